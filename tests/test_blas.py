"""The OpenBLAS fast path: detection, preload env, re-exec, and identical logits with it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mlxcel.daemon.models.blas import (
    DISABLE_ENV,
    fast_blas_env,
    find_system_openblas,
    slow_blas_env,
)

OPENBLAS = find_system_openblas()
needs_openblas = pytest.mark.skipif(OPENBLAS is None, reason="no system OpenBLAS installed")

LOGITS_SCRIPT = textwrap.dedent(
    """
    import sys
    import mlx.core as mx
    import numpy as np
    from mlxcel.daemon.models import load_model
    from mlxcel.daemon.models.blas import blas_name

    loaded = load_model(sys.argv[1], dtype="float32")
    ids = loaded.tokenizer.encode("What is the capital of France? " * 8)
    logits = loaded.model(mx.array([ids, ids[::-1]]))
    np.save(sys.argv[2], np.array(logits))
    print(blas_name(), loaded.info.blas)
    """
)

REEXEC_SCRIPT = textwrap.dedent(
    """
    import os
    from mlxcel.daemon.models.blas import blas_name, ensure_fast_blas
    ensure_fast_blas()
    import mlx.core as mx
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    print(blas_name(), os.environ.get("MLXCEL_BLAS_REEXEC", "-"))
    """
)


def _run(script: str, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@needs_openblas
def test_preload_env() -> None:
    env = fast_blas_env({"PATH": "/bin", "LD_PRELOAD": "/x/libfoo.so"})
    assert env["LD_PRELOAD"].split() == [str(OPENBLAS), "/x/libfoo.so"]
    assert fast_blas_env(env) == env  # idempotent
    assert fast_blas_env({"PATH": "/bin", DISABLE_ENV: "1"}) == {"PATH": "/bin", DISABLE_ENV: "1"}
    slow = slow_blas_env(env)
    assert slow["LD_PRELOAD"] == "/x/libfoo.so" and slow[DISABLE_ENV] == "1"
    assert "LD_PRELOAD" not in slow_blas_env({"LD_PRELOAD": str(OPENBLAS)})


@needs_openblas
def test_logits_agree_with_and_without_openblas(tiny_model_dir: Path, tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast.npy", tmp_path / "slow.npy"
    assert _run(LOGITS_SCRIPT, fast_blas_env(), str(tiny_model_dir), str(fast)) == (
        "openblas openblas"
    )
    assert _run(LOGITS_SCRIPT, slow_blas_env(), str(tiny_model_dir), str(slow)) == (
        "reference reference"
    )
    a, b = np.load(fast), np.load(slow)
    assert a.shape == b.shape and a.shape[0] == 2
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@needs_openblas
def test_ensure_fast_blas_reexecs_once() -> None:
    base = slow_blas_env()
    base.pop(DISABLE_ENV)
    assert _run(REEXEC_SCRIPT, base) == "openblas 1"
    assert _run(REEXEC_SCRIPT, {**base, DISABLE_ENV: "1"}) == "reference -"
    # Already preloaded: no re-exec (the marker stays unset).
    assert _run(REEXEC_SCRIPT, fast_blas_env(base)) == "openblas -"
