"""The random-weight models of a real size (`mlxcel.daemon.models.tiny.make_sized_model`),
through a scaled-down shape (`size="test"`) on the very code path of the qwen3-1.7B one: it
loads with mlx-lm as a quantized model and gives finite logits, its `quantization` block
matches the tensors written, and the writer works shard by shard (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlxcel.daemon.models.tiny import SIZED_SHAPES, main, make_sized_model, sized_config

SHARD_BYTES = 64 << 10  # far below the test model's size: several shards


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory):
    return make_sized_model(
        tmp_path_factory.mktemp("sized") / "qwen3-test",
        size="test",
        bits=4,
        group_size=64,
        max_shard_bytes=SHARD_BYTES,
    )


def _headers(path: Path) -> dict[str, dict[str, dict]]:
    out = {}
    for shard in sorted(path.glob("model*.safetensors")):
        with shard.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        out[shard.name] = header
    return out


def test_loads_with_mlx_lm_quantized_and_gives_finite_logits(sized) -> None:
    import mlx.nn as nn
    from mlx_lm import load

    model, tokenizer = load(str(sized.path))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")  # qwen3's q/k norms
    ids = tokenizer.encode("What is the capital of France?")
    logits = model(mx.array([ids]))
    mx.eval(logits)
    assert logits.shape == (1, len(ids), SIZED_SHAPES["qwen3"]["test"]["vocab_size"])
    assert bool(mx.isfinite(logits).all())
    assert float(logits.astype(mx.float32).std()) > 0  # random weights, not zeros


def test_quantization_block_matches_the_tensors(sized) -> None:
    config = json.loads((sized.path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    assert config["quantization_config"] == config["quantization"]
    assert config["tie_word_embeddings"] is True and config["model_type"] == "qwen3"
    tensors = {k: v for h in _headers(sized.path).values() for k, v in h.items()}
    quantized = [k[: -len(".scales")] for k in tensors if k.endswith(".scales")]
    # every projection, the embedding (the tied head), nothing else; no lm_head
    layers = config["num_hidden_layers"]
    assert len(quantized) == 7 * layers + 1 and "model.embed_tokens" in quantized
    assert "lm_head.weight" not in tensors
    for base in quantized:
        w, s, b = (tensors[f"{base}.{x}"] for x in ("weight", "scales", "biases"))
        assert w["dtype"] == "U32" and s["dtype"] == b["dtype"] == "F16"
        rows, packed = w["shape"]
        in_features = packed * 32 // 4
        assert s["shape"] == b["shape"] == [rows, in_features // 64], base
    norms = [k for k in tensors if k.endswith("norm.weight")]
    assert len(norms) == 4 * layers + 1  # input, post-attention, q, k per layer; final
    assert all(tensors[k]["dtype"] == "F16" for k in norms)


def test_the_writer_works_shard_by_shard(sized) -> None:
    headers = _headers(sized.path)
    assert list(headers) == list(sized.shards) and len(sized.shards) >= 3
    index = json.loads((sized.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {k for h in headers.values() for k in h}
    largest = max(
        v["data_offsets"][1] - v["data_offsets"][0] for h in headers.values() for v in h.values()
    )
    for name in sized.shards:
        # a shard is flushed once it reaches the limit: at most one tensor past it
        assert (sized.path / name).stat().st_size <= SHARD_BYTES + largest + (16 << 10), name
    # never the float32 model in memory: MLX's peak stays below half its float32 size
    assert sized.peak_memory_bytes < sized.parameters * 4 / 2
    assert sized.size_bytes == sum(f.stat().st_size for f in sized.path.iterdir())


def test_tokenizer_is_padded_to_the_config_vocabulary(sized) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sized.path))
    vocab = SIZED_SHAPES["qwen3"]["test"]["vocab_size"]
    assert len(tok) == vocab
    assert tok.convert_tokens_to_ids("<|im_end|>") == vocab - 1 == sized.config["eos_token_id"]
    assert tok.decode([vocab - 100]).strip().isalpha()  # a padding id prints as a word


def test_float32_variant_and_the_command_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "f32"
    assert main(["sized", str(out), "--size", "test", "--bits", "none"]) == 0
    line = capsys.readouterr().out
    assert "float32" in line and "on disk" in line and "made in" in line
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config
    dtypes = {v["dtype"] for h in _headers(out).values() for v in h.values()}
    assert dtypes == {"F32"}
    assert main(["sized", str(tmp_path / "bad"), "--size", "70b"]) == 1
    assert "mlxcel-tiny: error: unknown qwen3 size '70b'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="group sizes"):
        sized_config("qwen3", "test", bits=4, group_size=48)
