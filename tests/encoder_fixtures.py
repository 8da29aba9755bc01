"""Tiny random-weight BERT-family encoder directories (what an HF embedding repo holds:
config.json, model.safetensors, tokenizer.json, the sentence-transformers files) and a numpy
reference implementation of the encoder, for tests/integration/test_encoder.py and
tests/integration/test_embedding_models.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

WORDS = [
    "the",
    "a",
    "cat",
    "cats",
    "dog",
    "dogs",
    "sat",
    "on",
    "mat",
    "sofa",
    "bank",
    "central",
    "interest",
    "rate",
    "rates",
    "rise",
    "fell",
    "kitten",
    "puppy",
    "money",
    "market",
    "loan",
    "river",
    "stock",
    "price",
    "sleeps",
    "barks",
    "purrs",
    "slept",
]


def _vocab(model_type: str) -> tuple[dict[str, int], dict[str, str]]:
    """(token -> id, role -> token): BERT's [PAD]=0 ... or RoBERTa's <s>=0 <pad>=1 </s>=2."""
    if model_type == "bert":
        special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        roles = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]"}
    else:
        special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        roles = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>"}
    pieces = [*WORDS, *"abcdefghijklmnopqrstuvwxyz"] + [
        f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"
    ]
    tokens = special + pieces + [".", ",", "!", "?"]
    return {t: i for i, t in enumerate(tokens)}, roles


def write_tokenizer(path: Path, model_type: str) -> int:
    """A WordPiece tokenizer.json (lower-casing, BERT pre-tokenizer, [CLS] $A [SEP]); the
    vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab, roles = _vocab(model_type)
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=roles["unk"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = roles["cls"], roles["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    specials = [t for t in vocab if t.startswith(("[", "<")) and len(t) > 2]
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(path / "tokenizer.json"))
    return len(vocab)


def random_weights(config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights (no `bert.`/`roberta.` prefix) for `config`."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]

    def mat(rows: int, cols: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def vec(n: int, base: float = 0.0, scale: float = 0.1) -> np.ndarray:
        return (base + rng.standard_normal(n) * scale).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": mat(config["vocab_size"], hidden, 1.0),
        "embeddings.position_embeddings.weight": mat(config["max_position_embeddings"], hidden),
        "embeddings.token_type_embeddings.weight": mat(config["type_vocab_size"], hidden),
        "embeddings.LayerNorm.weight": vec(hidden, 1.0),
        "embeddings.LayerNorm.bias": vec(hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            w[f"{p}attention.self.{name}.weight"] = mat(hidden, hidden)
            w[f"{p}attention.self.{name}.bias"] = vec(hidden)
        w[f"{p}attention.output.dense.weight"] = mat(hidden, hidden)
        w[f"{p}attention.output.dense.bias"] = vec(hidden)
        w[f"{p}attention.output.LayerNorm.weight"] = vec(hidden, 1.0)
        w[f"{p}attention.output.LayerNorm.bias"] = vec(hidden)
        w[f"{p}intermediate.dense.weight"] = mat(inter, hidden)
        w[f"{p}intermediate.dense.bias"] = vec(inter)
        w[f"{p}output.dense.weight"] = mat(hidden, inter)
        w[f"{p}output.dense.bias"] = vec(hidden)
        w[f"{p}output.LayerNorm.weight"] = vec(hidden, 1.0)
        w[f"{p}output.LayerNorm.bias"] = vec(hidden)
    return w


def make_encoder_dir(
    path: Path,
    model_type: str = "bert",
    *,
    pooling: str | None = "mean",
    normalize: bool = True,
    prefix: bool = True,
    seed: int = 0,
    hidden_size: int = 32,
    layers: int = 2,
    heads: int = 4,
    intermediate_size: int = 64,
    max_tokens: int = 64,
    hidden_act: str = "gelu",
    extra_modules: list[dict[str, Any]] | None = None,
) -> Path:
    """A random-weight encoder directory; `pooling` None writes no sentence-transformers
    files at all (a plain HF BertModel directory); `prefix` stores the weights with their
    `bert.`/`roberta.` prefix (and a pooler, which the loader must skip)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path, model_type)
    pad = 0 if model_type == "bert" else 1
    offset = 0 if model_type == "bert" else pad + 1
    config = {
        "architectures": ["BertModel" if model_type == "bert" else "XLMRobertaModel"],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_tokens + offset,
        "type_vocab_size": 2 if model_type == "bert" else 1,
        "hidden_act": hidden_act,
        "layer_norm_eps": 1e-12 if model_type == "bert" else 1e-5,
        "pad_token_id": pad,
    }
    (path / "config.json").write_text(json.dumps(config))
    weights = random_weights(config, seed)
    if prefix:
        head = "bert." if model_type == "bert" else "roberta."
        weights = {head + k: v for k, v in weights.items()}
        weights[head + "pooler.dense.weight"] = np.zeros((hidden_size, hidden_size), np.float32)
        weights[head + "pooler.dense.bias"] = np.zeros(hidden_size, np.float32)
    save_file(weights, str(path / "model.safetensors"))
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        modules += extra_modules or []
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        keys = {
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": pooling == "max",
            "pooling_mode_mean_sqrt_len_tokens": False,
        }
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": hidden_size, **keys})
        )
    return path


# -- the numpy reference -------------------------------------------------------------------


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


_erf = np.vectorize(math.erf)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def reference_hidden(
    config: dict[str, Any], w: dict[str, np.ndarray], ids: list[int]
) -> np.ndarray:
    """BERT's last hidden states of one unpadded input (float64), from the HF definition."""
    offset = config["pad_token_id"] + 1 if config["model_type"] != "bert" else 0
    eps = config["layer_norm_eps"]
    n = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids].astype(np.float64)
        + w["embeddings.position_embeddings.weight"][np.arange(n) + offset]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    heads = config["num_attention_heads"]
    dim = config["hidden_size"] // heads
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(t: np.ndarray, name: str, p: str = p) -> np.ndarray:
            return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q = lin(x, "attention.self.query").reshape(n, heads, dim).transpose(1, 0, 2)
        k = lin(x, "attention.self.key").reshape(n, heads, dim).transpose(1, 0, 2)
        v = lin(x, "attention.self.value").reshape(n, heads, dim).transpose(1, 0, 2)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(dim)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = (scores / scores.sum(-1, keepdims=True)) @ v
        att = att.transpose(1, 0, 2).reshape(n, heads * dim)
        x = _layer_norm(
            lin(att, "attention.output.dense") + x,
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        h = _gelu(lin(x, "intermediate.dense"))
        x = _layer_norm(
            lin(h, "output.dense") + x,
            w[p + "output.LayerNorm.weight"],
            w[p + "output.LayerNorm.bias"],
            eps,
        )
    return x


def reference_vector(
    config: dict[str, Any], w: dict[str, np.ndarray], ids: list[int], pooling: str, normalize: bool
) -> np.ndarray:
    hidden = reference_hidden(config, w, ids)
    vector = {"cls": hidden[0], "mean": hidden.mean(0), "max": hidden.max(0)}[pooling]
    if normalize:
        vector = vector / np.linalg.norm(vector)
    return vector


def read_dir(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config, un-prefixed weights) of a directory `make_encoder_dir` wrote."""
    from safetensors.numpy import load_file

    config = json.loads((path / "config.json").read_text())
    raw = load_file(str(path / "model.safetensors"))
    weights = {}
    for name, value in raw.items():
        for head in ("bert.", "roberta."):
            name = name.removeprefix(head)
        weights[name] = value
    return config, weights


# -- NomicBERT -----------------------------------------------------------------------------


def make_nomic_dir(
    path: Path,
    *,
    activation: str = "swiglu",
    seed: int = 0,
    hidden_size: int = 32,
    layers: int = 2,
    heads: int = 4,
    inner: int = 48,
    rotary_fraction: float = 1.0,
    biases: bool = False,
    scaling: float | None = None,
) -> Path:
    """A random-weight nomic_bert directory (nomic-embed-text's config names, mean pooling,
    Normalize), its weights under the names nomic's checkpoints use."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path, "bert")
    padded = vocab_size + (-vocab_size) % 8
    config = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "activation_function": activation,
        "vocab_size": vocab_size,
        "pad_vocab_size_multiple": 8,
        "n_embd": hidden_size,
        "n_head": heads,
        "n_layer": layers,
        "n_inner": inner,
        "n_positions": 128,
        "max_trained_positions": 64,
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": rotary_fraction,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": scaling,
        "prenorm": False,
        "qkv_proj_bias": biases,
        "mlp_fc1_bias": biases,
        "mlp_fc2_bias": biases,
        "type_vocab_size": 2,
        "layer_norm_epsilon": 1e-12,
    }
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def vec(n: int, base: float = 0.0) -> np.ndarray:
        return (base + rng.standard_normal(n) * 0.1).astype(np.float32)

    w = {
        "embeddings.word_embeddings.weight": mat(padded, hidden_size, 1.0),
        "embeddings.token_type_embeddings.weight": mat(2, hidden_size),
        "emb_ln.weight": vec(hidden_size, 1.0),
        "emb_ln.bias": vec(hidden_size),
    }
    gated = activation in ("swiglu", "geglu", "glu")
    for i in range(layers):
        p = f"encoder.layers.{i}."
        w[p + "attn.Wqkv.weight"] = mat(3 * hidden_size, hidden_size)
        w[p + "attn.out_proj.weight"] = mat(hidden_size, hidden_size)
        for name in ("fc11", "fc12") if gated else ("fc1",):
            w[p + f"mlp.{name}.weight"] = mat(inner, hidden_size)
            if biases:
                w[p + f"mlp.{name}.bias"] = vec(inner)
        w[p + "mlp.fc2.weight"] = mat(hidden_size, inner)
        if biases:
            w[p + "attn.Wqkv.bias"] = vec(3 * hidden_size)
            w[p + "attn.out_proj.bias"] = vec(hidden_size)
            w[p + "mlp.fc2.bias"] = vec(hidden_size)
        for norm in ("norm1", "norm2"):
            w[p + norm + ".weight"] = vec(hidden_size, 1.0)
            w[p + norm + ".bias"] = vec(hidden_size)
    save_file(w, str(path / "model.safetensors"))
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden_size, "pooling_mode_mean_tokens": True})
    )
    return path


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def nomic_reference_hidden(
    config: dict[str, Any], w: dict[str, np.ndarray], ids: list[int]
) -> np.ndarray:
    """NomicBERT's last hidden states of one unpadded input (float64), from nomic's
    modeling_hf_nomic_bert.py: word + type-0 embeddings, emb_ln, then per block
    norm1(attn(x) + x), norm2(mlp(x) + x); GPT-NeoX rotary on q and k."""
    eps = config["layer_norm_epsilon"]
    hidden, heads = config["n_embd"], config["n_head"]
    dim = hidden // heads
    n = len(ids)
    x = w["embeddings.word_embeddings.weight"][ids].astype(np.float64)
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(x, w["emb_ln.weight"], w["emb_ln.bias"], eps)
    rot = int(dim * config["rotary_emb_fraction"])
    inv_freq = 1.0 / (config["rotary_emb_base"] ** (np.arange(0, rot, 2) / rot))
    freqs = np.outer(np.arange(n), inv_freq)
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs] * 2, -1))

    def rotary(t: np.ndarray) -> np.ndarray:  # (n, heads, dim)
        r, rest = t[..., :rot], t[..., rot:]
        x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
        turned = np.concatenate([-x2, x1], -1)
        return np.concatenate([r * cos[:, None] + turned * sin[:, None], rest], -1)

    act = config["activation_function"]
    gates = {"swiglu": lambda t: t * _sigmoid(t), "geglu": _gelu, "glu": _sigmoid}
    for i in range(config["n_layer"]):
        p = f"encoder.layers.{i}."

        def lin(t: np.ndarray, name: str, p: str = p) -> np.ndarray:
            out = t @ w[p + name + ".weight"].T
            bias = w.get(p + name + ".bias")
            return out if bias is None else out + bias

        qkv = lin(x, "attn.Wqkv").reshape(n, 3, heads, dim)
        q, k, v = rotary(qkv[:, 0]), rotary(qkv[:, 1]), qkv[:, 2]
        q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(dim)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = ((scores / scores.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, hidden)
        x = _layer_norm(
            lin(att, "attn.out_proj") + x, w[p + "norm1.weight"], w[p + "norm1.bias"], eps
        )
        if act in gates:
            h = lin(x, "mlp.fc11") * gates[act](lin(x, "mlp.fc12"))
        else:
            h = _gelu(lin(x, "mlp.fc1"))
        x = _layer_norm(lin(h, "mlp.fc2") + x, w[p + "norm2.weight"], w[p + "norm2.bias"], eps)
    return x
