"""GGUF quant types converted exactly (daemon/models/gguf_read.py; docs/models.md).

Each tiny file here is written with the `gguf` package (GGUFWriter; `gguf.quants.quantize`
for the 32-element types, hand-made blocks of random codes for the K-quants, which the package
cannot quantize). The reference never goes through our converter: `gguf.quants.dequantize`
of the file's tensors, un-permuted by hand, loaded by stock mlx-lm from a plain float32
directory. Our conversion must give those values exactly (MLX's own dequantize of the affine
triples), and its forward the reference's logits within 1e-4.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlxcel.daemon.models import ModelLoadError, convert_gguf, load_model
from mlxcel.daemon.models.gguf import load_gguf, read_gguf
from mlxcel.daemon.models.gguf_read import convert_tensor
from tiny_gguf import gguf_metadata, permute_qk

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


def dequantized_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Every weight of a loaded model as float32, quantized layers through mx.dequantize."""
    out = {}
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        if f"{base}.scales" in params:
            module = dict(model.named_modules())[base]
            value = mx.dequantize(
                value,
                params[f"{base}.scales"].astype(mx.float32),
                params[f"{base}.biases"].astype(mx.float32),
                group_size=module.group_size,
                bits=module.bits,
            )
        out[name] = np.array(value.astype(mx.float32))
    return out


@pytest.fixture(scope="module")
def tokenizer_meta(tiny_model_dir: Path) -> dict[str, Any]:
    return {k: v for k, v in gguf_metadata(tiny_model_dir).items() if k.startswith("tokenizer.")}


QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_each_quant_type_converts_exactly_and_runs_as_mlx_lm(
    qtype: Q, tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("llama", vocab), **tokenizer_meta}
    path = write_gguf(
        tmp_path / f"{qtype.name}.gguf", "llama", meta, tensor_names("llama"), lambda _name: qtype
    )
    ref_model, ref = reference_model(path, "llama", llama_config(vocab), tmp_path / "ref")

    model, tokenizer, _ = load_gguf(path)
    got = dequantized_params(model)
    assert set(got) == set(ref)
    for name, values in ref.items():
        # llama.cpp's q/k permutation is ours to keep (rope_traditional): compare the file's
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            n = HEADS if "q_proj" in name else KV_HEADS
            values = np.array(permute_qk(mx.array(values), n))
        np.testing.assert_array_equal(got[name], values, err_msg=name)

    expect_affine = qtype not in (Q.Q6_K, Q.F16, Q.BF16)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) is expect_affine
    if expect_affine:
        assert q_proj.group_size == 32
        assert q_proj.bits == {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4}.get(qtype, 5)
        k_quant = qtype in (Q.Q4_K, Q.Q5_K)
        assert q_proj.scales.dtype == (mx.float32 if k_quant else mx.float16)

    # What the daemon serves (load_model: float32 on the CPU) against stock mlx-lm.
    ids = tokenizer.encode("The quick brown fox, 1234!")
    served = load_model(str(path)).model
    np.testing.assert_allclose(logits(served, ids), logits(ref_model, ids), atol=1e-4, rtol=2e-6)

    # The converted directory keeps the affine layers (bits per layer), stock mlx-lm builds
    # it, and it serves the same logits.
    out = convert_gguf(path, tmp_path / "dir")
    stored = json.loads((out / "config.json").read_text())
    assert ("quantization" in stored) is expect_affine
    stock, _ = mlx_lm.load(str(out))
    assert isinstance(stock.model.layers[0].self_attn.q_proj, nn.QuantizedLinear) is expect_affine
    converted = load_model(str(out)).model
    np.testing.assert_allclose(logits(converted, ids), logits(ref_model, ids), atol=1e-4, rtol=2e-6)


def test_a_q4_k_m_style_mix_keeps_each_layers_bits(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    """What Q4_K_M files hold: Q4_K mostly, Q6_K for ffn_down and the head, Q5_K here and
    there; the config's quantization names each layer that is not 4-bit."""
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("llama", vocab), **tokenizer_meta}

    def qtype_of(name: str) -> Q:
        if "ffn_down" in name or name == "output.weight":
            return Q.Q6_K
        return Q.Q5_K if "attn_v" in name else Q.Q4_K

    path = write_gguf(tmp_path / "mix.gguf", "llama", meta, tensor_names("llama"), qtype_of)
    contents = read_gguf(path)
    quant = contents.config["quantization"]
    assert quant["bits"] == 4 and quant["group_size"] == 32
    assert quant["model.layers.0.self_attn.v_proj"] == {"group_size": 32, "bits": 5}
    assert "model.layers.0.mlp.down_proj.scales" not in contents.weights
    assert contents.weights["lm_head.weight"].dtype == mx.float32
    ref_model, _ = reference_model(path, "llama", llama_config(vocab), tmp_path / "ref")
    loaded = load_model(str(path))
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = tokenizer.encode("Hello there")
    np.testing.assert_allclose(logits(model, ids), logits(ref_model, ids), atol=1e-4, rtol=2e-6)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.TQ2_0], ids=lambda q: q.name)
def test_other_types_are_refused_at_pull_naming_the_tensor_type(
    qtype: Q, tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    from mlxcel.daemon.models.pull import pull

    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("llama", vocab), **tokenizer_meta}
    rng = np.random.default_rng(0)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(HIDDEN, HIDDEN // block * size), dtype=np.uint8)
    path = write_gguf(
        tmp_path / "odd.gguf", "llama", meta, tensor_names("llama"), lambda _n: Q.Q8_0
    )
    # the same file with one tensor of the odd type
    writer_meta = meta
    odd = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(odd), "llama")
    for key, value in writer_meta.items():
        add_kv(writer, key, value)
    for t in gguf.GGUFReader(str(path)).tensors:
        data = np.asarray(t.data)
        if t.name == "blk.1.attn_output.weight":
            writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        elif t.tensor_type == Q.F32:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as info:
        pull(str(odd), name="odd", progress=None)
    message = str(info.value)
    assert f"'blk.1.attn_output.weight' has type {qtype.name}" in message, message
    assert "\n" not in message
    with pytest.raises(ModelLoadError, match=f"has type {qtype.name}"):
        load_gguf(odd)


def test_convert_tensor_bf16_and_f16_stay_as_they_are() -> None:
    values = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    bf16 = quantize(values, Q.BF16)
    got = convert_tensor("x", Q.BF16, bf16, (4, 32)).arrays[""]
    assert got.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), dequantize(bf16, Q.BF16))
    f16 = values.astype(np.float16)
    got = convert_tensor("x", Q.F16, f16, (4, 32)).arrays[""]
    assert got.dtype == mx.float16 and np.array_equal(np.array(got), f16)


# --- the default model converts as before ---------------------------------------------------

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


@pytest.mark.e2e
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


def test_a_file_too_large_to_convert_is_refused_with_the_figure_before_reading(
    tokenizer_meta: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.daemon.models import gguf_read
    from mlxcel.daemon.models.pull import pull

    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("llama", vocab), **tokenizer_meta}
    path = write_gguf(tmp_path / "big.gguf", "llama", meta, tensor_names("llama"), lambda _: Q.Q6_K)
    from mlxcel.daemon.models.gguf_vet import vet_gguf

    header = vet_gguf(path)
    weights, _ = gguf_read.conversion_memory(header)
    elements = sum(int(np.prod(t.shape)) for t in header.tensors if t.ggml_type == "Q6_K")
    assert weights >= elements * 4  # Q6_K widens to float32
    monkeypatch.setattr(gguf_read, "available_memory", lambda: weights // 2)
    read = []
    from mlxcel.daemon.models import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "read_gguf_file", lambda *a: read.append(a))
    with pytest.raises(ModelLoadError) as info:
        pull(str(path), name="big", progress=None)
    message = str(info.value)
    assert message.startswith("converting big.gguf needs about ") and "is available" in message
    assert "\n" not in message and not read  # refused before any tensor was read
