"""Engine statistics: rolling 60 s windows, counters, and metric observations. Plain Python.

The engine thread records into `EngineStats`; the loop thread only calls `record_rejection`
and `drain_observations`, both under the lock.

Observations for the Prometheus exporter: `drain_observations()` returns and forgets the
histogram samples since the last call, as `(metric, labels, value)` tuples:
  ("time_to_first_token_seconds", {"cache": "hit" | "partial" | "miss"}, seconds)
  ("inter_token_latency_seconds", {}, seconds)
  ("request_duration_seconds", {"finish_reason": reason}, seconds)
Counters (requests by finish reason, rejections by reason, prompt tokens computed/cached,
generation tokens, prefill padded tokens, speculative decoding's verifications) are totals in
the snapshot's `Counters`.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable

from mlxcel.daemon.engine.speculative import SpecCounters, SpecPolicy
from mlxcel.shared.snapshot import CACHE_KINDS, Counters, LatencyInfo

WINDOW_S = 60.0
RATE_WINDOW_S = 5.0  # the "now" decode / prefill rates: the last few seconds, not the minute
LATENCY_REFRESH_S = 0.25
MAX_PENDING_OBSERVATIONS = 100_000  # beyond this (nobody draining) the oldest are dropped

Observation = tuple[str, dict[str, str], float]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class RollingWindow:
    """(time, value) samples of the last `span_s` seconds."""

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        self._prune(now)

    def values(self, now: float) -> list[float]:
        self._prune(now)
        return [v for _, v in self._samples]

    def total(self, now: float) -> float:
        return sum(self.values(now))

    def rate(self, now: float) -> float:
        """Per second over the window, timed from its first sample: a burst that began a
        second ago reads at its own pace, not diluted by the idle seconds before it. The first
        sample's amount was produced before its timestamp, so it only opens the interval."""
        self._prune(now)
        if len(self._samples) < 2:
            return 0.0
        first_at, first = self._samples[0]
        span = now - first_at
        if span <= 0.0:
            return 0.0
        return (sum(v for _, v in self._samples) - first) / span

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.span_s:
            self._samples.popleft()


def counted_percentile(counts: dict[float, int], q: float) -> float | None:
    """`percentile` of the list holding each value `count` times, without building it."""
    return counted_percentiles(counts, (q,))[0]


def counted_percentiles(counts: dict[float, int], qs: tuple[float, ...]) -> list[float | None]:
    """`counted_percentile` for each of `qs`, sorting the values once."""
    total = sum(counts.values())
    if not total:
        return [None] * len(qs)
    values = sorted(counts)
    cumulative = list(itertools.accumulate(counts[v] for v in values))
    out: list[float | None] = []
    for q in qs:
        pos = (total - 1) * q / 100.0
        lo = int(pos)
        hi = min(lo + 1, total - 1)
        at_lo = values[bisect.bisect_right(cumulative, lo)]  # the value at index lo
        at_hi = values[bisect.bisect_right(cumulative, hi)]
        out.append(at_lo + (at_hi - at_lo) * (pos - lo))
    return out


class CountedWindow:
    """(time, value, count) samples of the last `span_s` seconds. An engine step's inter-token
    gaps are mostly one value (every row got its token at the same moment): kept as one entry
    with a count, a minute at 12k tokens/s is ~12k entries instead of ~720k; the counts per
    value are kept up to date as samples come and go, and the percentiles are those of the
    full list (`counted_percentile`)."""

    def __init__(self, span_s: float = WINDOW_S) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, float, int]] = deque()
        self._counts: dict[float, int] = {}

    def add_many(self, now: float, values: list[float]) -> None:
        counts = self._counts
        for value, n in Counter(values).items():
            self._samples.append((now, value, n))
            counts[value] = counts.get(value, 0) + n
        self._prune(now)

    def counts(self, now: float) -> dict[float, int]:
        self._prune(now)
        return self._counts

    def _prune(self, now: float) -> None:
        samples, counts = self._samples, self._counts
        while samples and samples[0][0] < now - self.span_s:
            _, value, n = samples.popleft()
            left = counts[value] - n
            if left:
                counts[value] = left
            else:
                del counts[value]


class EngineStats:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._ttft = {kind: RollingWindow() for kind in CACHE_KINDS}
        self._itl = CountedWindow()
        self._decode_tokens = RollingWindow(RATE_WINDOW_S)
        self._prefill_tokens = RollingWindow(RATE_WINDOW_S)
        self._observations: deque[Observation] = deque(maxlen=MAX_PENDING_OBSERVATIONS)
        self._latency: LatencyInfo | None = None
        self._latency_at = 0.0
        self.requests_by_finish_reason: dict[str, int] = {}
        self.rejections_by_reason: dict[str, int] = {}
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.prefill_tokens = 0
        self.prefill_padded_tokens = 0
        self.steps = 0
        self.decode_steps = 0
        self.decode_rows = 0
        self.preemptions = 0  # running requests preempted for a higher lane (core.py)
        self.engine_restarts = 0  # engines the step watchdog replaced (bridge.py)
        # speculative decoding: the runner's policy, and what the policies before it counted
        self._spec_policy: SpecPolicy | None = None
        self._spec_retired = SpecCounters()
        # the policy's break-even estimate, read on the engine thread (the policy throttles it)
        self._spec_break_even: int | None = None

    def _observe(self, metric: str, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self._observations.append((metric, labels, value))

    def drain_observations(self) -> list[Observation]:
        with self._lock:
            drained = list(self._observations)
            self._observations.clear()
        return drained

    def record_rejection(self, reason: str) -> None:
        with self._lock:
            self.rejections_by_reason[reason] = self.rejections_by_reason.get(reason, 0) + 1

    def record_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens_cached += cached_tokens
        self.prompt_tokens_computed += prompt_tokens - cached_tokens

    def record_prefill(self, now: float, computed: int, padded: int) -> None:
        self.prefill_tokens += computed
        self.prefill_padded_tokens += padded
        if computed:
            self._prefill_tokens.add(now, computed)

    def record_decode_step(self, rows: int) -> None:
        self.decode_steps += 1
        self.decode_rows += rows

    def record_tokens(self, now: float, num_tokens: int) -> None:
        """Sampled tokens, from decode steps or from the end of a prefill."""
        self.generation_tokens += num_tokens
        self._decode_tokens.add(now, num_tokens)

    def record_first_token(self, now: float, ttft_s: float, kind: str) -> None:
        self._ttft[kind].add(now, ttft_s)
        self._latency = None  # first tokens are rare and watched: show them at once
        self._observe("time_to_first_token_seconds", {"cache": kind}, ttft_s)

    def record_inter_token(self, now: float, itl_s: float) -> None:
        self._itl.add_many(now, [itl_s])
        self._observe("inter_token_latency_seconds", {}, itl_s)

    def record_inter_tokens(self, now: float, gaps: list[float]) -> None:
        """One step's inter-token latencies at once (the same as one call per token)."""
        self._itl.add_many(now, gaps)
        no_labels: dict[str, str] = {}  # shared: the exporter only reads labels
        with self._lock:
            self._observations.extend([("inter_token_latency_seconds", no_labels, g) for g in gaps])

    def record_finish(self, reason: str, duration_s: float) -> None:
        self.requests_by_finish_reason[reason] = self.requests_by_finish_reason.get(reason, 0) + 1
        self._observe("request_duration_seconds", {"finish_reason": reason}, duration_s)

    def observe_speculation(self, policy: SpecPolicy | None) -> None:
        """The runner's speculation policy now (engine thread, before `counters`). Its counters
        go on from those of the policies before it (a mode switched off and on again, an engine
        the watchdog replaced: it keeps these stats), so the totals never go back."""
        old = self._spec_policy
        self._spec_break_even = None if policy is None else policy.measured_break_even()
        if policy is old:
            return
        if old is not None:
            done, c = self._spec_retired, old.counters
            done.steps += c.steps
            done.rows += c.rows
            done.drafted += c.drafted
            done.accepted += c.accepted
        self._spec_policy = policy

    def latency(self, now: float) -> LatencyInfo:
        """The 60 s figures, recomputed at most every LATENCY_REFRESH_S (sorting costs)."""
        if self._latency is None or now - self._latency_at >= LATENCY_REFRESH_S:
            self._latency, self._latency_at = self._compute_latency(now), now
        return self._latency

    def _compute_latency(self, now: float) -> LatencyInfo:
        by_kind = {k: w.values(now) for k, w in self._ttft.items()}
        everything = [v for values in by_kind.values() for v in values]
        itl_p50, itl_p95 = counted_percentiles(self._itl.counts(now), (50, 95))
        return LatencyInfo(
            ttft_p50_s=percentile(everything, 50),
            ttft_p95_s=percentile(everything, 95),
            ttft_by_cache={k: (percentile(v, 50), percentile(v, 95)) for k, v in by_kind.items()},
            decode_tokens_per_s=self._decode_tokens.rate(now),
            prefill_tokens_per_s=self._prefill_tokens.rate(now),
            itl_p50_s=itl_p50,
            itl_p95_s=itl_p95,
        )

    def counters(self) -> Counters:
        with self._lock:
            rejections = dict(self.rejections_by_reason)
        spec, policy = self._spec_retired, self._spec_policy
        live = policy.counters if policy is not None else None
        return Counters(
            requests_by_finish_reason=dict(self.requests_by_finish_reason),
            rejections_by_reason=rejections,
            prompt_tokens_computed=self.prompt_tokens_computed,
            prompt_tokens_cached=self.prompt_tokens_cached,
            generation_tokens=self.generation_tokens,
            prefill_tokens=self.prefill_tokens,
            prefill_padded_tokens=self.prefill_padded_tokens,
            steps=self.steps,
            decode_steps=self.decode_steps,
            decode_rows=self.decode_rows,
            preemptions=self.preemptions,
            engine_restarts=self.engine_restarts,
            spec_steps=spec.steps + (live.steps if live else 0),
            spec_rows=spec.rows + (live.rows if live else 0),
            spec_drafted=spec.drafted + (live.drafted if live else 0),
            spec_accepted=spec.accepted + (live.accepted if live else 0),
            spec_break_even_rows=self._spec_break_even,
        )
