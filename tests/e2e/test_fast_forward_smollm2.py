"""The fast CPU forward on the real SmolLM2 gives stock mlx-lm's greedy tokens: in this process,
and in one with the daemon's BLAS setup (tests/child_scripts/fast_forward_smollm2_parity.py),
alone and batched, on the best kernels and on forced AVX2. The kernels and the tiny llama are
tests/integration/test_fast_forward.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlxcel.daemon.forward.blas import cpu_flags, fast_blas_env
from mlxcel.daemon.forward.fast_forward import DISABLE_ENV, is_fast
from mlxcel.daemon.models import load_model
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = cpu_only  # the fused forward is installed on the CPU backend only
PARITY = TESTS / "child_scripts" / "fast_forward_smollm2_parity.py"


def test_smollm2_greedy_tokens_are_identical(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(str(default_model_dir))
    with monkeypatch.context() as patch:  # the same weights on mlx-lm's own modules
        patch.setenv(DISABLE_ENV, "1")
        stock = load_model(str(default_model_dir)).model
    pair = (stock, loaded.model)
    assert is_fast(pair[1]) and not is_fast(pair[0])
    tokenizer = loaded.tokenizer
    # on this process's BLAS (MLX's reference one on Linux): the fused forward's own matmuls,
    # not the few-row kernel; the longer parity run under the daemon's BLAS is the next test's.
    # Plain-text prompts: the reference BLAS prefills a chat template's ~30 tokens of system
    # prompt slowly, and the chat template is the next test's.
    prompts = ["The capital of France is"]
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        outputs = []
        for model in pair:
            cache = make_prompt_cache(model)
            token, generated = mx.array([ids]), []
            for _ in range(12):
                token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
                generated.append(token.item())
            outputs.append(generated)
        assert outputs[0] == outputs[1], prompt


PARITY_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "2+2=",
    "List three colours.",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Hamlet?",
    "Give me a short name for a grey cat.",
]


@pytest.mark.parametrize("isa", ["best", "avx2"])
def test_smollm2_greedy_tokens_equal_stock_on_the_fast_blas(
    default_model_dir: Path, isa: str
) -> None:
    """8 prompts x 24 tokens batched (B=8: the native decode step, native attention and SwiGLU
    at prefill) and the first alone (the few-row kernel), in a process with the daemon's BLAS
    setup (OpenBLAS core type by CPU, few-row kernel): the fused forward gives stock's tokens.
    `avx2` simulates a CPU without AVX-512 (forced AVX2 kernels, Haswell core type) on 4
    prompts x 16 tokens, 1 of them alone. Stock mlx-lm's one-row steps (~45 ms each on this
    CPU: per-op overhead) are most of the time, hence 1 alone."""
    prompts, steps = (PARITY_PROMPTS, 24) if isa == "best" else (PARITY_PROMPTS[:4], 16)
    alone = 1
    env = fast_blas_env()
    if isa == "avx2":
        env = fast_blas_env(
            {**os.environ, "MLXCEL_GEMM_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell"}
        )
    proc = subprocess.run(
        [
            sys.executable,
            str(PARITY),
            str(default_model_dir),
            str(steps),
            json.dumps(prompts),
            str(alone),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if sys.platform.startswith("linux") and "avx2" in cpu_flags():
        assert "+ sgemm" in out["blas"] and out["native"] > 0, out["blas"]
        assert out["decode"]  # batched decode steps ran the native decode step
        if isa == "avx2":
            assert out["blas"] == "openblas Haswell + sgemm avx2"
            assert out["ops"] == "avx2"
    assert len(out["stock"]) == alone and all(len(t) == steps for t in out["stock"])
    assert len(out["stock_batched"]) == len(prompts)
    for i, prompt in enumerate(prompts):
        if i < alone:
            assert out["fast"][i] == out["stock"][i], f"alone: {prompt}"
        assert out["fast_batched"][i] == out["stock_batched"][i], f"batched: {prompt}"
