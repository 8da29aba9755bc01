"""The console's plain-Python parts: formatting, history, change answers, import boundary."""

from __future__ import annotations

from mlxcel.shared.snapshot import (
    ConfigChange,
    Counters,
    DaemonInfo,
    EffectiveConfig,
    EngineSnapshot,
    KVInfo,
    LatencyInfo,
    PromptCacheInfo,
    QueueEntry,
    SlotInfo,
    Snapshot,
)
from mlxcel.tui.events import describe_event
from mlxcel.tui.format import (
    cache_lines,
    fmt_bytes,
    fmt_pair,
    fmt_secs,
    kv_lines,
    kv_subtitle,
    short_id,
    slot_cells,
    ttft_split,
)
from mlxcel.tui.state import ChangeDedupe, History, describe_change, parse_changes, series


def test_not_available_is_na_never_zero() -> None:
    assert fmt_bytes(None) == "n/a" and fmt_secs(None) == "n/a"
    assert fmt_pair(None, None) == "n/a"
    assert fmt_pair(0.05, None) == "50ms/n/a"
    pc = PromptCacheInfo(lookups=0, lookup_tokens=0)
    assert cache_lines(pc)[1] == "hit n/a req · n/a tok"
    assert "hit n/a" in ttft_split(LatencyInfo())


def test_kv_gauge_text_bounded_and_unbounded() -> None:
    kv = KVInfo(32, 1000, 250, 150, None, 1 << 20)
    assert kv_lines(kv) == ["used 250 · cached 150", "free 600 / 1000 blk"]
    assert kv_subtitle(kv) == "40% of 1000.0 MiB"
    unbounded = KVInfo(32, None, 5, 2)
    assert kv_lines(unbounded)[1] == "free: unbounded"
    assert kv_subtitle(unbounded) == "unbounded"


def test_slot_cells_idle_and_prefill() -> None:
    idle = slot_cells(SlotInfo(3))
    assert idle["state"] == "idle" and idle["ttft"] == "-" and idle["prompt"] == "-"
    busy = slot_cells(SlotInfo(1, "prefill", "chatcmpl-0123456789", 900, 64, 576, age_s=2.0))
    assert busy["state"] == "prefill 576/900" and busy["request"] == "01234567"
    assert busy["ttft"] == "n/a"  # no first token yet: unknown, not zero
    assert short_id(None) == "-"


def snapshot_with(ttft_p50_s: float | None) -> Snapshot:
    cfg = EffectiveConfig(2, 2, 256, None, 4, 4096, 512, True, 1 << 30, None, 64, 2048)
    engine = EngineSnapshot(
        0.0, cfg, (SlotInfo(0), SlotInfo(1)), (), KVInfo(), PromptCacheInfo(),
        LatencyInfo(ttft_p50_s=ttft_p50_s, decode_tokens_per_s=1.0), Counters(),
    )  # fmt: skip
    return Snapshot(DaemonInfo("0.1.0", 1, 1.0, "m", "cpu", "float32"), engine)


def test_history_keeps_sixty_seconds_and_skips_missing() -> None:
    history = History(window_s=60)
    history.add(snapshot_with(None), now=0.0)  # idle: no TTFT sample
    for t in range(1, 80):
        history.add(snapshot_with(0.1 * t), now=float(t))
    samples = history.samples()
    assert samples[0].time == 19.0 and samples[-1].time == 79.0
    assert len(series(samples, "ttft_p50_s")) == len(samples)
    history.clear()
    history.add(snapshot_with(None), now=100.0)
    assert series(history.samples(), "ttft_p50_s") == []  # None is skipped, not a 0


def test_change_answers_read_as_applied_clamped_refused() -> None:
    applied = ConfigChange("parallel", 5, True, 5, 4)
    clamped = ConfigChange("parallel", 4, True, 1, 1, "family cannot batch")
    refused = ConfigChange("parallel", 0, False, 4, 4, "parallel must be >= 1, got 0")
    assert describe_change(applied) == ("information", "parallel 4 → 5")
    assert describe_change(clamped) == (
        "warning",
        "parallel stays 1 (asked 4: family cannot batch)",
    )
    severity, text = describe_change(refused)
    assert severity == "error" and "refused: parallel must be >= 1" in text
    assert describe_change(ConfigChange("prompt_cache", False, True, False, True))[1] == (
        "prompt_cache on → off"
    )


def test_parse_changes_from_reply_and_event() -> None:
    change = ConfigChange("parallel", 3, True, 3, 4).to_dict()
    assert parse_changes({"changes": [change], "effective": {}})[0].effective == 3
    assert parse_changes(change)[0].key == "parallel"  # a config_changed event's data
    assert parse_changes({"something": "else"}) == []
    assert parse_changes({"changes": [{"key": "parallel"}, 5]}) == []  # not a change: skipped


def test_dedupe_logs_reply_and_event_once() -> None:
    dedupe = ChangeDedupe(window_s=3.0)
    change = ConfigChange("parallel", 3, True, 3, 4)
    assert dedupe.is_new(change, now=10.0)
    assert not dedupe.is_new(change, now=11.0)  # the event after the reply
    assert dedupe.is_new(change, now=20.0)  # the same change made again later


def test_daemon_events_worth_a_line() -> None:
    text, _ = describe_event(
        "request_rejected", {"request_id": "cmpl-abcdef123", "reason": "kv_budget",
                             "message": "prompt + max_tokens can never fit"},
    )  # fmt: skip
    assert text == "rejected abcdef12: kv_budget — prompt + max_tokens can never fit"
    assert describe_event("request_finished", {"finish_reason": "stop"}) is None
    failed = describe_event("request_finished", {"finish_reason": "error", "error": "boom"})
    assert failed is not None and "boom" in failed[0]
    reset = describe_event("cache_reset", {"entries_freed": 3, "bytes_freed": 2048})
    assert reset is not None and reset[0] == "prompt cache reset (3 entries, 2.0 KiB freed)"


def test_timelines_record_each_phase_of_a_request_as_seen() -> None:
    import dataclasses

    from mlxcel.tui.state import TIMELINE_KEEP_S, Timelines
    from tui_fakes import make_snapshot

    base = make_snapshot(False)
    rid = "chatcmpl-7f3a9c21e5"

    def at(queue: tuple[QueueEntry, ...] = (), state: str | None = None) -> Snapshot:
        slots = (
            tuple(
                SlotInfo(0, state, rid, 262, 0, 262, 1, 64, 1, None, None, 1.0) if state else s
                for s in base.engine.slots[:1]
            )
            + base.engine.slots[1:]
        )
        return dataclasses.replace(
            base, engine=dataclasses.replace(base.engine, queue=queue, slots=slots)
        )

    timelines = Timelines()
    timelines.add(at(queue=(QueueEntry(rid, 262, "slots_full", 0.0),)), 100.0)
    timelines.add(at(queue=(QueueEntry(rid, 262, "kv_budget", 1.0),)), 101.5)
    timelines.add(at(queue=(QueueEntry(rid, 262, "kv_budget", 2.0),)), 102.0)
    timelines.add(at(state="prefill"), 102.5)
    timelines.add(at(state="decode"), 103.0)
    timelines.add(at(state="decode"), 107.2)
    assert timelines.describe(rid) == [
        "waiting for a free slot 1.5s",
        "waiting for KV blocks (budget) 1.0s",
        "prefill 0.5s",
        "decode 4.2s",
    ]
    timelines.add(at(), 107.2 + TIMELINE_KEEP_S + 1)  # gone for longer than it is kept
    assert timelines.describe(rid) == []
