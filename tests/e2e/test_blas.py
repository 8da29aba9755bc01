"""The OpenBLAS fast path: detection, core type by CPU flags, preload env, re-exec (not with
the CUDA backend), the BLAS label, and identical logits with it.

On Linux a missing OpenBLAS fails these tests: the README's setup installs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlxcel.daemon.forward.blas import (
    CORETYPE_ENV,
    CORETYPE_SOURCE_ENV,
    DISABLE_ENV,
    GEMM_LIB_ENV,
    NO_GEMM_ENV,
    best_coretype,
    blas_label,
    build_native_gemm,
    cpu_flags,
    cuda_backend_installed,
    fast_blas_env,
    find_system_openblas,
    parse_cpu_flags,
    slow_blas_env,
)
from repo_paths import TESTS

OPENBLAS = find_system_openblas()
LINUX = sys.platform.startswith("linux")


@pytest.fixture(autouse=True)
def openblas_installed() -> None:
    """Linux without OpenBLAS is a broken setup, not a reason to skip (macOS has Accelerate)."""
    if not LINUX:
        pytest.skip("the OpenBLAS preload is Linux-only (macOS uses Accelerate)")
    if OPENBLAS is None:
        pytest.fail("no system OpenBLAS: scripts/setup.sh installs libopenblas0-pthread")


CHILD_SCRIPTS = TESTS / "child_scripts"

ZEN4_NO_AVX512 = "processor : 0\nflags : fpu sse sse2 avx fma avx2 bmi2\n"
ZEN5 = "flags : fpu avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16\n"
SANDY = "flags : fpu sse4_2 avx\n"
ARM = "Features : fp asimd evtstrm aes pmull sha1 sha2 crc32\n"


def _run(script: Path, env: dict[str, str], *args: str) -> str:
    """A child script under `env`; its stripped stdout."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_coretype_follows_the_cpu_flags() -> None:
    assert best_coretype(parse_cpu_flags(ZEN5)) == "SkylakeX"
    assert best_coretype(parse_cpu_flags(ZEN4_NO_AVX512)) == "Haswell"
    assert best_coretype(parse_cpu_flags(SANDY)) == "Sandybridge"
    assert best_coretype(parse_cpu_flags(ARM)) is None
    assert best_coretype({"avx512f", "avx2", "fma"}) == "Haswell"  # avx512f alone is not enough
    assert parse_cpu_flags("") == frozenset()


def test_preload_env_sets_the_coretype_unless_the_operator_did() -> None:
    base = {"PATH": "/bin", NO_GEMM_ENV: "1"}
    env = fast_blas_env(base)
    assert env.get(CORETYPE_ENV) == best_coretype(cpu_flags())
    if env.get(CORETYPE_ENV):
        assert env[CORETYPE_SOURCE_ENV] == "cpu flags"
    mine = fast_blas_env({**base, CORETYPE_ENV: "Haswell"})
    assert mine[CORETYPE_ENV] == "Haswell" and mine[CORETYPE_SOURCE_ENV] == "operator"
    assert fast_blas_env(mine) == mine


def test_preload_env_puts_the_kernel_in_front(tmp_path: Path) -> None:
    lib = build_native_gemm(tmp_path / "libmlxcel_gemm.so")  # a real one: it is ABI-checked
    env = fast_blas_env({"PATH": "/bin", GEMM_LIB_ENV: str(lib), "LD_PRELOAD": "/x/libfoo.so"})
    if {"avx2", "fma"} <= cpu_flags():
        assert env["LD_PRELOAD"].split() == [str(lib), str(OPENBLAS), "/x/libfoo.so"]
    else:
        assert env["LD_PRELOAD"].split() == [str(OPENBLAS), "/x/libfoo.so"]
    assert fast_blas_env(env) == env
    assert "LD_PRELOAD" not in slow_blas_env(env | {"LD_PRELOAD": f"{lib} {OPENBLAS}"})


def test_preload_env() -> None:
    env = fast_blas_env({"PATH": "/bin", "LD_PRELOAD": "/x/libfoo.so", NO_GEMM_ENV: "1"})
    assert env["LD_PRELOAD"].split() == [str(OPENBLAS), "/x/libfoo.so"]
    assert fast_blas_env(env) == env  # idempotent
    assert fast_blas_env({"PATH": "/bin", DISABLE_ENV: "1"}) == {"PATH": "/bin", DISABLE_ENV: "1"}
    slow = slow_blas_env(env)
    assert slow["LD_PRELOAD"] == "/x/libfoo.so" and slow[DISABLE_ENV] == "1"
    assert "LD_PRELOAD" not in slow_blas_env({"LD_PRELOAD": str(OPENBLAS)})


def test_logits_agree_with_and_without_openblas(tiny_model_dir: Path, tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast.npy", tmp_path / "slow.npy"
    logits = CHILD_SCRIPTS / "blas_logits.py"
    assert _run(logits, fast_blas_env(), str(tiny_model_dir), str(fast)) == "openblas openblas"
    assert _run(logits, slow_blas_env(), str(tiny_model_dir), str(slow)) == "reference reference"
    a, b = np.load(fast), np.load(slow)
    assert a.shape == b.shape and a.shape[0] == 2
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_ensure_fast_blas_reexecs_once() -> None:
    base = slow_blas_env()
    base.pop(DISABLE_ENV)
    reexec = CHILD_SCRIPTS / "blas_reexec.py"
    assert _run(reexec, base) == "openblas 1"
    assert _run(reexec, {**base, DISABLE_ENV: "1"}) == "reference -"
    # Already preloaded: no re-exec (the marker stays unset).
    assert _run(reexec, fast_blas_env(base)) == "openblas -"


def test_the_cuda_backend_installed_means_no_reexec(tmp_path: Path) -> None:
    """An `mlx-cuda-12` distribution (metadata only, mlx not imported): no OpenBLAS re-exec."""
    info = tmp_path / "mlx_cuda_12-0.32.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-cuda-12\nVersion: 0.32.4\n")
    assert not cuda_backend_installed()
    base = slow_blas_env()
    base.pop(DISABLE_ENV)
    env = {**base, "PYTHONPATH": str(tmp_path)}
    assert _run(CHILD_SCRIPTS / "blas_cuda_backend.py", env) == "True"
    reexec = CHILD_SCRIPTS / "blas_reexec.py"
    assert _run(reexec, env) == "reference -"  # not re-executed, nothing preloaded


def test_the_label_names_the_matmul_backend_in_use() -> None:
    assert blas_label("cuda") == "cuda"
    assert blas_label("metal") == "metal"
    env = fast_blas_env({**slow_blas_env(), DISABLE_ENV: "", CORETYPE_ENV: "Haswell"})
    label = _run(CHILD_SCRIPTS / "blas_label.py", env)
    assert label.startswith("openblas Haswell"), label
    assert _run(CHILD_SCRIPTS / "blas_label.py", slow_blas_env()) == "reference"


def test_status_and_models_show_the_core_type_and_kernel(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A real daemon on the daemon's BLAS setup: /v1/models and the status snapshot (which the
    console header and `status` print) name the OpenBLAS core type and the kernel path."""
    env = fast_blas_env({**slow_blas_env(), DISABLE_ENV: "", CORETYPE_ENV: "Haswell"})
    daemon = CHILD_SCRIPTS / "blas_daemon.py"
    out = json.loads(_run(daemon, env, str(tiny_model_dir), str(tmp_path)))
    assert out["models"] == out["status"]
    expected = "openblas Haswell"
    if {"avx2", "fma"} <= cpu_flags():
        expected += " + sgemm avx512" if "avx512f" in cpu_flags() else " + sgemm avx2"
    assert out["status"] == expected
