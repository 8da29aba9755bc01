"""What the model host refuses with: each maps to one HTTP status (server/http_app.py)."""

from __future__ import annotations

from mlxcel.daemon.models.info import ModelLoadError

__all__ = [
    "HostBusy",
    "ModelLoadError",
    "ModelNotFound",
    "ModelNotGenerative",
    "ModelPinned",
    "ModelTooLarge",
    "NoRoomForModel",
]


class ModelNotFound(LookupError):
    """A request named a model that is neither loaded nor available locally."""


class ModelNotGenerative(LookupError):
    """A generation route named an embedding-only model (docs/models.md, "Embedding models");
    refused before it is loaded, so no chat model is evicted for it."""


class HostBusy(LookupError):
    """Too many requests already wait for a model to load: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class ModelTooLarge(ModelLoadError):
    """The model's weights will not fit in memory on this backend, even with every other
    model unloaded; refused before anything is evicted."""


class NoRoomForModel(ModelLoadError):
    """No room for the model that only unpinning could make: every one of the
    `max_loaded_models` places is held by a pinned model, or its weights do not fit within
    `models_memory` (or the free memory) beside the pinned models'; refused before anything
    is evicted (HTTP 503), the resident models keep serving."""


class ModelPinned(LookupError):
    """`unload` of a pinned model: refused until it is unpinned."""
