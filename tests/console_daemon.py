"""A real daemon for the console tests: `start_daemon` runs `mlxcel-daemon start --foreground`
in a subprocess (tiny model, `--parallel 2`, its control socket at a path of the test's) and
returns once it answers `hello`; `Daemon.stop` ends it. `daemon_config` reads its effective
config over the socket; `live` and `log_text` read a console app. Used by
tests/e2e/test_tui_daemon.py, test_tui_cancel.py and tests/e2e/test_tui_remote.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon_helpers import wait_until
from mlxcel.shared.control_client import ControlClient, NotConnected
from mlxcel.shared.snapshot import Snapshot
from mlxcel.tui.app import MlxcelTop
from mlxcel.tui.state import Link

START_TIMEOUT_S = 120.0


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    socket: str
    hello: dict[str, Any]
    log: Path

    @property
    def url(self) -> str:
        return str(self.hello["http_url"]).rstrip("/")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_daemon(model_dir: Path, home: Path, sock: str) -> Daemon:
    env = dict(os.environ, MLXCEL_HOME=str(home))
    argv = [sys.executable, "-m", "mlxcel.daemon.cli", "start", "--foreground"]
    argv += ["--model", str(model_dir), "--port", "0", "--socket", sock, "--parallel", "2"]
    log = home / f"daemon-{time.monotonic_ns()}.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        return Daemon(proc, sock, _wait_ready(proc, sock, log), log)
    except BaseException:
        proc.kill()  # never leave a daemon behind a failed start
        proc.wait(10)
        raise


def _wait_ready(proc: subprocess.Popen[bytes], sock: str, log: Path) -> dict[str, Any]:
    def hello() -> dict[str, Any] | None:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited {proc.returncode}")
        with contextlib.suppress(NotConnected, OSError, asyncio.TimeoutError):
            return asyncio.run(_hello(sock))
        return None

    try:
        return wait_until(hello, timeout=START_TIMEOUT_S, poll=0.2, what="the daemon's hello")
    except AssertionError as err:
        raise AssertionError(f"{err}:\n{log.read_text()[-2000:]}") from None


async def _hello(sock: str) -> dict[str, Any]:
    async with ControlClient(sock) as client:
        return dict(client.hello)


async def daemon_config(sock: str) -> dict[str, Any]:
    async with ControlClient(sock) as client:
        return Snapshot.from_dict(await client.call("status")).engine.config.to_dict()


def live(app: MlxcelTop) -> bool:
    return app.link_state.link is Link.CONNECTED and app.latest is not None


def log_text(app: MlxcelTop) -> str:
    return "\n".join(line.text for line in app.query_one("#log").lines)
