"""Tiny random-weight models for fast tests: a complete MLX model directory in milliseconds.

`make_tiny_model(path, family)` writes config.json, model.safetensors (random float32
weights, deterministic per seed) and a small byte-level BPE tokenizer with a ChatML chat
template, loadable by `mlx_lm.load` and by `load_model`.

Families: "llama" (plain KVCache, can batch) and "lfm2" (hybrid ArraysCache + KVCache list,
which mlx-lm cannot batch), plus "mamba" (pure SSM, ArraysCache).
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.hf_tokenizer import (
    CHATML_TEMPLATE,
    build_bpe_tokenizer,
    byte_alphabet,
    bytes_to_unicode,
    save_hf_tokenizer,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
NUM_MERGES = 64

# Fixed text the merges are learned from, so the tokenizer is the same on every machine.
_CORPUS = (
    "What is the capital of France? The capital of France is Paris. "
    "Hello! How are you today? I am a helpful assistant and I answer questions. "
    "The quick brown fox jumps over the lazy dog. Tell me a story about the sea. "
    "Write a short poem about the moon and the stars in the night sky. "
    "user assistant system message content the and of to in is that it for on with "
)

_BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        # An untied head: tied random embeddings make greedy decoding repeat one token.
        "tie_word_embeddings": False,
    },
    "lfm2": {
        "model_type": "lfm2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128,
        "layer_types": ["conv", "full_attention"],
        "tie_word_embeddings": True,
    },
    "mamba": {
        "model_type": "mamba",
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "tie_word_embeddings": True,
    },
}

FAMILIES = tuple(_BASE_CONFIGS)


def _learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on `text` (GPT-2 byte symbols); ties break on the pair itself."""
    table = bytes_to_unicode()
    words = Counter(
        tuple(table[b] for b in (w if i == 0 else " " + w).encode())
        for i, w in enumerate(text.split(" "))
        if w
    )
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in pairwise(word):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        words = Counter({_merge_word(w, best): n for w, n in words.items()})
    return merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_tiny_tokenizer(path: Path, added_tokens: tuple[str, ...] = ()) -> int:
    """Write the tiny tokenizer into `path`; returns its vocabulary size. `added_tokens` (e.g.
    `<think>`, `</think>`) are whole tokens, matched before BPE and decoded as text, placed
    before the special tokens (the EOS stays the last id)."""
    vocab = {sym: i for i, sym in enumerate(byte_alphabet())}
    merges = _learn_merges(_CORPUS, NUM_MERGES)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for tok in (*added_tokens, *SPECIAL_TOKENS):
        vocab[tok] = len(vocab)
    tok = build_bpe_tokenizer(vocab, merges, SPECIAL_TOKENS, added_tokens=added_tokens)
    save_hf_tokenizer(
        tok,
        path,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )
    return len(vocab)


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    if family not in _BASE_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(FAMILIES)}")
    config = dict(_BASE_CONFIGS[family])
    config["vocab_size"] = vocab_size
    config.update(overrides)
    return config


def _randomize(weights: dict[str, Any]) -> dict[str, Any]:
    """Normal(0, 1/fan_in) matrices: mlx's default init gives a model that repeats one token,
    this one gives varied greedy text (batching-exactness tests need distinct outputs)."""
    import mlx.core as mx

    out = {}
    for name, value in weights.items():
        if name.endswith("weight") and value.ndim == 2:
            value = mx.random.normal(value.shape) / value.shape[1] ** 0.5
        out[name] = value.astype(mx.float32)
    return out


def make_tiny_model(
    path: Path,
    family: str = "llama",
    seed: int = 0,
    added_tokens: tuple[str, ...] = (),
    **overrides: Any,
) -> Path:
    """Write a random-weight MLX model directory at `path` (created) and return it.

    `overrides` replace config.json keys (e.g. num_hidden_layers=4). The same family, seed
    and overrides always give the same weights. `added_tokens`: see write_tiny_tokenizer.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tiny_tokenizer(path, added_tokens)
    config = tiny_config(family, vocab_size, **overrides)
    config.setdefault("eos_token_id", vocab_size - 1)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = _randomize(dict(tree_flatten(model.parameters())))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
