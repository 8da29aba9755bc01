"""Speculative decoding by prompt lookup (daemon/engine/speculative.py, runner.py
`RowBatch.verify_step`): the drafting and the policy on their own, then the real engine on the
tiny random-weight llama with every drafted token verified (`SpecPolicy(always=True)`) against
the same engine with speculation off: the same tokens, logprobs, grammar-valid output, and the
same KV accounting, with rows joining and leaving, prefix-cache hits, and rollbacks across the
cache's block and buffer boundaries; the runner the engine builds with the configured policy."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import pytest
from constrained_engine import FLAGS
from engine_driver import Driver
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.speculative import (
    DRAFT_MAX,
    NgramIndex,
    RowDraftState,
    SpecPolicy,
)
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams
from mlxcel.shared.config import ServingConfig
from platform_marks import cpu_only
from speculative_runs import engine_run, looping_prompt

GREEDY = SamplingParams(temperature=0.0)


# --- drafting ---


def test_the_draft_follows_the_last_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex()
    index.sync([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 0, 3, 4])
    # "3 4" last occurred before the end at positions 7-8 (followed by 7 8 0 ...)
    assert index.draft(3) == [7, 8, 0]
    index.append(7)  # "3 4 7" now: its last occurrence is at 7-9
    assert index.draft(2) == [8, 0]
    index.sync([*index.tokens, 1, 2, 3])  # "1 2 3" is at the start: 4 5 9 follows
    assert index.draft(3) == [4, 5, 9]


def test_a_draft_continues_the_copy_in_progress_rather_than_the_last_occurrence() -> None:
    # a "file" whose lines share a prefix (5 6 = "    return"): rewriting it, the row copies
    # line 1 then line 2; after "5 6" the copy in progress continues with 20, not with the
    # last line's 40
    source = [1, 5, 6, 10, 11, 2, 5, 6, 20, 21, 3, 5, 6, 40, 41, 9]
    index = NgramIndex()
    index.sync([*source, 1, 5, 6])
    assert index.draft(3) == [10, 11, 2]  # "1 5 6" occurs once: line 1 follows
    for token in (10, 11, 2):
        index.append(token)
    assert index.draft(5) == [5, 6, 20, 21, 3]  # "11 2" occurs once: line 2 follows
    for token in (99, 5, 6):  # the model changed one token, then went on copying line 2
        index.append(token)
    # only "5 6" matches now, at four places; the last is the row's own copy of line 1
    # (10 11 would follow), the copy in progress is at line 2
    assert index.draft(2) == [20, 21]
    fresh = NgramIndex()
    fresh.sync([*source, 7, 5, 6])
    assert fresh.draft(2) == [40, 41]  # no copy in progress: the last occurrence


def test_no_draft_without_a_match_and_the_index_grows_incrementally() -> None:
    index = NgramIndex()
    index.sync([5, 6, 7])
    assert index.draft(4) == []
    context = [5, 6, 7]
    for token in (8, 5, 6):
        context.append(token)
        index.sync(context)
    assert index.tokens == context
    assert index.draft(4) == [7, 8, 5, 6]


def test_a_row_draft_length_grows_on_full_acceptance_and_falls_back() -> None:
    state = RowDraftState()
    k = state.k
    state.record(k, k)
    assert state.k == min(DRAFT_MAX, 2 * k)
    state.record(state.k, 1)
    assert state.k == 2
    assert 0.0 < state.alpha < 1.0
    assert state.expected(1) == 0.0
    assert state.expected(3) > state.expected(2) > 0.0


# --- policy ---


def test_no_verification_before_a_plain_step_of_that_many_rows_is_measured() -> None:
    policy = SpecPolicy()
    policy.row("a")
    assert not policy.worth_trying(["a"])
    assert policy.plan(["a"], [[1, 2, 3]]) == 1
    policy.record_period(2, 1, 0.012)  # two rows measured: one row is not, yet
    assert not policy.worth_trying(["a"])
    policy.record_period(1, 1, 0.010)
    assert policy.worth_trying(["a"])


def test_the_plan_verifies_when_drafted_tokens_are_cheap_and_accepted() -> None:
    policy = SpecPolicy()
    policy.record_period(1, 1, 0.010)
    state = policy.row("a")
    state.record(4, 4)  # accepted in full: alpha 5/6, k 8
    assert policy.worth_trying(["a"])
    assert policy.plan(["a"], [[1, 2, 3, 4, 5, 6, 7, 8]]) > 2
    assert policy.plan(["a"], [[]]) == 1  # nothing drafted: nothing to verify


def test_the_plan_stays_plain_when_verification_costs_more_than_it_brings() -> None:
    policy = SpecPolicy()
    rows = list("abcdefgh")
    policy.record_period(8, 1, 0.020)
    policy.record_period(8, 3, 0.020 + 0.010 * 8 * 2)  # a drafted token: half a plain step
    for u in rows:
        policy.row(u).record(4, 1)
    assert policy.extra_cost(8) == pytest.approx(0.010)
    assert policy.plan(rows, [[1, 2, 3]] * 8) == 1


def test_a_row_count_whose_verifications_delivered_less_stops_verifying() -> None:
    policy = SpecPolicy()
    rows = list("abcd")
    for u in rows:
        policy.row(u).record(4, 4)  # whole drafts accepted so far
    policy.record_period(4, 1, 0.020)  # plain: 200 tokens/s
    assert policy.worth_trying(rows)
    assert policy.plan(rows, [[1, 2, 3, 4]] * 4) > 1
    policy.record_period(4, 5, 0.080, tokens=12)  # a verification: 150 tokens/s
    assert not any(policy.worth_trying(rows) for _ in range(200))
    assert policy.worth_trying(["a"]) is False  # one row: no plain step measured yet
    policy.record_period(6, 1, 0.025)
    assert not policy.worth_trying(list("abcdef"))  # more rows than a count that lost
    # the reprobe forgets the measurement: verification is tried again
    assert any(policy.worth_trying(rows) for _ in range(100))


def test_rows_that_accept_little_do_not_stop_rows_that_copy_at_the_same_count() -> None:
    # a chat row's verification delivered less than a plain step (nothing accepted): it
    # lowers that row's acceptance, not the next request's, a rewrite that copies its input
    policy = SpecPolicy()
    policy.record_period(1, 1, 0.010)  # plain: 100 tokens/s
    width = policy.plan(["chat"], [[1, 2, 3]])
    assert width > 1
    policy.record_period(1, width, 0.014, tokens=1)  # 71 tokens/s
    policy.record("chat", 3, 0)
    assert not policy.worth_trying(["chat"])  # the chat row itself stops verifying
    assert policy.worth_trying(["rewrite"])  # a new request probes
    rewrite = policy.row("rewrite")
    for _ in range(3):
        rewrite.record(12, 12)
    assert policy.worth_trying(["rewrite"])
    assert policy.plan(["rewrite"], [list(range(12))]) > 1


def test_a_burst_of_rejections_pauses_a_copying_row_and_it_resumes_after_a_few_steps() -> None:
    # a rewrite meets the passage it changes: its drafts fail several times in a row. Its
    # overall acceptance stays high; the recent rate stops the verifications there within a
    # few steps, and recovers over the plain steps after it, so the pause does not outlive
    # the changed passage (this machine's costs: a plain step 14 ms, a drafted token 6.5)
    policy = SpecPolicy()
    policy.record_period(1, 1, 0.014)
    policy.record_period(1, 3, 0.027, tokens=3)
    row = policy.row("rewrite")
    for _ in range(20):
        row.record(8, 8)  # whole drafts accepted: the copy
    assert policy.plan(["rewrite"], [list(range(8))]) > 3
    widths = []
    while (width := policy.plan(["rewrite"], [[1, 2, 3, 4]])) > 1:
        widths.append(width)
        assert len(widths) < 5, widths
        policy.record_period(1, width, 0.014 + 0.0065 * (width - 1), tokens=1)
        policy.record("rewrite", width - 1, 0)  # rejected at its first token
    assert widths == sorted(widths, reverse=True)  # shorter drafts as the failures go on
    assert row.alpha > 0.8  # overall: still a copying row
    steps = 0  # as the engine: a lookup and a plan where worth trying, else a plain step
    while not (
        policy.worth_trying(["rewrite"]) and policy.plan(["rewrite"], [list(range(row.k))]) > 1
    ):
        steps += 1
        assert steps < 12
    assert steps > 1


def test_a_row_count_whose_drafts_keep_being_declined_looks_only_now_and_then() -> None:
    policy = SpecPolicy()
    rows = list("abcdefgh")
    policy.record_period(8, 1, 0.020)
    policy.record_period(8, 3, 0.020 + 0.001 * 8 * 2)  # 1 ms a drafted token and row
    for u in rows:
        policy.row(u).record(8, 8)  # whole drafts accepted so far: worth looking
    assert policy.worth_trying(rows)
    for _ in range(2):  # one short draft among eight rows: not worth a verification
        assert policy.plan(rows, [[1]] + [[]] * 7) == 1
    assert sum(policy.worth_trying(rows) for _ in range(64)) <= 64 // 16 + 1
    assert policy.plan(rows, [[1, 2, 3, 4, 5, 6, 7, 8]] * 8) > 1  # it pays again
    assert policy.worth_trying(rows)


def test_rows_whose_lookups_find_nothing_are_not_drafted_for_every_step() -> None:
    policy = SpecPolicy()
    policy.record_period(1, 1, 0.010)
    state = policy.row("a")
    assert policy.worth_trying(["a"])
    for _ in range(20):
        state.looked_up(False)
    assert sum(policy.worth_trying(["a"]) for _ in range(64)) <= 64 // 16 + 1
    state.looked_up(True)  # a hit: look again at the next step
    assert policy.worth_trying(["a"])


def test_verification_costs_are_learned_per_row_count_and_one_outlier_does_not_dominate() -> None:
    policy = SpecPolicy()
    policy.record_period(1, 1, 0.010)
    policy.record_period(4, 1, 0.016)
    guess = policy.extra_cost(1)
    assert guess is not None and guess > 0
    policy.record_period(1, 3, 0.014)  # the first verification of one row: 2 ms a token
    assert policy.extra_cost(1) == pytest.approx(0.002)
    assert policy.extra_cost(4) == pytest.approx(0.002)  # borrowed until measured
    policy.record_period(4, 3, 0.016 + 0.005 * 4 * 2)
    assert policy.extra_cost(4) == pytest.approx(0.005)
    assert policy.extra_cost(1) == pytest.approx(0.002)
    policy.record_period(1, 3, 5.0)  # a huge outlier: clipped
    assert policy.extra_cost(1) < 4 * 0.002


def test_the_break_even_falls_with_the_acceptance_rate() -> None:
    policy = SpecPolicy()
    assert policy.break_even_rows(0.8) is None
    for rows in (1, 2, 4, 8):
        policy.record_period(rows, 1, 0.010 + 0.001 * rows)
        policy.record_period(rows, 3, 0.010 + 0.001 * rows + 0.0015 * rows * 2)
    high, low = policy.break_even_rows(0.9), policy.break_even_rows(0.2)
    assert high is not None and low is not None
    assert high > low


# --- the engine ---


def test_the_engine_s_wait_for_work_is_not_timed_as_a_step(tiny: Any) -> None:
    # the step that ends the last row is followed by the engine's wait for the next request:
    # that period is no step's cost (timed, it would make a plain step or a verification of
    # one row look seconds long to the policy)
    driver = Driver(tiny, parallel=4, max_batch_prefill=4, prompt_cache=False)
    policy = driver.engine.runner.speculation = SpecPolicy("ngram")
    periods: list[float] = []
    record = policy.record_period

    def timed(rows: int, width: int, seconds: float, tokens: int | None = None) -> None:
        periods.append(seconds)
        record(rows, width, seconds, tokens)

    policy.record_period = timed  # type: ignore[method-assign]
    for i in range(3):
        driver.add(request(f"r{i}", looping_prompt(i), 12))
        while driver.engine.has_work:
            driver.step()
        time.sleep(0.4)
    assert len(periods) > 10
    assert max(periods) < 0.4


def counters(driver: Driver) -> Any:
    policy = driver.engine.runner.speculation
    assert policy is not None
    return policy.counters


def request(
    rid: str, prompt: tuple[int, ...], n: int, sampling: SamplingParams = GREEDY, **kw: Any
):
    return GenerationRequest(rid, prompt, n, sampling, **kw)


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_greedy_output_is_the_same_with_rows_joining_and_leaving(tiny: Any) -> None:
    first = [request(f"a{i}", looping_prompt(i), 24 + 9 * i) for i in range(3)]
    late = [request(f"b{i}", looping_prompt(10 + i, 30 + i), 40) for i in range(3)]
    off = engine_run(tiny, first, spec=False, late=late)
    on = engine_run(tiny, first, spec=True, late=late, check_kv=True)
    assert on.tokens == off.tokens
    assert {r: f.finish_reason for r, f in on.finals.items()} == {
        r: f.finish_reason for r, f in off.finals.items()
    }
    c = counters(on)
    assert c.steps > 0 and c.accepted > 0, "nothing was verified or accepted"
    assert c.drafted > c.accepted, "no draft was rejected: the rollback went untested"
    # several tokens of a row in one step: fewer decode steps for the same tokens
    assert on.engine.stats.decode_steps < off.engine.stats.decode_steps


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_tokens_that_arrive_together_share_the_step_s_gap_in_the_latency_figures(
    tiny: Any,
) -> None:
    on = Driver(tiny, parallel=4, prompt_cache=False)
    on.engine.runner.speculation = SpecPolicy("ngram", always=True)
    gaps: list[float] = []
    record = on.engine.stats.record_inter_tokens
    on.engine.stats.record_inter_tokens = lambda now, g: (gaps.extend(g), record(now, g))  # type: ignore[method-assign]
    on.add(request("i", looping_prompt(11), 60)).run()
    assert counters(on).accepted > 10, "too few tokens accepted to arrive together"
    assert len(gaps) == len(on.tokens["i"]) - 1  # every token after the first has one
    assert min(gaps) > 0, "a token that arrived with others counted a zero gap"


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_a_prefix_cache_hit_and_block_boundaries_give_the_same_tokens(tiny: Any) -> None:
    base = looping_prompt(3, 60)
    shared = [request("p0", base, 40)]
    # the second prompt reuses the first's KV from the prompt cache, its length one short of
    # a block so drafts straddle block boundaries as they are accepted and rolled back
    follow = [request("p1", base + looping_prompt(4, 40)[:35], 60)]
    off = engine_run(tiny, shared, spec=False, late=follow, prompt_cache=True)
    on = engine_run(tiny, shared, spec=True, late=follow, prompt_cache=True, check_kv=True)
    assert on.tokens == off.tokens
    assert on.finals["p1"].cached_tokens > 0, "the second request missed the prompt cache"
    assert on.finals["p1"].cached_tokens == off.finals["p1"].cached_tokens
    assert counters(on).accepted > 0


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_rollback_across_the_cache_buffer_boundary(tiny: Any) -> None:
    # BatchKVCache grows its buffer 256 columns at a time: a prompt of 250 tokens decodes
    # (and rolls drafts back) across that boundary
    long = looping_prompt(5, 40) * 6 + looping_prompt(6, 40)[:10]
    assert len(long) == 250
    reqs = [request("long", long, 40), request("short", looping_prompt(7), 40)]
    off = engine_run(tiny, reqs, spec=False)
    on = engine_run(tiny, reqs, spec=True, check_kv=True)
    assert on.tokens == off.tokens
    assert counters(on).accepted > 0


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_seeded_sampling_gives_the_same_text_with_speculation_on_and_off(tiny: Any) -> None:
    # a near-greedy temperature: the random model's drafts get accepted; a hot one: rejected
    seeded = [
        request(f"s{i}", looping_prompt(i), 40, SamplingParams(temperature=t, seed=i))
        for i, t in enumerate((0.05, 0.3, 1.0))
    ]
    greedy = [request("g", looping_prompt(30), 40)]
    off = engine_run(tiny, seeded + greedy, spec=False)
    on = engine_run(tiny, seeded + greedy, spec=True)
    assert on.tokens == off.tokens
    assert counters(on).accepted > 0


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_penalties_and_logprobs_apply_to_every_accepted_token(tiny: Any) -> None:
    sampling = SamplingParams(
        temperature=0.0, repetition_penalty=1.3, logprobs=True, top_logprobs=3
    )
    plain = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    reqs = [
        request("pen", looping_prompt(40), 40, sampling),
        request("lp", looping_prompt(41), 40, plain),
    ]
    outs: dict[bool, dict[str, list[Any]]] = {}
    for spec in (False, True):
        driver = Driver(tiny, parallel=4, prompt_cache=False)
        driver.engine.runner.speculation = SpecPolicy("ngram", always=True) if spec else None
        got: dict[str, list[Any]] = {}
        driver.engine.on_output = lambda rid, out, got=got: got.setdefault(rid, []).append(out)
        driver.add(*reqs).run()
        outs[spec] = got
        if spec:
            assert counters(driver).accepted > 0
    for rid in ("pen", "lp"):
        off = [o for o in outs[False][rid] if o.token_id is not None]
        on = [o for o in outs[True][rid] if o.token_id is not None]
        assert [o.token_id for o in on] == [o.token_id for o in off]
        for a, b in zip(on, off, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_a_grammar_holds_for_accepted_drafts(tiny: Any) -> None:
    sampling = SamplingParams(temperature=0.0, json_schema=json.dumps(FLAGS))
    eos = frozenset({tiny.tokenizer.eos_token_id})
    # the prompt quotes a valid answer: prompt lookup drafts from it where the grammar forces
    # the same tokens (the keys), and the grammar rejects what it does not allow
    quoted = tuple(tiny.tokenizer.encode('{"ok": true, "color": "green", "n": 7}'))
    reqs = [request("json", looping_prompt(50, 24) + quoted * 2, 60, sampling, stop_token_ids=eos)]
    results = {}
    for spec in (False, True):
        engine = Engine(
            tiny.model,
            ServingConfig(parallel=4, prompt_cache=False),
            available_bytes=1 << 30,
            tokenizer=tiny.tokenizer,
        )
        engine.runner.speculation = SpecPolicy("ngram", always=True) if spec else None
        tokens: dict[str, list[int]] = {}
        engine.on_output = lambda rid, out, t=tokens: (
            t.setdefault(rid, []).append(out.token_id) if out.token_id is not None else None
        )
        for r in reqs:
            engine.add_request(r)
        while engine.has_work:
            engine.step()
        results[spec] = (tokens, engine.runner.speculation)
    (on, policy), (off, _) = results[True], results[False]
    assert on == off
    jsonschema.validate(json.loads(tiny.tokenizer.decode(on["json"])), FLAGS)
    assert policy is not None and policy.counters.accepted > 0


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_the_kv_accounting_returns_to_the_same_numbers(tiny: Any) -> None:
    reqs = [request(f"k{i}", looping_prompt(60 + i), 30 + 5 * i) for i in range(4)]
    off = engine_run(tiny, reqs, spec=False, prompt_cache=True)
    on = engine_run(tiny, reqs, spec=True, prompt_cache=True)
    assert on.tokens == off.tokens
    a, b = on.engine.snapshot(), off.engine.snapshot()
    assert a.kv.blocks_used == b.kv.blocks_used == 0
    assert a.kv.blocks_cached == b.kv.blocks_cached > 0
    assert (a.prompt_cache.entries, a.prompt_cache.bytes) == (
        b.prompt_cache.entries,
        b.prompt_cache.bytes,
    )
    assert counters(on).drafted > counters(on).accepted


def test_a_request_that_opts_out_never_drafts(tiny: Any) -> None:
    out = SamplingParams(temperature=0.0, speculative=False)
    driver = engine_run(tiny, [request("o", looping_prompt(70), 40, out)], spec=True)
    assert len(driver.tokens["o"]) == 40
    assert counters(driver).rows == 0


# -- the runner the engine builds (mlx) ------------------------------------------------------


def test_the_engine_builds_its_runner_with_the_configured_policy(tiny: Any, tiny_solo: Any) -> None:
    from mlxcel.daemon.engine.mlx_parts import make_runner
    from mlxcel.daemon.engine.runner import BatchRunner
    from mlxcel.daemon.engine.solo_runner import SoloRunner

    on = make_runner(tiny.model, ServingConfig(), can_batch=True)
    assert isinstance(on, BatchRunner) and isinstance(on.speculation, SpecPolicy)
    assert on.speculation.mode == "ngram"
    off = make_runner(tiny.model, ServingConfig(speculative="off"), can_batch=True)
    assert isinstance(off, BatchRunner) and off.speculation is None
    solo = make_runner(tiny_solo.model, ServingConfig(), can_batch=False)
    assert isinstance(solo, SoloRunner) and solo.speculation is None

    engine = Engine(tiny.model, ServingConfig(speculative="off"), available_bytes=1 << 30)
    assert engine.runner.speculation is None
    engine.reconfigure({"speculative": "ngram"})
    assert isinstance(engine.runner.speculation, SpecPolicy)
    engine.reconfigure({"speculative": "off"})
    assert engine.runner.speculation is None
