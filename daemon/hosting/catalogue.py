"""The complete local models a client may name (`/v1/models`, `/api/tags`, `models`)."""

from __future__ import annotations

from typing import Any


def local_catalogue() -> list[Any]:
    """Complete local models (the store, the Hugging Face cache) for `/v1/models` and
    `/api/tags`; reads files, so call it off the loop."""
    from mlxcel.daemon.models.registry import list_models

    return [m for m in list_models(include_hf_cache=True) if m.complete]
