"""One assistant turn: the generation's text split into content and tool calls.

Three tool modes, whatever the dialect (OpenAI, Anthropic, Ollama) that formats the events:
- off: the text is the content;
- auto: the model's own tool-call markup (mlx-lm's parser for its chat template, e.g.
  `<tool_call>{...}</tool_call>`) is cut out of the content and parsed into calls;
- forced: the whole output was generated under the forced-call JSON schema and is one call.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from mlxcel.daemon.server.generation import Generation, GenerationFailed, TokenLogprob
from mlxcel.daemon.server.tool_schema import ToolCall, ToolChoice, new_call_id, tool_calls_from_json

log = logging.getLogger("mlxcel.http")

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ToolMode:
    kind: str = "off"  # off | auto | forced
    tools: list[dict[str, Any]] = field(default_factory=list)
    parser: Callable[[str, Any], Any] | None = None
    start: str | None = None
    end: str | None = None


def tool_mode(tokenizer: Any, tools: list[dict[str, Any]], choice: ToolChoice) -> ToolMode:
    if not tools or choice.mode == "none":
        return ToolMode()
    if choice.forced:
        return ToolMode("forced", tools)
    if not getattr(tokenizer, "has_tool_calling", False):
        return ToolMode()  # the template has no tool-call markup we could parse
    return ToolMode(
        "auto", tools, tokenizer.tool_parser, tokenizer.tool_call_start, tokenizer.tool_call_end
    )


def template_tools(tools: list[dict[str, Any]], choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The tools the chat template shows the model (the named one only, when forced)."""
    if not tools or choice.mode == "none":
        return None
    if choice.mode == "named":
        return [t for t in tools if t["function"]["name"] == choice.name]
    return tools


class ToolCallSplitter:
    """Cuts `start ... end` spans out of streamed text; holds back a possible partial `start`."""

    def __init__(self, start: str, end: str) -> None:
        self.start = start
        self.end = end
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[str]]:
        self._buf += text
        content: list[str] = []
        calls: list[str] = []
        while True:
            if self._in_call:
                j = self._buf.find(self.end)
                if j < 0:
                    break
                calls.append(self._buf[:j])
                self._buf = self._buf[j + len(self.end) :]
                self._in_call = False
                continue
            i = self._buf.find(self.start)
            if i < 0:
                hold = self._partial_start()
                content.append(self._buf[: len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold :]
                break
            content.append(self._buf[:i])
            self._buf = self._buf[i + len(self.start) :]
            self._in_call = True
        return "".join(content), calls

    def _partial_start(self) -> int:
        for k in range(min(len(self.start) - 1, len(self._buf)), 0, -1):
            if self.start.startswith(self._buf[-k:]):
                return k
        return 0

    def finish(self) -> tuple[str, list[str]]:
        """What is left: an unterminated call is still tried as a call."""
        rest, self._buf = self._buf, ""
        return ("", [rest]) if self._in_call else (rest, [])


def parse_calls(mode: ToolMode, texts: list[str]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for text in texts:
        try:
            parsed = mode.parser(text, mode.tools) if mode.parser else None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("could not parse a tool call (%s): %.200r", exc, text)
            continue
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = item.get("arguments", {})
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(ToolCall(item.get("id") or new_call_id(), item["name"], args))
    return calls


@dataclass
class TurnEvent:
    """A piece of the turn: answer text (`text`), reasoning text (`reasoning`: a thinking
    model's, never part of `text`), tool calls, and the logprobs of the tokens read."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""

    @property
    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.tool_calls or self.logprobs)


class Turn:
    """Iterate `events()`; afterwards `finish_reason`, `tool_calls` and the usage are set.

    When the generation has a reasoning plan (`gen.reasoning`), the text goes through its
    ReasoningParser first: the reasoning comes out in `TurnEvent.reasoning`, and only the
    answer reaches the tool-call parsing."""

    def __init__(self, gen: Generation, mode: ToolMode) -> None:
        self.gen = gen
        self.mode = mode
        self.tool_calls: list[ToolCall] = []
        plan = getattr(gen, "reasoning", None)
        self.reasoning = plan.parser() if plan is not None else None

    @property
    def finish_reason(self) -> str:
        if self.tool_calls and self.gen.finish_reason in (None, "stop"):
            return FINISH_TOOL_CALLS
        return self.gen.finish_reason or "stop"

    async def collect(self) -> TurnEvent:
        """The whole answer at once (non-streaming responses): every event's text joined and
        logprobs merged; an engine failure is a 500 in the caller's dialect."""
        merged = TurnEvent()
        texts: list[str] = []
        thoughts: list[str] = []
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for event in events:
                    texts.append(event.text)
                    thoughts.append(event.reasoning)
                    merged.logprobs.extend(event.logprobs)
        except GenerationFailed as exc:
            raise exc.api_error() from None
        merged.text = "".join(texts)
        merged.reasoning = "".join(thoughts)
        return merged

    async def _texts(self) -> AsyncGenerator[tuple[str, str], None]:
        """The generation's pieces as (reasoning, content); the parser's held-back tail last."""
        parser = self.reasoning
        async with contextlib.aclosing(self.gen.pieces()) as pieces:
            async for text in pieces:
                yield parser.feed(text) if parser is not None else ("", text)
        if parser is not None:
            yield parser.finish()

    async def events(self) -> AsyncGenerator[TurnEvent, None]:
        if self.mode.kind == "forced":
            async for event in self._forced():
                yield event
            return
        splitter = (
            ToolCallSplitter(self.mode.start, self.mode.end)
            if self.mode.kind == "auto" and self.mode.start and self.mode.end
            else None
        )
        if self.reasoning is None:
            async with contextlib.aclosing(self.gen.pieces()) as pieces:
                if splitter is None and not self.gen.wants_logprobs:  # plain text, per token
                    async for text in pieces:
                        if text:
                            yield TurnEvent(text)
                    return
                async for text in pieces:
                    content, raw = splitter.feed(text) if splitter else (text, [])
                    event = self._event(content, raw)
                    if not event.empty:
                        yield event
        else:  # the reasoning first, then the answer's tool calls
            async with contextlib.aclosing(self._texts()) as texts:
                async for thought, text in texts:
                    content, raw = splitter.feed(text) if splitter else (text, [])
                    event = self._event(content, raw, thought)
                    if not event.empty:
                        yield event
        # What the splitter holds, and the logprobs of trailing tokens that made no text.
        content, raw = splitter.finish() if splitter else ("", [])
        event = self._event(content, raw)
        if not event.empty:
            yield event

    def _event(self, content: str, raw: list[str], reasoning: str = "") -> TurnEvent:
        calls = parse_calls(self.mode, raw) if raw else []
        if self.reasoning is not None:  # calls the reasoning markup carries (harmony)
            calls += [ToolCall(new_call_id(), n, a) for n, a in self.reasoning.take_calls()]
        self.tool_calls.extend(calls)
        return TurnEvent(content, calls, self.gen.take_logprobs(), reasoning)

    async def _forced(self) -> AsyncGenerator[TurnEvent, None]:
        """The answer is the call's JSON (generated under its schema); the reasoning before it
        streams as it comes."""
        parts = []
        async with contextlib.aclosing(self._texts()) as texts:
            async for thought, text in texts:
                parts.append(text)
                if thought:
                    yield TurnEvent(reasoning=thought)
        text = "".join(parts)
        calls = tool_calls_from_json(text)
        if calls is None and self.reasoning is not None:  # a call in the markup (harmony)
            carried = self.reasoning.take_calls()
            calls = [ToolCall(new_call_id(), n, a) for n, a in carried] or None
        if calls is None:  # cut short (max_tokens): hand back what was generated
            yield TurnEvent(text, [], self.gen.take_logprobs())
            return
        self.tool_calls = calls
        yield TurnEvent("", calls, self.gen.take_logprobs())
