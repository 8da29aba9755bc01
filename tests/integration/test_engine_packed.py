"""One packed forward per step (decode rows + the cohort's prefill chunk) on the tiny llama:
greedy parity with the two-forward path and with each request alone, under several step
budgets, with fused and stock attention; the budget never exceeded; cancel mid-prefill; live
changes under load; the fallback for models the packed forward does not handle."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from blas_process import run_with_fast_blas
from engine_checks import alone, check_native_packed_run, greedy, make_prompts, staggered
from engine_driver import Driver
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, SamplingParams
from mlxcel.daemon.forward.fast_forward import FusedAttention
from mlxcel.daemon.forward.packed_forward import PackedForward
from mlxcel.daemon.models import load_model
from platform_marks import cpu_only
from repo_paths import TESTS

NATIVE_PACKED = TESTS / "child_scripts" / "engine_packed_native.py"


def step_tokens(d: Driver) -> list[tuple[int, int]]:
    """Per step: (decode rows, padded prefill tokens), from the snapshots' counters."""
    out = []
    previous = None
    for snap in d.snapshots:
        c = snap.counters
        if previous is not None:
            rows = c.decode_rows - previous.decode_rows
            padded = c.prefill_padded_tokens - previous.prefill_padded_tokens
            out.append((rows, padded))
        previous = c
    return out


@pytest.fixture(scope="module")
def tiny_stock(tiny_model_dir: Path) -> Any:
    """The tiny llama with mlx-lm's own attention (no fused forward)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXCEL_NO_FAST_FORWARD", "1")
    try:
        return load_model(str(tiny_model_dir))
    finally:
        mp.undo()


@cpu_only  # bit-exact batched == alone: a CPU guarantee (docs/platforms.md)
@pytest.mark.parametrize("budget", [16, 40, 96, 512])
def test_packed_equals_two_forwards_and_alone_under_each_budget(tiny: Any, budget: int) -> None:
    requests = [greedy(f"r{i}", p, 16) for i, p in enumerate(make_prompts(8, seed=21))]
    runs = {}
    for packed in (True, False):
        d = Driver(
            tiny,
            packed=packed,
            parallel=8,
            max_batch_prefill=4,
            prefill_chunk_size=budget,
            prompt_cache=False,
        )
        runs[packed] = staggered(d, requests)
        assert (d.engine.runner.num_packed_steps > 0) == packed
    assert runs[True].tokens == runs[False].tokens == alone(tiny, requests)
    # the same chunks in both: only the number of forwards differs
    assert step_tokens(runs[True]) == step_tokens(runs[False])


@cpu_only
def test_packed_with_stock_attention_equals_alone(tiny_stock: Any) -> None:
    layers = tiny_stock.model.model.layers
    assert not any(isinstance(layer.self_attn, FusedAttention) for layer in layers)
    requests = [greedy(f"s{i}", p, 16) for i, p in enumerate(make_prompts(6, seed=22))]
    d = staggered(Driver(tiny_stock, parallel=8, prefill_chunk_size=48), requests)
    assert d.engine.runner.num_packed_steps > 0
    assert d.tokens == alone(tiny_stock, requests)


@pytest.mark.parametrize("budget", [24, 64, 200])
def test_a_step_never_computes_more_than_its_budget(tiny: Any, budget: int) -> None:
    requests = [greedy(f"b{i}", p, 20) for i, p in enumerate(make_prompts(12, seed=23, lo=20))]
    d = Driver(tiny, parallel=6, max_batch_prefill=3, prefill_chunk_size=budget)
    staggered(d, requests, every=2)
    assert d.engine.runner.num_packed_steps > 0
    steps = step_tokens(d)
    assert all(rows + padded <= budget for rows, padded in steps), steps
    # the budget is used: some step fills it, prefill included, with rows decoding
    assert max(rows + padded for rows, padded in steps if rows) > budget // 2
    assert all(f.finish_reason == "length" for f in d.finals.values()) and len(d.finals) == 12


def test_the_budget_leaves_one_token_per_prefill_row_at_least(tiny: Any) -> None:
    """Budget below decode rows + cohort rows: each cohort row still advances a token a step
    (prefill never starves behind decoding rows)."""
    requests = [greedy(f"f{i}", p, 30) for i, p in enumerate(make_prompts(6, seed=24, lo=30))]
    d = Driver(tiny, parallel=6, max_batch_prefill=2, prefill_chunk_size=16)
    staggered(d, requests, every=1)
    assert len(d.finals) == 6
    assert d.tokens == alone(tiny, requests)


def test_cancel_mid_prefill_in_a_packed_step_frees_within_one_step(tiny: Any) -> None:
    decoding = [greedy(f"d{i}", p, 40) for i, p in enumerate(make_prompts(2, seed=25, lo=10))]
    long_prompt = greedy("long", make_prompts(1, seed=26, lo=300, hi=301)[0], 10)
    d = Driver(tiny, parallel=4, prefill_chunk_size=32)
    d.add(*decoding)
    d.step()
    while any(d.engine.running[r.request_id].state != "decode" for r in decoding):
        d.step()
    d.add(long_prompt)
    packed_before = d.engine.runner.num_packed_steps
    d.step()
    d.step()
    assert d.engine.running["long"].state == "prefill"
    assert d.engine.runner.num_packed_steps == packed_before + 2  # its chunks ride the decode
    blocks_before = d.engine.kv.num_used
    assert d.engine.abort("long")
    assert d.engine.kv.num_used == blocks_before - d.engine.kv.blocks_for(310)
    snap = d.step()
    assert "long" not in {s.request_id for s in snap.slots}
    assert snap.kv.blocks_used == sum(s.kv_blocks for s in snap.slots)
    assert d.engine.runner.prefill_uids == []
    d.run()
    assert d.finals["long"].finish_reason == "abort"
    assert {k: d.tokens[k] for k in ("d0", "d1")} == alone(tiny, decoding)


def test_live_changes_under_load_keep_working_with_packed_steps(tiny: Any) -> None:
    prompts = make_prompts(16, seed=27, lo=20, hi=120)
    requests = [greedy(f"l{i}", p, 16) for i, p in enumerate(prompts)]
    d = Driver(tiny, parallel=8, max_batch_prefill=4, prefill_chunk_size=48)
    changes = {
        4: {"parallel": 3},
        10: {"max_batch_prefill_tokens": 100},
        16: {"prompt_cache": False},
        22: {"parallel": 8, "max_batch_prefill": 2},
        28: {"prompt_cache": True, "max_batch_prefill_tokens": 0},
    }
    for i, r in enumerate(requests):
        d.add(r)
        if i in changes:
            results = d.engine.reconfigure(changes[i])
            assert all(c.applied for c in results), results
        before = len(d.engine.running)
        d.step()
        d.step()
        # a lowered parallel drains down (nobody evicted, nobody new admitted meanwhile)
        assert len(d.engine.running) <= max(d.engine.effective.parallel, before)
    d.run()
    assert d.engine.runner.num_packed_steps > 0
    assert {f.finish_reason for f in d.finals.values()} == {"length"} and len(d.finals) == 16
    assert d.tokens == alone(tiny, requests)
    assert d.engine.kv.num_used == 0 and d.engine.kv.num_cached == d.engine.prefix_cache.num_blocks


def test_unrecognised_models_fall_back_to_two_forwards_and_say_so(
    tiny: Any, tiny_solo: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert PackedForward.for_model(tiny.model) is not None
    assert PackedForward.for_model(tiny_solo.model) is None  # lfm2: not a llama stack
    with caplog.at_level(logging.INFO, logger="mlxcel.engine"):
        d = Driver(tiny, split_head=False, parallel=4)  # no separable head: no packed step
    assert not d.engine.runner.packed
    assert "two forwards" in caplog.text
    requests = [greedy(f"g{i}", p, 10) for i, p in enumerate(make_prompts(4, seed=28))]
    staggered(d, requests)
    assert d.engine.runner.num_packed_steps == 0
    assert d.tokens == alone(tiny, requests)


def test_a_packed_step_samples_each_rows_own_settings(tiny: Any) -> None:
    """Rows with logit bias and seeded sampling in packed steps: the same tokens as alone."""
    prompts = make_prompts(4, seed=29)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=0.0, logit_bias={7: 5.0}, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, top_k=5, seed=9, logprobs=True),
    ]
    requests = [
        GenerationRequest(f"p{i}", p, 12, s)
        for i, (p, s) in enumerate(zip(prompts, params, strict=True))
    ]
    d = staggered(Driver(tiny, parallel=4, prefill_chunk_size=32), requests)
    assert d.engine.runner.num_packed_steps > 0
    assert d.tokens == alone(tiny, requests)


@cpu_only
def test_packed_steps_on_the_native_steps_equal_alone(tmp_path: Path) -> None:
    """In a process with the daemon's BLAS setup: packed steps run the native decode step for
    the decoding rows and the native chunk step for the cohort's chunk, right-padded ones
    included, and every request's greedy tokens equal its tokens alone."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", "llama", seed=3)
    out = run_with_fast_blas(NATIVE_PACKED, str(model_dir), "40,96,512")
    check_native_packed_run(out)


@pytest.mark.parametrize(
    ("packed", "native", "after"),
    [(True, True, True), (True, False, False), (False, True, False)],
    ids=["packed-native", "packed-queued", "two-forwards"],
)
def test_a_packed_steps_decode_tokens_go_out_after_its_chunk_is_finished(
    tiny: Any, packed: bool, native: bool, after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a packed step's decode rows ran through the native decode step, their tokens are
    emitted after the chunk that rode their forward is finished (one long gap for them, not
    two); a queued (pipelined MLX) packed forward's tokens, and a two-forward step's, go out
    before the chunk is finished or run."""
    backbone = tiny.model.model
    assert backbone.__dict__.get("_mlxcel_native") is not None
    if not native:  # the backbone's own forward: the pipelined MLX path, as on a GPU
        monkeypatch.delitem(backbone.__dict__, "_mlxcel_native")
    d = Driver(tiny, packed=packed, parallel=4, prefill_chunk_size=32, prompt_cache=False)
    events: list[str] = []
    runner, emit = d.engine.runner, d.engine.on_output
    prefill_chunk = runner.prefill_chunk

    def chunk() -> Any:
        events.append("chunk")
        return prefill_chunk()

    def output(request_id: str, out: Any) -> None:
        events.append(request_id)
        emit(request_id, out)

    runner.prefill_chunk, d.engine.on_output = chunk, output
    d.add(greedy("d", make_prompts(1, seed=32, lo=10)[0], 30))
    d.step()
    while d.engine.running["d"].state != "decode":
        d.step()
    d.add(greedy("long", make_prompts(1, seed=33, lo=200, hi=201)[0], 4))
    d.step()  # admits "long" and runs its first chunk
    events.clear()
    d.step()  # "long" prefills while "d" decodes
    assert events.count("chunk") == 1 and "d" in events, events
    assert (events.index("d") > events.index("chunk")) == after, events
    assert (runner.num_packed_steps > 0) == packed
