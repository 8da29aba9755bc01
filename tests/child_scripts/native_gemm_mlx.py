"""MLX matmuls of 1, 3, 8 and 16 rows (a plain product, an addmm, a batched transposed view)
checked against numpy in float64, with the BLAS choice logged to stderr first; prints one JSON
object: the BLAS label, the worst relative error, and how many products the few-row kernel ran.
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    import mlx.core as mx
    from mlxcel.daemon.forward.blas import blas_label, log_blas_choice, native_gemm_counts

    log_blas_choice()
    key = mx.random.key(0)
    worst = 0.0
    before = native_gemm_counts()[0]
    for rows in (1, 3, 8, 16):
        x = mx.random.normal((rows, 576), key=key)
        w = mx.random.normal((960, 576), key=mx.random.key(rows))
        bias = mx.random.normal((960,), key=mx.random.key(99))
        blocks = w.reshape(5, 192, 576).transpose(0, 2, 1)  # a batched, transposed view
        got = [x @ w.T, mx.addmm(bias, x, w.T, alpha=0.5, beta=2.0), x[None] @ blocks]
        x64, w64 = np.array(x, np.float64), np.array(w, np.float64)
        want = [
            x64 @ w64.T,
            0.5 * (x64 @ w64.T) + 2.0 * np.array(bias, np.float64),
            np.stack([x64 @ w64[i * 192 : (i + 1) * 192].T for i in range(5)]),
        ]
        scale = np.abs(x64) @ np.abs(w64).T + 1e-30
        for g, wnt in zip(got, want, strict=True):
            wnt = wnt.reshape(np.array(g).shape)
            err = np.abs(np.array(g, np.float64) - wnt) / (scale.max() if g.ndim == 3 else scale)
            worst = max(worst, float(err.max()))
    native = native_gemm_counts()[0] - before
    print(json.dumps({"label": blas_label(), "worst": worst, "native": native}))


if __name__ == "__main__":
    main()
