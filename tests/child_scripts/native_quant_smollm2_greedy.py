"""SmolLM2 (4-bit group 32 from its GGUF, an 8-bit embedding) kept quantized on the native
steps against its float32 copy on the float native steps, in a process with the daemon's BLAS
preload (tests/blas_process.py): 8 chat prompts as one left-padded batch, greedy. Prints one
JSON object: how many prompts gave identical tokens, and for each that did not where it
diverged and the float32 path's top-2 logit gap there.

Usage: native_quant_smollm2_greedy.py MODEL_DIR TOKENS
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.forward.fast_forward import apply_fast_forward
from mlxcel.daemon.models.loader import apply_dtype

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three prime numbers.",
    "Tell me a short story about a robot.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


def smollm2_greedy(model_dir: str, tokens: int) -> dict[str, Any]:
    """SmolLM2 (4-bit group 32 from its GGUF, an 8-bit embedding) kept quantized on the native
    steps, and dequantized to float32 on the float native steps: each prompt's greedy tokens,
    as a batch of 8 left-padded rows; where a row first diverges, the float32 path's top-2
    logit gap; the largest logit difference after the (same) prefill."""
    quant, tokenizer = mlx_lm.load(model_dir)
    cast = [  # float16 scales and norms to float32 (exact), as the loader does on the CPU
        (k, v.astype(mx.float32))
        for k, v in tree_flatten(quant.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    ]
    quant.update(tree_unflatten(cast))
    plain, _ = mlx_lm.load(model_dir)
    apply_dtype(plain, "float32", "cpu")  # today's CPU path: every layer float32
    mx.eval(quant.parameters(), plain.parameters())
    assert apply_fast_forward(quant, "cpu") and apply_fast_forward(plain, "cpu")
    assert quant.model._mlxcel_native.quantized and not plain.model._mlxcel_native.quantized
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    longest = max(len(r) for r in rows)
    padding = [longest - len(r) for r in rows]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
    pair = (plain, quant)
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    prefill_diff = mx.abs(last[0] - last[1]).max().item()  # the same inputs: the two paths
    out: list[list[list[int]]] = [[], []]
    gaps: list[list[float]] = [[], []]
    for _ in range(tokens):
        for k in range(2):
            top = np.sort(np.asarray(last[k]), axis=-1)
            gaps[k].append((top[:, -1] - top[:, -2]).tolist())
            out[k].append(np.asarray(mx.argmax(last[k], axis=-1)).tolist())
        # each model continues its own tokens (a divergence then shows as it happened)
        last = [
            m(mx.array(out[k][-1])[:, None], cache=c)[:, -1, :]
            for k, (m, c) in enumerate(zip(pair, caches, strict=True))
        ]
    result = {"identical": 0, "divergences": [], "prefill_logit_diff": prefill_diff}
    for i in range(len(PROMPTS)):
        a, b = [t[i] for t in out[0]], [t[i] for t in out[1]]
        if a == b:
            result["identical"] += 1
            continue
        at = next(j for j in range(tokens) if a[j] != b[j])
        result["divergences"].append({"prompt": i, "at": at, "float32_gap": gaps[0][at][i]})
    return result


def main(model_dir: str, tokens: str) -> None:
    print(json.dumps({"available": True, **smollm2_greedy(model_dir, int(tokens))}))


if __name__ == "__main__":
    main(*sys.argv[1:])
