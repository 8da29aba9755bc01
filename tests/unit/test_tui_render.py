"""Console rendering: snapshot tests (120x40, 80x24) and widget/text rendering.

These run against a small test-only control server that speaks the protocol with canned,
deterministic snapshots (tests/tui_fakes.py: a boundary fake, rendering must not depend on
model timing). Behaviour against the real daemon is in tests/e2e/test_tui_daemon.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from dataclasses import replace

import pytest
from daemon_helpers import async_wait_until
from mlxcel.shared import PROTOCOL_VERSION
from mlxcel.shared.snapshot import Counters, Snapshot
from mlxcel.tui.app import MlxcelTop, make_app
from mlxcel.tui.cli import main as cli_main
from mlxcel.tui.logpane import DaemonLogPane
from mlxcel.tui.messages import SnapshotReceived
from mlxcel.tui.screens import ConfirmScreen, DetailScreen
from mlxcel.tui.state import Link
from mlxcel.tui.tables import QueueTable, SlotsTable
from textual.command import CommandList, CommandPalette
from tui_fakes import (
    CANNED_LOG,
    T0,
    CannedDaemon,
    connected_with_snapshot,
    fixed_clock,
    make_config,
    make_snapshot,
    utc,  # noqa: F401  (autouse: log stamps in UTC, so snapshots match anywhere)
)

# --- snapshot tests (SVG screenshots under tests/__snapshots__/) ---


def _settle(extra_snapshots: int = 0):
    async def run_before(pilot) -> None:
        app = pilot.app
        await async_wait_until(lambda: connected_with_snapshot(app))
        for step in range(extra_snapshots):
            at = T0 - extra_snapshots + step + 1
            app.post_message(SnapshotReceived(make_snapshot(True, step), at))
            await pilot.pause()
        await pilot.pause()

    return run_before


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_snapshot_idle(snap_compare, size: tuple[int, int]) -> None:
    with CannedDaemon(make_snapshot(False)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        assert snap_compare(app, terminal_size=size, run_before=_settle())


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_snapshot_busy(snap_compare, size: tuple[int, int]) -> None:
    with CannedDaemon(make_snapshot(True)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        assert snap_compare(app, terminal_size=size, run_before=_settle(extra_snapshots=40))


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_snapshot_request_detail(snap_compare, size: tuple[int, int]) -> None:
    """Enter on the selected (first, decoding) slot: that request's figures, no prompt text."""
    settle = _settle(extra_snapshots=40)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("enter")
        await async_wait_until(lambda: isinstance(pilot.app.screen, DetailScreen))
        await pilot.pause()

    with CannedDaemon(make_snapshot(True)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_snapshot_cancel_confirmation(snap_compare) -> None:
    settle = _settle(extra_snapshots=40)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("k")
        await async_wait_until(lambda: isinstance(pilot.app.screen, ConfirmScreen))
        await pilot.pause()

    with CannedDaemon(make_snapshot(True)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])
def test_snapshot_daemon_log(snap_compare, size: tuple[int, int]) -> None:
    """`l`: the daemon's own log in the bottom pane, warnings and errors coloured."""
    settle = _settle(extra_snapshots=40)

    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press("l")
        await async_wait_until(lambda: pilot.app.query_one("#daemon-log").shown == len(CANNED_LOG))
        await pilot.pause()

    with CannedDaemon(make_snapshot(True)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        assert snap_compare(app, terminal_size=size, run_before=run_before)


async def test_daemon_log_level_filter() -> None:
    with CannedDaemon(make_snapshot(False)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            await pilot.press("l")
            pane = app.query_one("#daemon-log", DaemonLogPane)
            await async_wait_until(lambda: pane.shown == len(CANNED_LOG))
            assert ("logs.subscribe", {"level": "debug", "backlog": 500}) in daemon.calls
            levels = []
            for _ in range(4):
                await pilot.press("f")
                await pilot.pause()
                levels.append((pane.level, pane.shown))
            # warning: the warning and the error; error: the error; debug, info: all seven
            assert levels == [("warning", 2), ("error", 1), ("debug", 7), ("info", 7)]
            assert pane.border_title == "daemon log · info and up"
            await pilot.press("l")
            await pilot.pause()
            assert app.query_one("#log").display and not pane.display


def test_snapshot_disconnected(snap_compare) -> None:
    app = make_app("/nonexistent/mlxcel.sock", clock=fixed_clock)

    async def run_before(pilot) -> None:
        await async_wait_until(lambda: pilot.app.link_state.link is Link.DISCONNECTED)
        await pilot.pause()

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


# --- rendering and behaviour against the canned server ---


async def test_slots_update_in_place_by_row_key() -> None:
    with CannedDaemon(make_snapshot(False)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            table = app.query_one("#slots")
            assert [str(k.value) for k in table.rows] == ["0", "1", "2", "3"]
            before = table
            app.post_message(SnapshotReceived(make_snapshot(True), T0))
            await pilot.pause()
            assert app.query_one("#slots") is before  # same widget, not recomposed
            assert str(table.get_cell("0", "state")) == "decode"
            assert str(table.get_cell("1", "state")) == "prefill 512/1480"
            assert str(table.get_cell("3", "state")) == "idle"
            assert str(table.get_cell("0", "request")) == "7f3a9c21"
            queue = app.query_one("#queue")
            assert [str(k.value) for k in queue.rows] == [
                "chatcmpl-91aa0e3b77",
                "chatcmpl-c4e8d1f002",
            ]
            assert str(queue.get_cell("chatcmpl-c4e8d1f002", "reason")) == "KV blocks (budget)"


async def test_not_available_shows_na_not_zero() -> None:
    snap = make_snapshot(False)
    daemon_info = snap.daemon.__class__(**{**snap.daemon.to_dict(), "rss_bytes": None,
                                           "cpu_percent": None})  # fmt: skip
    snap = Snapshot(daemon_info, snap.engine)
    with CannedDaemon(snap) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)):
            await async_wait_until(lambda: connected_with_snapshot(app))
            text = str(app.query_one("#process").render())
            assert "RSS n/a" in text and "CPU n/a" in text and " 0" not in text
            latency = str(app.query_one("#ttft-figures").render())
            assert "p50 n/a" in latency


async def test_keys_send_config_set_and_show_the_answer() -> None:
    with CannedDaemon(make_snapshot(False), push=True) as daemon:
        app = make_app(daemon.path, interval_ms=100, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            await pilot.press("minus")
            await async_wait_until(
                lambda: ("config.set", {"values": {"parallel": 3}}) in daemon.calls
            )
            await async_wait_until(lambda: app.latest.engine.config.parallel == 3)
            await async_wait_until(lambda: "parallel 4 → 3" in _log_text(app))
            await pilot.press("plus")
            clamped = "parallel stays 3 (asked 4: limited to 3 by the test)"
            await async_wait_until(lambda: clamped in _log_text(app))
            await pilot.press("x")
            await pilot.press("y")
            await async_wait_until(lambda: not app.latest.engine.config.prompt_cache)
            await pilot.press("c")
            await pilot.press(*"1024", "enter")
            await async_wait_until(
                lambda: app.latest.engine.config.max_batch_prefill_tokens == 1024
            )
            await pilot.press("s")
            await async_wait_until(lambda: any(m == "config.save" for m, _ in daemon.calls))
            await async_wait_until(lambda: "settings saved to" in _log_text(app))


async def test_speculation_shows_under_the_daemon_gauge_and_d_switches_it() -> None:
    snap = make_snapshot(False, config=make_config(speculative="ngram"))
    spec = Counters(preemptions=2, spec_steps=300, spec_rows=600, spec_drafted=1000,
                    spec_accepted=780)  # fmt: skip
    snap = replace(snap, engine=replace(snap.engine, counters=spec))
    with CannedDaemon(snap, push=True) as daemon:
        app = make_app(daemon.path, interval_ms=100, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            gauge = app.query_one("#process")
            assert gauge.border_subtitle == "2 preempted · spec 78% · 2.3 tok/step"
            await pilot.press("d")
            off = ("config.set", {"values": {"speculative": "off"}})
            await async_wait_until(lambda: off in daemon.calls)
            await async_wait_until(lambda: app.latest.engine.config.speculative == "off")
            assert gauge.border_subtitle == ""  # the canned answer's counters: none
            await pilot.press("d")
            await async_wait_until(
                lambda: ("config.set", {"values": {"speculative": "ngram"}}) in daemon.calls
            )


async def test_d_switches_speculation_back_on_with_the_draft_model_where_one_is_loaded() -> None:
    config = make_config(speculative="off", draft_model="smol-4bit")
    with CannedDaemon(make_snapshot(False, config=config), push=True) as daemon:
        app = make_app(daemon.path, interval_ms=100, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            await pilot.press("d")
            await async_wait_until(
                lambda: ("config.set", {"values": {"speculative": "draft"}}) in daemon.calls
            )


def _log_text(app: MlxcelTop) -> str:
    return "\n".join(line.text for line in app.query_one("#log").lines)


async def test_pause_freezes_display_but_keeps_receiving() -> None:
    with CannedDaemon(make_snapshot(False)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            await pilot.press("space")
            assert app.paused
            busy = make_snapshot(True)
            app.post_message(SnapshotReceived(busy, T0))
            await pilot.pause()
            assert app.latest is busy and app.snapshot is not busy
            await pilot.press("space")
            assert app.snapshot is busy


async def test_protocol_mismatch_is_explained() -> None:
    with CannedDaemon(make_snapshot(False), protocol=PROTOCOL_VERSION + 1) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)):
            await async_wait_until(lambda: app.link_state.link is Link.MISMATCH)
            assert "install the same mlxcel version" in _log_text(app)
            assert "protocol mismatch" in str(app.query_one("#header").render())


async def test_every_action_is_in_the_command_palette() -> None:
    app = make_app("/nonexistent/mlxcel.sock", clock=fixed_clock)
    async with app.run_test(size=(120, 40)):
        titles = {cmd.title for cmd in app.get_system_commands(app.screen)}
        for needed in ("Parallel: one more slot", "Parallel: one fewer slot",
                       "Set prefill token cap", "Prompt cache on/off",
                       "Save settings to config.toml", "Pause/resume display",
                       "Help: keys and fields"):  # fmt: skip
            assert needed in titles
        ids = {b.id for b in app.BINDINGS}
        assert {"parallel.up", "parallel.down", "prefill.cap", "prompt.cache"} <= ids
        assert all(b.tooltip for b in app.BINDINGS)


async def test_command_palette_runs_an_action() -> None:
    with CannedDaemon(make_snapshot(False)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            await pilot.press("ctrl+p")
            await async_wait_until(lambda: isinstance(app.screen, CommandPalette))
            await pilot.press(*"one fewer slot")
            await async_wait_until(lambda: palette_offers(app, "one fewer slot"))
            await pilot.press("enter")
            await async_wait_until(
                lambda: ("config.set", {"values": {"parallel": 3}}) in daemon.calls
            )


def palette_offers(app: MlxcelTop, text: str) -> bool:
    """The open command palette has searched and highlights a command containing `text`."""
    if not isinstance(app.screen, CommandPalette):
        return False
    commands = app.screen.query_one(CommandList)
    index = commands.highlighted
    if index is None or commands.option_count == 0:
        return False
    return text in str(commands.get_option_at_index(index).prompt).lower()


# --- --once ---

# uptime 3723 s; KV (124 used + 310 cached) of 1024 blocks = 42 % of 1.5 GiB; cache hits 29/40
# requests, 6210/9100 tokens, 310 blocks x 1.5 MiB; 31 + 6 requests done; ids cut to 8 characters.
EXPECTED_FRAME = """\
mlxcel-top  smollm2-135m-instruct · cpu float32 · v0.1.0 pid 4242 · up 1h02m

KV blocks     used 124 · cached 310 · free 590 / 1024 blk · 42% of 1.5 GiB
prompt cache  ON · 17 entries · hit 72% req · 68% tok · 465.0 MiB / 512.0 MiB · 3 evicted
daemon        RSS 812.0 MiB · CPU 143% · requests 37 done · 2 rejected · 2 preempted
settings      parallel 4 · prefill cap 4096 tok · prompt cache on · batch prefill 4

slots (3/4 busy)
  slot  state             request   lane    prompt  cached  gen  KV blk   TTFT  tok/s   age
     0  decode            7f3a9c21  normal     262     224   41      10  184ms   11.8  4.2s
     1  prefill 512/1480  b81d04aa  normal    1480       0    0      49    n/a    n/a  2.9s
     2  decode            0c55e2f7  high       301       0   12      14  1.43s    9.6  1.7s
     3  idle              -         -            -       -    -       -      -      -     -

queue (2 waiting)
  #  request   lane    prompt  waiting for          age
  1  91aa0e3b  normal    2210  prefill token cap   1.2s
  2  c4e8d1f0  low        180  KV blocks (budget)  0.4s

last 60 s
  TTFT          p50 410ms  p95 1.43s  (hit 90ms/180ms · partial n/a · miss 960ms/1.43s)
  decode tok/s  now 20.0  ITL 81ms/142ms
  prefill tok/s now 180.0
"""


def test_once_prints_a_text_frame(capsys: pytest.CaptureFixture[str]) -> None:
    with CannedDaemon(make_snapshot(True)) as daemon:
        assert cli_main(["--socket", daemon.path, "--once"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out
    assert "prefill 512/1480" in out
    assert "a free slot" not in out and "prefill token cap" in out  # wait reasons
    assert "RSS 812.0 MiB" in out
    assert out == EXPECTED_FRAME  # worked out by hand from make_snapshot(True)


def test_once_json_prints_the_snapshot(capsys: pytest.CaptureFixture[str]) -> None:
    snap = make_snapshot(True)
    with CannedDaemon(snap) as daemon:
        assert cli_main(["--socket", daemon.path, "--once", "--json"]) == 0
    assert Snapshot.from_dict(json.loads(capsys.readouterr().out)) == snap


def test_once_without_daemon_fails_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="mt-") as tmp:
        dead = os.path.join(tmp, "dead.sock")
        with contextlib.closing(socket.socket(socket.AF_UNIX)) as s:
            s.bind(dead)  # a stale socket file nobody listens on
        assert cli_main(["--socket", dead, "--once"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlxcel-top: no daemon reachable") and "\n" not in err


async def test_sort_keys_reorder_and_keep_the_selection() -> None:
    with CannedDaemon(make_snapshot(True)) as daemon:
        app = make_app(daemon.path, clock=fixed_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await async_wait_until(lambda: connected_with_snapshot(app))
            table = app.query_one("#slots", SlotsTable)
            table.focus()
            await pilot.press("down")  # slot 1 (prefill, no tok/s yet)
            assert table.selected_key() == "1"

            def order() -> list[str]:
                return [str(k.value) for k in table.rows]

            await pilot.press("o", "o")  # slot order -> age -> tok/s
            await pilot.pause()
            assert order() == ["0", "2", "1", "3"]  # busy by tok/s (n/a as 0), idle last
            assert table.border_subtitle == "by tok/s (o)"
            assert table.selected_key() == "1" and table.cursor_row == 2
            for _ in range(len(SlotsTable.SORTS) - 2):
                await pilot.press("o")
            await pilot.pause()
            assert order() == ["0", "1", "2", "3"] and table.border_subtitle is None

            queue = app.query_one("#queue", QueueTable)
            queue.focus()
            entries = app.latest.engine.queue
            snap = make_snapshot(True)
            reordered = replace(snap, engine=replace(snap.engine, queue=entries[::-1]))
            app.paused = True  # the canned daemon's next snapshots must not replace it
            app.snapshot = reordered
            await pilot.pause()
            await pilot.press("o", "o")  # position -> age -> prompt
            await pilot.pause()
            assert [str(k.value) for k in queue.rows] == [e.request_id for e in entries]
            assert str(queue.get_cell(entries[0].request_id, "pos")) == "2"  # still its place


def test_help_lists_every_key() -> None:
    from mlxcel.tui.commands import COMMANDS
    from mlxcel.tui.screens import HELP

    missing = [
        c.key
        for c in COMMANDS
        if c.key not in ("plus", "minus")
        and f"[b]{c.key}" not in HELP
        and f"[b]{c.key_display}" not in HELP
    ]
    assert not missing, missing  # the footer cannot hold every key at 80 columns; help does
    assert "[b]+ -[/b]" in HELP


def test_request_detail_rows() -> None:
    from mlxcel.shared.snapshot import cache_kind
    from mlxcel.tui.format import request_detail

    snap = make_snapshot(True)
    rows = dict(request_detail(snap, "chatcmpl-c4e8d1f002") or [])
    assert rows["state"] == "waiting, #2 of 2 in the queue"
    assert rows["waiting for"] == "KV blocks (budget)" and rows["prompt tokens"] == "180"
    running = dict(request_detail(snap, "chatcmpl-0c55e2f713") or [])
    assert running["state"] == "decode in slot 2" and running["prompt cache"] == "miss"
    assert running["generated"] == "12 of max 128" and running["KV blocks"].startswith("14 ")
    assert request_detail(snap, "chatcmpl-gone") is None
    assert [cache_kind(262, c, 32) for c in (0, 224, 256)] == ["miss", "partial", "hit"]
