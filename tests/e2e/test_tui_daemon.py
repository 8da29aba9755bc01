"""The console against the real daemon (a subprocess on a tiny random-weight model).

The slots table fills while requests run; `+`/`-`, `x` (confirmed) and `c` change the daemon
(checked through a separate ControlClient); killing the daemon shows "disconnected" and a new
daemon on the same socket is picked up by itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from console_daemon import Daemon, daemon_config, live, log_text, start_daemon
from daemon_helpers import async_wait_until
from mlxcel.shared.snapshot import Snapshot
from mlxcel.tui.app import make_app
from mlxcel.tui.state import Link


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


async def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def test_slots_table_fills_while_requests_run(daemon: Daemon) -> None:
    app = make_app(daemon.socket, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await async_wait_until(lambda: live(app))
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

        await async_wait_until(lambda: len(busy_rows()) == 2)
        assert all(s == "decode" or s.startswith("prefill") for s in busy_rows())
        await pilot.pause()
        results = await asyncio.gather(*jobs)
        assert all(r["usage"]["completion_tokens"] == 400 for r in results)
        await async_wait_until(lambda: not busy_rows())
        assert "slots · 0/2 busy" in str(table.border_title)


async def test_keys_change_the_daemon(daemon: Daemon) -> None:
    sock = daemon.socket
    app = make_app(sock, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await async_wait_until(lambda: live(app))
        assert (await daemon_config(sock))["parallel"] == 2

        await pilot.press("plus")
        await async_wait_until(lambda: _config_is(sock, "parallel", 3), poll=0.1)
        await async_wait_until(lambda: "parallel 2 → 3" in log_text(app))
        await pilot.press("minus")
        await async_wait_until(lambda: _config_is(sock, "parallel", 2), poll=0.1)
        await async_wait_until(lambda: "parallel 3 → 2" in log_text(app))

        await pilot.press("x")
        await pilot.pause()
        assert (await daemon_config(sock))["prompt_cache"] is True  # not before confirming
        await pilot.press("y")
        await async_wait_until(lambda: _config_is(sock, "prompt_cache", False), poll=0.1)
        await async_wait_until(lambda: "prompt_cache on → off" in log_text(app))
        await pilot.press("x")  # back on: no confirmation needed
        await async_wait_until(lambda: _config_is(sock, "prompt_cache", True), poll=0.1)

        await pilot.press("c", *"1000", "enter")
        await async_wait_until(lambda: _config_is(sock, "max_batch_prefill_tokens", 1000), poll=0.1)
        await async_wait_until(lambda: app.latest.engine.config.max_batch_prefill_tokens == 1000)
        assert "prefill cap 1000 tok" in str(app.query_one("#controls").render())


async def test_refused_change_shows_the_reason(daemon: Daemon) -> None:
    app = make_app(daemon.socket, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await async_wait_until(lambda: live(app))
        await pilot.press("minus", "minus")  # 2 -> 1 -> 0: the daemon refuses 0
        await async_wait_until(lambda: "refused" in log_text(app))
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
            await async_wait_until(lambda: live(app))
            first.stop(signal.SIGKILL)  # a crash: stale socket left behind
            await async_wait_until(lambda: app.link_state.link is Link.DISCONNECTED)
            await pilot.pause()
            assert "disconnected" in str(app.query_one("#header").render())
            second = await asyncio.to_thread(start_daemon, tiny_model_dir, mlxcel_home, sock)
            await async_wait_until(
                lambda: app.link_state.hello_dict.get("pid") == second.hello["pid"]
            )
            assert app.link_state.link is Link.CONNECTED
            await async_wait_until(lambda: app.latest.daemon.pid == second.hello["pid"])
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
