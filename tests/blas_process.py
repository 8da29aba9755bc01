"""Running a test script in a process with the daemon's BLAS setup (forward/blas.py): the native
chunk step needs the preloaded cblas_sgemm, which a pytest process does not have."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def run_with_fast_blas(script: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run the Python script at `script` (a file under tests/child_scripts/) with `args`, in the
    daemon's BLAS environment; the JSON object it printed last. Skips without a system
    OpenBLAS; fails when the script fails or says the chunk step is unavailable
    (`{"available": false}`)."""
    from mlxcel.daemon.forward.blas import fast_blas_env, find_system_openblas

    if not isinstance(script, Path) or not script.is_file():
        raise TypeError(f"run_with_fast_blas takes a script file's path, not {script!r:.80}")
    if find_system_openblas() is None:
        pytest.skip("no system OpenBLAS: the chunk step needs a cblas_sgemm in the process")
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=fast_blas_env(),
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["available"], "chunk step unavailable with the daemon's BLAS preloaded"
    return out
