"""The control protocol over the daemon's WebSocket endpoint (`mlxcel-top --url`).

`RemoteControlClient` is a `ControlClient` whose messages are WebSocket text frames on
`ws://HOST:PORT/v1/control` instead of lines on the Unix socket: the same calls, replies and
events, so the console above it does not know the difference. The key goes in the
`Authorization` header; the daemon answers `hello` with `access` "full" or "read-only".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.control_client import ControlClient, NotConnected
from mlxcel.shared.protocol import MAX_LINE_BYTES

CONTROL_PATH = "/v1/control"
HEARTBEAT_S = 20.0


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://", "ws://", "wss://"))


def control_url(url: str) -> str:
    """`http://host:8080` (or ws://, with or without the path) → `ws://host:8080/v1/control`."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    if not path.endswith(CONTROL_PATH):
        path += CONTROL_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


class RemoteControlClient(ControlClient):
    CLOSED = "the daemon closed the connection"

    def __init__(self, url: str, api_key: str | None = None) -> None:
        super().__init__(url)
        self.url = control_url(url)
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse[bool] | None = None

    @property
    def connected(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def connect(self, timeout: float = 5.0) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._session = aiohttp.ClientSession()
        try:
            self._ws = await asyncio.wait_for(
                self._session.ws_connect(
                    self.url,
                    headers=headers,
                    heartbeat=HEARTBEAT_S,
                    max_msg_size=MAX_LINE_BYTES * 64,
                ),
                timeout,
            )
        except aiohttp.WSServerHandshakeError as exc:
            await self.close()
            if exc.status == 401:
                why = "wrong API key" if self.api_key else "an API key is needed (--api-key)"
                raise NotConnected(f"{self.url} refused the console: {why}") from exc
            raise NotConnected(f"{self.url} answered HTTP {exc.status}: {exc.message}") from exc
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            await self.close()
            raise NotConnected(f"cannot connect to {self.url}: {exc!r}") from exc
        except BaseException:  # cancelled (the console quits while connecting): leave nothing open
            await self.close()
            raise
        self._read_task = asyncio.create_task(self._read_loop())
        self.hello = await self.call("hello", {"protocol": PROTOCOL_VERSION}, timeout=timeout)
        return self.hello

    async def close(self) -> None:
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(BaseException):
                await self._read_task
        if self._session is not None:
            await self._session.close()
        self._ws = None
        self._session = None
        self._fail_pending(NotConnected("connection closed"))

    async def _send(self, line: bytes) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            raise NotConnected("not connected")
        try:
            await ws.send_str(line.decode())
        except aiohttp.ClientError as exc:
            raise NotConnected(str(exc)) from exc

    async def _frames(self) -> AsyncIterator[bytes]:
        """The daemon's text frames until it closes (any other frame ends the connection)."""
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    return
                yield msg.data.encode()
        except aiohttp.ClientError as exc:
            raise NotConnected(str(exc)) from exc
