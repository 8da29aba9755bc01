"""OpenAI's Responses API: POST /v1/responses and the stored responses' routes.

A request is translated to an OpenAI chat body (input items to messages, function_call items to
assistant tool_calls, function_call_output items to tool messages, flat function tools to chat
tools, `text.format` to `response_format`) and runs through the same validation, chat template,
engine and constrained decoding as chat completions (completions.prepare_chat); the turn comes
back as Responses output items, or as the Responses SSE event sequence when streaming. Tool
types other than `function` (web_search, file_search, local_shell, custom, namespace, ...) are
left out of what the model sees and named in X-Mlxcel-Ignored-Fields.

A thinking model's reasoning (completions.prepare_chat's reasoning plan, as on chat) comes back
apart from the answer: a `reasoning` output item with `reasoning_text` content, streamed as
`response.reasoning_text.delta` events; `reasoning.effort` is chat's `reasoning_effort`.

`store` (default true, as OpenAI) keeps the response in the app's ResponseStore
(response_store.py): `previous_response_id` prepends its conversation, so the chained prompt
begins with the first turn's tokens and the prompt-prefix cache serves them.

Why one module: the Responses dialect end to end: the request's translation and the response's
items and typed SSE events are built from one set of item shapes (`message_item`, `call_item`,
`reasoning_item`) that both halves use, and the stored-response routes read the same objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

from aiohttp import web
from mlxcel.daemon.server.completions import (
    SSE_HEADERS,
    clamp_max_tokens,
    counting_rejections,
    note_ignored,
    open_generation,
    prepare_chat,
)
from mlxcel.daemon.server.errors import APIError, bad_request, loads_finite
from mlxcel.daemon.server.generation import GenerationFailed, Usage
from mlxcel.daemon.server.response_store import ResponseStore, StoredResponse, json_size
from mlxcel.daemon.server.stream_write import DEFAULT_STREAM_TIMEOUT_S, StreamOut, stream_timeout
from mlxcel.daemon.server.tool_schema import ToolCall
from mlxcel.daemon.server.turn import Turn

if TYPE_CHECKING:
    from mlxcel.daemon.server.http_app import ModelContext, ServingState

RESPONSES: Any = web.AppKey("mlxcel_responses", ResponseStore)

# Fields we use or echo; OpenAI's other documented fields below are accepted and ignored.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stop",  # mlxcel extensions, as on chat completions: stop, ignore_eos
        "ignore_eos",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "include",
        "metadata",
        "store",
        "stream",
        "stream_options",
        "previous_response_id",
        "truncation",
        "top_logprobs",
        "speculative",  # mlxcel's: false opts out of speculative decoding (as on chat)
        "background",
        "conversation",
        "prompt",
    }
)
HARMLESS_FIELDS = frozenset(
    {
        "user",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "max_tool_calls",
        "client_metadata",
    }
)
MAX_INPUT_ITEMS = 10_000  # per request, and in a chained conversation
MAX_PARTS = 1_000  # content parts of one message
MAX_METADATA = 16
INPUT_ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
REASONING_SUMMARIES = frozenset({"auto", "concise", "detailed"})
ID_RE = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _where(where: str, key: str) -> str:
    return f"{where}.{key}"


@overload
def _string(value: Any, where: str, required: Literal[True] = True) -> str: ...
@overload
def _string(value: Any, where: str, required: bool) -> str | None: ...
def _string(value: Any, where: str, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string", where, "invalid_type")
    return value


# --- input items ------------------------------------------------------------------------------


MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})


def _parts_text(
    content: Any, where: str, role: str, media_as_note: bool = False
) -> list[dict[str, Any]]:
    """A message's content (a string or text parts) as normalized parts: `input_text` for
    user, system and developer messages, `output_text` for assistant ones. With
    `media_as_note` (a tool's output: Codex's `view_image` returns an image) a media part
    becomes a short text note instead of a 400, so the agent's session goes on."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        if len(content) > MAX_PARTS:
            raise bad_request(f"'{where}' has more than {MAX_PARTS} parts", where)
        texts = []
        for i, item in enumerate(content):
            at = f"{where}[{i}]"
            part_type = item.get("type") if isinstance(item, dict) else None
            if media_as_note and part_type in MEDIA_PARTS:
                texts.append(f"[{part_type} omitted: this model takes text only]")
                continue
            if part_type not in TEXT_PARTS:
                shown = part_type if isinstance(part_type, str) else type(item).__name__
                raise bad_request(
                    f"'{at}': only text parts are supported, got {shown!r}",
                    f"{at}.type",
                    "unsupported_value",
                )
            texts.append(_string(item.get(TEXT_PARTS[part_type]), f"{at}.text"))
    else:
        raise bad_request(f"'{where}' must be a string or a list of parts", where, "invalid_type")
    parts: list[dict[str, Any]] = []
    for text in texts:
        part: dict[str, Any] = {"type": kind, "text": text}
        if kind == "output_text":
            part["annotations"] = []
        parts.append(part)
    return parts


def _message_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in INPUT_ROLES:
        raise bad_request(
            f"'{where}.role' must be one of {', '.join(sorted(INPUT_ROLES))}", f"{where}.role"
        )
    if "content" not in item:
        raise bad_request(f"'{where}.content' is required", f"{where}.content")
    prefix = "msg"
    out = {
        "type": "message",
        "id": _item_id(item, where, prefix),
        "role": role,
        "content": _parts_text(item["content"], f"{where}.content", role),
        "status": "completed",
    }
    return out


def _item_id(item: dict[str, Any], where: str, prefix: str) -> str:
    given = item.get("id")
    if given is None:
        return new_id(prefix)
    if not isinstance(given, str) or not ID_RE.match(given):
        raise bad_request(f"'{where}.id' must be a short id string", f"{where}.id", "invalid_type")
    return given


def _function_call_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _string(item.get("call_id"), _where(where, "call_id"))
    name = _string(item.get("name"), _where(where, "name"))
    arguments = _string(item.get("arguments", "{}"), _where(where, "arguments"))
    try:
        parsed = loads_finite(arguments) if arguments.strip() else {}
    except ValueError:
        raise bad_request(f"'{where}.arguments' is not valid JSON", f"{where}.arguments") from None
    if not isinstance(parsed, dict):
        raise bad_request(f"'{where}.arguments' must be a JSON object", f"{where}.arguments")
    return {
        "type": "function_call",
        "id": _item_id(item, where, "fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _function_output_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _string(item.get("call_id"), _where(where, "call_id"))
    output = item.get("output")
    if isinstance(output, list):  # parts: text only
        parts = _parts_text(output, f"{where}.output", "user", media_as_note=True)
        text = "".join(p["text"] for p in parts)
    else:
        text = _string(output, _where(where, "output"))
    return {
        "type": "function_call_output",
        "id": _item_id(item, where, "fco"),
        "call_id": call_id,
        "output": text,
        "status": "completed",
    }


def _reasoning_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """Earlier reasoning: kept in the conversation, not shown to the model again."""
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise bad_request(f"'{where}.summary' must be a list", f"{where}.summary", "invalid_type")
    texts = []
    for i, part in enumerate(summary):
        text = part.get("text") if isinstance(part, dict) else None
        texts.append({"type": "summary_text", "text": _string(text, f"{where}.summary[{i}].text")})
    out: dict[str, Any] = {"type": "reasoning", "id": _item_id(item, where, "rs"), "summary": texts}
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        out["encrypted_content"] = _string(encrypted, _where(where, "encrypted_content"))
    return out


ITEM_PARSERS = {
    "message": _message_item,
    "function_call": _function_call_item,
    "function_call_output": _function_output_item,
    "reasoning": _reasoning_item,
}


def parse_input(value: Any) -> list[dict[str, Any]]:
    """`input` (a string or a list of items) -> normalized items, each with an id."""
    if isinstance(value, str):
        return [_message_item({"role": "user", "content": value}, "input")]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of items", "input", "invalid_type")
    if len(value) > MAX_INPUT_ITEMS:
        raise bad_request(
            f"'input' has {len(value)} items; at most {MAX_INPUT_ITEMS} are accepted", "input"
        )
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", where, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        parser = ITEM_PARSERS.get(kind) if isinstance(kind, str) else None
        if parser is None:
            shown = kind if isinstance(kind, str) else None
            hint = " (use previous_response_id)" if kind == "item_reference" else ""
            raise bad_request(
                f"'{where}.type' {shown!r} is not supported: message, function_call, "
                f"function_call_output or reasoning{hint}",
                f"{where}.type",
                "unsupported_value",
            )
        items.append(parser(item, where))
    return items


def _text_of(item: dict[str, Any]) -> str:
    return "".join(p["text"] for p in item["content"])


def to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Normalized items -> chat messages. Leading system and developer messages (instructions
    first) are merged into one (many templates take a single system message, first); a
    function_call joins the assistant message before it as one of its tool_calls."""
    out: list[dict[str, Any]] = []
    system: list[str] = [instructions] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "system" and not out:
                system.append(_text_of(item))
                continue
            out.append({"role": role, "content": _text_of(item)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out


# --- tools and formats ------------------------------------------------------------------------


def _tools(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int], list[str]]:
    """(chat tools, the function tools as echoed, the Responses index of each chat tool, the
    tool types left out)."""
    if value is None:
        return [], [], [], []
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list", "tools", "invalid_type")
    chat: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    index: list[int] = []
    dropped: list[str] = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"'tools[{i}]' must be an object with a 'type'", f"tools[{i}]")
        if kind != "function":
            dropped.append(f"tools.{kind}")
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        chat.append({"type": "function", "function": fn})
        echo.append(
            {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict", True),
            }
        )
        index.append(i)
    return chat, echo, index, sorted(set(dropped))


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """(the chat tool_choice, the chat tools, narrowed by `allowed_tools`)."""
    if value is None or isinstance(value, str):
        return value, tools
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function":
        name = _string(value.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        allowed = value.get("tools")
        mode = value.get("mode", "auto")
        if not isinstance(allowed, list) or mode not in ("auto", "required"):
            raise bad_request(
                "'tool_choice' allowed_tools needs 'mode' auto or required and a 'tools' list",
                "tool_choice",
            )
        names = {t.get("name") for t in allowed if isinstance(t, dict)}
        return mode, [t for t in tools if t["function"].get("name") in names]
    if isinstance(kind, str):
        raise bad_request(
            f"'tool_choice' asks for a {kind!r} tool, which this server does not offer",
            "tool_choice",
            "unsupported_value",
        )
    raise bad_request(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _text_format(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text` -> (the chat response_format, the `text` echoed)."""
    if value is None:
        return None, {"format": {"type": "text"}, "verbosity": "medium"}
    if not isinstance(value, dict):
        raise bad_request("'text' must be an object", "text", "invalid_type")
    verbosity = value.get("verbosity", "medium")
    if verbosity not in (None, "low", "medium", "high"):
        raise bad_request("'text.verbosity' must be low, medium or high", "text.verbosity")
    fmt = value.get("format", {"type": "text"})
    if fmt is None:
        fmt = {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    echo = {"format": fmt, "verbosity": verbosity}
    if kind in ("text", "json_object"):
        return {"type": kind}, echo
    if kind != "json_schema":
        raise bad_request(
            "'text.format.type' must be text, json_object or json_schema", "text.format.type"
        )
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request(
            "'text.format.schema' must be a JSON schema object",
            "text.format.schema",
            "invalid_type",
        )
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    echo = {"format": {"name": "response", **fmt}, "verbosity": verbosity}
    return {"type": "json_schema", "json_schema": spec}, echo


def _reasoning(value: Any) -> dict[str, Any]:
    """`reasoning`, validated and echoed; its `effort` becomes chat's `reasoning_effort` (none
    and minimal turn a thinking model's reasoning off; other values reach the template)."""
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise bad_request("'reasoning' must be an object", "reasoning", "invalid_type")
    effort, summary = value.get("effort"), value.get("summary", value.get("generate_summary"))
    if effort is not None and effort not in REASONING_EFFORTS:
        shown = ", ".join(sorted(REASONING_EFFORTS))
        raise bad_request(f"'reasoning.effort' must be one of {shown}", "reasoning.effort")
    if summary is not None and summary not in REASONING_SUMMARIES:
        raise bad_request(
            "'reasoning.summary' must be auto, concise or detailed", "reasoning.summary"
        )
    return {"effort": effort, "summary": summary}


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise bad_request(
            f"'metadata' must be an object of at most {MAX_METADATA} string values", "metadata"
        )
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise bad_request(
                "'metadata' keys take at most 64 characters, values are strings of at most 512",
                "metadata",
            )
    return dict(value)


def _check_scalars(body: dict[str, Any]) -> None:
    if body.get("background") is True:
        raise bad_request(
            "'background': true is not supported; send 'stream': true instead",
            "background",
            "unsupported_value",
        )
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise bad_request(
                f"'{key}' is not supported by this server (use previous_response_id and input)",
                key,
                "unsupported_value",
            )
    for key in ("store", "stream", "parallel_tool_calls", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise bad_request(f"'{key}' must be a boolean", key, "invalid_type")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad_request("'truncation' must be auto or disabled", "truncation")
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(i, str) for i in include)
    ):
        raise bad_request("'include' must be a list of strings", "include", "invalid_type")
    top = body.get("top_logprobs")
    bad_top = isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20
    if top is not None and bad_top:
        raise bad_request("'top_logprobs' must be an integer from 0 to 20", "top_logprobs")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    _string(body.get("instructions"), "instructions", required=False)


# --- the request ------------------------------------------------------------------------------


@dataclass
class Plan:
    """A Responses request translated: the chat body and what the response object echoes."""

    chat_body: dict[str, Any]
    input_items: list[dict[str, Any]]
    prefix: list[dict[str, Any]]  # the stored conversation chained onto (previous_response_id)
    prefix_bytes: int
    echo: dict[str, Any]
    store: bool
    tool_index: list[int] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def rename(self, err: APIError) -> APIError:
        """An error of the chat validator in this dialect's names (`input`, `max_output_tokens`,
        `text.format`, `tools[i].name`)."""
        err.message = self._names(err.message)
        err.param = None if err.param is None else self._names(err.param)
        return err

    def _names(self, text: str) -> str:
        def tool(m: re.Match[str]) -> str:
            i = int(m[1])
            return f"tools[{self.tool_index[i] if i < len(self.tool_index) else i}]"

        text = re.sub(r"tools\[(\d+)\]\.function", tool, text)
        text = text.replace("response_format.json_schema.", "text.format.")
        text = text.replace("response_format", "text.format")
        text = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", text)
        text = re.sub(r"'messages(\[\d+\])?", "'input", text)  # a quoted field name
        return "input" if text.startswith("messages") else text  # a param


def plan_request(body: Any, store: ResponseStore) -> Plan:
    """Validate a Responses body and translate it to the chat pipeline's (400 naming the field;
    404 for a `previous_response_id` that is not stored here)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    _check_scalars(body)
    prefix: list[dict[str, Any]] = []
    prefix_bytes = 0
    previous = body.get("previous_response_id")
    if previous is not None:
        entry = lookup(store, _string(previous, "previous_response_id"), "previous_response_id")
        if entry.in_flight:
            raise bad_request(
                f"previous response {previous!r} is still in progress", "previous_response_id"
            )
        prefix, prefix_bytes = entry.conversation, entry.conversation_bytes
    if body.get("input") is None and not prefix:
        raise bad_request("'input' is required", "input")
    items = parse_input(body.get("input", []))
    if len(prefix) + len(items) > MAX_INPUT_ITEMS:
        raise bad_request(
            f"the conversation has {len(prefix) + len(items)} items with the previous response's;"
            f" at most {MAX_INPUT_ITEMS} are accepted",
            "input",
        )
    instructions = body.get("instructions")
    messages = to_messages(prefix + items, instructions)
    if not messages:
        raise bad_request("'input' holds no message the model could answer", "input")
    chat_tools, echo_tools, tool_index, dropped = _tools(body.get("tools"))
    choice, allowed = _tool_choice(body.get("tool_choice"), chat_tools)
    tool_index = [i for i, t in zip(tool_index, chat_tools, strict=True) if t in allowed]
    chat_tools = allowed
    response_format, text_echo = _text_format(body.get("text"))
    chat: dict[str, Any] = {"messages": messages}
    passed = (
        "model",
        "temperature",
        "top_p",
        "stop",
        "ignore_eos",
        "stream",
        "parallel_tool_calls",
        "speculative",
    )
    for key in passed:
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = _reasoning(body.get("reasoning"))
    if reasoning["effort"] is not None:  # as chat's reasoning_effort (docs/api.md, "Reasoning")
        chat["reasoning_effort"] = reasoning["effort"]
    if chat_tools:
        chat["tools"] = chat_tools
        if choice is not None:
            chat["tool_choice"] = choice
    elif choice == "required" or isinstance(choice, dict):
        chat["tool_choice"] = choice  # the chat validator says why it cannot be
    if response_format is not None and response_format["type"] != "text":
        chat["response_format"] = response_format
    echo = {
        "instructions": instructions,
        "tools": echo_tools,
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": previous,
        "text": text_echo,
        "reasoning": reasoning,
        "metadata": _metadata(body.get("metadata")),
        "store": body.get("store", True),
        "truncation": body.get("truncation", "disabled"),
        "top_logprobs": body.get("top_logprobs", 0),
        "user": body.get("user"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "service_tier": "default",
        "background": False,
    }
    return Plan(
        chat_body=chat,
        input_items=items,
        prefix=prefix,
        prefix_bytes=prefix_bytes,
        echo=echo,
        store=body.get("store", True) is not False,
        tool_index=tool_index,
        dropped=dropped,
    )


def lookup(store: ResponseStore, response_id: str, param: str | None = None) -> StoredResponse:
    entry = store.get(response_id) if ID_RE.match(response_id) else None
    if entry is None:
        shown = response_id[:80]
        raise APIError(
            404,
            f"no response with id {shown!r} is stored here (never made here, stored with "
            "store: false, deleted, or evicted from the response store)",
            "invalid_request_error",
            "response_not_found",
            param,
        )
    return entry


# --- the response -----------------------------------------------------------------------------


def usage_of(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" or text else [],
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A thinking model's reasoning, as OpenAI returns an open model's (`reasoning_text`
    content, no summary: the model writes none)."""
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": content if status == "completed" or text else [],
        "status": status,
    }


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def output_text(output: list[dict[str, Any]]) -> str:
    return "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


class Run:
    """One response's life: its object, its store entry (in flight, then final)."""

    def __init__(
        self, plan: Plan, response_id: str, model: str, store: ResponseStore, turn: Turn
    ) -> None:
        self.plan = plan
        self.id = response_id
        self.model = model
        self.store = store
        self.turn = turn
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.entry: StoredResponse | None = None
        self.client_left = False
        self.partial: TextItem | None = None  # the message item being streamed
        self.thinking: TextItem | None = None  # the reasoning item being streamed
        if plan.store:
            self.entry = StoredResponse(
                id=response_id,
                response=self.response("in_progress"),
                input_items=plan.input_items,
                conversation=plan.prefix + plan.input_items,
                conversation_bytes=plan.prefix_bytes + json_size(plan.input_items),
                abort=turn.gen.abort,
            )
            store.put(self.entry)

    @property
    def cancelled(self) -> bool:
        return self.entry is not None and self.entry.cancelled

    def response(
        self,
        status: str,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        output = list(self.output) if status != "in_progress" else []
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "output_text": output_text(output),
            "usage": usage,
            **self.plan.echo,
        }

    def status(self) -> str:
        if self.cancelled or self.turn.gen.finish_reason == "abort":
            return "cancelled"
        return "incomplete" if self.turn.finish_reason == "length" else "completed"

    def finish(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The final response object, stored (with the conversation) unless `store: false`."""
        usage = usage_of(self.turn.gen.usage)
        self.final = self.response(status, usage, error)
        if self.entry is not None:
            self.entry.response = self.final
            self.entry.abort = None
            self.entry.conversation = self.entry.conversation + self.output
            self.entry.conversation_bytes += json_size(self.output)
            self.store.put(self.entry)
        return self.final

    def settle(self) -> None:
        """After the handler: a response that never finished is stored as it stood,
        `cancelled` when it was cancelled or its client left, `failed` otherwise."""
        if self.final is not None:
            return
        for streaming in (self.thinking, self.partial):
            if streaming is not None:
                streaming.keep()
        if self.cancelled or self.client_left:
            self.finish("cancelled")
        else:
            self.finish("failed", _server_error("the response ended before it was complete"))

    def add_text(self, text: str) -> None:
        self.output.append(message_item(new_id("msg"), text))

    def add_reasoning(self, text: str) -> None:
        self.output.append(reasoning_item(new_id("rs"), text))

    def answered(self) -> bool:
        """Whether the output has a message or a call (not only reasoning)."""
        return any(item["type"] != "reasoning" for item in self.output)

    def add_call(self, call: ToolCall) -> dict[str, Any]:
        item = call_item(new_id("fc"), call)
        self.output.append(item)
        return item


def _server_error(message: str) -> dict[str, Any]:
    return {"code": "server_error", "message": message}


async def handle_create(
    request: web.Request, state: ServingState, ctx: ModelContext, body: Any
) -> web.StreamResponse:
    store: ResponseStore = request.app[RESPONSES]
    with counting_rejections(state, ctx):
        plan = plan_request(body, store)
        unknown = tuple(sorted(set(body) - KNOWN_FIELDS - HARMLESS_FIELDS))
        if unknown and state.strict_api:
            raise bad_request(f"unknown field '{unknown[0]}'", unknown[0], "unknown_field")
    note_ignored(request, unknown + tuple(plan.dropped))
    try:
        chat = await prepare_chat(request, state, ctx, plan.chat_body)
    except APIError as err:
        raise plan.rename(err) from None
    options = clamp_max_tokens(ctx, len(chat.prompt_ids), chat.req.options)
    # the sampling used, the daemon's defaults included (--temperature, --top-p)
    plan.echo["temperature"] = options.sampling.temperature
    plan.echo["top_p"] = options.sampling.top_p
    response_id = new_id("resp")
    try:
        gen = open_generation(
            state, ctx, response_id, chat.prompt_ids, options, request.path, chat.reasoning
        )
    except APIError as err:
        raise plan.rename(err) from None
    turn = Turn(gen, chat.mode)
    run = Run(plan, response_id, ctx.name, store, turn)
    try:
        if options.stream:
            return await _stream(request, run, stream_timeout(ctx))
        return await _respond(run)
    except asyncio.CancelledError:  # the connection was lost (handler cancellation)
        run.client_left = True
        raise
    finally:
        gen.abort()  # the client left before or while reading: free the slot and KV now
        run.settle()


async def _respond(run: Run) -> web.Response:
    try:
        merged = await run.turn.collect()
    except APIError as err:  # the engine failed
        run.finish("failed", _server_error(err.message))
        raise
    if merged.reasoning:
        run.add_reasoning(merged.reasoning)
    if merged.text or not run.turn.tool_calls:
        run.add_text(merged.text)
    for call in run.turn.tool_calls:
        run.add_call(call)
    return web.json_response(run.finish(run.status()))


class EventWriter:
    """The Responses SSE events, numbered by `sequence_number` from 0."""

    def __init__(self, out: StreamOut) -> None:
        self.out = out
        self.sequence = 0

    async def emit(self, kind: str, **data: Any) -> None:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        await self.out.write(f"event: {kind}\ndata: {text}\n\n".encode())


class TextItem:
    """The message item (or, `reasoning`, the reasoning item) being streamed: added, its
    part, deltas (`response.output_text.delta` / `response.reasoning_text.delta`), then done."""

    def __init__(self, events: EventWriter, run: Run, reasoning: bool = False) -> None:
        self.events = events
        self.run = run
        self.reasoning = reasoning
        self.kind = "reasoning_text" if reasoning else "output_text"
        self.item_id: str | None = None
        self.index = 0
        self.texts: list[str] = []

    def item(self, text: str, status: str = "completed") -> dict[str, Any]:
        assert self.item_id is not None
        build = reasoning_item if self.reasoning else message_item
        return build(self.item_id, text, status)

    def _extra(self) -> dict[str, Any]:
        return {} if self.reasoning else {"logprobs": []}

    async def delta(self, text: str) -> None:
        if self.item_id is None:
            self.item_id = new_id("rs" if self.reasoning else "msg")
            self.index = len(self.run.output)
            self.run.output.append(self.item("", "in_progress"))
            await self.events.emit(
                "response.output_item.added",
                output_index=self.index,
                item=self.item("", "in_progress"),
            )
            part: dict[str, Any] = {"type": self.kind, "text": ""}
            if not self.reasoning:
                part.update(annotations=[], logprobs=[])
            await self.events.emit(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=self.index,
                content_index=0,
                part=part,
            )
        self.texts.append(text)
        await self.events.emit(
            f"response.{self.kind}.delta",
            item_id=self.item_id,
            output_index=self.index,
            content_index=0,
            delta=text,
            **self._extra(),
        )

    def keep(self) -> None:
        """The text so far as the item's final state (the stream ended early)."""
        if self.item_id is not None:
            self.run.output[self.index] = self.item("".join(self.texts), "incomplete")

    async def close(self) -> None:
        if self.item_id is None:
            return
        text = "".join(self.texts)
        item = self.item(text)
        self.run.output[self.index] = item
        where = {"item_id": self.item_id, "output_index": self.index, "content_index": 0}
        await self.events.emit(f"response.{self.kind}.done", **where, text=text, **self._extra())
        await self.events.emit("response.content_part.done", **where, part=item["content"][0])
        await self.events.emit("response.output_item.done", output_index=self.index, item=item)
        self.item_id, self.texts = None, []


async def _call(events: EventWriter, run: Run, call: ToolCall) -> None:
    index = len(run.output)
    item = run.add_call(call)
    added = {**item, "arguments": "", "status": "in_progress"}
    await events.emit("response.output_item.added", output_index=index, item=added)
    where = {"item_id": item["id"], "output_index": index}
    await events.emit("response.function_call_arguments.delta", **where, delta=call.arguments)
    await events.emit(
        "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
    )
    await events.emit("response.output_item.done", output_index=index, item=item)


async def _stream(
    request: web.Request, run: Run, timeout: float = DEFAULT_STREAM_TIMEOUT_S
) -> web.StreamResponse:
    """The Responses SSE events; every write bounded by `timeout` (stream_write.py)."""
    http_resp = web.StreamResponse(headers=SSE_HEADERS)
    events = EventWriter(StreamOut(request, http_resp, run.id, timeout))
    try:
        await http_resp.prepare(request)
        start = run.response("in_progress")
        await events.emit("response.created", response=start)
        await events.emit("response.in_progress", response=start)
        text = run.partial = TextItem(events, run)
        thinking = run.thinking = TextItem(events, run, reasoning=True)
        try:
            async with contextlib.aclosing(run.turn.events()) as turn_events:
                async for event in turn_events:
                    if event.reasoning:  # a thinking model's, before its answer
                        await text.close()
                        await thinking.delta(event.reasoning)
                    if event.text:
                        await thinking.close()
                        await text.delta(event.text)
                    for call in event.tool_calls:
                        await thinking.close()
                        await text.close()
                        await _call(events, run, call)
        except GenerationFailed as exc:
            await thinking.close()
            await text.close()
            failed = run.finish("failed", _server_error(str(exc)))
            await events.emit("response.failed", response=failed)
            await events.out.write_eof()
            return http_resp
        await thinking.close()
        if not run.answered():
            await text.delta("")  # an empty answer is still one message
        await text.close()
        status = run.status()
        final = run.finish(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        await events.emit(kind, response=final)
        await events.out.write_eof()
    except ConnectionResetError:  # the client left or stopped reading
        run.client_left = True  # the caller aborts the engine request, settles the response
    return http_resp


# --- the stored responses' routes ----------------------------------------------------------------


def _store(request: web.Request) -> ResponseStore:
    return request.app[RESPONSES]


async def handle_get(request: web.Request) -> web.Response:
    entry = lookup(_store(request), request.match_info["response_id"])
    if request.query.get("stream") in ("true", "1"):
        raise bad_request(
            "streaming a stored response again is not supported", "stream", "unsupported_value"
        )
    return web.json_response(entry.response)


async def handle_delete(request: web.Request) -> web.Response:
    store = _store(request)
    entry = lookup(store, request.match_info["response_id"])
    store.delete(entry.id)
    return web.json_response({"id": entry.id, "object": "response.deleted", "deleted": True})


async def handle_cancel(request: web.Request) -> web.Response:
    """Cancel an in-flight response: its generation stops, it ends `cancelled`. A finished one
    cannot be (400, as OpenAI answers for a response that is not in progress)."""
    entry = lookup(_store(request), request.match_info["response_id"])
    if not entry.in_flight:
        raise bad_request(
            f"response {entry.id!r} is {entry.response.get('status')}: only a response in "
            "progress can be cancelled",
            None,
            "response_not_cancellable",
        )
    entry.cancelled = True
    if entry.abort is not None:
        entry.abort()
    # The handler finishes it: wait briefly for the final object (usage, output so far).
    for _ in range(100):
        if not entry.in_flight:
            break
        await asyncio.sleep(0.02)
    response = dict(entry.response)
    response["status"] = "cancelled"
    return web.json_response(response)


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request("'limit' must be an integer from 1 to 100", "limit")
    return limit


async def handle_input_items(request: web.Request) -> web.Response:
    entry = lookup(_store(request), request.match_info["response_id"])
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be asc or desc", "order")
    items = list(entry.input_items if order == "asc" else reversed(entry.input_items))
    after = request.query.get("after")
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise bad_request(f"'after' {after[:80]!r} is not an item of this response", "after")
        items = items[ids.index(after) + 1 :]
    limit = _limit(request)
    page = items[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
