"""Prometheus metrics (docs/api.md, "Metrics"), on the daemon's own CollectorRegistry.

Two sources: gauges and counters the engine already keeps are read from its latest
snapshot at scrape time (a custom collector, so the numbers are the engine's own);
the latency histograms (first token, each token, each request) are timed by the engine and
moved into them from the bridge's `drain_observations()` periodically and at each scrape.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

from mlxcel.daemon.engine.stats import Observation
from mlxcel.daemon.engine.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    REJECT_HTTP_STATUS,
)
from mlxcel.shared.snapshot import CACHE_KINDS, DiskCacheInfo, EngineSnapshot
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Label values exported from the start (at 0), so a series exists before its first event.
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR, FINISH_TIMEOUT)
REJECT_REASONS = tuple(REJECT_HTTP_STATUS)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, math.inf)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, math.inf)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, math.inf)


class DaemonMetrics:
    """The registry and the histograms fed from engine observations. Rejections have one
    counter, the engine's (`EngineStats.rejections_by_reason`: the HTTP layer's refusals are
    recorded there too), read live through `rejections` so a scrape right after a refusal
    counts it."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot | None],
        observations: Callable[[], list[Observation]] = list,
        rejections: Callable[[], dict[str, int] | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._observations = observations
        self._lock = threading.Lock()
        self.registry.register(SnapshotCollector(snapshot, rejections))
        self.registry.register(MLXMemoryCollector())
        ProcessCollector(namespace="mlxcel", registry=self.registry)
        self.ttft = Histogram(
            "mlxcel_time_to_first_token_seconds",
            "Time from a request's arrival in the engine to its first token, "
            "by prompt-cache outcome.",
            ["cache"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        for label in CACHE_KINDS:
            self.ttft.labels(cache=label)
        self.itl = Histogram(
            "mlxcel_inter_token_latency_seconds",
            "Time between consecutive tokens of one response.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "mlxcel_request_duration_seconds",
            "Time from a request's arrival in the engine to its end, by finish reason.",
            ["finish_reason"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._histograms: dict[str, Histogram] = {
            "time_to_first_token_seconds": self.ttft,
            "inter_token_latency_seconds": self.itl,
            "request_duration_seconds": self.duration,
        }

    def absorb_observations(self) -> int:
        """Move the engine's pending histogram samples into the histograms."""
        with self._lock:
            samples = self._observations()
            for metric, labels, value in samples:
                hist = self._histograms.get(metric)
                if hist is not None:
                    (hist.labels(**labels) if labels else hist).observe(value)
        return len(samples)

    def render(self) -> bytes:
        self.absorb_observations()
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled_counter(
    name: str, doc: str, label: str, values: dict[str, int], known: tuple[str, ...]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted({**dict.fromkeys(known, 0), **values}.items()):
        family.add_metric([key], value)
    return family


class MLXMemoryCollector(Collector):
    """MLX's allocator figures at scrape time (on a GPU, the weights and KV are there)."""

    def collect(self) -> Iterator[Metric]:
        try:
            from mlxcel.daemon.engine.memory import mlx_memory

            active, cache, peak = mlx_memory()
        except Exception:  # no usable MLX in this process: nothing to report
            return
        yield _gauge("mlxcel_mlx_active_memory_bytes", "Bytes of MLX arrays alive.", active)
        yield _gauge(
            "mlxcel_mlx_cache_memory_bytes", "Bytes MLX keeps in its free-buffer cache.", cache
        )
        yield _gauge("mlxcel_mlx_peak_memory_bytes", "MLX's peak active memory.", peak)


class SnapshotCollector(Collector):
    """Gauges and counters from the engine's latest snapshot, read at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot | None],
        live_rejections: Callable[[], dict[str, int] | None],
    ) -> None:
        self._snapshot = snapshot
        self._live_rejections = live_rejections

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        yield from self._slots_and_config(snap)
        yield from self._kv_and_cache(snap)
        yield from self._tokens_and_requests(snap)

    def _slots_and_config(self, snap: EngineSnapshot) -> Iterator[Metric]:
        busy = sum(1 for s in snap.slots if s.state != "idle")
        cfg = snap.config
        yield _gauge("mlxcel_requests_running", "Requests holding a slot.", busy)
        yield _gauge("mlxcel_requests_waiting", "Requests in the queue.", len(snap.queue))
        yield _gauge("mlxcel_slots_total", "Decode slots.", len(snap.slots))
        yield _gauge("mlxcel_slots_busy", "Slots in prefill or decode.", busy)
        yield _gauge("mlxcel_parallel", "Effective parallel (decode slots).", cfg.parallel)
        yield _gauge(
            "mlxcel_max_batch_prefill", "Max prompts in one batched prefill.", cfg.max_batch_prefill
        )
        yield _gauge(
            "mlxcel_max_batch_prefill_tokens",
            "Cap on padded tokens in one batched prefill (0: uncapped).",
            cfg.max_batch_prefill_tokens,
        )
        yield _gauge(
            "mlxcel_prompt_cache_enabled", "1 when the prompt cache is on.", int(cfg.prompt_cache)
        )

    def _kv_and_cache(self, snap: EngineSnapshot) -> Iterator[Metric]:
        kv, pc = snap.kv, snap.prompt_cache
        total = math.inf if kv.blocks_total is None else kv.blocks_total
        yield _gauge("mlxcel_kv_blocks_total", "KV blocks in the budget (+Inf: unbounded).", total)
        yield _gauge(
            "mlxcel_kv_blocks_used", "KV blocks reserved by running requests.", kv.blocks_used
        )
        yield _gauge(
            "mlxcel_kv_blocks_cached", "KV blocks held by the prompt cache.", kv.blocks_cached
        )
        yield _counter(
            "mlxcel_prompt_cache_hits", "Prompt-cache lookups that reused a prefix.", pc.hits
        )
        yield _counter(
            "mlxcel_prompt_cache_misses", "Prompt-cache lookups that found nothing.", pc.misses
        )
        yield _counter(
            "mlxcel_prompt_cache_hit_tokens", "Prompt tokens served from the cache.", pc.hit_tokens
        )
        yield _gauge("mlxcel_prompt_cache_bytes", "Bytes held by the prompt cache.", pc.bytes)
        yield _gauge(
            "mlxcel_prompt_cache_capacity_bytes", "Prompt-cache byte budget.", pc.capacity_bytes
        )
        yield _gauge("mlxcel_prompt_cache_entries", "Entries in the prompt cache.", pc.entries)
        yield _counter(
            "mlxcel_prompt_cache_evictions", "Prompt-cache entries evicted.", pc.evictions
        )
        if pc.disk is not None:
            yield from self._disk_tier(pc.disk)

    @staticmethod
    def _disk_tier(disk: DiskCacheInfo) -> Iterator[Metric]:
        """The prompt cache's disk tier (docs/tuning.md), present when it is on."""
        p = "mlxcel_prompt_cache_disk_"
        for name, doc, value in (
            ("hits", "Disk-tier reads that served a prefix.", disk.hits),
            ("misses", "Disk-tier lookups and reads that served nothing.", disk.misses),
            ("hit_tokens", "Prompt tokens served from the disk tier.", disk.hit_tokens),
            ("bytes_read", "Bytes read from the disk tier.", disk.bytes_read),
            ("bytes_written", "Bytes written to the disk tier.", disk.bytes_written),
            ("read_seconds", "Seconds spent reading the disk tier.", disk.read_seconds),
            ("write_seconds", "Seconds spent writing the disk tier.", disk.write_seconds),
            ("evictions", "Disk-tier chunks deleted for its byte budget.", disk.evictions),
            ("rejected", "Disk-tier files found corrupt or foreign (deleted).", disk.rejected),
            ("writes_dropped", "Disk-tier writes dropped (writer behind).", disk.writes_dropped),
            ("write_errors", "Disk-tier writes that failed (disk full...).", disk.write_errors),
        ):
            yield _counter(p + name, doc, value)
        yield _gauge(p + "bytes", "Bytes held by the disk tier (this model).", disk.bytes)
        yield _gauge(p + "capacity_bytes", "Disk-tier byte budget.", disk.capacity_bytes)
        yield _gauge(p + "entries", "Chunks in the disk tier (this model).", disk.entries)

    @staticmethod
    def _speculative(snap: EngineSnapshot) -> Iterator[Metric]:
        """Speculative decoding (--speculative; docs/tuning.md): its verification steps, and
        how much they gave. The gauges are over the whole run (0 before any verification; the
        break-even estimate absent until measured)."""
        c, p = snap.counters, "mlxcel_speculative_"
        for name, doc, value in (
            ("steps", "Verification steps (drafted tokens checked in one forward).", c.spec_steps),
            ("draft_tokens", "Drafted tokens verified.", c.spec_drafted),
            ("accepted_tokens", "Drafted tokens the rows' own sampling accepted.", c.spec_accepted),
        ):
            yield _counter(p + name, doc, value)
        yield _gauge(
            p + "acceptance_ratio",
            "Accepted / drafted tokens since the start (0: none drafted yet).",
            c.spec_acceptance or 0.0,
        )
        yield _gauge(
            p + "tokens_per_step",
            "Tokens a row got per verification step, its accepted drafts included (0: none yet).",
            c.spec_tokens_per_step or 0.0,
        )
        if c.spec_break_even_rows is not None:  # absent until measured: 0 is "at no row count"
            yield _gauge(
                p + "break_even_rows",
                "The most rows at which verification pays, estimated from the measured step "
                "costs and acceptance (0: at no row count; absent until both are measured).",
                c.spec_break_even_rows,
            )

    def _tokens_and_requests(self, snap: EngineSnapshot) -> Iterator[Metric]:
        c = snap.counters
        prompt = CounterMetricFamily(
            "mlxcel_prompt_tokens", "Prompt tokens by source.", labels=["source"]
        )
        prompt.add_metric(["computed"], c.prompt_tokens_computed)
        prompt.add_metric(["cached"], c.prompt_tokens_cached)
        yield prompt
        yield _counter("mlxcel_generation_tokens", "Tokens generated.", c.generation_tokens)
        yield _counter(
            "mlxcel_preemptions", "Running requests preempted for a higher lane.", c.preemptions
        )
        yield _counter(
            "mlxcel_engine_restarts",
            "Engines the step watchdog replaced after a step outran --step-timeout.",
            c.engine_restarts,
        )
        yield from self._speculative(snap)
        yield _counter(
            "mlxcel_prefill_padded_tokens",
            "Tokens computed by batched prefill, padding included (rows x longest row).",
            c.prefill_padded_tokens,
        )
        yield _labelled_counter(
            "mlxcel_requests",
            "Finished requests by finish reason.",
            "finish_reason",
            c.requests_by_finish_reason,
            FINISH_REASONS,
        )
        live = self._live_rejections()
        yield _labelled_counter(
            "mlxcel_requests_rejected",
            "Refused requests by reason.",
            "reason",
            c.rejections_by_reason if live is None else live,
            REJECT_REASONS,
        )
