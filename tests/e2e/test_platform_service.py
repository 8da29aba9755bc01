"""Issue 17 items 5 and 10 for launchd, simulated on any OS: the plist's keys, and a reinstall
that waits for the old agent to exit before `launchctl bootstrap` (a fake `launchctl` on PATH
that behaves like launchd: bootout signals the agent and returns at once; bootstrap fails with
EIO while the old agent is still there)."""

from __future__ import annotations

import argparse
import json
import os
import plistlib
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlxcel.daemon.process import service_units as service
from mlxcel.daemon.process.lifecycle import pid_file_locked
from mlxcel.shared.paths import get_paths
from repo_paths import TESTS

AGENT_DRAIN_S = 1.5  # how long the fake old agent takes to exit after SIGTERM


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path / "mlxcel-home"))
    monkeypatch.delenv("MLXCEL_SOCKET", raising=False)
    monkeypatch.delenv(service.SERVICE_ENV, raising=False)
    return home


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mlxcel-daemon")
    service.add_service_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_plist_runs_interactive_with_a_raised_open_files_limit(env: Path) -> None:
    spec = service.build_spec("launchd")
    plist = plistlib.loads(spec.text.encode())
    assert plist["ProcessType"] == "Interactive"  # launchd throttles CPU and I/O otherwise
    assert plist["SoftResourceLimits"] == {"NumberOfFiles": 10240}  # macOS default: 256
    assert plist["ExitTimeOut"] == service.STOP_TIMEOUT_S


def _fake_launchctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "launchctl.log"
    bin_dir.mkdir()
    fake = bin_dir / "launchctl"
    pid_file = get_paths().pid_file
    # launchctl itself: runs tests/child_scripts/platform_service_fake_launchctl.py
    script = TESTS / "child_scripts" / "platform_service_fake_launchctl.py"
    argv = shlex.join([sys.executable, str(script), str(log), str(pid_file)])
    fake.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _start_agent() -> subprocess.Popen[str]:
    """The agent launchd runs: holds the daemon's pid lock, drains for a while on SIGTERM."""
    script = TESTS / "child_scripts" / "platform_service_old_agent.py"
    agent = subprocess.Popen(
        [sys.executable, str(script), str(AGENT_DRAIN_S)],
        env={**os.environ, service.SERVICE_ENV: "launchd"},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
    assert pid_file_locked(get_paths().pid_file)
    return agent


def _action_waits_for_the_agent(action: str) -> None:
    agent = _start_agent()
    try:
        started = time.monotonic()
        assert service.run_service(_parse([action]), manager="launchd", kind="launchd") == 0
        assert time.monotonic() - started >= AGENT_DRAIN_S * 0.9
        assert not pid_file_locked(get_paths().pid_file)  # gone when the command returns
        assert agent.wait(timeout=10) == 0
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.e2e  # Python subprocesses (docs/testing.md)
def test_reinstall_waits_for_the_old_agent_before_bootstrap(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _fake_launchctl(tmp_path, monkeypatch)
    _action_waits_for_the_agent("install-service")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    target = f"gui/{os.getuid()}/{service.LAUNCHD_LABEL}"
    plist = str(env / "Library/LaunchAgents/com.mlxcel.daemon.plist")
    assert calls == [
        [["enable", target], True],
        [["bootout", target], True],
        [["bootstrap", f"gui/{os.getuid()}", plist], False],  # once, after the agent exited
    ]


@pytest.mark.e2e  # Python subprocesses (docs/testing.md)
def test_uninstall_waits_for_the_agent_to_exit(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _fake_launchctl(tmp_path, monkeypatch)
    service.install(service.build_spec("launchd"), start=False, runner=service.run_command)
    _action_waits_for_the_agent("uninstall-service")
    target = f"gui/{os.getuid()}/{service.LAUNCHD_LABEL}"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[-1] == [["bootout", target], True]


def test_bootstrap_still_refused_is_reported_in_one_line(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "BOOTSTRAP_RETRY_S", 0.5)
    calls: list[tuple[str, ...]] = []

    def runner(argv: object) -> subprocess.CompletedProcess[str]:
        argv = tuple(argv)  # type: ignore[arg-type]
        calls.append(argv)
        failed = argv[1] == "bootstrap"
        err = "Bootstrap failed: 5: Input/output error" if failed else ""
        return subprocess.CompletedProcess(argv, 5 if failed else 0, "", err)

    with pytest.raises(service.ServiceError, match="Input/output error"):
        service.install(service.build_spec("launchd"), start=True, runner=runner)
    assert sum(1 for c in calls if c[1] == "bootstrap") >= 2  # retried before giving up
