"""The daemon's runtime files and process lifecycle: pid lock, state file, stale cleanup,
detached start, waiting for health, stop.

The pid file is held with an exclusive `flock` for the daemon's whole life, so "is a daemon
running?" is answered by the kernel: a daemon killed with SIGKILL releases the lock, and the
next start finds the leftovers stale and removes them. No mlx import here (the CLI is light).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from mlxcel.shared.paths import MAX_SOCKET_PATH, Paths, atomic_write

FATAL_MARK = "FATAL "  # the serving process logs its one-line startup failure after this


class LifecycleError(RuntimeError):
    """A lifecycle step failed; the message is one line meant for the operator."""


class AlreadyRunning(LifecycleError):
    def __init__(self, pid: int | None) -> None:
        super().__init__(f"mlxcel-daemon is already running (pid {pid})")
        self.pid = pid


def ensure_private_dir(path: Path) -> None:
    """Create a directory only the owner can enter (the socket's directory); refuse one that
    is a symlink or belongs to someone else (a shared /tmp folder created by another user)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or info.st_uid != os.getuid():
        raise LifecycleError(f"{path} is not a directory owned by this user: remove it")
    os.chmod(path, 0o700)


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise LifecycleError(
            f"socket path is {len(str(path))} bytes, over the {MAX_SOCKET_PATH}-byte limit "
            f"of Unix sockets: {path} (choose a shorter --socket)"
        )


def raise_open_files_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard one; returns (before, after).

    macOS starts processes (Terminal, launchd) with a soft limit of 256 descriptors: a few
    hundred clients plus the model files would hit EMFILE. macOS also caps the soft limit at
    OPEN_MAX (10240) whatever the hard limit says. Call it after importing mlx_lm: importing
    mlx_lm.utils sets the limits to (2048, 4096).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if sys.platform == "darwin":
        target = min(hard, 10240) if hard != resource.RLIM_INFINITY else 10240
    if soft != resource.RLIM_INFINITY and (target == resource.RLIM_INFINITY or target > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


class PidLock:
    """The daemon's pid file, locked for as long as the daemon lives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        ensure_private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise AlreadyRunning(read_pid(self.path)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def pid_file_locked(path: Path) -> bool:
    """True while some process holds the pid file's lock (a daemon is alive)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def running_pid(paths: Paths) -> int | None:
    """The pid of the live daemon, or None (leftovers of a dead one do not count)."""
    if not pid_file_locked(paths.pid_file):
        return None
    return read_pid(paths.pid_file)


def pid_alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie waiting to be reaped does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def read_state(paths: Paths) -> dict[str, Any] | None:
    try:
        data = json.loads(paths.state_file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_state(paths: Paths, state: dict[str, Any]) -> None:
    ensure_private_dir(paths.runtime_dir)
    atomic_write(paths.state_file, json.dumps(state, indent=2) + "\n", mode=0o600)


def clean_stale(paths: Paths, socket_path: Path | None = None) -> list[Path]:
    """Remove the pid, state and socket files of a daemon that is gone; returns them."""
    if running_pid(paths) is not None:
        return []
    candidates = [paths.pid_file, paths.state_file]
    state = read_state(paths)
    for sock in (socket_path, paths.socket_path, (state or {}).get("socket")):
        if sock and Path(sock) not in candidates and socket_is_stale(Path(sock)):
            candidates.append(Path(sock))
    removed = []
    for path in candidates:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def socket_is_stale(path: Path) -> bool:
    """A socket file nobody listens on (connect refused)."""
    if not path.exists() and not path.is_symlink():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError as exc:
            return exc.errno in (errno.ECONNREFUSED, errno.ENOTSOCK)
    return False


def prepare_socket(path: Path) -> None:
    """Make the socket's directory private and clear a stale socket file before binding."""
    check_socket_path(path)
    ensure_private_dir(path.parent)
    if path.exists() or path.is_symlink():
        if not socket_is_stale(path):
            raise LifecycleError(f"socket {path} is in use by another process")
        path.unlink()


# --- detached start ---------------------------------------------------------------------


DETACHED_ENV = "MLXCEL_DETACHED"  # set for the detached child: it logs to the file only


def spawn_detached(argv: list[str], log_file: Path) -> subprocess.Popen[bytes]:
    """Run `start --foreground` in a new session; its stdout/stderr go to the log file."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, DETACHED_ENV: "1", "PYTHONUNBUFFERED": "1"}
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "mlxcel.daemon.cli", "start", "--foreground", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )


def connect_url(http_url: str) -> str:
    """A URL a local client can reach (wildcard listeners answer on loopback)."""
    return http_url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")


def health_status(http_url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(connect_url(http_url) + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def log_offset(log_file: Path) -> int:
    try:
        return log_file.stat().st_size
    except OSError:
        return 0


def failure_reason(log_file: Path, offset: int, returncode: int | None) -> str:
    """The serving process's one-line reason, read from what it logged since `offset`."""
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    fatal = [ln.split(FATAL_MARK, 1)[1] for ln in text.splitlines() if FATAL_MARK in ln]
    if fatal:
        return fatal[-1].strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    tail = f": {lines[-1].strip()}" if lines else ""
    return f"the daemon exited with status {returncode}{tail} (see {log_file})"


def wait_until_healthy(
    proc: subprocess.Popen[bytes], paths: Paths, log_file: Path, offset: int, timeout: float
) -> dict[str, Any]:
    """Wait for /health 200 from the child; raises LifecycleError with the reason."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LifecycleError(failure_reason(log_file, offset, proc.returncode))
        state = read_state(paths)
        if state and state.get("pid") == proc.pid and state.get("http_url"):
            status = health_status(state["http_url"])
            if status == 200:
                return state
        time.sleep(0.1)
    raise LifecycleError(
        f"the daemon (pid {proc.pid}) did not become healthy within {timeout:.0f} s; "
        f"it is still starting, see {log_file}"
    )


# --- stop -------------------------------------------------------------------------------


def wait_for_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def _is_zombie(pid: int) -> bool:
    try:
        import psutil

        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except Exception:
        return False


def terminate(pid: int, timeout: float) -> bool:
    """SIGTERM (the daemon drains), then wait; True once the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    return wait_for_exit(pid, timeout)


def kill(pid: int, timeout: float = 5.0) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return wait_for_exit(pid, timeout)
