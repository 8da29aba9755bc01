"""Tiny llama-family GGUF files for tests, written from a tiny model directory.

q/k rows are permuted the way llama.cpp's `convert_hf_to_gguf.py` does, so the GGUF (loaded
with RoPE `traditional=True`) computes the same logits as the original directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import Tokenizer

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    """llama.cpp's tensor name for an mlx-lm llama parameter name."""
    base, suffix = name.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    _, _, index, rest = base.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}.{suffix}"


def permute_qk(w: mx.array, num_heads: int) -> mx.array:
    """HF rotary halves -> llama.cpp interleaved pairs (rows of q_proj / k_proj)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(model_dir: Path) -> dict[str, mx.array]:
    """The model's float weights under llama.cpp names, q/k permuted."""
    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for name, value in mx.load(str(model_dir / "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            value = permute_qk(value, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            value = permute_qk(value, config["num_key_value_heads"])
        tensors[gguf_name(name)] = value
    return tensors


def gguf_metadata(model_dir: Path) -> dict[str, Any]:
    """llama.* and tokenizer.* GGUF keys (plain Python values) for a tiny llama directory."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(True)
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in tokenizer_json["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.block_count": config["num_hidden_layers"],
        "llama.context_length": config["max_position_embeddings"],
        "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "llama.rope.freq_base": config["rope_theta"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": vocab["<|endoftext|>"],
        "tokenizer.chat_template": (model_dir / "chat_template.jinja").read_text(),
    }


def to_gguf_value(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return mx.array(value)
    if isinstance(value, int):
        return mx.array(value, dtype=mx.uint32)
    if isinstance(value, float):
        return mx.array(value, dtype=mx.float32)
    if value and isinstance(value[0], int):
        return mx.array(value, dtype=mx.int32)
    return list(value)


def write_tiny_gguf(model_dir: Path, path: Path, **metadata_overrides: Any) -> Path:
    """Write a float32 GGUF of the tiny llama at `model_dir`; overrides replace GGUF keys."""
    meta = {**gguf_metadata(Path(model_dir)), **metadata_overrides}
    mx.save_gguf(
        str(path), gguf_tensors(Path(model_dir)), {k: to_gguf_value(v) for k, v in meta.items()}
    )
    return Path(path)
