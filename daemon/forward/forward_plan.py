"""The forward plan: one place, at load, decides which path each step kind of a model takes on
this machine, applies it, and records what it chose and why (docs/models.md, "The forward
plan").

Step kinds: `weights` (how the weights are held in memory), `decode` (one new token per row),
`prefill` (prompt chunks) and `head` (the output projection to the vocabulary). Paths, fastest
first on a CPU: `native quantized` / `native float` (our C steps, native/fused_ops.c, reading
the packed or float32 weights), `fused mlx` (fast_forward.py's fused modules on MLX ops),
`stock` (mlx-lm's own forward). On Metal/CUDA everything is `stock` with the weights as they
came (quantized layers stay quantized there: MLX's GPU kernels are the fast path).

On the CPU, `--dtype auto` keeps 4- and 8-bit affine layers quantized when the native kernels
take their format and the model's structure is one the native steps run; otherwise they are
dequantized to float32 (MLX's own CPU quantized matmul is ~20x slower than float32 on
OpenBLAS) and the plan says why. `--dtype float32` always dequantizes.

`prepare(model, dtype, backend)` is what the loader calls; `status`, the log (one line at
load) and the console show `ForwardPlan.summary()`; the disk tier of the prompt cache keys its
entries to it (a cache written by the float32 path is never read by the quantized one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

logger = logging.getLogger(__name__)

# Families whose quantized weights stay quantized on the CPU (model_type in config.json): the
# ones the native steps run (packed_forward.plain_stack, native_decode); footprint.py predicts
# a load's memory from this before any weight is read.
NATIVE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"})

NATIVE_QUANTIZED = "native quantized"
NATIVE_FLOAT = "native float"
FUSED_MLX = "fused mlx"
STOCK = "stock"


@dataclass(frozen=True)
class StepChoice:
    """The path one step kind takes, and why it is not a faster one ("" when it is the best)."""

    path: str
    why: str = ""

    def __str__(self) -> str:
        return f"{self.path} ({self.why})" if self.why else self.path


@dataclass(frozen=True)
class ForwardPlan:
    weights: StepChoice
    decode: StepChoice
    prefill: StepChoice
    head: StepChoice

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {
            kind: {"path": choice.path, "why": choice.why}
            for kind, choice in (
                ("weights", self.weights),
                ("decode", self.decode),
                ("prefill", self.prefill),
                ("head", self.head),
            )
        }

    def summary(self) -> str:
        """One line: `weights 4-bit g32 · decode native quantized · prefill ... · head ...`."""
        parts = [f"weights {self.weights.path}"]
        parts += [
            f"{kind} {choice.path}"
            for kind, choice in (("decode", self.decode), ("prefill", self.prefill))
        ]
        parts.append(f"head {self.head.path}")
        return " · ".join(parts)

    def reasons(self) -> str:
        """The reasons behind every step kind that does not take its fastest path."""
        kinds = (
            ("weights", self.weights),
            ("decode", self.decode),
            ("prefill", self.prefill),
            ("head", self.head),
        )
        return "; ".join(f"{kind}: {choice.why}" for kind, choice in kinds if choice.why)


def quantized_formats(model: nn.Module) -> set[tuple[int, int, str]]:
    """(bits, group size, mode) of every quantized layer of `model`."""
    return {
        (int(m.bits), int(m.group_size), str(getattr(m, "mode", "affine")))
        for _, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }


def format_name(formats: set[tuple[int, int, str]]) -> str:
    """`4-bit g32`, `4/8-bit g64`, ... for the quantized formats of a model."""
    bits = "/".join(str(b) for b in sorted({b for b, _, _ in formats}))
    groups = "/".join(f"g{g}" for g in sorted({g for _, g, _ in formats}))
    modes = sorted({m for _, _, m in formats} - {"affine"})
    return " ".join(p for p in (f"{bits}-bit", groups, *modes) if p)


def kernels_refuse(formats: set[tuple[int, int, str]]) -> str | None:
    """Why the native quantized kernels do not take these formats, or None when they do."""
    from mlxcel.daemon.forward import native_ops

    for bits, group, mode in sorted(formats):
        if mode != "affine":
            return f"{mode} quantization (the native kernels take affine)"
        why = native_ops.quant_unsupported(bits, group)
        if why is not None:
            return why
    return None


# The switches that turn the native path off (fast_forward, native_decode, native_ops): with
# one set, quantized weights would run on MLX's slow CPU kernels, so they are dequantized.
_OFF_SWITCHES = ("MLXCEL_NO_FAST_FORWARD", "MLXCEL_NO_NATIVE_DECODE", "MLXCEL_NO_NATIVE_OPS")


def stays_quantized_why_not(family: str, formats: set[tuple[int, int, str]]) -> str | None:
    """Why quantized layers of these formats in a `family` model are dequantized on the CPU,
    None when they stay packed (the loader and footprint.py ask the same question)."""
    from mlxcel.shared.switches import switch_flag

    if not formats:
        return "not quantized"
    for switch in _OFF_SWITCHES:
        if switch_flag(switch):
            return f"the native steps are off ({switch})"
    if family not in NATIVE_FAMILIES:
        return f"the native steps do not run the {family} family"
    from mlxcel.daemon.forward import native_ops

    return native_ops.portable_decode_why_not() or kernels_refuse(formats)


def keep_quantized_why_not(model: nn.Module, family: str) -> str | None:
    """Why a quantized `model` of `family` is dequantized on the CPU (None: it stays quantized)."""
    return stays_quantized_why_not(family, quantized_formats(model))


def prepare(model: nn.Module, dtype: str, backend: str, family: str) -> ForwardPlan:
    """Decide and apply the forward of a freshly loaded `model`; log the plan in one line."""
    from mlxcel.daemon.forward.fast_forward import apply_fast_forward
    from mlxcel.daemon.models.loader import apply_dtype

    formats = quantized_formats(model)
    keep = False
    weights_why = ""
    if backend == "cpu" and formats:
        if dtype == "auto":
            why = keep_quantized_why_not(model, family)
            keep = why is None
            weights_why = "" if keep else f"dequantized: {why}"
        else:
            weights_why = f"dequantized: --dtype {dtype}"
    apply_dtype(model, dtype, backend, keep_quantized=keep)
    apply_fast_forward(model, backend)
    plan = describe(model, backend, formats if (keep or backend != "cpu") else set(), weights_why)
    logger.info("forward plan: %s", plan.summary())
    if plan.reasons():
        logger.info("forward plan: why not faster: %s", plan.reasons())
    if keep and plan.decode.path != NATIVE_QUANTIZED:
        logger.warning(
            "forward plan: quantized weights run on MLX's CPU kernels (slow): %s", plan.decode.why
        )
    return plan


def _weights_choice(model: nn.Module, formats: set[tuple[int, int, str]], why: str) -> StepChoice:
    if formats:
        return StepChoice(format_name(formats), why)
    dtypes = {str(p.dtype).removeprefix("mlx.core.") for p in _float_params(model)}
    name = dtypes.pop() if len(dtypes) == 1 else "mixed"
    return StepChoice(name, why)


def _float_params(model: nn.Module) -> list[Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)][
        :64
    ]


def describe(
    model: nn.Module, backend: str, formats: set[tuple[int, int, str]], weights_why: str = ""
) -> ForwardPlan:
    """The plan as installed on `model` (read off its modules)."""
    from mlxcel.daemon.forward import fast_forward, native_ops

    weights = _weights_choice(model, formats, weights_why)
    if backend != "cpu":
        stock = StepChoice(STOCK, "")
        return ForwardPlan(weights, stock, stock, StepChoice(STOCK, ""))
    quantized = bool(formats)
    native_path = NATIVE_QUANTIZED if quantized else NATIVE_FLOAT
    backbone = getattr(model, "model", None)
    native = None if backbone is None else backbone.__dict__.get("_mlxcel_native")
    if native is not None:
        off = getattr(native, "decode_off_why", None)
        decode = StepChoice(native_path) if off is None else StepChoice(FUSED_MLX, off)
        if getattr(native, "_chunk", None) is not None:
            prefill = StepChoice(native_path)
        else:
            prefill = StepChoice(FUSED_MLX, "the chunk step needs a cblas_sgemm in the process")
    elif fast_forward.is_fast(getattr(model, "model", model)) or fast_forward.is_fast(model):
        why = _native_why_not(backbone)
        decode = StepChoice(FUSED_MLX, why)
        prefill = StepChoice(FUSED_MLX, why)
    else:
        # which family and why (the fast forward's own reason), or off by its switch
        why = f"fast forward: {fast_forward.unsupported_reason(model) or 'not applied'}"
        decode, prefill = StepChoice(STOCK, why), StepChoice(STOCK, why)
    return ForwardPlan(weights, decode, prefill, _head_choice(model, quantized, native_ops))


def _native_why_not(backbone: Any) -> str:
    from mlxcel.daemon.forward.native_decode import NativeDecode

    if backbone is None:
        return "no backbone"
    _, why = NativeDecode.for_backbone(backbone)
    return why or "not installed"


def _head_choice(model: nn.Module, quantized: bool, native_ops: Any) -> StepChoice:
    head = getattr(model, "lm_head", None)
    if head is None:
        backbone = getattr(model, "model", None)
        head = getattr(backbone, "embed_tokens", None)
    if head is None:
        return StepChoice(STOCK, "no output head found")
    if getattr(head, "_mlxcel_quant", None) is not None:  # fast_forward._native_head
        return StepChoice(NATIVE_QUANTIZED if quantized else NATIVE_FLOAT)
    if isinstance(head, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return StepChoice(STOCK, "MLX's quantized matmul")
    return StepChoice(STOCK, "" if not quantized else "float head")
