"""The engine on the real SmolLM2: batched chunked greedy output equals each request alone, a
prompt-cache hit equals a cold run (the chat template's system prompt, under one block,
included), packed steps equal two forwards, and a JSON-schema constrained request writes a
valid object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import constrained_engine
import pytest
from blas_process import run_with_fast_blas
from constrained_engine import check_json, constrained
from engine_checks import check_native_packed_run, cold, req
from engine_driver import Driver
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, TokenOutput
from mlxcel.daemon.models import load_model
from mlxcel.shared.config import ServingConfig
from platform_marks import cpu_only
from repo_paths import TESTS

QUESTIONS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three primary colors, please, and say which one you like best and why.",
    "How many legs does a spider have?",
)


@pytest.fixture(scope="module")
def smollm(default_model_dir: Path) -> Any:
    return load_model(str(default_model_dir))


def prompt_ids(smollm: Any, question: str) -> tuple[int, ...]:
    messages = [{"role": "user", "content": question}]
    ids = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tuple(ids)


def run(smollm: Any, requests: list[GenerationRequest], **config: Any) -> tuple[dict, dict]:
    engine = Engine(
        smollm.model,
        ServingConfig(**config),
        can_batch=smollm.info.can_batch,
        context_length=smollm.info.context_length,
    )
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals: dict[str, TokenOutput] = {}

    def on_output(rid: str, out: TokenOutput) -> None:
        if out.token_id is not None:
            tokens[rid].append(out.token_id)
        if out.finished:
            finals[rid] = out

    engine.on_output = on_output
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    return tokens, finals


@cpu_only  # bit-exact batched == alone: a CPU guarantee (docs/platforms.md)
def test_batched_equals_alone_and_cache_hit_equals_cold(smollm: Any) -> None:
    eos = frozenset(smollm.info.eos_token_ids)
    requests = [
        GenerationRequest(f"q{i}", prompt_ids(smollm, q), 12, GREEDY, eos)
        for i, q in enumerate(QUESTIONS)
    ]
    batched, _ = run(smollm, requests, parallel=4, max_batch_prefill=4, prefill_chunk_size=16)
    for r in requests:
        alone, _ = run(smollm, [r], parallel=1, prompt_cache=False)
        assert batched[r.request_id] == alone[r.request_id], smollm.tokenizer.decode(
            batched[r.request_id]
        )
    assert "Paris" in smollm.tokenizer.decode(batched["q0"])

    # a second turn reuses the first turn's KV from the prompt cache
    first = requests[2]
    follow_ids = first.prompt_ids + tuple(batched["q2"]) + prompt_ids(smollm, "And why?")[1:]
    follow = GenerationRequest("f", follow_ids, 8, GREEDY, eos)
    engine_tokens, finals = run(smollm, [first, follow], parallel=1)
    assert finals["f"].cached_tokens >= 32
    cold, cold_finals = run(smollm, [follow], parallel=1, prompt_cache=False)
    assert cold_finals["f"].cached_tokens == 0
    assert engine_tokens["f"] == cold["f"]


@cpu_only  # bit-exact batched == alone: a CPU guarantee (docs/platforms.md)
def test_packed_steps_equal_two_forwards_and_alone_at_parallel_8(smollm: Any) -> None:
    """Eight chat requests arriving in two waves (the second wave's prefill rides the first's
    decode steps), with a 40-token step budget: packed == two forwards == each alone."""
    eos = frozenset(smollm.info.eos_token_ids)
    questions = QUESTIONS + tuple(f"{q} Answer briefly." for q in QUESTIONS)
    requests = [
        GenerationRequest(f"p{i}", prompt_ids(smollm, q), 8, GREEDY, eos)
        for i, q in enumerate(questions)
    ]
    alone = {
        r.request_id: run(smollm, [r], parallel=1, prompt_cache=False)[0][r.request_id]
        for r in requests
    }
    for packed in (True, False):
        engine = make_engine(smollm, packed, parallel=8, max_batch_prefill=4, prefill_chunk_size=40)
        tokens = drive_in_waves(engine, requests, wave=4, gap=2)
        assert tokens == alone, packed
        assert (engine.runner.num_packed_steps > 0) == packed


@cpu_only
def test_packed_steps_on_the_native_steps_equal_alone_on_smollm2(default_model_dir: Path) -> None:
    """In a process with the daemon's BLAS setup: SmolLM2's packed steps run the native decode
    step and the native chunk step (right-padded cohort chunks included), at parallel 8 under
    two step budgets, and every request's greedy tokens equal its tokens alone."""
    script = TESTS / "child_scripts" / "engine_packed_native.py"
    out = run_with_fast_blas(script, str(default_model_dir), "40,512", timeout=600)
    check_native_packed_run(out)


def make_engine(smollm: Any, packed: bool, **config: Any) -> Engine:
    return Engine(
        smollm.model,
        ServingConfig(**config),
        can_batch=smollm.info.can_batch,
        context_length=smollm.info.context_length,
        packed=packed,
    )


def drive_in_waves(
    engine: Engine, requests: list[GenerationRequest], wave: int, gap: int
) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}

    def on_output(rid: str, out: TokenOutput) -> None:
        if out.token_id is not None:
            tokens[rid].append(out.token_id)

    engine.on_output = on_output
    for start in range(0, len(requests), wave):
        for r in requests[start : start + wave]:
            engine.add_request(r)
        for _ in range(gap):
            engine.step()
    while engine.has_work:
        engine.step()
    return tokens


def test_smollm_chat_template_system_prompt_is_reused_and_equals_a_cold_run(
    smollm: Any,
) -> None:
    eos = frozenset(smollm.info.eos_token_ids)

    def chat(question: str) -> tuple[int, ...]:
        messages = [{"role": "user", "content": question}]
        return tuple(smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    prompts = [chat(q) for q in ("What is the capital of France?", "Name a blue fruit.")]
    shared = next(i for i, (x, y) in enumerate(zip(*prompts, strict=False)) if x != y)
    assert 16 <= shared < 32  # the template's default system prompt: under one block
    requests = [req(f"s{i}", p, 10, eos) for i, p in enumerate(prompts)]
    r = Driver(smollm, parallel=2, prefill_chunk_size=16)
    for q in requests:
        r.add(q).run()
    assert [r.finals[q.request_id].cached_tokens for q in requests] == [0, shared]
    for q in requests:
        assert r.tokens[q.request_id] == cold(smollm, q)


def test_smollm2_writes_a_valid_object(default_model_dir: Path) -> None:
    model = load_model(str(default_model_dir))
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "indoor": {"type": "boolean"},
        },
        "required": ["name", "age", "indoor"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Describe a pet cat as JSON: name, age, indoor."}]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    eos = frozenset(model.tokenizer.eos_token_ids)
    request = GenerationRequest("cat", tuple(ids), 100, constrained(schema), eos)
    outs, _ = constrained_engine.run(constrained_engine.make_engine(model), [request])
    value = check_json(model, outs["cat"], schema)
    assert value["name"]
