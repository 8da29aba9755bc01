"""Alerts (docs/console.md): `[alerts]` thresholds from config.toml, each alert's start and
end over a stream of snapshots, and the console colouring the panel concerned and logging an
event, against the canned control server of the render tests (tests/tui_fakes.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import async_wait_until
from mlxcel.daemon.process.option_sources import ConfigFileError, read_config_file
from mlxcel.shared.alerts import AlertRules, AlertTracker, parse_alerts, read_alert_rules
from mlxcel.shared.config import ConfigError
from mlxcel.shared.snapshot import Counters, KVInfo, LatencyInfo, QueueEntry, Snapshot
from mlxcel.tui.app import make_app
from mlxcel.tui.messages import SnapshotReceived
from tui_fakes import (
    T0,
    CannedDaemon,
    connected_with_snapshot,
    fixed_clock,
    make_snapshot,
    utc,  # noqa: F401  (autouse: log stamps in UTC, so snapshots match anywhere)
)


def with_engine(snapshot: Snapshot, **changes: Any) -> Snapshot:
    return dataclasses.replace(snapshot, engine=dataclasses.replace(snapshot.engine, **changes))


def queued(n: int) -> tuple[QueueEntry, ...]:
    return tuple(QueueEntry(f"req-{i}", 100, "slots_full", 1.0) for i in range(n))


def kv(used: int, total: int = 100) -> KVInfo:
    return KVInfo(blocks_total=total, blocks_used=used, bytes_per_block=1024)


def rejected(n: int) -> Counters:
    return Counters(rejections_by_reason={"queue_full": n})


BASE = make_snapshot(False)


def test_parse_alerts_defaults_values_and_errors() -> None:
    assert parse_alerts(None) == AlertRules()
    rules = parse_alerts({"kv_percent": 80, "ttft-p95": 2.5, "queue_min": 3, "enabled": True})
    assert (rules.kv_percent, rules.ttft_p95, rules.queue_min) == (80.0, 2.5, 3)
    for bad, why in (
        ({"kv_percent": 120}, "between"),
        ({"ttft_p95": "fast"}, "must be a number"),
        ({"queue_min": True}, "must be a number"),
        ({"loud": 1}, "unknown"),
        ({"enabled": "yes"}, "true or false"),
        ([1, 2], "must be a table"),
    ):
        with pytest.raises(ConfigError, match=why):
            parse_alerts(bad)


def test_config_toml_alerts_table(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("parallel = 2\n\n[alerts]\nkv_percent = 75\nttft_p95 = 3\n")
    assert read_config_file(path) == {"parallel": 2}  # the daemon accepts the table
    assert read_alert_rules(path) == AlertRules(kv_percent=75.0, ttft_p95=3.0)
    path.write_text("parallel = 2\n\n[alerts]\nkv_percent = 900\n")
    with pytest.raises(ConfigFileError, match=r"line \d+: .*kv_percent must be between"):
        read_config_file(path)
    with pytest.raises(ConfigError, match="kv_percent"):
        read_alert_rules(path)
    assert read_alert_rules(tmp_path / "absent.toml") == AlertRules()


def test_config_toml_read_as_the_daemon_reads_it(tmp_path: Path) -> None:
    """The console parses config.toml with the daemon's parser (tomlkit; tomllib is 3.11+):
    a BOM some editors write is no error to either, and a broken file is a ConfigError naming
    it, not a traceback."""
    path = tmp_path / "config.toml"
    path.write_bytes(b"\xef\xbb\xbfparallel = 2\n\n[alerts]\nkv-percent = 75\nenabled = false\n")
    assert read_config_file(path) == {"parallel": 2}
    assert read_alert_rules(path) == AlertRules(kv_percent=75.0, enabled=False)
    for raw in (b"[alerts]\nkv_percent = \n", b"[alerts]\nkv_percent = 75 # \xff\n"):
        path.write_bytes(raw)
        with pytest.raises(ConfigError, match=re.escape(str(path))):
            read_alert_rules(path)


def test_each_alert_starts_and_ends() -> None:
    tracker = AlertTracker(AlertRules(queue_min=2, queue_window=10, ttft_p95=2.0))
    t = T0
    assert tracker.update(BASE, t) == []
    # KV: 95 of 100 blocks reserved.
    [change] = tracker.update(with_engine(BASE, kv=kv(95)), t + 1)
    assert change.active and change.name == "kv" and change.panel == "kv"
    assert change.message == "KV blocks 95% in use (above 90%)"
    assert tracker.update(with_engine(BASE, kv=kv(95)), t + 2) == []  # still on: no new event
    [change] = tracker.update(with_engine(BASE, kv=kv(50)), t + 3)
    assert not change.active and change.name == "kv"
    # TTFT p95 over the target.
    slow = with_engine(BASE, latency=LatencyInfo(ttft_p50_s=1.0, ttft_p95_s=3.5))
    [change] = tracker.update(slow, t + 4)
    assert change.name == "ttft" and change.panel == "latency" and "3.50s" in change.message
    tracker.update(BASE, t + 5)
    # Queue: at least 2 waiting for the whole 10 s, and more than 10 s ago.
    assert tracker.update(with_engine(BASE, queue=queued(1)), t + 8) == []  # under queue_min
    assert tracker.update(with_engine(BASE, queue=queued(2)), t + 10) == []  # 1 in the window
    [change] = tracker.update(with_engine(BASE, queue=queued(3)), t + 19)
    assert change.name == "queue" and change.message == "queue growing: 3 waiting, 1 10 s ago"
    assert tracker.update(with_engine(BASE, queue=queued(4)), t + 20) == []
    assert tracker.update(with_engine(BASE, queue=queued(4)), t + 30) == []  # steady: still on
    [change] = tracker.update(with_engine(BASE, queue=queued(3)), t + 35)  # shorter than then
    assert not change.active and change.name == "queue"
    # Flickering between 1 and 2 waiting (more clients than slots) is no alert.
    flicker = AlertTracker(AlertRules())
    for i in range(60):
        assert flicker.update(with_engine(BASE, queue=queued(1 + i % 2)), t + i) == []
    # Rejections: 2 more since the first look, within the minute; then a quiet minute.
    [change] = tracker.update(with_engine(BASE, counters=rejected(4)), t + 40)
    assert change.name == "rejections" and change.panel == "process"
    assert change.message == "rejections rising: 2 in the last 60 s"  # BASE has 2 already
    assert tracker.update(with_engine(BASE, counters=rejected(5)), t + 41) == []
    [change] = tracker.update(with_engine(BASE, counters=rejected(5)), t + 102)
    assert not change.active and change.name == "rejections"


def test_disabled_alerts_say_nothing() -> None:
    tracker = AlertTracker(AlertRules(enabled=False))
    assert tracker.update(with_engine(BASE, kv=kv(99)), T0) == []


async def test_console_colours_the_panel_and_logs_the_alert() -> None:
    busy = make_snapshot(True)
    with CannedDaemon(busy) as daemon:
        app = make_app(daemon.path, clock=fixed_clock, alert_rules=AlertRules(ttft_p95=1.0))
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            full = with_engine(busy, kv=kv(96))
            app.post_message(SnapshotReceived(full, T0 + 1))
            await pilot.pause()
            assert app.query_one("#kv").has_class("-alert")
            assert app.query_one("#latency").has_class("-alert")  # p95 1.43 s > 1 s
            assert not app.query_one("#queue").has_class("-alert")
            red = app.query_one("#kv").styles.border_title_color
            assert red != app.query_one("#cache").styles.border_title_color  # the CSS applies
            log = "\n".join(line.text for line in app.query_one("#log").lines)
            assert "alert: KV blocks 96% in use (above 90%)" in log
            assert "alert: TTFT p95 1.43s (above the 1s target)" in log
            app.post_message(SnapshotReceived(with_engine(busy, kv=kv(10)), T0 + 2))
            await pilot.pause()
            assert not app.query_one("#kv").has_class("-alert")
            log = "\n".join(line.text for line in app.query_one("#log").lines)
            assert "alert over: kv back under its threshold" in log


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_snapshot_alerts(snap_compare, size: tuple[int, int]) -> None:
    """KV above 90 % and TTFT p95 over its target: those two panels turn red."""
    busy = make_snapshot(True)

    async def run_before(pilot) -> None:
        app = pilot.app
        await async_wait_until(lambda: connected_with_snapshot(app))
        app.post_message(SnapshotReceived(with_engine(busy, kv=kv(960, 1024)), T0 + 1))
        await pilot.pause()
        await async_wait_until(lambda: app.query_one("#kv").has_class("-alert"))
        await pilot.pause()

    with CannedDaemon(busy) as daemon:
        app = make_app(daemon.path, clock=fixed_clock, alert_rules=AlertRules(ttft_p95=1.0))
        assert snap_compare(app, terminal_size=size, run_before=run_before)
