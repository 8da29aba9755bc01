"""The CPU path serves the GGUF's exact values: float32 dequantization, no float16 rounding.

The reference here is independent of MLX: the `gguf` package reads the raw block records and
numpy does llama.cpp's arithmetic in float32 (Q4_1: f32(d) * q + f32(m); Q8_0: f32(d) * q).
Then stock mlx-lm, loading those exact float32 weights from a plain directory, must produce the
same greedy tokens as our loader with the fused CPU forward (with it off, the weights check
below makes the two the same computation).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from mlx.utils import tree_flatten
from mlxcel.daemon.forward.blas import fast_blas_env
from mlxcel.daemon.models import load_model
from mlxcel.daemon.models.gguf import _mlx_name
from mlxcel.daemon.models.registry import read_manifest
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = [pytest.mark.e2e, cpu_only]  # float32 weights: the CPU path

Q4_1_BLOCK, Q8_0_BLOCK = 20, 34  # bytes per 32 weights: (d, m, 16 nibble bytes), (d, 32 int8)


def reference_dequantize(tensor: object) -> np.ndarray:
    """One GGUF tensor as float32, computed with numpy from its raw records."""
    raw = np.asarray(tensor.data)  # type: ignore[attr-defined]
    qtype = tensor.tensor_type  # type: ignore[attr-defined]
    shape = [int(n) for n in reversed(tensor.shape)]  # type: ignore[attr-defined]
    if qtype == GGMLQuantizationType.F32:
        return raw.astype(np.float32).reshape(shape)
    if qtype == GGMLQuantizationType.Q4_1:
        blocks = raw.reshape(-1, Q4_1_BLOCK)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = blocks[:, 4:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(shape)
    if qtype == GGMLQuantizationType.Q8_0:
        blocks = raw.reshape(-1, Q8_0_BLOCK)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    raise AssertionError(f"unexpected GGUF tensor type {qtype!r} in the default model")


@pytest.fixture(scope="module")
def source_gguf(default_model_dir: Path) -> Path:
    manifest = read_manifest(default_model_dir) or {}
    if "gguf" not in manifest:
        pytest.skip("this model directory keeps no source GGUF")
    return default_model_dir / manifest["gguf"]


@pytest.fixture(scope="module")
def reference_weights(source_gguf: Path) -> dict[str, np.ndarray]:
    reader = GGUFReader(str(source_gguf))
    kinds = {t.tensor_type for t in reader.tensors}
    assert GGMLQuantizationType.Q4_1 in kinds and GGMLQuantizationType.Q8_0 in kinds
    return {_mlx_name(t.name): reference_dequantize(t) for t in reader.tensors}


@pytest.mark.parametrize("source", ["dir", "gguf"])
def test_cpu_weights_equal_float32_dequantization(
    source: str,
    default_model_dir: Path,
    source_gguf: Path,
    reference_weights: dict[str, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # mlx-lm's own module layout (the fast forward fuses q/k/v and gate/up).
    monkeypatch.setenv("MLXCEL_NO_FAST_FORWARD", "1")
    spec = str(default_model_dir if source == "dir" else source_gguf)
    loaded = load_model(spec, dtype="float32")
    params = dict(tree_flatten(loaded.model.parameters()))
    assert set(params) == set(reference_weights)
    quantized = [n for n in params if n.endswith("_proj.weight") or "embed_tokens" in n]
    assert len(quantized) == 1 + 7 * 30  # the embedding and every linear
    for name, expected in reference_weights.items():
        got = params[name]
        assert got.dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(got), expected, err_msg=name)


SYSTEM = "You are a helpful assistant. Answer briefly and precisely."
PASSAGE = (
    "The lighthouse stood on a rock at the mouth of the bay, and for a hundred years its "
    "keepers had climbed the spiral stair each evening to light the lamp. When the last "
    "keeper retired, the town argued for a whole winter about whether to automate the light "
    "or let it go dark. In the end the fishermen paid for a small electric lamp, and the old "
    "keeper still walks up the hill every evening to watch it come on by itself."
)
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PASSAGE + "\n\nSummarise that."},
    ],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "I am planning a trip to Japan in April. Any advice?"},
        {
            "role": "assistant",
            "content": "April is cherry blossom season, so book hotels early, get a rail "
            "pass if you travel between cities, and carry some cash for small shops.",
        },
        {"role": "user", "content": "Which cities should I visit in ten days?"},
        {
            "role": "assistant",
            "content": "Tokyo for four days, Kyoto for three, a day trip to Nara, and two "
            "days in Osaka for the food.",
        },
        {"role": "user", "content": "What should I eat in Osaka?"},
    ],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]


def _report(topic: str) -> str:
    return (
        f"This is a short report about {topic}. It began quietly, but over the months more and "
        "more people heard about it, talked about it with friends, and came to see for "
        "themselves. Some were sceptical at first, others were delighted, and a few wrote long "
        "letters to the local newspaper explaining what it meant to them and to the town. "
        f"Today, everyone agrees that {topic} changed the place in small but lasting ways."
    )


# ~120-token "Summarise that." prompts whose greedy paths pass a near tie at their 13th token
# (top logits 0.002-0.004 apart): weights dequantized through float16 (the old conversion, see
# issue 19) leave stock mlx-lm's tokens exactly there.
NEAR_TIES = [
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": _report(topic) + "\n\nSummarise that."},
    ]
    for topic in ("bees and colony losses", "a team moving its weekly meeting")
]
# 16 tokens: past the near ties (13th token) and most of each conversation's first sentence;
# stock mlx-lm's one-row steps (~45 ms each here) are most of this file's time
RUNS = [{"messages": c, "max_tokens": 16} for c in [*CONVERSATIONS, *NEAR_TIES]]


def _write_exact_dir(
    default_model_dir: Path, reference_weights: dict[str, np.ndarray], out: Path
) -> Path:
    """A plain float32 mlx-lm directory holding the numpy-dequantized weights."""
    out.mkdir()
    config = json.loads((default_model_dir / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (out / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    weights = {name: mx.array(value) for name, value in reference_weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    for path in default_model_dir.iterdir():
        if path.is_file() and path.name.startswith(("tokenizer", "chat_template", "special")):
            shutil.copy2(path, out / path.name)
    return out


def _greedy(args: list[str]) -> dict[str, list[dict[str, object]]]:
    """tests/child_scripts/models_exact_greedy.py: greedy decoding, stock mlx-lm on the exact
    weights then our loader with the fused forward, in one child with the OpenBLAS fast path
    (the reference BLAS is ~10x slower)."""
    env = fast_blas_env()
    env.pop("MLXCEL_NO_FAST_FORWARD", None)
    proc = subprocess.run(
        [sys.executable, str(TESTS / "child_scripts" / "models_exact_greedy.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_greedy_tokens_equal_stock_mlx_lm_on_exact_weights(
    default_model_dir: Path, reference_weights: dict[str, np.ndarray], tmp_path: Path
) -> None:
    exact = _write_exact_dir(default_model_dir, reference_weights, tmp_path / "exact-f32")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(RUNS))
    # Ours is the fused forward only: with it off, our loader runs mlx-lm's own modules on the
    # same config.json and on weights that test_cpu_weights_equal_float32_dequantization proves
    # equal to these bit for bit, which is stock mlx-lm by construction.
    runs = _greedy([str(exact), str(default_model_dir), str(prompts)])
    stock, ours = runs["stock"], runs["ours"]
    lengths = [run["prompt_len"] for run in stock]
    assert lengths[2] >= 100 and lengths[3] >= 120 and min(lengths[5:]) >= 110  # long ones
    assert all(len(run["tokens"]) == 16 for run in stock)  # 16 tokens each (no early stop)
    for i, (mine, theirs) in enumerate(zip(ours, stock, strict=True)):
        assert mine == theirs, f"conversation {i}"
