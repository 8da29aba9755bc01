"""Embedding-only models: BERT-family encoders (bge, e5, all-MiniLM, multilingual-e5, bge-m3)
served on the three embedding routes (docs/api.md, "Embeddings"; docs/models.md).

`is_encoder_config` tells a model directory's config.json apart from a chat model's without
importing mlx (the loader, `models show` and the catalogue call it); `load.py` loads one,
`model.py` is the MLX encoder, `encoder_engine.py` the engine thread's side of an
embedding-only model.
"""

from __future__ import annotations

from typing import Any

# config.json `model_type`s the encoder in model.py computes
ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "roberta", "nomic_bert"})
ENCODER_ARCHITECTURES = frozenset(
    {
        "BertModel",
        "BertForMaskedLM",
        "BertForPreTraining",
        "XLMRobertaModel",
        "XLMRobertaForMaskedLM",
        "RobertaModel",
        "RobertaForMaskedLM",
        "NomicBertModel",
    }
)
# encoders the loader recognises but cannot compute: refused with a clear message
UNSUPPORTED_ENCODER_TYPES = frozenset({"distilbert", "mpnet", "modernbert"})


def encoder_kind(config: dict[str, Any]) -> str | None:
    """ "supported", "unsupported" (an encoder family model.py does not compute) or None (not
    an encoder: a chat model)."""
    model_type = str(config.get("model_type", ""))
    if model_type in ENCODER_TYPES:
        return "supported"
    if model_type in UNSUPPORTED_ENCODER_TYPES:
        return "unsupported"
    archs = config.get("architectures") or []
    if isinstance(archs, list) and any(a in ENCODER_ARCHITECTURES for a in archs):
        return "supported"
    return None


def config_int(config: dict[str, Any], *keys: str) -> int | None:
    """The first of `keys` that holds a positive integer."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def nomic_context(config: dict[str, Any]) -> int | None:
    """NomicBERT's context (nomic.py): with dynamic NTK rotary scaling, the positions it was
    trained on (the scaling starts past them); without, `n_positions`."""
    if config.get("rotary_scaling_factor"):
        return config_int(config, "max_trained_positions", "n_positions")
    return config_int(config, "n_positions", "max_position_embeddings", "max_trained_positions")


def encoder_context(config: dict[str, Any]) -> int | None:
    """The most tokens one input may have (model.py's `EncoderArgs.max_tokens`, nomic.py's
    `NomicArgs.max_tokens`): RoBERTa's positions start after the padding index."""
    if str(config.get("model_type")) == "nomic_bert":
        return nomic_context(config)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool):
        return None
    if str(config.get("model_type")) in ("roberta", "xlm-roberta"):
        pad = config.get("pad_token_id")
        positions -= (pad if isinstance(pad, int) and pad >= 0 else 0) + 1
    return positions if positions > 0 else None


def is_encoder_config(config: dict[str, Any]) -> bool:
    """Whether config.json describes an embedding-only (encoder) model."""
    return encoder_kind(config) is not None
