#!/usr/bin/env python
"""A/B of two builds of the native ops library's quantized matmul, in one process.

The machine's speed drifts by tens of percent within minutes, so two kernels are compared in
one process, in alternating blocks of calls, on the same weights (random, quantized by MLX with
float16 scales): SmolLM2's layer shapes (4-bit, group 32), its 8-bit output head, and two
larger shapes. Prints per shape each library's best block (µs a call and GB/s of weights read;
small shapes stay in cache between calls) and B/A, and the largest relative difference of the
two results. Run it in both orders: the first library of a pair has a small edge.

  # each side: the library a checkout builds (`python -m mlxcel.daemon.forward.blas build`
  # prints its path in the per-user cache)
  python scripts/bench_qmatmul_ab.py OLD/libmlxcel_ops.so NEW/libmlxcel_ops.so [--rows 1]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from typing import Any

from mlxcel.daemon.forward.blas import ensure_fast_blas

SHAPES = [  # name, in, out, bits, group
    ("qkv", 576, 960, 4, 32),
    ("o", 576, 576, 4, 32),
    ("gate_up", 576, 3072, 4, 32),
    ("down", 1536, 576, 4, 32),
    ("head 8-bit", 576, 49152, 8, 32),
    ("4096x8192", 4096, 8192, 4, 32),
    ("4096x4096 8-bit", 4096, 4096, 8, 32),
    ("2048x6144 g64", 2048, 6144, 4, 64),
]
QUANT_F16 = 1  # native/quant_kernels.h


def _qmatmul(path: str) -> Any:
    fn = ctypes.CDLL(path).mlxcel_qmatmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    fn.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="library A (libmlxcel_ops.so)")
    parser.add_argument("b", help="library B")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=15)
    args = parser.parse_args()
    ensure_fast_blas()
    import mlx.core as mx
    import numpy as np

    fns = [_qmatmul(args.a), _qmatmul(args.b)]
    print(f"rows {args.rows}; A {args.a}\n          B {args.b}")
    for name, inputs, outputs, bits, group in SHAPES:
        weight = mx.random.normal((outputs, inputs), key=mx.random.key(outputs)).astype(mx.float16)
        q, s, b = (np.array(a) for a in mx.quantize(weight, group_size=group, bits=bits))
        x = np.random.default_rng(0).standard_normal((args.rows, inputs), dtype=np.float32)
        ys = [np.zeros((args.rows, outputs), np.float32) for _ in fns]
        calls = [
            (x.ctypes.data, args.rows, inputs, outputs, q.ctypes.data, s.ctypes.data,
             b.ctypes.data, bits, group, QUANT_F16, y.ctypes.data)
            for y in ys
        ]  # fmt: skip
        for fn, call in zip(fns, calls, strict=True):
            if fn(*call) != 0:
                raise SystemExit(f"{name}: the kernel refused the format")
        diff = float(np.abs(ys[0] - ys[1]).max() / (np.abs(ys[0]).max() + 1e-30))
        per_block = max(3, int(2e6 / (inputs * outputs * args.rows)))
        times: list[list[float]] = [[], []]
        for _ in range(args.blocks):
            for i, (fn, call) in enumerate(zip(fns, calls, strict=True)):
                start = time.perf_counter()
                for _ in range(per_block):
                    fn(*call)
                times[i].append((time.perf_counter() - start) / per_block)
        best = [min(t) for t in times]
        pair = statistics.median(tb / ta for ta, tb in zip(*times, strict=True))
        nbytes = q.nbytes + s.nbytes + b.nbytes
        rates = [f"{t * 1e6:8.1f} us ({nbytes / t / 1e9:5.1f} GB/s)" for t in best]
        print(
            f"{name:16s} A {rates[0]}  B {rates[1]}  B/A best {best[1] / best[0]:.3f},"
            f" median of pairs {pair:.3f}  max rel. diff {diff:.1e}"
        )


if __name__ == "__main__":
    main()
