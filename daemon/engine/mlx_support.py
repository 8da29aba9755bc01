"""MLX helpers shared by the runners: memory, model probing, per-row samplers, KV payloads.

With runner.py and solo_runner.py, the only engine modules that import mlx / mlx_lm.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)
from mlxcel.daemon.engine.constraints import ReasoningGate, RowConstraint
from mlxcel.daemon.engine.runner_api import ModelProbe, RowLogprobs
from mlxcel.daemon.engine.types import SamplingParams
from mlxcel.daemon.mlx_lm_compat import merge_with_room

generation_stream = mx.new_thread_local_stream(mx.default_device())


def available_memory_bytes(model: Any = None, parallel: int = 1) -> int:
    """Memory the KV budget and prompt cache may use now (after the weights are loaded), on
    the backend's device, less mlx-lm's KV growth step per slot (see engine/memory.py)."""
    from mlxcel.daemon.engine import memory

    per_token = probe_model(model).kv_bytes_per_token if model is not None else 0
    return memory.available_for_caches(parallel, per_token)


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


def kv_layout(model: Any) -> str:
    """The KV cache's layout, per layer (cache kind, heads, head dims, dtype), from a
    one-token forward: a part of the prompt cache's disk fingerprint (disk_cache.py)."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    parts = []
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            parts.append(
                f"{type(c).__name__}:{keys.shape[1]}x{keys.shape[3]}/{values.shape[3]}:{keys.dtype}"
            )
        else:
            parts.append(type(c).__name__)
    return ";".join(parts)


def kernel_path(runner: Any) -> str:
    """Which code computes the KV: the runner, its packed step, mlx and its device, and the
    switches of our native kernels (part of the disk fingerprint)."""
    switches = sorted(
        f"{k}={v}"
        for k, v in os.environ.items()
        if k.startswith("MLXCEL_") and any(w in k for w in ("NATIVE", "PACKED", "GEMM", "BLAS"))
    )
    packed = getattr(runner, "packed", False)
    device = mx.default_device()
    return f"{type(runner).__name__}:packed={packed}:mlx={mx.__version__}:{device}:{switches}"


def restore_random_state() -> None:
    """After a failed step: a sampler that raised inside `mx.compile` (mlx-lm's samplers take
    mx.random.state as input) leaves a traced array there that no later sample can eval."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


@dataclass(eq=False)
class RowSampler:
    """One row's sampling: its sampler, whether it reports log-probabilities, its grammar.

    Stands in the `samplers` lists of mlx-lm's batch classes, which carry it through
    split/filter/extend with the row; only `RowBatch` (runner.py), `sample_row` and the solo
    runner look inside it.
    """

    params: SamplingParams
    sampler: Callable[[mx.array], mx.array]  # logprobs (1, vocab) -> token (1,); unused if greedy
    constraint: RowConstraint | ReasoningGate | None = None

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs or self.params.top_logprobs > 0

    @property
    def needs_logprobs(self) -> bool:
        """Whether the log-softmax must be computed for this row (greedy rows sample the argmax
        of the processed logits, which needs none)."""
        return not self.greedy or self.wants_logprobs

    def __call__(self, logprobs: mx.array) -> mx.array:
        return greedy_sampler(logprobs) if self.greedy else self.sampler(logprobs)


def make_row_sampler(
    params: SamplingParams, constraint: RowConstraint | ReasoningGate | None = None
) -> RowSampler:
    """A row's sampler; with a seed the row draws from its own key, not the global RNG."""
    return RowSampler(params, _make_sampler(params), constraint)


def _make_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    if params.greedy:
        return greedy_sampler
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
    for _ in range(params.seed_draws):  # a resumed row: the stream where it stopped
        key, _ = mx.random.split(key)
    scale = 1.0 / params.temperature

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * scale, key=sub)

    return sampler


def make_row_processors(params: SamplingParams) -> list[Any]:
    """mlx-lm's logits processors for one row: logit_bias, then the repetition, presence and
    frequency penalties (each over the last 20 tokens of the row's context, prompt included,
    as mlx-lm applies them)."""
    return make_logits_processors(
        params.logit_bias,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


# A row's log-probability report: (logprob of the sampled token, ((token, logprob), ...)).
# The same, still on the device: (sampled token's logprob, top ids, top logprobs) or None.
_LazyLogprobs = tuple[mx.array, mx.array | None, mx.array | None]


def apply_mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """Disallowed tokens to -inf on one row's (1, vocab) logits."""
    mask = mx.array(allowed[: logits.shape[-1]])
    if mask.shape[0] < logits.shape[-1]:  # logits wider than the tokenizer: extra ids banned
        pad = mx.zeros((logits.shape[-1] - mask.shape[0],), dtype=mx.bool_)
        mask = mx.concatenate([mask, pad])
    return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))


def process_rows(
    logits: mx.array,
    rows: Sequence[RowSampler],
    processors: Sequence[Sequence[Any]],
    contexts: Sequence[Callable[[], mx.array] | None],
    masks: dict[int, np.ndarray | None],
) -> mx.array:
    """Each row's logits processors (penalties, bias), then its grammar mask, on (B, vocab).
    A None mask (a reasoning row whose grammar is dormant, constraints.ReasoningGate) is none."""
    if not any(processors) and all(m is None for m in masks.values()):
        return logits
    out = []
    for e in range(len(rows)):
        row_logits = logits[e : e + 1]
        if processors[e]:
            fetch = contexts[e]
            context = fetch() if fetch is not None else mx.array([], dtype=mx.int32)
            for processor in processors[e]:
                row_logits = processor(context, row_logits)
        mask = masks.get(e)
        if mask is not None:
            row_logits = apply_mask(row_logits, mask)
        out.append(row_logits)
    return mx.concatenate(out, axis=0)


def sample_rows(
    logits: mx.array, rows: Sequence[RowSampler]
) -> tuple[mx.array, list[_LazyLogprobs | None]]:
    """Sample one token per row from processed (B, vocab) logits, lazily.

    Greedy rows take the argmax of the logits; the log-softmax is computed only for the rows
    that sample from it or report log-probabilities, so an all-greedy batch computes none.
    Returns the (B,) tokens and, per row, the device arrays of its log-probability report.
    """
    need = [e for e, r in enumerate(rows) if r.needs_logprobs]
    if not need:
        return mx.argmax(logits, axis=-1), [None] * len(rows)
    sub = logits if len(need) == len(rows) else logits[mx.array(need)]
    logprobs = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
    if all(r.greedy for r in rows):
        sampled = mx.argmax(logits, axis=-1)
    else:
        greedy_tokens = mx.argmax(logits, axis=-1) if any(r.greedy for r in rows) else None
        where = {e: j for j, e in enumerate(need)}
        sampled = mx.concatenate(
            [
                greedy_tokens[e : e + 1]
                if r.greedy and greedy_tokens is not None
                else r.sampler(logprobs[where[e] : where[e] + 1]).reshape(1)
                for e, r in enumerate(rows)
            ]
        )
    reports: list[_LazyLogprobs | None] = [None] * len(rows)
    for j, e in enumerate(need):
        row = rows[e]
        if not row.wants_logprobs:
            continue
        row_lp = logprobs[j]
        chosen = row_lp[sampled[e]]
        k = min(row.params.top_logprobs, row_lp.shape[-1])
        if k > 0:
            top = mx.argpartition(-row_lp, kth=k - 1)[:k]
            reports[e] = (chosen, top, row_lp[top])
        else:
            reports[e] = (chosen, None, None)
    return sampled, reports


def read_logprobs(reports: Sequence[_LazyLogprobs | None]) -> list[RowLogprobs | None]:
    """The evaluated reports as Python values: top pairs most likely first, -inf (tokens a
    grammar banned) left out."""
    out: list[RowLogprobs | None] = []
    for report in reports:
        if report is None:
            out.append(None)
            continue
        chosen, top_ids, top_values = report
        pairs: tuple[tuple[int, float], ...] = ()
        if top_ids is not None and top_values is not None:
            ranked = sorted(
                zip(top_ids.tolist(), top_values.tolist(), strict=True), key=lambda p: -p[1]
            )
            pairs = tuple((int(t), float(v)) for t, v in ranked if math.isfinite(v))
        out.append((float(chosen.item()), pairs))
    return out


class RoomyKVCache(KVCache):
    """One row's cache as a prefill cohort starts (a prompt-cache prefix, or empty), merged
    into the cohort's `BatchKVCache` with room for `room` more columns: the rest of the
    prompt is then written in place. mlx-lm's merge copies several rows' prefixes into a
    cache sized to them, which the first chunk grows: a second copy of all of it (~0.15 s per
    6k SmolLM2 tokens). (One row's merge is free there, and the copy happens at the growth;
    here it happens at the merge: the same one copy.)"""

    room = 0

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> Any:
        return merge_with_room(caches, max(getattr(c, "room", 0) for c in caches))

    @classmethod
    def of(cls, cache: KVCache | None, room: int) -> RoomyKVCache:
        roomy = cls()
        if cache is not None:
            roomy.keys, roomy.values, roomy.offset = cache.keys, cache.values, cache.offset
        roomy.room = room
        return roomy


def roomy_caches(model: Any, prefix: list[KVCache] | None, room: int) -> list[Any]:
    """A cohort row's per-layer caches (`prefix`, or fresh ones) as `RoomyKVCache`s; the
    model's own caches as they are when they are not all plain `KVCache`s (rotating ones)."""
    caches = prefix if prefix is not None else make_prompt_cache(model)
    if any(type(c) is not KVCache for c in caches):
        return caches
    return [RoomyKVCache.of(c, room) for c in caches]


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


Head = Callable[[mx.array], mx.array]


def detect_head(model: Any) -> tuple[Any, Head] | None:
    """(backbone, head) with model(x) == head(backbone(x)) exactly, or None.

    Lets prefill send only each row's last position through the output layer (mlx-lm models
    compute logits for every position). Checked on a probe input, so a family with extra output
    processing (soft-capping, scaling) simply keeps the generic path.
    """
    backbone = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(backbone, "embed_tokens", None), "as_linear", None)
    if not callable(backbone) or not callable(head):
        return None
    probe = mx.array([[1, 2, 3]])
    try:
        expected = model(probe)
        got = head(backbone(probe))
        if got.shape != expected.shape or not mx.array_equal(got, expected).item():
            return None
    except Exception:
        return None
    return backbone, head


def sample_row(
    logits: mx.array, row: RowSampler, processors: Sequence[Any], context: list[int]
) -> tuple[mx.array, _LazyLogprobs | None]:
    """One row's token from its (1, vocab) logits, as `RowBatch` samples it (the first token
    after prefill: the row's grammar, if any, is at its start state)."""
    masks = {0: row.constraint.allowed()} if row.constraint is not None else {}
    logits = process_rows(logits, [row], [processors], [lambda: mx.array(context)], masks)
    sampled, reports = sample_rows(logits, [row])
    if row.constraint is not None:
        row.constraint.pending_accept = True  # the next input is this sampled token
    return sampled, reports[0]


def drop_last_positions(caches: list[Any], drop: list[int]) -> None:
    """Forget each row's last `drop[i]` positions in `caches` (one `BatchKVCache` per layer):
    all rows' common part by trimming, the rest by rolling that row's surplus into its left
    padding (`BatchKVCache.finalize`). The rollback past rejected drafts, in the main cache
    and the draft model's."""
    common = min(drop)
    for c in caches:
        if common:
            c.trim(common)
        if max(drop) > common:
            c.prepare(right_padding=[d - common for d in drop])
            c.finalize()
