"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request is translated to an OpenAI chat body (content blocks to messages, tool_use to
assistant tool_calls, tool_result to tool messages, tools and tool_choice to theirs) and runs
through the same validation, chat template and engine; the turn comes back as Anthropic
content blocks, or as Anthropic's SSE event sequence when streaming. A thinking model's
reasoning comes back as `thinking` blocks before the text (docs/api.md, "Reasoning").
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web
from mlxcel.daemon.server.completions import (
    SSE_HEADERS,
    chat_prompt_ids,
    check_dialect_fields,
    check_model,
    clamp_max_tokens,
    counting_rejections,
    open_generation,
    parse_off_loop,
    prepare_chat,
)
from mlxcel.daemon.server.errors import APIError, bad_request
from mlxcel.daemon.server.generation import GenerationFailed, Usage
from mlxcel.daemon.server.openai_schema import parse_chat_request
from mlxcel.daemon.server.stream_write import DEFAULT_STREAM_TIMEOUT_S, StreamOut, stream_timeout
from mlxcel.daemon.server.tool_schema import ToolCall
from mlxcel.daemon.server.turn import Turn, template_tools

if TYPE_CHECKING:
    from mlxcel.daemon.server.http_app import ModelContext, ServingState

# Anthropic fields we use; the rest of its documented fields are accepted and ignored.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "thinking",
        "speculative",  # mlxcel's: false opts out of speculative decoding (docs/api.md)
    }
)
HARMLESS_FIELDS = frozenset({"metadata", "service_tier", "container", "mcp_servers"})
# `thinking.type`: enabled (with its budget) and disabled; the others leave it to the model.
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of blocks", where, "invalid_type")
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"'{where}[{i}]': expected a text block, got {kind!r}", where)
        if not isinstance(block.get("text"), str):
            raise bad_request(f"'{where}[{i}].text' must be a string", where, "invalid_type")
        texts.append(block["text"])
    return "".join(texts)


def _message(msg: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message -> OpenAI messages (tool results become tool messages)."""
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise bad_request(f"'{where}.role' must be user, assistant or system", where)
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": msg["role"], "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' is required", where, "invalid_type")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_of([block], at))
        elif kind == "tool_use" and msg["role"] == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise bad_request(f"'{at}' needs a name and an input object", at)
            fn = {"name": block["name"], "arguments": json.dumps(block["input"])}
            calls.append({"id": str(block.get("id", f"toolu_{i}")), "function": fn})
        elif kind == "tool_result" and msg["role"] == "user":
            body = block.get("content", "")
            text = _text_of(body, f"{at}.content")
            call_id = block.get("tool_use_id")
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning: not shown to this model again
        else:
            raise bad_request(f"'{at}': block type {kind!r} is not supported", at)
    out = list(results)
    if msg["role"] == "assistant":
        item: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            item["tool_calls"] = calls
        out.append(item)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _is_plain_user(msg: dict[str, Any]) -> bool:
    return msg.get("role") == "user" and set(msg) == {"role", "content"}


def _conversation(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """The OpenAI messages of an Anthropic conversation. `role: "system"` entries inside
    `messages` (Claude Code sends its mid-conversation reminders so) are merged, in order,
    into the one leading system message after `system`: most chat templates take a single
    system message and only first. Two user turns that such an entry separated become one,
    as Anthropic combines consecutive same-role turns (templates that need alternating
    roles would refuse them otherwise)."""
    system_texts = [] if system is None else [_text_of(system, "system")]
    out: list[dict[str, Any]] = []
    after_system = False
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(msg, dict) and msg.get("role") == "system":
            if msg.get("content") is None:
                raise bad_request(f"'{where}.content' is required", where, "invalid_type")
            system_texts.append(_text_of(msg["content"], f"{where}.content"))
            after_system = True
            continue
        converted = _message(msg, where)
        if after_system and out and _is_plain_user(out[-1]) and _is_plain_user(converted[0]):
            joined = f"{out[-1]['content']}\n\n{converted[0]['content']}"
            out[-1] = {"role": "user", "content": joined}
            converted = converted[1:]
        out.extend(converted)
        after_system = False
    if not out:
        raise bad_request("'messages' needs a user or assistant message", "messages")
    texts = [t for t in system_texts if t]
    if texts or system is not None:
        out.insert(0, {"role": "system", "content": "\n\n".join(texts)})
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or "input_schema" not in tool:
            raise bad_request(f"'tools[{i}]' must have a name and an input_schema", "tools")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad_request("'tool_choice.type' must be auto, any, tool or none", "tool_choice")


def to_openai_body(body: Any, for_counting: bool = False) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    if not for_counting and body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages", "invalid_type")
    out: dict[str, Any] = {"messages": _conversation(body.get("system"), messages)}
    for key in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "speculative"):
        if body.get(key) is not None:
            out[key] = body[key]
    if isinstance(body.get("temperature"), (int, float)) and not 0 <= body["temperature"] <= 1:
        raise bad_request("'temperature' must be between 0 and 1", "temperature")
    out.update(thinking_fields(body.get("thinking")))
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice = body.get("tool_choice")
        out["tool_choice"] = _tool_choice(choice)
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    out["stream_options"] = {"include_usage": True} if body.get("stream") is True else None
    return {k: v for k, v in out.items() if v is not None}


def thinking_fields(value: Any) -> dict[str, Any]:
    """`thinking` -> the OpenAI chat body's reasoning fields (docs/api.md, "Reasoning"):
    `{"type": "enabled", "budget_tokens": N}` is a reasoning budget of N tokens;
    `{"type": "disabled"}` turns thinking off (the template's `enable_thinking: false`, and any
    reasoning closed at once); `adaptive`, `between_tools` or no `thinking`: the model's
    default. `budget_tokens`, when given, is a positive integer (not NaN or 1e999)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'thinking' must be an object", "thinking", "invalid_type")
    kind = value.get("type")
    if kind not in THINKING_TYPES:
        shown = repr(kind)[:40]
        raise bad_request(
            f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}, got {shown}",
            "thinking.type",
        )
    budget = value.get("budget_tokens")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
    ):
        shown = repr(budget)[:40]
        raise bad_request(
            f"'thinking.budget_tokens' must be a positive integer, got {shown}",
            "thinking.budget_tokens",
        )
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_budget": 0}
    if kind == "enabled" and budget is not None:
        return {"reasoning_budget": budget}
    return {}


def shows_thinking(body: Any) -> bool:
    """False when the client asked for the thinking to be left out (`display: "omitted"`):
    its blocks come back empty, as Anthropic's do."""
    thinking = body.get("thinking") if isinstance(body, dict) else None
    return not (isinstance(thinking, dict) and thinking.get("display") == "omitted")


def usage_of(usage: Usage) -> dict[str, Any]:
    """Anthropic's usage; `output_tokens` counts the reasoning too, as Anthropic's does."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def stop_reason(turn: Turn) -> tuple[str, str | None]:
    if turn.gen.stop_sequence is not None and turn.finish_reason == "stop":
        return "stop_sequence", turn.gen.stop_sequence
    return STOP_REASONS.get(turn.finish_reason, "end_turn"), None


async def handle_messages(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.StreamResponse:
    with counting_rejections(state, ctx):
        openai_body = to_openai_body(body)
        check_dialect_fields(request, state, body, KNOWN_FIELDS | HARMLESS_FIELDS)
    chat = await prepare_chat(request, state, ctx, openai_body)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    options = clamp_max_tokens(ctx, len(chat.prompt_ids), chat.req.options)
    gen = open_generation(
        state, ctx, message_id, chat.prompt_ids, options, request.path, chat.reasoning
    )
    turn = Turn(gen, chat.mode)
    shown = shows_thinking(body)
    try:
        if options.stream:
            timeout = stream_timeout(ctx)
            return await _stream(request, turn, message_id, ctx.name, timeout, shown)
        return await _respond(turn, message_id, ctx.name, shown)
    finally:
        gen.abort()


def _message_object(message_id: str, model: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


def thinking_block(thinking: str) -> dict[str, Any]:
    """A reasoning block. `signature` is required by the SDKs (`ThinkingBlock.signature: str`);
    there is nothing to sign here, so it is empty."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


async def _respond(turn: Turn, message_id: str, model: str, shown: bool = True) -> web.Response:
    merged = await turn.collect()
    text = merged.text
    message = _message_object(message_id, model)
    if merged.reasoning:
        message["content"].append(thinking_block(merged.reasoning if shown else ""))
    if text or not turn.tool_calls:
        message["content"].append({"type": "text", "text": text})
    message["content"].extend(tool_use_block(c) for c in turn.tool_calls)
    message["stop_reason"], message["stop_sequence"] = stop_reason(turn)
    message["usage"] = usage_of(turn.gen.usage)
    return web.json_response(message)


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class BlockWriter:
    """Numbers content blocks and writes their start / delta / stop events."""

    def __init__(self, resp: StreamOut, show_thinking: bool = True) -> None:
        self.resp = resp
        self.index = -1
        self.open_kind: str | None = None
        self.show_thinking = show_thinking
        self.wrote_text = False

    async def start(self, block: dict[str, Any]) -> None:
        await self.close()
        self.index += 1
        self.open_kind = block["type"]
        data = {"type": "content_block_start", "index": self.index, "content_block": block}
        await self.resp.write(sse_event("content_block_start", data))

    async def delta(self, delta: dict[str, Any]) -> None:
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        await self.resp.write(sse_event("content_block_delta", data))

    async def close(self) -> None:
        if self.open_kind == "thinking":  # the SDKs expect the signature just before the stop
            await self.delta({"type": "signature_delta", "signature": ""})
        if self.open_kind is not None:
            data = {"type": "content_block_stop", "index": self.index}
            await self.resp.write(sse_event("content_block_stop", data))
            self.open_kind = None

    async def text(self, text: str) -> None:
        if self.open_kind != "text":
            await self.start({"type": "text", "text": ""})
            self.wrote_text = True
        await self.delta({"type": "text_delta", "text": text})

    async def thinking(self, thinking: str) -> None:
        if self.open_kind != "thinking":
            await self.start(thinking_block(""))
        if self.show_thinking:
            await self.delta({"type": "thinking_delta", "thinking": thinking})

    async def tool_use(self, call: ToolCall) -> None:
        await self.start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        await self.delta({"type": "input_json_delta", "partial_json": call.arguments})
        await self.close()


async def _stream(
    request: web.Request,
    turn: Turn,
    message_id: str,
    model: str,
    timeout: float = DEFAULT_STREAM_TIMEOUT_S,
    show_thinking: bool = True,
) -> web.StreamResponse:
    """Anthropic's SSE events; every write bounded by `timeout` (stream_write.py). The
    reasoning is a `thinking` block (thinking_delta events) before the text."""
    http_resp = web.StreamResponse(headers=SSE_HEADERS)
    resp = StreamOut(request, http_resp, message_id, timeout)
    started = False

    async def message_start() -> None:
        """Sent with the first event: by then the engine has looked the prompt up in the
        prompt cache, so `input_tokens` (uncached) and `cache_read_input_tokens` are the
        split message_delta and a non-streamed answer report too."""
        nonlocal started
        if started:
            return
        started = True
        known = turn.gen.usage
        start = _message_object(message_id, model)
        start["usage"] = usage_of(Usage(known.prompt_tokens, known.cached_tokens))
        await resp.write(sse_event("message_start", {"type": "message_start", "message": start}))
        await resp.write(sse_event("ping", {"type": "ping"}))

    try:
        await http_resp.prepare(request)
        blocks = BlockWriter(resp, show_thinking)
        try:
            async with contextlib.aclosing(turn.events()) as events:
                async for event in events:
                    await message_start()
                    if event.reasoning:
                        await blocks.thinking(event.reasoning)
                    if event.text:
                        await blocks.text(event.text)
                    for call in event.tool_calls:
                        await blocks.tool_use(call)
        except GenerationFailed as exc:
            await message_start()
            err = exc.api_error()
            await resp.write(sse_event("error", error_body(err)))
            return http_resp
        await message_start()
        if not blocks.wrote_text and not turn.tool_calls:  # as _respond: a text block
            await blocks.text("")
        await blocks.close()
        reason, sequence = stop_reason(turn)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_of(turn.gen.usage),
        }
        await resp.write(sse_event("message_delta", delta))
        await resp.write(sse_event("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client left or stopped reading; the caller aborts the engine request
    return http_resp


async def handle_count_tokens(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.Response:
    with counting_rejections(state, ctx):
        openai_body = to_openai_body(body, for_counting=True)
        req = await parse_off_loop(parse_chat_request, openai_body, state.strict_api)
        check_dialect_fields(request, state, body, KNOWN_FIELDS | HARMLESS_FIELDS)
        check_model(ctx, req.options.model)
        tools = template_tools(req.tools, req.tool_choice)
        ids = await chat_prompt_ids(state, ctx, req.messages, tools, req.template_kwargs)
    return web.json_response({"input_tokens": len(ids)})
