"""Two prefill chunks through the native chunk step on a tiny quantized llama
(tests/native_quant_checks.py: quantized_pair), then 8 decode steps, against stock mlx-lm's
quantized forward, in a process with the daemon's BLAS preload (tests/blas_process.py). Prints
one JSON object: the chunk step's calls, the largest logit difference of each forward, and
whether the greedy tokens stayed the same.

Usage: native_quant_chunk.py BITS GROUP
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the kernel checks

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache
from native_quant_checks import counted_calls, quantized_pair


def main(bits: str, group: str) -> None:
    stock, native = quantized_pair(int(bits), int(group), seed=2)
    step = native.model._mlxcel_native
    if step._chunk is None:
        print(json.dumps({"available": False}))
        return
    calls = counted_calls(step, "_chunk")
    padding = [0, 5, 17]
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in (stock, native)]
    diffs = []
    keep = (mx.arange(40)[None] >= mx.array(padding)[:, None])[..., None]
    for n, key in ((40, 1), (24, 2)):  # a fresh cache, then a chunk on top of it
        chunk = mx.random.randint(1, 250, (3, n), key=mx.random.key(key))
        outs = [m(chunk, cache=c) for m, c in zip((stock, native), caches, strict=True)]
        d = mx.abs(outs[0] - outs[1]) * (keep if n == 40 else 1)
        diffs.append(d.max().item())
    token = mx.argmax(outs[0][:, -1, :], axis=-1)[:, None]
    same = True
    for _ in range(8):
        outs = [m(token, cache=c)[:, -1, :] for m, c in zip((stock, native), caches, strict=True)]
        diffs.append(mx.abs(outs[0] - outs[1]).max().item())
        token = mx.argmax(outs[0], axis=-1)[:, None]
        same &= mx.array_equal(token, mx.argmax(outs[1], axis=-1)[:, None]).item()
    print(json.dumps({"available": True, "calls": calls[0], "diffs": diffs, "same": same}))


if __name__ == "__main__":
    main(*sys.argv[1:])
