"""GGUF loading and conversion on tiny GGUF files written here from the tiny llama model.

`write_tiny_gguf` permutes q/k the way llama.cpp's converter does, so a GGUF that loads
correctly (name mapping, hyper-parameters, RoPE `traditional=True`) gives the same logits as
the original model. Real SmolLM2 checks are in test_models_e2e.py and test_models_exact.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from gguf_builders import add_kv
from mlx.utils import tree_flatten
from mlxcel.daemon.models import ModelLoadError, convert_gguf, load_model
from mlxcel.daemon.models.gguf import load_gguf
from mlxcel.daemon.models.loader import apply_dtype
from platform_marks import cpu_only
from tiny_gguf import (
    gguf_metadata,
    gguf_tensors,
    to_gguf_value,
    write_tiny_gguf,
)

PROMPTS = ["What is the capital of France?", "Hello there, 1234!", "Tell me a story"]


def _logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    out = model(mx.array([ids]))
    return np.array(out[0].astype(mx.float32))


def _greedy(model: nn.Module, tokenizer: Any, prompt: str, n: int = 12) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    for _ in range(n):
        ids.append(int(np.argmax(_logits(model, ids)[-1])))
    return ids


@pytest.fixture(scope="module")
def float_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def test_float_gguf_matches_the_original_model(tiny_model_dir: Path, float_gguf: Path) -> None:
    reference, ref_tok = mlx_lm.load(str(tiny_model_dir))
    model, tokenizer, config = load_gguf(float_gguf)
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is False
    for prompt in PROMPTS:
        ids = ref_tok.encode(prompt)
        assert tokenizer.encode(prompt) == ids
        np.testing.assert_allclose(_logits(model, ids), _logits(reference, ids), atol=2e-4)


def test_gguf_tokenizer_matches(tiny_model_dir: Path, float_gguf: Path) -> None:
    _, ref_tok = mlx_lm.load(str(tiny_model_dir))
    tokenizer = load_model(str(float_gguf)).tokenizer
    messages = [{"role": "user", "content": "Hi <|im_end|> there"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
        ref_tok.apply_chat_template(messages, add_generation_prompt=True)
    )
    assert tokenizer.eos_token_ids == ref_tok.eos_token_ids
    ids = tokenizer.encode("naïve café 😀 x")
    assert tokenizer.decode(ids) == "naïve café 😀 x"


def test_converted_dir_gives_identical_greedy_tokens(float_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(float_gguf, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is True and config["model_type"] == "llama"
    direct = load_model(str(float_gguf))
    converted = load_model(str(out))
    assert direct.info.source == "gguf" and converted.info.source == "dir"
    assert direct.info.num_params == converted.info.num_params
    for prompt in PROMPTS:
        assert _greedy(direct.model, direct.tokenizer, prompt) == _greedy(
            converted.model, converted.tokenizer, prompt
        )


def _write_quantized_gguf(
    tiny_model_dir: Path, out: Path, exact_norms: bool = True
) -> dict[str, np.ndarray]:
    """A Q4_1 tiny GGUF with a Q8_0 embedding (the default model's mix); returns gguf's own
    dequantization of each quantized tensor. The norms get a third added (not a float16
    value); `exact_norms` then rounds them to float16 values (as a bf16-trained model's are),
    so storing them in float16 loses nothing."""
    qtypes = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, value in gguf_metadata(tiny_model_dir).items():
        add_kv(writer, key, value)
    expected = {}
    for name, value in gguf_tensors(tiny_model_dir).items():
        array = np.array(value)
        qtype = qtypes.get(name, gguf.GGMLQuantizationType.Q4_1)
        if array.ndim == 2:
            packed = quantize(array.astype(np.float32), qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            expected[name] = dequantize(packed, qtype)
        else:
            array = array.astype(np.float32) + np.float32(1 / 3)  # tiny norms are all ones
            if exact_norms:
                array = array.astype(np.float16).astype(np.float32)
            writer.add_tensor(name, array.astype(np.float32))
            expected[name] = array.astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@cpu_only
def test_quantized_gguf_dequantizes_exactly(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compare weights in mlx-lm's own layout: the CPU fast forward fuses q/k/v and gate/up.
    monkeypatch.setenv("MLXCEL_NO_FAST_FORWARD", "1")
    expected = _write_quantized_gguf(tiny_model_dir, tmp_path / "tiny-q.gguf")

    loaded = load_model(str(tmp_path / "tiny-q.gguf"), dtype="auto")
    assert loaded.info.dtype == "float32" and loaded.info.quantization is None
    embed = np.array(loaded.model.model.embed_tokens.weight)
    np.testing.assert_array_equal(embed, expected["token_embd.weight"])
    q = np.array(loaded.model.model.layers[0].self_attn.q_proj.weight)
    np.testing.assert_array_equal(q, expected["blk.0.attn_q.weight"])

    out = convert_gguf(tmp_path / "tiny-q.gguf", tmp_path / "q-dir")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    kept = load_model(str(out), dtype="float32")
    ids = kept.tokenizer.encode(PROMPTS[0])
    np.testing.assert_array_equal(_logits(kept.model, ids), _logits(loaded.model, ids))


def test_converted_quantized_dir_has_no_float32_next_to_float16_scales(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXCEL_NO_FAST_FORWARD", "1")
    expected = _write_quantized_gguf(tiny_model_dir, tmp_path / "tiny-q.gguf")
    out = convert_gguf(tmp_path / "tiny-q.gguf", tmp_path / "q-dir")
    stored = mx.load(str(out / "model.safetensors"))
    floats = {str(v.dtype) for v in stored.values() if mx.issubdtype(v.dtype, mx.floating)}
    assert floats == {"mlx.core.float16"}
    # ... and the CPU still gets the exact float32 norms back.
    model = load_model(str(out), dtype="auto").model
    norm = np.array(model.model.layers[0].input_layernorm.weight)
    assert norm.dtype == np.float32
    np.testing.assert_array_equal(norm, expected["blk.0.attn_norm.weight"])

    # A norm float16 cannot hold exactly stays float32 (never rounded).
    _write_quantized_gguf(tiny_model_dir, tmp_path / "raw.gguf", exact_norms=False)
    raw = mx.load(str(convert_gguf(tmp_path / "raw.gguf", tmp_path / "raw") / "model.safetensors"))
    assert raw["model.norm.weight"].dtype == mx.float32


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_gpu_keeps_quantized_layers_and_casts_only_the_rest(
    tiny_model_dir: Path, tmp_path: Path, backend: str
) -> None:
    """Simulated: apply_dtype as it runs off the CPU (the arrays themselves live on the CPU)."""
    _write_quantized_gguf(tiny_model_dir, tmp_path / "tiny-q.gguf", exact_norms=False)
    out = convert_gguf(tmp_path / "tiny-q.gguf", tmp_path / "q-dir")
    for dtype, plain in (("auto", mx.float16), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        model, _ = mlx_lm.load(str(out))
        apply_dtype(model, dtype, backend)
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear), dtype
        assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding), dtype
        assert layer.self_attn.q_proj.scales.dtype == mx.float16  # scales untouched
        assert layer.input_layernorm.weight.dtype == plain, dtype
        assert model.model.norm.weight.dtype == plain, dtype


def test_unsupported_gguf_files_fail_with_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = write_tiny_gguf(
        tiny_model_dir, tmp_path / "falcon.gguf", **{"general.architecture": "falcon"}
    )
    with pytest.raises(ModelLoadError, match="architecture 'falcon' is not supported"):
        load_model(str(other))
    bert = write_tiny_gguf(
        tiny_model_dir, tmp_path / "bert-tok.gguf", **{"tokenizer.ggml.model": "bert"}
    )
    with pytest.raises(ModelLoadError, match="tokenizer 'bert' is not supported"):
        load_model(str(bert))
    tensors = {**gguf_tensors(tiny_model_dir), "rope_freqs.weight": mx.linspace(3.0, 1.0, 8)}
    meta = {k: to_gguf_value(v) for k, v in gguf_metadata(tiny_model_dir).items()}
    mx.save_gguf(str(tmp_path / "odd-rope.gguf"), tensors, meta)
    with pytest.raises(ModelLoadError, match="match no Llama 3 RoPE scaling"):
        load_model(str(tmp_path / "odd-rope.gguf"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(garbage))
    assert "\n" not in str(info.value)


def test_converted_float_dir_drops_quantization(float_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(float_gguf, tmp_path / "f16", dtype="float16")
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["torch_dtype"] == "float16"
    weights = dict(tree_flatten(mlx_lm.load(str(out))[0].parameters()))
    assert {v.dtype for v in weights.values()} == {mx.float16}
