"""Drill down into one request and cancel it from the console, against the real daemon (a
subprocess on the tiny model): select the busy slot, enter shows its tokens moving, `k` + `y`
ends the streaming client cleanly (finish_reason "abort" with usage) and the slot is idle
within a second, the event log says who cancelled what, and the daemon log pane (l) shows the
daemon's own cancel line, filterable by level (f)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from console_daemon import Daemon, live, log_text, start_daemon
from daemon_helpers import async_wait_until
from mlxcel.tui.app import make_app
from mlxcel.tui.logpane import DaemonLogPane
from mlxcel.tui.screens import ConfirmScreen, DetailScreen
from mlxcel.tui.tables import SlotsTable

MAX_TOKENS = 1000  # on conftest's slow_model_dir: still streaming when the keys arrive


@pytest.fixture
def daemon(slow_model_dir: Path, mlxcel_home: Path) -> Iterator[Daemon]:
    folder = tempfile.mkdtemp(prefix="mtc-", dir="/tmp")  # short: socket paths ≤ 104 bytes
    d = start_daemon(slow_model_dir, mlxcel_home, os.path.join(folder, "d.sock"))
    yield d
    d.stop()
    shutil.rmtree(folder, ignore_errors=True)


async def stream(url: str, ended: dict[str, Any]) -> None:
    """An OpenAI-style SSE client: records the last finish_reason, the usage and [DONE]."""
    body = {
        "prompt": "count with me " * 4,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        # Per-token host work (top-20 logprobs, penalties) slows the tiny model, so there is
        # time to select and confirm before max_tokens.
        "logprobs": 20,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    ended["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        ended["finish"] = choice.get("finish_reason") or ended.get("finish")
                    if chunk.get("usage"):
                        ended["usage"] = chunk["usage"]
    ended["at"] = time.monotonic()


def detail_text(app: Any) -> str:
    return str(app.screen.query_one("#detail-body").render())


def generated(app: Any) -> int:
    match = re.search(r"generated\s+(\d+)", detail_text(app))
    assert match, detail_text(app)
    return int(match.group(1))


async def test_select_detail_and_cancel_a_streaming_request(daemon: Daemon) -> None:
    app = make_app(daemon.socket, interval_ms=100)
    async with app.run_test(size=(120, 40)) as pilot:
        await async_wait_until(lambda: live(app))
        # Two streams (both slots): each runs slower, and the other one must be unaffected.
        ended: dict[str, Any] = {}
        other: dict[str, Any] = {}
        job = asyncio.create_task(stream(daemon.url, ended))
        other_job = asyncio.create_task(stream(daemon.url, other))
        table = app.query_one("#slots", SlotsTable)
        await async_wait_until(lambda: all(s.state == "decode" for s in app.latest.engine.slots))
        busy = app.latest.engine.slots[0]
        table.focus()
        await pilot.press("down")
        await pilot.pause()
        assert table.selected_request() == app.latest.engine.slots[1].request_id
        await pilot.press("up")
        await pilot.pause()
        assert table.show_cursor and table.selected_request() == busy.request_id

        await pilot.press("enter")
        await async_wait_until(lambda: isinstance(app.screen, DetailScreen))
        assert busy.request_id in detail_text(app) and "prompt cache" in detail_text(app)
        first = generated(app)
        await async_wait_until(lambda: generated(app) > first, timeout=10)  # it moves while open
        assert "count with me" not in detail_text(app)  # never the prompt text
        # request.info: the endpoint, the model and the sampling parameters the client asked for.
        await async_wait_until(lambda: "repetition_penalty 1.1" in detail_text(app), timeout=5)
        assert re.search(r"endpoint\s+/v1/completions", detail_text(app)), detail_text(app)
        assert "presence_penalty 0.5" in detail_text(app) and "logprobs True" in detail_text(app)
        assert re.search(r"model\s+\S+", detail_text(app))

        await pilot.press("k")
        await async_wait_until(lambda: isinstance(app.screen, ConfirmScreen))
        assert not job.done() and not other_job.done()  # nothing happens before the answer
        await pilot.press("y")
        asked = time.monotonic()
        done, _ = await asyncio.wait([job, other_job], timeout=10, return_when="FIRST_COMPLETED")
        assert len(done) == 1
        cancelled = ended if job in done else other  # which stream slot 0 serves is not known
        assert cancelled["at"] - asked < 1.0  # the client's stream has ended within a second
        assert cancelled.get("done") and cancelled["finish"] == "abort"
        assert 0 < cancelled["usage"]["completion_tokens"] < MAX_TOKENS
        await async_wait_until(lambda: app.latest.engine.slots[0].state == "idle", timeout=2.0)
        # Idle on the console within a second of `y` (plus a 100 ms refresh or two).
        assert time.monotonic() - asked < 1.2, time.monotonic() - asked
        assert app.latest.engine.slots[1].state == "decode"  # the other one runs on
        short = busy.request_id.removeprefix("cmpl-")[:8]
        await async_wait_until(lambda: f"request {short}" in log_text(app), timeout=5)
        assert re.search(rf"request {short}\S* cancelled by mlxcel-top \(pid \d+\)", log_text(app))
        await async_wait_until(lambda: "finished" in detail_text(app), timeout=5)
        await pilot.press("escape")
        await pilot.pause()

        # The daemon's own log (l): its cancel line, streamed over logs.subscribe.
        pane = app.query_one("#daemon-log", DaemonLogPane)

        def pane_text() -> str:  # long lines wrap at the headless console's 80 columns
            return " ".join(pane.text().split())

        assert not pane.display
        await pilot.press("l")
        await pilot.pause()
        assert pane.display and not app.query_one("#log").display
        cancel_line = f"request {busy.request_id} cancelled by mlxcel-top"
        await async_wait_until(lambda: cancel_line in pane_text(), timeout=5)
        assert "ready: " in pane_text()  # the recent lines came first
        await pilot.press("f")  # warning and up: the INFO cancel line is filtered out
        await pilot.pause()
        assert pane.level == "warning" and cancel_line not in pane_text()
        for _ in range(3):  # error, debug, info
            await pilot.press("f")
        await pilot.pause()
        assert pane.level == "info" and cancel_line in pane_text()

        survivor = other if cancelled is ended else ended
        await asyncio.wait_for(asyncio.gather(job, other_job), 300)
        assert survivor["finish"] == "length"
        assert survivor["usage"]["completion_tokens"] == MAX_TOKENS

        await pilot.press("k")  # an idle slot: nothing to cancel, no confirmation
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)
