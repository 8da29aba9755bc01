"""An asyncio client of the control socket, used by the console and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.protocol import (
    EV_SNAPSHOT,
    MAX_LINE_BYTES,
    Event,
    ProtocolError,
    Reply,
    Request,
    decode_message,
    encode,
)


class ControlError(RuntimeError):
    """The daemon answered with an error (code and message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class NotConnected(ConnectionError):
    pass


class ControlClient:
    """One connection: call() methods and receive pushed events.

    Replies are matched to calls by id; events go to a bounded queue where only the
    newest snapshot is kept when the reader falls behind. A subclass over another transport
    (tui/remote.py: WebSocket frames) overrides `connected`, `_send` and `_frames`.
    """

    CLOSED = "daemon closed the connection"  # what pending calls fail with when it ends

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._pending: dict[Any, asyncio.Future[Any]] = {}
        self._events: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=256)
        self._read_task: asyncio.Task[None] | None = None
        self.hello: dict[str, Any] = {}

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self, timeout: float = 5.0) -> dict[str, Any]:
        if not Path(self.path).exists():
            raise NotConnected(f"no daemon socket at {self.path}")
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path, limit=MAX_LINE_BYTES * 64), timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise NotConnected(f"cannot connect to {self.path}: {exc}") from exc
        self._read_task = asyncio.create_task(self._read_loop())
        self.hello = await self.call("hello", {"protocol": PROTOCOL_VERSION}, timeout=timeout)
        return self.hello

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(BaseException):
                await self._read_task
        self._writer = None
        self._fail_pending(NotConnected("connection closed"))

    async def __aenter__(self) -> ControlClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(
        self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0
    ) -> Any:
        if not self.connected:
            raise NotConnected("not connected")
        req_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            await self._send(encode(Request(req_id, method, params or {})))
            return await asyncio.wait_for(fut, timeout)
        except ConnectionError as exc:  # BrokenPipeError and NotConnected too
            raise NotConnected(str(exc)) from exc
        finally:
            self._pending.pop(req_id, None)

    async def _send(self, line: bytes) -> None:
        """One encoded message (a line) to the daemon."""
        if self._writer is None:
            raise NotConnected("not connected")
        self._writer.write(line)
        await self._writer.drain()

    async def _frames(self) -> AsyncIterator[bytes]:
        """The daemon's messages, one line each, until it closes (the socket closed after)."""
        assert self._reader is not None
        try:
            while line := await self._reader.readline():
                yield line
        finally:
            if self._writer is not None:
                self._writer.close()

    async def events(self) -> AsyncIterator[Event]:
        """Pushed events until the connection closes."""
        while True:
            ev = await self._events.get()
            if ev is None:
                return
            yield ev

    async def next_event(self, timeout: float | None = None) -> Event | None:
        """The next pushed event, or None when the connection closed."""
        return await asyncio.wait_for(self._events.get(), timeout)

    async def _read_loop(self) -> None:
        """Replies to their calls, events to the queue (an unreadable message is skipped);
        when the connection ends, pending calls fail and the event stream ends (None)."""
        try:
            async for raw in self._frames():
                try:
                    msg = decode_message(raw)
                except ProtocolError:
                    continue
                if isinstance(msg, Reply):
                    self._resolve(msg)
                else:
                    self._push_event(msg)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._fail_pending(NotConnected(self.CLOSED))
            self._push_event(None)

    def _resolve(self, reply: Reply) -> None:
        fut = self._pending.get(reply.id)
        if fut is None or fut.done():
            return
        if reply.error is not None:
            err = reply.error if isinstance(reply.error, dict) else {}
            fut.set_exception(
                ControlError(str(err.get("code", "error")), str(err.get("message", reply.error)))
            )
        else:
            fut.set_result(reply.result)

    def _push_event(self, ev: Event | None) -> None:
        if self._events.full():
            # Full: drop every queued snapshot (the one arriving is newer) and, if that is not
            # room enough, the oldest other events; a slow reader gets the newest snapshot.
            kept = [e for e in _drain(self._events) if e is None or e.event != EV_SNAPSHOT]
            for e in kept[-(self._events.maxsize - 1) :]:
                self._events.put_nowait(e)
        self._events.put_nowait(ev)

    def _fail_pending(self, exc: Exception) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)


def _drain(q: asyncio.Queue[Event | None]) -> list[Event | None]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items
