"""`/metrics` (docs/api.md): parses as Prometheus text, has every family, moves with traffic."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_helpers import embedded_daemon, wait_until
from prometheus_client.parser import text_string_to_metric_families

# name as the parser reports it (counters lose `_total`) -> type
DOCUMENTED_FAMILIES = {
    "mlxcel_requests_running": "gauge",
    "mlxcel_requests_waiting": "gauge",
    "mlxcel_slots_total": "gauge",
    "mlxcel_slots_busy": "gauge",
    "mlxcel_parallel": "gauge",
    "mlxcel_max_batch_prefill_tokens": "gauge",
    "mlxcel_prompt_cache_enabled": "gauge",
    "mlxcel_kv_blocks_total": "gauge",
    "mlxcel_kv_blocks_used": "gauge",
    "mlxcel_prompt_cache_hits": "counter",
    "mlxcel_prompt_cache_misses": "counter",
    "mlxcel_prompt_cache_hit_tokens": "counter",
    "mlxcel_prompt_cache_bytes": "gauge",
    "mlxcel_prompt_cache_evictions": "counter",
    "mlxcel_prompt_tokens": "counter",
    "mlxcel_generation_tokens": "counter",
    "mlxcel_prefill_padded_tokens": "counter",
    "mlxcel_speculative_steps": "counter",
    "mlxcel_speculative_draft_tokens": "counter",
    "mlxcel_speculative_accepted_tokens": "counter",
    "mlxcel_speculative_acceptance_ratio": "gauge",
    "mlxcel_speculative_tokens_per_step": "gauge",
    "mlxcel_time_to_first_token_seconds": "histogram",
    "mlxcel_inter_token_latency_seconds": "histogram",
    "mlxcel_request_duration_seconds": "histogram",
    "mlxcel_requests": "counter",
    "mlxcel_requests_rejected": "counter",
}
PROMPT = "Summarise: " + "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, tiny_model_dir, parallel=3) as d:
        yield d


def scrape(daemon: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def families(daemon: Any) -> dict[str, str]:
    with urllib.request.urlopen(daemon.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_every_spec_family_is_exported_with_its_type(daemon: Any) -> None:
    found = families(daemon)
    missing = {n: t for n, t in DOCUMENTED_FAMILIES.items() if found.get(n) != t}
    assert not missing
    assert all(name.startswith("mlxcel_") and ":" not in name for name in found)


def test_config_gauges_follow_the_engine(daemon: Any) -> None:
    s = scrape(daemon)
    assert s[("mlxcel_parallel", ())] == 3 and s[("mlxcel_slots_total", ())] == 3
    assert s[("mlxcel_max_batch_prefill_tokens", ())] == 4096
    assert s[("mlxcel_prompt_cache_enabled", ())] == 1


def test_counters_and_histograms_move_with_traffic(daemon: Any) -> None:
    before = scrape(daemon)
    client = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="x", max_retries=0)
    model = daemon.daemon.state.model.name
    for _ in range(2):  # the second request hits the prompt cache
        client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    finished = ("mlxcel_requests_total", (("finish_reason", "length"),))

    def both_counted() -> dict[Any, float] | None:
        scraped = scrape(daemon)
        return scraped if scraped.get(finished, 0) >= 2 + before.get(finished, 0) else None

    after = wait_until(both_counted, 5, 0.1, what="both requests counted in /metrics")

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("mlxcel_requests_total", finish_reason="length") == 2
    assert delta("mlxcel_generation_tokens_total") == 10
    assert delta("mlxcel_prompt_tokens_total", source="cached") >= 32
    assert delta("mlxcel_prompt_tokens_total", source="computed") > 0
    assert delta("mlxcel_prompt_cache_hits_total") == 1
    assert delta("mlxcel_prompt_cache_hit_tokens_total") >= 32
    assert delta("mlxcel_prefill_padded_tokens_total") > 0
    ttft = sum(
        delta("mlxcel_time_to_first_token_seconds_count", cache=c)
        for c in ("hit", "partial", "miss")
    )
    assert ttft == 2 and delta("mlxcel_time_to_first_token_seconds_count", cache="miss") >= 1
    assert delta("mlxcel_inter_token_latency_seconds_count") == 8
    assert delta("mlxcel_request_duration_seconds_count", finish_reason="length") == 2


def test_rejections_before_the_engine_are_counted(daemon: Any) -> None:
    client = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="x", max_retries=0)
    before = scrape(daemon)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=daemon.daemon.state.model.name, prompt="x", max_tokens=-1)
    after = scrape(daemon)
    key = ("mlxcel_requests_rejected_total", (("reason", "invalid_request"),))
    assert after[key] - before[key] == 1
