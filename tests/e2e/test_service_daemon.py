"""The service unit's command run as a daemon subprocess, as systemd/launchd would run it
(daemon/process/service_units.py): healthy, seen as managed, and a clean exit on SIGTERM. The units'
rendering and their install/uninstall round trips are tests/unit/test_service.py's."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from daemon_helpers import wait_until
from mlxcel.daemon.forward.blas import NATIVE_CACHE_ENV
from mlxcel.daemon.process import service_units as service
from service_home import service_home


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return service_home(tmp_path, monkeypatch)


def unit_command(text: str) -> tuple[list[str], dict[str, str]]:
    """ExecStart and Environment of a rendered unit, unescaped as systemd would."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            argv = [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(value)]
        elif key == "Environment":
            name, _, val = shlex.split(value)[0].replace("%%", "%").partition("=")
            env[name] = val
    return argv, env


def test_the_units_command_serves_and_exits_0_on_sigterm(env: Path, tiny_model_dir: Path) -> None:
    """What systemd/launchd would run: healthy, seen as managed, and a clean exit on SIGTERM
    (so Restart=on-failure / KeepAlive.SuccessfulExit=false leave a stopped daemon stopped)."""
    argv, unit_env = unit_command(service.build_spec("systemd").text)
    assert argv == service.daemon_argv()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    unit_env |= {"HOME": str(env), "MLXCEL_MODEL": str(tiny_model_dir), "MLXCEL_PORT": str(port)}
    unit_env[NATIVE_CACHE_ENV] = os.environ[NATIVE_CACHE_ENV]  # the kernels built (service_home)
    log = (env / "daemon.out").open("wb")
    proc = subprocess.Popen(argv, env=unit_env, stdout=log, stderr=subprocess.STDOUT, cwd=env)

    def healthy() -> bool:
        if _healthy(port):
            return True
        assert proc.poll() is None, (env / "daemon.out").read_text()
        return False

    try:
        wait_until(healthy, timeout=120, poll=0.3, what="the daemon healthy")
        assert service.process_service(proc.pid) == "systemd"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (env / "daemon.out").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
