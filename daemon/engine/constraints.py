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

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
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
