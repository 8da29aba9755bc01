"""A private home for the service-unit tests (daemon/process/service_units.py): `service_home`
points HOME and MLXCEL_HOME at fresh folders under the test's tmp_path and clears what would
send the unit elsewhere (XDG_CONFIG_HOME, MLXCEL_SOCKET, the managed-by-a-service marker). The
native kernels' build cache stays the user's (MLXCEL_NATIVE_CACHE): a daemon under the new HOME
would compile them again (~15 s). Each test module wraps it in its `env` fixture
(tests/unit/test_service.py, tests/e2e/test_service_daemon.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlxcel.daemon.forward.blas import NATIVE_CACHE_ENV, native_cache_root
from mlxcel.daemon.process import service_units as service


def service_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The new HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv(NATIVE_CACHE_ENV, str(native_cache_root()))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path / "mlxcel home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("MLXCEL_SOCKET", raising=False)
    monkeypatch.delenv(service.SERVICE_ENV, raising=False)
    return home
