"""Prefill chunks of more families (tests/family_models.py: llama3 and yarn rope scaling, qwen3,
phi3 longrope, gemma2 with as many kv heads as heads, at head dims 16 and 64) through the
native chunk step, in a process with the daemon's BLAS preload (the chunk step needs its
cblas_sgemm): mlx-lm's own logits. The families' fused forward and decode steps in-process are
tests/integration/test_native_families.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
from blas_process import run_with_fast_blas
from family_models import ATOL, make_family_dirs
from mlxcel.daemon.forward import native_ops
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = [
    cpu_only,
    pytest.mark.skipif(native_ops.path() is None, reason="native ops library not built"),
]
CHUNK_STEP = TESTS / "child_scripts" / "native_families_chunk_step.py"
NAMES = ("llama3", "llama-yarn", "qwen3", "phi3-longrope", "gemma2-mha", "gemma2-hd64")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_family_dirs(tmp_path_factory.mktemp("families"), NAMES)


def test_prefill_chunks_through_the_chunk_step_match_mlx_lm(model_dirs: dict[str, Path]) -> None:
    """In a process with the daemon's BLAS setup (the chunk step needs its cblas_sgemm): a
    left-padded prefill chunk on fresh caches, a second one on top and a short third go
    through the native chunk step and give mlx-lm's logits, and the decode steps after them
    too (gemma2: its soft-capped scores on every attention path, post norms and GELU)."""
    paths = [str(model_dirs[n]) for n in NAMES]
    out = run_with_fast_blas(CHUNK_STEP, *paths)
    assert out["calls"] == dict.fromkeys(paths, 3)
    assert all(d <= ATOL for d in out["diffs"].values()), out["diffs"]
