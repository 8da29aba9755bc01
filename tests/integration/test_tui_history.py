"""Fifteen minutes of history (docs/console.md, `h`): the daemon keeps one point per 10 s from
its engine's counters (those of `status` and /metrics) and answers `history`; the console
switches its sparklines between its own 60 s and those 15 minutes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import async_wait_until, embedded_daemon
from mlxcel.daemon.server.history import CoarseHistory
from mlxcel.shared.control_client import ControlClient
from mlxcel.shared.snapshot import Counters, LatencyInfo
from mlxcel.tui.app import make_app
from mlxcel.tui.latency import LatencyPanel
from tui_fakes import T0, CannedDaemon, connected_with_snapshot, make_snapshot


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def engine_at(generated: int, prefilled: int, p50: float | None = None) -> Any:
    engine = make_snapshot(True).engine
    return dataclasses.replace(
        engine,
        counters=Counters(generation_tokens=generated, prefill_tokens=prefilled),
        latency=LatencyInfo(ttft_p50_s=p50, ttft_p95_s=p50),
    )


def test_points_are_step_means_from_the_counters_and_keep_15_minutes() -> None:
    clock = Clock()
    current = {"engine": engine_at(0, 0)}
    history = CoarseHistory(lambda: current["engine"], step_s=10, span_s=900, clock=clock)
    history.sample()  # opens the first interval: no point yet
    assert history.to_dict()["points"] == []
    clock.now += 10
    current["engine"] = engine_at(500, 2000, p50=0.25)
    history.sample()
    [point] = history.to_dict()["points"]
    assert point == {
        "t": T0 + 10,
        "decode_tokens_per_s": 50.0,
        "prefill_tokens_per_s": 200.0,
        "ttft_p50_s": 0.25,
        "ttft_p95_s": 0.25,
    }
    for i in range(120):  # 20 minutes more
        clock.now += 10
        current["engine"] = engine_at(500 + 10 * (i + 1), 2000)
        history.sample()
    points = history.to_dict()["points"]
    assert len(points) == 90 and points[-1]["t"] - points[0]["t"] == 890
    assert points[-1]["decode_tokens_per_s"] == 1.0
    # A model switch starts the counters over: no negative rate.
    clock.now += 10
    current["engine"] = engine_at(3, 0)
    history.sample()
    assert history.to_dict()["points"][-1]["decode_tokens_per_s"] == 0.0


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, tiny_model_dir, parallel=2) as d:
        yield d


async def test_history_over_the_socket_follows_the_tokens(daemon: Any) -> None:
    history = daemon.daemon.history
    body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}
    async with ControlClient(daemon.socket_path) as client:
        assert "history" in client.hello["methods"]
        before = await client.call("history")
        assert before["step_s"] == 10 and before["span_s"] == 900
        daemon.call(history.sample)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{daemon.http_url}/v1/completions", json=body) as resp:
                assert resp.status == 200
        time.sleep(0.05)
        daemon.call(history.sample)
        after = await client.call("history")
        last = after["points"][-1]
        assert last["decode_tokens_per_s"] > 0 and last["prefill_tokens_per_s"] > 0
        assert len(after["points"]) >= len(before["points"]) + 1


POINTS = [
    {
        "t": T0 - 900 + 10 * i,
        "decode_tokens_per_s": float(i % 30),
        "prefill_tokens_per_s": 100.0 + i,
        "ttft_p50_s": 0.2,
        "ttft_p95_s": 0.4,
    }
    for i in range(90)
]


async def test_h_switches_the_sparklines_to_15_minutes_and_back() -> None:
    with CannedDaemon(make_snapshot(True), push=True) as daemon:
        daemon.answers["history"] = {"step_s": 10, "span_s": 900, "points": POINTS}
        app = make_app(daemon.path, interval_ms=100)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            panel = app.query_one("#latency", LatencyPanel)
            assert panel.border_title == "last 60 s"
            await pilot.press("h")
            await async_wait_until(lambda: len(app.samples) == 90)
            assert panel.border_title == "last 15 min"
            assert ("history", {}) in daemon.calls
            await pilot.pause(0.3)  # snapshots keep coming: the 15 minutes stay
            assert len(app.samples) == 90
            assert "peak 29.0" in str(panel.query_one("#decode-figures").render())
            await pilot.press("h")
            await pilot.pause()
            assert panel.border_title == "last 60 s" and len(app.samples) < 90
