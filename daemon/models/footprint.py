"""What a model's weights will occupy in memory once loaded on a backend (docs/models.md).

The size on disk is not it: on the CPU backend the loader dequantizes quantized layers and
casts every float parameter to float32 (`loader.apply_dtype`), so a 4-bit model takes ~8x its
packed weights and an 8-bit or bfloat16 one ~4x / 2x. `resident_weight_bytes` reads only the
headers (safetensors JSON headers, GGUF tensor infos; bounded) and config.json's
`quantization`, never the tensors. The model host checks it against the available memory
before it evicts anything for a load.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from mlxcel.daemon.models.info import ModelLoadError

FLOAT32_BYTES = 4
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit on its JSON header
MAX_GGUF_HEADER = 256 << 20  # metadata + tensor infos read at most (a tokenizer is ~10 MB)
MAX_GGUF_COUNT = 1 << 20  # tensors, metadata keys, array items
MAX_GGUF_DIMS = 8

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
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(_safetensors_header(file))
    if backend != "cpu":  # quantized layers stay quantized; floats keep about their width
        return sum(
            _elements(shape) * _SAFETENSORS_BYTES.get(dt, 4) for dt, shape in tensors.values()
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

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Reader:
    """Reads a GGUF header with a byte budget, so a crafted count cannot make it run away."""

    def __init__(self, f: BinaryIO, budget: int) -> None:
        self._f = f
        self._left = budget

    def take(self, n: int) -> bytes:
        if n > self._left:
            raise ValueError("the header is larger than any real GGUF's")
        data = self._f.read(n)
        if len(data) != n:
            raise ValueError("the header is cut short")
        self._left -= n
        return data

    def skip(self, n: int) -> None:
        if n > self._left:
            raise ValueError("the header is larger than any real GGUF's")
        self._left -= n
        self._f.seek(n, 1)

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def count(self, wide: bool) -> int:
        n = self.u64() if wide else self.u32()
        if n > MAX_GGUF_COUNT:
            raise ValueError(f"a count of {n}")
        return n

    def skip_string(self, wide: bool) -> None:
        self.skip(self.u64() if wide else self.u32())

    def skip_value(self, kind: int, wide: bool, depth: int = 0) -> None:
        if kind in _GGUF_SCALARS:
            self.skip(_GGUF_SCALARS[kind])
        elif kind == _GGUF_STRING:
            self.skip_string(wide)
        elif kind == _GGUF_ARRAY and depth < 2:
            item, n = self.u32(), self.count(wide)
            if item in _GGUF_SCALARS:
                self.skip(_GGUF_SCALARS[item] * n)
            else:
                for _ in range(n):
                    self.skip_value(item, wide, depth + 1)
        else:
            raise ValueError(f"unknown metadata value type {kind}")


def _gguf_tensors(file: Path) -> Iterator[tuple[int, ...]]:
    with open(file, "rb") as f:
        r = _Reader(f, min(MAX_GGUF_HEADER, file.stat().st_size))
        if r.take(4) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = r.u32()
        if version not in (1, 2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        wide = version >= 2
        n_tensors, n_kv = r.count(wide), r.count(wide)
        for _ in range(n_kv):
            r.skip_string(wide)
            r.skip_value(r.u32(), wide)
        for _ in range(n_tensors):
            r.skip_string(wide)
            n_dims = r.u32()
            if n_dims > MAX_GGUF_DIMS:
                raise ValueError(f"a tensor with {n_dims} dimensions")
            dims = tuple(r.u64() if wide else r.u32() for _ in range(n_dims))
            r.skip(4 + 8)  # type, offset
            yield dims


def _gguf_bytes(file: Path, backend: str) -> int:
    try:
        elements = sum(_elements(dims) for dims in _gguf_tensors(file))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{file} is not a valid GGUF file ({exc})") from None
    if backend == "cpu":  # every tensor is dequantized / cast to float32
        return elements * FLOAT32_BYTES
    return file.stat().st_size
