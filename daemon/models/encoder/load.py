"""Loading an embedding-only model directory: config.json, HF weights (safetensors), the
tokenizer, and the sentence-transformers files that say how a vector is made (docs/models.md,
"Embedding models").

- **Weights**: `model.safetensors` (or shards `model-*.safetensors`), HF parameter names with
  or without the `bert.` / `roberta.` prefix; the pooler and the MLM head are not used. A
  directory with only `pytorch_model.bin` is refused: a pickle runs code when it is read.
- **Pooling**: `modules.json` names the Pooling module's folder (usually `1_Pooling`), whose
  `config.json` picks `cls`, `mean`, `max`, `mean_sqrt_len` or `lasttoken`; no modules.json
  or no Pooling module: `mean`. A `Normalize` module in modules.json: the vector is
  L2-normalised (bge, e5, all-MiniLM); without one it is not. A `Dense` (or other) module is
  refused rather than skipped: the vector would be wrong.
- **Tokenizer**: the directory's `tokenizer.json` through the `tokenizers` package (its
  post-processor adds `[CLS]`/`[SEP]` or `<s>`/`</s>`), else transformers' AutoTokenizer (a
  `vocab.txt`). No truncation inside the tokenizer: the HTTP layer refuses, or truncates
  (Ollama's `truncate`), at the context length: the model's positions, or
  `sentence_bert_config.json`'s `max_seq_length` when smaller (what sentence-transformers cuts
  at).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.info import ModelInfo, ModelLoadError

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_ST_MODULES_OK = ("Transformer", "Pooling", "Normalize")
_DROPPED_PREFIXES = ("pooler.", "cls.", "lm_head.")
_MODEL_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass(frozen=True)
class SentenceConfig:
    """How token states become one vector (the sentence-transformers files)."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} is unreadable: {exc}") from None


def pooling_mode(config: dict[str, Any], where: str = "1_Pooling/config.json") -> str:
    """The one pooling a sentence-transformers Pooling config asks for."""
    named = config.get("pooling_mode")
    if isinstance(named, str):
        modes = [{"mean_tokens": "mean", "cls_token": "cls"}.get(named, named)]
    else:
        modes = [mode for key, mode in _POOLING_KEYS.items() if config.get(key) is True]
    if not modes:
        return "mean"
    if len(modes) > 1 or modes[0] not in POOLING_MODES:
        raise ModelLoadError(
            f"{where} asks for pooling {'+'.join(modes)}; supported: one of "
            f"{', '.join(POOLING_MODES)}"
        )
    return modes[0]


def sentence_config(path: Path) -> SentenceConfig:
    """The pooling and normalisation of the model in `path` (see the module doc)."""
    pooling, normalize = "mean", False
    modules_file = path / "modules.json"
    if modules_file.is_file():
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise ModelLoadError(f"{modules_file} is not a list of modules")
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            short = kind.rsplit(".", 1)[-1]
            if short not in _ST_MODULES_OK:
                raise ModelLoadError(
                    f"{modules_file} lists a {kind or 'malformed'} module, which mlxcel does "
                    "not compute (it serves Transformer + Pooling [+ Normalize] models)"
                )
            if short == "Normalize":
                normalize = True
            elif short == "Pooling":
                sub = path / str(module.get("path", "1_Pooling")) / "config.json"
                if sub.is_file():
                    pooling = pooling_mode(_read_json(sub), str(sub.relative_to(path)))
    max_seq: int | None = None
    st_file = path / "sentence_bert_config.json"
    if st_file.is_file():
        value = _read_json(st_file)
        length = value.get("max_seq_length") if isinstance(value, dict) else None
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            max_seq = length
    return SentenceConfig(pooling, normalize, max_seq)


class EncoderTokenizer:
    """The slice of a tokenizer the daemon uses for an embedding model: `encode` (with the
    model's special tokens), `len()`, the special ids, and `truncate` that keeps the closing
    special token (`[SEP]`, `</s>`) when an input is cut."""

    chat_template = None
    has_tool_calling = False
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, backend: Any) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._tok = backend
        self.all_special_ids = sorted(
            int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self._special = frozenset(self.all_special_ids)
        self._size = int(backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def truncate(self, ids: list[int], limit: int) -> list[int]:
        if len(ids) <= limit:
            return ids
        if limit > 1 and ids[-1] in self._special:
            return [*ids[: limit - 1], ids[-1]]
        return ids[:limit]

    def __len__(self) -> int:
        return self._size


def load_tokenizer(path: Path) -> EncoderTokenizer:
    file = path / "tokenizer.json"
    try:
        if file.is_file():
            from tokenizers import Tokenizer

            return EncoderTokenizer(Tokenizer.from_file(str(file)))
        from transformers import AutoTokenizer

        backend = getattr(AutoTokenizer.from_pretrained(str(path)), "backend_tokenizer", None)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {exc}") from None
    if backend is None:
        raise ModelLoadError(f"{path} has no tokenizer.json and no fast tokenizer could be made")
    return EncoderTokenizer(backend)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an encoder directory; a one-line refusal otherwise."""
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if files:
        return files
    if (path / "pytorch_model.bin").is_file():
        raise ModelLoadError(
            f"{path} holds only pytorch_model.bin: PyTorch pickles are not loaded (reading one "
            "runs code); use the repo's model.safetensors, or convert it with transformers' "
            "save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"{path} holds no model.safetensors weights")


def hf_weight_name(name: str) -> str | None:
    """The encoder's parameter name for a checkpoint's, or None for a tensor it does not use
    (the pooler, the MLM head, buffers)."""
    for prefix in _MODEL_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name.startswith(_DROPPED_PREFIXES) or name.endswith(("position_ids", "token_type_ids")):
        return None
    if name.endswith(".gamma"):  # the oldest BERT checkpoints' LayerNorm names
        name = name[: -len(".gamma")] + ".weight"
    elif name.endswith(".beta"):
        name = name[: -len(".beta")] + ".bias"
    return name


def load_weights(model: Any, files: list[Path]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights: dict[str, Any] = {}
    for file in files:
        try:
            tensors = mx.load(str(file))
        except Exception as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
        for name, value in tensors.items():
            ours = hf_weight_name(name)
            if ours is not None:
                weights[ours] = value
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" and {len(missing) - 1} more" if missing[1:] else ""
        raise ModelLoadError(f"the weights lack {missing[0]}{more}")
    for name, want in expected.items():
        if weights[name].shape != want.shape:
            raise ModelLoadError(
                f"weight {name} has shape {tuple(weights[name].shape)}, the config says "
                f"{tuple(want.shape)}"
            )
    model.load_weights([(n, weights[n]) for n in expected], strict=True)


def load_encoder(spec: str, path: Path, source: str, dtype: str) -> Any:
    """A `loader.LoadedModel` for the encoder in `path` (its info's kind is "embedding")."""
    from mlx.utils import tree_flatten
    from mlxcel.daemon.forward.blas import blas_name
    from mlxcel.daemon.models.encoder import encoder_kind
    from mlxcel.daemon.models.encoder.model import BertEncoder, EncoderArgs
    from mlxcel.daemon.models.encoder.nomic import NomicArgs, NomicEncoder
    from mlxcel.daemon.models.loader import LoadedModel, apply_dtype, backend_name

    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    if encoder_kind(config) == "unsupported":
        raise ModelLoadError(
            f"embedding model family {config.get('model_type')!r} is not supported yet "
            "(supported: bert, roberta, xlm-roberta, nomic_bert)"
        )
    nomic = str(config.get("model_type")) == "nomic_bert"
    try:
        args: Any = (NomicArgs if nomic else EncoderArgs).from_config(config)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    files = weight_files(path)
    sentence = sentence_config(path)
    tokenizer = load_tokenizer(path)
    model = NomicEncoder(args) if nomic else BertEncoder(args)
    load_weights(model, files)
    apply_dtype(model, dtype, backend_name())
    model.sentence = sentence  # how the engine pools (encoder_engine.py)
    context = args.max_tokens
    if sentence.max_seq_length is not None:
        context = min(context, sentence.max_seq_length)
    params = tree_flatten(model.parameters())
    kinds = {str(v.dtype).removeprefix("mlx.core.") for _, v in params}
    info = ModelInfo(
        name=spec,
        path=str(path),
        source=source,
        family=args.model_type,
        can_batch=True,
        batch_reason=None,
        context_length=context,
        dtype=kinds.pop() if len(kinds) == 1 else "mixed",
        quantization=None,
        backend=backend_name(),
        blas=blas_name(),
        weights_bytes=sum(v.nbytes for _, v in params),
        num_params=sum(v.size for _, v in params),
        kind="embedding",
        pooling=sentence.pooling,
        normalize=sentence.normalize,
    )
    return LoadedModel(model, tokenizer, info)
