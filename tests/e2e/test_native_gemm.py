"""The few-row sgemm kernel (daemon/models/native/): exact enough on every shape the models use,
on both of its paths, reached by MLX's matmuls, and loud about which path it took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlxcel.daemon.models.blas import (
    CORETYPE_ENV,
    CORETYPE_SOURCE_ENV,
    GEMM_ISA_ENV,
    GEMM_LIB_ENV,
    NO_GEMM_ENV,
    best_coretype,
    build_native_gemm,
    cpu_flags,
    fast_blas_env,
    find_system_openblas,
    native_gemm_library,
    native_gemm_unavailable,
)

pytestmark = [
    pytest.mark.e2e,  # Python subprocesses under the preload (docs/testing.md)
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or "avx2" not in cpu_flags(),
        reason="the kernel is for x86-64 Linux CPUs with AVX2 (it is never loaded elsewhere)",
    ),
]

# (N, K) of every product of the models we serve: SmolLM2-135M (fused q/k/v 960, o 576,
# fused gate/up 3072, down, head 49152) and the tiny test model (hidden 64, MLP 128, vocab
# 256); attention's q k^T and p v (K = head_dim 64, N = keys); odd sizes on both axes.
DOT_SHAPES = [
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (49152, 576),
    (128, 64),
    (256, 64),
    (64, 128),
    (300, 64),
    (1, 1),
    (7, 13),
    (33, 577),
    (1537, 31),
]
AXPY_SHAPES = [(64, 300), (64, 17), (576, 576), (13, 7), (129, 65), (1, 1)]

CHECK_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
    import numpy as np
    from mlxcel.daemon.models.blas import native_gemm_counts, native_gemm_path

    dot_shapes, axpy_shapes = json.loads(sys.argv[1])
    P = ctypes.POINTER(ctypes.c_float)
    sgemm = ctypes.CDLL(None).cblas_sgemm
    sgemm.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int, ctypes.c_float, P, ctypes.c_int
    ]
    rng = np.random.default_rng(0)
    worst, cases = 0.0, 0

    def check(m, n, k, trans_b, alpha, beta, pad_a, pad_b, order=101, trans_a=111):
        global worst, cases
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
        if order == 102:  # column-major: the same product, transposed storage
            at, bt = np.ascontiguousarray(a[:, :k].T), np.ascontiguousarray(b64.T, np.float32)
            ct = np.ascontiguousarray(np.nan_to_num(c).T)
            sgemm(102, 111, 111, m, n, k, alpha, at.ctypes.data_as(P), m,
                  bt.ctypes.data_as(P), k, beta, ct.ctypes.data_as(P), m)
            got = ct.T
        else:
            sgemm(order, trans_a, 112 if trans_b else 111, m, n, k, alpha,
                  a.ctypes.data_as(P), lda, b.ctypes.data_as(P), ldb, beta,
                  c.ctypes.data_as(P), n)
            got = c
        err = float(np.max(np.abs(got - want) / scale))
        cases += 1
        if not err <= 1e-5:
            raise SystemExit(f"m={m} n={n} k={k} trans_b={trans_b} rel err {err}")
        worst = max(worst, err)

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
    check(4, 40, 24, False, 1.0, 0.0, 0, 0, order=102)  # column-major: OpenBLAS
    forwarded = native_gemm_counts()[1] - forwarded0
    print(json.dumps({"path": native_gemm_path(), "cases": cases, "native": native,
                      "forwarded": forwarded, "worst": worst}))
    """
)

MLX_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    import mlx.core as mx
    import numpy as np
    from mlxcel.daemon.models.blas import blas_label, log_blas_choice, native_gemm_counts

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
        want = [x64 @ w64.T, 0.5 * (x64 @ w64.T) + 2.0 * np.array(bias, np.float64),
                np.stack([x64 @ w64[i * 192:(i + 1) * 192].T for i in range(5)])]
        scale = np.abs(x64) @ np.abs(w64).T + 1e-30
        for g, wnt in zip(got, want):
            wnt = wnt.reshape(np.array(g).shape)
            err = np.abs(np.array(g, np.float64) - wnt) / (scale.max() if g.ndim == 3 else scale)
            worst = max(worst, float(err.max()))
    print(json.dumps({"label": blas_label(), "worst": worst,
                      "native": native_gemm_counts()[0] - before}))
    """
)


def _child(script: str, env: dict[str, str], *args: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def kernel_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kernel built from the current source (setup.sh builds the installed copy)."""
    if find_system_openblas() is None:
        pytest.fail("no system OpenBLAS: scripts/setup.sh installs libopenblas0-pthread")
    return build_native_gemm(tmp_path_factory.mktemp("gemm") / "libmlxcel_gemm.so")


def _env(lib: Path, kernel: bool = True, **extra: str) -> dict[str, str]:
    """This process's environment (an operator's OPENBLAS_CORETYPE kept) with `lib` in front."""
    drop = (GEMM_ISA_ENV, NO_GEMM_ENV, CORETYPE_SOURCE_ENV, "LD_PRELOAD")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    env = fast_blas_env({**base, GEMM_LIB_ENV: str(lib), **extra})
    front = [str(lib), str(find_system_openblas())] if kernel else [str(find_system_openblas())]
    assert env["LD_PRELOAD"].split()[: len(front)] == front
    return env


def test_setup_built_the_installed_kernel() -> None:
    """The README's setup leaves the kernel where the daemon looks for it."""
    assert native_gemm_unavailable() is None, native_gemm_unavailable()
    assert native_gemm_library().is_file()


@pytest.mark.parametrize("isa", ["best", "avx2"])
def test_every_model_shape_matches_numpy(kernel_lib: Path, isa: str) -> None:
    extra = {GEMM_ISA_ENV: "avx2", CORETYPE_ENV: "Haswell"} if isa == "avx2" else {}
    shapes = json.dumps([DOT_SHAPES, AXPY_SHAPES])
    result, _ = _child(CHECK_SCRIPT, _env(kernel_lib, **extra), shapes)
    expected = "avx2" if isa == "avx2" or "avx512f" not in cpu_flags() else "avx512"
    assert result["path"] == expected
    assert result["cases"] > 16 * (len(DOT_SHAPES) + len(AXPY_SHAPES)) - 16 * 5
    assert result["native"] == result["cases"] - 2  # every M <= 16 row-major product ran here
    assert result["forwarded"] == 2  # M = 17 and column-major went to OpenBLAS
    assert result["worst"] <= 1e-5


@pytest.mark.parametrize("isa", ["best", "avx2"])
def test_mlx_matmuls_reach_the_kernel_and_the_log_names_the_path(
    kernel_lib: Path, isa: str
) -> None:
    """No AVX-512 simulated: forced AVX2 kernel and Haswell core type; it runs, matches, says so."""
    extra = {GEMM_ISA_ENV: "avx2", CORETYPE_ENV: "Haswell"} if isa == "avx2" else {}
    result, log = _child(MLX_SCRIPT, _env(kernel_lib, **extra))
    if isa == "avx2":
        assert result["label"] == "openblas Haswell + sgemm avx2"
        assert "OpenBLAS core type Haswell (OPENBLAS_CORETYPE set by the operator)" in log
        assert "few-row sgemm kernel active, avx2 path, forced by MLXCEL_GEMM_ISA=avx2" in log
    elif "avx512f" in cpu_flags():
        coretype = os.environ.get(CORETYPE_ENV) or best_coretype(cpu_flags())
        assert result["label"].endswith(" + sgemm avx512")
        if coretype == "SkylakeX":
            assert result["label"] == "openblas SkylakeX + sgemm avx512"
        assert "few-row sgemm kernel active, avx512 path" in log
    assert result["native"] == 4 * (1 + 1 + 5)  # per row count: matmul, addmm, 5 blocks
    assert result["worst"] <= 1e-5


def test_turned_off_it_is_not_preloaded_and_the_log_says_why(kernel_lib: Path) -> None:
    result, log = _child(MLX_SCRIPT, _env(kernel_lib, False, **{NO_GEMM_ENV: "1"}))
    assert result["native"] == 0 and "sgemm" not in result["label"]
    assert "few-row sgemm kernel not in use: turned off by MLXCEL_NO_NATIVE_GEMM" in log


def test_a_missing_library_is_one_log_line_not_a_failure(tmp_path: Path) -> None:
    env = fast_blas_env({"PATH": "/bin", GEMM_LIB_ENV: str(tmp_path / "absent.so")})
    assert str(tmp_path / "absent.so") not in env["LD_PRELOAD"]
    result, log = _child(MLX_SCRIPT, env)
    assert result["native"] == 0
    assert "few-row sgemm kernel not in use: not built" in log
