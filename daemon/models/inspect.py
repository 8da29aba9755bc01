"""`describe_model(name)`: what `models show` prints, read from the files (no weights loaded).

Capabilities come from the config and the chat template: `can_batch` from whether mlx-lm's
module for the family makes its own caches (the loader's check at load time is the final
word), tool calling from the template's tool markup, as mlx-lm's tokenizer wrapper decides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.registry import (
    ALIASES,
    LocalModel,
    list_models,
    read_config,
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


def find_local(name: str) -> LocalModel:
    """The store entry or Hugging Face cache repo `name` (through the aliases) names."""
    target = resolve_alias(name)
    for model in list_models(include_hf_cache=True):
        if model.name in (name, target):
            return model
    path = Path(target).expanduser()
    if path.exists():
        from mlxcel.daemon.models.registry import _describe_entry

        return _describe_entry(str(path), path, "path")
    hint = (
        " (a built-in model: `mlxcel-daemon models pull` fetches it)" if target in ALIASES else ""
    )
    raise ModelLoadError(f"no local model {name!r}{hint}; see `mlxcel-daemon models list`")


def chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(errors="replace")
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
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
        from mlx_lm.utils import _get_classes
        from mlxcel.daemon.models.loader import batch_support

        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        return batch_support(model, str(config.get("model_type")))
    except Exception as exc:
        return False, f"mlx-lm cannot build this family ({type(exc).__name__}: {exc})"


def tool_calling(template: str | None) -> bool:
    if not template:
        return False
    return "tool_call" in template or ("tools" in template and "<tool" in template)


def describe_model(name: str) -> dict[str, Any]:
    model = find_local(name)
    if not model.complete:
        raise ModelLoadError(
            f"{model.name!r} is incomplete (a pull that did not finish); pull it again or rm it"
        )
    path = model.path
    config = read_config(path) if path.is_dir() else {}
    template = chat_template(path) if path.is_dir() else None
    can_batch, reason = batch_capability(config)
    return {
        "name": model.name,
        "path": str(path),
        "source": model.source,
        "family": model.family,
        "size_bytes": model.size_bytes,
        "quantization": model.quantization,
        "context_length": model.context_length,
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
