"""Service units: rendering for both platforms, systemd-analyze / plistlib checks, and real
install/uninstall file round trips with the service-manager calls recorded. The unit's command
run as a daemon is tests/e2e/test_service_daemon.py's."""

from __future__ import annotations

import argparse
import os
import plistlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from mlxcel.daemon.process import service_units as service
from mlxcel.shared.paths import get_paths
from service_home import service_home

LAUNCHD_KEYS = ("Label", "ProgramArguments", "RunAtLoad", "KeepAlive")
LAUNCHD_KEYS += ("StandardOutPath", "StandardErrorPath", "EnvironmentVariables")


class Recorder:
    """Stands in for systemctl/launchctl (a boundary we don't own) and records the calls."""

    def __init__(self, failing: Sequence[str] = ()) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.failing = set(failing)

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = tuple(argv)
        self.calls.append(argv)
        failed = any(word in argv for word in self.failing)
        return subprocess.CompletedProcess(argv, 1 if failed else 0, "", "boom" if failed else "")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return service_home(tmp_path, monkeypatch)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mlxcel-daemon")
    service.add_service_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    """The unit checker; on Linux `scripts/setup.sh --dev` installs it, so missing is a failure."""
    found = shutil.which("systemd-analyze")
    if found:
        return found
    if not sys.platform.startswith("linux"):
        pytest.skip("systemd units are checked on Linux only (no systemd here)")
    pytest.fail("systemd-analyze is missing: run scripts/setup.sh --dev (apt package systemd)")


def verify_unit(analyze: str, text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    unit_dir = tmp_path / "verify"
    unit_dir.mkdir(exist_ok=True)
    unit = unit_dir / service.UNIT_NAME
    unit.write_text(text)
    # a short runtime folder: the user's socket units (gpg-agent's) put their socket paths
    # below it, and a deep tmp_path (a pytest-xdist worker's) pushes them past the 108-byte limit
    runtime = tempfile.mkdtemp(prefix="xdg-")
    try:
        env = {**os.environ, "XDG_RUNTIME_DIR": runtime}
        return subprocess.run(
            [analyze, "--user", "verify", str(unit)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_print_systemd_unit_passes_systemd_analyze_verify(
    env: Path, tmp_path: Path, systemd_analyze: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service.run_service(parse(["install-service", "--print"]), kind="systemd") == 0
    out = capsys.readouterr().out
    assert f"ExecStart={os.path.abspath(sys.executable)} -m mlxcel.daemon.cli start" in out
    for line in ("Type=simple", "Restart=on-failure", "RestartSec=2", "KillSignal=SIGTERM"):
        assert line in out.splitlines()
    assert "WantedBy=default.target" in out
    assert f'Environment="MLXCEL_HOME={tmp_path}/mlxcel home"' in out
    result = verify_unit(systemd_analyze, out, tmp_path)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert not (env / ".config").exists()  # --print writes nothing


def test_systemd_quoting_survives_odd_paths(
    env: Path, tmp_path: Path, systemd_analyze: str
) -> None:
    odd = tmp_path / "py dir %h $HOME"
    odd.mkdir()
    (odd / "python").symlink_to(sys.executable)
    argv = [*service.daemon_argv(str(odd / "python")), '--x=$HOME "q" 50%']
    environment = {"MLXCEL_HOME": '/a b/%i/$X/"q"\\z', "PATH": "/usr/bin"}
    text = service.render_unit("systemd", argv, environment, tmp_path)
    # verify checks that the executable exists: a mis-quoted path would not.
    result = verify_unit(systemd_analyze, text, tmp_path)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert '"--x=$$HOME \\"q\\" 50%%"' in text
    assert 'Environment="MLXCEL_HOME=/a b/%%i/$X/\\"q\\"\\\\z"' in text
    with pytest.raises(ValueError, match="quotes"):
        service.render_unit("systemd", ['/opt/"q"/python'], {}, tmp_path)


def test_systemd_analyze_catches_a_broken_unit(
    env: Path, tmp_path: Path, systemd_analyze: str
) -> None:
    argv = service.daemon_argv(str(tmp_path / "no-such-python"))
    text = service.render_unit("systemd", argv, {"PATH": "/usr/bin"}, tmp_path)
    assert verify_unit(systemd_analyze, text, tmp_path).returncode != 0


def test_launchd_plist_parses_with_the_keys_launchd_needs(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path / "a <b> & 'c'"))
    spec = service.build_spec("launchd")
    assert spec.path == env / "Library" / "LaunchAgents" / "com.mlxcel.daemon.plist"
    plist = plistlib.loads(spec.text.encode())
    for key in LAUNCHD_KEYS:
        assert key in plist, key
    assert plist["Label"] == "com.mlxcel.daemon"
    assert plist["ProgramArguments"] == service.daemon_argv()
    assert plist["ProgramArguments"][0] == os.path.abspath(sys.executable)
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["EnvironmentVariables"]["MLXCEL_HOME"] == str(tmp_path / "a <b> & 'c'")
    assert plist["EnvironmentVariables"][service.SERVICE_ENV] == "launchd"
    log_dir = get_paths().log_dir
    assert Path(plist["StandardOutPath"]).parent == log_dir
    assert Path(plist["StandardErrorPath"]).parent == log_dir
    if shutil.which("plutil"):  # macOS only
        check = subprocess.run(["plutil", "-lint", "-"], input=spec.text, text=True, check=False)
        assert check.returncode == 0


def test_unit_values_with_line_breaks_are_refused(tmp_path: Path) -> None:
    for kind in ("systemd", "launchd"):
        with pytest.raises(ValueError, match="line break"):
            service.render_unit(kind, ["/bin/python"], {"X": "a\nb"}, tmp_path)


def test_systemd_path_honours_xdg_config_home(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert service.unit_path("systemd") == env / ".config/systemd/user/mlxcel.service"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert service.unit_path("systemd") == tmp_path / "xdg/systemd/user/mlxcel.service"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/is/ignored")
    assert service.unit_path("systemd") == env / ".config/systemd/user/mlxcel.service"


def test_systemd_install_uninstall_round_trip(env: Path) -> None:
    before = files_under(env)
    rec = Recorder()
    assert service.run_service(parse(["install-service"]), runner=rec, manager="systemd") == 0
    unit = ".config/systemd/user/mlxcel.service"
    assert files_under(env) - before == {unit}
    assert (env / unit).read_text() == service.build_spec("systemd").text
    ctl = ("systemctl", "--user")
    assert rec.calls == [(*ctl, "daemon-reload"), (*ctl, "enable", "--now", "mlxcel.service")]

    rec.calls.clear()  # a second install restarts the running unit with the new file
    assert service.run_service(parse(["install-service"]), runner=rec, manager="systemd") == 0
    assert rec.calls[-2:] == [
        (*ctl, "enable", "mlxcel.service"),
        (*ctl, "restart", "mlxcel.service"),
    ]

    rec.calls.clear()
    assert service.run_service(parse(["uninstall-service"]), runner=rec, manager="systemd") == 0
    assert files_under(env) == before
    assert rec.calls == [(*ctl, "disable", "--now", "mlxcel.service"), (*ctl, "daemon-reload")]


def test_systemd_no_start_enables_without_starting(env: Path) -> None:
    rec = Recorder()
    args = parse(["install-service", "--no-start"])
    assert service.run_service(args, runner=rec, manager="systemd") == 0
    assert rec.calls[-1] == ("systemctl", "--user", "enable", "mlxcel.service")
    assert not any("--now" in c or "start" in c or "restart" in c for c in rec.calls)


def test_launchd_install_uninstall_round_trip(env: Path) -> None:
    before = files_under(env)
    rec = Recorder()
    args = parse(["install-service"])
    assert service.run_service(args, runner=rec, manager="launchd", kind="launchd") == 0
    plist = env / "Library/LaunchAgents/com.mlxcel.daemon.plist"
    assert files_under(env) - before == {str(plist.relative_to(env))}
    assert get_paths().log_dir.is_dir()  # launchd would not create it for the log files
    target = f"gui/{os.getuid()}/com.mlxcel.daemon"
    assert rec.calls == [
        ("launchctl", "enable", target),
        ("launchctl", "bootout", target),
        ("launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)),
    ]
    rec.calls.clear()
    args = parse(["uninstall-service"])
    assert service.run_service(args, runner=rec, manager="launchd", kind="launchd") == 0
    assert files_under(env) == before
    assert rec.calls == [("launchctl", "bootout", target)]


def test_launchd_no_start_only_enables(env: Path) -> None:
    rec = Recorder()
    args = parse(["install-service", "--no-start"])
    assert service.run_service(args, runner=rec, manager="launchd", kind="launchd") == 0
    assert rec.calls == [("launchctl", "enable", f"gui/{os.getuid()}/com.mlxcel.daemon")]


def test_without_a_service_manager_install_prints_the_unit_and_fails(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service.run_service(parse(["install-service"]), manager=None, kind="systemd") == 1
    captured = capsys.readouterr()
    assert "[Service]" in captured.out
    reason = captured.err.strip().splitlines()
    assert len(reason) == 1 and "systemd is not running" in reason[0]
    assert files_under(env) == set()
    assert service.run_service(parse(["uninstall-service"]), manager=None, kind="systemd") == 0
    assert "no service installed" in capsys.readouterr().out


def test_a_failing_manager_call_is_reported(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Recorder(failing=["enable"])
    assert service.run_service(parse(["install-service"]), runner=rec, manager="systemd") == 1
    err = capsys.readouterr().err
    assert "systemctl --user enable --now mlxcel.service` failed: boom" in err


def test_a_hand_started_daemon_blocks_starting_the_service(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    pid_file = get_paths().pid_file
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    plain = subprocess.Popen(sleeper, env=dict(os.environ))
    managed = subprocess.Popen(sleeper, env={**os.environ, service.SERVICE_ENV: "systemd"})
    try:
        pid_file.write_text(f"{plain.pid}\n")
        rec = Recorder()
        assert service.run_service(parse(["install-service"]), runner=rec, manager="systemd") == 1
        assert f"pid {plain.pid}" in capsys.readouterr().err and rec.calls == []
        args = parse(["install-service", "--no-start"])
        assert service.run_service(args, runner=rec, manager="systemd") == 0
        pid_file.write_text(f"{managed.pid}\n")  # the service's own daemon: reinstall is fine
        assert service.run_service(parse(["install-service"]), runner=rec, manager="systemd") == 0
        assert service.process_service(managed.pid) == "systemd"
        assert service.process_service(plain.pid) is None
    finally:
        for proc in (plain, managed):
            proc.kill()
            proc.wait()


def test_managed_by_service_reads_the_environment() -> None:
    assert service.managed_by_service({}) is None
    assert service.managed_by_service({"MLXCEL_SERVICE": "systemd"}) == "systemd"
    assert service.managed_by_service({"MLXCEL_SERVICE": "launchd"}) == "launchd"
    assert service.managed_by_service({"MLXCEL_SERVICE": "bogus"}) is None
    assert service.managed_by_service({"XPC_SERVICE_NAME": "com.mlxcel.daemon"}) == "launchd"
    assert service.managed_by_service({"XPC_SERVICE_NAME": "0"}) is None


def test_service_status_reports_the_installed_file(env: Path) -> None:
    status = service.service_status()
    assert status.installed is False
    assert status.path == service.unit_path(service.host_kind())
    rec = Recorder()
    service.install(service.build_spec(status.kind), start=False, runner=rec)
    assert service.service_status().installed is True
