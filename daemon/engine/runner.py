"""The forward passes: the only engine module that imports mlx / mlx_lm.

`BatchRunner` drives mlx-lm's `PromptProcessingBatch` (one prefill cohort, a chunk per call,
right-padded rows merged into a `BatchKVCache`) and `GenerationBatch` (every decoding row, one
token per call, pipelined with `async_eval`). `SoloRunner` serves families whose caches cannot
be merged (SSM, hybrid): one row, the model's own cache list, no batching.

Both share one contract: `decode()` returns the token each row sampled in the previous forward
and queues the next forward, so a row's first token arrives at the first `decode()` after its
prefill ended.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)
from mlxcel.daemon.engine.types import FINISH_LENGTH, FINISH_STOP, SamplingParams

generation_stream = mx.new_thread_local_stream(mx.default_device())
CLEAR_CACHE_EVERY = 256  # decode steps


def available_memory_bytes() -> int:
    """Memory the KV budget and prompt cache may use now (after the weights are loaded)."""
    import psutil

    available = psutil.virtual_memory().available
    if mx.default_device().type == mx.gpu and mx.metal.is_available():
        working_set = mx.device_info().get("max_recommended_working_set_size", 0)
        if working_set:
            available = min(available, max(working_set - mx.get_active_memory(), 0))
    return available


@dataclass(frozen=True)
class ModelProbe:
    kv_bytes_per_token: int  # KV bytes one token costs across all layers
    vocab_size: int


def probe_model(model: Any) -> ModelProbe:
    """Measure the KV cost of a token and the vocabulary with a one-token forward."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    total = 0
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            total += keys.shape[1] * keys.shape[3] * keys.itemsize
            total += values.shape[1] * values.shape[3] * values.itemsize
    return ModelProbe(total, logits.shape[-1])


def restore_random_state() -> None:
    """After a failed step: a sampler that raised inside `mx.compile` (mlx-lm's samplers take
    mx.random.state as input) leaves a traced array there that no later sample can eval."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


def make_row_sampler(params: SamplingParams) -> Any:
    """A sampler for one row; with a seed the row draws from its own key, not the global RNG."""
    if params.greedy:
        return greedy_sampler  # one shared object: GenerationBatch then samples all rows at once
    if params.seed is None:
        return make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    filters = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    key = mx.random.key(params.seed)
    scale = 1.0 / params.temperature

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * scale, key=sub)

    return sampler


class KVPayload:
    """Per-layer keys/values of one sequence: what the prefix cache keeps."""

    def __init__(self, layers: list[tuple[mx.array, mx.array]]) -> None:
        self.layers = layers
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in layers)

    @classmethod
    def from_caches(cls, caches: Sequence[KVCache], num_tokens: int) -> KVPayload:
        """Copy the first `num_tokens` of each layer (contiguous, so the batch can be freed)."""
        layers = [
            (
                mx.contiguous(c.keys[..., :num_tokens, :]),
                mx.contiguous(c.values[..., :num_tokens, :]),
            )
            for c in caches
        ]
        mx.eval(layers)
        return cls(layers)

    def prefix_caches(self, num_tokens: int) -> list[KVCache]:
        """Fresh KVCaches holding the first `num_tokens` (views: merging copies them)."""
        caches = []
        for keys, values in self.layers:
            cache = KVCache()
            cache.keys = keys[..., :num_tokens, :]
            cache.values = values[..., :num_tokens, :]
            cache.offset = num_tokens
            caches.append(cache)
        return caches


@dataclass
class RowSpec:
    """One request entering prefill."""

    uid: str
    compute_tokens: list[int]  # prompt tokens after the cached prefix (at least one)
    cached_tokens: list[int]  # the cached prefix (may be empty)
    cached_payload: KVPayload | None
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int


@dataclass
class PrefillProgress:
    uid_to_computed: dict[str, int] = field(default_factory=dict)  # prompt tokens computed
    padded_tokens: int = 0  # what the forwards computed: rows x longest, per forward
    graduated: list[str] = field(default_factory=list)  # rows that left prefill for decode


@dataclass
class DecodeOutput:
    uid: str
    token: int
    finish_reason: str | None
    kv_tokens: list[int] | None = None  # on finish: the tokens whose KV `kv_caches` holds
    kv_caches: list[Any] | None = None


class BatchRunner:
    """Batched prefill of one cohort at a time plus batched decode of every running row."""

    def __init__(self, model: Any, chunk_size: int) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self._prefill: PromptProcessingBatch | None = None
        self._uid_to_remaining: dict[str, list[int]] = {}
        self._decode = GenerationBatch.empty(model, greedy_sampler)
        self._num_decode_steps = 0

    @property
    def prefill_uids(self) -> list[str]:
        return list(self._prefill.uids) if self._prefill is not None else []

    @property
    def decode_uids(self) -> list[str]:
        return list(self._decode.uids)

    def start_cohort(self, rows: Sequence[RowSpec]) -> None:
        if self._prefill is not None:
            raise RuntimeError("a prefill cohort is already running")
        caches = [
            r.cached_payload.prefix_caches(len(r.cached_tokens))
            if r.cached_payload is not None
            else make_prompt_cache(self.model)
            for r in rows
        ]
        with mx.stream(generation_stream):
            self._prefill = PromptProcessingBatch(
                self.model,
                [r.uid for r in rows],
                caches,
                tokens=[list(r.cached_tokens) for r in rows],
                prefill_step_size=self.chunk_size,
                samplers=[make_row_sampler(r.sampling) for r in rows],
                fallback_sampler=greedy_sampler,
                logits_processors=[make_logits_processors(r.sampling.logit_bias) for r in rows],
                stop_sequences=[StopSequences([[t] for t in r.stop_token_ids]) for r in rows],
                max_tokens=[r.max_tokens for r in rows],
            )
        for r in rows:
            self._uid_to_remaining[r.uid] = list(r.compute_tokens)

    def prefill_chunk(self) -> PrefillProgress:
        """One chunk for every row of the cohort; rows whose prompt is done move to decode."""
        progress = PrefillProgress()
        if self._prefill is None:
            return progress
        with mx.stream(generation_stream):
            self._graduate(progress)
            if self._prefill is not None:
                chunks = []
                for uid in self._prefill.uids:
                    remaining = self._uid_to_remaining[uid]
                    n = min(self.chunk_size, len(remaining) - 1)  # the last token goes to decode
                    chunks.append(remaining[:n])
                    self._uid_to_remaining[uid] = remaining[n:]
                    progress.uid_to_computed[uid] = n
                self._prefill.prompt(chunks)
                progress.padded_tokens += len(chunks) * max(len(c) for c in chunks)
                self._graduate(progress)
        return progress

    def _graduate(self, progress: PrefillProgress) -> None:
        """Rows with only their last prompt token left start decoding (its forward runs now)."""
        batch = self._prefill
        assert batch is not None
        done = [i for i, uid in enumerate(batch.uids) if len(self._uid_to_remaining[uid]) == 1]
        if not done:
            return
        uids = [batch.uids[i] for i in done]
        last = [self._uid_to_remaining.pop(uid) for uid in uids]
        if len(done) == len(batch.uids):
            generation = batch.generate(last)
            self._prefill = None
        else:
            generation = batch.split(done).generate(last)
        self._decode.extend(generation)
        for uid in uids:
            progress.uid_to_computed[uid] = progress.uid_to_computed.get(uid, 0) + 1
        progress.padded_tokens += len(uids)
        progress.graduated.extend(uids)

    def decode(self) -> list[DecodeOutput]:
        if not len(self._decode):
            return []
        with mx.stream(generation_stream):
            responses = self._decode.next()
        self._num_decode_steps += 1
        if self._num_decode_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()  # return freed buffers now and then, as mlx-lm's BatchGenerator does
        return [
            DecodeOutput(
                r.uid,
                r.token,
                r.finish_reason,
                kv_tokens=list(r.all_tokens) if r.finish_reason else None,
                kv_caches=r.prompt_cache,
            )
            for r in responses
        ]

    def remove(self, uid: str) -> bool:
        """Drop a row wherever it is; True when it was found."""
        if self._prefill is not None and uid in self._prefill.uids:
            keep = [i for i, u in enumerate(self._prefill.uids) if u != uid]
            self._uid_to_remaining.pop(uid, None)
            if keep:
                self._prefill.filter(keep)
            else:
                self._prefill = None
            return True
        if uid in self._decode.uids:
            self._decode.filter([i for i, u in enumerate(self._decode.uids) if u != uid])
            return True
        return False

    def reset(self) -> None:
        """Forget every row (after a failed step)."""
        self._prefill = None
        self._uid_to_remaining.clear()
        self._decode = GenerationBatch.empty(self.model, greedy_sampler)
        restore_random_state()


@dataclass
class _SoloRow:
    spec: RowSpec
    cache: list[Any]
    remaining: list[int]
    tokens: list[int]
    sampler: Any
    processors: list[Any]
    stop: StopSequences.Matcher
    pending: mx.array | None = None
    num_generated: int = 0


class SoloRunner:
    """One row at a time on the model's own cache list (families that cannot batch)."""

    def __init__(self, model: Any, chunk_size: int) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self._row: _SoloRow | None = None

    @property
    def prefill_uids(self) -> list[str]:
        row = self._row
        return [row.spec.uid] if row is not None and row.pending is None else []

    @property
    def decode_uids(self) -> list[str]:
        row = self._row
        return [row.spec.uid] if row is not None and row.pending is not None else []

    def start_cohort(self, rows: Sequence[RowSpec]) -> None:
        if self._row is not None or len(rows) != 1:
            raise RuntimeError("the solo runner takes one row at a time")
        spec = rows[0]
        self._row = _SoloRow(
            spec,
            make_prompt_cache(self.model),
            list(spec.compute_tokens),
            [],
            make_row_sampler(spec.sampling),
            make_logits_processors(spec.sampling.logit_bias),
            StopSequences([[t] for t in spec.stop_token_ids]).matcher(),
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
                row.pending = self._forward(row, row.remaining.pop())
                progress.graduated.append(row.spec.uid)
                n += 1
        progress.uid_to_computed[row.spec.uid] = n
        progress.padded_tokens = n
        return progress

    def _forward(self, row: _SoloRow, token: int) -> mx.array:
        row.tokens.append(token)
        logits = self.model(mx.array([[token]]), cache=row.cache)[:, -1, :]
        for processor in row.processors:
            logits = processor(mx.array(row.tokens), logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = row.sampler(logprobs)
        mx.async_eval(sampled)
        return sampled

    def decode(self) -> list[DecodeOutput]:
        row = self._row
        if row is None or row.pending is None:
            return []
        with mx.stream(generation_stream):
            token = int(row.pending.item())
            row.num_generated += 1
            finish = None
            if row.stop.advance(token):
                finish = FINISH_STOP
            elif row.num_generated >= row.spec.max_tokens:
                finish = FINISH_LENGTH
            if finish is None:
                row.pending = self._forward(row, token)
            else:
                self._row = None
        return [DecodeOutput(row.spec.uid, token, finish)]

    def remove(self, uid: str) -> bool:
        if self._row is not None and self._row.spec.uid == uid:
            self._row = None
            return True
        return False

    def reset(self) -> None:
        self._row = None
        restore_random_state()
