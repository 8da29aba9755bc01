"""GGUF files (llama, qwen2/3, gemma 1-3, phi3) → mlx-lm models (in memory or as a dir).

`gguf_read.read_gguf_file` reads the vetted file: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and
Q4_K/Q5_K tensors become MLX affine-quantized triples (weight, scales, biases; group size 32),
exactly the file's values, so the converted directory keeps them quantized (small, and what
Metal runs fastest); Q6_K becomes float32 (exact; MLX has no group size 16); the loader
dequantizes for the CPU in float32. The other float tensors (norms) are stored in the scales'
dtype when that is lossless, so a GPU runs the model in float16 throughout (a float32 norm
would promote activations and the KV cache to float32). llama.cpp permutes q/k of `llama`
files for interleaved RoPE, hence `rope_traditional: true` there (qwen2, qwen3, gemma and
phi3 use NeoX RoPE and are not permuted); a `rope_freqs` tensor (Llama 3.1/3.2) becomes
mlx-lm's `llama3` RoPE scaling, Phi-3's rope_factors_long/short its LongRoPE; gemma's norms
are stored as 1 + w (mlx-lm adds the 1 itself); phi3 keeps q/k/v and gate/up fused. The
tokenizer is rebuilt from the vocabulary in the file (GPT-2 BPE or SentencePiece).

Why one module: the GGUF conversion: the architecture table, the tokenizer's translation and
`convert_gguf` apply one mapping of names and keys; reading (`gguf_read.py`), inspection
(`gguf_info.py`) and vetting (`gguf_vet.py`) are modules of their own.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlxcel.daemon.models.gguf_info import source_info, write_source_info
from mlxcel.daemon.models.gguf_read import Converted, check_conversion_memory, read_gguf_file
from mlxcel.daemon.models.gguf_vet import check_gguf_loads
from mlxcel.daemon.models.hf_tokenizer import (
    add_bos_processor,
    build_bpe_tokenizer,
    build_spm_tokenizer,
    save_hf_tokenizer,
)
from mlxcel.daemon.models.info import ModelLoadError

log = logging.getLogger(__name__)

GROUP_SIZE = 32
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
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
}
# GGUF architecture -> (mlx-lm model_type, HF class). llama.cpp writes Mistral 7B and its
# kin as "llama" (it ignores their sliding window, as mlx-lm's llama does).
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
_GEMMAS = {"gemma", "gemma2", "gemma3"}
# Gemma 2/3 have a norm after attention and one before and after the MLP.
_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's 27B models (by layer count) scale queries by hidden / heads, not head_dim
# (llama-model.cpp, after gemma_pytorch's config), as their HF query_pre_attn_scalar says.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Phi-3 keeps q/k/v and gate/up fused, in llama.cpp as in mlx-lm (gate first, then up).
_PHI3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_up"},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_PERMUTED_QK = {"llama"}  # llama.cpp's converter permutes these for interleaved RoPE
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's tokenizer.json split (llama.cpp's "qwen2" pre-tokenizer: Qwen2, Qwen2.5, Qwen3).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PRE = {"qwen2", "stablelm2", "deepseek-r1-qwen"}
# llama.cpp pre-tokenizer names → how HF splits: GPT-2 regex with single digits, or Llama 3.
_DIGIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "smaug-bpe", "falcon3"}
_GPT2_PRE = {"default", "gpt2", "gpt-2"}
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4


@dataclass
class GGUFContents:
    config: dict[str, Any]  # an mlx-lm llama config.json
    weights: dict[str, mx.array]  # mlx-lm names; quantized layers as (weight, scales, biases)
    metadata: dict[str, Any]
    source_types: dict[str, str] | None = None  # GGUF tensor name -> ggml type in the file
    targets: dict[str, str] | None = None  # GGUF tensor name -> what it became
    architecture: str = "llama"


def _plain(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _mlx_name(name: str, arch: str = "llama") -> str:
    parts = name.split(".")
    layer_names = _LAYER_NAMES
    if arch == "phi3":
        layer_names = _PHI3_LAYER_NAMES
    elif arch in ("gemma2", "gemma3"):
        layer_names = _GEMMA2_LAYER_NAMES
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ModelLoadError(f"unsupported tensor {name!r} in GGUF file (only plain llama layers)")


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's config "quantization": the common bit width plus per-layer exceptions."""
    bits_by_layer = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            layer = name.removesuffix(".scales")
            packed = weights[f"{layer}.weight"].shape[-1]
            bits_by_layer[layer] = packed * 32 // (scales.shape[-1] * GROUP_SIZE)
    if not bits_by_layer:
        return None
    common = Counter(bits_by_layer.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    for layer, bits in sorted(bits_by_layer.items()):
        if bits != common:
            quant[layer] = {"group_size": GROUP_SIZE, "bits": bits}
    return quant


def _check_supported(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear", "llama3"):
        raise ModelLoadError(f"GGUF RoPE scaling {scaling!r} is not supported")
    return str(arch)


def _llama3_factors(config: dict[str, Any]) -> np.ndarray:
    """The per-frequency multipliers mlx-lm's `Llama3RoPE` applies (llama.cpp's rope_freqs)."""
    rs, dims, base = config["rope_scaling"], config["head_dim"], config["rope_theta"]
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelens = 2 * np.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (old / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelens > old / low, factor, 1.0)
    return np.where((wavelens > old / high) & (wavelens < old / low), medium, out)


def _llama3_scaling(meta: dict[str, Any], arch: str, freqs: np.ndarray, config: dict[str, Any]):
    """mlx-lm's llama3 `rope_scaling` that reproduces the file's rope_freqs: the scaling keys
    the file has (else Llama 3's defaults: low 1, high 4, 8192), or else the ones fitted to
    its smoothly scaled frequencies; a tensor no such scaling matches is refused."""
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    if np.all(freqs == 1.0):
        return None

    def key(name: str, default: float) -> float:
        value = _plain(meta.get(f"{arch}.rope.scaling.{name}"))
        return float(value) if value is not None else default

    factor = key("factor", float(freqs.max()))
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": key("low_freq_factor", 1.0),
        "high_freq_factor": key("high_freq_factor", 4.0),
        "original_max_position_embeddings": int(key("original_context_length", 8192)),
    }
    trial = {**config, "rope_scaling": scaling}
    if len(freqs) == config["head_dim"] // 2:
        if np.allclose(_llama3_factors(trial), freqs, rtol=1e-5):
            return scaling
        dims, base = config["head_dim"], config["rope_theta"]
        wavelens = 2 * np.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
        mid = (freqs > 1.0) & (freqs < factor)
        if mid.sum() >= 2 and factor > 1:
            smooth = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)  # = a / wavelen - b
            a, neg_b = np.polyfit(1 / wavelens[mid], smooth, 1)
            if a > 0 and neg_b < 0:
                scaling["high_freq_factor"] = 1.0 - 1.0 / neg_b
                scaling["original_max_position_embeddings"] = int(np.rint(a / -neg_b))
                fitted = {**config, "rope_scaling": scaling}
                if np.allclose(_llama3_factors(fitted), freqs, rtol=1e-5):
                    return scaling
    raise ModelLoadError(
        f"GGUF rope_freqs ({len(freqs)} values, up to {freqs.max():g}) match no Llama 3 RoPE "
        "scaling mlx-lm computes"
    )


def _config(meta: dict[str, Any], weights: dict[str, mx.array], arch: str = "llama") -> dict:
    def key(name: str, default: Any = None) -> Any:
        value = _plain(meta.get(f"{arch}.{name}", default))
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return value

    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    model_type, hf_class = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_traditional": arch in _PERMUTED_QK,
        "max_position_embeddings": int(key("context_length", 4096)),
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in weights,
    }
    rope_dims = _plain(meta.get(f"{arch}.rope.dimension_count"))
    if arch == "phi3" and rope_dims is not None and int(rope_dims) != config["head_dim"]:
        config["partial_rotary_factor"] = int(rope_dims) / config["head_dim"]
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(key("rope.scaling.factor"))}
    for field in ("bos", "eos"):
        token_id = _plain(meta.get(f"tokenizer.ggml.{field}_token_id"))
        if token_id is not None:
            config[f"{field}_token_id"] = int(token_id)
    # llama.cpp ends generation at any end-of-generation token: EOS, end of turn (Llama 3's
    # <|eot_id|>, Gemma's <end_of_turn>), end of message; mlx-lm stops at each id listed.
    stops = [config["eos_token_id"]] if "eos_token_id" in config else []
    for field in ("eot", "eom"):
        token_id = _plain(meta.get(f"tokenizer.ggml.{field}_token_id"))
        if token_id is not None and int(token_id) not in stops and int(token_id) >= 0:
            stops.append(int(token_id))
    if len(stops) > 1:
        config["eos_token_id"] = stops
    quant = _quantization(weights)
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def read_gguf(path: Path) -> GGUFContents:
    """Tensors (mlx-lm names) and an mlx-lm config from a llama-family GGUF file.

    The header is vetted and the file's first `mx.load` runs in a child process first
    (`check_gguf_loads`): a crafted file that would crash MLX's reader is refused with one
    line instead of taking the process (the daemon) down."""
    header = check_gguf_loads(Path(path))
    check_conversion_memory(Path(path), header)
    meta, tensors = read_gguf_file(Path(path), header)
    with _metadata_errors(path):
        arch = _check_supported(meta)
        rope_freqs = tensors.pop("rope_freqs.weight", None)
        long_factors = tensors.pop("rope_factors_long.weight", None)
        short_factors = tensors.pop("rope_factors_short.weight", None)
        weights = _mlx_weights(tensors, arch)
        config = _config(meta, weights, arch)
        if arch not in ("llama", "phi3", "gemma3") and config.get("rope_scaling"):
            raise ModelLoadError(f"GGUF RoPE scaling in a {arch} file is not supported")
        if long_factors is not None or short_factors is not None:
            if arch != "phi3" or long_factors is None or short_factors is None:
                raise ModelLoadError(
                    f"GGUF rope_factors tensors in a {arch} file are not supported"
                )
            _phi3_longrope(meta, config, long_factors, short_factors)
        if rope_freqs is not None and arch != "llama":
            raise ModelLoadError(f"GGUF rope_freqs in a {arch} file is not supported")
        if rope_freqs is not None:
            freqs = np.array(rope_freqs.arrays[""].astype(mx.float32))
            scaling = _llama3_scaling(meta, arch, freqs, config)
            if scaling is not None:
                config["rope_scaling"] = scaling
        if arch in _GEMMAS:
            _gemma_fixups(weights, arch)
            _gemma_config(meta, arch, config)
        log.info("GGUF %s: %s", Path(path).name, _describe_conversion(tensors))
        types = {name: c.source_type for name, c in tensors.items()}
        targets = {name: c.target for name, c in tensors.items()}
        return GGUFContents(config, weights, meta, types, targets, arch)


def _phi3_longrope(
    meta: dict[str, Any], config: dict[str, Any], long: Converted, short: Converted
) -> None:
    """Phi-3's LongRoPE (128k variants): llama.cpp's rope_factors_long/short tensors are the
    config's long_factor/short_factor lists; mlx-lm's SuScaledRoPE takes them as they are."""

    def factors(c: Converted) -> list[float]:
        return [float(x) for x in np.array(c.arrays[""].astype(mx.float32)).reshape(-1)]

    original = _plain(meta.get("phi3.rope.scaling.original_context_length"))
    if original is None:
        raise ModelLoadError("GGUF metadata lacks phi3.rope.scaling.original_context_length")
    config["rope_scaling"] = {
        "type": "longrope",
        "long_factor": factors(long),
        "short_factor": factors(short),
    }
    config["original_max_position_embeddings"] = int(original)


def _mlx_weights(tensors: dict[str, Converted], arch: str = "llama") -> dict[str, mx.array]:
    """mlx-lm names for the converted tensors (".scales"/".biases" beside a quantized one)."""
    weights: dict[str, mx.array] = {}
    for name, converted in tensors.items():
        mlx = _mlx_name(name, arch)
        base = mlx.removesuffix(".weight")
        for suffix, value in converted.arrays.items():
            weights[f"{base}{suffix}" if suffix else mlx] = value
    return weights


def _gemma_fixups(weights: dict[str, mx.array], arch: str = "gemma") -> None:
    """llama.cpp stores every Gemma RMSNorm weight (q/k norms too) as 1 + w (ggml multiplies
    by the weight); mlx-lm's Gemma modules add the 1 themselves. Gemma 1/2 tie the head to
    the embedding (mlx-lm has no lm_head for them)."""
    for name in list(weights):
        if name.endswith("norm.weight"):
            weights[name] = weights[name].astype(mx.float32) - 1.0
    if "lm_head.weight" in weights and arch != "gemma3":
        raise ModelLoadError(f"GGUF {arch} file has an output.weight ({arch} ties its head)")


def _gemma_config(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> None:
    """Gemma 2/3 settings llama.cpp reads from the file or fixes in its code."""
    if arch == "gemma":
        return

    def key(name: str) -> Any:
        return _plain(meta.get(f"{arch}.{name}"))

    big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    heads = config["num_attention_heads"]
    config["query_pre_attn_scalar"] = config["hidden_size"] // heads if big else config["head_dim"]
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(name) is not None:
                config[name] = float(key(name))
        return
    if key("final_logit_softcapping"):
        raise ModelLoadError("GGUF gemma3 files with final_logit_softcapping are not supported")
    window = key("attention.sliding_window")
    # llama.cpp: every sixth layer global, the others a sliding window with RoPE base 10000
    config["sliding_window"] = int(window) if window else 1
    config["sliding_window_pattern"] = 6 if window else 1
    config["rope_local_base_freq"] = 10000.0


def _describe_conversion(tensors: dict[str, Converted]) -> str:
    counts = Counter(f"{c.source_type} -> {c.target}" for c in tensors.values())
    return "; ".join(f"{n} x {kind}" for kind, n in sorted(counts.items()))


@contextmanager
def _metadata_errors(path: Path) -> Iterator[None]:
    """Metadata of the wrong type or shape (a string where a count belongs, a token id past
    the vocabulary) is one line, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ModelLoadError(
            f"GGUF file {Path(path).name} has unusable metadata ({type(exc).__name__}: {exc})"
        ) from None


def _pre_tokenizer_args(pre: str) -> dict[str, Any]:
    if pre in _DIGIT_PRE:
        return {"digits_individual": True}
    if pre in _LLAMA3_PRE:
        return {"split_regex": _LLAMA3_SPLIT, "ignore_merges": True}
    if pre in _QWEN2_PRE:
        return {"split_regex": _QWEN2_SPLIT}
    if pre not in _GPT2_PRE:
        log.warning("GGUF pre-tokenizer %r is unknown; using the GPT-2 split pattern", pre)
    return {}


def write_gguf_tokenizer(meta: dict[str, Any], out_dir: Path, context_length: int) -> None:
    """Rebuild the tokenizer in the metadata (GPT-2 byte-level BPE, "gpt2", or SentencePiece,
    "llama") as HF tokenizer files, with its special tokens, BOS/EOS and chat template."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"GGUF tokenizer {kind!r} is not supported (only 'gpt2', byte-level BPE, and "
            "'llama', SentencePiece)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _plain(meta.get("tokenizer.ggml.token_type")) or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        vocab.setdefault(text, token_id)

    def token(field: str) -> str | None:
        token_id = _plain(meta.get(f"tokenizer.ggml.{field}_token_id"))
        return tokens[int(token_id)] if token_id is not None else None

    if kind == "llama":
        scores = _plain(meta.get("tokenizer.ggml.scores")) or [0.0] * len(tokens)
        tok = build_spm_tokenizer(
            tokens,
            scores,
            types,
            add_space_prefix=bool(_plain(meta.get("tokenizer.ggml.add_space_prefix", True))),
            unk_token=token("unknown"),
        )
    else:
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = build_bpe_tokenizer(
            vocab,
            merges,
            special_tokens=[t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL_TOKEN],
            added_tokens=[
                t for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED_TOKEN
            ],
            **_pre_tokenizer_args(str(meta.get("tokenizer.ggml.pre", "default"))),
        )

    bos, eos = token("bos"), token("eos")
    # llama.cpp's defaults: SentencePiece vocabularies add BOS unless the file says not
    add_bos = _plain(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = _plain(meta.get("tokenizer.ggml.add_eos_token", False))
    if bos is not None and add_bos:
        tail = (eos, vocab[eos]) if add_eos and eos is not None else None
        add_bos_processor(tok, bos, vocab[bos], tail)
    if eos is None:
        raise ModelLoadError("GGUF metadata lacks tokenizer.ggml.eos_token_id")
    save_hf_tokenizer(
        tok,
        out_dir,
        eos_token=eos,
        bos_token=bos,
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=context_length,
    )


def _cast_weights(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Dequantize the triples (scales in float32: float16 rounding would lose bits) and cast."""
    out = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{layer}.scales" in weights:
            scales = weights[f"{layer}.scales"].astype(mx.float32)
            biases = weights[f"{layer}.biases"].astype(mx.float32)
            bits = value.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
            value = mx.dequantize(value, scales, biases, group_size=GROUP_SIZE, bits=bits)
        out[name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    return out


def _compact_floats(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Store non-quantized float tensors in the scales' dtype where that loses nothing."""
    scale_dtypes = {v.dtype for k, v in weights.items() if k.endswith(".scales")}
    if len(scale_dtypes) != 1:
        return weights
    target = scale_dtypes.pop()
    out = {}
    for name, value in weights.items():
        layer = name.rsplit(".", 1)[0]
        plain = f"{layer}.scales" not in weights and mx.issubdtype(value.dtype, mx.floating)
        if plain and value.dtype != target:
            narrow = value.astype(target)
            if mx.array_equal(narrow.astype(value.dtype), value).item():
                value = narrow
            else:
                log.warning("%s is not exact in %s: kept as %s", name, target, value.dtype)
        out[name] = value
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str | None = None) -> Path:
    """Write an MLX model directory for `gguf_path` into `out_dir` (created) and return it.

    `dtype` None keeps the GGUF's quantized layers quantized (other float tensors in the scales'
    dtype where lossless); "float32"/"float16"/"bfloat16" dequantizes everything to that dtype.
    """
    contents = read_gguf(Path(gguf_path))
    config, weights = contents.config, contents.weights
    if dtype is None:
        weights = _compact_floats(weights)
    else:
        weights = _cast_weights(weights, getattr(mx, dtype))
        config = {
            k: v for k, v in config.items() if k not in ("quantization", "quantization_config")
        }
        config["torch_dtype"] = dtype
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _metadata_errors(gguf_path):
        write_gguf_tokenizer(contents.metadata, out_dir, config["max_position_embeddings"])
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    info = source_info(
        Path(gguf_path).name,
        contents.architecture,
        contents.source_types or {},
        contents.targets or {},
    )
    if dtype is not None:
        info["converted_to"] = {cls: dtype for cls in info["tensor_types"]}
    write_source_info(out_dir, info)
    return out_dir


def build_model(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """An mlx-lm model from a config and in-memory weights (what `mlx_lm.load` does on disk)."""
    from mlxcel.daemon.mlx_lm_compat import get_model_classes

    model_cls, args_cls = get_model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quant = config.get("quantization")
    if quant is not None:

        def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
            if path in quant:
                return quant[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, quant["group_size"], quant["bits"], class_predicate=predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_gguf(path: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """(model, TokenizerWrapper, config) straight from a GGUF file, without a model dir."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    contents = read_gguf(Path(path))
    model = build_model(contents.config, contents.weights)
    with tempfile.TemporaryDirectory(prefix="mlxcel-gguf-tok-") as tmp, _metadata_errors(path):
        write_gguf_tokenizer(
            contents.metadata, Path(tmp), contents.config["max_position_embeddings"]
        )
        tokenizer = load_tokenizer(Path(tmp), eos_token_ids=contents.config.get("eos_token_id"))
    return model, tokenizer, contents.config
