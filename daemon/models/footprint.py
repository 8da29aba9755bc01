"""What a model's weights will occupy in memory once loaded on a backend (docs/models.md).

The size on disk is not it: on the CPU backend every float parameter is cast to float32, and
quantized layers stay packed only where the forward plan keeps them (forward_plan.py: a family
the native steps run, a format the native kernels take); elsewhere they are dequantized, so a
4-bit model then takes ~8x its packed weights and an 8-bit or bfloat16 one ~4x / 2x.
`resident_weight_bytes` reads only the headers (safetensors JSON headers, GGUF tensor infos;
bounded) and config.json's `quantization`, never the tensors. The model host checks it against
the available memory before it evicts anything for a load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.info import ModelLoadError

FLOAT32_BYTES = 4
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit on its JSON header

_SAFETENSORS_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
_FLOATS = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}


def resident_weight_bytes(path: Path, backend: str) -> int:
    """Bytes the weights of the model at `path` (a model directory or a .gguf file) will take
    once loaded on `backend` ("cpu", "metal", "cuda") with dtype auto. Raises
    ModelLoadError for a header it cannot read."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_bytes(path, backend)
    return _safetensors_bytes(path, backend)


# -- safetensors directories -------------------------------------------------------------------


def _safetensors_bytes(path: Path, backend: str) -> int:
    config = _read_json(path / "config.json")
    quant = config.get("quantization") or config.get("quantization_config") or {}
    if not isinstance(quant, dict):
        quant = {}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(path.glob("model*.safetensors")):  # what mlx-lm loads (not consolidated.*)
        tensors.update(_safetensors_header(file))
    if backend != "cpu":  # quantized layers stay quantized; floats keep about their width
        return sum(
            _elements(shape) * _SAFETENSORS_BYTES.get(dt, 4) for dt, shape in tensors.values()
        )
    if _cpu_keeps_quantized(str(config.get("model_type", "")), _formats(quant, tensors)):
        # Packed weights as they are; scales, biases and every float parameter in float32.
        return sum(
            _elements(shape) * (FLOAT32_BYTES if dt in _FLOATS else _SAFETENSORS_BYTES.get(dt, 4))
            for dt, shape in tensors.values()
        )
    total = 0
    for name, (dtype, shape) in tensors.items():
        base = name.rsplit(".", 1)[0]
        quantized = f"{base}.scales" in tensors
        if quantized and name.endswith((".scales", ".biases")):
            continue  # folded into the dequantized weight
        if quantized and name.endswith(".weight"):
            bits = _bits(quant, base)
            packed_bits = _SAFETENSORS_BYTES.get(dtype, 4) * 8
            total += _elements(shape) * packed_bits // bits * FLOAT32_BYTES
        elif dtype in _FLOATS:
            total += _elements(shape) * FLOAT32_BYTES
        else:
            total += _elements(shape) * _SAFETENSORS_BYTES.get(dtype, 4)
    return total


def _cpu_keeps_quantized(family: str, formats: set[tuple[int, int, str]]) -> bool:
    """True when the loader keeps these quantized formats packed on the CPU (forward_plan.py)."""
    from mlxcel.daemon.forward.forward_plan import stays_quantized_why_not

    return stays_quantized_why_not(family, formats) is None


def _formats(
    quant: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]]
) -> set[tuple[int, int, str]]:
    """(bits, group size, mode) of every quantized layer, from config.json's `quantization`."""
    group_size = quant.get("group_size")
    group = group_size if isinstance(group_size, int) else 64
    mode = str(quant.get("mode", "affine"))
    formats = set()
    for name in tensors:
        if name.endswith(".scales"):
            base = name.removesuffix(".scales")
            own = quant.get(base) or quant.get(base.removeprefix("model."))
            size = own.get("group_size", group) if isinstance(own, dict) else group
            formats.add((_bits(quant, base), int(size), mode))
    return formats


def _bits(quant: dict[str, Any], layer: str) -> int:
    """A layer's bits: its own entry in config.json's `quantization` (mixed quantization),
    else the model's; 4 when neither says (mlx-lm's default)."""
    for key in (layer, layer.removeprefix("model.")):
        own = quant.get(key)
        if isinstance(own, dict) and isinstance(own.get("bits"), int) and own["bits"] > 0:
            return int(own["bits"])
    bits = quant.get("bits")
    return int(bits) if isinstance(bits, int) and bits > 0 else 4


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    return data


def _safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= MAX_SAFETENSORS_HEADER:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(int(d) for d in entry["shape"])
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in {name}")
            out[name] = (str(entry["dtype"]), shape)
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{file} is not a valid safetensors file ({exc})") from None


def _elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


# -- GGUF files --------------------------------------------------------------------------------


def _gguf_bytes(file: Path, backend: str) -> int:
    from mlxcel.daemon.models.gguf_info import conversion_memory
    from mlxcel.daemon.models.gguf_vet import vet_gguf_once

    # The one bounded GGUF header reader (daemon/models/gguf_vet.py): refuses a crafted header
    # with its reason (ModelLoadError), remembered per file version.
    header = vet_gguf_once(file)
    if backend == "cpu" and not _gguf_keeps_quantized(file, header):
        # every tensor is dequantized / cast to float32
        return sum(_elements(t.shape) for t in header.tensors) * FLOAT32_BYTES
    # What the conversion makes of each tensor (docs/models.md, "GGUF files"): not the file's
    # size, since Q6_K becomes float32 (~4.9x its bytes) and K-quants get float32 scales.
    return conversion_memory(header)[0]


def _gguf_keeps_quantized(file: Path, header: Any) -> bool:
    """True when the conversion of this GGUF stays quantized on the CPU (forward_plan.py)."""
    from mlxcel.daemon.models.gguf_info import AFFINE_BITS_BY_NAME, FLOAT_NAMES

    formats = set()
    for tensor in header.tensors:
        bits = AFFINE_BITS_BY_NAME.get(tensor.ggml_type)
        if bits is not None:
            formats.add((bits, 32, "affine"))
        elif tensor.ggml_type not in FLOAT_NAMES:
            formats.add((0, 32, tensor.ggml_type))  # a type converted to float32: mixed
    formats = {f for f in formats if f[0] != 0}
    return bool(formats) and _cpu_keeps_quantized(_gguf_family(file), formats)


def _gguf_family(file: Path) -> str:
    """The mlx-lm model_type of a (vetted) GGUF file, or "" when it cannot be read."""
    try:
        from mlxcel.daemon.models.gguf import ARCHITECTURES
        from mlxcel.daemon.models.gguf_vet import read_metadata, vet_gguf_once

        arch = read_metadata(file, vet_gguf_once(file)).get("general.architecture")
        return ARCHITECTURES.get(arch, ("",))[0] if isinstance(arch, str) else ""
    except Exception:  # a family unknown here only makes the estimate larger
        return ""
