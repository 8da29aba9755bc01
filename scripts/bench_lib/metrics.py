"""Reads the daemon's Prometheus /metrics during a level: counter deltas and slot occupancy."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SAMPLE_INTERVAL_S = 0.25
# (metric sample name, label filter) -> short key in the result
COUNTERS = {
    "prompt_computed": ("mlxcel_prompt_tokens_total", {"source": "computed"}),
    "prompt_cached": ("mlxcel_prompt_tokens_total", {"source": "cached"}),
    "prefill_padded": ("mlxcel_prefill_padded_tokens_total", {}),
    "generation": ("mlxcel_generation_tokens_total", {}),
    "cache_hit_tokens": ("mlxcel_prompt_cache_hit_tokens_total", {}),
}


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample_value(samples: dict, name: str, labels: dict[str, str]) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


class MetricsSampler:
    """Counter deltas over a level plus mean busy slots, sampled every SAMPLE_INTERVAL_S."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = f"{url}/metrics"
        self.before: dict = {}
        self.busy: list[float] = []
        self.total: float | None = None
        self.task: asyncio.Task[None] | None = None

    async def fetch(self) -> dict:
        async with self.session.get(self.url) as resp:
            if resp.status != 200:
                return {}
            return parse_metrics(await resp.text())

    async def start(self) -> None:
        self.before = await self.fetch()
        self.task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            # Sleep first: at t=0 the level's requests have not arrived yet.
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            samples = await self.fetch()
            busy = sample_value(samples, "mlxcel_slots_busy", {})
            self.total = sample_value(samples, "mlxcel_slots_total", {}) or self.total
            if busy is not None:
                self.busy.append(busy)

    async def stop(self) -> dict[str, float] | None:
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await self.task
        after = await self.fetch()
        if not after or not self.before:
            return None  # not an mlxcel server: "not available", never a fake 0
        self.total = self.total or sample_value(after, "mlxcel_slots_total", {})
        out: dict[str, float] = {}
        for key, (name, labels) in COUNTERS.items():
            a, b = sample_value(after, name, labels), sample_value(self.before, name, labels)
            if a is not None and b is not None:
                out[key] = a - b
        if self.busy:  # none for a level shorter than one interval: n/a, not 0
            out["slots_busy_mean"] = sum(self.busy) / len(self.busy)
        if self.total:
            out["slots_total"] = self.total
            if self.busy:
                out["slot_occupancy"] = out["slots_busy_mean"] / self.total
        if out.get("prefill_padded"):
            out["prefill_padding_efficiency"] = (
                out.get("prompt_computed", 0) / out["prefill_padded"]
            )
        return out
