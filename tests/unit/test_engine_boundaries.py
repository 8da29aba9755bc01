"""The engine's policy modules are plain Python: importing them never loads mlx / mlx_lm."""

from __future__ import annotations

import subprocess
import sys

import pytest
from repo_paths import TESTS

PLAIN_MODULES = (
    "types",
    "admission",
    "scheduler",
    "kv_budget",
    "prefix_cache",
    "effective_config",
    "constraints",
    "stats",
    "snapshot_builder",
    "runner_api",
    "core",  # the runner and model probe are injected (mlx_parts.py builds the defaults)
)
MLX_MODULES = ("draft_model", "embedder", "memory", "mlx_support", "runner", "solo_runner")


@pytest.mark.parametrize("name", PLAIN_MODULES)
def test_policy_module_does_not_import_mlx(name: str) -> None:
    script = TESTS / "child_scripts" / "engine_boundaries_mlx_imports.py"
    out = subprocess.run(
        [sys.executable, str(script), name], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_only_the_runner_modules_import_mlx_directly() -> None:
    from pathlib import Path

    import mlxcel.daemon.engine as engine_pkg

    folder = Path(engine_pkg.__file__).parent
    importers = sorted(
        p.stem
        for p in folder.glob("*.py")
        if any(
            line.startswith(("import mlx", "from mlx ", "from mlx.", "from mlx_lm"))
            for line in p.read_text().splitlines()
        )
    )
    assert importers == sorted(MLX_MODULES)
