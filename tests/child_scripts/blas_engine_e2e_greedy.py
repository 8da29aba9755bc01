"""Four chat questions as one batch through the engine on a float32 model, 16 greedy tokens
each; prints one JSON object: the BLAS in use and each request's tokens
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

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "Why is the sky blue? Answer briefly.",
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
    for i, question in enumerate(QUESTIONS):
        ids = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        engine.add_request(GenerationRequest(f"q{i}", tuple(ids), 16, GREEDY))
    while engine.has_work:
        engine.step()
    print(json.dumps({"blas": blas_name(), "tokens": tokens}))


if __name__ == "__main__":
    main(sys.argv[1])
