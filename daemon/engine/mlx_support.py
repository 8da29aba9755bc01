"""MLX helpers shared by the runners: memory, model probing, per-row samplers, KV payloads.

With runner.py and solo_runner.py, the only engine modules that import mlx / mlx_lm.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_sampler,
)
from mlxcel.daemon.engine.types import SamplingParams

generation_stream = mx.new_thread_local_stream(mx.default_device())


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
    logits: mx.array, sampler: Any, processors: Sequence[Any], context: list[int]
) -> mx.array:
    """One row's token from its (1, vocab) logits, as GenerationBatch samples it."""
    if processors:
        tokens = mx.array(context)
        for processor in processors:
            logits = processor(tokens, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs)
