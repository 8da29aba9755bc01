"""Four plain-text prompts as one batch through the engine on a float32 model, 16 greedy tokens
each (no chat template: its ~30-token system prompt per row is most of the reference BLAS's
time); prints one JSON object: the BLAS in use and each request's tokens
(`{"blas": "openblas", "tokens": {"q0": [...], ...}}`).

Usage: blas_engine_e2e_greedy.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys

from mlxcel.daemon.engine.core import Engine
from mlxcel.daemon.engine.types import GREEDY, GenerationRequest, TokenOutput
from mlxcel.daemon.forward.blas import blas_name
from mlxcel.daemon.models import load_model
from mlxcel.shared.config import ServingConfig

PROMPTS = [
    "The capital of France is",
    "The three primary colours are",
    "Once upon a time, by the sea,",
    "The sky is blue because",
]


def main(model_dir: str) -> None:
    loaded = load_model(model_dir, dtype="float32")
    info = loaded.info
    cfg = ServingConfig(parallel=4, max_batch_prefill=4, prefill_chunk_size=32, prompt_cache=False)
    engine = Engine(
        loaded.model,
        cfg,
        info.can_batch,
        info.batch_reason,
        info.context_length,
        available_bytes=1 << 30,
    )
    tokens: dict[str, list[int]] = {}

    def on_output(rid: str, out: TokenOutput) -> None:
        if out.token_id is not None:
            tokens.setdefault(rid, []).append(out.token_id)

    engine.on_output = on_output
    for i, prompt in enumerate(PROMPTS):
        ids = loaded.tokenizer.encode(prompt)
        engine.add_request(GenerationRequest(f"q{i}", tuple(ids), 16, GREEDY))
    while engine.has_work:
        engine.step()
    print(json.dumps({"blas": blas_name(), "tokens": tokens}))


if __name__ == "__main__":
    main(sys.argv[1])
