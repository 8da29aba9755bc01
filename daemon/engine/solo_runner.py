"""`SoloRunner`: one sequence at a time on the model's own cache list, for families whose
caches mlx-lm cannot merge (SSM, hybrid). Same contract as `BatchRunner`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlxcel.daemon.engine.mlx_support import (
    KVPayload,
    RowSampler,
    generation_stream,
    make_row_processors,
    make_row_sampler,
    process_rows,
    read_logprobs,
    restore_random_state,
    sample_rows,
)
from mlxcel.daemon.engine.runner import stop_sequences
from mlxcel.daemon.engine.runner_api import (
    DecodeOutput,
    PrefillProgress,
    RowSpec,
    StopMatcher,
    finish_reason,
)

if TYPE_CHECKING:
    from mlxcel.daemon.engine.speculative import SpecPolicy


@dataclass
class _SoloRow:
    spec: RowSpec
    cache: list[Any]
    remaining: list[int]
    tokens: list[int]
    sampler: RowSampler
    processors: list[Any]
    stop: StopMatcher
    pending: mx.array | None = None
    pending_logprobs: Any = None  # the pending token's log-probability report (device arrays)
    num_generated: int = 0


class SoloRunner:
    """One row at a time on the model's own cache list (families that cannot batch)."""

    def __init__(self, model: Any, chunk_size: int) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self._row: _SoloRow | None = None
        self.keep_prompt_kv = False  # no prompt cache: the model's own caches are not block KV
        self.expect_joins = False  # the engine's hint; one row at a time has no slots to keep

    @property
    def prefill_uids(self) -> list[str]:
        row = self._row
        return [row.spec.uid] if row is not None and row.pending is None else []

    @property
    def decode_uids(self) -> list[str]:
        row = self._row
        return [row.spec.uid] if row is not None and row.pending is not None else []

    tokens_after_chunk = False  # one row: no packed step
    # no speculative decoding: its verification step is BatchRunner's
    speculation: SpecPolicy | None = None

    def start_cohort(self, rows: Sequence[RowSpec]) -> None:
        if self._row is not None or len(rows) != 1:
            raise RuntimeError("the solo runner takes one row at a time")
        spec = rows[0]
        self._row = _SoloRow(
            spec,
            make_prompt_cache(self.model),
            list(spec.compute_tokens),
            [],
            make_row_sampler(spec.sampling, spec.constraint),
            make_row_processors(spec.sampling),
            stop_sequences(spec).matcher(),
        )

    def prefill_chunk(self) -> PrefillProgress:
        progress = PrefillProgress()
        row = self._row
        if row is None or row.pending is not None:
            return progress
        with mx.stream(generation_stream):
            n = min(self.chunk_size, len(row.remaining) - 1)
            if n > 0:
                self.model(mx.array(row.remaining[:n])[None], cache=row.cache)
                mx.eval([c.state for c in row.cache])
                row.tokens += row.remaining[:n]
                row.remaining = row.remaining[n:]
            if len(row.remaining) == 1:
                self._forward(row, row.remaining.pop())
                progress.graduated.append(row.spec.uid)
                n += 1
        progress.uid_to_computed[row.spec.uid] = n
        progress.padded_tokens = n
        return progress

    def _forward(self, row: _SoloRow, token: int | mx.array) -> None:
        """Queue the forward of `token` and the sampling of the next one (row.pending).

        `token` is an int already in `row.tokens`' future (appended here), or the lazy token
        sampled by the previous forward, not read yet (the caller appends it once read).
        """
        if isinstance(token, int):
            row.tokens.append(token)
            inputs = mx.array([[token]])

            def context() -> mx.array:
                return mx.array(row.tokens)

        else:
            inputs = token.reshape(1, 1)
            known = mx.array(row.tokens, dtype=token.dtype)

            def context() -> mx.array:
                return mx.concatenate([known, token.reshape(1)])

        logits = self.model(inputs, cache=row.cache)[:, -1, :]
        masks = {}
        constraint = row.sampler.constraint
        if constraint is not None:
            assert isinstance(token, int)  # a grammar needs the token's value
            mx.async_eval(logits)  # the forward runs while the grammar computes its mask
            constraint.advance(token)
            masks[0] = constraint.allowed()
        logits = process_rows(logits, [row.sampler], [row.processors], [context], masks)
        sampled, reports = sample_rows(logits, [row.sampler])
        mx.async_eval(sampled, [r for r in reports if r is not None])
        row.pending, row.pending_logprobs = sampled, reports[0]

    def decode(self, hold: bool = False) -> list[DecodeOutput]:
        """The token sampled by the last forward. As mlx-lm's generate_step, the next forward
        is queued on that token before it is read, so the device never waits for Python; a
        row with a grammar reads it first (its mask needs the value). When the token ends the
        row, the extra forward is dropped with the row."""
        row = self._row
        if hold or row is None or row.pending is None:
            return []
        with mx.stream(generation_stream):
            pending, report = row.pending, row.pending_logprobs
            ahead = row.sampler.constraint is None and row.num_generated + 1 < row.spec.max_tokens
            if ahead:
                self._forward(row, pending)
            token = int(pending.item())
            logprobs = read_logprobs([report])[0]
            row.num_generated += 1
            finish = finish_reason(row.stop, token, row.num_generated, row.spec.max_tokens)
            if finish is not None:
                self._row = None
            elif ahead:
                row.tokens.append(token)
            else:
                self._forward(row, token)
        return [DecodeOutput(row.spec.uid, token, finish, logprobs=logprobs)]

    def remove(self, uid: str) -> bool:
        if self._row is not None and self._row.spec.uid == uid:
            self._row = None
            return True
        return False

    def decode_kv(self, uid: str) -> list[Any] | None:
        return None  # a model that cannot batch: its caches may not trim; recomputed

    def kv_payload(self, caches: list[Any], num_tokens: int) -> KVPayload:
        return KVPayload.from_caches(caches, num_tokens)

    def reset(self) -> None:
        self._row = None
        restore_random_state()
