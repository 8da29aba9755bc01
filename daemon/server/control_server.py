"""The control API (docs/api.md, "Control API"): newline-delimited JSON on a Unix socket.

One task per connection reads requests and answers them in order; a subscribed connection
has a second task that pushes events. A slow subscriber never slows the engine: snapshots
are taken fresh when it can be written to (stale ones are simply never built), discrete
events wait in a bounded per-connection backlog, and a peer that stops reading for
WRITE_TIMEOUT_S is disconnected.

Why one module: the control API's dispatch table and a handler per protocol method, side by
side, so `test_every_protocol_method_has_a_handler` and a reader see every method in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from mlxcel.daemon.process.lifecycle import prepare_socket, private_umask
from mlxcel.daemon.server.log_stream import RING_LINES, LogHub, parse_level
from mlxcel.daemon.server.peercred import peer_uid
from mlxcel.daemon.server.request_info import request_info
from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.protocol import (
    E_INTERNAL,
    E_METHOD,
    E_PARAMS,
    E_VERSION,
    EV_LOG,
    EV_SNAPSHOT,
    M_CACHE_RESET,
    M_CONFIG_GET,
    M_CONFIG_SAVE,
    M_CONFIG_SET,
    M_HELLO,
    M_HISTORY,
    M_LOGS_SUBSCRIBE,
    M_LOGS_UNSUBSCRIBE,
    M_MODEL_LIST,
    M_MODEL_LOAD,
    M_MODEL_PIN,
    M_MODEL_UNLOAD,
    M_MODEL_UNPIN,
    M_REQUEST_CANCEL,
    M_REQUEST_INFO,
    M_SHUTDOWN,
    M_STATUS,
    M_SUBSCRIBE,
    M_UNSUBSCRIBE,
    MAX_LINE_BYTES,
    Event,
    ProtocolError,
    Reply,
    Request,
    decode_request,
    encode,
    error_reply,
)

if TYPE_CHECKING:
    from mlxcel.daemon.server.history import CoarseHistory

log = logging.getLogger("mlxcel.control")

E_PERMISSION = "permission_denied"
MIN_INTERVAL_MS = 20
MAX_INTERVAL_MS = 60_000
EVENT_BACKLOG = 512
WRITE_HIGH_WATER = 256 * 1024
WRITE_TIMEOUT_S = 30.0
REFUSAL_LINGER_S = 1.0
# What a read-only peer (a remote console with a read-only key) may call: it watches.
READ_ONLY_METHODS = frozenset(
    {
        M_HELLO,
        M_STATUS,
        M_CONFIG_GET,
        M_SUBSCRIBE,
        M_UNSUBSCRIBE,
        M_LOGS_SUBSCRIBE,
        M_LOGS_UNSUBSCRIBE,
        M_MODEL_LIST,
        M_HISTORY,
        M_REQUEST_INFO,
    }
)


class ControlTarget(Protocol):
    """What the control server drives (the daemon runtime)."""

    def hello(self) -> dict[str, Any]: ...
    def snapshot_dict(self) -> dict[str, Any]: ...
    def config_dict(self) -> dict[str, Any]: ...
    async def set_config(self, values: dict[str, Any]) -> dict[str, Any]: ...
    async def save_config(self) -> dict[str, Any]: ...
    async def reset_cache(self, tier: str = "all") -> dict[str, Any]: ...
    async def cancel_request(self, request_id: str, by: str) -> dict[str, Any]: ...
    def request_shutdown(self, drain: bool, timeout: float | None) -> None: ...
    async def models(self) -> dict[str, Any]: ...
    async def load_model(self, name: str) -> dict[str, Any]: ...
    async def unload_model(self, name: str | None) -> dict[str, Any]: ...
    async def pin_model(self, name: str) -> dict[str, Any]: ...
    async def unpin_model(self, name: str) -> dict[str, Any]: ...


class InvalidParams(ValueError):
    pass


_logged_encode_failures: set[str] = set()  # what encode_message has warned about once


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON has no such number)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def encode_message(message: Reply | Event) -> bytes | None:
    """The line that carries `message`, never an exception: a value JSON has no number for
    (NaN, an infinity) goes as null; a value it cannot hold at all (an object) turns a reply
    into an `internal_error` reply with the request's id, and drops an event (None). Either is
    logged once per event name (replies: once)."""
    try:
        return encode(message)
    except (ValueError, TypeError, RecursionError) as exc:
        failure: Exception = exc
    what = "reply" if isinstance(message, Reply) else f"event {message.event}"
    line: bytes | None = None
    if isinstance(failure, ValueError):  # out-of-range floats: send them as null
        try:
            if isinstance(message, Reply):
                line = encode(Reply(message.id, _finite(message.result), message.error))
            else:
                line = encode(Event(message.event, _finite(message.data)))
        except (ValueError, TypeError, RecursionError) as exc:
            failure = exc
    if what not in _logged_encode_failures:
        _logged_encode_failures.add(what)
        done = "sent with null in their place" if line is not None else "not sent"
        log.warning("a control %s held values JSON cannot carry (%s): %s", what, failure, done)
    if line is not None:
        return line
    if isinstance(message, Reply):
        reason = f"the reply could not be encoded: {type(failure).__name__}: {failure}"
        return encode(error_reply(message.id, E_INTERNAL, reason[:500]))
    return None


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.events: deque[Event] = deque(maxlen=EVENT_BACKLOG)
        self.wake = asyncio.Event()
        self.interval_s: float | None = None
        self.pusher: asyncio.Task[None] | None = None
        self.log_level: int | None = None  # logs.subscribe: lines at or above are pushed
        self.access = "full"  # "read-only": only READ_ONLY_METHODS (a remote read-only key)
        self._write_lock = asyncio.Lock()

    def close(self) -> None:
        self.writer.close()

    def peer_text(self) -> str:
        """Who is at the other end, for the event log: " (pid N)" on Linux."""
        return _peer_pid_text(self)

    @property
    def wants_pushes(self) -> bool:
        return self.interval_s is not None or self.log_level is not None

    def push_log(self, line: dict[str, Any]) -> None:
        """One log line (loop thread); the bounded backlog drops the oldest for a slow peer."""
        self.events.append(Event(EV_LOG, line))
        self.wake.set()

    async def send(self, message: Reply | Event) -> None:
        line = encode_message(message)
        if line is None:
            return
        async with self._write_lock:
            self.writer.write(line)
            if self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                await asyncio.wait_for(self.writer.drain(), WRITE_TIMEOUT_S)

    def push(self, event: Event) -> None:
        if self.interval_s is not None:
            self.events.append(event)
            self.wake.set()

    def stop_pushing(self) -> None:
        self.interval_s = None
        if self.pusher is not None:
            self.pusher.cancel()
            self.pusher = None


class ControlServer:
    def __init__(self, target: ControlTarget, path: Path, logs: LogHub | None = None) -> None:
        self.target = target
        self.path = path
        self.logs = logs
        self.history: CoarseHistory | None = None  # for `history`
        self.uid = os.getuid()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        prepare_socket(self.path)
        with private_umask():  # born 0600: no moment between bind and chmod with wider bits
            self._server = await asyncio.start_unix_server(
                self._on_connect, path=str(self.path), limit=MAX_LINE_BYTES
            )
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.stop_pushing()
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def broadcast(self, name: str, data: dict[str, Any]) -> None:
        """Queue a discrete event for every subscriber (called on the loop thread)."""
        event = Event(name, data)
        for conn in self._connections:
            conn.push(event)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Connection(writer)
        try:
            if not await self._peer_allowed(conn, reader):
                return
            self._connections.add(conn)
            await self._serve(conn, reader)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        except asyncio.CancelledError:
            # close(): the daemon stops, and this connection with it. Not re-raised: asyncio's
            # unix server (3.11) logs a connection task that ends cancelled as an error.
            pass
        finally:
            self._connections.discard(conn)
            self._tasks.discard(task)
            if self.logs is not None:
                self.logs.unsubscribe(id(conn))
            conn.stop_pushing()
            writer.close()

    async def _peer_allowed(self, conn: _Connection, reader: asyncio.StreamReader) -> bool:
        sock = conn.writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        if uid is None or uid == self.uid:
            return True
        log.warning("refused a control connection from uid %s", uid)
        await conn.send(error_reply(None, E_PERMISSION, "peer uid differs from the daemon's"))
        # Half-close and swallow what the peer sent, so it reads the reason, not a reset.
        with contextlib.suppress(Exception):
            conn.writer.write_eof()
            await asyncio.wait_for(reader.read(MAX_LINE_BYTES), REFUSAL_LINGER_S)
        return False

    async def _serve(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # over the stream limit: the line is too long
                log.warning("closing a control connection: line over %d bytes", MAX_LINE_BYTES)
                return
            if not line:
                return
            if not line.strip():
                continue
            await conn.send(await self._answer(conn, line))

    async def serve_remote(self, conn: _Connection, lines: AsyncIterator[bytes]) -> None:
        """Answer a connection that is not on the socket (the WebSocket endpoint): the same
        methods, events and pushes; `conn.access` limits what it may call."""
        self._connections.add(conn)
        try:
            async for line in lines:
                if line.strip():
                    await conn.send(await self._answer(conn, line))
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            self._connections.discard(conn)
            if self.logs is not None:
                self.logs.unsubscribe(id(conn))
            conn.stop_pushing()

    async def _answer(self, conn: _Connection, line: bytes) -> Reply:
        try:
            request = decode_request(line)
        except ProtocolError as exc:
            return error_reply(exc.req_id, exc.code, exc.message)
        try:
            result = await self._dispatch(conn, request)
        except InvalidParams as exc:
            return error_reply(request.id, E_PARAMS, str(exc))
        except ProtocolError as exc:
            return error_reply(request.id, exc.code, exc.message)
        except Exception as exc:
            log.exception("control method %s failed", request.method)
            return error_reply(request.id, E_INTERNAL, f"{type(exc).__name__}: {exc}")
        return Reply(request.id, result=result)

    async def _dispatch(self, conn: _Connection, req: Request) -> Any:
        if conn.access != "full" and req.method not in READ_ONLY_METHODS:
            raise ProtocolError(E_PERMISSION, f"{req.method} needs a full key (this one reads)")
        handler = HANDLERS.get(req.method)
        if handler is None:  # decode_request refuses a name outside METHODS first
            raise ProtocolError(E_METHOD, f"unknown method {req.method!r}", req.id)
        return await handler(self, conn, req.params)

    # --- the methods, one each (HANDLERS, below the class, maps the names to them) ---

    async def _m_hello(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return {**self._hello(params), "access": conn.access}

    async def _m_status(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return self.target.snapshot_dict()

    async def _m_config_get(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return self.target.config_dict()

    async def _m_config_set(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.set_config(_config_values(params))

    async def _m_config_save(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.save_config()

    async def _m_cache_reset(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.reset_cache(str(params.get("tier", "all")))

    async def _m_request_cancel(self, conn: _Connection, params: dict[str, Any]) -> Any:
        request_id, by = _cancel_params(params)
        return await self.target.cancel_request(request_id, f"{by}{conn.peer_text()}")

    async def _m_request_info(self, conn: _Connection, params: dict[str, Any]) -> Any:
        request_id, _ = _cancel_params(params)
        return request_info(getattr(self.target, "host", None), request_id)

    async def _m_model_list(self, conn: _Connection, params: dict[str, Any]) -> Any:
        _model_name(params)
        return await self.target.models()

    async def _m_model_load(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.load_model(_model_name(params, required=True))

    async def _m_model_unload(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.unload_model(_model_name(params))

    async def _m_model_pin(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.pin_model(_model_name(params, required=True))

    async def _m_model_unpin(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return await self.target.unpin_model(_model_name(params, required=True))

    async def _m_subscribe(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return self._subscribe(conn, params)

    async def _m_unsubscribe(self, conn: _Connection, params: dict[str, Any]) -> Any:
        if conn.log_level is None:
            conn.stop_pushing()
        conn.interval_s = None  # a pusher still sending log lines sends no snapshots
        return {"subscribed": False}

    async def _m_history(self, conn: _Connection, params: dict[str, Any]) -> Any:
        if self.history is None:
            raise ProtocolError(E_METHOD, "this daemon keeps no history")
        return self.history.to_dict()

    async def _m_logs_subscribe(self, conn: _Connection, params: dict[str, Any]) -> Any:
        return self._logs_subscribe(conn, params)

    async def _m_logs_unsubscribe(self, conn: _Connection, params: dict[str, Any]) -> Any:
        if self.logs is not None:
            self.logs.unsubscribe(id(conn))
        conn.log_level = None
        conn.wake.set()  # a log-only pusher ends
        return {"subscribed": False}

    async def _m_shutdown(self, conn: _Connection, params: dict[str, Any]) -> Any:
        drain, timeout = _shutdown_params(params)
        self.target.request_shutdown(drain, timeout)
        return {"shutting_down": True, "drain": drain}

    def _hello(self, params: dict[str, Any]) -> dict[str, Any]:
        version = params.get("protocol", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                E_VERSION,
                f"protocol {version!r} is not supported (daemon speaks {PROTOCOL_VERSION})",
            )
        return self.target.hello()

    def _subscribe(self, conn: _Connection, params: dict[str, Any]) -> dict[str, Any]:
        interval = params.get("interval_ms", 500)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise InvalidParams("interval_ms must be a number")
        if not MIN_INTERVAL_MS <= interval <= MAX_INTERVAL_MS:
            raise InvalidParams(f"interval_ms must be in [{MIN_INTERVAL_MS}, {MAX_INTERVAL_MS}]")
        conn.stop_pushing()
        conn.interval_s = interval / 1000
        conn.pusher = asyncio.create_task(self._push_loop(conn))
        return {"subscribed": True, "interval_ms": interval}

    def _logs_subscribe(self, conn: _Connection, params: dict[str, Any]) -> dict[str, Any]:
        """Follow the daemon's log: the recent lines at or above `level` come in the reply
        (at most `backlog`), newer ones as `log` events."""
        if self.logs is None:
            raise ProtocolError(E_METHOD, "this daemon does not stream its log")
        try:
            level = parse_level(params.get("level", "info"))
        except ValueError as exc:
            raise InvalidParams(str(exc)) from None
        backlog = params.get("backlog", RING_LINES)
        if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 0:
            raise InvalidParams("backlog must be an integer >= 0")
        lines = self.logs.recent(level, min(backlog, RING_LINES))
        conn.log_level = level
        self.logs.subscribe(id(conn), level, conn.push_log)
        if conn.pusher is None or conn.pusher.done():
            conn.pusher = asyncio.create_task(self._push_loop(conn))
        return {"subscribed": True, "level": params.get("level", "info").lower(), "lines": lines}

    async def _push_loop(self, conn: _Connection) -> None:
        next_snapshot = time.monotonic()
        try:
            while conn.wants_pushes:
                delay = None if conn.interval_s is None else next_snapshot - time.monotonic()
                if (delay is None or delay > 0) and not conn.events:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(conn.wake.wait(), delay)
                conn.wake.clear()
                while conn.events:
                    await conn.send(conn.events.popleft())
                if conn.interval_s is not None and time.monotonic() >= next_snapshot:
                    await conn.send(Event(EV_SNAPSHOT, self.target.snapshot_dict()))
                    next_snapshot = time.monotonic() + conn.interval_s
        except (ConnectionError, asyncio.TimeoutError):
            conn.close()


# A control method's handler: (server, connection, params) -> the reply's result.
Handler = Callable[[ControlServer, _Connection, dict[str, Any]], Awaitable[Any]]

# Every method of the protocol (`METHODS`, shared/protocol.py) and its handler;
# tests/integration/test_control_socket.py checks that none is missing.
HANDLERS: dict[str, Handler] = {
    M_HELLO: ControlServer._m_hello,
    M_STATUS: ControlServer._m_status,
    M_CONFIG_GET: ControlServer._m_config_get,
    M_CONFIG_SET: ControlServer._m_config_set,
    M_CONFIG_SAVE: ControlServer._m_config_save,
    M_CACHE_RESET: ControlServer._m_cache_reset,
    M_REQUEST_CANCEL: ControlServer._m_request_cancel,
    M_REQUEST_INFO: ControlServer._m_request_info,
    M_MODEL_LIST: ControlServer._m_model_list,
    M_MODEL_LOAD: ControlServer._m_model_load,
    M_MODEL_UNLOAD: ControlServer._m_model_unload,
    M_MODEL_PIN: ControlServer._m_model_pin,
    M_MODEL_UNPIN: ControlServer._m_model_unpin,
    M_LOGS_SUBSCRIBE: ControlServer._m_logs_subscribe,
    M_LOGS_UNSUBSCRIBE: ControlServer._m_logs_unsubscribe,
    M_HISTORY: ControlServer._m_history,
    M_SUBSCRIBE: ControlServer._m_subscribe,
    M_UNSUBSCRIBE: ControlServer._m_unsubscribe,
    M_SHUTDOWN: ControlServer._m_shutdown,
}


@overload
def _model_name(params: dict[str, Any], required: Literal[True]) -> str: ...
@overload
def _model_name(params: dict[str, Any], required: bool = False) -> str | None: ...
def _model_name(params: dict[str, Any], required: bool = False) -> str | None:
    """The `name` of a model.* method (docs/models.md): a non-empty string, or None when it
    may be left out."""
    name = params.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise InvalidParams("name must be a non-empty string")
    if name is None and required:
        raise InvalidParams("name is required")
    return name


def _config_values(params: dict[str, Any]) -> dict[str, Any]:
    """`{"values": {...}}`, `{"key": k, "value": v}` or flat `{k: v}`."""
    if "values" in params:
        values = params["values"]
        if not isinstance(values, dict):
            raise InvalidParams("values must be an object")
    elif "key" in params:
        if not isinstance(params["key"], str) or "value" not in params:
            raise InvalidParams("key must be a string and value must be given")
        values = {params["key"]: params["value"]}
    else:
        values = dict(params)
    if not values:
        raise InvalidParams("no values to set")
    return values


def _shutdown_params(params: dict[str, Any]) -> tuple[bool, float | None]:
    drain = params.get("drain", True)
    timeout = params.get("timeout")
    if not isinstance(drain, bool):
        raise InvalidParams("drain must be a boolean")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
    ):
        raise InvalidParams("timeout must be a number of seconds >= 0")
    return drain, None if timeout is None else float(timeout)


MAX_BY_CHARS = 64


def _cancel_params(params: dict[str, Any]) -> tuple[str, str]:
    """`{"request_id": "...", "by": "mlxcel-top"}`; `by` (optional) names the caller."""
    request_id = params.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidParams("request_id must be a non-empty string")
    by = params.get("by", "control socket")
    if not isinstance(by, str) or not by.strip() or len(by) > MAX_BY_CHARS:
        raise InvalidParams(f"by must be a non-empty string of at most {MAX_BY_CHARS} characters")
    return request_id, by.strip()


def _peer_pid_text(conn: _Connection) -> str:
    """ " (pid N)" for the peer on Linux (SO_PEERCRED); "" where it cannot be told."""
    sock = conn.writer.get_extra_info("socket")
    if sock is None or not sys.platform.startswith("linux"):
        return ""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_PEERCRED", 17), 12)
        pid = struct.unpack("3i", raw)[0]
    except (OSError, struct.error):
        return ""
    return f" (pid {pid})"
