"""A model's files and size, checked before anything is evicted for it; the one-line
messages of the refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.shared.config import format_size

if TYPE_CHECKING:
    from mlxcel.daemon.hosting.resident import Resident

MEMORY_HEADROOM = 1.2  # a model needs its resident weights x this free to load beside another


def precheck(resolve_spec: Callable[[str], Any], key: str, backend: str) -> int | None:
    """Vet `key`'s files (off the loop; GGUF files too) and return the bytes its weights will
    take on `backend`, or None where nothing is local yet (a hub id not downloaded)."""
    from mlxcel.daemon.models.footprint import resident_weight_bytes
    from mlxcel.daemon.models.registry import check_model_files

    resolved = resolve_spec(key)
    if resolved.path is None:
        return None
    try:
        if resolved.path.is_dir():  # an encoder with only pytorch_model.bin: its own message
            from mlxcel.daemon.models.encoder import is_encoder_config
            from mlxcel.daemon.models.encoder.load import weight_files
            from mlxcel.daemon.models.registry import read_config

            if is_encoder_config(read_config(resolved.path)):
                weight_files(resolved.path)
        check_model_files(resolved.path)
        return resident_weight_bytes(resolved.path, backend)
    except ModelLoadError as exc:
        raise ModelLoadError(f"cannot load model {key!r}: {exc}") from None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def over_budget(key: str, need: int, budget: int, pinned: list[Resident]) -> str:
    held = sum(r.weights_bytes for r in pinned)
    text = (
        f"cannot load model {key!r}: its weights ({format_size(need)}) do not fit in "
        f"models_memory ({format_size(budget)})"
    )
    if not pinned:
        return text
    names = ", ".join(f"{r.key} ({format_size(r.weights_bytes)})" for r in pinned)
    return f"{text} beside the pinned models' {format_size(held)}: {names}"


def too_large(key: str, need: int, backend: str, available: int, freeable: int) -> str:
    others = f" (with {format_size(freeable)} of it freed by unloading the loaded models)"
    return (
        f"cannot load model {key!r}: it needs {format_size(need * MEMORY_HEADROOM)} of memory "
        f"({format_size(need)} of weights as the {backend} backend holds them, "
        f"x{MEMORY_HEADROOM} headroom) and {format_size(available + freeable)} is available"
        + (others if freeable else "")
    )
