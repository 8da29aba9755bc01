"""The console's connection to the daemon: connect, subscribe, forward, reconnect.

`DaemonLink.run()` runs as a Textual worker. It never touches widgets: everything it
learns goes to the App as a message (see messages.py), and the App changes state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.control_client import ControlClient, ControlError, NotConnected
from mlxcel.shared.protocol import E_VERSION, EV_LOG, EV_SNAPSHOT
from mlxcel.shared.snapshot import Snapshot
from textual.message import Message

from .messages import (
    ConnectAttemptFailed,
    ConnectionLost,
    ConnectionMade,
    DaemonEventReceived,
    LogLinesReceived,
    ProtocolMismatched,
    SnapshotReceived,
)
from .remote import RemoteControlClient, is_url

RETRY_S = 1.0
MISMATCH_RETRY_S = 5.0  # a daemon of another version is rarely swapped within a second
CONNECT_TIMEOUT_S = 3.0
LOG_BACKLOG = 500  # recent daemon log lines asked for on each (re)connect


class VersionMismatch(RuntimeError):
    pass


def mismatch_message(daemon_protocol: Any, daemon_version: Any = None) -> str:
    version = f" (mlxcel {daemon_version})" if daemon_version else ""
    return (
        f"the daemon{version} speaks control protocol {daemon_protocol}, this console "
        f"speaks {PROTOCOL_VERSION}: install the same mlxcel version for both"
    )


def check_hello(hello: dict[str, Any]) -> None:
    """Raise VersionMismatch when the daemon speaks another protocol version."""
    protocol = hello.get("protocol")
    if protocol != PROTOCOL_VERSION:
        raise VersionMismatch(mismatch_message(protocol, hello.get("version")))


async def open_client(
    target: str, timeout: float = CONNECT_TIMEOUT_S, api_key: str | None = None
) -> ControlClient:
    """Connect to a socket path or an http:// URL (the daemon's WebSocket endpoint) and check
    the protocol; raises NotConnected or VersionMismatch."""
    client = RemoteControlClient(target, api_key) if is_url(target) else ControlClient(target)
    try:
        check_hello(await client.connect(timeout=timeout))
    except ControlError as exc:
        await client.close()
        if exc.code == E_VERSION:
            raise VersionMismatch(exc.message) from exc
        raise NotConnected(f"daemon refused hello: {exc.message}") from exc
    except (VersionMismatch, NotConnected):
        await client.close()
        raise
    except (asyncio.TimeoutError, OSError) as exc:
        await client.close()
        raise NotConnected(f"no answer from {target}: {exc!r}") from exc
    return client


class DaemonLink:
    """Keeps one subscribed connection alive and posts what it hears."""

    def __init__(
        self,
        socket_path: str,
        interval_ms: int,
        post: Callable[[Message], object],
        clock: Callable[[], float] = time.time,
        retry_s: float = RETRY_S,
        api_key: str | None = None,
    ) -> None:
        self.socket_path = socket_path  # or the daemon's http:// URL
        self.api_key = api_key
        self.interval_ms = interval_ms
        self._post = post
        self._clock = clock
        self._retry_s = retry_s
        self._client: ControlClient | None = None

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """One control call on the live connection; raises NotConnected or ControlError."""
        client = self._client
        if client is None or not client.connected:
            raise NotConnected("not connected to the daemon")
        return await client.call(method, params, timeout=10.0)

    async def set_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """`config.set`; the reply holds one ConfigChange per key and the effective config."""
        # The daemon takes {"values": {...}} (its own CLI's form; flat keys work too).
        result = await self.call("config.set", {"values": changes})
        return result if isinstance(result, dict) else {}

    async def run(self) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                self._client = await open_client(self.socket_path, api_key=self.api_key)
            except VersionMismatch as exc:
                self._post(ProtocolMismatched(str(exc)))
                await asyncio.sleep(MISMATCH_RETRY_S)
                continue
            except NotConnected as exc:
                self._post(ConnectAttemptFailed(str(exc), attempt))
                await asyncio.sleep(self._retry_s)
                continue
            attempt = 0
            reason = await self._serve(self._client)
            self._client = None
            self._post(ConnectionLost(reason))
            await asyncio.sleep(self._retry_s)

    async def _serve(self, client: ControlClient) -> str:
        """Subscribe and forward events until the connection ends; returns why it ended."""
        try:
            self._post(ConnectionMade(dict(client.hello)))
            self._forward_snapshot(await client.call("status", timeout=10.0))
            await client.call("subscribe", {"interval_ms": self.interval_ms}, timeout=10.0)
            await self._follow_log(client)
            async for event in client.events():
                if event.event == EV_SNAPSHOT:
                    self._forward_snapshot(event.data)
                elif event.event == EV_LOG:
                    self._post(LogLinesReceived([event.data]))
                else:
                    self._post(DaemonEventReceived(event.event, event.data))
            return "the daemon closed the connection"
        except (NotConnected, ControlError, asyncio.TimeoutError, OSError) as exc:
            return str(exc) or type(exc).__name__
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    async def _follow_log(self, client: ControlClient) -> None:
        """Every line the daemon keeps (the console filters by level itself)."""
        if "logs.subscribe" not in client.hello.get("methods", ()):
            return
        params = {"level": "debug", "backlog": LOG_BACKLOG}
        reply = await client.call("logs.subscribe", params, timeout=10.0)
        lines = reply.get("lines") if isinstance(reply, dict) else None
        self._post(LogLinesReceived(list(lines) if isinstance(lines, list) else [], replace=True))

    def _forward_snapshot(self, data: Any) -> None:
        try:
            snapshot = Snapshot.from_dict(data)
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            self._post(DaemonEventReceived("bad_snapshot", {"message": repr(exc)}))
            return
        self._post(SnapshotReceived(snapshot, self._clock()))
