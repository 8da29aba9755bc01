"""Calls `cblas_sgemm` (whatever the process's global scope resolves it to: the preloaded
few-row kernel in front of OpenBLAS) on random products of the given shapes for every M up to
16, transposed and not, with alpha/beta and padded leading dimensions, then an M = 17 and a
column-major one (both for OpenBLAS), and compares each with numpy in float64. Exits with the
case when a relative error is over 1e-5; otherwise prints one JSON object: the kernel's path,
the number of cases, how many the kernel ran and how many it forwarded, the worst error.

Usage: native_gemm_check.py SHAPES_JSON   ([[[N, K], ...] of q k^T-like, [[N, K], ...] axpy])
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import numpy as np
from mlxcel.daemon.forward.blas import native_gemm_counts, native_gemm_path

P = ctypes.POINTER(ctypes.c_float)
ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112


class Checker:
    """Runs sgemm cases against numpy; keeps the count and the worst relative error."""

    def __init__(self) -> None:
        self.sgemm: Any = ctypes.CDLL(None).cblas_sgemm
        self.sgemm.argtypes = [ctypes.c_int] * 6 + [
            ctypes.c_float,
            P,
            ctypes.c_int,
            P,
            ctypes.c_int,
            ctypes.c_float,
            P,
            ctypes.c_int,
        ]
        self.rng = np.random.default_rng(0)
        self.worst = 0.0
        self.cases = 0

    def check(
        self,
        m: int,
        n: int,
        k: int,
        trans_b: bool,
        alpha: float,
        beta: float,
        pad_a: int,
        pad_b: int,
        order: int = ROW_MAJOR,
        trans_a: int = NO_TRANS,
    ) -> None:
        rng = self.rng
        lda = k + pad_a
        a = rng.standard_normal((m, lda)).astype(np.float32)
        rows, cols = (n, k) if trans_b else (k, n)
        ldb = cols + pad_b
        b = rng.standard_normal((rows, ldb)).astype(np.float32)
        c = rng.standard_normal((m, n)).astype(np.float32)
        if beta == 0.0:
            c[:] = np.nan  # beta 0 must not read C
        a64 = a[:, :k].astype(np.float64)
        b64 = b[:, :cols].astype(np.float64)
        b64 = b64.T if trans_b else b64
        c0 = np.nan_to_num(c.astype(np.float64)) if beta else 0.0
        want = alpha * (a64 @ b64) + beta * c0
        # The relative error bound of a float32 dot product: |a| @ |b|, not |result|.
        scale = abs(alpha) * (np.abs(a64) @ np.abs(b64)) + abs(beta) * np.abs(c0) + 1e-30
        if order == COL_MAJOR:  # the same product, transposed storage
            at, bt = np.ascontiguousarray(a[:, :k].T), np.ascontiguousarray(b64.T, np.float32)
            ct = np.ascontiguousarray(np.nan_to_num(c).T)
            self.sgemm(
                COL_MAJOR, NO_TRANS, NO_TRANS, m, n, k, alpha,
                at.ctypes.data_as(P), m, bt.ctypes.data_as(P), k, beta, ct.ctypes.data_as(P), m,
            )  # fmt: skip
            got = ct.T
        else:
            self.sgemm(
                order, trans_a, TRANS if trans_b else NO_TRANS, m, n, k, alpha,
                a.ctypes.data_as(P), lda, b.ctypes.data_as(P), ldb, beta,
                c.ctypes.data_as(P), n,
            )  # fmt: skip
            got = c
        err = float(np.max(np.abs(got - want) / scale))
        self.cases += 1
        if not err <= 1e-5:
            raise SystemExit(f"m={m} n={n} k={k} trans_b={trans_b} rel err {err}")
        self.worst = max(self.worst, err)


def main(dot_shapes: list[list[int]], axpy_shapes: list[list[int]]) -> None:
    checker = Checker()
    check = checker.check
    before = native_gemm_counts()
    for m in range(1, 17):
        for n, k in dot_shapes:
            if n * k * m > 3e6 and m not in (1, 2, 7, 8, 16):
                continue  # the head at every M is slow to check; its M = 1, 2, 7, 8, 16 suffice
            check(m, n, k, True, 1.0, 0.0, 0, 0)
        for n, k in axpy_shapes:
            check(m, n, k, False, 1.0, 0.0, 0, 0)
    for trans_b in (True, False):  # alpha/beta, padded leading dimensions (slices of wider rows)
        check(5, 77, 65, trans_b, 0.5, 0.25, 3, 5)
        check(16, 640, 96, trans_b, -2.0, 1.0, 16, 1)
        check(3, 19, 300, trans_b, 1.0, 1.0, 0, 0)
    native = native_gemm_counts()[0] - before[0]
    forwarded0 = native_gemm_counts()[1]
    check(17, 96, 64, True, 1.0, 0.0, 0, 0)  # M > 16: OpenBLAS
    check(4, 40, 24, False, 1.0, 0.0, 0, 0, order=COL_MAJOR)  # column-major: OpenBLAS
    forwarded = native_gemm_counts()[1] - forwarded0
    result = {
        "path": native_gemm_path(),
        "cases": checker.cases,
        "native": native,
        "forwarded": forwarded,
        "worst": checker.worst,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(*json.loads(sys.argv[1]))
