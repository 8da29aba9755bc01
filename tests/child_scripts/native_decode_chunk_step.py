"""Prefill chunks of a tiny llama through the native chunk step and through the model forward,
in a process with the daemon's BLAS preload (tests/blas_process.py). Prints one JSON object:
the chunk step's calls, the largest difference of each forward's hidden states, and of the
last layer's cached keys.

Usage: native_decode_chunk_step.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.models import load_model

PADDING = [0, 5, 17]
# a fresh cache, a chunk after it, then a right-padded one (as the runner's cohorts); then
# short ones, as a verification's drafts (attention read from the cache in place, the row-wise
# ops on the caller below 17 rows), plain and right-padded: (tokens, seed, row lengths)
CHUNKS: tuple[tuple[int, int, list[int] | None], ...] = (
    (40, 1, None),
    (24, 2, None),
    (20, 3, [20, 13, 7]),
    (5, 4, None),
    (6, 5, [6, 3, 1]),
)


def run(model: Any, native: Any, chunk_step: Any) -> tuple[list[mx.array], list[Any]]:
    native._chunk = chunk_step
    caches = [BatchKVCache(PADDING) for _ in model.layers]
    outs = []
    for n, key, lengths in CHUNKS:
        chunk = mx.random.randint(1, 250, (3, n), key=mx.random.key(key))
        if lengths:
            for c in caches:
                c.prepare(lengths=lengths, right_padding=[n - k for k in lengths])
        out = model(chunk, cache=caches)
        if lengths:
            for c in caches:
                c.finalize()
            out = out * (mx.arange(n)[None] < mx.array(lengths)[:, None])[..., None]
        outs.append(out)
    token = mx.argmax(outs[-1][:, -1, :], axis=-1)[:, None]
    for _ in range(4):
        outs.append(model(token, cache=caches))
        token = mx.argmax(outs[-1][:, -1, :], axis=-1)[:, None]
    return outs, caches


def main(model_dir: str) -> None:
    model = load_model(model_dir).model
    native = model.model._mlxcel_native
    step, calls = native._chunk, [0]
    if step is None:
        print(json.dumps({"available": False}))
        return

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return step(*args)

    (a, ca), (b, cb) = run(model, native, counted), run(model, native, None)
    padding = mx.array(PADDING)
    diffs = []
    for x, y in zip(a, b, strict=True):
        if x.shape[1] == 40:  # the padding rows' positions hold nothing anyone reads
            keep = (mx.arange(40)[None] >= padding[:, None])[..., None]
            x, y = x * keep, y * keep
        diffs.append(mx.abs(x - y).max().item())
    idx = ca[0]._idx  # every row's own columns start by 35 (17 + 13 + 5 rolled from the right)
    keys = mx.abs(ca[-1].keys[..., 35:idx, :] - cb[-1].keys[..., 35:idx, :]).max().item()
    print(json.dumps({"available": True, "calls": calls[0], "diffs": diffs, "keys": keys}))


if __name__ == "__main__":
    main(sys.argv[1])
