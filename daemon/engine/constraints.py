"""Constrained decoding: JSON-schema grammars on llguidance, one matcher per row.

Plain Python (numpy + llguidance, no mlx). `GrammarCache` turns a schema's text into a compiled
matcher once (validation happens there, so a schema the library cannot compile is refused in
`EngineBridge.submit`, before it is queued); each constrained row then gets a cheap copy of that
matcher (`RowConstraint`). The runners ask a row's constraint for the mask of allowed next tokens
(a numpy bool vector over the model's vocabulary) and tell it which token was sampled.

Why llguidance and not xgrammar: see docs/structured-output.md (xgrammar's wheel requires torch).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from mlxcel.daemon.mlx_lm_compat import wrapped_tokenizer

log = logging.getLogger("mlxcel.engine")

MAX_SCHEMA_CHARS = 200_000  # a bigger schema is refused before compiling
CACHE_ENTRIES = 64  # compiled schemas kept, least recently used dropped first
CACHE_CHARS = 16_000_000  # and at most this much schema text kept (the grammars scale with it)


class GrammarError(ValueError):
    """A schema that cannot be turned into a grammar; the message names the problem."""


def build_ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """An `llguidance.LLTokenizer` over the loaded model's tokenizer (mlx-lm's TokenizerWrapper
    or a Hugging Face fast tokenizer), sized to the model's logits (`vocab_size`)."""
    import llguidance

    hf = wrapped_tokenizer(tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("constrained decoding needs a Hugging Face fast tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", None) or [])
    if not eos and getattr(hf, "eos_token_id", None) is not None:
        eos = [int(hf.eos_token_id)]
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos or None)


class GrammarCache:
    """Compiled JSON-schema grammars by schema text, least recently used dropped first past
    CACHE_ENTRIES or CACHE_CHARS (thread-safe: the bridge's grammar worker compiles
    (`EngineBridge.compile_schema`, awaited by the HTTP handlers before `submit`), the engine
    thread copies). The LLTokenizer is built on first use (~0.7 s for a 49k vocabulary)."""

    def __init__(self, tokenizer: Any | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._chars = 0  # schema text held by _compiled
        self.compiles = 0  # schemas compiled (cache misses)

    @property
    def available(self) -> bool:
        return self._tokenizer is not None

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise GrammarError("constrained decoding needs the model's tokenizer")
                try:
                    self._ll_tokenizer = build_ll_tokenizer(self._tokenizer, self.vocab_size)
                except GrammarError:
                    raise
                except Exception as exc:  # a tokenizer llguidance cannot read
                    raise GrammarError(
                        f"constrained decoding is not available for this model's tokenizer: {exc}"
                    ) from None
            return self._ll_tokenizer

    def compile(self, schema: str) -> Any:
        """The compiled matcher (a template, never advanced) for `schema`; raises GrammarError.
        A refusal is cached too, so a bad schema is not compiled again to be refused again."""
        if len(schema) > MAX_SCHEMA_CHARS:  # refused before compiling, and not kept
            raise GrammarError(
                f"json_schema is {len(schema)} characters (at most {MAX_SCHEMA_CHARS})"
            )
        with self._lock:
            found = self._compiled.get(schema)
            if found is not None:
                self._compiled.move_to_end(schema)
        if isinstance(found, _Refused):
            raise GrammarError(found.message)
        if found is not None:
            return found
        try:
            matcher: Any = self._build(schema)
        except GrammarError as exc:
            matcher = _Refused(str(exc))
        with self._lock:
            if schema not in self._compiled:
                self._chars += len(schema)
            self._compiled[schema] = matcher
            self._compiled.move_to_end(schema)
            while len(self._compiled) > 1 and (
                len(self._compiled) > CACHE_ENTRIES or self._chars > CACHE_CHARS
            ):
                self._chars -= len(self._compiled.popitem(last=False)[0])
            self.compiles += 1
        if isinstance(matcher, _Refused):
            raise GrammarError(matcher.message)
        return matcher

    def cached(self, schema: str) -> bool:
        """Whether `compile(schema)` is a lookup now (a compiled grammar or a cached refusal)."""
        with self._lock:
            return len(schema) > MAX_SCHEMA_CHARS or schema in self._compiled

    def warm(self, schema: str) -> None:
        """Compile `schema` now (refusals cached too, raised later by `compile`): on the
        bridge's grammar worker (`EngineBridge.compile_schema`), never in a step and never
        under the lock the engine thread takes."""
        try:
            self.compile(schema)
        except GrammarError:
            pass

    def _build(self, schema: str) -> Any:
        import llguidance

        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise GrammarError("json_schema must be a JSON object")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                parsed, defaults={"whitespace_flexible": False}
            )
        except ValueError as exc:
            raise GrammarError(f"json_schema cannot be compiled: {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"json_schema cannot be compiled: {_first_line(matcher.get_error())}"
            )
        return matcher

    def row(self, schema: str) -> RowConstraint:
        """A fresh constraint for one row (a copy of the compiled matcher)."""
        template = self.compile(schema)
        return RowConstraint(template.deep_copy(), self.ll_tokenizer(), self.vocab_size)


class _Refused:
    """A cached refusal: the schema's GrammarError message."""

    def __init__(self, message: str) -> None:
        self.message = message


def _first_line(text: str, limit: int = 300) -> str:
    """The library's message on one line (multi-line regex errors included), cut at `limit`."""
    line = " ".join(text.split()) or "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class RowConstraint:
    """One row's grammar state. `pending_accept`: the row's next forward input is a token this
    row sampled (not a prompt token), so the matcher must consume it before the next mask."""

    def __init__(self, matcher: Any, ll_tokenizer: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(int(t) for t in ll_tokenizer.eos_tokens)
        self.pending_accept = False
        self._words = (vocab_size + 31) // 32
        self._bitmask = np.full((1, self._words), -1, dtype=np.int32)
        self.failed: str | None = None

    def accept(self, token: int) -> None:
        """Consume a sampled token (a token the mask allowed; a refusal would be a bug)."""
        if self.failed is None and not self.matcher.consume_token(int(token)):
            self.failed = _first_line(self.matcher.get_error())
            log.warning("grammar refused token %d: %s", token, self.failed)

    def advance(self, token: int) -> None:
        """Consume `token` when it was sampled by this row, then expect sampled inputs."""
        if self.pending_accept:
            self.accept(token)
        self.pending_accept = True

    def allowed(self) -> np.ndarray:
        """The allowed next tokens, a bool vector of `vocab_size`. A failed matcher allows only
        the stop tokens, so the row ends at once."""
        if self.failed is not None or self.matcher.is_error():
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[[t for t in self.stop_ids if t < self.vocab_size]] = True
            return allowed
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)


# The states of a row's reasoning (ReasoningTracker.state).
BEFORE = "before"  # nothing generated yet: the reasoning may still start
REASONING = "reasoning"
ANSWER = "answer"  # the reasoning ended (or never started): the answer


class ReasoningTracker:
    """Follows a row's generated tokens through a thinking model's reasoning markup
    (types.ReasoningSpec); plain Python, shared by the engine (budget, constraint gate) and the
    HTTP layer (usage.completion_tokens_details.reasoning_tokens).

    The reasoning starts either in the prompt (`spec.open`: the template opened it) or with
    `spec.start_ids` as the very first tokens generated; it ends with `spec.end_ids`.
    `reasoning_tokens` counts the tokens between the markup (neither tag counted)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.state = REASONING if spec.open else (BEFORE if spec.start_ids else ANSWER)
        self._matched = 0  # start_ids matched so far (BEFORE)
        self._tail: list[int] = []  # the last len(end_ids) reasoning tokens
        self.spent = 0  # tokens generated since the reasoning started, markup included

    @property
    def reasoning_tokens(self) -> int:
        if self.state == ANSWER and self.spent:
            return max(self.spent - len(self.spec.end_ids), 0)
        return self.spent

    def add(self, token: int) -> None:
        spec = self.spec
        if self.state == BEFORE:
            if token == spec.start_ids[self._matched]:
                self._matched += 1
                if self._matched == len(spec.start_ids):
                    self.state = REASONING
            else:
                self.state = ANSWER
            return
        if self.state != REASONING:
            return
        self.spent += 1
        end = spec.end_ids
        if not end:
            return
        self._tail.append(int(token))
        if len(self._tail) > len(end):
            del self._tail[0]
        if tuple(self._tail) == end:
            self.state = ANSWER


class ReasoningGate:
    """A reasoning row's token constraint, in the place of its RowConstraint (the runners see
    the same interface: `advance`, `allowed`, `pending_accept`, `stop_ids`).

    - While the row reasons, `inner` (its JSON-schema grammar, if any) is dormant: it sees no
      token, and the mask allows everything (`allowed()` is None: no mask at all).
    - Before anything is generated, with a grammar and a one-token start tag, the mask is the
      grammar's plus that tag: the model may open its reasoning, or answer in the schema.
    - Past `budget` reasoning tokens the row is made to emit `spec.close_ids` (a one-token
      mask each), which ends the reasoning; then the grammar applies, from its start state.
    """

    def __init__(
        self, spec: Any, budget: int | None, inner: RowConstraint | None, vocab_size: int
    ) -> None:
        self.tracker = ReasoningTracker(spec)
        self.budget = budget
        self.inner = inner
        self.vocab_size = inner.vocab_size if inner is not None else vocab_size
        self.stop_ids = inner.stop_ids if inner is not None else frozenset()
        self.pending_accept = False
        self.failed: str | None = None
        self._forced: list[int] = []  # tokens the row must emit next (the budget's close)
        self._closed = False  # the budget's close was queued
        if inner is not None and self.tracker.state == BEFORE and len(spec.start_ids) != 1:
            self.tracker.state = ANSWER  # a multi-token start cannot share a grammar's mask

    def accept(self, token: int) -> None:
        before = self.tracker.state
        if self._forced:
            self._forced.pop(0)  # the mask allowed nothing else
        self.tracker.add(token)
        after = self.tracker.state
        if self.inner is not None and after == ANSWER and before != REASONING:
            self.inner.accept(token)  # an answer token (the end tag itself is not one)
            self.failed = self.inner.failed

    def advance(self, token: int) -> None:
        if self.pending_accept:
            self.accept(token)
        self.pending_accept = True

    def _only(self, token: int) -> np.ndarray:
        allowed = np.zeros(max(self.vocab_size, token + 1), dtype=bool)
        allowed[token] = True
        return allowed

    def allowed(self) -> np.ndarray | None:
        """The mask of allowed next tokens, or None for no mask (the row samples freely)."""
        if self._forced:
            return self._only(self._forced[0])
        state = self.tracker.state
        if state == REASONING:
            budget = self.budget
            close = self.tracker.spec.close_ids
            if budget is not None and not self._closed and close and self.tracker.spent >= budget:
                self._closed = True
                self._forced = list(close)
                return self._only(self._forced[0])
            return None
        if self.inner is None:
            return None
        allowed = self.inner.allowed()
        if state == BEFORE:  # the grammar's first tokens, or the reasoning's start tag
            allowed = allowed.copy()
            start = self.tracker.spec.start_ids[0]
            if start < allowed.shape[0]:
                allowed[start] = True
        return allowed
