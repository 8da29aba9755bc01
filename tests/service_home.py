"""A private home for the service-unit tests (daemon/process/service_units.py): `service_home`
points HOME and MLXCEL_HOME at fresh folders under the test's tmp_path and clears what would
send the unit elsewhere (XDG_CONFIG_HOME, MLXCEL_SOCKET, the managed-by-a-service marker). Each
test module wraps it in its `env` fixture (tests/unit/test_service.py,
tests/e2e/test_service_daemon.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlxcel.daemon.process import service_units as service


def service_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The new HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path / "mlxcel home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("MLXCEL_SOCKET", raising=False)
    monkeypatch.delenv(service.SERVICE_ENV, raising=False)
    return home
