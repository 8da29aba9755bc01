"""Streamed writes with a deadline: a client that stops reading cannot keep its request.

aiohttp's `StreamResponse.write` waits (drain) while the connection's send buffer is full,
that is while the client reads nothing: forever for a client that stopped reading without
closing its socket. Its handler would keep the engine request (slot, KV) after generation
ended, and its model lease, so an unload or a model switch would wait for it.

Every streamed write of every dialect (OpenAI SSE, Anthropic SSE, Ollama NDJSON) goes
through `write_or_drop`, which bounds that wait by `stream_timeout` (docs/configuration.md,
`--stream-timeout`, default 60 s). Past it the connection is aborted (not closed: a close
waits to flush its buffer to the client that does not read) and `ClientStalled`, a
`ConnectionResetError` like any client that left, reaches the handler: it returns, its
`finally` aborts the engine request (slot and KV freed at once) and the model lease is
released. One INFO line says which request and after how long.

A client that reads slowly but reads is never cut: the deadline restarts with every write.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

log = logging.getLogger("mlxcel.http")

# Used when the daemon's runtime does not say (ServingConfig.stream_timeout's default).
DEFAULT_STREAM_TIMEOUT_S = 60.0


class ClientStalled(ConnectionResetError):
    """The client read nothing for `stream_timeout` seconds; its connection was cut."""


def stream_timeout(ctx: Any) -> float:
    """The stream deadline for a model context's requests: the daemon's `stream_timeout`
    (`DaemonRuntime.stream_timeout`), or the default."""
    value = getattr(getattr(ctx, "runtime", None), "stream_timeout", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return DEFAULT_STREAM_TIMEOUT_S


async def write_or_drop(
    request: web.Request,
    resp: web.StreamResponse,
    data: bytes,
    timeout: float,
    request_id: str = "",
    eof: bool = False,
) -> None:
    """`resp.write(data)` (or `write_eof(data)`), cut after `timeout` seconds without progress:
    then the connection is aborted and `ClientStalled` raised."""
    stalled = False

    def cut() -> None:
        nonlocal stalled
        stalled = True
        log.info(
            "client stopped reading: request %s took no data for %g s; stream cut, request aborted",
            request_id or request.path,
            timeout,
        )
        transport = request.transport
        if transport is not None:
            # Wakes the pending drain; the daemon's runner also cancels the handler on a lost
            # connection (handler_cancellation), so its `finally` may run from here directly.
            transport.abort()

    handle = asyncio.get_running_loop().call_later(timeout, cut)
    try:
        if eof:
            await resp.write_eof(data)
        else:
            await resp.write(data)
    except ConnectionError:
        if not stalled:
            raise
    finally:
        handle.cancel()
    if stalled:
        raise ClientStalled(f"the client read nothing for {timeout:g} s")


class StreamOut:
    """One streamed response's writes, each through `write_or_drop`."""

    def __init__(
        self, request: web.Request, resp: web.StreamResponse, request_id: str, timeout: float
    ) -> None:
        self.request = request
        self.resp = resp
        self.request_id = request_id
        self.timeout = timeout

    async def write(self, data: bytes) -> None:
        await write_or_drop(self.request, self.resp, data, self.timeout, self.request_id)

    async def write_eof(self) -> None:
        await write_or_drop(self.request, self.resp, b"", self.timeout, self.request_id, eof=True)
