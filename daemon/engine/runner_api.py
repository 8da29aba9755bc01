"""The contract between the engine and a runner (plain Python: no mlx here).

The engine schedules; a runner executes forwards. `Runner` is what `Engine` calls each step:
`start_cohort` (admitted rows), `decode()` (the tokens of every decoding row), then
`prefill_chunk()` (the cohort's next chunk), `remove` (cancel), `reset` (after a failed step),
and `kv_payload` (a finished prompt's KV, kept by the prompt cache). `BatchRunner`
(runner.py) and `SoloRunner` (solo_runner.py) are the mlx implementations; the engine gets one
injected, or builds the default through `mlx_parts.py`, so `core.py` itself never imports
mlx (tests/unit/test_engine_boundaries.py, tests/unit/test_engine_scripted.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxcel.daemon.engine.constraints import RowConstraint
from mlxcel.daemon.engine.speculative import SpecPolicy
from mlxcel.daemon.engine.types import FINISH_LENGTH, FINISH_STOP, SamplingParams

# (logprob of the sampled token, ((token, logprob), ...) of the top ones)
RowLogprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class ModelProbe:
    kv_bytes_per_token: int  # KV bytes one token costs across all layers
    vocab_size: int


@dataclass
class RowSpec:
    """One request entering prefill."""

    uid: str
    compute_tokens: list[int]  # prompt tokens after the cached prefix (at least one)
    cached_tokens: list[int]  # the cached prefix (may be empty)
    cached_payload: Any  # the prompt cache's payload of that prefix (a runner's kv_payload)
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int
    constraint: RowConstraint | None = None  # the row's grammar (SamplingParams.json_schema)

    def stop_ids(self) -> list[int]:
        """Tokens that end the row: its stop tokens and, with a grammar, the ones a complete
        grammar allows."""
        stops = self.stop_token_ids
        if self.constraint is not None:
            stops = stops | self.constraint.stop_ids
        return sorted(stops)


@dataclass
class DecodeOutput:
    uid: str
    token: int
    finish_reason: str | None
    kv_tokens: list[int] | None = None  # on finish: the tokens whose KV `kv_caches` holds
    kv_caches: list[Any] | None = None
    logprobs: RowLogprobs | None = None  # when the row asked: (logprob, top pairs)


@dataclass
class PrefillProgress:
    uid_to_computed: dict[str, int] = field(default_factory=dict)  # prompt tokens computed
    padded_tokens: int = 0  # what the forwards computed: rows x longest, per forward
    graduated: list[str] = field(default_factory=list)  # rows that left prefill for decode
    first_tokens: list[DecodeOutput] = field(default_factory=list)  # sampled at prefill end
    # rows whose prompt is done, with `keep_prompt_kv`: (uid, tokens, per-layer caches of them)
    prompt_kv: list[tuple[str, list[int], list[Any]]] = field(default_factory=list)
    # work the runner left for after the first tokens are out (the decode batch's merged KV,
    # evaluated): the engine calls it once they are flushed, in the same step
    settle: Callable[[], None] | None = None


class StopMatcher(Protocol):
    """mlx-lm's stop-sequence matcher of one row (`StopSequences.matcher()`)."""

    def advance(self, token: int) -> bool:
        """Consume `token`; True when it ends a stop sequence."""
        ...


def finish_reason(matcher: StopMatcher, token: int, generated: int, max_tokens: int) -> str | None:
    """Why a row ends with `token`, its `generated`-th: a stop token (`matcher.advance`, an
    mlx-lm stop-sequence matcher, consumes it), max_tokens, or None. The runners' one rule,
    for the first token at prefill end and each decoded one (mlx-lm's `GenerationBatch`
    applies the same order inside its batch)."""
    if matcher.advance(token):
        return FINISH_STOP
    if generated >= max_tokens:
        return FINISH_LENGTH
    return None


class EmbeddingUnsupported(Exception):
    """The model serves no embeddings (embedder.py); the message says why, for the client's
    400 `embeddings_unsupported`."""


class KVPayloadLike(Protocol):
    nbytes: int
    layers: list[tuple[Any, Any]]  # per layer (keys, values): what the disk tier writes


class Runner(Protocol):
    """What the engine needs from a runner (engine thread only)."""

    keep_prompt_kv: bool  # hand each finished prompt's KV out (`PrefillProgress.prompt_kv`)
    # set by the engine each step: rows are about to join the decode batch, so rows that leave
    # it may keep their slots for them (`BatchRunner`; other runners ignore it)
    expect_joins: bool
    # Speculative decoding's policy (speculative.py; `BatchRunner` only): None when off. An
    # optional member: a runner without it never speculates (read it with `speculation_of`).
    speculation: SpecPolicy | None

    @property
    def prefill_uids(self) -> list[str]: ...

    @property
    def decode_uids(self) -> list[str]: ...

    @property
    def tokens_after_chunk(self) -> bool:
        """True after a packed `decode()` (its forward also ran the cohort's prefill chunk)
        whose decode rows were computed then and there (the native decode step), not queued:
        their tokens had better go out after `prefill_chunk()` has finished the chunk."""
        ...

    def start_cohort(self, rows: Sequence[RowSpec]) -> None: ...

    def decode(self, hold: bool = False) -> list[DecodeOutput]:
        """The decode rows' next tokens; with `hold` they sit this step out: nothing is
        computed or returned (their tokens come as they would have, a step later)."""
        ...

    def prefill_chunk(self) -> PrefillProgress: ...

    def remove(self, uid: str) -> bool: ...

    def decode_kv(self, uid: str) -> list[Any] | None:
        """The per-layer KV caches of decoding row `uid`: its prompt and every token it has
        produced (lazy views; `kv_payload` copies them), or None when they cannot be handed
        out (a preempted row's KV then goes nowhere and is recomputed)."""
        ...

    def reset(self) -> None: ...

    def kv_payload(self, caches: list[Any], num_tokens: int) -> KVPayloadLike: ...


def speculation_of(runner: Any) -> SpecPolicy | None:
    """`runner.speculation`, or None for a runner without that member (an injected one)."""
    return getattr(runner, "speculation", None)
