"""The model layer: loading (aliases, HF ids, MLX dirs, GGUF), the local store, BLAS.

Names are imported lazily so `import mlxcel.daemon.models.registry` stays free of mlx.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# transformers (used for tokenizers only) otherwise warns on import that PyTorch is missing.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_LAZY = {
    "LoadedModel": "mlxcel.daemon.models.loader",
    "load_model": "mlxcel.daemon.models.loader",
    "ModelInfo": "mlxcel.daemon.models.info",
    "ModelLoadError": "mlxcel.daemon.models.info",
    "convert_gguf": "mlxcel.daemon.models.gguf",
    "pull_model": "mlxcel.daemon.models.pull",
    "list_models": "mlxcel.daemon.models.registry",
    "LocalModel": "mlxcel.daemon.models.registry",
    "DEFAULT_MODEL": "mlxcel.daemon.models.registry",
    "make_tiny_model": "mlxcel.daemon.models.tiny",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
