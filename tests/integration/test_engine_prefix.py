"""Token-exact prefix reuse on the real engine: partial-block hits (a chat template's system
prompt, shorter than one block) equal a cold run exactly, and requests arriving together with
a common prefix compute it once. SmolLM2's chat template on the same path is
tests/e2e/test_engine_e2e.py's."""

from __future__ import annotations

import random
from typing import Any

import pytest
from engine_checks import cold, req
from engine_driver import Driver as Run
from mlxcel.daemon.engine.types import GenerationRequest


def rand_tokens(n: int, seed: int, lo: int = 1, hi: int = 300) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(lo, hi) for _ in range(n))


SYSTEM = rand_tokens(24, seed=100)  # like a chat template's system prompt: under one block


@pytest.mark.parametrize("split_head", [True, False])
def test_a_system_prompt_under_one_block_is_reused_and_equals_a_cold_run(
    tiny: Any, split_head: bool
) -> None:
    questions = [rand_tokens(n, seed=i, lo=1, hi=300) for i, n in enumerate((9, 30, 5, 61))]
    questions = [(301 + i, *q) for i, q in enumerate(questions)]  # each differs at token 24
    requests = [req(f"q{i}", SYSTEM + q) for i, q in enumerate(questions)]
    r = Run(tiny, split_head=split_head, parallel=2, prefill_chunk_size=16)
    for request in requests:  # one after the other, as chat turns of different users
        r.add(request).run()
    cached = [r.finals[q.request_id].cached_tokens for q in requests]
    assert cached == [0, 24, 24, 24]
    for q in requests:
        assert r.tokens[q.request_id] == cold(tiny, q, split_head=split_head)
    c = r.snapshots[-1].counters
    assert c.prompt_tokens_cached == 3 * 24
    assert c.prefill_tokens == sum(len(q.prompt_ids) for q in requests) - 3 * 24


@pytest.mark.parametrize("cut", [1, 31, 33, 50, 70])
def test_a_partial_block_hit_equals_a_cold_run(tiny: Any, cut: int) -> None:
    first = req("a", rand_tokens(80, seed=1), 12)
    r = Run(tiny, parallel=2, prefill_chunk_size=16).add(first).run()
    prompt = first.prompt_ids[:cut] + rand_tokens(20, seed=2, lo=300, hi=323)
    second = req("b", prompt, 12)
    r.add(second).run()
    assert r.finals["b"].cached_tokens == cut
    assert r.tokens["b"] == cold(tiny, second)


@pytest.mark.parametrize("split_head", [True, False])
def test_requests_arriving_together_compute_a_common_prefix_once(
    tiny: Any, split_head: bool
) -> None:
    common = rand_tokens(200, seed=3)
    a = req("a", common + rand_tokens(17, seed=4, lo=300, hi=323), 8)
    b = req("b", common + rand_tokens(40, seed=5, lo=1, hi=299), 8)
    c = req("c", rand_tokens(50, seed=6), 8)  # unrelated, behind b in the queue
    r = Run(tiny, split_head=split_head, parallel=4, max_batch_prefill=4, prefill_chunk_size=64)
    r.add(a, b, c).run()
    # the 200 common tokens were computed once: b reused them from a's finished prefill
    assert r.finals["b"].cached_tokens == 200
    counters = r.snapshots[-1].counters
    total = sum(len(q.prompt_ids) for q in (a, b, c))
    assert counters.prefill_tokens == counters.prompt_tokens_computed == total - 200
    for q in (a, b, c):
        assert r.tokens[q.request_id] == cold(tiny, q, split_head=split_head)
    # b waited for a's prefill (reason prefill_cap), c was never skipped ahead of b
    admitted = [{s.request_id for s in snap.slots if s.request_id} for snap in r.snapshots[:6]]
    assert admitted[0] == {"a"}
    assert next(i for i, ids in enumerate(admitted) if "b" in ids) == next(
        i for i, ids in enumerate(admitted) if "c" in ids
    )

    # without a prompt cache nobody waits: all three in one cohort, the prefix computed twice
    off = Run(tiny, split_head=split_head, parallel=4, max_batch_prefill=4, prompt_cache=False)
    off.add(a, b, c).step()
    assert off.engine.num_running == 3
    off.run()
    assert off.snapshots[-1].counters.prefill_tokens == total
    assert off.tokens == r.tokens


def test_a_cancelled_leader_does_not_strand_the_request_waiting_for_its_prefix(
    tiny: Any,
) -> None:
    common = rand_tokens(200, seed=7)
    a = req("a", (*common, 5), 8)
    b = req("b", (*common, 6, 7), 8)
    r = Run(tiny, parallel=4, max_batch_prefill=4, prefill_chunk_size=32).add(a, b)
    snap = r.step()
    assert [s.request_id for s in snap.slots if s.request_id] == ["a"]
    assert [q.wait_reason for q in snap.queue] == ["prefill_cap"]
    assert r.engine.abort("a")
    snap = r.step()  # within one step: a's slot is free and b is admitted
    assert [s.request_id for s in snap.slots if s.request_id] == ["b"]
    assert snap.kv.blocks_used == r.engine.kv.blocks_for(len(b.prompt_ids) + 8)
    r.run()
    assert r.finals["a"].finish_reason == "abort"
    assert r.finals["b"].cached_tokens == 0  # a never finished its prefill
    assert r.tokens["b"] == cold(tiny, b)


def test_the_prompt_cache_stays_in_whole_blocks_of_the_kv_budget(tiny: Any) -> None:
    r = Run(tiny, parallel=1)
    r.add(req("a", (*SYSTEM, 5, 6, 7), 4)).run()  # 27 prompt + 4 generated tokens = 31
    snap = r.snapshots[-1]
    assert snap.prompt_cache.entries == 1 and snap.kv.blocks_cached == 1
    r.add(req("b", SYSTEM + tuple(range(1, 12)), 4)).run()  # 35 + 4: two blocks
    snap = r.snapshots[-1]
    assert snap.prompt_cache.entries == 2 and snap.kv.blocks_cached == 3
    assert r.finals["b"].cached_tokens == 24


def shared_prefix_load(n: int, seed: int) -> list[GenerationRequest]:
    """n requests over three 70-token prefixes (families), each with its own tail."""
    families = [rand_tokens(70, seed=seed + f) for f in range(3)]
    return [
        req(f"L{i}", families[i % 3] + rand_tokens(5 + i % 11, seed=seed + 100 + i), 12)
        for i in range(n)
    ]


def test_padded_prefill_tokens_never_exceed_the_cap_with_prefix_reuse(tiny: Any) -> None:
    chunk, cap = 16, 96
    r = Run(tiny, parallel=8, max_batch_prefill=8, prefill_chunk_size=chunk)
    r.engine.reconfigure({"max_batch_prefill_tokens": cap})
    distinct = [req(f"D{i}", rand_tokens(20 + 3 * i, seed=60 + i), 12) for i in range(12)]
    r.add(*distinct, *shared_prefix_load(16, seed=20))
    padded_before = 0
    while r.engine.has_work:
        snap = r.step()
        padded = snap.counters.prefill_padded_tokens - padded_before
        padded_before = snap.counters.prefill_padded_tokens
        # one prefill forward per step: rows x longest chunk, rows x chunk <= cap
        assert padded <= max(cap, chunk)
    assert len(r.finals) == 28
    assert all(f.finish_reason == "length" for f in r.finals.values())
    assert r.snapshots[-1].counters.prompt_tokens_cached > 0


def test_live_changes_under_a_shared_prefix_load_keep_serving(tiny: Any) -> None:
    requests = shared_prefix_load(24, seed=40)
    r = Run(tiny, parallel=8, max_batch_prefill=4, prefill_chunk_size=16)
    r.add(*requests[:12])
    changes = [
        {"parallel": 3},
        {"prompt_cache": "off"},  # while requests wait for a shared prefix: nobody is stranded
        {"max_batch_prefill_tokens": 64},
        {"prompt_cache": "on"},
        {"parallel": 8, "max_batch_prefill": 8},
    ]
    step = 0
    while r.engine.has_work or step < 30:
        if step % 6 == 5 and changes:
            results = r.engine.reconfigure(changes.pop(0))
            assert all(c.applied for c in results), results
        if step == 10:
            r.add(*requests[12:])
        snap = r.step()
        busy = sum(s.state != "idle" for s in snap.slots)
        assert busy <= max(snap.config.parallel, 8)
        assert snap.kv.blocks_used == sum(s.kv_blocks for s in snap.slots)
        step += 1
        assert step < 2000
    assert not changes
    assert sorted(r.finals) == sorted(q.request_id for q in requests)
    assert all(f.finish_reason == "length" for f in r.finals.values())
    for q in requests[::5]:  # a sample: reuse never changes what is generated
        assert r.tokens[q.request_id] == cold(tiny, q)


def test_a_short_common_start_does_not_make_a_burst_wait(tiny: Any) -> None:
    # 40 common tokens (one block and more: a long system prompt) before long distinct prompts:
    # waiting would cost a whole prefill to save one block, so all start in one cohort
    start = rand_tokens(40, seed=80)
    burst = [req(f"B{i}", start + rand_tokens(200, seed=81 + i), 4) for i in range(4)]
    r = Run(tiny, parallel=4, max_batch_prefill=4, max_batch_prefill_tokens=0).add(*burst)
    snap = r.step()
    assert sum(s.state != "idle" for s in snap.slots) == 4 and not snap.queue
    r.run()
    assert all(r.finals[q.request_id].finish_reason == "length" for q in burst)


def finish_one_while_another_decodes(tiny: Any) -> tuple[Run, GenerationRequest]:
    """Requests "a" (4 tokens) and "b" (30), stepped until "a" has finished; "b" decodes."""
    a = req("a", rand_tokens(70, seed=5), 4)
    r = Run(tiny, parallel=3)
    r.add(a, req("b", rand_tokens(40, seed=6), 30))
    while "a" not in r.finals:
        r.step()
    assert r.engine.running["b"].state == "decode"
    return r, a


def test_a_finished_rows_kv_waits_while_others_decode_and_is_there_for_the_next_lookup(
    tiny: Any,
) -> None:
    """The copy of a finished sequence's KV for the prompt cache waits while other rows
    decode (it would lengthen their inter-token gap), is made before the next admission looks
    the cache up, and is never left behind once nobody decodes."""
    r, a = finish_one_while_another_decodes(tiny)
    reply = tuple(r.tokens["a"])
    reused = a.prompt_ids + reply[:3]
    assert len(r.engine._kv_offers) == 1
    assert not r.engine.prefix_cache.covers(list(reused))  # the prompt alone is cached so far
    follow = req("c", reused + rand_tokens(10, seed=7, lo=300, hi=320), 4)
    r.add(follow).step()
    assert r.engine._kv_offers == []
    r.run()
    assert r.finals["c"].cached_tokens == len(reused)
    assert r.tokens["c"] == cold(tiny, follow)
    assert r.engine._kv_offers == []


def test_waiting_kv_copies_are_made_at_once_past_their_memory_bound(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiting copy keeps the decode batch's old cache alive: past `MAX_KV_OFFER_BYTES` of
    those, the copy is made in the step the row finished, though others still decode."""
    from mlxcel.daemon.engine import core as engine_module

    monkeypatch.setattr(engine_module, "MAX_KV_OFFER_BYTES", 0)
    r, a = finish_one_while_another_decodes(tiny)
    assert r.engine._kv_offers == [] and r.engine._kv_offers_bytes == 0
    reply = tuple(r.tokens["a"])
    assert r.engine.prefix_cache.covers(list(a.prompt_ids + reply[:3]))


def test_a_prompts_first_token_leaves_before_its_kv_is_copied_for_the_cache(tiny: Any) -> None:
    """The prompt's KV copy for the prompt cache (~0.1 s per 6k-token SmolLM2 prompt) comes
    after the first token has been handed over, not inside the time to first token."""
    r = Run(tiny, parallel=2, prefill_chunk_size=16)
    engine = r.engine
    events: list[str] = []
    seen = engine.on_output

    def output(rid: str, out: Any) -> None:
        if out.token_id is not None and rid not in r.tokens:
            events.append("first token")
        seen(rid, out)

    keep = engine._keep_kv

    def keep_kv(tokens: list[int], caches: list[Any]) -> None:
        events.append(f"keep {len(tokens)}")
        keep(tokens, caches)

    engine.on_output = output
    engine.on_flush = lambda: events.append("flush")
    engine._keep_kv = keep_kv  # type: ignore[method-assign]
    prompt = rand_tokens(70, seed=5)
    r.add(req("a", prompt, 6)).run()
    assert "keep 70" in events, events  # the prompt's KV was offered to the cache
    kept = events.index("keep 70")
    assert "first token" in events[:kept], events
    assert "flush" in events[events.index("first token") : kept], events


def test_a_prefix_hit_leaves_room_for_the_rest_of_the_prompt_in_the_cohort_s_cache(
    tiny: Any,
) -> None:
    """After a hit, the cohort's cache holds the cached prefix with room for the prompt's rest
    from the start, so its chunks never grow it (a copy of the whole prefix each time)."""
    first = req("a", rand_tokens(256, seed=7), 4)  # a prefix of whole 256-column steps
    r = Run(tiny, parallel=2, prefill_chunk_size=16).add(first).run()
    prompt = first.prompt_ids + rand_tokens(60, seed=8)
    r.add(req("b", prompt, 4))
    runner, columns = r.engine.runner, set()
    start = runner.start_cohort

    def start_cohort(rows: Any) -> None:
        start(rows)
        columns.add(runner._prefill.prompt_cache[0].keys.shape[2])  # as merged

    runner.start_cohort = start_cohort  # type: ignore[method-assign]
    while "b" not in r.finals:
        r.step()
        if runner.prefill_uids:
            columns.add(runner._prefill.prompt_cache[0].keys.shape[2])
    assert len(columns) == 1 and min(columns) >= len(prompt), columns
    assert r.finals["b"].cached_tokens == 256
    assert r.tokens["b"] == cold(tiny, req("b", prompt, 4))
