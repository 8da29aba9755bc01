"""Prefill chunks through the native chunk step against mlx-lm's own forward, on each model
directory given, in a process with the daemon's BLAS preload (tests/blas_process.py): a
left-padded chunk on fresh caches, a second one on top, a short one (the chunk step's
direct attention over the cache), then 4 decode steps. Prints one JSON
object: per model the chunk step's calls and the largest logit difference.

Usage: native_families_chunk_step.py MODEL_DIR...
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.models import load_model


def main(*paths: str) -> None:
    out = {"available": True, "calls": {}, "diffs": {}}
    for path in paths:
        stock = mlx_lm.load(path)[0]
        ours = load_model(path).model
        native = ours.model._mlxcel_native
        chunk, calls = native._chunk, [0]
        if chunk is None:
            print(json.dumps({"available": False}))
            return

        def counted(*args, chunk=chunk, calls=calls):
            calls[0] += 1
            return chunk(*args)

        native._chunk = counted
        padding = [0, 5, 17]
        diffs = []
        caches = [[BatchKVCache(padding) for _ in m.layers] for m in (stock, ours)]
        keep = (mx.arange(40)[None] >= mx.array(padding)[:, None])[..., None]
        # a fresh cache, a chunk on top of it, a short one (at most 16 tokens: attention read
        # from the cache in place)
        for n, key in ((40, 1), (24, 2), (6, 3)):
            chunk_in = mx.random.randint(1, 250, (3, n), key=mx.random.key(key))
            a, b = (m(chunk_in, cache=c) for m, c in zip((stock, ours), caches, strict=True))
            if n == 40:
                a, b = a * keep, b * keep
            diffs.append(mx.abs(a - b).max().item())
        token = mx.argmax(a[:, -1, :], axis=-1)[:, None]
        for _ in range(4):
            a, b = (m(token, cache=c) for m, c in zip((stock, ours), caches, strict=True))
            diffs.append(mx.abs(a - b).max().item())
            token = mx.argmax(a[:, -1, :], axis=-1)[:, None]
        out["calls"][path] = calls[0]
        out["diffs"][path] = max(diffs)
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
