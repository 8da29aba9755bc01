"""Writes chain after chain into a disk tier (fingerprint "c" * 64): for seed 0, 1, ... the
four-layer KV of 640 tokens `[seed + 1] * 640` from numpy's generator of that seed, flushed;
prints each seed once it is on disk. Runs until killed (the test kills it mid-write).

Usage: prompt_cache_disk_writer.py CACHE_DIR
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlxcel.daemon.engine.disk_cache import DiskTier


def main(directory: str) -> None:
    t = DiskTier(directory, "c" * 64, 1 << 34)
    for seed in range(10_000):
        rng = np.random.default_rng(seed)
        layers = [
            (
                mx.array(rng.standard_normal((1, 4, 640, 128), dtype=np.float32)),
                mx.array(rng.standard_normal((1, 4, 640, 128), dtype=np.float32)),
            )
            for _ in range(4)
        ]
        mx.eval(layers)
        t.offer([seed + 1] * 640, layers)
        t.flush()
        print(seed, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
