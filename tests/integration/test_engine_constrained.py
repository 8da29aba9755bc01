"""JSON-schema constrained decoding in the real engine: grammar masks per row inside the batched
step (tiny random-weight models, whose free choice would never be JSON) and refusals of schemas
the grammar library cannot compile; the run on the real default model is tests/e2e/
test_engine_e2e.py's."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from constrained_engine import FLAGS, check_json, constrained, make_engine, run, tokens
from mlxcel.daemon.engine.bridge import EngineBridge
from mlxcel.daemon.engine.constraints import MAX_SCHEMA_CHARS
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import (
    AdmissionRejected,
    GenerationRequest,
    SamplingParams,
    TokenOutput,
)
from mlxcel.shared.config import ServingConfig

TAGS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
GREEDY = SamplingParams(temperature=0.0)


def prompt(seed: int, n: int = 20) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randrange(1, 300) for _ in range(n))


def mixed_requests(eos: frozenset[int]) -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    hot = SamplingParams(temperature=0.9, seed=5)
    asks = SamplingParams(temperature=0, top_logprobs=3)
    free = [
        GenerationRequest("free0", prompt(0), 24, GREEDY, eos),
        GenerationRequest("free1", prompt(1, 45), 24, GREEDY, eos),
        GenerationRequest("free2", prompt(2, 7), 24, hot, eos),
        GenerationRequest("logp", prompt(3), 24, asks, eos),
    ]
    schema_rows = [
        GenerationRequest("json0", prompt(4), 120, constrained(FLAGS), eos),
        GenerationRequest("json1", prompt(5, 33), 120, constrained(TAGS), eos),
        GenerationRequest(
            "json2", prompt(6), 120, constrained(FLAGS, temperature=1.0, seed=2), eos
        ),
        GenerationRequest("json3", prompt(7), 120, constrained(TAGS, top_logprobs=2), eos),
    ]
    return free, schema_rows


@pytest.mark.parametrize("split_head", [True, False])
def test_eight_mixed_rows_batch_together(tiny: Any, split_head: bool) -> None:
    eos = frozenset(tiny.tokenizer.eos_token_ids)
    free, schema_rows = mixed_requests(eos)
    engine = make_engine(tiny, split_head, prefill_chunk_size=64)
    outs, busiest = run(engine, free + schema_rows)
    assert busiest == 8  # constrained and free rows in one batch
    for r in schema_rows:
        schema = FLAGS if r.request_id in ("json0", "json2") else TAGS
        check_json(tiny, outs[r.request_id], schema)
    assert all(len(o.top_logprobs) <= 2 for o in outs["json3"])
    assert all(o.logprob is not None for o in outs["json3"] if o.token_id is not None)
    alone, _ = run(make_engine(tiny, split_head, prefill_chunk_size=16), free)
    for r in free:  # token-identical to a run without the constrained rows
        assert tokens(outs[r.request_id]) == tokens(alone[r.request_id])
    assert all(len(tokens(outs[rid])) == 24 for rid in ("free0", "free1", "logp"))


def test_unconstrained_the_model_writes_no_json(tiny: Any) -> None:
    eos = frozenset(tiny.tokenizer.eos_token_ids)
    outs, _ = run(make_engine(tiny), [GenerationRequest("a", prompt(4), 40, GREEDY, eos)])
    with pytest.raises(ValueError):
        json.loads(tiny.tokenizer.decode(tokens(outs["a"])))


def test_solo_runner_constrained(tiny_solo: Any) -> None:
    eos = frozenset(tiny_solo.tokenizer.eos_token_ids)
    requests = [
        GenerationRequest("a", prompt(8), 120, constrained(FLAGS), eos),
        GenerationRequest("b", prompt(9), 120, constrained(TAGS, temperature=0.7, seed=1), eos),
    ]
    outs, _ = run(make_engine(tiny_solo), requests)
    check_json(tiny_solo, outs["a"], FLAGS)
    check_json(tiny_solo, outs["b"], TAGS)


def test_max_tokens_cuts_a_constrained_row(tiny: Any) -> None:
    outs, _ = run(make_engine(tiny), [GenerationRequest("a", prompt(4), 3, constrained(FLAGS))])
    assert outs["a"][-1].finish_reason == "length"
    assert tiny.tokenizer.decode(tokens(outs["a"])).startswith("{")


def test_one_schema_compiles_once(tiny: Any) -> None:
    engine = make_engine(tiny)
    requests = [GenerationRequest(f"r{i}", prompt(i), 60, constrained(FLAGS)) for i in range(3)]
    for r in requests:
        engine.check_admission(r, 0)  # what bridge.submit does, on the loop thread
    assert engine.grammars.compiles == 1
    outs, _ = run(engine, requests)
    assert engine.grammars.compiles == 1  # the engine thread only copies the compiled matcher
    assert all(outs[r.request_id][-1].finish_reason == "stop" for r in requests)


BAD_SCHEMAS = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"type": "frobnicate"}), "frobnicate"),
    (json.dumps({"$ref": "#/$defs/missing"}), "missing"),
    (json.dumps({"type": "object", "minProperties": 3, "maxProperties": 1}), "cannot be compiled"),
    (json.dumps({"enum": ["x" * 40] * (MAX_SCHEMA_CHARS // 40)}), "characters"),
]


@pytest.mark.parametrize(
    ("schema", "problem"), BAD_SCHEMAS, ids=[problem for _, problem in BAD_SCHEMAS]
)
async def test_a_bad_schema_is_refused_before_queuing(tiny: Any, schema: str, problem: str) -> None:
    bridge = EngineBridge(make_engine(tiny))
    bridge.start()
    try:
        bad = GenerationRequest("bad", prompt(1), 8, SamplingParams(json_schema=schema))
        with pytest.raises(AdmissionRejected) as err:
            bridge.submit(bad)
        assert err.value.reason == "invalid_request" and err.value.http_status == 400
        assert "json_schema" in err.value.message and problem in err.value.message
        # the engine keeps serving
        good = bridge.submit(GenerationRequest("ok", prompt(2), 40, constrained(FLAGS)))
        outs = await asyncio.wait_for(_collect(good), 60)
        check_json(tiny, outs, FLAGS)
    finally:
        await bridge.shutdown(drain=False)


async def _collect(stream: Any) -> list[TokenOutput]:
    return [out async for out in stream]


async def test_submit_compiles_outside_the_lock_the_engine_thread_takes(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big schema compiling in submit must not hold the bridge's lock: the engine thread
    takes it every step, so every running row would wait."""
    from mlxcel.daemon.engine.constraints import GrammarCache

    bridge = EngineBridge(make_engine(tiny))
    held: list[bool] = []
    build = GrammarCache._build

    def noting(self: GrammarCache, schema: str) -> Any:
        held.append(bridge._cond._is_owned())  # type: ignore[attr-defined]
        return build(self, schema)

    monkeypatch.setattr(GrammarCache, "_build", noting)
    bridge.start()
    try:
        stream = bridge.submit(GenerationRequest("a", prompt(3), 40, constrained(TAGS)))
        check_json(tiny, await asyncio.wait_for(_collect(stream), 60), TAGS)
        with pytest.raises(AdmissionRejected):
            bridge.submit(GenerationRequest("b", prompt(3), 8, SamplingParams(json_schema="[")))
        with pytest.raises(AdmissionRejected):  # a refusal is cached: not compiled again
            bridge.submit(GenerationRequest("c", prompt(3), 8, SamplingParams(json_schema="[")))
    finally:
        await bridge.shutdown(drain=False)
    assert held == [False, False]


def test_without_a_tokenizer_a_schema_is_refused(tiny: Any) -> None:
    engine = Engine(tiny.model, ServingConfig(), available_bytes=1 << 30)
    with pytest.raises(AdmissionRejected) as err:
        engine.check_admission(GenerationRequest("x", (1, 2), 4, constrained(FLAGS)), 0)
    assert "tokenizer" in err.value.message
