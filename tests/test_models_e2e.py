"""End-to-end checks on the real default model (SmolLM2-135M-Instruct from its Q4_1 GGUF).

Skipped with a reason when the model has not been pulled (`mlxcel-daemon models pull`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx_lm
import pytest
from mlxcel.daemon.models import LoadedModel, load_model
from mlxcel.daemon.models.blas import fast_blas_env, find_system_openblas
from mlxcel.daemon.models.registry import read_manifest

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France?"
CLI = (sys.executable, "-m", "mlxcel.daemon.cli_models")


@pytest.fixture(scope="module")
def default_model(default_model_dir: Path) -> LoadedModel:
    return load_model(str(default_model_dir))


def _chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_paris(default_model: LoadedModel) -> None:
    text = mlx_lm.generate(
        default_model.model, default_model.tokenizer, _chat_ids(default_model, QUESTION), 12
    )
    assert "Paris" in text
    assert text.strip().startswith("The capital of France is Paris")


def test_default_model_info(default_model: LoadedModel) -> None:
    info = default_model.info
    assert info.family == "llama" and info.can_batch and info.batch_reason is None
    assert info.context_length == 8192
    assert info.num_params == 134_515_008
    assert info.eos_token_ids == (2,)
    if info.backend == "cpu":
        assert info.dtype == "float32" and info.weights_bytes == 4 * info.num_params


# Run in a child with the OpenBLAS fast path: greedy decoding on the reference BLAS is ~10x
# slower than the whole test needs to be.
COMPARE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlxcel.daemon.models import load_model

    def chat(loaded, text):
        messages = [{"role": "user", "content": text}]
        return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def greedy(loaded, ids):
        steps = generate_step(mx.array(ids), loaded.model, max_tokens=20)
        return [int(token) for token, _ in steps]

    result = {}
    for key, spec in zip(("dir", "gguf"), sys.argv[1:3]):
        loaded = load_model(spec)
        ids = chat(loaded, "What is the capital of France?")
        haiku = chat(loaded, "Write a haiku about the sea.")
        logits = loaded.model(mx.array([haiku]))[0, -1]
        result[key] = {"source": loaded.info.source, "ids": ids, "tokens": greedy(loaded, ids),
                       "haiku": haiku, "logits": logits.tolist()}
    print(json.dumps(result))
    """
)


def test_gguf_and_converted_dir_give_identical_greedy_tokens(default_model_dir: Path) -> None:
    manifest = read_manifest(default_model_dir) or {}
    if "gguf" not in manifest:
        pytest.skip("this model directory keeps no source GGUF")
    gguf = default_model_dir / manifest["gguf"]
    proc = subprocess.run(
        [sys.executable, "-c", COMPARE_SCRIPT, str(default_model_dir), str(gguf)],
        capture_output=True,
        text=True,
        env=fast_blas_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    direct, converted = result["gguf"], result["dir"]
    assert (direct["source"], converted["source"]) == ("gguf", "dir")
    assert direct["ids"] == converted["ids"] and direct["haiku"] == converted["haiku"]
    assert direct["tokens"] == converted["tokens"]
    assert direct["logits"] == converted["logits"]  # the same dequantized weights, bit for bit


def test_cli_run_answers_paris(default_model_dir: Path) -> None:
    proc = subprocess.run(
        [*CLI, "run", QUESTION, "--model", str(default_model_dir), "--max-tokens", "16"],
        capture_output=True,
        text=True,
        env=fast_blas_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    if find_system_openblas() is not None:
        assert "/openblas" in proc.stderr
