"""The engine on tiny random-weight models: batched = alone (bit-exact on the CPU, close on any
backend), prompt cache, KV budget, live changes, cancellation, the non-batching clamp."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_checks import alone, greedy, make_prompts
from engine_driver import Driver
from mlx_lm.generate import generate_step
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, SamplingParams, TokenOutput
from mlxcel.daemon.models import load_model
from mlxcel.shared.config import ServingConfig
from platform_marks import cpu_only


def test_alone_matches_mlx_lm_generate_step(tiny: Any) -> None:
    assert Driver(tiny).engine.runner._split is not None  # the first token comes from prefill
    prompt = make_prompts(1, seed=3)[0]
    ours = alone(tiny, [greedy("a", prompt, 10)])["a"]
    ref = [
        int(tok)
        for (tok, _), _ in zip(
            generate_step(mx.array(prompt), tiny.model, max_tokens=10), range(10), strict=False
        )
    ]
    assert ours == ref
    assert len(set(ours)) > 1  # the random model does not just repeat one token


@cpu_only  # bit-exact batched == alone: a CPU guarantee (docs/platforms.md)
@pytest.mark.parametrize(
    ("parallel", "cap", "split_head", "packed"),
    [
        (4, 0, True, True),
        (8, 0, True, True),
        (8, 600, True, True),
        (8, 0, False, True),
        (8, 0, True, False),  # the two-forward path
        (8, 600, True, False),
    ],
)
def test_batched_chunked_greedy_equals_each_alone(
    tiny: Any, parallel: int, cap: int, split_head: bool, packed: bool
) -> None:
    requests = [greedy(f"r{i}", p) for i, p in enumerate(make_prompts(8))]
    d = Driver(
        tiny,
        split_head=split_head,
        packed=packed,
        parallel=parallel,
        max_batch_prefill=parallel,
        prefill_chunk_size=32,  # the step's token budget: a few tokens per row and step
        max_batch_prefill_tokens=cap,
        prompt_cache=False,
    )
    d.add(*requests)
    d.run()
    assert d.tokens == alone(tiny, requests)
    assert all(f.finish_reason == "length" and f.completion_tokens == 12 for f in d.finals.values())
    busiest = max(sum(s.state != "idle" for s in snap.slots) for snap in d.snapshots)
    prefilling = max(sum(s.state == "prefill" for s in snap.slots) for snap in d.snapshots)
    assert busiest == parallel and prefilling > 1  # really batched, prefill included
    c = d.snapshots[-1].counters
    assert c.prefill_padded_tokens > c.prefill_tokens  # rows of different lengths were padded
    assert c.decode_rows > c.decode_steps
    # one forward for decode rows and prefill chunk (the head must split for it)
    assert (d.engine.runner.num_packed_steps > 0) == (packed and split_head)


def test_prompt_cache_hit_equals_a_cold_run(tiny: Any) -> None:
    prompts = make_prompts(4, seed=1, lo=40, hi=120)
    d = Driver(tiny, parallel=4, prefill_chunk_size=16)
    d.add(*[greedy(f"a{i}", p, 20) for i, p in enumerate(prompts)])
    d.run()
    # the next turn: the old prompt, its answer and a few new tokens
    follow = [
        greedy(f"b{i}", p + tuple(d.tokens[f"a{i}"]) + (7, 8, 9), 12) for i, p in enumerate(prompts)
    ]
    d.add(*follow)
    d.run()
    for r, p in zip(follow, prompts, strict=True):
        # reused to the token: the whole first turn (prompt and answer), not whole blocks
        assert d.finals[r.request_id].cached_tokens == len(p) + 20 == len(r.prompt_ids) - 3
    assert {r.request_id: d.tokens[r.request_id] for r in follow} == alone(tiny, follow)
    pc = d.snapshots[-1].prompt_cache
    assert (pc.hits, pc.misses) == (4, 4) and pc.entries == 4 and pc.bytes > 0
    assert d.snapshots[-1].counters.prompt_tokens_cached == sum(
        d.finals[r.request_id].cached_tokens for r in follow
    )
    by_cache = d.snapshots[-1].latency.ttft_by_cache
    assert by_cache["miss"][0] is not None
    assert by_cache["hit"][0] is not None or by_cache["partial"][0] is not None


def test_tiny_kv_budget_queues_instead_of_failing(tiny: Any) -> None:
    probe = Driver(tiny, prompt_cache=False)
    block_bytes = probe.engine.kv.bytes_per_block
    requests = [
        greedy(f"k{i}", p, 20) for i, p in enumerate(make_prompts(16, seed=2, lo=20, hi=60))
    ]
    # 6 blocks: two or three of these (2-3 blocks each) at a time
    d = Driver(tiny, parallel=8, kv_cache_budget=6 * block_bytes, prefill_chunk_size=16)
    d.add(*requests)
    d.run()
    assert sorted(d.finals) == sorted(r.request_id for r in requests)
    assert {f.finish_reason for f in d.finals.values()} == {"length"}
    reasons = {q.wait_reason for snap in d.snapshots for q in snap.queue}
    assert "kv_budget" in reasons
    assert all(snap.kv.blocks_used + snap.kv.blocks_cached <= 6 for snap in d.snapshots)
    assert d.tokens == alone(tiny, requests)


def test_request_that_can_never_fit_is_refused(tiny: Any) -> None:
    from mlxcel.daemon.engine.types import AdmissionRejected

    probe = Driver(tiny)
    d = Driver(tiny, kv_cache_budget=4 * probe.engine.kv.bytes_per_block)
    with pytest.raises(AdmissionRejected) as exc:
        d.engine.check_admission(greedy("big", tuple(range(100)), 100), 0)
    assert (exc.value.reason, exc.value.http_status) == ("kv_never_fits", 400)
    d.engine.check_admission(greedy("ok", tuple(range(100)), 28), 0)


def test_lowering_parallel_drains_down_without_eviction(tiny: Any) -> None:
    d = Driver(tiny, parallel=4, prefill_chunk_size=64)
    d.add(*[greedy(f"p{i}", p, 30) for i, p in enumerate(make_prompts(4, seed=4, hi=60))])
    while sum(s.state == "decode" for s in d.step().slots) < 4:
        pass
    [change] = d.engine.reconfigure({"parallel": 1})
    assert (change.applied, change.previous, change.effective) == (True, 4, 1)
    d.add(*[greedy(f"q{i}", p, 5) for i, p in enumerate(make_prompts(2, seed=5, hi=60))])
    d.run()
    assert all(d.finals[f"p{i}"].finish_reason == "length" for i in range(4))
    assert all(d.finals[f"p{i}"].completion_tokens == 30 for i in range(4))
    for snap in d.snapshots:
        ids = [s.request_id for s in snap.slots if s.request_id]
        if any(i.startswith("p") for i in ids):
            assert not any(i.startswith("q") for i in ids)  # nobody admitted while draining
        else:
            assert len(ids) <= 1  # after the drain: one slot
    assert {"q0", "q1"} <= set(d.finals)


def test_raising_parallel_admits_at_the_next_step(tiny: Any) -> None:
    d = Driver(tiny, parallel=1, max_batch_prefill=8, prefill_chunk_size=64)
    d.add(*[greedy(f"r{i}", p, 20) for i, p in enumerate(make_prompts(8, seed=6, hi=60))])
    d.step()
    assert d.engine.num_running == 1
    assert [q.wait_reason for q in d.snapshots[-1].queue] == ["slots_full"] * 7
    d.engine.reconfigure({"parallel": 8})
    d.step()
    assert d.engine.num_running == 8 and not d.snapshots[-1].queue


def test_turning_the_prompt_cache_off_frees_it(tiny: Any) -> None:
    d = Driver(tiny, prefill_chunk_size=64)
    d.add(greedy("a", make_prompts(1, seed=7, lo=100, hi=101)[0], 10))
    d.run()
    before = d.engine.snapshot()
    assert before.prompt_cache.entries == 1 and before.prompt_cache.bytes > 0
    assert before.kv.blocks_cached == 4  # 110 tokens, counted in whole blocks
    [change] = d.engine.reconfigure({"prompt_cache": "off"})
    assert change.applied and change.effective is False
    after = d.engine.snapshot()
    assert (after.prompt_cache.enabled, after.prompt_cache.entries, after.prompt_cache.bytes) == (
        False,
        0,
        0,
    )
    assert after.kv.blocks_cached == 0
    d.add(greedy("b", make_prompts(1, seed=7, lo=100, hi=101)[0], 5))
    d.run()
    assert d.engine.snapshot().prompt_cache.lookups == before.prompt_cache.lookups
    assert d.finals["b"].cached_tokens == 0


def test_invalid_changes_are_refused_and_the_old_value_kept(tiny: Any) -> None:
    d = Driver(tiny, parallel=4, ctx_size=2048)
    changes = d.engine.reconfigure({"parallel": 0, "max_batch_prefill": "many", "ctx_size": 9})
    assert [c.applied for c in changes] == [False, False, False]
    assert all(c.reason for c in changes)
    [too_thin] = d.engine.reconfigure({"parallel": 8})  # 2048 / 8 = 256 < 512 per slot
    assert not too_thin.applied and "per slot" in too_thin.reason
    assert d.engine.snapshot().config.parallel == 4


def test_cancellation_frees_slot_and_kv_within_one_step(tiny: Any) -> None:
    requests = [greedy(f"c{i}", p, 25) for i, p in enumerate(make_prompts(3, seed=8, lo=40, hi=90))]
    long_prompt = greedy("long", make_prompts(1, seed=9, lo=200, hi=201)[0], 10)
    d = Driver(tiny, parallel=4, prefill_chunk_size=64, max_batch_prefill=4)
    d.add(*requests)
    for _ in range(10):
        d.step()
    d.add(long_prompt)
    d.step()
    d.step()
    assert d.engine.running["long"].state == "prefill"
    blocks_before = d.engine.kv.num_used
    assert d.engine.abort("c1") and d.engine.abort("long")
    assert d.engine.kv.num_used == blocks_before - d.snapshots[-1].slots[1].kv_blocks - 7
    snap = d.step()
    assert {s.request_id for s in snap.slots} == {"c0", "c2", None}
    assert snap.kv.blocks_used == sum(s.kv_blocks for s in snap.slots)
    d.run()
    assert d.finals["c1"].finish_reason == "abort" and d.finals["long"].finish_reason == "abort"
    assert d.finals["c1"].completion_tokens < 25
    expected = alone(tiny, [requests[0], requests[2]])
    assert {k: d.tokens[k] for k in expected} == expected


def test_long_prefill_is_chunked_and_interleaved_with_decode(tiny: Any) -> None:
    d = Driver(tiny, parallel=2, prefill_chunk_size=16)
    d.add(greedy("short", make_prompts(1, seed=10, lo=10, hi=11)[0], 40))
    for _ in range(3):
        d.step()
    d.add(greedy("long", make_prompts(1, seed=11, lo=300, hi=301)[0], 5))
    generated_while_prefilling = []
    while "long" not in d.engine.running or d.engine.running["long"].state != "decode":
        before = d.engine.running["short"].generated
        d.step()
        generated_while_prefilling.append(d.engine.running["short"].generated - before)
    assert len(generated_while_prefilling) >= 300 // 16
    assert set(generated_while_prefilling) == {1}  # one token per step, every step
    d.run()
    assert d.finals["long"].finish_reason == "length"


def test_stop_tokens_and_logit_bias(tiny: Any) -> None:
    prompt = make_prompts(1, seed=12)[0]
    reference = alone(tiny, [greedy("ref", prompt, 10)])["ref"]
    stop_at = reference[3]
    d = Driver(tiny, parallel=2)
    d.add(GenerationRequest("stop", prompt, 10, GREEDY, frozenset({stop_at})))
    d.add(GenerationRequest("bias", prompt, 6, SamplingParams(0.0, logit_bias={42: 1000.0})))
    d.run()
    final = d.finals["stop"]
    assert (final.finish_reason, final.token_id, final.completion_tokens) == ("stop", None, 4)
    assert d.tokens["stop"] == reference[:3]
    assert d.tokens["bias"] == [42] * 6


def test_seeded_sampling_is_reproducible_in_a_batch(tiny: Any) -> None:
    prompts = make_prompts(3, seed=13)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    seeded = [GenerationRequest(f"s{i}", p, 15, params) for i, p in enumerate(prompts)]
    d = Driver(tiny, parallel=4, prefill_chunk_size=16)
    d.add(*seeded, GenerationRequest("other", prompts[0], 15, SamplingParams(1.0, seed=99)))
    d.run()
    solo = {}
    for r in seeded:
        s = Driver(tiny, parallel=1)
        s.add(r)
        s.run()
        solo[r.request_id] = s.tokens[r.request_id]
    assert {k: d.tokens[k] for k in solo} == solo
    assert d.tokens["other"] != d.tokens["s0"]


def test_non_batching_family_is_clamped_to_one_slot(tiny_nobatch_model_dir: Path) -> None:
    loaded = load_model(str(tiny_nobatch_model_dir))
    assert not loaded.info.can_batch
    d = Driver(loaded, parallel=4, max_batch_prefill=4, prefill_chunk_size=16)
    cfg = d.engine.snapshot().config
    assert (cfg.parallel, cfg.parallel_requested, cfg.max_batch_prefill) == (1, 4, 1)
    assert cfg.parallel_clamp_reason and "lfm2" in cfg.parallel_clamp_reason
    assert not cfg.prompt_cache
    prompts = make_prompts(3, seed=14, lo=20, hi=70)
    d.add(*[greedy(f"n{i}", p, 8) for i, p in enumerate(prompts)])
    d.run()
    assert max(sum(s.state != "idle" for s in snap.slots) for snap in d.snapshots) == 1
    for i, p in enumerate(prompts):
        ref = [
            int(t)
            for (t, _), _ in zip(generate_step(mx.array(p), loaded.model), range(8), strict=False)
        ]
        assert d.tokens[f"n{i}"] == ref
    [change] = d.engine.reconfigure({"parallel": 8})
    assert change.applied and change.effective == 1 and "clamped" in change.reason
    [refused] = d.engine.reconfigure({"prompt_cache": True})
    assert not refused.applied


def test_out_of_vocabulary_ids_are_refused(tiny: Any) -> None:
    from mlxcel.daemon.engine.types import AdmissionRejected

    d = Driver(tiny)
    vocab = d.engine.vocab_size
    assert vocab == 323
    bad = [
        greedy("neg", (1, -1, 2)),
        greedy("big", (1, vocab)),
        GenerationRequest("bias", (1, 2), 4, SamplingParams(logit_bias={vocab: 1.0})),
        greedy("empty", ()),
        greedy("zero", (1, 2), 0),
    ]
    for r in bad:
        with pytest.raises(AdmissionRejected) as exc:
            d.engine.check_admission(r, 0)
        assert (exc.value.reason, exc.value.http_status) == ("invalid_request", 400)
    d.engine.check_admission(greedy("ok", (0, vocab - 1)), 0)


@pytest.mark.parametrize("split_head", [True, False])
def test_requests_that_end_on_their_first_token(tiny: Any, split_head: bool) -> None:
    prompt = make_prompts(1, seed=15, lo=70, hi=71)[0]
    first = alone(tiny, [greedy("ref", prompt, 3)])["ref"][0]
    d = Driver(tiny, parallel=4, split_head=split_head)
    d.add(
        greedy("one", prompt, 1),
        GenerationRequest("stop", prompt, 5, GREEDY, frozenset({first})),
        greedy("more", prompt, 3),
    )
    d.run()
    one, stop = d.finals["one"], d.finals["stop"]
    assert (one.finish_reason, one.token_id, one.completion_tokens) == ("length", first, 1)
    assert (stop.finish_reason, stop.token_id, stop.completion_tokens) == ("stop", None, 1)
    assert d.tokens["one"] == [first] and "stop" not in d.tokens
    assert d.finals["more"].completion_tokens == 3
    assert d.engine.snapshot().prompt_cache.entries == 1  # 70 prompt tokens: 2 blocks kept
    assert d.engine.kv.num_used == 0


def test_non_batching_family_abort_frees_the_only_slot(tiny_nobatch_model_dir: Path) -> None:
    loaded = load_model(str(tiny_nobatch_model_dir))
    d = Driver(loaded, prefill_chunk_size=16)
    d.add(greedy("a", make_prompts(1, seed=16, lo=50, hi=51)[0], 100), greedy("b", (5, 6, 7), 4))
    for _ in range(6):
        d.step()
    assert d.engine.running["a"].state == "decode" and "b" not in d.engine.running
    assert d.engine.abort("a")
    d.run()
    assert d.finals["a"].finish_reason == "abort"
    assert (d.finals["b"].finish_reason, d.finals["b"].completion_tokens) == ("length", 4)
    assert d.engine.kv.num_used == 0


@pytest.mark.parametrize("keep", [[1, 2, 3], [0, 3], [2], [0, 1, 2, 3], [3, 1]])
def test_filtering_a_batch_cache_in_one_copy_equals_mlx_lm_filter(keep: list[int]) -> None:
    """`filter_batch_cache` (the decode batch's filter when rows finish) gives mlx-lm's
    `BatchKVCache.filter` result: the same keys and values in every row's columns, offsets,
    padding and length, and the next append lands after them."""
    from mlx_lm.models.cache import BatchKVCache
    from mlxcel.daemon.engine.runner import filter_batch_cache

    ours, theirs = BatchKVCache([4, 9, 6, 12]), BatchKVCache([4, 9, 6, 12])
    keys = mx.random.normal((4, 2, 30, 8), key=mx.random.key(1))
    for c in (ours, theirs):
        c.update_and_fetch(keys, keys * 3)
    filter_batch_cache(ours, keep)
    theirs.filter(keep)
    mx.eval(ours.state, theirs.state)
    assert ours._idx == theirs._idx and ours.keys.shape == theirs.keys.shape
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist()
    for row, pad in enumerate(ours.left_padding.tolist()):
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert mx.array_equal(a[row, :, pad : ours._idx], b[row, :, pad : theirs._idx]).item()
    new = mx.ones((len(keep), 2, 1, 8))
    for c in (ours, theirs):
        c.update_and_fetch(new, new)
    assert mx.array_equal(ours.keys[..., : ours._idx, :][:, :, -1], new[:, :, 0]).item()


# On any backend: a batched request's first-token distribution is close to its alone one.
# Bit-exact on the CPU (asserted by the cpu_only tests); float16 rounding on a GPU.
LOGPROB_ATOL = 0.05


def _first_logprobs(
    model: Any, prompts: list[tuple[int, ...]], parallel: int
) -> dict[str, dict[int, float]]:
    engine = Engine(
        model.model,
        ServingConfig(parallel=parallel, max_batch_prefill=parallel, prompt_cache=False),
        can_batch=model.info.can_batch,
        context_length=model.info.context_length,
        available_bytes=1 << 30,
    )
    first: dict[str, dict[int, float]] = {}

    def on_output(rid: str, out: TokenOutput) -> None:
        if out.token_id is not None and rid not in first:
            first[rid] = dict(out.top_logprobs)

    engine.on_output = on_output
    sampling = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", prompt, 2, sampling))
    while engine.has_work:
        engine.step()
    return first


def test_batched_first_token_is_close_to_alone_on_any_backend(tiny_model_dir: Path) -> None:
    model = load_model(str(tiny_model_dir))
    rnd = random.Random(7)
    prompts = [tuple(rnd.randrange(1, 300) for _ in range(rnd.randrange(5, 90))) for _ in range(6)]
    batched = _first_logprobs(model, prompts, parallel=6)
    for i, prompt in enumerate(prompts):
        alone = _first_logprobs(model, [prompt], parallel=1)["r0"]
        mine = batched[f"r{i}"]
        shared = set(alone) & set(mine)
        assert len(shared) >= 4, (alone, mine)  # the same candidates, up to a near tie at 5th
        for token in shared:
            assert abs(mine[token] - alone[token]) <= LOGPROB_ATOL, (i, token)
