"""Engine statistics: percentiles, 60 s windows, cache kinds, observations for metrics."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlxcel.daemon.engine.stats import (
    EngineStats,
    RollingWindow,
    counted_percentile,
    percentile,
)
from mlxcel.shared.snapshot import cache_kind


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 95) == 95.0


def test_window_forgets_samples_older_than_its_span() -> None:
    w = RollingWindow(60.0)
    w.add(0.0, 1.0)
    w.add(30.0, 2.0)
    assert w.total(59.0) == 3.0
    assert w.values(61.0) == [2.0]
    assert w.values(200.0) == []


def test_cache_kind() -> None:
    assert cache_kind(100, 0, 32) == "miss"
    assert cache_kind(100, 96, 32) == "hit"  # floor(99 / 32) = 3 blocks: all reusable
    assert cache_kind(100, 64, 32) == "partial"
    assert cache_kind(97, 96, 32) == "hit"


def test_now_rates_follow_a_fresh_burst_and_fall_to_zero_after_it() -> None:
    """After a quiet minute, 4 streams at ~55 tok/s for 2 s read as ~55 "now" (a 60 s
    average would say ~2), prefill likewise; 6 s after the burst both are 0."""
    clock = Clock()
    stats = EngineStats(clock)
    clock.now += 60
    stats.record_prefill(clock.now, 256, 256)
    for _ in range(28):  # 72 ms steps of 4 rows: 4 / 0.072 = 55.6 tok/s
        clock.now += 0.072
        stats.record_tokens(clock.now, 4)
        stats.record_prefill(clock.now, 36, 36)  # 500 tok/s
    lat = stats.latency(clock.now)
    assert lat.decode_tokens_per_s == pytest.approx(4 / 0.072, rel=0.01)
    assert lat.prefill_tokens_per_s == pytest.approx(36 / 0.072, rel=0.01)
    clock.now += 6
    lat = stats.latency(clock.now)
    assert lat.decode_tokens_per_s == 0.0 and lat.prefill_tokens_per_s == 0.0


def test_latency_rates_and_observations() -> None:
    clock = Clock()
    stats = EngineStats(clock)
    clock.now += 10
    stats.record_first_token(clock.now, 0.5, "miss")
    stats.record_first_token(clock.now, 0.1, "hit")
    for _ in range(20):
        stats.record_decode_step(4)
        stats.record_tokens(clock.now, 4)
        stats.record_inter_token(clock.now, 0.2)
    stats.record_prefill(clock.now, 500, 600)
    stats.record_finish("length", 3.0)
    stats.record_rejection("queue_full")
    lat = stats.latency(clock.now)
    assert lat.ttft_by_cache["miss"] == (0.5, 0.5) and lat.ttft_by_cache["partial"] == (None, None)
    assert lat.ttft_p50_s == pytest.approx(0.3)
    assert lat.decode_tokens_per_s == 0.0  # one instant: no interval to divide by yet
    assert lat.prefill_tokens_per_s == 0.0 and lat.itl_p95_s == 0.2
    c = stats.counters()
    assert (c.generation_tokens, c.prefill_tokens, c.prefill_padded_tokens) == (80, 500, 600)
    assert c.requests_by_finish_reason == {"length": 1}
    assert c.rejections_by_reason == {"queue_full": 1}
    obs = stats.drain_observations()
    assert obs[:2] == [
        ("time_to_first_token_seconds", {"cache": "miss"}, 0.5),
        ("time_to_first_token_seconds", {"cache": "hit"}, 0.1),
    ]
    assert obs[-1] == ("request_duration_seconds", {"finish_reason": "length"}, 3.0)
    assert sum(1 for name, _, _ in obs if name == "inter_token_latency_seconds") == 20
    assert stats.drain_observations() == []
    clock.now += 120  # everything has left the window
    lat = stats.latency(clock.now)
    assert lat.ttft_p50_s is None and lat.decode_tokens_per_s == 0.0


def test_a_steps_inter_token_latencies_at_once_equal_one_call_per_token() -> None:
    one_by_one, batched = EngineStats(Clock()), EngineStats(Clock())
    for step in range(3):
        now = 10.0 + step
        gaps = [0.01 * (step + 1) + 0.001 * i for i in range(5)]
        for gap in gaps:
            one_by_one.record_inter_token(now, gap)
        batched.record_inter_tokens(now, gaps)
    assert batched.drain_observations() == one_by_one.drain_observations()
    assert batched.latency(12.0) == one_by_one.latency(12.0)
    assert batched.latency(80.0).itl_p50_s is None  # the batch leaves the window like the rest


@given(
    values=st.lists(
        st.one_of(st.sampled_from([0.0, 0.1, 0.25, 1.0]), st.floats(0, 10)), min_size=0
    ),
    q=st.sampled_from([0, 1, 50, 95, 99, 100]),
)
def test_counted_percentile_is_the_percentile_of_the_full_list(values: list[float], q: int) -> None:
    assert counted_percentile(Counter(values), q) == percentile(values, q)


def test_a_minute_of_steps_keeps_one_itl_entry_per_distinct_gap() -> None:
    stats = EngineStats(Clock())
    for step in range(1000):
        stats.record_inter_tokens(10.0 + 0.01 * step, [0.01] * 63 + [0.02])
    assert len(stats._itl._samples) == 2000  # not 64,000
    assert stats._itl.counts(20.0) == {0.01: 63_000, 0.02: 1000}
    lat = stats.latency(20.0)
    assert (lat.itl_p50_s, lat.itl_p95_s) == (0.01, 0.01)
    assert stats.latency(200.0).itl_p95_s is None
    assert stats._itl.counts(200.0) == {}  # pruned entries leave the counts too
