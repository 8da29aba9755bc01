"""GGUF architectures: llama (with Llama 3 `rope_freqs`), qwen2, qwen3, gemma (docs/models.md).

Each tiny file is written with the `gguf` package the way llama.cpp's converter lays it out
(llama: q/k permuted for interleaved RoPE; gemma: norms stored as 1 + w, tied head; qwen2:
attention biases; qwen3: q/k norms). The reference is stock mlx-lm's model of the matching
family, built from a config written here by hand and the file's tensors dequantized by
`gguf.quants` (un-permuted, norms back to w); the daemon's load must give its logits
within 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_builders import (
    FFN,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    arch_keys,
    llama_config,
    logits,
    reference_model,
    tensor_names,
    write_gguf,
)
from mlxcel.daemon.models import ModelLoadError, load_model
from mlxcel.daemon.models.gguf import read_gguf

HEAD_DIM = HIDDEN // HEADS
TEXT = "The capital of France is Paris. 1234 naïve?"


def _base(vocab: int, model_type: str, layers: int = LAYERS, **extra: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        **extra,
    }


def _check_forward(path: Path, arch: str, config: dict[str, Any], tmp_path: Path) -> None:
    reference, _ = reference_model(path, arch, config, tmp_path / "reference")
    loaded = load_model(str(path))
    ids = loaded.tokenizer.encode(TEXT)
    assert len(ids) > 8
    got, want = logits(loaded.model, ids), logits(reference, ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=2e-6)  # summation order on ~170


def _q8(_name: str) -> Q:
    return Q.Q8_0


def llama3_rope_freqs(
    factor: float, low: float, high: float, old: int, dims: int = HEAD_DIM
) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `rope_freqs` for a Llama 3.1 rope_scaling."""
    freqs = 1.0 / (10000.0 ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    low_wl, high_wl = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(
    ("factor", "low", "high", "old", "keys"),
    [
        (8.0, 1.0, 4.0, 8192, False),  # Llama 3.1: the defaults, factor from the tensor
        (32.0, 1.0, 4.0, 8192, True),  # Llama 3.2: factor in the metadata
        (16.0, 1.0, 2.0, 4096, False),  # other bounds: fitted to the smooth frequencies
    ],
)
def test_llama3_rope_freqs_become_mlx_lm_llama3_scaling(
    factor: float,
    low: float,
    high: float,
    old: int,
    keys: bool,
    tokenizer_meta: dict[str, Any],
    tmp_path: Path,
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    extra = {"rope.scaling.factor": factor} if keys else {}
    meta = {**arch_keys("llama", vocab, **extra), **tokenizer_meta}
    freqs = llama3_rope_freqs(factor, low, high, old)
    assert ((freqs > 1) & (freqs < factor)).sum() >= 2  # some smoothly scaled frequencies
    path = write_gguf(
        tmp_path / "llama3.gguf",
        "llama",
        meta,
        tensor_names("llama"),
        _q8,
        extra={"rope_freqs.weight": freqs},
    )
    scaling = read_gguf(path).config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old,
    }
    _check_forward(path, "llama", llama_config(vocab, rope_scaling=rope), tmp_path)


def test_rope_freqs_no_llama3_scaling_matches_are_refused(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("llama", vocab), **tokenizer_meta}
    freqs = np.linspace(1.0, 3.0, HEAD_DIM // 2).astype(np.float32)[::-1].copy()
    path = write_gguf(
        tmp_path / "odd-rope.gguf",
        "llama",
        meta,
        tensor_names("llama"),
        _q8,
        extra={"rope_freqs.weight": freqs},
    )
    with pytest.raises(ModelLoadError, match=r"rope_freqs .* match no Llama 3 RoPE scaling"):
        load_model(str(path))


def test_qwen2_attention_biases_and_tied_head(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("qwen2", vocab), **tokenizer_meta}
    names = tensor_names("qwen2", tied=True, bias=True)
    path = write_gguf(tmp_path / "qwen2.gguf", "qwen2", meta, names, _q8)
    config = read_gguf(path).config
    assert config["model_type"] == "qwen2" and config["rope_traditional"] is False
    _check_forward(path, "qwen2", _base(vocab, "qwen2", tie_word_embeddings=True), tmp_path)


def test_qwen3_q_and_k_norms(tokenizer_meta: dict[str, Any], tmp_path: Path) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("qwen3", vocab, **{"attention.key_length": HEAD_DIM}), **tokenizer_meta}
    names = tensor_names("qwen3", qk_norm=True)
    path = write_gguf(tmp_path / "qwen3.gguf", "qwen3", meta, names, lambda _n: Q.Q4_K)
    config = read_gguf(path).config
    assert config["model_type"] == "qwen3" and config["head_dim"] == HEAD_DIM
    _check_forward(path, "qwen3", _base(vocab, "qwen3", tie_word_embeddings=False), tmp_path)


def test_gemma_norms_embedding_scale_and_tied_head(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("gemma", vocab, **{"attention.key_length": HEAD_DIM}), **tokenizer_meta}
    path = write_gguf(tmp_path / "gemma.gguf", "gemma", meta, tensor_names("gemma", tied=True), _q8)
    contents = read_gguf(path)
    assert contents.config["model_type"] == "gemma"
    # llama.cpp's 1 + w is back to w (the file's norms are near 1, so w is near 0)
    assert abs(float(contents.weights["model.norm.weight"].mean())) < 0.1
    _check_forward(path, "gemma", _base(vocab, "gemma"), tmp_path)


def test_gemma2_softcapping_and_sandwich_norms(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    keys = {
        "attention.key_length": HEAD_DIM,
        "attn_logit_softcapping": 40.0,
        "final_logit_softcapping": 20.0,
        "attention.sliding_window": 4096,
    }
    meta = {**arch_keys("gemma2", vocab, **keys), **tokenizer_meta}
    names = tensor_names("gemma2", tied=True, sandwich=True)
    path = write_gguf(tmp_path / "gemma2.gguf", "gemma2", meta, names, _q8)
    reference = _base(
        vocab,
        "gemma2",
        attn_logit_softcapping=40.0,
        final_logit_softcapping=20.0,
        query_pre_attn_scalar=HEAD_DIM,
    )
    _check_forward(path, "gemma2", reference, tmp_path)


def test_gemma3_sliding_window_local_rope_and_qk_norms(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    keys = {"attention.key_length": HEAD_DIM, "attention.sliding_window": 4}
    # six layers: five with the sliding window and RoPE base 10000, the sixth global (1e6)
    meta = {**arch_keys("gemma3", vocab, layers=6, **keys), **tokenizer_meta}
    meta["gemma3.rope.freq_base"] = 1_000_000.0
    names = tensor_names("gemma3", tied=True, sandwich=True, qk_norm=True, layers=6)
    path = write_gguf(tmp_path / "gemma3.gguf", "gemma3", meta, names, lambda _n: Q.Q4_K)
    config = read_gguf(path).config
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 4
    reference = _base(
        vocab,
        "gemma3_text",
        layers=6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=4,  # shorter than the prompt: the window matters
        sliding_window_pattern=6,
    )
    _check_forward(path, "gemma3", reference, tmp_path)


def test_gemma_27b_scales_queries_by_hidden_over_heads() -> None:
    from mlxcel.daemon.models.gguf import _gemma_config

    for arch, layers in (("gemma2", 46), ("gemma3", 62)):
        config = {"num_hidden_layers": layers, "hidden_size": 5376, "num_attention_heads": 32}
        config["head_dim"] = 128
        _gemma_config({f"{arch}.attention.sliding_window": 1024}, arch, config)
        assert config["query_pre_attn_scalar"] == 168
        config["num_hidden_layers"] = layers - 2
        _gemma_config({f"{arch}.attention.sliding_window": 1024}, arch, config)
        assert config["query_pre_attn_scalar"] == 128


@pytest.mark.parametrize("longrope", [False, True], ids=["4k", "longrope"])
def test_phi3_fused_qkv_and_gate_up(
    longrope: bool, tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    keys: dict[str, Any] = {"rope.dimension_count": HEAD_DIM}
    extra: dict[str, np.ndarray] = {}
    reference = _base(vocab, "phi3", tie_word_embeddings=False)
    if longrope:
        rng = np.random.default_rng(3)
        long = rng.uniform(1.0, 8.0, HEAD_DIM // 2).astype(np.float32)
        short = rng.uniform(1.0, 1.5, HEAD_DIM // 2).astype(np.float32)
        keys["rope.scaling.original_context_length"] = 512
        extra = {"rope_factors_long.weight": long, "rope_factors_short.weight": short}
        reference["rope_scaling"] = {
            "type": "longrope",
            "long_factor": long.tolist(),
            "short_factor": short.tolist(),
        }
        reference["original_max_position_embeddings"] = 512
    meta = {**arch_keys("phi3", vocab, **keys), **tokenizer_meta}
    names = tensor_names("phi3", fused=True)
    path = write_gguf(tmp_path / "phi3.gguf", "phi3", meta, names, lambda _n: Q.Q5_K, extra=extra)
    config = read_gguf(path).config
    assert config["model_type"] == "phi3" and config["rope_traditional"] is False
    assert ("rope_scaling" in config) is longrope
    _check_forward(path, "phi3", reference, tmp_path)


@pytest.mark.parametrize("arch", ["falcon", "starcoder2", "bert"])
def test_other_architectures_are_refused_by_name(
    arch: str, tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    from mlxcel.daemon.models.pull import pull

    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys(arch, vocab), **tokenizer_meta}
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, meta, tensor_names(arch), _q8)
    with pytest.raises(ModelLoadError) as info:
        pull(str(path), name=arch, progress=None)
    assert f"GGUF architecture {arch!r} is not supported" in str(info.value)
