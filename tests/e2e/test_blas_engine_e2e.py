"""OpenBLAS against the wheel's reference BLAS on the real default model (SmolLM2): the greedy
tokens of a batch through the engine are the same with either, not only logits within a
tolerance (tests/e2e/test_blas.py checks those on the tiny model). Each side is its own
subprocess: the OpenBLAS preload only takes effect from process start (daemon/models/blas.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlxcel.daemon.models.blas import fast_blas_env, find_system_openblas, slow_blas_env

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from mlxcel.daemon.engine.engine import Engine
    from mlxcel.daemon.engine.types import GREEDY, GenerationRequest
    from mlxcel.daemon.models import load_model
    from mlxcel.daemon.models.blas import blas_name
    from mlxcel.shared.config import ServingConfig

    loaded = load_model(sys.argv[1], dtype="float32")
    info = loaded.info
    cfg = ServingConfig(parallel=4, max_batch_prefill=4, prefill_chunk_size=32, prompt_cache=False)
    engine = Engine(loaded.model, cfg, info.can_batch, info.batch_reason, info.context_length,
                    available_bytes=1 << 30)
    tokens = {}
    engine.on_output = lambda rid, out: out.token_id is not None and tokens.setdefault(
        rid, []).append(out.token_id)
    questions = ["What is the capital of France?", "Name three colours of the rainbow.",
                 "Write one sentence about the sea.", "Why is the sky blue? Answer briefly."]
    for i, q in enumerate(questions):
        ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                   add_generation_prompt=True)
        engine.add_request(GenerationRequest(f"q{i}", tuple(ids), 16, GREEDY))
    while engine.has_work:
        engine.step()
    print(json.dumps({"blas": blas_name(), "tokens": tokens}))
    """
)


def run_engine(env: dict[str, str], model_dir: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_greedy_tokens_are_the_same_with_openblas_and_reference_blas(
    default_model_dir: Path,
) -> None:
    if find_system_openblas() is None:
        if not sys.platform.startswith("linux"):
            pytest.skip("the OpenBLAS preload is a Linux fast path")
        pytest.fail("no system OpenBLAS: scripts/setup.sh installs it (apt libopenblas0-pthread)")
    fast = run_engine(fast_blas_env(), default_model_dir)
    slow = run_engine(slow_blas_env(), default_model_dir)
    assert (fast["blas"], slow["blas"]) == ("openblas", "reference")
    assert sorted(fast["tokens"]) == [f"q{i}" for i in range(4)]  # type: ignore[arg-type]
    assert all(len(set(t)) > 3 for t in fast["tokens"].values())  # type: ignore[union-attr]
    assert fast["tokens"] == slow["tokens"]
