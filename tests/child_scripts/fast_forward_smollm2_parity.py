"""Greedy tokens of a model on mlx-lm's own modules and on the fused forward (the same float32
weights), each prompt alone and all of them as one left-padded batch, in a process with the
environment the parent set (the daemon's BLAS preload, MLXCEL_GEMM_ISA, ...). Prints one JSON
object: the four token lists, the BLAS label, the native GEMM calls, the native ops' path and
whether the native decode step was installed.

Usage: fast_forward_smollm2_parity.py MODEL_DIR STEPS PROMPTS_JSON ALONE
(PROMPTS_JSON a JSON list of prompts; the first ALONE of them also run alone)
"""

from __future__ import annotations

import json
import os
import sys

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlxcel.daemon.forward import native_decode, native_ops
from mlxcel.daemon.forward.blas import blas_label, native_gemm_counts
from mlxcel.daemon.forward.fast_forward import DISABLE_ENV, is_fast
from mlxcel.daemon.models import load_model


def main(path: str, steps_arg: str, prompts_json: str, alone_arg: str) -> None:
    steps, prompts, alone_n = int(steps_arg), json.loads(prompts_json), int(alone_arg)
    os.environ[DISABLE_ENV] = "1"
    stock = load_model(path).model  # the same float32 weights, mlx-lm's own modules
    del os.environ[DISABLE_ENV]
    loaded = load_model(path)
    fast, tok = loaded.model, loaded.tokenizer
    assert is_fast(fast) and not is_fast(stock)
    ids = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in prompts
    ]

    def alone(model):
        out = []
        for row in ids[:alone_n]:
            cache, token, gen = make_prompt_cache(model), mx.array([row]), []
            for _ in range(steps):
                token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
                gen.append(token.item())
            out.append(gen)
        return out

    def batched(model):
        longest = max(len(r) for r in ids)
        pad = [longest - len(r) for r in ids]
        cache = [BatchKVCache(pad) for _ in model.layers]
        token = mx.array([[0] * p + r for p, r in zip(pad, ids, strict=True)])
        gen = []
        for _ in range(steps):
            token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
            gen.append(token[:, 0].tolist())
        return [list(col) for col in zip(*gen, strict=True)]

    out = {
        "stock": alone(stock),
        "fast": alone(fast),
        "stock_batched": batched(stock),
        "fast_batched": batched(fast),
    }
    print(
        json.dumps(
            {
                **out,
                "blas": blas_label(),
                "native": native_gemm_counts()[0],
                "ops": native_ops.path(),
                "decode": native_decode.is_installed(fast),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
