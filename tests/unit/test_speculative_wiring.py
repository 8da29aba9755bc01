"""Speculative decoding wired through the product, on a scripted runner (its policy, its
verification step and the runner the engine builds on a model are
tests/integration/test_speculative.py's): the engine's row counts and runtime switch, the
snapshot's counters, /metrics, `status`, the per-request opt-out in every dialect, the
X-Speculative header, and a distributed group (which never speculates)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.runner_api import DecodeOutput, ModelProbe
from mlxcel.daemon.engine.speculative import BREAK_EVEN_EVERY, SpecPolicy
from mlxcel.daemon.engine.stats import EngineStats
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, TokenOutput
from mlxcel.daemon.server.errors import APIError
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.snapshot import Counters
from scripted_engine import KV_BYTES_PER_TOKEN, VOCAB, ScriptedRunner, scripted_token

# -- the engine on a scripted runner that "verifies" ----------------------------------------


class SpeculatingRunner(ScriptedRunner):
    """ScriptedRunner whose decode steps, while it has a policy, are verification steps as
    BatchRunner's are seen from the engine: each row drafts one token and gets it accepted (two
    outputs for its uid, in order) unless its first token ends it; the policy counts them."""

    def __init__(self, chunk: int = 8, mode: str | None = "ngram") -> None:
        super().__init__(chunk)
        self.speculation: SpecPolicy | None = None if mode is None else SpecPolicy(mode)
        self.rows_per_step: list[int] = []  # rows each decode step computed

    def decode(self, hold: bool = False) -> list[DecodeOutput]:
        policy = self.speculation
        if hold or not self._decoding:
            return []
        self.rows_per_step.append(len(self._decoding))
        if policy is None:
            return super().decode(hold)
        self.forwards += 1
        outs: list[DecodeOutput] = []
        for row in list(self._decoding):
            out = self._sample(row)
            outs.append(out)
            accepted = 0
            if out.finish_reason is None:
                out = self._sample(row)
                outs.append(out)
                accepted = 1
            policy.record(row.spec.uid, 1, accepted)
            if out.finish_reason is not None:
                self._decoding.remove(row)
        policy.counters.steps += 1
        return outs


def engine_on(runner: Any, can_batch: bool = True, **config: Any) -> Engine:
    return Engine(
        None,
        ServingConfig(**config),
        can_batch=can_batch,
        available_bytes=1 << 24,
        runner=runner,
        probe=ModelProbe(KV_BYTES_PER_TOKEN, VOCAB),
    )


def run(engine: Engine, requests: dict[str, int]) -> dict[str, list[TokenOutput]]:
    """`requests` (id -> max_tokens) to the end; each one's outputs."""
    outputs: dict[str, list[TokenOutput]] = {}
    engine.on_output = lambda rid, out: outputs.setdefault(rid, []).append(out)
    for rid, max_tokens in requests.items():
        prompt = tuple(range(1, 12 + len(rid)))
        engine.add_request(GenerationRequest(rid, prompt, max_tokens, GREEDY))
    for _ in range(200):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work
    return outputs


def test_a_verification_step_gives_rows_several_tokens_and_counts_each_row_once() -> None:
    runner = SpeculatingRunner()
    engine = engine_on(runner, parallel=2, max_batch_prefill=2)
    outputs = run(engine, {"a": 9, "b": 7})
    for rid, max_tokens in (("a", 9), ("b", 7)):
        tokens = [o.token_id for o in outputs[rid]]
        assert tokens == [scripted_token(rid, n) for n in range(max_tokens)]
        assert outputs[rid][-1].finish_reason == "length"
    assert max(runner.rows_per_step) == 2  # the two rows verified together
    stats = engine.stats
    # rows, not outputs: a verification step's row gave two of them
    assert stats.decode_rows == sum(runner.rows_per_step) < stats.generation_tokens - 2
    assert stats.decode_steps == len(runner.rows_per_step)
    c = engine.snapshot().counters
    policy = runner.speculation
    assert policy is not None and c.spec_steps == policy.counters.steps > 0
    assert (c.spec_rows, c.spec_drafted, c.spec_accepted) == (
        policy.counters.rows,
        policy.counters.drafted,
        policy.counters.accepted,
    )
    assert c.spec_tokens_per_step == (c.spec_rows + c.spec_accepted) / c.spec_rows > 1.5
    assert engine.snapshot().config.speculative == "ngram"


def test_speculative_switches_at_runtime_and_its_counters_never_go_back() -> None:
    runner = SpeculatingRunner()
    engine = engine_on(runner, parallel=2)
    run(engine, {"a": 6})
    first = runner.speculation
    assert first is not None
    done = engine.snapshot().counters
    assert done.spec_steps > 0

    [same] = engine.reconfigure({"speculative": "ngram"})
    assert same.applied and runner.speculation is first  # its measurements are kept

    [off] = engine.reconfigure({"speculative": "OFF"})
    assert (off.applied, off.previous, off.effective) == (True, "ngram", "off")
    assert runner.speculation is None and engine.snapshot().config.speculative == "off"
    run(engine, {"b": 6})
    plain = engine.snapshot().counters
    assert (plain.spec_steps, plain.spec_accepted) == (done.spec_steps, done.spec_accepted)

    [on] = engine.reconfigure({"speculative": "ngram"})
    assert on.applied and runner.speculation is not None and runner.speculation is not first
    run(engine, {"c": 6})
    again = engine.snapshot().counters
    assert again.spec_steps == done.spec_steps + runner.speculation.counters.steps
    assert again.spec_steps > done.spec_steps

    [bad] = engine.reconfigure({"speculative": "eagle"})
    assert not bad.applied and "speculative must be one of off, ngram" in (bad.reason or "")
    assert engine.snapshot().config.speculative == "ngram"


def test_speculative_off_at_start_and_a_family_that_cannot_batch() -> None:
    runner = SpeculatingRunner(mode=None)
    engine = engine_on(runner, speculative="off")
    assert engine.snapshot().config.speculative == "off"
    run(engine, {"a": 5})
    assert engine.snapshot().counters.spec_steps == 0
    assert engine.stats.decode_rows == sum(runner.rows_per_step)

    solo = SpeculatingRunner(mode=None)  # as SoloRunner: the member, always None
    engine = engine_on(solo, can_batch=False, parallel=1)
    assert engine.snapshot().config.speculative == "off"  # asked ngram (the default)
    [change] = engine.reconfigure({"speculative": "ngram"})
    assert change.effective == "off" and "stays off" in (change.reason or "")
    assert solo.speculation is None


def test_a_runner_without_the_member_never_speculates() -> None:
    runner = ScriptedRunner(8)
    engine = engine_on(runner)
    run(engine, {"a": 4})
    assert not hasattr(runner, "speculation")
    [change] = engine.reconfigure({"speculative": "off"})
    assert change.applied and not hasattr(runner, "speculation")
    assert engine.snapshot().counters.spec_steps == 0


def test_counters_go_on_across_an_engine_the_watchdog_replaced() -> None:
    """The bridge hands the old engine's stats to the fresh one (bridge.py): the fresh
    runner's new policy adds to what the old one counted."""
    old_runner = SpeculatingRunner()
    old = engine_on(old_runner)
    run(old, {"a": 6})
    before = old.snapshot().counters.spec_steps
    assert before > 0
    fresh_runner = SpeculatingRunner()
    fresh = engine_on(fresh_runner)
    fresh.stats = old.stats
    fresh._publish()
    assert fresh.snapshot().counters.spec_steps == before
    run(fresh, {"b": 6})
    after = fresh.snapshot().counters.spec_steps
    assert after == before + fresh_runner.speculation.counters.steps > before


def test_stats_add_a_replaced_policys_counts_once() -> None:
    stats = EngineStats(lambda: 0.0)
    first, second = SpecPolicy(), SpecPolicy()
    first.counters.steps, first.counters.rows = 3, 6
    stats.observe_speculation(first)
    stats.observe_speculation(first)  # the same policy: nothing added twice
    assert stats.counters().spec_steps == 3
    first.counters.steps = 4  # counting on while it is the runner's
    stats.observe_speculation(None)
    assert (stats.counters().spec_steps, stats.counters().spec_rows) == (4, 6)
    second.counters.steps = 2
    stats.observe_speculation(second)
    assert stats.counters().spec_steps == 6


def test_stats_carry_the_policys_break_even_estimate() -> None:
    stats = EngineStats(lambda: 0.0)
    policy = SpecPolicy()
    stats.observe_speculation(policy)
    assert stats.counters().spec_break_even_rows is None  # nothing timed yet
    # one row's plain step 10 ms; a drafted token adds 1 ms a row, 2 ms from 4 rows on
    policy.plain.update({1: 0.010, 4: 0.012, 8: 0.014})
    policy.extra.update({1: 0.001, 4: 0.002, 8: 0.002})
    policy.counters.drafted, policy.counters.accepted = 100, 80
    policy.counters.steps = BREAK_EVEN_EVERY
    stats.observe_speculation(policy)
    expected = policy.measured_break_even()
    assert expected is not None and 1 <= expected < 64
    assert stats.counters().spec_break_even_rows == expected
    policy.counters.accepted = 5  # verification hardly ever pays now
    policy.counters.steps += 1
    stats.observe_speculation(policy)  # not recomputed before BREAK_EVEN_EVERY more steps
    assert stats.counters().spec_break_even_rows == expected
    policy.counters.steps += BREAK_EVEN_EVERY
    stats.observe_speculation(policy)
    assert stats.counters().spec_break_even_rows == policy.measured_break_even() < expected
    stats.observe_speculation(None)  # speculation switched off
    assert stats.counters().spec_break_even_rows is None


# -- the snapshot's derived figures, status, the console's note ------------------------------


def test_counters_derive_acceptance_and_tokens_per_step() -> None:
    none = Counters()
    assert none.spec_acceptance is None and none.spec_tokens_per_step is None
    c = Counters(spec_steps=10, spec_rows=20, spec_drafted=50, spec_accepted=39)
    assert c.spec_acceptance == pytest.approx(0.78)
    assert c.spec_tokens_per_step == pytest.approx(59 / 20)
    assert "spec_acceptance" not in c.to_dict()  # derived: not on the wire
    assert Counters.from_dict(c.to_dict()) == c


def test_status_and_the_console_show_speculation() -> None:
    from mlxcel.daemon.cli.control_commands import speculative_line
    from mlxcel.tui.format import engine_notes, spec_note

    c = Counters(spec_steps=1204, spec_rows=2408, spec_drafted=6000, spec_accepted=4680)
    assert speculative_line("ngram", c) == (
        "ngram, 78% accepted, 2.9 tokens per verification step, 1204 verification steps"
    )
    assert speculative_line("ngram", Counters()) == "ngram, no verification step yet"
    assert speculative_line("off", Counters()) == "off"
    assert spec_note(c) == "spec 78% · 2.9 tok/step"
    assert spec_note(Counters()) == ""
    assert engine_notes(Counters(preemptions=2)) == "2 preempted"
    assert engine_notes(Counters(preemptions=2, **{k: getattr(c, k) for k in SPEC})) == (
        "2 preempted · spec 78% · 2.9 tok/step"
    )


SPEC = ("spec_steps", "spec_rows", "spec_drafted", "spec_accepted")


# -- /metrics --------------------------------------------------------------------------------


def metrics_text(counters: Counters) -> str:
    from mlxcel.daemon.server.metrics import DaemonMetrics
    from tui_fakes import make_snapshot

    engine = replace(make_snapshot(False).engine, counters=counters)
    return DaemonMetrics(lambda: engine).render().decode()


def samples(text: str) -> dict[str, tuple[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.name: (f.type, s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("mlxcel_speculative")
    }


def test_metrics_export_the_speculation_counters_and_gauges() -> None:
    c = Counters(
        spec_steps=10, spec_rows=20, spec_drafted=50, spec_accepted=39, spec_break_even_rows=3
    )
    got = samples(metrics_text(c))
    assert got == {
        "mlxcel_speculative_break_even_rows": ("gauge", 3),
        "mlxcel_speculative_steps_total": ("counter", 10),
        "mlxcel_speculative_draft_tokens_total": ("counter", 50),
        "mlxcel_speculative_accepted_tokens_total": ("counter", 39),
        "mlxcel_speculative_acceptance_ratio": ("gauge", pytest.approx(0.78)),
        "mlxcel_speculative_tokens_per_step": ("gauge", pytest.approx(59 / 20)),
    }
    idle = samples(metrics_text(Counters()))
    assert idle["mlxcel_speculative_acceptance_ratio"] == ("gauge", 0)
    assert idle["mlxcel_speculative_tokens_per_step"] == ("gauge", 0)
    assert idle["mlxcel_speculative_steps_total"] == ("counter", 0)
    assert "mlxcel_speculative_break_even_rows" not in idle  # not measured: absent, not 0
    never_pays = samples(metrics_text(Counters(spec_break_even_rows=0)))
    assert never_pays["mlxcel_speculative_break_even_rows"] == ("gauge", 0)


# -- the per-request opt-out: body fields, the header ----------------------------------------

MSG = [{"role": "user", "content": "hi"}]


def test_the_body_field_reaches_the_sampling_params() -> None:
    from mlxcel.daemon.server.generation import sampling_params
    from mlxcel.daemon.server.openai_schema import parse_chat_request, parse_completion_request

    chat = parse_chat_request({"messages": MSG, "speculative": False}, strict=True)
    assert chat.options.speculative is False
    assert sampling_params(chat.options).speculative is False
    default = parse_chat_request({"messages": MSG}, strict=True)
    assert default.options.speculative is None and sampling_params(default.options).speculative
    completion = parse_completion_request({"prompt": "x", "speculative": True}, strict=True)
    assert completion.options.speculative is True
    for body in ({"messages": MSG, "speculative": "no"}, {"messages": MSG, "speculative": 0}):
        with pytest.raises(APIError) as err:
            parse_chat_request(body)
        assert (err.value.status, err.value.param) == (400, "speculative")
        assert "'speculative' must be a boolean" in err.value.message


def test_the_other_dialects_pass_the_field_on() -> None:
    from mlxcel.daemon.server import anthropic_api, ollama_api, responses_api
    from mlxcel.daemon.server.response_store import ResponseStore

    body = {"max_tokens": 5, "messages": MSG, "speculative": False}
    assert anthropic_api.to_openai_body(body)["speculative"] is False
    assert "speculative" in anthropic_api.KNOWN_FIELDS
    plan = responses_api.plan_request({"input": "hi", "speculative": False}, ResponseStore())
    assert plan.chat_body["speculative"] is False
    assert "speculative" in responses_api.KNOWN_FIELDS
    assert ollama_api._options({"options": {"speculative": False}}) == {"speculative": False}


def build(headers: dict[str, str], speculative: bool | None) -> Any:
    """The engine request `build_request` makes under `policy_middleware` for a request with
    `headers` whose body's `speculative` is `speculative`."""
    from mlxcel.daemon.server.completions import build_request
    from mlxcel.daemon.server.openai_schema import GenerationOptions
    from mlxcel.daemon.server.request_policy import policy_middleware

    built: list[GenerationRequest] = []
    ctx: Any = SimpleNamespace(vocab_size=VOCAB, eos_ids=frozenset({2}))
    options = GenerationOptions(max_tokens=4, speculative=speculative)

    async def handler(request: web.Request) -> web.StreamResponse:
        built.append(build_request(ctx, "r", [1, 2, 3], options))
        return web.Response()

    async def go() -> None:
        request = make_mocked_request("POST", "/v1/completions", headers=headers)
        await policy_middleware(request, handler)

    asyncio.run(go())
    return built[0]


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({}, None, True),
        ({"X-Speculative": "off"}, None, False),
        ({"X-Speculative": "OFF"}, None, False),
        ({"X-Speculative": "on"}, None, True),
        ({"X-Speculative": "off"}, True, True),  # the body's field wins
        ({"X-Speculative": "on"}, False, False),
        ({}, False, False),
    ],
)
def test_the_header_opts_a_request_out_unless_the_body_says(
    headers: dict[str, str], body: bool | None, expected: bool
) -> None:
    assert build(headers, body).sampling.speculative is expected


def test_a_bad_header_is_a_400_naming_it() -> None:
    with pytest.raises(APIError) as err:
        build({"X-Speculative": "maybe"}, None)
    assert (err.value.status, err.value.param) == (400, "X-Speculative")
    assert "X-Speculative: must be on or off, got 'maybe'" in err.value.message


# -- the distributed group -----------------------------------------------------------------


def test_a_group_runs_and_stays_without_speculation() -> None:
    from mlxcel.daemon.distributed.group_engine import DistributedEngine
    from mlxcel.daemon.distributed.launch import group_config

    assert group_config(ServingConfig(), "tensor").speculative == "off"
    assert group_config(ServingConfig(), "pipeline").speculative == "off"
    engine = DistributedEngine.__new__(DistributedEngine)  # only its reconfigure is tried
    events: list[tuple[str, dict[str, Any]]] = []
    engine.mode, engine.on_event = "tensor", lambda name, data: events.append((name, data))
    [refused] = engine.reconfigure({"speculative": "ngram"})
    assert not refused.applied and refused.effective == "off"
    assert "every rank must run the same steps" in (refused.reason or "")
    assert events and events[0][1]["key"] == "speculative"
