"""The default model's GGUF (SmolLM2-135M-Instruct.Q4_1, kept by `models pull`): converted
again it gives the same bytes as before, and `models show` reports its source quant types
(docs/models.md). The tiny GGUF files of every quant type are tests/integration/
test_gguf_quant.py's and test_gguf_show.py's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlxcel.daemon.models import convert_gguf
from mlxcel.daemon.models.inspect import describe_model

# sha256 over the converted SmolLM2-135M-Instruct.Q4_1.gguf's tensors (sorted by name: name,
# dtype, shape, bytes) and of its config.json, as `mx.load`'s reader made them before the
# converter read through the `gguf` package (commit f90f8de).
SMOLLM2_WEIGHTS_SHA256 = "58b597d420684725ab3232bb2a24bcea3d671b7a874fc79af0bd29b2556794e9"
SMOLLM2_FILES_SHA256 = {
    "config.json": "b3f5e5902950d2180232f2346341db7ab5741cb4e8816725eceb9dac98527822",
    "tokenizer.json": "4f190f7976aa03fcb4ae4d1c5876033e4aaab29b2756161db5a6e1807a104b29",
    "tokenizer_config.json": "6d8f3834e249f24b728b74ff491ba9106e04c55785b0aa1a18b7a0aa8d0f507a",
    "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
}


def weights_digest(weights: dict[str, mx.array]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        value = weights[name]
        digest.update(name.encode())
        digest.update(str(value.dtype).encode())
        digest.update(str(value.shape).encode())
        digest.update(np.array(value).tobytes())
    return digest.hexdigest()


def test_the_default_smollm2_gguf_converts_bit_for_bit_as_before(
    default_model_dir: Path, tmp_path: Path
) -> None:
    from mlxcel.daemon.models.registry import read_manifest

    manifest = read_manifest(default_model_dir) or {}
    if "gguf" not in manifest:
        pytest.skip("this model directory keeps no source GGUF")
    out = convert_gguf(default_model_dir / manifest["gguf"], tmp_path / "smollm2")
    assert weights_digest(mx.load(str(out / "model.safetensors"))) == SMOLLM2_WEIGHTS_SHA256
    for name, expected in SMOLLM2_FILES_SHA256.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == expected, name


def test_the_default_model_reports_its_kept_source(default_model_dir: Path) -> None:
    info = describe_model(str(default_model_dir), probe_batch=False)["gguf"]
    if info is None:
        pytest.skip("this model directory keeps no source GGUF")
    types = info["tensor_types"]
    assert types["token_embd"] == "Q8_0" and types["attn_q"] == "Q4_1"
    assert types["attn_norm"] == "F32"
