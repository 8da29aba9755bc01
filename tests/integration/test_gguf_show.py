"""`models show` reports a GGUF model's source quant type per tensor class (docs/models.md); the
default model's kept source is tests/e2e/test_gguf_smollm2.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_builders import arch_keys, tensor_names, write_gguf
from mlxcel.daemon.models import convert_gguf
from mlxcel.daemon.models.gguf_info import SOURCE_INFO
from mlxcel.daemon.models.inspect import describe_model
from tiny_gguf import gguf_metadata


def _qtype(name: str) -> Q:
    if name == "blk.0.ffn_down.weight" or name == "output.weight":
        return Q.Q6_K
    return Q.Q5_K if "attn_v" in name else Q.Q4_K


@pytest.fixture(scope="module")
def mixed_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    meta: dict[str, Any] = {
        k: v for k, v in gguf_metadata(tiny_model_dir).items() if k.startswith("tokenizer.")
    }
    meta.update(arch_keys("llama", len(meta["tokenizer.ggml.tokens"])))
    path = tmp_path_factory.mktemp("show") / "Tiny-Q4_K_M.gguf"
    return write_gguf(path, "llama", meta, tensor_names("llama"), _qtype)


EXPECTED = {
    "attn_q": "Q4_K",
    "attn_v": "Q5_K",
    "ffn_down": "Q4_K, Q6_K in 1 of 2",
    "output": "Q6_K",
    "token_embd": "Q4_K",
    "attn_norm": "F32",
}


def test_show_of_a_gguf_file_reads_its_header(mixed_gguf: Path) -> None:
    info = describe_model(str(mixed_gguf), probe_batch=False)["gguf"]
    assert info["source"] == mixed_gguf.name
    assert {k: info["tensor_types"][k] for k in EXPECTED} == EXPECTED


def test_show_of_a_converted_directory_says_what_each_class_became(
    mixed_gguf: Path, tmp_path: Path
) -> None:
    out = convert_gguf(mixed_gguf, tmp_path / "converted")
    assert (out / SOURCE_INFO).is_file()
    info = describe_model(str(out), probe_batch=False)["gguf"]
    assert info["source"] == mixed_gguf.name and info["architecture"] == "llama"
    assert {k: info["tensor_types"][k] for k in EXPECTED} == EXPECTED
    became = info["converted_to"]
    assert became["attn_q"] == "4-bit affine, group 32 (float32 scales)"
    assert became["attn_v"] == "5-bit affine, group 32 (float32 scales)"
    assert became["output"] == "float32"
    assert (
        became["ffn_down"].startswith("4-bit affine") and "float32 in 1 of 2" in became["ffn_down"]
    )


def test_a_model_not_from_gguf_has_none(tiny_model_dir: Path) -> None:
    assert describe_model(str(tiny_model_dir), probe_batch=False)["gguf"] is None
