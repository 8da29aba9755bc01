"""The HTTP access log (docs/api.md): one line per request, at INFO on `mlxcel.http.access`.

`METHOD /path STATUS DURATION ms` (the path as sent, without its query string, cut at 200
characters), plus `code=...` for a 4xx/5xx whose answer carries a stable error code. A stream
is logged when it ends, with its whole duration. `/health` and `/metrics` polls go at DEBUG,
so a console or Prometheus polling does not flood daemon.log. Bodies, headers, query strings
and keys are never logged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("mlxcel.http.access")

# The error code an error response carries (http_app.error_response sets it): the Anthropic
# and Ollama envelopes have no `code` field of their own.
ERROR_CODE = web.ResponseKey("mlxcel_error_code", str)
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled: DEBUG
MAX_PATH_CHARS = 200
MAX_ERROR_BODY = 64 * 1024  # an OpenAI envelope bigger than this is not parsed for its code

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_code(response: web.StreamResponse) -> str | None:
    """The stable code of an error answer: the one error_response recorded, else the
    OpenAI envelope's `error.code` (a response built elsewhere)."""
    code = response.get(ERROR_CODE)
    if isinstance(code, str):
        return code
    body = getattr(response, "body", None)
    if not isinstance(body, bytes) or len(body) > MAX_ERROR_BODY:
        return None
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    value = error.get("code") if isinstance(error, dict) else None
    return value if isinstance(value, str) else None


def _path(request: web.Request) -> str:
    path = request.rel_url.raw_path  # as sent (percent-encoded: no newline can forge a line)
    return path if len(path) <= MAX_PATH_CHARS else path[:MAX_PATH_CHARS] + "..."


def access_line(request: web.Request, status: int | str, elapsed_s: float, code: str | None) -> str:
    line = f"{request.method} {_path(request)} {status} {elapsed_s * 1000:.1f} ms"
    return f"{line} code={code}" if code else line


@web.middleware
async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: it sees every answer, error envelopes included. A streamed
    answer's handler returns once its stream ended, so its line comes then."""
    started = time.monotonic()
    level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # one that no inner middleware turned into an envelope
        if log.isEnabledFor(level):
            log.log(level, access_line(request, exc.status, time.monotonic() - started, None))
        raise
    except BaseException as exc:  # the client left (cancelled) or a bug (aiohttp answers 500)
        status = 500 if isinstance(exc, Exception) else "cancelled"
        log.log(level, access_line(request, status, time.monotonic() - started, None))
        raise
    if log.isEnabledFor(level):
        status = response.status
        code = error_code(response) if status >= 400 else None
        log.log(level, access_line(request, status, time.monotonic() - started, code))
    return response
