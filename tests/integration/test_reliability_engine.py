"""The engine survives a request whose sampler fails (docs/reliability.md), on the tiny model.

The HTTP layer keeps such values out (top_k at or over the vocabulary is treated as off); this
is the layer below it: a sampler that raises inside `mx.compile` must not leave MLX's global
random state unusable for every later unseeded request.
"""

from __future__ import annotations

from typing import Any

import pytest
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import (
    FINISH_ERROR,
    FINISH_LENGTH,
    GenerationRequest,
    SamplingParams,
    TokenOutput,
)
from mlxcel.shared.config import ServingConfig


def run(engine: Engine, *requests: GenerationRequest) -> dict[str, TokenOutput]:
    finals: dict[str, TokenOutput] = {}

    def on_output(rid: str, out: TokenOutput) -> None:
        if out.finished:
            finals[rid] = out

    engine.on_output = on_output
    for r in requests:
        engine.add_request(r)
    for _ in range(500):
        if not engine.has_work:
            return finals
        engine.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("seed", [None, 7])
def test_a_failing_sampler_leaves_later_requests_working(tiny: Any, seed: int | None) -> None:
    engine = Engine(
        tiny.model,
        ServingConfig(parallel=2),
        can_batch=True,
        context_length=tiny.info.context_length,
        available_bytes=1 << 30,
    )
    prompt = (5, 6, 7, 8, 9)
    poison = SamplingParams(temperature=1.0, top_k=10**6, seed=seed)  # mlx-lm raises on it
    finals = run(engine, GenerationRequest("bad", prompt, 4, poison))
    assert finals["bad"].finish_reason == FINISH_ERROR and finals["bad"].error
    assert engine.num_running == 0 and engine.kv.num_used == 0
    # Unseeded sampling draws from MLX's global random state: it must still work.
    later = run(
        engine,
        GenerationRequest("sampled", prompt, 6, SamplingParams(temperature=1.0)),
        GenerationRequest("top_k", prompt, 6, SamplingParams(temperature=0.8, top_k=5)),
        GenerationRequest("greedy", prompt, 6, SamplingParams(temperature=0.0)),
    )
    assert {rid: out.finish_reason for rid, out in later.items()} == {
        "sampled": FINISH_LENGTH,
        "top_k": FINISH_LENGTH,
        "greedy": FINISH_LENGTH,
    }, {rid: out.error for rid, out in later.items()}
