"""Where things are, for tests in any kind folder: the repository root and the helpers' folder."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the helpers (daemon_helpers.py, ...) and conftest.py
ROOT = TESTS.parent
SCRIPTS = ROOT / "scripts"
