"""OpenAI response objects and stream chunks for chat and text completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ResponseShape:
    """What every object of one response shares."""

    kind: str  # chat | text
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def _choice(
        self,
        text: str,
        finish_reason: str | None,
        delta: bool,
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        if self.kind == "text":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if delta:
            content: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            if reasoning:  # a reasoning delta: `reasoning_content` (and content only if any)
                content = {"reasoning_content": reasoning, **({"content": text} if text else {})}
            if tool_calls:
                content = {"tool_calls": tool_calls}
            return {
                "index": 0,
                "delta": content,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if reasoning:  # a thinking model's reasoning, apart from the answer (vLLM, llama.cpp)
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "logprobs": logprobs}
        return {**choice, "finish_reason": finish_reason}

    def response(
        self,
        text: str,
        finish_reason: str,
        usage: dict[str, Any],
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        obj = self._base("chat.completion" if self.kind == "chat" else "text_completion")
        choice = self._choice(text, finish_reason, False, tool_calls, logprobs, reasoning)
        obj["choices"] = [choice]
        obj["usage"] = usage
        return obj

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        include_usage: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        obj = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        choice = self._choice(text, finish_reason, True, tool_calls, logprobs, reasoning)
        obj["choices"] = [choice]
        if include_usage:
            obj["usage"] = None
        return obj

    def role_chunk(self, include_usage: bool) -> dict[str, Any]:
        obj = self.chunk("", None, include_usage)
        obj["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return obj

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage
        return obj


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


_TEXT_MARK = "\ue000mlxcel-text\ue000"  # a private-use string no JSON escape of text contains


class TextChunkSSE:
    """The SSE bytes of a response's plain text chunks, from a template built once: per chunk
    only the text is JSON-escaped (the bytes `sse(shape.chunk(text, None, include_usage))`
    gives, without building and encoding the whole object each token)."""

    def __init__(self, shape: ResponseShape, include_usage: bool, reasoning: bool = False) -> None:
        """`reasoning`: chunks of `delta.reasoning_content` instead of `delta.content`."""
        if reasoning:
            data = sse(shape.chunk("", None, include_usage, reasoning=_TEXT_MARK))
        else:
            data = sse(shape.chunk(_TEXT_MARK, None, include_usage))
        head, tail = data.split(json.dumps(_TEXT_MARK).encode())
        self._head, self._tail = head, tail

    def __call__(self, text: str) -> bytes:
        # json.dumps' own string escape (ASCII, as json.dumps(obj) writes strings)
        return self._head + _escape(text).encode() + self._tail


_escape = json.encoder.encode_basestring_ascii


SSE_DONE = sse("[DONE]")
