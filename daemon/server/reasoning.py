"""Thinking models: the reasoning kept apart from the answer (docs/api.md, "Reasoning").

Plain Python. Per model, `detect(tokenizer)` finds the reasoning markup from its vocabulary and
chat template, once (cached per tokenizer), as mlx-lm's TokenizerWrapper (`think_start`,
`think_end`) and llama.cpp do:
- `<think>` ... `</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills; mlx-lm's other tag pairs),
  including templates that open `<think>` in the generation prompt themselves, so the output
  starts inside the reasoning (`ReasoningFormat.opens_in(prompt_ids)`);
- gpt-oss harmony channels: `<|channel|>analysis<|message|>...<|end|>` is reasoning,
  `<|channel|>final<|message|>...` the answer.

Per request, a `ReasoningPlan` (the format, whether the prompt opened the reasoning, the budget)
gives the engine its `ReasoningSpec` (budget, constraint gate: constraints.ReasoningGate), the
HTTP layer a `ReasoningParser` (detokenized text -> (reasoning, content) pieces, robust to
markup split across tokens and chunks) and a token counter (constraints.ReasoningTracker).
A model without markup has no format: nothing changes, nothing is computed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from mlxcel.daemon.engine.constraints import ReasoningTracker
from mlxcel.daemon.engine.types import ReasoningSpec
from mlxcel.daemon.mlx_lm_compat import wrapped_tokenizer

THINK = "think"
HARMONY = "harmony"
# Tag pairs of single-token thinking modes, as mlx-lm knows them (tokenizer_utils._infer_thinking).
THINK_TAGS = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)
# gpt-oss harmony (https://cookbook.openai.com/articles/openai-harmony)
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_RETURN, H_CALL, H_CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
HARMONY_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL, H_CONSTRAIN)
HARMONY_REASONING_CHANNEL = "analysis"
HARMONY_FINAL = H_CHANNEL + "final" + H_MESSAGE
HARMONY_CLOSE = H_END + H_START + "assistant" + HARMONY_FINAL
# The prompt opened the reasoning when its start tag is among its last tokens, unclosed.
OPEN_TAIL_TOKENS = 8

_FORMATS: weakref.WeakKeyDictionary[Any, ReasoningFormat | None] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's reasoning markup: its text and token ids."""

    kind: str  # THINK | HARMONY
    start: str  # the text that opens the reasoning
    end: str  # the text that ends it (harmony: the final channel's header)
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    close_ids: tuple[int, ...]  # what the engine forces when the budget is spent
    markup_ids: frozenset[int]  # rendered as text for the parser, even when special tokens

    def opens_in(self, prompt_ids: list[int] | tuple[int, ...]) -> bool:
        """Whether generation starts inside the reasoning: a harmony answer always begins with
        its channel headers; a `<think>` model's when its template ended the prompt with an
        open `<think>` (DeepSeek-R1, Qwen3 thinking templates), closed by no `</think>`."""
        if self.kind == HARMONY:
            return True
        tail = list(prompt_ids[-(OPEN_TAIL_TOKENS + len(self.start_ids)) :])
        start = _rfind(tail, self.start_ids)
        return start >= 0 and _rfind(tail[start:], self.end_ids) < 0

    def plan(self, prompt_ids: list[int] | tuple[int, ...], budget: int | None) -> ReasoningPlan:
        return ReasoningPlan(self, self.opens_in(prompt_ids), budget)


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning: the model's format, whether the prompt opened the reasoning,
    the budget (None: the server's default; -1: unbounded; 0: closed at once)."""

    format: ReasoningFormat
    open: bool
    budget: int | None = None

    def spec(self) -> ReasoningSpec:
        """What the engine needs (SamplingParams.reasoning)."""
        fmt = self.format
        start_ids = () if fmt.kind == HARMONY else fmt.start_ids
        return ReasoningSpec(start_ids, fmt.end_ids, fmt.close_ids, self.open, self.budget)

    def parser(self) -> ReasoningParser:
        if self.format.kind == HARMONY:
            return HarmonyParser()
        return ThinkParser(self.format.start, self.format.end, self.open)

    def tracker(self) -> ReasoningTracker:
        """Counts the reasoning tokens as the engine does (usage.reasoning_tokens)."""
        return ReasoningTracker(self.spec())


def _rfind(tokens: list[int], seq: tuple[int, ...]) -> int:
    if not seq:
        return -1
    for i in range(len(tokens) - len(seq), -1, -1):
        if tuple(tokens[i : i + len(seq)]) == seq:
            return i
    return -1


def _template_text(tokenizer: Any) -> str | None:
    """The chat template's source (all of them, for a dict of named templates), or None."""
    hf = wrapped_tokenizer(tokenizer)
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


def known(tokenizer: Any) -> bool:
    """Whether `detect(tokenizer)` is a lookup now."""
    try:
        return tokenizer in _FORMATS
    except TypeError:
        return False


def detect(tokenizer: Any) -> ReasoningFormat | None:
    """The model's reasoning markup, or None (computed once per tokenizer)."""
    try:
        return _FORMATS[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        found = _detect(tokenizer)
    except Exception:  # a tokenizer we cannot read: no reasoning markup
        found = None
    try:
        _FORMATS[tokenizer] = found
    except TypeError:  # not weak-referenceable: detected each time
        pass
    return found


def _detect(tokenizer: Any) -> ReasoningFormat | None:
    hf = wrapped_tokenizer(tokenizer)
    vocab = hf.get_vocab()
    template = _template_text(tokenizer)

    def used(*texts: str) -> bool:  # the template shows the markup (no template: the vocab)
        return template is None or any(t in template for t in texts)

    if all(m in vocab for m in (H_START, H_CHANNEL, H_MESSAGE, H_END)) and used(H_CHANNEL):
        markup = frozenset(int(vocab[m]) for m in HARMONY_MARKERS if m in vocab)
        final = _encode(tokenizer, HARMONY_FINAL)
        return ReasoningFormat(
            HARMONY,
            H_CHANNEL + HARMONY_REASONING_CHANNEL + H_MESSAGE,
            HARMONY_FINAL,
            _encode(tokenizer, H_CHANNEL + HARMONY_REASONING_CHANNEL + H_MESSAGE),
            final,
            _encode(tokenizer, HARMONY_CLOSE),
            markup,
        )
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):  # mlx-lm's TokenizerWrapper found it
        start_ids = tuple(getattr(tokenizer, "think_start_tokens", None) or ())
        end_ids = tuple(getattr(tokenizer, "think_end_tokens", None) or ())
    else:
        pair = next(((s, e) for s, e in THINK_TAGS if s in vocab and e in vocab), None)
        if pair is None:
            return None
        start, end = pair
        start_ids, end_ids = (int(vocab[start]),), (int(vocab[end]),)
    start_ids = start_ids or _encode(tokenizer, start)
    end_ids = end_ids or _encode(tokenizer, end)
    if not used(start, end) or not start_ids or not end_ids:
        return None
    markup = frozenset(start_ids) | frozenset(end_ids)
    return ReasoningFormat(THINK, start, end, start_ids, end_ids, end_ids, markup)


def plan_for(
    tokenizer: Any, prompt_ids: list[int] | tuple[int, ...], budget: int | None = None
) -> ReasoningPlan | None:
    """The request's ReasoningPlan, or None for a model without reasoning markup."""
    fmt = detect(tokenizer)
    return fmt.plan(prompt_ids, budget) if fmt is not None else None


# --- parsing the text ---------------------------------------------------------------------


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers` (held back)."""
    longest = max((len(m) for m in markers), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class ReasoningParser:
    """Detokenized text in, (reasoning_delta, content_delta) out; `finish()` flushes what was
    held back (a possible partial tag)."""

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def take_calls(self) -> list[tuple[str, str]]:
        """Tool calls the markup itself carries, (name, arguments JSON text), completed since
        the last call (harmony's `to=functions.NAME` messages); none for `<think>` models."""
        return []

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, str]:
        """All at once (a non-streamed answer): (reasoning, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


class ThinkParser(ReasoningParser):
    """`<think>reasoning</think>answer`. The reasoning starts where the prompt opened it
    (`open`), or with the start tag as the first text (leading whitespace allowed); otherwise
    the text is all content, unchanged. Whitespace at the start of the reasoning and of the
    answer after it is dropped."""

    def __init__(self, start: str, end: str, open: bool = False) -> None:
        self.start, self.end = start, end
        self._state = REASONING if open else BEFORE
        self._buf = ""
        self._trim = open  # drop whitespace before the next piece's first character

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == BEFORE:
                rest = self._buf.lstrip()
                if rest.startswith(self.start):
                    self._buf = rest[len(self.start) :]
                    self._state, self._trim = REASONING, True
                    continue
                if not rest or self.start.startswith(rest):
                    break  # whitespace, or a partial start tag: wait
                self._state = CONTENT
                continue
            if self._state == REASONING:
                i = self._buf.find(self.end)
                if i < 0:
                    cut = len(self._buf) - _partial_suffix(self._buf, (self.end,))
                    reasoning.append(self._trimmed(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    break
                reasoning.append(self._trimmed(self._buf[:i]))
                self._buf = self._buf[i + len(self.end) :]
                self._state, self._trim = CONTENT, True
                continue
            content.append(self._trimmed(self._buf))
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def _trimmed(self, piece: str) -> str:
        if self._trim:
            piece = piece.lstrip()
            self._trim = not piece
        return piece

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == REASONING:  # unterminated: all of it reasoning
            return self._trimmed(rest), ""
        return "", rest if self._state == BEFORE else self._trimmed(rest)


class HarmonyParser(ReasoningParser):
    """gpt-oss harmony: messages `<|channel|>NAME<|message|>BODY<|end|>`, each after an
    optional `<|start|>ROLE`. The `analysis` channel is reasoning; `final` (and any other, e.g.
    `commentary`) is content; headers and markers are dropped. Text before any header is
    content. A message addressed `to=functions.NAME` is a tool call: its body is the call's
    arguments (`take_calls`), not content."""

    def __init__(self) -> None:
        self._buf = ""
        self._header = False  # reading a header (up to <|message|>)
        self._channel: str | None = None
        self._recipient: str | None = None  # the function a message is addressed to
        self._args: list[str] = []
        self._calls: list[tuple[str, str]] = []

    def take_calls(self) -> list[tuple[str, str]]:
        out, self._calls = self._calls, []
        return out

    def _end_message(self) -> None:
        if self._recipient is not None:
            self._calls.append((self._recipient, "".join(self._args).strip()))
        self._recipient, self._args = None, []

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._header:
                i = self._buf.find(H_MESSAGE)
                if i < 0:
                    break  # the header is dropped: nothing to hold back but the header
                header = self._buf[:i]
                self._buf = self._buf[i + len(H_MESSAGE) :]
                self._channel = _channel_of(header)
                self._recipient = _recipient_of(header)
                self._header = False
                continue
            hits = [(j, m) for m in HARMONY_MARKERS if (j := self._buf.find(m)) >= 0]
            if not hits:
                keep = _partial_suffix(self._buf, HARMONY_MARKERS)
                self._route(self._buf[: len(self._buf) - keep], reasoning, content)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            j, marker = min(hits)
            self._route(self._buf[:j], reasoning, content)
            self._buf = self._buf[j + len(marker) :]
            if marker in (H_START, H_END, H_RETURN, H_CALL, H_CHANNEL):
                self._end_message()  # a new header ends the message before it
                self._header, self._channel = True, None  # a header follows, up to <|message|>
        return "".join(reasoning), "".join(content)

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self._recipient is not None:
            self._args.append(text)
        else:
            (reasoning if self._channel == HARMONY_REASONING_CHANNEL else content).append(text)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._header:
            return "", ""  # an unfinished header: no text
        reasoning: list[str] = []
        content: list[str] = []
        self._route(rest, reasoning, content)
        self._end_message()  # `<|call|>` ends the generation (a stop token): never rendered
        return "".join(reasoning), "".join(content)


def _recipient_of(header: str) -> str | None:
    """The function a harmony header addresses (`... to=functions.get_weather ...`)."""
    i = header.find("to=functions.")
    if i < 0:
        return None
    rest = header[i + len("to=functions.") :].split(H_CHANNEL, 1)[0].split(H_CONSTRAIN, 1)[0]
    words = rest.split()
    return words[0] if words else None


def _channel_of(header: str) -> str:
    """The channel a harmony header names: `assistant<|channel|>final`, `analysis`,
    `commentary to=functions.f <|constrain|>json` -> final, analysis, commentary."""
    if H_CHANNEL in header:
        header = header.rsplit(H_CHANNEL, 1)[1]
    header = header.split(H_CONSTRAIN, 1)[0]
    words = header.split()
    return words[0] if words else ""


BEFORE, REASONING, CONTENT = "before", "reasoning", "content"


def split_reasoning(plan: ReasoningPlan | None, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content); without a plan, ("", text)."""
    if plan is None:
        return "", text
    return plan.parser().split(text)
