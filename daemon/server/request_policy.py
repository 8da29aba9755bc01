"""A request's priority lane and timeout from its headers (docs/api.md, "Priority and timeouts").

`X-Priority: high|normal|low` (or vLLM's integer: lower is served earlier) and `X-Timeout:
SECONDS` apply to every generation endpoint (OpenAI, Anthropic, Responses, Ollama): the
middleware parses them once, refuses a bad value with a 400, and keeps them in a context
variable of the handler's task; `build_request` reads them. A body's `priority` / `timeout`
field wins over the header, and the header over the lane of the API key the request came with
(`--api-keys-file`; the auth middleware puts it in the request as `KEY_LANE`).

`X-Speculative: off|on` is the same for speculative decoding (docs/api.md, "Speculative
decoding"): `off` opts the request out; a body's `speculative` field wins over it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

from aiohttp import web
from mlxcel.daemon.engine.lanes import parse_lane, parse_timeout
from mlxcel.daemon.server.errors import bad_request

PRIORITY_HEADER = "X-Priority"
TIMEOUT_HEADER = "X-Timeout"
SPECULATIVE_HEADER = "X-Speculative"
SWITCH_WORDS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
# the request's API key's default lane (--api-keys-file)
KEY_LANE: Any = (
    web.RequestKey("mlxcel_key_lane", str)
    if hasattr(web, "RequestKey")  # aiohttp >= 3.13; a plain key before
    else "mlxcel_key_lane"
)
T = TypeVar("T")

# (lane, timeout seconds) from the headers, or the key's lane, of the request this task serves
_HEADERS: ContextVar[tuple[str | None, float | None]] = ContextVar(
    "mlxcel_request_policy", default=(None, None)
)
# X-Speculative of the request this task serves (None: not given)
_SPECULATIVE: ContextVar[bool | None] = ContextVar("mlxcel_request_speculative", default=None)


def parse_switch(text: str) -> bool:
    """`on` / `off` (also `true` / `false`, `1` / `0`; any case) -> bool; ValueError else."""
    value = SWITCH_WORDS.get(text.strip().lower())
    if value is None:
        raise ValueError(f"must be on or off, got {text[:40]!r}")
    return value


def header_policy(request: web.Request) -> tuple[str | None, float | None]:
    """The lane and timeout the headers ask for (the lane: else the API key's; None: not
    given); 400 on a bad value."""
    return (
        _header(request, PRIORITY_HEADER, parse_lane) or request.get(KEY_LANE),
        _header(request, TIMEOUT_HEADER, parse_timeout),
    )


def _header(request: web.Request, name: str, parse: Callable[[str], T]) -> T | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        return parse(raw)
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", name) from None


@web.middleware
async def policy_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    policy = header_policy(request)
    switch = _header(request, SPECULATIVE_HEADER, parse_switch)  # both parsed before either is set
    token, speculative = _HEADERS.set(policy), _SPECULATIVE.set(switch)
    try:
        return await handler(request)
    finally:
        _SPECULATIVE.reset(speculative)
        _HEADERS.reset(token)


def request_policy(
    body_lane: str | None = None, body_timeout: float | None = None
) -> tuple[str, float | None]:
    """The lane (default normal) and timeout (None: the server's default) of the request this
    task serves: the body's fields, else the headers'."""
    header_lane, header_timeout = _HEADERS.get()
    lane = body_lane or header_lane or "normal"
    timeout = body_timeout if body_timeout is not None else header_timeout
    return lane, timeout


def request_speculative(body_speculative: bool | None = None) -> bool:
    """Whether the request this task serves may be decoded speculatively: the body's
    `speculative`, else the X-Speculative header's, else yes (where the server's
    --speculative is on)."""
    if body_speculative is not None:
        return body_speculative
    header = _SPECULATIVE.get()
    return True if header is None else header
