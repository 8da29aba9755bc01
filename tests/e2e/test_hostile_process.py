"""Hostile input at the process level (docs/reliability.md): what sits at the `--socket` path,
the socket's folder, the log file's mode, `--api-key-file`, and CLI numbers past every range.

A non-socket file at `--socket` is refused with one line and left as it was (it used to be
deleted); an existing folder keeps its mode (it used to be chmodded 0700, /tmp included); a
stale socket is still replaced; the log is 0600; the key from `--api-key-file` guards the API
without showing in the daemon's argv or environment; nan, 1e999 and 400-digit numbers give
one line and exit 1. Most cases run `mlxcel-daemon`'s `main()` in this process; one real
detached daemon (module-scoped) covers the end-to-end part.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import RunningDaemon, control, http_json, start_daemon
from mlxcel.daemon.cli import argv_to_flags, main, resolve
from mlxcel.daemon.process.lifecycle import (
    LifecycleError,
    PrivateRotatingFileHandler,
    clean_stale,
    prepare_socket,
    private_umask,
)
from mlxcel.daemon.process.option_sources import resolve_config
from mlxcel.shared.config import ConfigError
from mlxcel.shared.paths import get_paths

KEY = "sk-process-test-7f3a9c"
HUGE = "1" * 400


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1, (code, err)
    assert len(lines) == 1 and lines[0].startswith("mlxcel-daemon: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def start_args(tmp: Path, *extra: str) -> tuple[str, ...]:
    """`start` that can never serve (no such model, a free port) if a guard failed to refuse."""
    return ("start", "--model", str(tmp / "no-such-model"), "--port", "0", "--wait", "5", *extra)


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on (a killed daemon's leftover)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def private_key_file(folder: Path, text: str, mode: int = 0o600) -> Path:
    path = folder / "api.key"
    path.write_bytes(text.encode())
    path.chmod(mode)
    return path


# --- what sits at --socket -------------------------------------------------------------------


def _make(kind: str, path: Path) -> Any:
    """Put a `kind` at `path`; returns what must still be there afterwards."""
    if kind == "regular file":
        path.write_bytes(b"precious data\n\x00\xff")
        return path.read_bytes()
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_text("kept")
        return sorted(os.listdir(path))
    if kind == "symlink":
        target = path.parent / "target"
        target.write_text("the target")
        path.symlink_to(target)
        return os.readlink(path)
    os.mkfifo(path)
    return None


def _still(kind: str, path: Path, before: Any) -> bool:
    info = os.lstat(path)
    if kind == "regular file":
        return stat.S_ISREG(info.st_mode) and path.read_bytes() == before
    if kind == "directory":
        return stat.S_ISDIR(info.st_mode) and sorted(os.listdir(path)) == before
    if kind == "symlink":
        return stat.S_ISLNK(info.st_mode) and os.readlink(path) == before
    return stat.S_ISFIFO(info.st_mode)


@pytest.mark.parametrize("kind", ["regular file", "directory", "symlink", "fifo"])
def test_a_non_socket_at_the_socket_path_is_refused_and_left_intact(
    kind: str, mlxcel_home: Path, short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = short_tmp / "d.sock"
    before = _make(kind, path)
    what = "a named pipe" if kind == "fifo" else f"a {kind}"
    code, _, err = run_cli(capsys, *start_args(short_tmp, "--socket", str(path)))
    assert_one_line(
        code,
        err,
        f"--socket {path}: {what} is there, not a socket; remove it or choose another path",
    )
    assert _still(kind, path, before)
    assert clean_stale(get_paths(), path) == [] and _still(kind, path, before)
    with pytest.raises(LifecycleError, match="not a socket"):
        prepare_socket(path)  # the daemon's own check at bind time refuses it too
    assert _still(kind, path, before)
    assert stat.S_IMODE(short_tmp.stat().st_mode) == 0o700  # mkdtemp's mode, untouched


def test_a_folder_others_may_write_without_the_sticky_bit_is_refused(
    mlxcel_home: Path, short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = short_tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code, _, err = run_cli(capsys, *start_args(short_tmp, "--socket", str(shared / "d.sock")))
    assert_one_line(code, err, f"its folder {shared} is writable by other users (mode 0777)")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("mode", [0o755, 0o1777])
def test_an_existing_folder_keeps_its_mode_and_a_stale_socket_is_replaced(
    mode: int, short_tmp: Path
) -> None:
    folder = short_tmp / "sockets"
    folder.mkdir()
    folder.chmod(mode)
    path = folder / "d.sock"
    stale_socket(path)
    prepare_socket(path)  # what the control server runs before it binds
    assert not os.path.lexists(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        with private_umask():
            server.bind(str(path))
        server.listen()
        assert stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0  # born private (0700)
        with pytest.raises(LifecycleError, match="in use by another process"):
            prepare_socket(path)  # a live socket is never taken over
    assert stat.S_IMODE(folder.stat().st_mode) == mode


def test_a_missing_folder_is_created_private(short_tmp: Path) -> None:
    path = short_tmp / "new" / "d.sock"
    prepare_socket(path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


# --- the log file ----------------------------------------------------------------------------


def test_the_log_and_its_backups_are_0600(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "daemon.log"
    log_file.parent.mkdir()
    log_file.write_text("old line\n")
    backup = Path(f"{log_file}.1")
    backup.write_text("older\n")
    for path in (log_file, backup):
        path.chmod(0o644)  # left by an older version
    handler = PrivateRotatingFileHandler(log_file, maxBytes=200, backupCount=2, encoding="utf-8")
    try:
        assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(backup.stat().st_mode) == 0o600
        for i in range(10):  # past maxBytes: rollovers create fresh files
            handler.emit(logging.makeLogRecord({"msg": f"line {i} " + "x" * 60}))
    finally:
        handler.close()
    assert Path(f"{log_file}.2").exists()
    for path in (log_file, backup, Path(f"{log_file}.2")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert "line 9" in log_file.read_text()


# --- --api-key-file --------------------------------------------------------------------------


def test_the_key_file_sets_the_key_and_api_key_wins(tmp_path: Path) -> None:
    key_file = private_key_file(tmp_path, f"  {KEY}  \nsecond line ignored\n")
    toml = tmp_path / "config.toml"
    cfg, sources = resolve_config({"api_key_file": str(key_file)}, toml, environ={})
    assert cfg.api_key == KEY and sources["api_key"] == "flag"
    cfg, _ = resolve_config({"api_key_file": str(key_file), "api_key": "given"}, toml, {})
    assert cfg.api_key == "given"  # --api-key beats --api-key-file
    toml.write_text('api_key = "from-toml"\n')
    cfg, _ = resolve_config({"api_key_file": str(key_file)}, toml, environ={})
    assert cfg.api_key == KEY  # the flag's file beats config.toml's key
    toml.write_text(f'api_key = "from-toml"\napi_key_file = "{key_file}"\n')
    cfg, _ = resolve_config({}, toml, environ={})
    assert cfg.api_key == "from-toml"  # one layer: the key itself wins
    # A non-loopback host is allowed with a key from a file.
    cfg, _ = resolve_config({"api_key_file": str(key_file), "host": "0.0.0.0"}, toml, {})
    assert cfg.api_key == KEY


@pytest.mark.parametrize(
    ("content", "mode", "fragment"),
    [
        (None, 0o600, "cannot read: No such file or directory"),
        ("", 0o600, "the first line is empty"),
        ("   \nkey-on-line-two\n", 0o600, "the first line is empty"),
        ("ab\x1b[2Jcd\n", 0o600, "the key holds control characters"),
        ("ab\x00cd\n", 0o600, "the key holds control characters"),
        ("  clé ünicode  \n", 0o600, None),  # any printable text, stripped
        (f"{KEY}\n", 0o644, "other users may read it (mode 0644); chmod 600"),
        (f"{KEY}\n", 0o640, "other users may read it (mode 0640)"),
    ],
)
def test_a_bad_key_file_is_one_line_at_start(
    content: str | None,
    mode: int,
    fragment: str | None,
    mlxcel_home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key_file = tmp_path / "api.key"
    if content is not None:
        private_key_file(tmp_path, content, mode)
    if fragment is None:
        cfg, _ = resolve_config({"api_key_file": str(key_file)}, tmp_path / "c.toml", {})
        assert cfg.api_key == content.strip()
        return
    code, _, err = run_cli(capsys, *start_args(tmp_path, "--api-key-file", str(key_file)))
    assert_one_line(code, err, f"api_key_file {key_file}: {fragment}")


def test_a_key_file_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")  # opening it must not hang the start
    for path, why in ((tmp_path, "cannot read|not a regular file"), (tmp_path / "pipe", "not a")):
        with pytest.raises(ConfigError, match=why):
            resolve_config({"api_key_file": str(path)}, tmp_path / "c.toml", environ={})


# --- numbers past every range: one line, exit 1 ---------------------------------------------


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (("--prompt-cache-bytes", HUGE), "prompt_cache_bytes"),
        (("--keep-alive", "1e999"), "keep_alive"),
        (("--port", "9" * 400), "port must be <= 65535"),
        (("--parallel", "1e999"), "parallel must be an integer"),
        (("--wait", "nan"), "--wait must be between 0 and 86400 seconds, got nan"),
        (("--wait", "1e999"), "--wait must be between 0 and 86400 seconds, got inf"),
    ],
)
def test_start_refuses_absurd_numbers_with_one_line(
    argv: tuple[str, ...],
    fragment: str,
    mlxcel_home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, *start_args(tmp_path), *argv)
    assert_one_line(code, err, fragment)


@pytest.mark.parametrize(
    "argv",
    [
        ("stop", "--timeout", "1e999"),
        ("stop", "--timeout", "nan"),
        ("restart", "--timeout", "nan"),
        ("restart", "--wait", "-1"),
    ],
)
def test_stop_and_restart_refuse_absurd_timeouts(
    argv: tuple[str, ...], mlxcel_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert_one_line(code, err, "must be between 0 and 86400 seconds")


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        (f"prompt_cache_bytes = {HUGE}", "config.toml line 2: prompt_cache_bytes"),
        ("keep_alive = 1e999", "config.toml line 2: keep_alive"),
        (f"port = {HUGE}", "config.toml line 2: port"),
        ("stream_timeout = nan", "config.toml line 2: stream_timeout"),
    ],
)
def test_config_toml_with_absurd_numbers_is_one_line(
    line: str,
    fragment: str,
    mlxcel_home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = get_paths().config_file
    config.parent.mkdir(parents=True)
    config.write_text(f"# a comment\n{line}\n")
    code, _, err = run_cli(capsys, *start_args(tmp_path))
    assert_one_line(code, err, fragment)


def test_logs_with_a_400_digit_count_prints_everything(
    mlxcel_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_file = get_paths().log_file
    log_file.parent.mkdir(parents=True)
    log_file.write_text("".join(f"line {i}\n" for i in range(5)))
    code, out, err = run_cli(capsys, "logs", "-n", "1" + "0" * 400)
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"line {i}" for i in range(5)]


# --- one real daemon: --socket in a 0755 folder over a stale socket, --api-key-file ---------


@pytest.fixture(scope="module")
def daemon(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningDaemon, Path]]:
    import shutil
    import tempfile

    from mlxcel.shared.paths import short_socket_dir

    home = tmp_path_factory.mktemp("hostile-process")
    secrets = tmp_path_factory.mktemp("secrets")
    key_file = private_key_file(secrets, KEY + "\n")
    folder = Path(tempfile.mkdtemp(prefix="mlxcel-p-", dir=short_socket_dir().parent))
    try:
        folder.chmod(0o755)
        stale_socket(folder / "d.sock")
        log_file = home / "logs" / "daemon.log"
        log_file.parent.mkdir(parents=True)
        log_file.write_text("a line from before\n")
        log_file.chmod(0o644)
        flags = ("--socket", str(folder / "d.sock"), "--api-key-file", str(key_file))
        d = start_daemon(home, tiny_model_dir, *flags)
        try:
            yield d, key_file
        finally:
            d.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_stale_socket_was_replaced_and_the_folder_kept_its_mode(
    daemon: tuple[RunningDaemon, Path],
) -> None:
    d, _ = daemon
    assert d.socket.name == "d.sock"
    assert control(d.socket, "hello")["result"]["pid"] == d.pid
    assert stat.S_ISSOCK(os.lstat(d.socket).st_mode)
    assert stat.S_IMODE(os.lstat(d.socket).st_mode) == 0o600
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o755


def test_the_log_file_is_0600(daemon: tuple[RunningDaemon, Path]) -> None:
    d, _ = daemon
    assert stat.S_IMODE(d.log_file.stat().st_mode) == 0o600
    assert "a line from before" in d.log_text()


def test_the_key_file_guards_the_api(daemon: tuple[RunningDaemon, Path]) -> None:
    d, _ = daemon
    status, _, _ = http_json(d.http_url + "/v1/models")
    assert status == 401
    status, _, _ = http_json(d.http_url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401
    status, _, body = http_json(
        d.http_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 200 and body["data"], body


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
def test_the_key_is_not_in_the_daemons_argv_environment_or_state(
    daemon: tuple[RunningDaemon, Path],
) -> None:
    d, key_file = daemon
    cmdline = Path(f"/proc/{d.pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{d.pid}/environ").read_bytes()
    assert KEY.encode() not in b"\0".join(cmdline) and KEY.encode() not in environ
    assert b"MLXCEL_API_KEY=" not in environ
    assert b"--api-key-file" in cmdline and str(key_file).encode() in cmdline
    state_text = (d.home / "run" / "daemon.json").read_text()
    assert KEY not in state_text


def test_restart_reads_the_key_file_again(
    daemon: tuple[RunningDaemon, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `restart` does before it stops anything: the previous argv, resolved again."""
    import json

    d, _ = daemon
    monkeypatch.setenv("MLXCEL_HOME", str(d.home))
    argv = json.loads((d.home / "run" / "daemon.json").read_text())["argv"]
    cfg, socket_path = resolve(argv_to_flags([str(a) for a in argv]), get_paths())
    assert cfg.api_key == KEY and socket_path == d.socket


def test_cli_control_commands_work_and_refuse_absurd_values(
    daemon: tuple[RunningDaemon, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d, _ = daemon
    monkeypatch.setenv("MLXCEL_HOME", str(d.home))
    code, out, _ = run_cli(capsys, "status")
    assert code == 0 and f"running (pid {d.pid})" in out
    code, out, err = run_cli(capsys, "set", f"parallel={HUGE}")
    assert code == 1 and "Traceback" not in out + err
    assert len(out.strip().splitlines()) == 1 and out.startswith("parallel: refused:"), out
    assert control(d.socket, "hello")["result"]["pid"] == d.pid  # still serving


def test_stop_leaves_the_folder_as_it_was(
    daemon: tuple[RunningDaemon, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d, _ = daemon
    monkeypatch.setenv("MLXCEL_HOME", str(d.home))
    code, out, _ = run_cli(capsys, "stop", "--timeout", "30")
    assert code == 0 and "stopped" in out, out
    assert not d.alive()
    assert not os.path.lexists(d.socket)
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o755
    with contextlib.suppress(OSError):
        assert stat.S_IMODE(d.log_file.stat().st_mode) == 0o600
