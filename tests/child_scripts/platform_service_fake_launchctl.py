"""A fake `launchctl` that behaves like launchd's: the agent is loaded while something holds a
lock on the daemon's pid file; `bootout` signals it (SIGTERM) and returns at once; `bootstrap`
fails with EIO (exit 5) while it is still loaded. Prints nothing on success; appends each call
to LOG as one JSON line, `[[launchctl args...], loaded]`.

Usage: platform_service_fake_launchctl.py LOG PID_FILE LAUNCHCTL_ARGS...
(tests/e2e/test_platform_service.py puts a `launchctl` on PATH that execs this.)
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from pathlib import Path


def agent_loaded(pid_file: str) -> bool:
    """Whether another process holds the pid file's lock (a running agent)."""
    try:
        with open(pid_file) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
    except FileNotFoundError:
        pass
    return False


def main(log: str, pid_file: str, args: list[str]) -> int:
    loaded = agent_loaded(pid_file)
    with open(log, "a") as f:
        f.write(json.dumps([args, loaded]) + "\n")
    if args[0] == "bootout" and loaded:
        pid = int(Path(pid_file).read_text().split()[0])
        os.kill(pid, signal.SIGTERM)  # and returns at once
    if args[0] == "bootstrap" and loaded:
        print("Bootstrap failed: 5: Input/output error", file=sys.stderr)
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
