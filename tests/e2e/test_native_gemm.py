"""The few-row sgemm kernel (daemon/forward/native/): exact enough on every shape the models use,
on both of its paths, reached by MLX's matmuls, and loud about which path it took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlxcel.daemon.forward.blas import (
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
from repo_paths import TESTS

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

CHILD_SCRIPTS = TESTS / "child_scripts"
CHECK_SCRIPT = CHILD_SCRIPTS / "native_gemm_check.py"  # cblas_sgemm on every shape vs numpy
MLX_SCRIPT = CHILD_SCRIPTS / "native_gemm_mlx.py"  # MLX matmuls vs numpy, the BLAS choice logged


def _child(script: Path, env: dict[str, str], *args: str) -> tuple[dict, str]:
    """A child script under `env`: the JSON object it printed last, and its stderr."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
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
