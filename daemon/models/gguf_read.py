"""GGUF tensors and metadata of a vetted file, each quant type converted exactly.

The metadata comes from the vetted header's bytes (`gguf_vet.read_metadata`), each tensor's
raw ggml blocks from a map of the file at the vetted offsets; they are turned
into MLX's affine quantized triples (`weight` packed codes, `scales`, `biases`: w = s * q + b
per group of 32) where a block's arithmetic is exactly that, and into floats otherwise:

| ggml type | llama.cpp's value | MLX form |
|---|---|---|
| F32, F16, BF16 | itself | the same float type |
| Q8_0 | d * q (q int8) | 8-bit, group 32: s = d, b = -128 d |
| Q4_0 | d * (q - 8) | 4-bit, group 32: s = d, b = -8 d |
| Q4_1 | d * q + m | 4-bit, group 32: s = d, b = m |
| Q5_0 | d * (q - 16) | 5-bit, group 32: s = d, b = -16 d |
| Q5_1 | d * q + m | 5-bit, group 32: s = d, b = m |
| Q4_K | (d sc_j) q - (dmin m_j) per 32 | 4-bit, group 32: s = d sc_j, b = -dmin m_j |
| Q5_K | the same with 5-bit q | 5-bit, group 32 |
| Q6_K | (d sc_j) (q - 32) per 16 | float32 (MLX has no group size 16) |

d, dmin and m are float16 in the file and sc_j, m_j 6-bit integers, so every s and b above is
exact in float32 (d sc_j needs 17 significant bits); they are stored in float16 when that holds
them exactly for the whole tensor (Q8_0/Q4_x/Q5_x: always, which is also how MLX's own GGUF
reader stores them), else in float32. A tensor that is not a matrix (a quantized norm) is
dequantized to float32. Any other type (IQ*, Q2_K, Q3_K, TQ*, ...) is refused with its name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import psutil
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from mlxcel.daemon.models.gguf_info import AFFINE_BITS_BY_NAME, conversion_memory
from mlxcel.daemon.models.gguf_vet import (
    CONVERTIBLE,
    GGUFHeader,
    check_convertible,
    read_metadata,
    unconvertible_reason,
)
from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.shared.config import format_size

log = logging.getLogger(__name__)

GROUP = 32
Q = GGMLQuantizationType
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}
AFFINE_BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5}
WIDENED = {Q.Q6_K}  # converted to float32: exact, but not MLX's affine form
SUPPORTED = FLOAT_TYPES | set(AFFINE_BITS) | WIDENED
assert {t.name: b for t, b in AFFINE_BITS.items()} == AFFINE_BITS_BY_NAME
assert {t.name for t in SUPPORTED} == CONVERTIBLE  # the header check refuses the same types


@dataclass
class Converted:
    arrays: dict[str, mx.array]  # "" -> the weight; ".scales"/".biases" for affine ones
    source_type: str  # the ggml type name in the file
    target: str  # what it became: "float32", "4-bit affine (float16 scales)", ...


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (n, 2) bytes -> (n,) float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(raw.shape[0])


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits, element j = bit j."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> the 8 six-bit scales and mins of a super-block."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32) 4-bit codes: 32 bytes hold sub-blocks 2c (low) and 2c+1."""
    chunks = qs.reshape(qs.shape[0], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(qs.shape[0], 8, 32)


def affine_groups(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw blocks (n, block bytes) -> codes (n groups, 32) uint8 and float32 scales and
    biases (n groups,) with value = scale * code + bias, exactly llama.cpp's value."""
    n = blocks.shape[0]
    if qtype == Q.Q8_0:
        d = _f16(blocks[:, 0:2])
        codes = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128.0 * d
    if qtype == Q.Q4_0:
        d = _f16(blocks[:, 0:2])
        return _nibbles(blocks[:, 2:18]), d, -8.0 * d
    if qtype == Q.Q4_1:
        return _nibbles(blocks[:, 4:20]), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    if qtype == Q.Q5_0:
        d = _f16(blocks[:, 0:2])
        codes = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6]) << 4)
        return codes, d, -16.0 * d
    if qtype == Q.Q5_1:
        codes = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8]) << 4)
        return codes, _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, mn = _k_scales(blocks[:, 4:16])
        if qtype == Q.Q4_K:
            codes = _k_low(blocks[:, 16:144])
        else:  # qh (32 bytes): bit j of byte i is element i of sub-block j
            high = np.unpackbits(blocks[:, 16:48], axis=-1, bitorder="little")
            high = high.reshape(n, 32, 8).transpose(0, 2, 1)
            codes = _k_low(blocks[:, 48:176]) | (high << 4)
        return codes.reshape(n * 8, 32), (d * sc).reshape(-1), (-(dmin * mn)).reshape(-1)
    raise AssertionError(qtype)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) codes -> MLX's packing: a little-endian bit stream in uint32 words."""
    rows, cols = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        pairs = codes.reshape(rows, cols // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    stream = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little").view(
        np.uint32
    )


def _narrow(values: np.ndarray) -> np.ndarray:
    """float16 when it holds every value exactly, else float32."""
    half = values.astype(np.float16)
    if np.isfinite(half).all() and np.array_equal(half.astype(np.float32), values):
        return half
    return values


def convert_tensor(name: str, qtype: Q, data: np.ndarray, shape: tuple[int, ...]) -> Converted:
    """One tensor (`shape` in numpy order; `data` as the reader gives it) in MLX's form."""
    if qtype not in SUPPORTED:
        raise ModelLoadError(unconvertible_reason(name, qtype.name))
    if qtype == Q.F32:
        return Converted(
            {"": mx.array(np.asarray(data, np.float32).reshape(shape))}, "F32", "float32"
        )
    if qtype == Q.F16:
        return Converted(
            {"": mx.array(np.asarray(data).view(np.float16).reshape(shape))}, "F16", "float16"
        )
    if qtype == Q.BF16:
        raw = mx.array(np.ascontiguousarray(data).view(np.uint16).reshape(shape))
        return Converted({"": raw.view(mx.bfloat16)}, "BF16", "bfloat16")
    if qtype in WIDENED or len(shape) != 2 or qtype not in AFFINE_BITS:
        values = dequantize(np.asarray(data), qtype).reshape(shape).astype(np.float32)
        return Converted({"": mx.array(values)}, qtype.name, "float32")
    rows, cols = shape
    bits = AFFINE_BITS[qtype]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    codes, scales, biases = affine_groups(blocks, qtype)
    scales, biases = _narrow(scales.reshape(rows, cols // GROUP)), biases.reshape(rows, -1)
    biases = _narrow(biases)
    if scales.dtype != biases.dtype:
        scales, biases = scales.astype(np.float32), biases.astype(np.float32)
    arrays = {
        "": mx.array(pack(codes.reshape(rows, cols), bits)),
        ".scales": mx.array(scales),
        ".biases": mx.array(biases),
    }
    kind = "float16" if scales.dtype == np.float16 else "float32"
    return Converted(arrays, qtype.name, f"{bits}-bit affine, group {GROUP} ({kind} scales)")


def read_gguf_file(path: Path, header: GGUFHeader) -> tuple[dict[str, Any], dict[str, Converted]]:
    """(metadata, tensors by GGUF name) of a vetted file (`header`: its `vet_gguf`);
    unsupported types refused first. The metadata is read with `struct` (`read_metadata`),
    each tensor's bytes from a map of the file at the header's offsets, typed as the `gguf`
    package's reader hands them out (F32/F16 as floats, the rest as raw bytes, a quantized one
    in rows of bytes)."""
    path = Path(path)
    check_convertible(header)
    meta = read_metadata(path, header)
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    if mapped.size != header.file_size:
        raise ModelLoadError(f"{path.name}: the file changed since it was checked")
    tensors = {}
    for info in header.tensors:
        qtype = GGMLQuantizationType[info.ggml_type]
        start = header.data_offset + info.offset
        shape = tuple(reversed(info.shape))  # numpy order
        tensors[info.name] = convert_tensor(
            info.name, qtype, _typed(mapped[start : start + info.nbytes], qtype, info.shape), shape
        )
        if qtype in WIDENED:
            log.info(
                "%s (%s) converted to float32: exact, not MLX's affine form",
                info.name,
                info.ggml_type,
            )
    return meta, tensors


def _typed(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as the `gguf` reader types them: F32 and F16 as those floats, other
    types as bytes in rows (the GGUF shape's first dimension is a row)."""
    if qtype == Q.F32:
        return raw.view(np.float32)
    if qtype == Q.F16:
        return raw.view(np.float16)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return raw.reshape(-1, shape[0] // block * block_bytes)


def available_memory() -> int:
    return int(psutil.virtual_memory().available)


def check_conversion_memory(path: Path, header: GGUFHeader) -> None:
    """Refuse, before any tensor is read, a file whose conversion cannot fit in the memory
    available now, with the figure it would need."""
    weights, temporaries = conversion_memory(header)
    available = available_memory()
    if weights + temporaries > available:
        raise ModelLoadError(
            f"converting {Path(path).name} needs about {format_size(weights + temporaries)} of "
            f"memory ({format_size(weights)} of converted weights and "
            f"{format_size(temporaries)} while its largest tensor converts) and "
            f"{format_size(available)} is available"
        )
