"""Tiny random-weight models for fast tests: a complete MLX model directory in milliseconds.

`make_tiny_model(path, family)` writes config.json, model.safetensors (random float32
weights, deterministic per seed) and a small byte-level BPE tokenizer with a ChatML chat
template, loadable by `mlx_lm.load` and by `load_model`.

Families: "llama" (plain KVCache, can batch) and "lfm2" (hybrid ArraysCache + KVCache list,
which mlx-lm cannot batch), plus "mamba" (pure SSM, ArraysCache).

Why one module: mostly data: a base config per family for random-weight test models, next to
the one writer that turns any of them into a loadable directory.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
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
    for special in (*added_tokens, *SPECIAL_TOKENS):
        vocab[special] = len(vocab)
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
    from mlxcel.daemon.mlx_lm_compat import get_model_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tiny_tokenizer(path, added_tokens)
    config = tiny_config(family, vocab_size, **overrides)
    config.setdefault("eos_token_id", vocab_size - 1)
    model_cls, args_cls = get_model_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = _randomize(dict(tree_flatten(model.parameters())))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# ---------------------------------------------------------------- random models of a real size

# config.json shapes of real models (the published configs' sizes; random weights). "test" is
# a scaled-down shape through the same code path, for the unit tests.
SIZED_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3": {
        "test": {
            "hidden_size": 128,
            "num_hidden_layers": 3,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 1024,
            "max_position_embeddings": 4096,
        },
        "0.6b": {
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
        },
        "1.7b": {
            "hidden_size": 2048,
            "num_hidden_layers": 28,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
        },
        "4b": {
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "intermediate_size": 9728,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
        },
    },
}
_SIZED_BASE: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
}
DEFAULT_SHARD_BYTES = 512 << 20
# Random values are drawn this many float32 elements at a time (a 64 MiB slab): the largest
# float32 temporary while writing, whatever the model's size.
_SLAB_ELEMENTS = 16 << 20


@dataclass(frozen=True)
class SizedModel:
    """What make_sized_model wrote."""

    path: Path
    shards: tuple[str, ...]  # safetensors file names, in order
    size_bytes: int  # every file in the directory
    seconds: float
    peak_memory_bytes: int  # MLX's peak allocation while writing
    parameters: int  # logical weight count (before packing)
    config: dict[str, Any]


def write_padded_tokenizer(path: Path, vocab_size: int, model_max_length: int = 2048) -> int:
    """The tiny tokenizer with its vocabulary padded to `vocab_size` ids (ids a real-size
    random model can emit): the padding entries are short words (" ab", " abc", ...) that
    encoding never produces but decoding prints as text; the special tokens stay the last ids
    (the EOS is `vocab_size - 1`). Returns the vocabulary size."""
    from itertools import product
    from string import ascii_lowercase

    vocab = {sym: i for i, sym in enumerate(byte_alphabet())}
    merges = _learn_merges(_CORPUS, NUM_MERGES)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    space = bytes_to_unicode()[ord(" ")]
    want = vocab_size - len(SPECIAL_TOKENS)
    if want < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the tiny tokenizer's {len(vocab)}")
    for length in range(2, 6):
        if len(vocab) >= want:
            break
        for letters in product(ascii_lowercase, repeat=length):
            if len(vocab) >= want:
                break
            vocab.setdefault(space + "".join(letters), len(vocab))
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    tok = build_bpe_tokenizer(vocab, merges, SPECIAL_TOKENS)
    save_hf_tokenizer(
        tok,
        path,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
    )
    return len(vocab)


def sized_config(
    family: str, size: str, bits: int | None, group_size: int, **overrides: Any
) -> dict[str, Any]:
    """config.json of a `family` model of `size`, with mlx-lm's `quantization` block when
    `bits` is given."""
    shapes = SIZED_SHAPES.get(family)
    if shapes is None:
        raise ValueError(f"unknown sized family {family!r}; choose from {', '.join(SIZED_SHAPES)}")
    if size not in shapes:
        raise ValueError(f"unknown {family} size {size!r}; choose from {', '.join(shapes)}")
    if bits is not None and (bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128)):
        raise ValueError(
            f"bits {bits} / group_size {group_size}: MLX's affine format takes "
            "bits 2-6 or 8 and group sizes 32, 64, 128"
        )
    config = {**_SIZED_BASE[family], **shapes[size], **overrides}
    config["torch_dtype"] = "float32" if bits is None else "float16"
    if bits is not None:
        quant = {"group_size": group_size, "bits": bits}
        config["quantization"] = dict(quant)
        config["quantization_config"] = dict(quant)
    return config


def _param_plan(config: dict[str, Any], group_size: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, quantized) of every parameter of mlx-lm's model for `config`, in order.

    The model is built lazily (MLX evaluates nothing until asked), so this costs no weight
    memory; a weight is quantized when its module can be (`to_quantized`) and its rows split
    into whole groups, as mlx-lm's own quantize does."""
    from mlx.utils import tree_flatten
    from mlxcel.daemon.mlx_lm_compat import get_model_classes

    model_cls, args_cls = get_model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    quantizable = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if hasattr(module, "to_quantized")
        and getattr(module, "weight", None) is not None
        and module.weight.shape[-1] % group_size == 0
    }
    plan = [(k, tuple(v.shape), k in quantizable) for k, v in tree_flatten(model.parameters())]
    del model
    return sorted(plan)


def _random_tensor(
    shape: tuple[int, ...], seed: int, quantize: tuple[int, int] | None, dtype: Any
) -> dict[str, Any]:
    """Normal(0, 1/fan_in) values (ones for vectors: norms), drawn a slab of rows at a time;
    with `quantize` = (bits, group_size) each slab is quantized right away (groups lie along
    a row, so slabs quantize exactly as the whole matrix would). Returns {"weight", ...}."""
    import mlx.core as mx

    if len(shape) == 1:
        ones = mx.ones(shape, dtype=dtype)
        mx.eval(ones)
        return {"weight": ones}
    rows, cols = shape
    step = max(1, _SLAB_ELEMENTS // cols)
    parts: dict[str, list[Any]] = {}
    for n, start in enumerate(range(0, rows, step)):
        key = mx.random.key(seed * 1_000_003 + n)
        slab = mx.random.normal((min(step, rows - start), cols), key=key) * cols**-0.5
        slab = slab.astype(dtype)
        if quantize is None:
            pieces = {"weight": slab}
        else:
            wq, scales, biases = mx.quantize(slab, group_size=quantize[1], bits=quantize[0])
            pieces = {"weight": wq, "scales": scales, "biases": biases}
        mx.eval(*pieces.values())
        for k, v in pieces.items():
            parts.setdefault(k, []).append(v)
        del slab, pieces
    out = {k: v[0] if len(v) == 1 else mx.concatenate(v) for k, v in parts.items()}
    mx.eval(*out.values())
    return out


def make_sized_model(
    path: Path,
    family: str = "qwen3",
    size: str = "1.7b",
    bits: int | None = 4,
    group_size: int = 64,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    **overrides: Any,
) -> SizedModel:
    """Write a random-weight MLX model directory of a real model's shape at `path`.

    `bits` 4 or 8 (...): MLX's affine format as mlx-community ships it (uint32 packed weights,
    float16 scales and biases per `group_size` values, float16 norms) with the `quantization`
    block mlx-lm reads; `bits=None`: float32 everything. Tensors are made one at a time and
    written shard by shard (`model-00001-of-0000N.safetensors` + the index once there is more
    than one), so the memory it takes is about one shard plus one 64 MiB slab, never the
    model's float32 size. The tokenizer is the tiny one padded to the config's vocabulary."""
    import os
    import time

    import mlx.core as mx

    started = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = sized_config(family, size, bits, group_size, **overrides)
    vocab = write_padded_tokenizer(path, config["vocab_size"], config["max_position_embeddings"])
    config["eos_token_id"] = vocab - 1
    dtype = mx.float32 if bits is None else mx.float16
    plan = _param_plan(config, group_size)
    mx.clear_cache()
    mx.reset_peak_memory()
    live_before = mx.get_active_memory()  # another thread's arrays are not the writer's
    shards: list[tuple[str, list[str]]] = []
    pending: dict[str, Any] = {}
    pending_bytes = 0
    total_bytes = 0
    parameters = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f".shard-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(path / name), pending, metadata={"format": "mlx"})
        shards.append((name, sorted(pending)))
        pending, pending_bytes = {}, 0
        mx.clear_cache()

    for index, (name, shape, quantized) in enumerate(plan):
        quant = (bits, group_size) if quantized and bits is not None else None
        tensors = _random_tensor(shape, seed * 100_003 + index, quant, dtype)
        parameters += math.prod(shape)
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        for suffix, value in tensors.items():
            key = name if suffix == "weight" else f"{base}.{suffix}"
            pending[key] = value
            pending_bytes += value.nbytes
            total_bytes += value.nbytes
        del tensors
        if pending_bytes >= max_shard_bytes:
            flush()
    flush()
    names: list[str] = []
    weight_map: dict[str, str] = {}
    for n, (tmp_name, keys) in enumerate(shards):
        final = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        os.replace(path / tmp_name, path / final)
        names.append(final)
        weight_map.update(dict.fromkeys(keys, final))
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    size_bytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return SizedModel(
        path=path,
        shards=tuple(names),
        size_bytes=size_bytes,
        seconds=time.perf_counter() - started,
        peak_memory_bytes=max(0, int(mx.get_peak_memory()) - live_before),
        parameters=parameters,
        config=config,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m mlxcel.daemon.models.tiny sized DIR [--family qwen3] [--size 1.7b]
    [--bits 4|8|none] [--group-size 64] [--seed 0]`: write a random model of a real size."""
    import argparse
    import sys

    from mlxcel.shared.config import format_size

    p = argparse.ArgumentParser(prog="python -m mlxcel.daemon.models.tiny")
    sub = p.add_subparsers(dest="command", required=True)
    sized = sub.add_parser("sized", help="a random-weight model of a real model's shape")
    sized.add_argument("dir", type=Path)
    sized.add_argument("--family", default="qwen3", choices=sorted(SIZED_SHAPES))
    sized.add_argument("--size", default="1.7b")
    sized.add_argument("--bits", default="4", help="2-6 or 8 (MLX affine), or none: float32")
    sized.add_argument("--group-size", type=int, default=64)
    sized.add_argument("--seed", type=int, default=0)
    sized.add_argument("--max-shard-mb", type=int, default=DEFAULT_SHARD_BYTES >> 20)
    args = p.parse_args(argv)
    try:
        bits = None if args.bits.lower() in ("none", "float32", "0") else int(args.bits)
        made = make_sized_model(
            args.dir,
            family=args.family,
            size=args.size,
            bits=bits,
            group_size=args.group_size,
            seed=args.seed,
            max_shard_bytes=args.max_shard_mb << 20,
        )
    except (ValueError, OSError) as exc:
        print(f"mlxcel-tiny: error: {exc}", file=sys.stderr)
        return 1
    kind = "float32" if bits is None else f"{bits}-bit, group {args.group_size}"
    print(
        f"{made.path}: {args.family} {args.size} ({made.parameters / 1e9:.3f} B parameters, "
        f"{kind}), {len(made.shards)} shard(s), {format_size(made.size_bytes)} on disk, "
        f"made in {made.seconds:.1f} s (peak MLX memory {format_size(made.peak_memory_bytes)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
