"""Speculative decoding with a draft model (daemon/engine/draft_model.py, `--speculative
draft`): the real engine on the tiny llama, every draft verified (`SpecPolicy(always=True)`),
against the same engine with speculation off; the draft model's own KV kept in step with each
row's context; the tokenizer check; the option and the runtime switch; a daemon that drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from constrained_engine import FLAGS
from engine_driver import Driver
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.draft_model import DraftModel, DraftModelError, check_pair
from mlxcel.daemon.engine.speculative import SpecPolicy
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams
from mlxcel.shared.config import ConfigError, ServingConfig, build_config
from platform_marks import cpu_only
from speculative_runs import engine_run, looping_prompt

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A one-layer llama of other random weights on the same tokenizer: a draft model whose
    drafts the tiny llama mostly rejects."""
    from mlxcel.daemon.models import load_model
    from mlxcel.daemon.models.tiny import make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("draft") / "llama", "llama", seed=7, num_hidden_layers=1
    )
    return load_model(str(path))


def assert_draft_kv_matches(drafter: DraftModel) -> None:
    """Each drafting row's draft KV holds exactly the tokens the drafter says it fed."""
    for cache in drafter.caches:
        offsets = cache.offset.tolist()
        for j, fed in enumerate(drafter.fed):
            assert offsets[j] == len(fed), "the draft cache holds other tokens than it fed"


def draft_run(
    tiny: Any,
    draft: Any | None,
    requests: list[GenerationRequest],
    late: list[GenerationRequest] = (),  # type: ignore[assignment]
    join_budget: int = 512,
    **config: Any,
) -> Driver:
    """The requests through one engine stepped here, drafting with `draft` (every draft
    verified), or with speculation off when None; `late` join after a few steps. After every
    step both caches hold exactly what they fed."""

    def setup(driver: Driver) -> None:
        assert draft is not None
        runner = driver.engine.runner
        runner.drafter = DraftModel(draft.model, driver.engine.vocab_size, join_budget)
        runner.speculation = SpecPolicy("draft", always=True)

    return engine_run(
        tiny,
        requests,
        spec=draft is not None,
        late=late,
        check_kv=draft is not None,
        setup=setup,
        check=lambda runner: assert_draft_kv_matches(runner.drafter) if draft else None,
        **config,
    )


def workload() -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    first = [GenerationRequest(f"a{i}", looping_prompt(i), 20 + 9 * i, GREEDY) for i in range(3)]
    late = [GenerationRequest("b", looping_prompt(20, 50), 36, GREEDY)]
    return first, late


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_a_draft_model_of_the_same_weights_is_accepted_whole_and_changes_no_token(
    tiny: Any,
) -> None:
    first, late = workload()
    off = draft_run(tiny, None, first, late)
    on = draft_run(tiny, tiny, first, late)
    assert on.tokens == off.tokens
    c = on.engine.runner.speculation.counters
    # the draft model is the model itself: a drafted token is what the model would say (the
    # drafter's KV bookkeeping is off by a token, the acceptance falls to chance)
    assert c.drafted > 40 and c.accepted >= 0.95 * c.drafted, (c.accepted, c.drafted)
    assert on.engine.stats.decode_steps < off.engine.stats.decode_steps / 2


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_rejected_drafts_roll_back_both_caches_and_change_no_token(
    tiny: Any, other_draft: Any
) -> None:
    first, late = workload()
    off = draft_run(tiny, None, first, late)
    on = draft_run(tiny, other_draft, first, late, prompt_cache=True)
    assert on.tokens == off.tokens
    c = on.engine.runner.speculation.counters
    assert c.steps > 10 and c.drafted > c.accepted, "no draft was rejected"
    # the finished rows left the draft batch: no draft KV is kept for them
    assert on.engine.runner.drafter.uids == []


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_the_kv_accounting_returns_to_the_same_numbers_after_rejected_drafts(
    tiny: Any, other_draft: Any
) -> None:
    reqs = [
        GenerationRequest(f"k{i}", looping_prompt(60 + i), 30 + 5 * i, GREEDY) for i in range(4)
    ]
    off = draft_run(tiny, None, reqs, prompt_cache=True)
    on = draft_run(tiny, other_draft, reqs, prompt_cache=True)
    assert on.tokens == off.tokens
    a, b = on.engine.snapshot(), off.engine.snapshot()
    assert a.kv.blocks_used == b.kv.blocks_used == 0
    assert a.kv.blocks_cached == b.kv.blocks_cached > 0
    assert (a.prompt_cache.entries, a.prompt_cache.bytes) == (
        b.prompt_cache.entries,
        b.prompt_cache.bytes,
    )
    c = on.engine.runner.speculation.counters
    assert c.drafted > c.accepted
    assert on.engine.runner.drafter.rows == 0  # no draft KV left behind


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_a_grammar_holds_for_accepted_model_drafts(tiny: Any) -> None:
    # the draft model (the model itself) drafts its unconstrained greedy tokens: the grammar
    # accepts those it allows and rejects the rest
    sampling = SamplingParams(temperature=0.0, json_schema=json.dumps(FLAGS))
    eos = frozenset({tiny.tokenizer.eos_token_id})
    reqs = [GenerationRequest("json", looping_prompt(50, 24), 60, sampling, stop_token_ids=eos)]
    results = {}
    for draft in (None, tiny):
        engine = Engine(
            tiny.model,
            ServingConfig(parallel=4, prompt_cache=False, speculative="off"),
            available_bytes=1 << 30,
            tokenizer=tiny.tokenizer,
        )
        if draft is not None:
            engine.runner.drafter = DraftModel(draft.model, engine.vocab_size)
            engine.runner.speculation = SpecPolicy("draft", always=True)
        tokens: dict[str, list[int]] = {}
        engine.on_output = lambda rid, out, t=tokens: (
            t.setdefault(rid, []).append(out.token_id) if out.token_id is not None else None
        )
        for r in reqs:
            engine.add_request(r)
        while engine.has_work:
            engine.step()
        results[draft is not None] = (tokens, engine.runner.speculation)
    (on, policy), (off, _) = results[True], results[False]
    assert on == off
    jsonschema.validate(json.loads(tiny.tokenizer.decode(on["json"])), FLAGS)
    assert policy is not None and policy.counters.accepted > 0
    assert policy.counters.drafted > policy.counters.accepted


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_seeded_sampling_gives_the_same_text_with_a_draft_model(tiny: Any) -> None:
    seeded = [
        GenerationRequest(f"s{i}", looping_prompt(i), 30, SamplingParams(temperature=t, seed=i))
        for i, t in enumerate((0.05, 0.7))
    ]
    off = draft_run(tiny, None, seeded)
    on = draft_run(tiny, tiny, seeded)
    assert on.tokens == off.tokens
    assert on.engine.runner.speculation.counters.accepted > 0


@cpu_only  # token-identical on and off: a CPU guarantee (docs/platforms.md)
def test_a_long_context_catches_up_with_the_draft_model_over_several_steps(tiny: Any) -> None:
    long = looping_prompt(3, 60) * 3  # 180 tokens, 16 a step: a dozen steps to catch up
    reqs = [GenerationRequest("long", long, 40, GREEDY)]
    off = draft_run(tiny, None, reqs)
    driver = Driver(tiny, parallel=2, prompt_cache=False)
    runner = driver.engine.runner
    drafter = runner.drafter = DraftModel(tiny.model, driver.engine.vocab_size, join_budget=16)
    runner.speculation = SpecPolicy("draft", always=True)
    driver.add(*reqs)
    caught_up, fed = [], 0
    while driver.engine.has_work:
        driver.step()
        joining = drafter.joining.get("long")
        if joining is not None:
            assert len(joining.fed) - fed <= 16, "more context than the budget in one step"
            fed = len(joining.fed)
        caught_up.append("long" in drafter.uids)
    assert driver.tokens == off.tokens
    assert caught_up.index(True) >= 180 // 16 - 1, "the whole context ran in one step"
    assert runner.speculation.counters.accepted > 0


def test_a_row_that_opts_out_or_has_no_room_drafts_nothing(tiny: Any) -> None:
    opted = SamplingParams(temperature=0.0, speculative=False)
    reqs = [
        GenerationRequest("out", looping_prompt(1), 12, opted),
        GenerationRequest("in", looping_prompt(2), 12, GREEDY),
    ]
    on = draft_run(tiny, tiny, reqs)
    policy = on.engine.runner.speculation
    assert policy.counters.drafted > 0
    assert "out" not in policy.rows or policy.rows["out"].compared == 0
    assert all(len(t) == 12 for t in on.tokens.values())  # max_tokens held with drafts


def test_the_tokenizer_check_names_the_first_difference(
    tiny: Any, tmp_path: Path, other_draft: Any
) -> None:
    from mlxcel.daemon.models import load_model
    from mlxcel.daemon.models.tiny import make_tiny_model

    check_pair(tiny.tokenizer, other_draft.tokenizer, other_draft.model)  # same tokenizer
    odd = load_model(
        str(make_tiny_model(tmp_path / "odd", "llama", seed=1, added_tokens=("<odd_token>",)))
    )
    with pytest.raises(
        DraftModelError, match=r"tokenizer differs: token .* is id \d+ for the model and id"
    ):
        check_pair(tiny.tokenizer, odd.tokenizer, odd.model)


def test_a_draft_model_that_cannot_draft_is_a_load_error_for_the_daemon_s_model(
    tiny_model_dir: Path, tmp_path: Path, tiny: Any
) -> None:
    from mlxcel.daemon.models import ModelLoadError
    from mlxcel.daemon.models.tiny import make_tiny_model
    from mlxcel.daemon.process.daemon import load_draft

    odd = make_tiny_model(tmp_path / "odd", "llama", seed=1, added_tokens=("<odd_token>",))
    cfg = ServingConfig(model=str(tiny_model_dir), speculative="draft", draft_model=str(odd))
    with pytest.raises(ModelLoadError, match=r"cannot draft for .*tokenizer differs"):
        load_draft(cfg, tiny, str(tiny_model_dir))
    # another model (one the daemon loads on request) falls back to prompt lookup
    assert load_draft(cfg, tiny, "another-model") is None
    cfg = ServingConfig(model=str(tiny_model_dir), draft_model=str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"draft model .*missing"):
        load_draft(cfg, tiny, str(tiny_model_dir))


def test_draft_needs_a_draft_model_and_the_runtime_switch_knows_whether_one_is_loaded(
    tiny: Any,
) -> None:
    with pytest.raises(ConfigError, match="--draft-model"):
        build_config({"speculative": "draft"})
    assert build_config({"speculative": "draft", "draft_model": "x"}).draft_model == "x"
    plain = Driver(tiny, parallel=2, speculative="ngram")
    (change,) = plain.engine.reconfigure({"speculative": "draft"})
    assert not change.applied and "no draft model" in (change.reason or "")
    engine = Engine(
        tiny.model,
        ServingConfig(parallel=2, speculative="draft", draft_model="x"),
        available_bytes=1 << 30,
        draft=tiny.model,
    )
    assert engine.effective.speculative == "draft"
    assert engine.runner.speculation.mode == "draft"
    (change,) = engine.reconfigure({"speculative": "ngram"})
    assert change.applied and engine.runner.speculation.mode == "ngram"
    (change,) = engine.reconfigure({"speculative": "draft"})
    assert change.applied and engine.runner.speculation.mode == "draft"
    # without a draft model (another model of the daemon), `draft` drafts by prompt lookup
    engine = Engine(
        tiny.model,
        ServingConfig(parallel=2, speculative="draft", draft_model="x"),
        available_bytes=1 << 30,
    )
    assert engine.effective.speculative == "ngram"
    assert engine.runner.speculation.mode == "ngram"


def test_a_daemon_drafts_with_its_draft_model_and_answers_as_without(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> None:
    from daemon_helpers import embedded_daemon, http_json

    config = {"parallel": 2, "speculative": "draft", "draft_model": str(tiny_model_dir)}
    with embedded_daemon(tmp_path_factory, tiny_model_dir, **config) as d:
        engine = d.daemon.state.model.runtime.bridge.engine
        assert engine.effective.speculative == "draft"
        # every draft verified, whatever this machine's step times say (the policy's own
        # decision is test_speculative.py's)
        engine.runner.speculation.always = True
        body = {
            "messages": [{"role": "user", "content": "count: one two three one two three"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        answers = []
        for extra in ({"speculative": False}, {}):
            status, _, reply = http_json(d.http_url + "/v1/chat/completions", {**body, **extra})
            assert status == 200, reply
            answers.append(reply["choices"][0]["message"]["content"])
        assert answers[0] == answers[1]
        metrics = _get(d.http_url + "/metrics")
        assert "mlxcel_speculative_accepted_tokens_total" in metrics
        accepted = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("mlxcel_speculative_accepted_tokens_total")
        ]
        assert accepted and accepted[0] > 0, metrics


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()
