"""Run a whole daemon (HTTP, engine, control socket) on a thread of this process.

For tests that want the real daemon without a subprocess: the same `Daemon` as
`mlxcel-daemon start --foreground`, minus signals and the pid lock. A test harness, so it lives
here and not in the shipped package (`daemon_helpers.embedded_daemon()` builds one).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

from mlxcel.daemon.process.daemon import Daemon
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.paths import Paths


class EmbeddedDaemon:
    """`with EmbeddedDaemon(cfg, paths, socket) as d:` serves at `d.http_url` until exit."""

    def __init__(self, cfg: ServingConfig, paths: Paths, socket_path: Path) -> None:
        if cfg.prompt_cache_disk_bytes is None:  # tests opt in to the disk tier (conftest.py)
            cfg = cfg.replace(prompt_cache_disk_bytes=0)
        self.daemon = Daemon(cfg, paths, socket_path, argv=[])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def http_url(self) -> str:
        return self.daemon.http_url

    @property
    def socket_path(self) -> Path:
        return self.daemon.socket_path

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def start(self, timeout: float = 120.0) -> EmbeddedDaemon:
        self._thread = threading.Thread(target=self._main, name="mlxcel-embedded", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the embedded daemon was not ready within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"the embedded daemon failed: {self._error}") from self._error
        return self

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()
            self._loop.close()

    async def _run(self) -> None:
        runner = asyncio.ensure_future(self.daemon.run(install_signals=False))
        ready = asyncio.ensure_future(self.daemon.ready_event.wait())
        await asyncio.wait({runner, ready}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if runner.done():  # it stopped before it was ready: _main records why
            runner.result()
            raise RuntimeError("the daemon stopped before it was ready")
        self._ready.set()
        await runner

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the daemon's loop thread and return its result."""
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(fn, *args), self.loop)
        return future.result(30)

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self.daemon.request_stop, drain, timeout)
        self._thread.join(timeout + 30)
        self._thread = None

    def __enter__(self) -> EmbeddedDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _as_coroutine(fn: Any, *args: Any) -> Any:
    result = fn(*args)
    if asyncio.iscoroutine(result):
        result = await result
    return result


def paths_under(root: Path) -> Paths:
    """The file layout `MLXCEL_HOME=root` gives, without touching the environment."""
    return Paths(root / "config", root / "data", root / "logs", root / "run")
