"""The console against the real daemon (a subprocess on a tiny random-weight model).

The slots table fills while requests run; `+`/`-`, `x` (confirmed) and `c` change the daemon
(checked through a separate ControlClient); killing the daemon shows "disconnected" and a new
daemon on the same socket is picked up by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from mlxcel.shared.control_client import ControlClient, NotConnected
from mlxcel.shared.snapshot import Snapshot
from mlxcel.tui.app import MlxcelTop, make_app
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
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(NotConnected, OSError, asyncio.TimeoutError):
            return asyncio.run(_hello(sock))
        time.sleep(0.2)
    raise AssertionError(f"daemon not ready in time:\n{log.read_text()[-2000:]}")


async def _hello(sock: str) -> dict[str, Any]:
    async with ControlClient(sock) as client:
        return dict(client.hello)


async def daemon_config(sock: str) -> dict[str, Any]:
    async with ControlClient(sock) as client:
        return Snapshot.from_dict(await client.call("status")).engine.config.to_dict()


@pytest.fixture
def runtime_dir() -> Iterator[str]:
    # Short on purpose: sockets have a ~104-byte path limit.
    path = tempfile.mkdtemp(prefix="mtd-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(tiny_model_dir: Path, mlxcel_home: Path, runtime_dir: str) -> Iterator[Daemon]:
    d = start_daemon(tiny_model_dir, mlxcel_home, os.path.join(runtime_dir, "d.sock"))
    yield d
    d.stop()


async def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def wait_until(check: Callable[[], Any], timeout: float = 30.0) -> None:
    """Like wait_for, for an async check (a ControlClient query)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


def live(app: MlxcelTop) -> bool:
    return app.link_state.link is Link.CONNECTED and app.latest is not None


def log_text(app: MlxcelTop) -> str:
    return "\n".join(line.text for line in app.query_one("#log").lines)


async def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def test_slots_table_fills_while_requests_run(daemon: Daemon) -> None:
    app = make_app(daemon.socket, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(lambda: live(app))
        table = app.query_one("#slots")
        assert len(table.rows) == 2  # --parallel 2: idle slots are rows too
        jobs = [
            asyncio.create_task(complete(daemon.url, f"request number {i} " * 20, 400))
            for i in range(3)
        ]

        def busy_rows() -> list[str]:
            return [
                str(table.get_cell(key, "state"))
                for key in table.rows
                if str(table.get_cell(key, "state")) != "idle"
            ]

        await wait_for(lambda: len(busy_rows()) == 2)
        assert all(s == "decode" or s.startswith("prefill") for s in busy_rows())
        await pilot.pause()
        results = await asyncio.gather(*jobs)
        assert all(r["usage"]["completion_tokens"] == 400 for r in results)
        await wait_for(lambda: not busy_rows())
        assert "slots · 0/2 busy" in str(table.border_title)


async def test_keys_change_the_daemon(daemon: Daemon) -> None:
    sock = daemon.socket
    app = make_app(sock, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(lambda: live(app))
        assert (await daemon_config(sock))["parallel"] == 2

        await pilot.press("plus")
        await wait_until(lambda: _config_is(sock, "parallel", 3))
        await wait_for(lambda: "parallel 2 → 3" in log_text(app))
        await pilot.press("minus")
        await wait_until(lambda: _config_is(sock, "parallel", 2))
        await wait_for(lambda: "parallel 3 → 2" in log_text(app))

        await pilot.press("x")
        await pilot.pause()
        assert (await daemon_config(sock))["prompt_cache"] is True  # not before confirming
        await pilot.press("y")
        await wait_until(lambda: _config_is(sock, "prompt_cache", False))
        await wait_for(lambda: "prompt_cache on → off" in log_text(app))
        await pilot.press("x")  # back on: no confirmation needed
        await wait_until(lambda: _config_is(sock, "prompt_cache", True))

        await pilot.press("c", *"1000", "enter")
        await wait_until(lambda: _config_is(sock, "max_batch_prefill_tokens", 1000))
        await wait_for(lambda: app.latest.engine.config.max_batch_prefill_tokens == 1000)
        assert "prefill cap 1000 tok" in str(app.query_one("#controls").render())


async def test_refused_change_shows_the_reason(daemon: Daemon) -> None:
    app = make_app(daemon.socket, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(lambda: live(app))
        await pilot.press("minus", "minus")  # 2 -> 1 -> 0: the daemon refuses 0
        await wait_for(lambda: "refused" in log_text(app))
        assert (await daemon_config(daemon.socket))["parallel"] == 1
        assert "parallel=0 refused" in log_text(app)


async def _config_is(sock: str, key: str, value: Any) -> bool:
    return (await daemon_config(sock))[key] == value


async def test_reconnects_after_daemon_restart(
    tiny_model_dir: Path, mlxcel_home: Path, runtime_dir: str
) -> None:
    sock = os.path.join(runtime_dir, "d.sock")
    first = await asyncio.to_thread(start_daemon, tiny_model_dir, mlxcel_home, sock)
    second: Daemon | None = None
    try:
        app = make_app(sock, interval_ms=200)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(lambda: live(app))
            first.stop(signal.SIGKILL)  # a crash: stale socket left behind
            await wait_for(lambda: app.link_state.link is Link.DISCONNECTED)
            await pilot.pause()
            assert "disconnected" in str(app.query_one("#header").render())
            second = await asyncio.to_thread(start_daemon, tiny_model_dir, mlxcel_home, sock)
            await wait_for(lambda: app.link_state.hello_dict.get("pid") == second.hello["pid"])
            assert app.link_state.link is Link.CONNECTED
            await wait_for(lambda: app.latest.daemon.pid == second.hello["pid"])
            assert "daemon restarted" in log_text(app)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_once_against_the_daemon(daemon: Daemon) -> None:
    top = [sys.executable, "-m", "mlxcel.tui.cli", "--socket", daemon.socket, "--once"]
    text = subprocess.run(top, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert f"pid {daemon.hello['pid']}" in text.stdout and "slots (0/2 busy)" in text.stdout
    data = subprocess.run([*top, "--json"], capture_output=True, text=True, timeout=60)
    assert data.returncode == 0, data.stderr
    assert Snapshot.from_dict(json.loads(data.stdout)).daemon.pid == daemon.hello["pid"]
