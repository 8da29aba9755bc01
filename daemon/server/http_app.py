"""The OpenAI-compatible HTTP API (docs/api.md): app factory, auth and error middleware, routes.

The listener starts before the model loads (`/health` answers 503 meanwhile); `ServingState`
gets its `ModelContext` once the engine runs. State lives on the Application under AppKeys.

Why one module: the aiohttp app: its factory, the middlewares every route passes (error
envelope, CORS, auth, leases) and the plain routes, which the dialect modules register into.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from mlxcel.daemon.server import (
    anthropic_api,
    embeddings_api,
    ollama_api,
    responses_api,
    ws_control,
)
from mlxcel.daemon.server.access_log import ERROR_CODE, access_log_middleware
from mlxcel.daemon.server.completions import IGNORED_FIELDS_KEY, handle_chat, handle_completion
from mlxcel.daemon.server.daemon_runtime import CACHE_TIERS
from mlxcel.daemon.server.errors import loads_finite
from mlxcel.daemon.server.guards import (
    HostAllowlist,
    header_list,
    keys_match,
    make_host_middleware,
    make_origin_middleware,
    origin_allowed,
    read_body,
)
from mlxcel.daemon.server.metrics import CONTENT_TYPE, DaemonMetrics
from mlxcel.daemon.server.openai_schema import API_SAMPLING, APIError, SamplingDefaults
from mlxcel.daemon.server.request_policy import KEY_LANE, policy_middleware
from mlxcel.daemon.server.stream_write import stream_timeout
from mlxcel.shared import __version__

if TYPE_CHECKING:
    from mlxcel.daemon.hosting.host import ModelHost
    from mlxcel.daemon.models.info import ModelInfo
    from mlxcel.daemon.server.control_server import ControlServer
    from mlxcel.daemon.server.daemon_runtime import DaemonRuntime
    from mlxcel.daemon.server.seams import RequestBridge

log = logging.getLogger("mlxcel.http")

CLIENT_MAX_SIZE = 8 * 1024 * 1024
RETRY_AFTER_LOADING_S = "5"
# "/" says only that the server runs (Claude Code and Ollama clients probe it, HEAD or GET);
# the WebSocket checks its own keys
PUBLIC_PATHS = frozenset({"/", "/health", ws_control.PATH})
IGNORED_FIELDS_HEADER = "X-Mlxcel-Ignored-Fields"


@dataclass
class ModelContext:
    """What the handlers need once the model is loaded and the engine runs."""

    name: str
    names: frozenset[str]  # accepted as `model` in requests
    tokenizer: Any
    vocab_size: int
    eos_ids: frozenset[int]
    skip_ids: frozenset[int]  # never rendered as text (eos and other special tokens)
    bridge: RequestBridge
    runtime: DaemonRuntime
    created: int
    info: ModelInfo | None = None


@dataclass
class ServingState:
    api_key: str | None
    metrics: DaemonMetrics
    strict_api: bool = False  # unknown request fields: 400 instead of ignored
    allowed_origins: frozenset[str] = frozenset()  # CORS; "*" allows any origin
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="mlxcel-tokenize")
    )
    host: ModelHost | None = None  # every model, the first included (hosting/host.py)
    draining: bool = False
    load_error: str | None = None
    readonly_api_key: str | None = None  # /v1/control: a key that only watches
    control: ControlServer | None = None  # for /v1/control, once the daemon is live
    # the Host header values answered (guards.HostAllowlist; the default: loopback only)
    hosts: HostAllowlist = field(default_factory=HostAllowlist)
    header_timeout: float = 30.0  # also the longest a request body may pause (read_json)
    # --api-keys-file: more API keys, each with its default priority lane (request_policy.py)
    key_lanes: dict[str, str] = field(default_factory=dict)
    # what a request that sets no temperature, top_p, top_k or min_p gets (--temperature, ...)
    sampling_defaults: SamplingDefaults = API_SAMPLING

    @property
    def model(self) -> ModelContext | None:
        """The primary model's context (requests that name no model): the host's, or None
        while none is loaded."""
        primary = None if self.host is None else self.host.primary
        return None if primary is None else primary.ctx


STATE = web.AppKey("serving_state", ServingState)
MAX_BODY = web.AppKey("client_max_size", int)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: APIError, path: str = "") -> web.Response:
    """The error in the envelope of the dialect the path speaks."""
    if path.startswith("/v1/messages"):
        body = anthropic_api.error_body(err)
    elif path.startswith("/api/"):
        body = ollama_api.error_body(err)
    else:
        body = err.body()
    response = web.json_response(body, status=err.status, headers=err.headers)
    if err.code is not None:
        response[ERROR_CODE] = err.code  # for the access log (access_log.py)
    if err.headers.get("Connection") == "close":  # e.g. a stalled body: the connection goes
        response.force_close()
    return response


def ready_model(request: web.Request) -> ModelContext:
    state = request.app[STATE]
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", "shutting_down")
    if state.model is None and state.host is not None and state.host.started:
        raise APIError(
            503,
            "no model is loaded (unloaded after --keep-alive); the next request for one loads it",
            "server_error",
            "model_unloaded",
        )
    if state.model is None:
        raise APIError(
            503,
            "the model is loading" if state.load_error is None else state.load_error,
            "server_error",
            "model_loading",
            headers={"Retry-After": RETRY_AFTER_LOADING_S},
        )
    return state.model


def not_generative(message: str) -> APIError:
    """A generation route naming an embedding-only model (docs/models.md)."""
    return APIError(400, message, code="model_not_generative", param="model")


def _check_generative(ctx: ModelContext) -> None:
    if getattr(ctx.info, "kind", "chat") == "embedding":
        raise not_generative(
            f"model {ctx.name!r} is an embedding model: it serves /v1/embeddings, /api/embed "
            "and /api/embeddings, not text generation"
        )


@contextlib.asynccontextmanager
async def model_lease(
    request: web.Request, generative: bool = True
) -> AsyncIterator[tuple[ModelContext, Any]]:
    """(the ModelContext of the model the body names, the body), held while the handler runs:
    another local model is loaded first (docs/models.md); unknown names are a 404.
    `generative` (every route but the embedding ones): an embedding-only model is a 400
    `model_not_generative`, refused before it is loaded."""
    state = request.app[STATE]
    host = state.host
    if host is None or not host.started or state.draining:
        ctx = ready_model(request)
        if generative:
            _check_generative(ctx)
        yield ctx, await read_json(request)
        return
    body = await read_json(request)
    name = body.get("model") if isinstance(body, dict) else None
    from mlxcel.daemon.hosting.errors import (
        HostBusy,
        ModelNotFound,
        ModelNotGenerative,
        ModelTooLarge,
        NoRoomForModel,
    )
    from mlxcel.daemon.models.info import ModelLoadError

    try:
        lease = host.lease(name if isinstance(name, str) else None, generative=generative)
        ctx = await lease.__aenter__()
    except ModelNotFound as exc:
        raise APIError(404, str(exc), "not_found_error", "model_not_found", "model") from None
    except ModelNotGenerative as exc:  # no context of its own: counted on the host's
        err = not_generative(str(exc))
        host.facade.record_rejection("invalid_request")
        if state.model is not None:
            state.model.runtime.reject(None, "invalid_request", err.message)
        raise err from None
    except HostBusy as exc:  # too many requests already wait for a load (docs/reliability.md)
        raise APIError(
            503,
            exc.message,
            "server_error",
            "queue_full",
            "model",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except ModelTooLarge as exc:  # refused before anything was evicted
        raise APIError(507, str(exc), "server_error", "insufficient_memory", "model") from None
    except NoRoomForModel as exc:  # pinned models or models_memory: nothing was evicted
        raise APIError(503, str(exc), "server_error", "no_room_for_model", "model") from None
    except ModelLoadError as exc:
        raise APIError(500, str(exc), "server_error", "model_load_failed", "model") from None
    try:
        if generative:
            _check_generative(ctx)  # the default model, named by no `model`
        yield ctx, body
    finally:
        await lease.__aexit__(None, None, None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err, request.path)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY]
        return error_response(
            APIError(413, f"request body over {limit} bytes", code="request_too_large"),
            request.path,
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        http_err = APIError(exc.status, exc.reason, kind, exc.reason.lower().replace(" ", "_"))
        http_err.headers = {k: v for k, v in exc.headers.items() if k in ("Allow",)}
        return error_response(http_err, request.path)


CORS_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type, X-Priority, X-Timeout, X-Speculative"
CORS_MAX_AGE_S = "600"


def allowed_origin(request: web.Request) -> str | None:
    """The request's Origin when the operator allowed it (the CORS response echoes it)."""
    origin = request.headers.get("Origin")
    if origin and origin_allowed(origin, request.app[STATE].allowed_origins):
        return origin
    return None


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer preflights before auth (a browser sends no key on OPTIONS)."""
    if request.method != "OPTIONS":
        return await handler(request)
    headers = {"Allow": CORS_ALLOW_METHODS}
    if allowed_origin(request):
        asked = request.headers.get("Access-Control-Request-Headers", CORS_DEFAULT_HEADERS)
        headers.update(
            {
                "Access-Control-Allow-Methods": CORS_ALLOW_METHODS,
                "Access-Control-Allow-Headers": asked,
                "Access-Control-Max-Age": CORS_MAX_AGE_S,
            }
        )
    return web.Response(status=204, headers=headers)


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Headers every response gets: CORS for allowed origins, the ignored request fields."""
    if request.app[STATE].allowed_origins:  # the answer depends on Origin: tell caches
        response.headers.add("Vary", "Origin")
    origin = allowed_origin(request)
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = IGNORED_FIELDS_HEADER
    ignored = request.get(IGNORED_FIELDS_KEY)
    if ignored:  # names a client chose: escaped to token characters (no CR/LF), bounded
        response.headers[IGNORED_FIELDS_HEADER] = header_list(ignored)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    key, key_lanes = state.api_key, state.key_lanes
    if (key or key_lanes) and request.path not in PUBLIC_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if "x-api-key" in request.headers and not header:  # the Anthropic SDK's header
            header, scheme, token = "x-api-key", "bearer", request.headers["x-api-key"]
        token = token.strip()
        matched = keys_match(token, key) if key else False
        for listed, lane in key_lanes.items():  # each compared, in constant time
            if keys_match(token, listed):
                matched = True
                request[KEY_LANE] = lane
        if scheme.lower() != "bearer" or not matched:
            what = "missing" if not header else "wrong"
            raise APIError(
                401,
                f"{what} API key (send Authorization: Bearer <key>)",
                "authentication_error",
                "invalid_api_key",
            )
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "shutting_down"}, status=503)
    if state.model is None and state.host is not None and state.host.started:
        return web.json_response({"status": "ok", "model": None})  # unloaded, loads on request
    if state.model is None:
        status = "error" if state.load_error else "loading"
        return web.json_response({"status": status}, status=503)
    bridges = [state.model.bridge]
    if state.host is not None and state.host.started:
        bridges += [r.bridge for r in state.host.resident.values() if r.bridge not in bridges]
    for bridge in bridges:
        # a distributed group that lost a rank; a hung engine step (engine/bridge.py)
        problem = getattr(bridge, "problem", None)
        if problem is not None:
            return web.json_response({"status": "degraded", "reason": problem}, status=503)
    return web.json_response({"status": "ok"})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.host is None or not state.host.started:
        ctx = ready_model(request)
        return web.json_response({"object": "list", "data": [_model_item(ctx)]})
    from mlxcel.daemon.hosting.catalogue import local_catalogue

    items = [_model_item(r.ctx) for r in state.host.resident.values()]
    served = {i["id"] for i in items}
    for entry in await asyncio.to_thread(local_catalogue):
        if entry.name not in served:
            items.append(
                {
                    "id": entry.name,
                    "object": "model",
                    "created": int(entry.path.stat().st_mtime) if entry.path.exists() else 0,
                    "owned_by": "mlxcel",
                    "context_length": entry.context_length,
                    "loaded": False,
                }
            )
    return web.json_response({"object": "list", "data": items})


def _model_item(ctx: ModelContext) -> dict[str, Any]:
    snap = ctx.bridge.snapshot()
    return {
        "id": ctx.name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "mlxcel",
        "context_length": snap.config.ctx_per_slot,
        "blas": getattr(ctx.runtime, "blas", None),  # the matmul backend in use
        "loaded": True,
    }


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def slots(request: web.Request) -> web.Response:
    ctx = ready_model(request)
    return web.json_response([s.to_dict() for s in ctx.bridge.snapshot().slots])


async def cache_stats(request: web.Request) -> web.Response:
    ctx = ready_model(request)
    snap = ctx.bridge.snapshot()
    return web.json_response({"prompt_cache": snap.prompt_cache.to_dict(), "kv": snap.kv.to_dict()})


async def cache_reset(request: web.Request) -> web.Response:
    """Both tiers; `{"tier": "ram"}` (or `?tier=ram`) keeps the disk tier (docs/api.md)."""
    ctx = ready_model(request)
    tier = request.query.get("tier", "all")
    if request.body_exists and request.content_length != 0:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_request")
        tier = body.get("tier", tier)
    if tier not in CACHE_TIERS:
        detail = f"tier must be all or ram, got {str(tier)[:40]!r}"
        raise APIError(400, detail, code="invalid_request")
    return web.json_response(await ctx.runtime.reset_cache(tier))


# The types a web page may POST cross-site without a CORS preflight. A browser sends an
# `Origin` header with every POST: a page whose origin is not allowed is refused before this by
# guards.origin_middleware (403 origin_not_allowed, any non-JSON type or none); an allowed one
# still gets 415 for a form or text body. Without `Origin` (curl -d, scripts) the body is read
# as JSON whatever the type says, as other local servers (Ollama, mlx_lm.server) do.
SIMPLE_FORM_TYPES = frozenset(
    {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)


def check_content_type(request: web.Request) -> None:
    ctype = request.content_type if "Content-Type" in request.headers else ""
    if ctype in SIMPLE_FORM_TYPES and "Origin" in request.headers:
        raise APIError(
            415,
            f"Content-Type {ctype!r} is not accepted from a web page; send application/json",
            code="unsupported_media_type",
        )


async def read_json(request: web.Request) -> Any:
    """The body as JSON; 400 for bad UTF-8 or JSON, NaN, Infinity and numbers out of float range
    such as 1e999 included (413 comes from aiohttp's size check)."""
    check_content_type(request)
    raw = await read_body(request, request.app[STATE].header_timeout, request.app[MAX_BODY])
    try:
        text = raw.decode("utf-8")
        body = loads_finite(text)
        if "\\u" in text:  # an escaped lone surrogate (\ud800) is no text a tokenizer takes
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the body is not valid UTF-8", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(400, "the body holds a lone UTF-16 surrogate", code="invalid_json") from None
    except (ValueError, RecursionError) as exc:  # also an integer over the 4300-digit limit
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    return body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    async with model_lease(request) as (ctx, body):
        return await handle_chat(request, request.app[STATE], ctx, body)


async def completions(request: web.Request) -> web.StreamResponse:
    async with model_lease(request) as (ctx, body):
        return await handle_completion(request, request.app[STATE], ctx, body)


async def anthropic_messages(request: web.Request) -> web.StreamResponse:
    async with model_lease(request) as (ctx, body):
        return await anthropic_api.handle_messages(request, request.app[STATE], ctx, body)


async def anthropic_count_tokens(request: web.Request) -> web.Response:
    async with model_lease(request) as (ctx, body):
        return await anthropic_api.handle_count_tokens(request, request.app[STATE], ctx, body)


async def responses_create(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses` (OpenAI's Responses API, responses_api.py)."""
    async with model_lease(request) as (ctx, body):
        return await responses_api.handle_create(request, request.app[STATE], ctx, body)


async def responses_get(request: web.Request) -> web.Response:
    return await responses_api.handle_get(request)


async def responses_delete(request: web.Request) -> web.Response:
    return await responses_api.handle_delete(request)


async def responses_cancel(request: web.Request) -> web.Response:
    return await responses_api.handle_cancel(request)


async def responses_input_items(request: web.Request) -> web.Response:
    return await responses_api.handle_input_items(request)


async def ollama_chat(request: web.Request) -> web.StreamResponse:
    host = request.app[STATE].host
    if host is not None and host.started and ollama_api.wants_unload(await read_json(request)):
        return await ollama_api.unload(host, await read_json(request))  # `ollama stop`
    async with model_lease(request) as (ctx, body):
        return await ollama_api.handle_chat(request, request.app[STATE], ctx, body)


async def ollama_generate(request: web.Request) -> web.StreamResponse:
    host = request.app[STATE].host
    if host is not None and host.started and ollama_api.wants_unload(await read_json(request)):
        return await ollama_api.unload(host, await read_json(request))  # `ollama stop`
    async with model_lease(request) as (ctx, body):
        return await ollama_api.handle_generate(request, request.app[STATE], ctx, body)


async def embeddings(request: web.Request) -> web.Response:
    """`POST /v1/embeddings` (embeddings_api.py)."""
    async with model_lease(request, generative=False) as (ctx, body):
        return await embeddings_api.handle_openai(request, request.app[STATE], ctx, body)


async def ollama_embed(request: web.Request) -> web.Response:
    async with model_lease(request, generative=False) as (ctx, body):
        return await embeddings_api.handle_ollama_embed(request, request.app[STATE], ctx, body)


async def ollama_embeddings(request: web.Request) -> web.Response:
    async with model_lease(request, generative=False) as (ctx, body):
        return await embeddings_api.handle_ollama_embeddings(request, request.app[STATE], ctx, body)


async def ollama_tags(request: web.Request) -> web.Response:
    host = request.app[STATE].host
    if host is None or not host.started:
        return await ollama_api.tags(ready_model(request))
    return await ollama_api.host_tags(host)


async def ollama_ps(request: web.Request) -> web.Response:
    host = request.app[STATE].host
    if host is None or not host.started:
        return await ollama_api.ps(ready_model(request))
    return await ollama_api.host_ps(host)


async def ollama_show(request: web.Request) -> web.Response:
    host = request.app[STATE].host
    if host is None or not host.started:
        return await ollama_api.show(ready_model(request), await read_json(request))
    return await ollama_api.host_show(host, await read_json(request))


async def ollama_version(request: web.Request) -> web.Response:
    return ollama_api.version()


async def ollama_pull(request: web.Request) -> web.StreamResponse:
    """`POST /api/pull`: `mlxcel-daemon models pull` for a name (never a path), off the loop."""
    state = request.app[STATE]
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", "shutting_down")
    body = await read_json(request)
    return await ollama_api.pull(request, body, stream_timeout(state.model), _served_path(state))


def _served_path(state: ServingState) -> Callable[[str], str | None]:
    """The weights' path of a model the daemon serves under `name` (a `--model /path/dir`
    answers to its folder's name too), so `/api/pull` of it needs no download."""

    def served(name: str) -> str | None:
        host = state.host
        resident = host.find_resident(name) if host is not None and host.started else None
        info = resident.loaded.info if resident is not None and resident.loaded else None
        return str(info.path) if info is not None and info.path else None

    return served


async def root(request: web.Request) -> web.Response:
    """`GET /` and `HEAD /` (clients' "is a server there" probe): 200 and one line."""
    return web.Response(text=f"mlxcel is running (version {__version__})\n")


def _hosts(request: web.Request) -> HostAllowlist:
    return request.app[STATE].hosts


def _origins(request: web.Request) -> frozenset[str]:
    return request.app[STATE].allowed_origins


async def _executor_ctx(app: web.Application) -> Any:
    yield
    app[STATE].executor.shutdown(wait=False, cancel_futures=True)


def make_app(state: ServingState, client_max_size: int = CLIENT_MAX_SIZE) -> web.Application:
    app = web.Application(
        client_max_size=client_max_size,
        middlewares=[
            access_log_middleware,  # outermost: every answer, error envelopes included
            error_middleware,
            make_host_middleware(_hosts),  # every route, preflights and /v1/control included
            cors_middleware,
            make_origin_middleware(_origins),  # every POST/PUT/DELETE/PATCH route
            auth_middleware,
            policy_middleware,  # X-Priority, X-Timeout, X-Speculative (request_policy.py)
        ],
    )
    app.on_response_prepare.append(_on_prepare)
    app[STATE] = state
    app[MAX_BODY] = client_max_size
    app[responses_api.RESPONSES] = responses_api.ResponseStore()  # the stored responses
    app.cleanup_ctx.append(_executor_ctx)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/slots", slots)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/cache/stats", cache_stats)
    app.router.add_post("/v1/cache/reset", cache_reset)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", anthropic_messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic_count_tokens)
    app.router.add_post("/v1/responses", responses_create)
    app.router.add_get("/v1/responses/{response_id}", responses_get)
    app.router.add_delete("/v1/responses/{response_id}", responses_delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses_cancel)
    app.router.add_get("/v1/responses/{response_id}/input_items", responses_input_items)
    app.router.add_post("/api/chat", ollama_chat)
    app.router.add_post("/api/generate", ollama_generate)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/api/embed", ollama_embed)
    app.router.add_post("/api/embeddings", ollama_embeddings)
    app.router.add_get("/api/tags", ollama_tags)
    app.router.add_get("/api/ps", ollama_ps)
    app.router.add_post("/api/show", ollama_show)
    app.router.add_get("/api/version", ollama_version)
    app.router.add_post("/api/pull", ollama_pull)
    app.router.add_get("/", root)  # HEAD too
    app.router.add_get(ws_control.PATH, ws_control.make_handler(STATE))
    return app
