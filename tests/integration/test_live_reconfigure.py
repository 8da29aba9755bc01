"""Live reconfiguration under load, on the real engine and a tiny random-weight model: with four
requests in flight (one decoding from cached prompt blocks, three mid-prefill), the prefill
token cap is lowered and the prompt cache turned off in one change. The next cohort respects
the new cap, the running request that reused cached blocks is unharmed, nothing new is served
from the cache, and every output equals its solo run.
"""

from __future__ import annotations

from typing import Any

from engine_checks import alone, greedy, make_prompts
from engine_driver import Driver

NEW_CAP = 128  # rows x longest prompt: two rows of <= 64 tokens


def prefilling(snapshot: Any, prefix: str) -> list[Any]:
    return [
        s
        for s in snapshot.slots
        if s.state == "prefill" and (s.request_id or "").startswith(prefix)
    ]


def test_lower_cap_and_cache_off_mid_flight(tiny: Any) -> None:
    d = Driver(
        tiny, parallel=8, max_batch_prefill=4, prefill_chunk_size=16, max_batch_prefill_tokens=0
    )  # uncapped to begin with
    base = make_prompts(1, seed=21, lo=100, hi=101)[0]
    d.add(greedy("warm", base, 12))
    d.run()
    hit_prompt = base + tuple(d.tokens["warm"]) + (5, 6, 7)  # a follow-up turn: cached prefix
    first = [greedy("hit", hit_prompt, 40)]
    first += [greedy(f"a{i}", p, 20) for i, p in enumerate(make_prompts(3, 22, 120, 200))]
    d.add(*first)
    while d.engine.running.get("hit") is None or d.engine.running["hit"].state != "decode":
        d.step()
    # In flight: "hit" decodes from its cached blocks, the other three are mid-prefill.
    assert d.engine.running["hit"].cached_tokens >= 96
    assert all(d.engine.running[f"a{i}"].state == "prefill" for i in range(3))

    changes = d.engine.reconfigure({"max_batch_prefill_tokens": NEW_CAP, "prompt_cache": "off"})
    assert [(c.key, c.applied, c.effective) for c in changes] == [
        ("max_batch_prefill_tokens", True, NEW_CAP),
        ("prompt_cache", True, False),
    ]
    snap = d.engine.snapshot()
    assert (snap.prompt_cache.entries, snap.kv.blocks_cached) == (0, 0)
    lookups = snap.prompt_cache.lookups
    second = [greedy(f"b{i}", p, 10) for i, p in enumerate(make_prompts(4, 23, 50, 64))]
    second.append(greedy("again", hit_prompt, 10))  # would be a cache hit if the cache were on
    d.add(*second)
    changes_at = len(d.snapshots)
    d.run()

    after = d.snapshots[changes_at:]
    widest = 0
    for s in after:
        rows = prefilling(s, "b")
        if len(rows) > 1:
            longest = max(r.prompt_tokens - r.cached_tokens for r in rows)
            assert len(rows) * longest <= NEW_CAP, rows
        widest = max(widest, len(rows))
    assert widest == 2  # uncapped, max_batch_prefill would have taken all four at once

    hit = d.finals["hit"]
    assert (hit.finish_reason, hit.completion_tokens) == ("length", 40)
    assert hit.cached_tokens >= 96
    assert d.finals["again"].cached_tokens == 0
    assert d.engine.snapshot().prompt_cache.lookups == lookups
    requests = first + second
    assert {r.request_id: d.tokens[r.request_id] for r in requests} == alone(tiny, requests)
    assert d.engine.kv.num_used == 0
