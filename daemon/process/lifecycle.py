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
import io
import json
import logging.handlers
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlxcel.shared.paths import MAX_SOCKET_PATH, Paths, atomic_write, get_paths, short_socket_dir

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


def _kind_of(mode: int) -> str:
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    return next((name for test, name in kinds if test(mode)), "something else")


def is_own_socket_dir(parent: Path) -> bool:
    """The folders mlxcel names itself (the runtime dir, the short /tmp/mlxcel-UID one): they
    are made private (0700). Any other folder is the operator's and keeps its mode."""
    return parent in (get_paths().runtime_dir, short_socket_dir())


def check_socket_dir(parent: Path, label: str) -> None:
    """An operator's folder for the socket (`--socket`): a missing one is created 0700 at bind;
    an existing one is never chmodded, and refused where another user could replace the
    socket in it (owned by someone else, or group/world-writable without the sticky bit)."""
    try:
        info = os.stat(parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LifecycleError(f"{label}: cannot use its folder {parent}: {exc.strerror}") from None
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISDIR(info.st_mode):
        raise LifecycleError(f"{label}: {parent} is {_kind_of(info.st_mode)}, not a directory")
    if info.st_uid not in (os.getuid(), 0):
        raise LifecycleError(
            f"{label}: its folder {parent} belongs to uid {info.st_uid}, who could replace the "
            f"socket; choose a folder of your own"
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise LifecycleError(
            f"{label}: its folder {parent} is writable by other users (mode {mode:04o}) without "
            f"the sticky bit, so they could replace the socket; choose a private folder"
        )


def check_socket_path(path: Path, label: str | None = None) -> None:
    """Refuse, before anything starts, a socket path that cannot be bound safely: too long, a
    non-socket file there (a regular file, directory, symlink or pipe is never deleted), or
    a folder another user could write to (docs/reliability.md). A socket there is fine: a
    stale one is removed at bind, a live one refused."""
    label = label or f"socket {path}"
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise LifecycleError(
            f"socket path is {len(str(path))} bytes, over the {MAX_SOCKET_PATH}-byte limit "
            f"of Unix sockets: {path} (choose a shorter --socket)"
        )
    if not is_own_socket_dir(path.parent):
        check_socket_dir(path.parent, label)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LifecycleError(f"{label}: cannot check it: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise LifecycleError(
            f"{label}: {_kind_of(info.st_mode)} is there, not a socket; "
            f"remove it or choose another path"
        )


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """umask 077 around a bind: the socket is born 0600 (then chmodded 0600 all the same)."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


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
    """A socket file nobody listens on (connect refused). Anything that is not a socket
    (a regular file, a symlink, a directory) is never stale: it is not ours to remove."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
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
    """Before binding: mlxcel's own socket folder made private (0700); an operator's missing
    folder created 0700, an existing one left as it is (check_socket_path vetted it); a
    stale socket removed; a live one, or anything that is not a socket, refused."""
    check_socket_path(path)
    parent = path.parent
    if is_own_socket_dir(parent):
        ensure_private_dir(parent)
    elif not os.path.lexists(parent):
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_socket_dir(parent, f"socket {path}")  # lost a race to someone else's folder?
    if not os.path.lexists(path):
        return
    if not socket_is_stale(path):
        raise LifecycleError(f"socket {path} is in use by another process")
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise LifecycleError(
            f"socket {path}: cannot remove the stale socket: {exc.strerror}"
        ) from None


# --- private log files ------------------------------------------------------------------


PRIVATE_FILE_MODE = 0o600  # the log: requests, model paths and errors are the operator's


def _tighten(fd: int) -> None:
    """An existing file of ours with group/other bits gets 0600 (a file of someone else's, or
    a device such as /dev/null, is left alone)."""
    info = os.fstat(fd)
    wide = stat.S_IMODE(info.st_mode) & 0o077
    if wide and stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
        with contextlib.suppress(OSError):
            os.fchmod(fd, PRIVATE_FILE_MODE)


def open_private_log(path: Path) -> int:
    """The log file opened for appending, created 0600 (its folder 0700 when new); a file
    with wider bits is narrowed to 0600. Returns the descriptor."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        _tighten(fd)
    except OSError:
        os.close(fd)
        raise
    return fd


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """RotatingFileHandler whose files (the log and each new one after a rollover) are 0600;
    backups left with wider bits by an older version are narrowed too."""

    def __init__(self, filename: Path, maxBytes: int, backupCount: int, encoding: str) -> None:
        for n in range(1, backupCount + 1):
            backup = Path(f"{filename}.{n}")
            with contextlib.suppress(OSError):
                info = os.lstat(backup)
                ours = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
                if ours and stat.S_IMODE(info.st_mode) & 0o077:
                    os.chmod(backup, PRIVATE_FILE_MODE)
        super().__init__(filename, maxBytes=maxBytes, backupCount=backupCount, encoding=encoding)

    def _open(self) -> io.TextIOWrapper:
        fd = open_private_log(Path(self.baseFilename))
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


# --- detached start ---------------------------------------------------------------------


DETACHED_ENV = "MLXCEL_DETACHED"  # set for the detached child: it logs to the file only


def spawn_detached(argv: list[str], log_file: Path) -> subprocess.Popen[bytes]:
    """Run `start --foreground` in a new session; its stdout/stderr go to the log file."""
    env = {**os.environ, DETACHED_ENV: "1", "PYTHONUNBUFFERED": "1"}
    with open(open_private_log(log_file), "ab") as log:
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
