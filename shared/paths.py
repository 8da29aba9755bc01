"""Where mlxcel keeps its files (platformdirs), overridable with MLXCEL_HOME for tests.

MLXCEL_HOME=/some/dir puts config, data, logs and runtime files below that one folder. When
the socket path there would pass the Unix-socket limit (macOS's temp dirs under
/private/var/folders/... do), the socket alone moves to a short private folder in /tmp, named
after a hash of the runtime dir so two homes never share one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from mlxcel.shared.switches import switch_value

APP = "mlxcel"
SOCKET_NAME = "mlxcel.sock"
# sockaddr_un.sun_path is 104 bytes on macOS, 108 on Linux (including the NUL).
MAX_SOCKET_PATH = 103


@dataclass(frozen=True)
class Paths:
    config_dir: Path
    data_dir: Path
    log_dir: Path
    runtime_dir: Path

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    cache_dir: Path | None = None  # files that may go at any time; None: data_dir/cache

    @property
    def prompt_cache_dir(self) -> Path:
        """The prompt cache's disk tier (docs/tuning.md)."""
        return (self.cache_dir or self.data_dir / "cache") / "prompt-cache"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def log_file(self) -> Path:
        return self.log_dir / "daemon.log"

    @property
    def pid_file(self) -> Path:
        return self.runtime_dir / "daemon.pid"

    @property
    def state_file(self) -> Path:
        """JSON the running daemon writes: pid, http address, socket path, log file."""
        return self.runtime_dir / "daemon.json"

    @property
    def socket_path(self) -> Path:
        path = self.runtime_dir / SOCKET_NAME
        if len(os.fsencode(str(path))) <= MAX_SOCKET_PATH:
            return path
        digest = hashlib.sha256(os.fsencode(str(self.runtime_dir))).hexdigest()[:16]
        return short_socket_dir() / f"{digest}.sock"


def short_socket_dir() -> Path:
    """A per-user folder with a short path for sockets (/tmp, not macOS's long $TMPDIR)."""
    base = Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())
    return base / f"{APP}-{os.getuid()}"


def get_paths() -> Paths:
    home = switch_value("MLXCEL_HOME")
    if home:
        root = Path(home).expanduser().resolve()
        return Paths(root / "config", root / "data", root / "logs", root / "run", root / "cache")
    with warnings.catch_warnings():
        # Without XDG_RUNTIME_DIR platformdirs falls back to /tmp/runtime-UID and warns.
        warnings.simplefilter("ignore")
        runtime = Path(platformdirs.user_runtime_dir(APP))
    if len(os.fsencode(str(runtime / SOCKET_NAME))) > MAX_SOCKET_PATH:
        runtime = short_socket_dir()
    return Paths(
        config_dir=Path(platformdirs.user_config_dir(APP)),
        data_dir=Path(platformdirs.user_data_dir(APP)),
        log_dir=Path(platformdirs.user_log_dir(APP)),
        runtime_dir=runtime,
        cache_dir=Path(platformdirs.user_cache_dir(APP)),
    )


def default_socket_path() -> Path:
    env = os.environ.get("MLXCEL_SOCKET")
    return Path(env) if env else get_paths().socket_path


def atomic_write(path: Path, text: str, mode: int | None = None) -> None:
    """Write `text` to `path` all at once: a temp file in the same folder, then `os.replace`, so
    a reader sees the old file or the new one, never half of one (the state file, config.toml).
    `mode` sets the file's permissions; None keeps an existing file's (0600 for a new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        elif path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
