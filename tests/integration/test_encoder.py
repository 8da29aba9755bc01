"""The MLX encoder of embedding-only models (daemon/models/encoder/): its vectors equal a numpy
reference implementation of BERT (tests/encoder_fixtures.py, written from HF's definition) for
bert and xlm-roberta configs, a padded row gives the vector it has alone, pooling and
normalisation follow the sentence-transformers files, HF weight names load with or without
their prefix, and what cannot be served is refused in one line (docs/models.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from encoder_fixtures import (
    make_encoder_dir,
    make_nomic_dir,
    nomic_reference_hidden,
    read_dir,
    reference_vector,
)

TEXTS = [
    "the cat sat on the mat",
    "dogs",
    "central bank interest rates rise while the stock market fell, money!",
]


def load(path: Path) -> Any:
    from mlxcel.daemon.models import load_model

    return load_model(str(path))


def vectors(loaded: Any, texts: list[str]) -> np.ndarray:
    from mlxcel.daemon.models.encoder.encoder_engine import embed_rows

    rows = [loaded.tokenizer.encode(t) for t in texts]
    return np.array(embed_rows(loaded.model, rows))


@pytest.mark.parametrize(
    ("model_type", "pooling", "normalize", "act"),
    [
        ("bert", "mean", True, "gelu"),
        ("bert", "cls", False, "gelu"),
        ("xlm-roberta", "mean", True, "gelu"),
        ("xlm-roberta", "max", False, "gelu"),
    ],
)
def test_matches_numpy_reference_in_a_padded_batch(
    tmp_path: Path, model_type: str, pooling: str, normalize: bool, act: str
) -> None:
    path = make_encoder_dir(
        tmp_path / "enc", model_type, pooling=pooling, normalize=normalize, hidden_act=act
    )
    loaded = load(path)
    assert loaded.info.kind == "embedding" and not loaded.info.generative
    assert (loaded.info.pooling, loaded.info.normalize) == (pooling, normalize)
    config, weights = read_dir(path)
    batch = vectors(loaded, TEXTS)  # right-padded to the longest
    for text, got in zip(TEXTS, batch, strict=True):
        ids = loaded.tokenizer.encode(text)
        want = reference_vector(config, weights, ids, pooling, normalize)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        alone = vectors(loaded, [text])[0]
        np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)
    norms = np.linalg.norm(batch, axis=1)
    if normalize:
        np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    else:
        assert not np.allclose(norms, 1.0, atol=1e-3)


def test_xlm_roberta_positions_start_after_padding_idx(tmp_path: Path) -> None:
    """The same weights read as BERT (positions from 0) give another vector: the offset is
    what makes the reference match above."""
    from mlxcel.daemon.models.encoder.model import EncoderArgs

    path = make_encoder_dir(tmp_path / "enc", "xlm-roberta")
    config = json.loads((path / "config.json").read_text())
    args = EncoderArgs.from_config(config)
    assert args.position_offset == 2 and args.max_tokens == 64
    assert load(path).info.context_length == 64
    from mlxcel.daemon.models.encoder import encoder_context

    assert encoder_context(config) == 64  # what `models list` and the catalogue say
    bert = EncoderArgs.from_config(dict(config, model_type="bert"))
    assert bert.position_offset == 0 and bert.max_tokens == 66


def test_tokenizer_adds_specials_and_truncate_keeps_sep(tmp_path: Path) -> None:
    loaded = load(make_encoder_dir(tmp_path / "enc", "bert"))
    tok = loaded.tokenizer
    ids = tok.encode("the cat sat")
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP]
    assert tok.truncate(ids, 3) == [ids[0], ids[1], ids[-1]]
    assert tok.truncate(ids, 10) == ids
    assert tok.eos_token_ids == frozenset() and 2 in tok.all_special_ids
    assert len(tok) == loaded.model.args.vocab_size


def test_pooling_defaults_and_files(tmp_path: Path) -> None:
    from mlxcel.daemon.models.encoder.load import pooling_mode, sentence_config

    plain = make_encoder_dir(tmp_path / "plain", "bert", pooling=None)
    assert sentence_config(plain).pooling == "mean" and not sentence_config(plain).normalize
    cls = make_encoder_dir(tmp_path / "cls", "bert", pooling="cls", normalize=True)
    assert (sentence_config(cls).pooling, sentence_config(cls).normalize) == ("cls", True)
    (cls / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    assert load(cls).info.context_length == 16
    assert pooling_mode({"pooling_mode": "lasttoken"}) == "lasttoken"
    from mlxcel.daemon.models.info import ModelLoadError

    with pytest.raises(ModelLoadError, match="cls\\+mean"):
        pooling_mode({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})


def test_plain_hf_dir_mean_pooled_unnormalised(tmp_path: Path) -> None:
    path = make_encoder_dir(tmp_path / "enc", "bert", pooling=None, prefix=False)
    loaded = load(path)
    config, weights = read_dir(path)
    got = vectors(loaded, TEXTS[:1])[0]
    want = reference_vector(config, weights, loaded.tokenizer.encode(TEXTS[0]), "mean", False)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_hf_weight_names() -> None:
    from mlxcel.daemon.models.encoder.load import hf_weight_name

    assert hf_weight_name("bert.encoder.layer.0.output.dense.weight") == (
        "encoder.layer.0.output.dense.weight"
    )
    assert hf_weight_name("roberta.embeddings.LayerNorm.weight") == "embeddings.LayerNorm.weight"
    assert hf_weight_name("embeddings.LayerNorm.gamma") == "embeddings.LayerNorm.weight"
    assert hf_weight_name("embeddings.LayerNorm.beta") == "embeddings.LayerNorm.bias"
    assert hf_weight_name("bert.pooler.dense.weight") is None
    assert hf_weight_name("cls.predictions.bias") is None
    assert hf_weight_name("bert.embeddings.position_ids") is None


def test_refusals_are_one_line(tmp_path: Path) -> None:
    from mlxcel.daemon.models.info import ModelLoadError

    torch_only = make_encoder_dir(tmp_path / "bin", "bert")
    (torch_only / "model.safetensors").rename(torch_only / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin: PyTorch pickles are not"):
        load(torch_only)
    dense = make_encoder_dir(
        tmp_path / "dense",
        "bert",
        extra_modules=[{"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}],
    )
    with pytest.raises(ModelLoadError, match="Dense module"):
        load(dense)
    missing = make_encoder_dir(tmp_path / "missing", "bert", prefix=False)
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(missing / "model.safetensors"))
    del weights["encoder.layer.1.output.dense.bias"]
    save_file(weights, str(missing / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lack encoder\.layer\.1\.output\.dense\.bias"):
        load(missing)
    relative = make_encoder_dir(tmp_path / "relative", "bert")
    config = json.loads((relative / "config.json").read_text())
    config["position_embedding_type"] = "relative_key"
    (relative / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="position_embedding_type 'relative_key'"):
        load(relative)
    distil = make_encoder_dir(tmp_path / "distil", "bert")
    config = json.loads((distil / "config.json").read_text())
    (distil / "config.json").write_text(json.dumps(dict(config, model_type="distilbert")))
    with pytest.raises(ModelLoadError, match="'distilbert' is not supported"):
        load(distil)


def test_is_encoder_config() -> None:
    from mlxcel.daemon.models.encoder import is_encoder_config

    assert is_encoder_config({"model_type": "bert"})
    assert is_encoder_config({"model_type": "xlm-roberta"})
    assert is_encoder_config({"architectures": ["XLMRobertaModel"], "model_type": "x"})
    assert is_encoder_config({"model_type": "nomic_bert"})
    assert is_encoder_config({"model_type": "distilbert"})  # known, refused at load
    assert not is_encoder_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_describe_model_reports_kind(tmp_path: Path, mlxcel_home: Path) -> None:
    from mlxcel.daemon.models.inspect import describe_model

    path = make_encoder_dir(tmp_path / "enc", "bert", pooling="cls")
    info = describe_model(str(path))
    assert info["kind"] == "embedding"
    assert info["capabilities"]["embedding"] is True
    assert info["capabilities"]["chat"] is False and info["capabilities"]["completion"] is False
    assert info["embedding"] == {"width": 32, "pooling": "cls", "normalize": True}
    xlmr = describe_model(str(make_encoder_dir(tmp_path / "xlmr", "xlm-roberta")))
    assert xlmr["context_length"] == 64 and xlmr["kind"] == "embedding"


def test_engine_batches_within_budget_and_long_inputs_alone(tmp_path: Path) -> None:
    """The engine thread's side: a step computes at most the budget (rows x longest), an input
    over it alone; every job gets its vectors, equal to the direct forward's."""
    import concurrent.futures

    from mlxcel.daemon.models.encoder.encoder_engine import EncoderEngine
    from mlxcel.shared.config import ServingConfig

    loaded = load(make_encoder_dir(tmp_path / "enc", "bert"))
    engine = EncoderEngine(loaded.model, ServingConfig(prefill_chunk_size=16), 64)
    rows = [loaded.tokenizer.encode(t) for t in TEXTS]  # 8, 3 and 17 tokens
    futures = [concurrent.futures.Future() for _ in range(2)]
    engine.add_embedding(rows, futures[0])
    engine.add_embedding([rows[1]] * 4, futures[1])
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    assert steps >= 3
    np.testing.assert_allclose(futures[0].result(), vectors(loaded, TEXTS), atol=1e-5)
    np.testing.assert_allclose(
        futures[1].result(), np.repeat(vectors(loaded, [TEXTS[1]]), 4, axis=0), atol=1e-5
    )
    snap = engine.snapshot()
    assert snap.slots == () and snap.kv.blocks_total == 0 and not snap.prompt_cache.enabled
    assert snap.config.ctx_per_slot == 64
    from mlxcel.daemon.engine.types import AdmissionRejected

    with pytest.raises(AdmissionRejected) as err:
        engine.check_admission(None, 0)  # type: ignore[arg-type]
    assert err.value.reason == "model_not_generative"
    changes = engine.reconfigure({"parallel": 2, "prompt_cache": True})
    assert [c.applied for c in changes] == [False, False]
    assert "embedding model" in changes[0].reason


def test_matches_transformers_bertmodel(tmp_path: Path) -> None:
    """Against HF's own BertModel, where torch is installed (it is not in this venv: skipped)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = make_encoder_dir(tmp_path / "enc", "bert", pooling="mean", normalize=False)
    hf = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    loaded = load(path)
    rows = [loaded.tokenizer.encode(t) for t in TEXTS]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
    keep = mask.numpy()[..., None]
    want = (hidden * keep).sum(1) / keep.sum(1)
    np.testing.assert_allclose(vectors(loaded, TEXTS), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("activation", "fraction", "biases"),
    [("swiglu", 1.0, False), ("geglu", 0.5, True), ("gelu", 1.0, True), ("glu", 1.0, False)],
)
def test_nomic_bert_matches_reference(
    tmp_path: Path, activation: str, fraction: float, biases: bool
) -> None:
    """nomic_bert (rotary, fused Wqkv, gated MLP, emb_ln): the batch equals nomic's model
    computed in numpy (encoder_fixtures.nomic_reference_hidden), mean-pooled, normalised."""
    path = make_nomic_dir(
        tmp_path / "nomic", activation=activation, rotary_fraction=fraction, biases=biases
    )
    loaded = load(path)
    assert loaded.info.family == "nomic_bert" and loaded.info.context_length == 128
    config, weights = read_dir(path)
    batch = vectors(loaded, TEXTS)
    for text, got in zip(TEXTS, batch, strict=True):
        hidden = nomic_reference_hidden(config, weights, loaded.tokenizer.encode(text))
        want = hidden.mean(0) / np.linalg.norm(hidden.mean(0))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(got, vectors(loaded, [text])[0], atol=1e-5, rtol=0)


def test_nomic_bert_context_and_refusals(tmp_path: Path) -> None:
    from mlxcel.daemon.models.encoder import encoder_context
    from mlxcel.daemon.models.info import ModelLoadError

    scaled = make_nomic_dir(tmp_path / "scaled", scaling=2.0)
    assert load(scaled).info.context_length == 64  # the NTK scaling would start past 64
    config = json.loads((scaled / "config.json").read_text())
    assert encoder_context(config) == 64
    assert encoder_context(dict(config, rotary_scaling_factor=None)) == 128
    prenorm = make_nomic_dir(tmp_path / "prenorm")
    (prenorm / "config.json").write_text(json.dumps(dict(config, prenorm=True)))
    with pytest.raises(ModelLoadError, match="pre-norm"):
        load(prenorm)
