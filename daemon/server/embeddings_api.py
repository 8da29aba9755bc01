"""Embeddings: OpenAI's `POST /v1/embeddings`, Ollama's `POST /api/embed` and its legacy
`POST /api/embeddings` (docs/api.md, "Embeddings").

Validation and tokenization happen here (the tokenizer on its executor); the vectors come from
the engine thread (`EngineBridge.embed`, engine/embedder.py: the backbone's hidden states
mean-pooled over the input's tokens, L2-normalised), computed between decode steps within the
step's token budget, so running streams keep their pace.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
from aiohttp import web
from mlxcel.daemon.engine.runner_api import EmbeddingUnsupported
from mlxcel.daemon.engine.types import AdmissionRejected
from mlxcel.daemon.server.completions import (
    check_dialect_fields,
    check_model,
    counting_rejections,
)
from mlxcel.daemon.server.errors import APIError, bad_request
from mlxcel.daemon.server.ollama_api import apply_keep_alive, model_name

if TYPE_CHECKING:
    from mlxcel.daemon.server.http_app import ModelContext, ServingState

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)
MAX_TOTAL_TOKENS = 300_000  # tokens in one request, all inputs together (OpenAI's limit)
RETRY_AFTER_QUEUE_FULL_S = "1"
OPENAI_KNOWN = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
OLLAMA_EMBED_KNOWN = frozenset({"model", "input", "truncate", "options", "keep_alive"})
OLLAMA_LEGACY_KNOWN = frozenset({"model", "prompt", "options", "keep_alive"})
ENCODINGS = ("float", "base64")


# -- parsing -----------------------------------------------------------------------------------


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_input(value: Any, param: str = "input") -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids (one input), or a
    list of token-id lists; each item a text or the token ids of one input."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_int(v) for v in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(
            f"'{param}' must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param,
            "invalid_type",
        )
    if not items:
        raise bad_request(f"'{param}' is an empty list", param, "invalid_value")
    if len(items) > MAX_INPUTS:
        raise bad_request(
            f"'{param}' has {len(items)} items, more than the {MAX_INPUTS} allowed",
            param,
            "too_many_inputs",
        )
    kinds = {
        "text" if isinstance(v, str) else "ids" if isinstance(v, list) else "bad" for v in items
    }
    if "bad" in kinds or len(kinds) > 1:
        raise bad_request(
            f"'{param}' must hold only strings or only token-id lists, not a mix or other values",
            param,
            "invalid_type",
        )
    for i, item in enumerate(items):
        if not item:
            what = "an empty string" if isinstance(item, str) else "an empty token list"
            raise bad_request(f"{param}[{i}] is {what}", param, "empty_input")
        if isinstance(item, list) and not all(_is_int(t) for t in item):
            raise bad_request(
                f"{param}[{i}] must hold only integer token ids", param, "invalid_type"
            )
    return items


def check_token_ids(items: list[list[int]], vocab_size: int, param: str = "input") -> None:
    for i, ids in enumerate(items):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"{param}[{i}] holds token id {bad}, outside the vocabulary [0, {vocab_size})",
                param,
                "invalid_token_id",
            )


def context_limit(ctx: ModelContext) -> int:
    """The most tokens one input may have: the model's context (or the context per slot when
    its config does not say)."""
    length = getattr(ctx.info, "context_length", None)
    if _is_int(length) and length > 0:
        return int(length)
    return int(ctx.bridge.snapshot().config.ctx_per_slot)


def check_lengths(items: list[list[int]], limit: int, param: str = "input") -> int:
    """The total tokens; 400 for an input over the context or a total over the bound."""
    total = 0
    for i, ids in enumerate(items):
        if len(ids) > limit:
            raise APIError(
                400,
                f"{param}[{i}] has {len(ids)} tokens, more than the model's context of {limit} "
                "tokens",
                "invalid_request_error",
                "context_length_exceeded",
                param,
            )
        total += len(ids)
    if total > MAX_TOTAL_TOKENS:
        raise APIError(
            400,
            f"the inputs have {total} tokens together, more than the {MAX_TOTAL_TOKENS} one "
            "request may have; split them over several requests",
            "invalid_request_error",
            "too_many_tokens",
            param,
        )
    return total


async def tokenize(state: ServingState, ctx: ModelContext, items: list[Any]) -> list[list[int]]:
    """Token ids of every input (texts encoded on the tokenizer's executor, one call)."""
    if not isinstance(items[0], str):
        return [list(ids) for ids in items]
    encode = ctx.tokenizer.encode

    def run() -> list[list[int]]:
        return [list(encode(text)) for text in items]

    return await asyncio.get_running_loop().run_in_executor(state.executor, run)


async def embed(ctx: ModelContext, inputs: list[list[int]]) -> np.ndarray:
    """The vectors from the engine; its refusals as HTTP errors."""
    bridge: Any = ctx.bridge
    try:
        return await bridge.embed(inputs)
    except AdmissionRejected as exc:
        headers = {"Retry-After": RETRY_AFTER_QUEUE_FULL_S} if exc.http_status == 503 else {}
        kind = "server_error" if exc.http_status >= 500 else "invalid_request_error"
        raise APIError(exc.http_status, exc.message, kind, exc.reason, headers=headers) from None
    except EmbeddingUnsupported as exc:
        raise APIError(400, str(exc), code="embeddings_unsupported", param="model") from None
    except RuntimeError as exc:  # the forward failed (logged on the engine thread)
        raise APIError(500, str(exc), "server_error", "embedding_failed") from None


def check_dimensions(value: Any, width: int | None) -> None:
    if value is None:
        return
    if not _is_int(value) or value < 1:
        raise bad_request("'dimensions' must be a positive integer", "dimensions", "invalid_type")
    if width is not None and value != width:
        raise bad_request(
            f"'dimensions' {value} is not supported: this model's embeddings have {width} "
            "dimensions (it is not trained to be truncated); omit the field or send "
            f"{width}",
            "dimensions",
            "unsupported_dimensions",
        )


async def _off_loop(state: ServingState, func: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.executor, func, *args)


def _as_floats(vectors: np.ndarray) -> list[list[float]]:
    return vectors.astype(np.float32).tolist()


def _as_base64(vectors: np.ndarray) -> list[str]:
    """Each vector as OpenAI's SDK decodes it: little-endian float32 bytes, base64."""
    little = vectors.astype("<f4")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]


# -- OpenAI ------------------------------------------------------------------------------------


async def handle_openai(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.Response:
    """`POST /v1/embeddings`."""
    with counting_rejections(state, ctx):
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", None, "invalid_type")
        check_dialect_fields(request, state, body, OPENAI_KNOWN)
        if "input" not in body:
            raise bad_request("'input' is required", "input", "missing_field")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request("'model' must be a string", "model", "invalid_type")
        if state.host is None or not state.host.started:
            check_model(ctx, model)
        encoding = body.get("encoding_format", "float")
        if encoding is None:
            encoding = "float"
        if encoding not in ENCODINGS:
            raise bad_request(
                f"'encoding_format' must be 'float' or 'base64', got {encoding!r}",
                "encoding_format",
                "invalid_value",
            )
        bridge: Any = ctx.bridge
        check_dimensions(body.get("dimensions"), bridge.embedding_width())
        items = parse_input(body["input"])
        inputs = await tokenize(state, ctx, items)
        if not isinstance(items[0], str):
            check_token_ids(inputs, ctx.vocab_size)
        for i, ids in enumerate(inputs):
            if not ids:  # a text that encodes to nothing
                raise bad_request(f"input[{i}] encodes to no tokens", "input", "empty_input")
        total = check_lengths(inputs, context_limit(ctx))
    vectors = await embed(ctx, inputs)
    dims = body.get("dimensions")
    if dims is not None and vectors.shape[1] != dims:  # a model whose width the config hid
        with counting_rejections(state, ctx):
            check_dimensions(dims, int(vectors.shape[1]))
    encode = _as_base64 if encoding == "base64" else _as_floats
    encoded = await _off_loop(state, encode, vectors)  # 2048 x width floats: not on the loop
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)]
    payload = {
        "object": "list",
        "data": data,
        "model": ctx.name,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    return await _json(state, payload)


async def _json(state: ServingState, payload: dict[str, Any]) -> web.Response:
    import json

    text = await _off_loop(state, json.dumps, payload)
    return web.Response(text=text, content_type="application/json")


# -- Ollama ------------------------------------------------------------------------------------


def _ollama_truncate(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise bad_request("'truncate' must be true or false", "truncate", "invalid_type")
    return value


async def handle_ollama_embed(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.Response:
    """`POST /api/embed`: `input` a string or a list of strings; `truncate` (default true)
    cuts an input over the context to it, false refuses it."""
    started = time.perf_counter_ns()
    with counting_rejections(state, ctx):
        _check_ollama_body(request, state, ctx, body, OLLAMA_EMBED_KNOWN)
        truncate = _ollama_truncate(body.get("truncate"))
        raw = body.get("input")
        if raw is None or raw == []:  # Ollama's "load the model" call: it is loaded
            return web.json_response(_ollama_body(ctx, [], started, 0))
        if not (
            isinstance(raw, str) or (isinstance(raw, list) and all(isinstance(v, str) for v in raw))
        ):
            raise bad_request(
                "'input' must be a string or a list of strings", "input", "invalid_type"
            )
        items = parse_input(raw)
        inputs = await tokenize(state, ctx, items)
        limit = context_limit(ctx)
        if truncate:
            # an encoder's tokenizer keeps its closing [SEP] / </s> (models/encoder/load.py)
            cut = getattr(ctx.tokenizer, "truncate", None)
            inputs = [cut(ids, limit) if cut else ids[:limit] for ids in inputs]
        for i, ids in enumerate(inputs):
            if not ids:
                raise bad_request(f"input[{i}] encodes to no tokens", "input", "empty_input")
        total = check_lengths(inputs, limit)
    vectors = await embed(ctx, inputs)
    encoded = await _off_loop(state, _as_floats, vectors)
    return await _json(state, _ollama_body(ctx, encoded, started, total))


def _ollama_body(
    ctx: ModelContext, embeddings: list[list[float]], started: int, count: int
) -> dict[str, Any]:
    return {
        "model": ctx.name,
        "embeddings": embeddings,
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": 0,  # the model was resident (a load happens in the lease, before)
        "prompt_eval_count": count,
    }


def _check_ollama_body(
    request: web.Request,
    state: ServingState,
    ctx: ModelContext,
    body: Any,
    known: frozenset[str],
) -> None:
    """What both Ollama embedding calls check first: an object of known fields, the model,
    `keep_alive` (applied), `options` (an object; none of its keys changes an embedding)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    check_dialect_fields(request, state, body, known)
    if state.host is None or not state.host.started:
        check_model(ctx, model_name(ctx, body.get("model")))
    apply_keep_alive(state, ctx, body)
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'options' must be a JSON object", "options", "invalid_type")


async def handle_ollama_embeddings(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.Response:
    """`POST /api/embeddings` (Ollama's legacy call): `prompt`, one string →
    `{"embedding": [...]}`; an empty prompt gives an empty vector, as Ollama's does. Inputs
    over the context are refused (the legacy call has no `truncate`)."""
    with counting_rejections(state, ctx):
        _check_ollama_body(request, state, ctx, body, OLLAMA_LEGACY_KNOWN)
        prompt = body.get("prompt", "")
        if prompt is None:
            prompt = ""
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt", "invalid_type")
        if not prompt:
            return web.json_response({"embedding": []})
        inputs = await tokenize(state, ctx, [prompt])
        if not inputs[0]:
            return web.json_response({"embedding": []})
        check_lengths(inputs, context_limit(ctx), "prompt")
    vectors = await embed(ctx, inputs)
    encoded = await _off_loop(state, _as_floats, vectors)
    return await _json(state, {"embedding": encoded[0]})
