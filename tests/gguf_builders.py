"""Tiny GGUF files written with the `gguf` package, and their reference outside our converter.

`write_gguf` lays out random tensors the way llama.cpp's converter does (`tensor_names`,
`arch_keys`: a small llama-shaped model; the K-quants as hand-made blocks of random codes, which
the package cannot quantize). `reference_model` is stock mlx-lm on the file's tensors
dequantized by `gguf.quants` (q/k un-permuted, gemma's 1 + w norms back to w) in a plain
float32 directory. Used by the GGUF tests (tests/integration/test_gguf_*.py,
test_model_kind_surfaces.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # rows of 256: K-quant super-blocks
HF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
}
GEMMA2_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
HF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
K_BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


def hf_name(name: str, arch: str = "llama") -> str:
    base, suffix = name.rsplit(".", 1)
    if base in HF_TOP:
        return f"{HF_TOP[base]}.{suffix}"
    _, index, role = base.split(".")
    if arch == "phi3" and role == "ffn_up":  # Phi-3's fused gate/up
        return f"model.layers.{index}.mlp.gate_up_proj.{suffix}"
    if arch in ("gemma2", "gemma3") and role in GEMMA2_NORMS:
        return f"model.layers.{index}.{GEMMA2_NORMS[role]}.{suffix}"
    return f"model.layers.{index}.{HF_LAYER[role]}.{suffix}"


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (rows, cols / 256 * block bytes) with sane d and dmin."""
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, K_BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, 16 int8 scales, then d
        blocks[:, 208:210] = _f16_bytes(rng.uniform(1e-4, 3e-4, n))
    else:  # d, dmin first
        blocks[:, 0:2] = _f16_bytes(rng.uniform(1e-3, 3e-3, n))
        blocks[:, 2:4] = _f16_bytes(rng.uniform(1e-3, 3e-3, n))
    return blocks.reshape(rows, -1)


def arch_keys(arch: str, vocab: int, layers: int = LAYERS, **extra: Any) -> dict[str, Any]:
    return {
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 2048,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.vocab_size": vocab,
        **{f"{arch}.{k}": v for k, v in extra.items()},
    }


def add_kv(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if key == "general.architecture":
        return
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, value)


def tensor_names(
    arch: str,
    tied: bool = False,
    qk_norm: bool = False,
    bias: bool = False,
    fused: bool = False,
    sandwich: bool = False,
    layers: int = LAYERS,
) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of a tiny model's tensors; the vocabulary is filled in later."""
    head_dim = HIDDEN // HEADS
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (-1, HIDDEN))]
    for i in range(layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (HIDDEN,)), (f"{b}.ffn_norm.weight", (HIDDEN,))]
        if fused:  # Phi-3: q/k/v in one tensor, gate and up in one
            out += [(f"{b}.attn_qkv.weight", ((HEADS + 2 * KV_HEADS) * head_dim, HIDDEN))]
            out += [(f"{b}.ffn_up.weight", (2 * FFN, HIDDEN))]
        else:
            out += [(f"{b}.attn_q.weight", (HEADS * head_dim, HIDDEN))]
            out += [(f"{b}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN))]
            out += [(f"{b}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN))]
            out += [(f"{b}.ffn_gate.weight", (FFN, HIDDEN)), (f"{b}.ffn_up.weight", (FFN, HIDDEN))]
        out += [(f"{b}.attn_output.weight", (HIDDEN, HEADS * head_dim))]
        out += [(f"{b}.ffn_down.weight", (HIDDEN, FFN))]
        if bias:
            out += [(f"{b}.attn_q.bias", (HEADS * head_dim,))]
            out += [(f"{b}.attn_k.bias", (KV_HEADS * head_dim,))]
            out += [(f"{b}.attn_v.bias", (KV_HEADS * head_dim,))]
        if sandwich:  # Gemma 2/3: norms after attention and after the MLP too
            out += [(f"{b}.post_attention_norm.weight", (HIDDEN,))]
            out += [(f"{b}.post_ffw_norm.weight", (HIDDEN,))]
        if qk_norm:
            out += [(f"{b}.attn_q_norm.weight", (head_dim,))]
            out += [(f"{b}.attn_k_norm.weight", (head_dim,))]
    out.append(("output_norm.weight", (HIDDEN,)))
    if not tied:
        out.append(("output.weight", (-1, HIDDEN)))
    return out


def write_gguf(
    path: Path,
    arch: str,
    meta: dict[str, Any],
    tensors: list[tuple[str, tuple[int, ...]]],
    qtype_of: Callable[[str], Q],
    seed: int = 0,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """A GGUF of random tensors: 2-D ones in `qtype_of(name)`, the others float32 (norms
    near 1). -1 in a shape is the vocabulary (the tokenizer's size)."""
    rng = np.random.default_rng(seed)
    vocab = len(meta["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        add_kv(writer, key, value)
    for name, shape in tensors:
        shape = tuple(vocab if n == -1 else n for n in shape)
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if name.endswith(".bias"):
                values -= 1.0
            writer.add_tensor(name, values)
            continue
        qtype = qtype_of(name)
        if qtype in K_BLOCK_BYTES:
            packed = k_blocks(qtype, *shape, rng)
        else:
            values = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            if qtype == Q.F32:
                writer.add_tensor(name, values)
                continue
            packed = quantize(values, qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_weights(path: Path, arch: str) -> dict[str, np.ndarray]:
    """The file's tensors as float32 by `gguf.quants.dequantize`, in HF names and layout
    (q/k rows un-permuted for llama; gemma's 1 + w norms back to w)."""
    reader = gguf.GGUFReader(str(path))
    heads = int(reader.fields[f"{arch}.attention.head_count"].contents())
    kv = int(reader.fields[f"{arch}.attention.head_count_kv"].contents())
    out = {}
    for t in reader.tensors:
        if t.name.startswith(("rope_freqs.", "rope_factors_")):
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        if arch in ("llama", "mistral") and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in t.name else kv
            # llama.cpp's permutation, inverted: interleaved pairs -> rotary halves
            values = values.reshape(n, -1, 2, shape[1]).swapaxes(1, 2).reshape(shape)
        if arch.startswith("gemma") and t.name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        out[hf_name(t.name, arch)] = values
    return out


def reference_model(
    path: Path, arch: str, config: dict[str, Any], out: Path
) -> tuple[nn.Module, dict[str, np.ndarray]]:
    """Stock mlx-lm on a plain float32 directory of the reference weights."""
    weights = reference_weights(path, arch)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    (out / "config.json").write_text(json.dumps(config))
    model, _ = mlx_lm.utils.load_model(out)
    return model, weights


def llama_config(vocab: int, **extra: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        **extra,
    }


def logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))
