"""The `MLXCEL_*` switches read once at import (shared/switches.py), in a fresh interpreter that
imports mlx: the native thresholds take MLXCEL_NATIVE_MIN_ROWS and keep their defaults
otherwise. The registry itself is tests/unit/test_switches.py's."""

from __future__ import annotations

import os
import subprocess
import sys

from repo_paths import TESTS


def test_the_native_thresholds_are_read_once_at_import() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    env["MLXCEL_NATIVE_MIN_ROWS"] = "3"
    script = TESTS / "child_scripts" / "switches_native_thresholds.py"
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "16384"]
