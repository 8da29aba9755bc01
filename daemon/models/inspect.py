"""`describe_model(name)`: what `models show` prints, read from the files (no weights loaded).

Capabilities come from the config and the chat template: `can_batch` from whether mlx-lm's
module for the family makes its own caches (the loader's check at load time is the final
word), tool calling from the template's tool markup, as mlx-lm's tokenizer wrapper decides.

What it reads is bounded: config.json up to `MAX_CONFIG_BYTES`, the template files up to
`MAX_TEMPLATE_BYTES`, nothing outside the model's folder. The HTTP API (`/api/show`) asks
only about names the daemon already resolved to its store or residents, and without
`probe_batch` (building mlx-lm's module takes as long as the config says: a 20,000-layer
config took 34 s and 510 MB).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.encoder import is_encoder_config
from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.registry import (
    ALIASES,
    LocalModel,
    list_models,
    resolve_alias,
)

CONFIG_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
    "quantization",
)


# A model's config.json is a few kB (a per-tensor quantization table: some 100 kB).
MAX_CONFIG_BYTES = 1 << 20
# tokenizer_config.json may carry every added token (a few MB) beside the template.
MAX_TEMPLATE_BYTES = 32 << 20


def find_local(name: str, allow_paths: bool = True) -> LocalModel:
    """The store entry or Hugging Face cache repo `name` (through the aliases) names; a
    folder or file path too when `allow_paths` (the CLI's `models show PATH`)."""
    target = resolve_alias(name)
    for model in list_models(include_hf_cache=True):
        if model.name in (name, target):
            return model
    path = Path(target).expanduser()
    if allow_paths and path.exists():
        from mlxcel.daemon.models.registry import _describe_entry

        return _describe_entry(str(path), path, "path")
    hint = (
        " (a built-in model: `mlxcel-daemon models pull` fetches it)" if target in ALIASES else ""
    )
    raise ModelLoadError(f"no local model {name!r}{hint}; see `mlxcel-daemon models list`")


def read_capped(file: Path, limit: int) -> bytes:
    """The file's bytes; OSError when it is not a plain file or is over `limit` bytes."""
    if not file.is_file():  # before opening: a FIFO would block, a device never end
        raise FileNotFoundError(f"{file} is not a file")
    with open(file, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{file} is over {limit} bytes")
    return data


def read_config_capped(path: Path) -> dict[str, Any]:
    """`path/config.json` as a dict, refused over `MAX_CONFIG_BYTES` (ModelLoadError)."""
    try:
        data = json.loads(read_capped(path / "config.json", MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise ModelLoadError(
            f"{path} has no config.json: not an MLX/Hugging Face model dir"
        ) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}/config.json is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}/config.json is not a JSON object")
    return data


def chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            return read_capped(jinja, MAX_TEMPLATE_BYTES).decode(errors="replace")
        except OSError:
            return None
    try:
        config = json.loads(read_capped(path / "tokenizer_config.json", MAX_TEMPLATE_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def batch_capability(config: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether the engine can batch the model: mlx-lm's module for the family, built without
    weights (MLX arrays are lazy), and the loader's own test on its caches."""
    if not config:
        return False, "unknown family"
    try:
        from mlxcel.daemon.mlx_lm_compat import get_model_classes
        from mlxcel.daemon.models.loader import batch_support

        model_class, args_class = get_model_classes(config)
        model = model_class(args_class.from_dict(config))
        return batch_support(model, str(config.get("model_type")))
    except Exception as exc:
        return False, f"mlx-lm cannot build this family ({type(exc).__name__}: {exc})"


def tool_calling(template: str | None) -> bool:
    if not template:
        return False
    return "tool_call" in template or ("tools" in template and "<tool" in template)


def gguf_source(path: Path) -> dict[str, Any] | None:
    """For a model from a GGUF: the file, and per tensor class its ggml quant type (and what
    the conversion made of it) (`gguf_info.gguf_quant_summary`); None otherwise."""
    from mlxcel.daemon.models.gguf_info import gguf_quant_summary

    try:
        return gguf_quant_summary(path)
    except ModelLoadError:
        return None


def describe_model(name: str, allow_paths: bool = True, probe_batch: bool = True) -> dict[str, Any]:
    """What `models show` prints. `allow_paths`: `name` may be a path (the CLI); without
    `probe_batch`, `can_batch` is None (no mlx-lm module is built)."""
    model = find_local(name, allow_paths)
    if not model.complete:
        raise ModelLoadError(
            f"{model.name!r} is incomplete (a pull that did not finish); pull it again or rm it"
        )
    path = model.path
    config = read_config_capped(path) if path.is_dir() else {}
    if is_encoder_config(config):
        return _describe_encoder(model, config)
    template = chat_template(path) if path.is_dir() else None
    can_batch: bool | None
    if probe_batch:
        can_batch, reason = batch_capability(config)
    else:
        can_batch, reason = None, "not probed"
    return {
        "name": model.name,
        "kind": "chat",
        "path": str(path),
        "source": model.source,
        "family": model.family,
        "size_bytes": model.size_bytes,
        "quantization": model.quantization,
        "context_length": model.context_length,
        "gguf": gguf_source(path),
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
        "template": template,
        "capabilities": {
            "completion": True,
            "chat": template is not None,
            "tools": tool_calling(template),
            "can_batch": can_batch,
            "batch_reason": reason,
        },
    }


def _describe_encoder(model: LocalModel, config: dict[str, Any]) -> dict[str, Any]:
    """`models show` of an embedding-only model: its pooling, normalisation and context (what
    the loader will use; models/encoder/load.py)."""
    from mlxcel.daemon.models.encoder.load import sentence_config

    sentence = sentence_config(model.path)
    context = model.context_length  # the encoder's (registry: encoder_context)
    if context is not None and sentence.max_seq_length is not None:
        context = min(context, sentence.max_seq_length)
    return {
        "name": model.name,
        "kind": "embedding",
        "path": str(model.path),
        "source": model.source,
        "family": model.family,
        "size_bytes": model.size_bytes,
        "quantization": model.quantization,
        "context_length": context,
        "config": {k: config[k] for k in CONFIG_KEYS if k in config},
        "template": None,
        "embedding": {
            "width": config.get("hidden_size"),
            "pooling": sentence.pooling,
            "normalize": sentence.normalize,
        },
        "capabilities": {
            "completion": False,
            "chat": False,
            "tools": False,
            "can_batch": True,
            "batch_reason": None,
            "embedding": True,
        },
    }
