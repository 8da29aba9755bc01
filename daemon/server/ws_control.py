"""The control protocol over a WebSocket on the HTTP server: `GET /v1/control`.

One text frame per message, each the same JSON object as a line on the Unix socket (requests,
replies, events: docs/api.md), answered by the same `ControlServer`. Who may connect:

- a peer presenting the daemon's `api_key` (`Authorization: Bearer KEY`) gets full access;
- a peer presenting `readonly_api_key` gets read-only access (it watches: `status`,
  `subscribe`, `logs.subscribe`, ...; a change gets `permission_denied`);
- with no key configured (the daemon then listens on loopback only), a loopback peer without a
  key gets read-only access (it cannot be told apart from another local user);
- anything else is refused with 401 before the WebSocket opens;
- a browser page (a handshake with an `Origin` header) is refused with 403 unless the operator
  allowed its origin (`allowed_origins`): WebSockets are not bound by CORS, so without this any
  page the user visits could watch a loopback daemon that has no key.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import WSMsgType, web
from mlxcel.daemon.server.control_server import (
    WRITE_TIMEOUT_S,
    ControlServer,
    _Connection,
    encode_message,
)
from mlxcel.daemon.server.errors import APIError
from mlxcel.daemon.server.guards import keys_match, origin_allowed
from mlxcel.shared.protocol import MAX_LINE_BYTES, Event, Reply

log = logging.getLogger("mlxcel.control")

PATH = "/v1/control"
HEARTBEAT_S = 20.0  # pings keep NATs open and find dead peers


class WsConnection(_Connection):
    """A control connection whose messages are WebSocket text frames."""

    def __init__(self, ws: web.WebSocketResponse, peer: str, access: str) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # no stream writer
        self.ws = ws
        self.peer = peer
        self.access = access
        self._closing: asyncio.Future[Any] | None = None

    async def send(self, message: Reply | Event) -> None:
        async with self._write_lock:
            line = encode_message(message)
            if line is not None:
                await asyncio.wait_for(self.ws.send_str(line.decode()), WRITE_TIMEOUT_S)

    def close(self) -> None:
        self._closing = asyncio.ensure_future(self.ws.close())

    def peer_text(self) -> str:
        return f" (remote {self.peer})"


def access_for(request: web.Request, api_key: str | None, readonly_key: str | None) -> str:
    """ "full" or "read-only" for this request's key; raises a 401 APIError when refused."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if token:
        if api_key and keys_match(token, api_key):
            return "full"
        if readonly_key and keys_match(token, readonly_key):
            return "read-only"
        raise APIError(401, "wrong API key", "authentication_error", "invalid_api_key")
    if not api_key and not readonly_key and _is_loopback(request.remote):
        return "read-only"
    raise APIError(
        401,
        "missing API key (send Authorization: Bearer <key>; a read-only key watches)",
        "authentication_error",
        "invalid_api_key",
    )


def refuse_foreign_page(request: web.Request, allowed: frozenset[str]) -> None:
    """A 403 APIError when a web page whose origin the operator did not allow opens the socket
    (consoles and scripts send no `Origin`)."""
    origin = request.headers.get("Origin")
    if origin is None or origin_allowed(origin, allowed):
        return
    raise APIError(
        403,
        f"origin {origin!r} may not open the control socket (allowed_origins)",
        "permission_error",
        "origin_not_allowed",
    )


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def make_handler(state_key: Any) -> Any:
    """The `/v1/control` handler; the app's ServingState (under `state_key`) holds the keys and,
    once the daemon is live, its ControlServer as `control`."""

    async def control_ws(request: web.Request) -> web.StreamResponse:
        state = request.app[state_key]
        refuse_foreign_page(request, getattr(state, "allowed_origins", frozenset()))
        access = access_for(request, state.api_key, getattr(state, "readonly_api_key", None))
        server: ControlServer | None = getattr(state, "control", None)
        if server is None or state.draining:
            raise APIError(503, "the daemon is not ready", "server_error", "not_ready")
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_LINE_BYTES)
        await ws.prepare(request)
        conn = WsConnection(ws, request.remote or "?", access)
        log.info("remote control connection from %s (%s)", conn.peer, access)
        await server.serve_remote(conn, _frames(ws))
        await ws.close()
        return ws

    return control_ws


async def _frames(ws: web.WebSocketResponse) -> AsyncIterator[bytes]:
    async for msg in ws:
        if msg.type is WSMsgType.TEXT:
            yield msg.data.encode()
        elif msg.type is WSMsgType.BINARY:
            yield bytes(msg.data)
        else:  # close, error
            return
