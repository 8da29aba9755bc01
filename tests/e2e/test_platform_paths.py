"""Issue 17 items 4-5: sockets under long base dirs (macOS temp dirs) and the 256-descriptor
default soft limit, each with a real daemon subprocess (docs/platforms.md)."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
from daemon_helpers import (
    CLI,
    attach,
    control,
    daemon_env,
    read_line,
    stop_started,
    wait_until,
)
from mlxcel.daemon.process.lifecycle import (
    LifecycleError,
    ensure_private_dir,
    raise_open_files_limit,
)
from mlxcel.shared.paths import MAX_SOCKET_PATH, get_paths, short_socket_dir

# As deep as pytest's temp dir under /private/var/folders/xx/yyyyyyyy/T/pytest-of-u/... goes.
LONG = ("deliberately-long-folder-name-" * 3).rstrip("-")


def _long_home(tmp_path: Path) -> Path:
    home = tmp_path / LONG / LONG / "mlxcel-home"
    assert len(str(home / "run" / "mlxcel.sock")) > MAX_SOCKET_PATH
    return home


def test_socket_under_a_long_home_gets_a_short_private_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXCEL_HOME", str(_long_home(tmp_path)))
    paths = get_paths()
    assert len(os.fsencode(str(paths.socket_path))) <= MAX_SOCKET_PATH
    assert paths.socket_path.parent == short_socket_dir()
    assert paths.runtime_dir == _long_home(tmp_path) / "run"  # pid and state files stay put
    assert get_paths().socket_path == paths.socket_path  # the CLI and the daemon agree
    monkeypatch.setenv("MLXCEL_HOME", str(_long_home(tmp_path) / "other"))
    assert get_paths().socket_path != paths.socket_path  # two homes, two sockets
    monkeypatch.setenv("MLXCEL_HOME", str(tmp_path / "h"))
    assert get_paths().socket_path == tmp_path / "h" / "run" / "mlxcel.sock"  # short: as is


def test_a_foreign_or_linked_socket_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(LifecycleError, match="not a directory owned by this user"):
        ensure_private_dir(tmp_path / "link")
    if os.getuid() == 0:  # root can hand a folder to another uid and check the refusal
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)
        with pytest.raises(LifecycleError, match="not a directory owned by this user"):
            ensure_private_dir(foreign)


def _start(home: Path, model_dir: Path, nofile: int | None = None) -> subprocess.CompletedProcess:
    """`mlxcel-daemon start` (detached), optionally with a lower soft RLIMIT_NOFILE."""
    home.mkdir(parents=True, exist_ok=True)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    try:
        return subprocess.run(
            [*CLI, "start", "--model", str(model_dir), "--port", "0"],
            env=daemon_env(home),
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=limit,
        )
    except subprocess.TimeoutExpired:
        stop_started(home)
        raise


def test_daemon_under_a_long_home_serves_its_socket(tmp_path: Path, tiny_model_dir: Path) -> None:
    home = _long_home(tmp_path)
    done = _start(home, tiny_model_dir)
    try:
        assert done.returncode == 0, done.stderr
        daemon = attach(home)
        assert len(str(daemon.socket)) <= MAX_SOCKET_PATH
        assert daemon.status()["daemon"]["socket_path"] == str(daemon.socket)
        status = subprocess.run(
            [*CLI, "status", "--json"], env=daemon_env(home), capture_output=True, text=True
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["daemon"]["pid"] == daemon.pid
    finally:
        stop_started(home)
    assert not Path(daemon.socket).exists()


def test_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        before, after = raise_open_files_limit()
        assert before == 256 and after == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert after == hard or (after == 10240 and hard > 10240)  # macOS's OPEN_MAX cap
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


CONNECTIONS = 300


def _connect(sock: socket.socket, path: Path, timeout: float = 20.0) -> None:
    """connect(), waiting while the listen backlog is full (EAGAIN on a Unix socket)."""

    def connected() -> bool:
        try:
            sock.connect(str(path))
        except BlockingIOError:
            return False
        return True

    wait_until(connected, timeout, 0.01, what=f"room in the listen backlog of {path}")


def test_300_control_connections_are_served_from_a_256_soft_limit(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """macOS's default soft limit (Terminal, launchd) is 256 descriptors."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < CONNECTIONS + 200:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} is below what the test needs")
    # This process holds the client ends: it needs the descriptors too.
    home = tmp_path / "home"
    done = _start(home, tiny_model_dir, nofile=256)
    assert done.returncode == 0, done.stderr
    daemon = attach(home)
    clients: list[socket.socket] = []
    try:
        for _ in range(CONNECTIONS):  # all open at once
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(20)
            clients.append(sock)
            _connect(sock, daemon.socket)
        line = json.dumps({"id": 1, "method": "status", "params": {}}) + "\n"
        for sock in clients:
            sock.sendall(line.encode())
        replies = [json.loads(read_line(sock)) for sock in clients]
        assert all("result" in r for r in replies), [r for r in replies if "result" not in r][:1]
        assert control(daemon.socket, "status")["result"]["daemon"]["pid"] == daemon.pid
        # mlx_lm.utils sets (2048, 4096) when imported; the daemon raises the soft limit after.
        soft, hard = psutil.Process(daemon.pid).rlimit(psutil.RLIMIT_NOFILE)
        assert soft == hard, (soft, hard)
        assert "open files limit raised from" in daemon.log_text()
    finally:
        for sock in clients:
            sock.close()
        daemon.stop()
