"""Loads the default model twice, from its converted directory and from its source GGUF; prints
one JSON object keyed `dir` and `gguf`, each with the model's source, a chat prompt's ids and
its 20 greedy tokens, and a second prompt's ids with its last-position logits.

Usage: models_e2e_compare.py MODEL_DIR GGUF_FILE
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlxcel.daemon.models import LoadedModel, load_model


def chat(loaded: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def greedy(loaded: LoadedModel, ids: list[int]) -> list[int]:
    steps = generate_step(mx.array(ids), loaded.model, max_tokens=20)
    return [int(token) for token, _ in steps]


def main(model_dir: str, gguf: str) -> None:
    result: dict[str, dict[str, Any]] = {}
    for key, spec in (("dir", model_dir), ("gguf", gguf)):
        loaded = load_model(spec)
        ids = chat(loaded, "What is the capital of France?")
        haiku = chat(loaded, "Write a haiku about the sea.")
        logits = loaded.model(mx.array([haiku]))[0, -1]
        result[key] = {
            "source": loaded.info.source,
            "ids": ids,
            "tokens": greedy(loaded, ids),
            "haiku": haiku,
            "logits": logits.tolist(),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
