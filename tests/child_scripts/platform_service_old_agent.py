"""The agent launchd runs, as an old install left it: holds the daemon's pid lock (under
MLXCEL_HOME) and prints `ready`, then idles; on SIGTERM it takes DRAIN_S seconds to exit (0).

Usage: platform_service_old_agent.py DRAIN_S
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

from mlxcel.daemon.process.lifecycle import PidLock
from mlxcel.shared.paths import get_paths


def main(drain_s: float) -> None:
    lock = PidLock(get_paths().pid_file)
    lock.acquire()

    def drain(_signum: int, _frame: FrameType | None) -> None:
        time.sleep(drain_s)
        sys.exit(0)

    signal.signal(signal.SIGTERM, drain)
    print("ready", flush=True)
    while True:  # idles until the signal
        time.sleep(0.1)


if __name__ == "__main__":
    main(float(sys.argv[1]))
