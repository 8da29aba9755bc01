"""SmolLM2 kept quantized on the native quantized steps (daemon/forward/native/quant_kernels.h)
against its float32 copy on the float native steps, greedy, in a process with the daemon's
BLAS preload (tests/child_scripts/native_quant_smollm2_greedy.py). The kernels and the steps
on tiny quantized models are tests/integration/test_native_quant.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
from blas_process import run_with_fast_blas
from mlxcel.daemon.forward import native_ops
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = [
    cpu_only,
    pytest.mark.skipif(native_ops.quant_path() is None, reason="native quantized kernels absent"),
]
GREEDY = TESTS / "child_scripts" / "native_quant_smollm2_greedy.py"


def test_smollm2_quantized_greedy_tokens_equal_float32(default_model_dir: Path) -> None:
    """8 prompts x 64 tokens: at least 7 identical; a divergence only at a near-tie (the float32
    path's top-2 logits within 0.05 where the two first differ)."""
    out = run_with_fast_blas(GREEDY, str(default_model_dir), "64", timeout=900)
    assert out["identical"] >= 7, out
    for d in out["divergences"]:
        assert d["float32_gap"] < 0.05, out
