"""JSON-schema constrained decoding through the real engine (daemon/engine/constraints.py):
`FLAGS`, a small object schema; `constrained` (sampling under a schema), `make_engine` (an
engine with the model's tokenizer, for grammars), `run` (requests to the end: each one's
outputs), `check_json` (the output parses and validates). Used by tests/integration/
test_engine_constrained.py, test_speculative*.py and tests/e2e/test_engine_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GenerationRequest, SamplingParams, TokenOutput
from mlxcel.shared.config import ServingConfig

FLAGS = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}


def make_engine(model: Any, split_head: bool = True, **config: Any) -> Engine:
    cfg = {"parallel": 8, "max_batch_prefill": 8, "prompt_cache": False, **config}
    return Engine(
        model.model,
        ServingConfig(**cfg),
        can_batch=model.info.can_batch,
        batch_reason=model.info.batch_reason,
        context_length=model.info.context_length,
        available_bytes=1 << 30,
        split_head=split_head,
        tokenizer=model.tokenizer,
    )


def run(engine: Engine, requests: list[GenerationRequest]) -> tuple[dict, int]:
    """Outputs per request, and the most rows busy at once."""
    outs: dict[str, list[TokenOutput]] = {}
    engine.on_output = lambda rid, out: outs.setdefault(rid, []).append(out)
    for r in requests:
        engine.add_request(r)
    busiest = 0
    for _ in range(5000):
        if not engine.has_work:
            return outs, busiest
        engine.step()
        busiest = max(busiest, sum(s.state != "idle" for s in engine.snapshot().slots))
    raise AssertionError("the engine did not finish")


def tokens(outs: list[TokenOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def constrained(schema: dict, **sampling: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **sampling}, json_schema=json.dumps(schema))


def check_json(model: Any, outs: list[TokenOutput], schema: dict) -> Any:
    assert outs[-1].finish_reason == "stop", outs[-1]
    value = json.loads(model.tokenizer.decode(tokens(outs)))
    jsonschema.validate(value, schema)
    return value
