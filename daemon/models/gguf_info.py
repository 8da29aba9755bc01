"""Which ggml quant types a GGUF model came from, per tensor class (`models show`).

A tensor class is llama.cpp's tensor name without the block number (`attn_q`, `ffn_down`,
`token_embd`, `output`, ...). `convert_gguf` writes `SOURCE_INFO` into the converted
directory (the source file's name, architecture, and for each class its ggml type and what it
became); `models show` reads that, or the header of a `.gguf` file itself (vetted, bounded:
`gguf_vet`), or that of the source GGUF a store entry keeps (the default model). No mlx here,
so `conversion_memory` (what a conversion needs; what the weights take once converted, e.g.
on a GPU backend: Q6_K is float32 there) can run beside the header checks.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SOURCE_INFO = "mlxcel-gguf.json"
MAX_INFO_BYTES = 1 << 20


def tensor_class(name: str) -> str:
    """`blk.3.attn_q.weight` -> `attn_q`; `token_embd.weight` -> `token_embd`; a bias keeps
    its suffix (`attn_q.bias`)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        parts = parts[2:]
    if parts[-1] == "weight":
        parts = parts[:-1]
    return ".".join(parts)


def summarize(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(tensor name, value) pairs -> per class the most common value, then the others with
    their counts: {"ffn_down": "Q4_K, Q6_K in 12 of 24"}."""
    by_class: dict[str, Counter[str]] = {}
    for name, value in pairs:
        by_class.setdefault(tensor_class(name), Counter())[value] += 1
    out = {}
    for cls, counts in sorted(by_class.items()):
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        total = sum(counts.values())
        out[cls] = ranked[0][0] + "".join(f", {v} in {n} of {total}" for v, n in ranked[1:])
    return out


def source_info(
    file_name: str, arch: str, types: dict[str, str], targets: dict[str, str]
) -> dict[str, Any]:
    return {
        "source": file_name,
        "architecture": arch,
        "tensor_types": summarize(types.items()),
        "converted_to": summarize(targets.items()),
    }


def write_source_info(out_dir: Path, info: dict[str, Any]) -> None:
    (Path(out_dir) / SOURCE_INFO).write_text(json.dumps(info, indent=2) + "\n")


# What gguf_read makes of each type: affine bits (group 32), else float32 unless a float type.
AFFINE_BITS_BY_NAME = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}
FLOAT_NAMES = {"F32", "F16", "BF16"}
# Bytes per element of the numpy temporaries while one tensor converts: its codes and their
# packing (the 5-bit one goes through a bit per byte), gguf's float32 dequantization (Q6_K)
# and its copies. Measured with tracemalloc on 2048 x 2048 tensors: 4-bit 2.3, 8-bit 4.1,
# 5-bit 11.3, Q6_K 8.1.
TEMP_BYTES = {4: 6, 8: 6, 5: 12, 32: 12}


def converted_bytes(type_name: str, elements: int, nbytes: int) -> int:
    """Bytes a tensor takes once converted (affine: packed codes + float32 scales and biases
    at most; Q6_K: float32; float types: as stored)."""
    if type_name in FLOAT_NAMES:
        return nbytes
    bits = AFFINE_BITS_BY_NAME.get(type_name)
    if bits is not None:
        return elements * bits // 8 + elements // 32 * 8
    return elements * 4


def conversion_memory(header: Any) -> tuple[int, int]:
    """(bytes of the converted weights, bytes of the largest tensor's temporaries) for a
    vetted `gguf_vet.GGUFHeader`; also what the weights take on a GPU backend."""
    total, peak = 0, 0
    for tensor in header.tensors:
        elements = 1
        for dim in tensor.shape:
            elements *= dim
        total += converted_bytes(tensor.ggml_type, elements, tensor.nbytes)
        if tensor.ggml_type in FLOAT_NAMES:
            temp = tensor.nbytes
        else:
            temp = elements * TEMP_BYTES[AFFINE_BITS_BY_NAME.get(tensor.ggml_type, 32)]
        peak = max(peak, temp)
    return total, peak


def _from_header(file: Path) -> dict[str, Any]:
    from mlxcel.daemon.models.gguf_vet import vet_gguf_once

    header = vet_gguf_once(file)
    return {
        "source": file.name,
        "tensor_types": summarize((t.name, t.ggml_type) for t in header.tensors),
    }


def gguf_quant_summary(path: Path) -> dict[str, Any] | None:
    """What `models show` reports for `path` (a .gguf, or a converted / store directory);
    None for a model that did not come from a GGUF. `ModelLoadError` for a bad header."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_header(path)
    if not path.is_dir():
        return None
    info = path / SOURCE_INFO
    if info.is_file():
        try:
            with open(info, "rb") as f:
                raw = f.read(MAX_INFO_BYTES + 1)
            data = json.loads(raw) if len(raw) <= MAX_INFO_BYTES else None
        except (OSError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None
    from mlxcel.daemon.models.registry import read_manifest

    manifest = read_manifest(path) or {}
    kept = manifest.get("gguf")
    source = (path / kept).resolve() if isinstance(kept, str) else None
    # the default model keeps its source GGUF inside its folder
    if source is not None and source.is_relative_to(path.resolve()) and source.is_file():
        return _from_header(source)
    return None
