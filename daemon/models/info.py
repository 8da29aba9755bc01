"""What the model layer tells the rest of the daemon about a loaded model (no mlx import)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class ModelLoadError(Exception):
    """A model could not be found, fetched or loaded; the message is one line for the user."""


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what the user asked for (alias, repo id or path)
    path: str  # local directory (or .gguf file) the weights came from
    source: str  # "alias", "dir", "gguf" or "hf"
    family: str  # config model_type, e.g. "llama"
    can_batch: bool
    batch_reason: str | None  # why not, when can_batch is False
    context_length: int | None
    dtype: str  # compute dtype of the weights, e.g. "float32"
    quantization: str | None  # e.g. "4-bit affine, group 32" when weights stay quantized
    backend: str  # "cpu", "metal" or "cuda"
    blas: str  # "openblas", "reference", "accelerate", ...
    weights_bytes: int
    num_params: int
    eos_token_ids: tuple[int, ...] = ()
    # "chat" (a generative model) or "embedding" (an encoder: serves only the embedding routes,
    # docs/models.md "Embedding models"); pooling and normalize: how its vectors are made
    kind: str = "chat"
    pooling: str | None = None  # "mean", "cls", ... (None: a chat model, mean-pooled)
    normalize: bool | None = None  # L2-normalised vectors (None: a chat model, normalised)
    # The forward plan's one line (forward/forward_plan.py): which path each step kind takes
    forward: str | None = None

    @property
    def dtype_label(self) -> str:
        """The weights as the status line and the console header name them: the float dtype,
        after the bits of the layers that stay quantized ("4/8-bit + float32")."""
        if not self.quantization:
            return self.dtype
        return f"{self.quantization.removesuffix(' quantized')} + {self.dtype}"

    @property
    def generative(self) -> bool:
        return self.kind != "embedding"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        return data
