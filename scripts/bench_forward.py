#!/usr/bin/env python
"""One forward pass of the default model: stock mlx-lm vs mlxcel's fast forward, same process.

    python scripts/bench_forward.py [--model smollm2-135m-instruct] [--batches 1,4,8]
                                    [--context 300] [--prefill 256] [--reps 7] [--steps 4]

Decode: one token per row through the whole model (logits, argmax) on `BatchKVCache`s that
hold `--context` tokens per row (rows left-padded by different amounts, as in the engine);
the caches are trimmed back after each step so every step sees the same context. Prefill:
`--prefill` tokens of one row into a fresh `BatchKVCache`, the backbone on every position and
the head on the last one (what the engine's prefill does). Stock and fast runs alternate, so
the ratios hold on a shared machine; times are medians over `--reps`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from mlxcel.daemon.models.blas import ensure_fast_blas


def _load(model: str, fast: bool) -> Any:
    from mlxcel.daemon.models import load_model
    from mlxcel.daemon.models.fast_forward import DISABLE_ENV

    if fast:
        os.environ.pop(DISABLE_ENV, None)
    else:
        os.environ[DISABLE_ENV] = "1"
    try:
        return load_model(model).model
    finally:
        os.environ.pop(DISABLE_ENV, None)


def _filled_caches(model: Any, batch: int, context: int) -> list[Any]:
    """BatchKVCaches holding `context` positions per row (random keys/values)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    padding = [(3 * i) % 17 for i in range(batch)]
    caches = []
    margs = model.args
    head_dim = getattr(margs, "head_dim", None) or margs.hidden_size // margs.num_attention_heads
    for layer in model.layers:
        heads = layer.self_attn.n_kv_heads
        size = (context // BatchKVCache.step + 1) * BatchKVCache.step
        keys = mx.random.normal((batch, heads, size, head_dim), key=mx.random.key(len(caches)))
        values = mx.random.normal((batch, heads, size, head_dim), key=mx.random.key(99))
        cache = BatchKVCache([0] * batch)
        offset = mx.array([context - p for p in padding])
        cache.state = (keys, values, offset, mx.array(padding), context)
        caches.append(cache)
    mx.eval([c.state for c in caches])
    return caches


def _decode_step(model: Any, caches: list[Any], tokens: Any) -> Any:
    import mlx.core as mx

    logits = model(tokens, cache=caches)
    out = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(out)
    for c in caches:
        c.trim(1)
    return logits


def _prefill(model: Any, tokens: Any) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    caches = [BatchKVCache([0]) for _ in model.layers]
    hidden = model.model(tokens, cache=caches)
    logits = model.model.embed_tokens.as_linear(hidden[:, -1:, :])
    if not model.args.tie_word_embeddings:
        logits = model.lm_head(hidden[:, -1:, :])
    mx.eval(logits, [c.state for c in caches])


def _time(fn: Callable[[], Any], times: int) -> float:
    best = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        best.append(time.perf_counter() - start)
    return statistics.median(best)


def _compare(
    name: str, runs: dict[str, Callable[[], Any]], reps: int, times: int, per: float = 1.0
) -> None:
    for fn in runs.values():  # warm-up: allocations, compiled traces
        fn()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for key, fn in runs.items():
            samples[key].append(_time(fn, times))
    stock = statistics.median(samples["stock"]) * 1000
    fast = statistics.median(samples["fast"]) * 1000
    extra = f"   ({per / stock * 1000:.0f} vs {per / fast * 1000:.0f} tok/s)" if per > 1 else ""
    print(f"{name:<22} stock {stock:8.1f} ms   fast {fast:8.1f} ms   x{stock / fast:5.2f}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="decode steps per timed sample")
    args = parser.parse_args()
    ensure_fast_blas()
    import mlx.core as mx
    from mlxcel.daemon.models.blas import blas_name
    from mlxcel.daemon.models.fast_forward import is_fast

    models = {"stock": _load(args.model, fast=False), "fast": _load(args.model, fast=True)}
    print(f"model {args.model}  blas {blas_name()}  fast forward active: {is_fast(models['fast'])}")
    vocab = models["stock"].args.vocab_size
    for batch in [int(b) for b in args.batches.split(",")]:
        caches = {k: _filled_caches(m, batch, args.context) for k, m in models.items()}
        tokens = mx.random.randint(100, vocab, (batch, 1), key=mx.random.key(batch))
        logits = {k: _decode_step(m, caches[k], tokens) for k, m in models.items()}
        diff = mx.abs(logits["stock"] - logits["fast"]).max().item()
        same = mx.array_equal(logits["stock"].argmax(-1), logits["fast"].argmax(-1)).item()
        runs = {
            k: (lambda m=m, c=caches[k], t=tokens: _decode_step(m, c, t)) for k, m in models.items()
        }
        _compare(f"decode batch {batch}", runs, args.reps, args.steps)
        print(f"{'':<22} max |logit diff| {diff:.2e}, same argmax: {same}")
    prompt = mx.random.randint(100, vocab, (1, args.prefill), key=mx.random.key(0))
    runs = {k: (lambda m=m: _prefill(m, prompt)) for k, m in models.items()}
    _compare(f"prefill {args.prefill} tokens", runs, max(3, args.reps // 2), 1, args.prefill)


if __name__ == "__main__":
    main()
