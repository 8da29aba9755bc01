"""GGUF quant types converted exactly (daemon/models/gguf_read.py; docs/models.md).

Each tiny file here is written with the `gguf` package (GGUFWriter; `gguf.quants.quantize`
for the 32-element types, hand-made blocks of random codes for the K-quants, which the package
cannot quantize). The reference never goes through our converter: `gguf.quants.dequantize`
of the file's tensors, un-permuted by hand, loaded by stock mlx-lm from a plain float32
directory (tests/gguf_builders.py). Our conversion must give those values exactly (MLX's own
dequantize of the affine triples), and its forward the reference's logits within 1e-4. The
default model's own GGUF converting as before is tests/e2e/test_gguf_smollm2.py's.
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
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_builders import (
    HEADS,
    HIDDEN,
    KV_HEADS,
    add_kv,
    arch_keys,
    llama_config,
    logits,
    reference_model,
    tensor_names,
    write_gguf,
)
from mlx.utils import tree_flatten
from mlxcel.daemon.models import ModelLoadError, convert_gguf, load_model
from mlxcel.daemon.models.gguf import load_gguf, read_gguf
from mlxcel.daemon.models.gguf_read import convert_tensor
from tiny_gguf import permute_qk


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


def test_our_reader_gives_the_gguf_packages_metadata_and_tensors(tmp_path: Path) -> None:
    """gguf_read serves from its own reader of the vetted header (gguf_vet.read_metadata, and
    the tensors' bytes at the vetted offsets): every metadata value type, arrays included,
    comes out as the `gguf` package's reader gives it, and every tensor converts the same."""
    from mlxcel.daemon.models.gguf_read import read_gguf_file
    from mlxcel.daemon.models.gguf_vet import read_metadata, vet_gguf

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25, -3.0])
    writer.add_array("t.strs", ["a", "ü", "", "<0x0A>"])
    writer.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(2)
    values = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", values)
    writer.add_tensor("f16", values.astype(np.float16))
    for qtype in (Q.Q8_0, Q.Q4_1, Q.BF16):
        blocks = quantize(values, qtype)
        writer.add_tensor(qtype.name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(str(path))
    want: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            want[key] = value.item() if isinstance(value, np.generic) else value
    header = vet_gguf(path)
    got = read_metadata(path, header)
    assert got == want
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
    assert got["t.strs"] == ["a", "ü", "", "<0x0A>"] and got["t.u64"] == 2**63 + 5

    meta, tensors = read_gguf_file(path, header)
    assert meta == want and len(tensors) == len(reader.tensors) == 5
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        expected = convert_tensor(tensor.name, tensor.tensor_type, tensor.data, shape)
        ours = tensors[tensor.name]
        assert (ours.source_type, ours.target) == (expected.source_type, expected.target)
        assert ours.arrays.keys() == expected.arrays.keys()
        for part, array in expected.arrays.items():
            assert ours.arrays[part].dtype == array.dtype, (tensor.name, part)
            assert mx.array_equal(ours.arrays[part], array).item(), (tensor.name, part)


def test_the_footprint_of_a_quantized_gguf_is_what_its_load_keeps(
    tokenizer_meta: dict[str, Any], tmp_path: Path
) -> None:
    """The model host's estimate before a load reads the file's family from its metadata
    (gguf_vet.read_metadata): a Q8_0 llama stays packed on the CPU, and the estimate counts it
    packed."""
    from mlxcel.daemon.models.footprint import resident_weight_bytes

    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**arch_keys("llama", vocab), **tokenizer_meta}
    path = write_gguf(tmp_path / "q8.gguf", "llama", meta, tensor_names("llama"), lambda _: Q.Q8_0)
    loaded = load_model(str(path)).info.weights_bytes
    # within 15 % above what the load kept (1.69 vs 1.53 MB here); expanded to float32, as a
    # family it could not read would count it, 5.4 MB
    assert loaded <= resident_weight_bytes(path, "cpu") <= 1.15 * loaded
