"""Native fused ops (attention, SwiGLU) for prefill-sized inputs, through ctypes.

`native/fused_ops.c`, built by scripts/setup.sh into `libmlxcel_ops.so` beside the few-row
kernel, runs a whole attention (scores, mask, softmax, weighted sum) or SwiGLU in one
multi-threaded AVX-512/AVX2 pass (plain C elsewhere: aarch64, an x86 CPU without AVX2/FMA,
"portable" in the log). MLX's CPU backend runs those as several single-threaded
scalar ops (its `exp` alone costs 20+ ns a float here): at a 256-token prefill they cost more
than the matmuls.

The call is plain ctypes on evaluated arrays: the inputs are evaluated (a sync, ~30 us), the
C code reads their buffers in place (numpy views, strides passed along) and writes a numpy
array that becomes the op's result. The sync is why only large inputs take this path
(`NATIVE_MIN_ROWS`); a decode step's few rows stay in MLX's graph. Without the library (not
built, no compiler, `MLXCEL_NO_NATIVE_OPS=1`) every caller uses its MLX version; `log_choice()`
says which in one line.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
from mlxcel.daemon.forward.blas import resolve_native
from mlxcel.shared.switches import switch_flag, switch_int, switch_value

logger = logging.getLogger(__name__)

DISABLE_ENV = "MLXCEL_NO_NATIVE_OPS"
F32_SCALES_ENV = "MLXCEL_QUANT_F32_SCALES"  # keep quantized layers' scales in float32
# Query rows x batch (attention) or token rows (SwiGLU) from which the native path pays for its
# sync; MLXCEL_NATIVE_MIN_ROWS overrides it (measurements).
# Read once, at import: the forward reads it per layer as a plain global, and tests and
# scripts/bench_forward.py patch it as a module attribute (shared/switches.py).
NATIVE_MIN_ROWS = switch_int("MLXCEL_NATIVE_MIN_ROWS")

_F32P = ctypes.POINTER(ctypes.c_float)
_LONGP = ctypes.POINTER(ctypes.c_long)
_I32P = ctypes.POINTER(ctypes.c_int)


@cache
def _load() -> tuple[Any, str]:
    """(the library or None, why not / which path). The file is `blas.resolve_native("ops")`'s:
    MLXCEL_OPS_LIB, the package's build, the per-user cache (built at first use); one of
    another ABI version is refused there by name."""
    if switch_flag(DISABLE_ENV):
        return None, f"turned off by {DISABLE_ENV}"
    found = resolve_native("ops")
    if found.path is None:
        return None, found.why
    path = found.path
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    logger.info("native ops: %s %s", path.name, found.describe())
    lib.mlxcel_ops_path.restype = ctypes.c_char_p
    isa = (lib.mlxcel_ops_path() or b"none").decode()
    if isa not in ("avx512", "avx2", "portable"):  # "none": a build from before "portable"
        return None, f"the library has no float ops for this CPU ({isa}; rebuild it)"
    lib.mlxcel_swiglu.restype = ctypes.c_int
    lib.mlxcel_swiglu.argtypes = (_F32P, _F32P, ctypes.c_long, ctypes.c_long)
    lib.mlxcel_attention.restype = ctypes.c_int
    lib.mlxcel_attention.argtypes = (
        _F32P, _LONGP, _F32P, _LONGP, _F32P, _LONGP,
        ctypes.POINTER(ctypes.c_uint8), ctypes.c_long, ctypes.c_long, _F32P,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_float,
    )  # fmt: skip
    if hasattr(lib, "mlxcel_rms_norm"):
        lib.mlxcel_rms_norm.restype = ctypes.c_int
        lib.mlxcel_rms_norm.argtypes = (_F32P, _F32P, ctypes.c_float, ctypes.c_long,
                                        ctypes.c_long, _F32P)  # fmt: skip
        lib.mlxcel_rope_rows.restype = ctypes.c_int
        lib.mlxcel_rope_rows.argtypes = (
            _F32P, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int, _I32P,
            _F32P, _F32P, ctypes.c_long, ctypes.c_int,
        )  # fmt: skip
    return lib, isa


QUANT_BITS = (4, 8)
QUANT_GROUPS = (32, 64, 128)
_U32P = ctypes.POINTER(ctypes.c_uint32)


@cache
def _quant_lib() -> tuple[Any, str]:
    """(the library with its quantized kernels' signatures set, or None; their path
    "avx512" / "avx2" / "portable", or why not)."""
    lib, why = _load()
    if lib is None:
        return None, why
    if not hasattr(lib, "mlxcel_qmatmul"):
        return None, "the library predates the quantized kernels (rebuild it)"
    lib.mlxcel_qmatmul.restype = ctypes.c_int
    lib.mlxcel_qmatmul.argtypes = (
        _F32P, ctypes.c_long, ctypes.c_long, ctypes.c_long, _U32P, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, _F32P,
    )  # fmt: skip
    lib.mlxcel_quant_supported.restype = ctypes.c_int
    lib.mlxcel_quant_supported.argtypes = (ctypes.c_int, ctypes.c_int)
    lib.mlxcel_quant_path.restype = ctypes.c_char_p
    return lib, (lib.mlxcel_quant_path() or b"portable").decode()


def quant_path() -> str | None:
    """The quantized kernels' path ("avx512", "avx2", "portable"), None without them."""
    lib, name = _quant_lib()
    return name if lib is not None else None


def quant_unsupported(bits: int, group: int, mode: str = "affine") -> str | None:
    """None when the native quantized kernels take weights of `bits` and `group` (MLX's
    affine format, float32 scales and biases), else why not."""
    lib, why = _quant_lib()
    if lib is None:
        return f"native quantized kernels not available ({why})"
    if mode != "affine":
        return f"quantization mode {mode!r} (the kernels take MLX's affine format)"
    if bits not in QUANT_BITS:
        return f"{bits}-bit weights (the kernels take 4 and 8 bits)"
    if group not in QUANT_GROUPS:
        return f"group size {group} (the kernels take 32, 64 and 128)"
    if not lib.mlxcel_quant_supported(bits, group):
        return f"{bits}-bit group {group} (not in this library's kernels)"
    return None


# The C kernels' types of scales and biases (`half` in native/quant_kernels.h), by the host
# array's dtype: bfloat16 travels as its uint16 bits (numpy has no bfloat16).
SCALE_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}


def scale_type(scales: np.ndarray) -> int:
    """`half` of the C kernels for host scales or biases (quant_arrays)."""
    return SCALE_TYPES[scales.dtype]


def narrow_scales(layer: Any) -> str | None:
    """Store a quantized layer's float32 scales and biases as float16, or else bfloat16, when
    that type holds every value exactly (a GGUF's and most mlx-community models' do: they
    came as float16 / bfloat16): the native kernels then read fewer bytes a token (at group
    32, a 4-bit layer's 6 bits a weight become 5) and give the same results bit for bit, as
    every value they compute with is the same. The layer's own MLX ops stay exact too (they
    promote to float32). Only for a layer the native kernels run (`quant_unsupported` is
    None); off with MLXCEL_QUANT_F32_SCALES=1. Returns the type chosen, or None."""
    if switch_flag(F32_SCALES_ENV) or layer.get("biases") is None:
        return None
    if layer.scales.dtype != mx.float32 or layer.biases.dtype != mx.float32:
        return None
    if quant_unsupported(layer.bits, layer.group_size, getattr(layer, "mode", "affine")):
        return None
    wide = (layer.scales, layer.biases)
    for dtype, name in ((mx.float16, "float16"), (mx.bfloat16, "bfloat16")):
        narrow = [a.astype(dtype) for a in wide]
        if all(
            mx.array_equal(n.astype(mx.float32), w).item()
            for n, w in zip(narrow, wide, strict=True)
        ):
            mx.eval(narrow)
            layer.scales, layer.biases = narrow
            return name
    return None


def host_scales(array: mx.array) -> np.ndarray:
    """Scales or biases as the kernels take them (bfloat16 as its uint16 bits), evaluated."""
    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16))
    return np.asarray(array)


def quant_arrays(layer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight uint32, scales, biases) of a quantized layer (a QuantizedLinear or
    QuantizedEmbedding), C-contiguous host arrays (views of the evaluated buffers where they
    already are); scales and biases float32, float16, or bfloat16 as uint16 (`scale_type`).
    Raises TypeError for a layer that is not MLX's affine format with biases, both of one of
    those types, ValueError for a format the kernels do not take (the message says which)."""
    why = quant_unsupported(layer.bits, layer.group_size, getattr(layer, "mode", "affine"))
    if why is not None:
        raise ValueError(why)
    if layer.get("biases") is None:
        raise TypeError("quantized layer without biases")
    kinds = (mx.float32, mx.float16, mx.bfloat16)
    if layer.scales.dtype not in kinds or layer.biases.dtype != layer.scales.dtype:
        raise TypeError(f"quantized layer with {layer.scales.dtype} scales")
    mx.eval(layer.weight, layer.scales, layer.biases)
    arrays = (np.asarray(layer.weight), host_scales(layer.scales), host_scales(layer.biases))
    return tuple(np.ascontiguousarray(a) for a in arrays)  # type: ignore[return-value]


def qmatmul(
    x: mx.array, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int
) -> mx.array:
    """x @ dequantize(weight, scales, biases).T for the host arrays of `quant_arrays`, x
    float32 (..., in) evaluated here; (..., out) float32."""
    lib, why = _quant_lib()
    if lib is None:
        raise RuntimeError(f"native quantized kernels not available ({why})")
    out_dims, in_dims = weight.shape[0], scales.shape[1] * group
    if x.shape[-1] != in_dims:
        raise ValueError(f"input of width {x.shape[-1]} for a {in_dims}-wide layer")
    if biases.dtype != scales.dtype:
        raise TypeError(f"scales of {scales.dtype} with biases of {biases.dtype}")
    x = mx.contiguous(x.astype(mx.float32))
    mx.eval(x)
    host = np.asarray(x)
    rows = host.size // in_dims
    y = np.empty((*host.shape[:-1], out_dims), dtype=np.float32)
    code = lib.mlxcel_qmatmul(
        _ptr(host), rows, in_dims, out_dims, weight.ctypes.data_as(_U32P), scales.ctypes.data,
        biases.ctypes.data, bits, group, scale_type(scales), _ptr(y),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"native quantized matmul failed ({code})")
    return mx.array(y)


def path() -> str | None:
    """ "avx512" / "avx2" when the native ops run in this process, else None."""
    lib, isa = _load()
    return isa if lib is not None else None


PORTABLE_DECODE_ENV = "MLXCEL_PORTABLE_DECODE"


def portable_decode_why_not() -> str | None:
    """Why the native decode step stays off on this process's path, or None (it runs). On the
    portable C path it is off unless MLXCEL_PORTABLE_DECODE=1: measured on an x86 proxy (the
    portable build with 128-bit FMA vectors, SmolLM2, one row), its decode step took 45-69 ms
    against 40-53 ms for MLX's ops with BLAS, while its prefill was 1.3-1.5x faster
    (docs/platforms.md)."""
    if path() != "portable" or switch_flag(PORTABLE_DECODE_ENV):
        return None
    return f"the portable C decode step is slower than MLX's ops ({PORTABLE_DECODE_ENV}=1 runs it)"


_logged = False


def log_choice() -> None:
    global _logged
    if _logged:
        return
    _logged = True
    lib, why = _load()
    if lib is not None:
        forced = switch_value("MLXCEL_GEMM_ISA")
        suffix = f", forced by MLXCEL_GEMM_ISA={forced}" if forced else ""
        logger.info("native ops: prefill attention and SwiGLU on the %s path%s", why, suffix)
    else:
        logger.info("native ops: not in use (%s): MLX ops for attention and SwiGLU", why)


def _ptr(array: np.ndarray) -> Any:
    return array.ctypes.data_as(_F32P)


def _host(x: mx.array) -> np.ndarray:
    """A numpy view of an evaluated float32 array whose last axis is contiguous."""
    view = np.asarray(x)
    if view.strides[-1] != 4:
        view = np.ascontiguousarray(view)
    return view


def swiglu(gate_up: mx.array, hidden: int) -> mx.array:
    """silu(gate) * up for the halves [:hidden] and [hidden:] of the last axis."""
    lib, _ = _load()
    if lib is None:
        raise RuntimeError("native ops not available")
    x = mx.contiguous(gate_up)
    mx.eval(x)
    host = np.asarray(x)
    rows = host.size // (2 * hidden)
    out = np.empty((*host.shape[:-1], hidden), dtype=np.float32)
    if lib.mlxcel_swiglu(_ptr(host), _ptr(out), rows, hidden) != 0:
        raise RuntimeError("native swiglu failed")
    return mx.array(out)


def _strides(view: np.ndarray) -> Any:
    elems = [s // 4 for s in view.strides[:3]]
    return (ctypes.c_long * 3)(*elems)


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array | None:
    """softmax(q k^T * scale, masked) v like `fast_ops.attention`; None when this input is not
    one the kernel takes (the caller then uses MLX)."""
    lib, _ = _load()
    if lib is None or queries.dtype != mx.float32 or keys.dtype != mx.float32:
        return None
    if values.dtype != mx.float32:
        return None
    batch, heads, length, head_dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    causal = 0
    mask_arr = None
    if isinstance(mask, str):
        if mask != "causal":
            return None
        causal = 1
    elif mask is not None:
        if mask.ndim == 2:
            mask = mask.reshape(1, 1, *mask.shape)
        if mask.dtype != mx.bool_ or mask.ndim != 4 or mask.shape[1] != 1:
            return None
        mask_arr = mx.broadcast_to(mask, (mask.shape[0], 1, length, num_keys))
    if head_dim % 16 or head_dim > 256 or heads % kv_heads:
        return None
    todo = [queries, keys, values] + ([mask_arr] if mask_arr is not None else [])
    mx.eval(todo)
    q, k, v = _host(queries), _host(keys), _host(values)
    mask_ptr, mask_bs, mask_is = None, 0, 0
    if mask_arr is not None:
        m = np.asarray(mask_arr)
        if m.strides[-1] != 1:
            m = np.ascontiguousarray(m)
        mask_ptr = m.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        mask_bs = m.strides[0] if m.shape[0] > 1 else 0
        mask_is = m.strides[2]
    out = np.empty((batch, heads, length, head_dim), dtype=np.float32)
    code = lib.mlxcel_attention(
        _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v), _strides(v),
        mask_ptr, mask_bs, mask_is, _ptr(out),
        batch, heads, kv_heads, length, num_keys, head_dim, causal, scale,
    )  # fmt: skip
    if code != 0:
        return None
    return mx.array(out)


# Floats from which RMSNorm and RoPE take the native path: below it the sync and the copies
# cost more than MLX's single-threaded kernels (a prefill chunk of SmolLM2 is ~150k, a tiny
# model's 64-row decode step 4k); MLXCEL_NATIVE_ELEMENTWISE_MIN overrides it.
NATIVE_ELEMENTWISE_MIN = switch_int("MLXCEL_NATIVE_ELEMENTWISE_MIN")  # at import, as above


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """mx.fast.rms_norm(x, weight, eps) in one multi-threaded pass; None when this input is not
    one the library takes (the caller then uses MLX)."""
    lib, _ = _load()
    if lib is None or not hasattr(lib, "mlxcel_rms_norm") or weight.ndim != 1:
        return None
    if x.dtype != mx.float32 or weight.dtype != mx.float32:
        return None
    x = mx.contiguous(x)
    mx.eval(x, weight)
    host = np.asarray(x)
    out = np.empty(host.shape, dtype=np.float32)
    width = host.shape[-1]
    lib.mlxcel_rms_norm(_ptr(host), _ptr(_host(weight)), eps, host.size // width, width, _ptr(out))
    return mx.array(out)


def rope_rows(
    x: mx.array, heads: int, head_dim: int, positions: np.ndarray, table: Any
) -> mx.array | None:
    """`x` (..., width) with RoPE applied to its first `heads` heads of `head_dim`, row r at
    `positions[r]` (clamped at 0), from `table` (a fast_ops.RopeTable: its native cos/sin rows,
    the input scale folded in, and layout); None when the library is not there."""
    lib, _ = _load()
    if lib is None or not hasattr(lib, "mlxcel_rope_rows") or x.dtype != mx.float32:
        return None
    x = mx.contiguous(x)
    mx.eval(x)
    host = np.array(x, dtype=np.float32)  # a copy: rotated in place
    width = host.shape[-1]
    rows = host.size // width
    pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    if pos.shape[0] != rows:
        raise ValueError(f"{pos.shape[0]} positions for {rows} rows")
    cos, sin = _host(table.native_cos), _host(table.native_sin)
    lib.mlxcel_rope_rows(
        _ptr(host), rows, width, heads, head_dim, pos.ctypes.data_as(_I32P),
        _ptr(cos), _ptr(sin), cos.strides[0] // 4, int(table.traditional),
    )  # fmt: skip
    return mx.array(host)
