"""Import boundaries (tui -> shared <- daemon), checked in fresh interpreters.

Every module of each package is imported (found with pkgutil, so new modules are covered);
after each import `sys.modules` must hold none of that package's forbidden imports.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from repo_paths import TESTS

FORBIDDEN = {
    "mlxcel.shared": ["textual", "mlx", "mlx_lm", "mlxcel.daemon", "mlxcel.tui"],
    "mlxcel.tui": ["mlx", "mlx_lm", "mlxcel.daemon"],
    "mlxcel.daemon": ["textual", "mlxcel.tui"],
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_boundaries(package: str) -> None:
    script = TESTS / "child_scripts" / "boundaries_import_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), package, json.dumps(FORBIDDEN[package])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, "modules that fail to import:\n" + "\n".join(
        report["errors"].values()
    )
    assert report["violations"] == {}, f"{package} must not import {FORBIDDEN[package]}"
    assert len(report["modules"]) > 1 or package != "mlxcel.daemon"
