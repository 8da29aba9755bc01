"""OpenBLAS against the wheel's reference BLAS on the real default model (SmolLM2): the greedy
tokens of a batch through the engine are the same with either, not only logits within a
tolerance (tests/e2e/test_blas.py checks those on the tiny model). Each side is its own
subprocess: the OpenBLAS preload only takes effect from process start (daemon/forward/blas.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlxcel.daemon.forward.blas import fast_blas_env, find_system_openblas, slow_blas_env
from repo_paths import TESTS


def run_engine(env: dict[str, str], model_dir: Path) -> dict[str, object]:
    """tests/child_scripts/blas_engine_e2e_greedy.py under `env`: the BLAS and the tokens."""
    script = TESTS / "child_scripts" / "blas_engine_e2e_greedy.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_greedy_tokens_are_the_same_with_openblas_and_reference_blas(
    default_model_dir: Path,
) -> None:
    if find_system_openblas() is None:
        if not sys.platform.startswith("linux"):
            pytest.skip("the OpenBLAS preload is a Linux fast path")
        pytest.fail("no system OpenBLAS: scripts/setup.sh installs it (apt libopenblas0-pthread)")
    fast = run_engine(fast_blas_env(), default_model_dir)
    slow = run_engine(slow_blas_env(), default_model_dir)
    assert (fast["blas"], slow["blas"]) == ("openblas", "reference")
    assert sorted(fast["tokens"]) == [f"q{i}" for i in range(4)]  # type: ignore[arg-type]
    assert all(len(set(t)) > 3 for t in fast["tokens"].values())  # type: ignore[union-attr]
    assert fast["tokens"] == slow["tokens"]
