"""Greedy decoding of a list of conversations, first with stock mlx-lm on a plain float32
directory, then with mlxcel's loader on the model (the fused CPU forward unless
MLXCEL_NO_FAST_FORWARD is set), in one process (stock runs before mlxcel is imported); prints
one JSON object: for each, each conversation's prompt length and tokens
(`{"stock": [{"prompt_len": ..., "tokens": [...]}, ...], "ours": [...]}`).

Usage: models_exact_greedy.py EXACT_DIR MODEL_DIR PROMPTS_JSON
PROMPTS_JSON holds `[{"messages": [...], "max_tokens": N}, ...]`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step


def run(model: Any, tokenizer: Any, conversations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for conv in conversations:
        ids = tokenizer.apply_chat_template(conv["messages"], add_generation_prompt=True)
        steps = generate_step(mx.array(ids), model, max_tokens=conv["max_tokens"])
        out.append({"prompt_len": len(ids), "tokens": [int(t) for t, _ in steps]})
    return out


def main(exact_dir: str, model_dir: str, prompts_file: str) -> None:
    conversations = json.loads(Path(prompts_file).read_text())
    model, tokenizer = mlx_lm.load(exact_dir)
    stock = run(model, tokenizer, conversations)
    del model

    from mlxcel.daemon.forward.fast_forward import is_fast
    from mlxcel.daemon.models import load_model

    loaded = load_model(model_dir)
    assert loaded.info.dtype == "float32", loaded.info
    assert is_fast(loaded.model) == (not os.environ.get("MLXCEL_NO_FAST_FORWARD"))
    ours = run(loaded.model, loaded.tokenizer, conversations)
    print(json.dumps({"stock": stock, "ours": ours}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
