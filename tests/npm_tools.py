"""Real npm clients for the e2e tests (Claude Code, Codex CLI): installed once into a cache folder.

`MLXCEL_TEST_CACHE` moves the folder (default `~/.cache/mlxcel-tests`). A test that needs a
client it cannot install (no node/npm, no network) is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

INSTALL_TIMEOUT_S = 600


def cache_folder(name: str) -> Path:
    root = Path(os.environ.get("MLXCEL_TEST_CACHE", Path.home() / ".cache" / "mlxcel-tests"))
    return root / name


def npm_binary(package: str, folder: str, command: str) -> Path:
    """`command` from `package` (`name@version`) installed with npm into the cache's `folder`
    the first time."""
    prefix = cache_folder(folder)
    binary = prefix / "node_modules" / ".bin" / command
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip(f"node and npm are needed to install {package}")
    prefix.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", package]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {package} took over {INSTALL_TIMEOUT_S // 60} minutes (network?)")
    if done.returncode != 0 or not binary.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"npm install {package} failed (network?): {tail[0]}")
    return binary
