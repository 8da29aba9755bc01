"""The native decode step: every layer of a decode step in one C call (`mlxcel_decode_step`).

On MLX's CPU backend a decode step of the fused forward (fast_forward.py) is ~50 graph ops a
layer at several microseconds each, plus per-op passes over the data; at batch 1 that is as
much time again as reading the weights. `native/fused_ops.c` runs the whole layer stack for
one new token per row in one call: RMSNorm, q/k/v, RoPE from the model's table, attention over
the row's KV cache plus its new token, the output projection, SwiGLU and the residuals, with
the few-row matmul kernel on the library's thread pool; for gemma2 also its attention and MLP
outputs' own norms, GELU-approx and soft-capped scores (its embedding scaled by sqrt(hidden)
here, as its forward does).

The caches stay mlx-lm's `BatchKVCache`s and are only read by the C code (their evaluated
buffers, in place). Each layer's new key and value come back and are appended as the cache's
own `update_and_fetch` appends them (`mlx_lm_compat.append_columns`: its MLX slice updates,
without the slices it returns), so growth, copy-on-write and everything the engine does with
caches afterwards (filter, extend, extract, trim) are unchanged. The embedding, the final norm
and the output head stay in MLX.

`install(model)` puts the step in front of the model's backbone (`model.model`) when the fast
forward is installed, the library has the step and the layers are ones it takes; it is used
for inputs of one token per row, 1-16 rows, on `BatchKVCache`s (the engine's decode steps),
and `chunk` for prefill chunks (`mlxcel_chunk_step`); the engine's packed step calls both
(packed_forward.py). Anything else (other caches, RoPE positions past the table) runs the
backbone's own forward. Off with MLXCEL_NO_NATIVE_DECODE=1 (or MLXCEL_NO_NATIVE_OPS=1);
`install` logs which in one line.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.forward import native_ops
from mlxcel.daemon.forward.fast_forward import FastRMSNorm, FusedAttention, FusedMLP, family
from mlxcel.daemon.forward.packed_forward import plain_stack
from mlxcel.daemon.mlx_lm_compat import append_columns, cache_index, right_padding
from mlxcel.shared.switches import switch_flag

logger = logging.getLogger(__name__)

DISABLE_ENV = "MLXCEL_NO_NATIVE_DECODE"
CHUNK_DISABLE_ENV = "MLXCEL_NO_NATIVE_CHUNK"  # the prefill chunk step alone
CHUNK_MIN_TOKENS = 2  # a chunk of one token per row is a decode step
MAX_ROWS = 16  # the few-row kernel's limit

_F32P = ctypes.POINTER(ctypes.c_float)
_I32P = ctypes.POINTER(ctypes.c_int)


class _Matrix(ctypes.Structure):
    """`mlxcel_matrix` in native/quant_kernels.h: float32 (bits 0) or MLX's affine format."""

    _fields_ = [
        ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("biases", ctypes.c_void_p),
        ("bias", ctypes.c_void_p), ("bits", ctypes.c_int), ("group", ctypes.c_int),
        ("half", ctypes.c_int),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    """`mlxcel_layer` in fused_ops.c."""

    _fields_ = [
        ("attn_norm", ctypes.c_void_p), ("qkv", _Matrix), ("o", _Matrix),
        ("mlp_norm", ctypes.c_void_p), ("gate_up", _Matrix), ("down", _Matrix),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("ks", ctypes.c_long * 3), ("vs", ctypes.c_long * 3),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
        ("post_attn_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p),
        ("softcap", ctypes.c_float), ("gelu", ctypes.c_int),
    ]  # fmt: skip


def _step_function() -> Any:
    """The library's `mlxcel_decode_step` with its signature set, or None."""
    lib, _ = native_ops._load()
    if lib is None or not hasattr(lib, "mlxcel_decode_step"):
        return None
    fn = lib.mlxcel_decode_step
    fn.restype = ctypes.c_int
    fn.argtypes = (
        _F32P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Layer), ctypes.c_float,
        ctypes.c_float, ctypes.c_int, _I32P, _I32P,
        _F32P, _F32P, ctypes.c_long, ctypes.c_int, _F32P, _F32P,
    )  # fmt: skip
    return fn


def _chunk_function() -> Any:
    """The library's `mlxcel_chunk_step` with its signature set, or None when this process has
    no cblas_sgemm in its global scope (the daemon preloads one: forward/blas.py)."""
    lib, _ = native_ops._load()
    if lib is None or not hasattr(lib, "mlxcel_chunk_step"):
        return None
    lib.mlxcel_chunk_step_available.restype = ctypes.c_int
    if not lib.mlxcel_chunk_step_available():
        return None
    fn = lib.mlxcel_chunk_step
    fn.restype = ctypes.c_int
    fn.argtypes = (
        _F32P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Layer), ctypes.c_float,
        ctypes.c_float, ctypes.c_int, _I32P, _I32P,
        _F32P, _F32P, ctypes.c_long, ctypes.c_int, _F32P, _F32P,
    )  # fmt: skip
    return fn


def _host_weight(array: mx.array | None, keep: list[Any]) -> int | None:
    """The address of `array`'s float32 data, C-contiguous (a copy kept in `keep` if not)."""
    if array is None:
        return None
    view = np.asarray(array)
    if view.dtype != np.float32:
        raise TypeError("not float32")
    if not view.flags.c_contiguous:
        view = np.ascontiguousarray(view)
    keep.append(view)
    return view.ctypes.data


def _set_matrix(m: _Matrix, linear: Any, keep: list[Any]) -> None:
    """Point `m` at `linear`'s weights: a float32 nn.Linear, or an nn.QuantizedLinear in a
    format the quantized kernels take (TypeError / ValueError saying why not)."""
    if isinstance(linear, nn.QuantizedLinear):
        arrays = native_ops.quant_arrays(linear)
        keep.extend(arrays)
        m.w, m.scales, m.biases = (a.ctypes.data for a in arrays)
        m.bits, m.group, m.half = linear.bits, linear.group_size, native_ops.scale_type(arrays[1])
    else:
        m.w, m.scales, m.biases, m.bits, m.group, m.half = (
            _host_weight(linear.weight, keep),
            None,
            None,
            0,
            0,
            0,
        )
    m.bias = _host_weight(linear.get("bias"), keep)


# gemma2's backbone: its layers' extra norms, GELU MLP and soft-capped scores are the C steps'
# too (its embedding scaled by sqrt(hidden) here, as its own forward does); mlx-lm gives it no
# sliding windows. gemma3's local layers slide (rotating caches) and use their own RoPE table.
_GEMMA2 = ("mlx_lm.models.gemma2", "GemmaModel")
_GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _is_gemma2(backbone: Any) -> bool:
    return any((c.__module__, c.__name__) == _GEMMA2 for c in type(backbone).__mro__)


def _why_not(backbone: Any) -> str | None:
    """Why the step cannot run `backbone`, or None when it can."""
    gemma2 = _is_gemma2(backbone) and getattr(backbone, "pipeline_size", 1) == 1
    if not plain_stack(backbone) and not gemma2:
        name = family(backbone)
        return (
            f"{name}: the C steps take llama/qwen2/qwen3/phi3 and gemma2 stacks only (no"
            " sliding-window layers, no pipeline split)"
        )
    for layer in backbone.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, FusedAttention) or not isinstance(mlp, FusedMLP):
            return "fast forward not installed"
        if attn._rope_table is None:
            return "RoPE without a table"
        if attn.head_dim % 16 or attn.head_dim > 256:
            return f"head_dim {attn.head_dim}"
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            *(_GEMMA_NORMS if gemma2 else ()),
        ):
            if type(getattr(layer, name, None)) not in (FastRMSNorm, nn.RMSNorm):
                return "norm is not RMSNorm"
        if (attn.q_norm is None) != (attn.k_norm is None):
            return "a q norm without a k norm"
    return None


class NativeDecode:
    """The step for one backbone: its weights' addresses, gathered once."""

    def __init__(self, backbone: Any, step: Any) -> None:
        self._step = step
        # the decode step itself, or only the chunk step it carries (the portable C path)
        self.decode_off_why = native_ops.portable_decode_why_not()
        self._chunk = None if switch_flag(CHUNK_DISABLE_ENV) else _chunk_function()
        self._keep: list[Any] = []  # host views and copies the addresses point into
        self.quantized = False  # some matrices stay quantized (native/quant_kernels.h)
        layers = backbone.layers
        first = layers[0].self_attn
        self.num_layers = len(layers)
        self.heads, self.kv_heads, self.head_dim = first.n_heads, first.n_kv_heads, first.head_dim
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        self.inter = layers[0].mlp.hidden
        self.scale = float(first.scale)
        self.eps = float(layers[0].input_layernorm.eps)
        table = first._rope_table
        gemma2 = _is_gemma2(backbone)
        # gemma2 scales its embedding by sqrt(hidden) (GemmaModel.__call__)
        self.embed_scale = float(backbone.args.hidden_size) ** 0.5 if gemma2 else None
        self.rope_size = table.size
        self.rope_pairs = table.traditional
        self._cos = np.ascontiguousarray(np.asarray(table.native_cos, dtype=np.float32))
        self._sin = np.ascontiguousarray(np.asarray(table.native_sin, dtype=np.float32))
        self._layers = (_Layer * self.num_layers)()
        keep = self._keep
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if attn._rope_table is not table:
                raise ValueError("layers with different RoPE tables")
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if gemma2:  # post_attention_layernorm is the attention output's own norm
                norms += [getattr(layer, name) for name in _GEMMA_NORMS]
            if any(float(n.eps) != self.eps for n in norms):
                raise ValueError("norms with different eps")
            s = self._layers[i]
            s.attn_norm = _host_weight(norms[0].weight, keep)
            _set_matrix(s.qkv, attn.qkv_proj, keep)
            _set_matrix(s.o, attn.o_proj, keep)
            if gemma2:
                s.post_attn_norm = _host_weight(norms[1].weight, keep)
                s.mlp_norm = _host_weight(norms[2].weight, keep)
                s.post_mlp_norm = _host_weight(norms[3].weight, keep)
            else:
                s.mlp_norm = _host_weight(norms[1].weight, keep)
            s.softcap = attn.softcap or 0.0
            s.gelu = int(mlp.gelu)
            _set_matrix(s.gate_up, mlp.gate_up_proj, keep)
            _set_matrix(s.down, mlp.down_proj, keep)
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(isinstance(m, nn.QuantizedLinear) for m in linears):
                self.quantized = True
            if attn.q_norm is not None:  # qwen3: per-head RMSNorm of q and k before RoPE
                if float(attn.q_norm.eps) != float(attn.k_norm.eps):
                    raise ValueError("q and k norms with different eps")
                s.q_norm = _host_weight(attn.q_norm.weight, keep)
                s.k_norm = _host_weight(attn.k_norm.weight, keep)
                s.qk_eps = float(attn.q_norm.eps)

    @classmethod
    def for_backbone(cls, backbone: Any) -> tuple[NativeDecode | None, str]:
        """(the step, "") or (None, why not)."""
        if switch_flag(DISABLE_ENV):
            return None, f"turned off by {DISABLE_ENV}"
        step = _step_function()
        if step is None:
            _, why = native_ops._load()
            return None, why if native_ops.path() is None else "library without the step"
        refusal = _why_not(backbone)
        if refusal is not None:
            return None, refusal
        try:
            return cls(backbone, step), ""
        except (TypeError, ValueError) as exc:  # not float32 / a quantized format, mixed layers
            return None, str(exc)

    def _point_at(self, caches: list[Any]) -> list[np.ndarray] | None:
        """Each layer's struct pointed at its cache's evaluated keys and values (NULL for a cache
        without any yet); the host views behind the pointers, or None (nothing pointed) when a
        buffer's layout is not one the C code reads."""
        views = []
        for s, c in zip(self._layers, caches, strict=True):
            if c.keys is None:
                s.k_cache = s.v_cache = None
                continue
            for name, strides, array in (("k_cache", s.ks, c.keys), ("v_cache", s.vs, c.values)):
                view = np.asarray(array)
                if view.strides[-1] != 4 or view.shape[-1] != self.head_dim:
                    self._unpoint()
                    return None
                views.append(view)
                setattr(s, name, view.ctypes.data)
                strides[:] = [st // 4 for st in view.strides[:3]]
        return views

    def _unpoint(self) -> None:
        for s in self._layers:
            s.k_cache = s.v_cache = None

    def __call__(self, backbone: Any, inputs: mx.array, caches: list[Any]) -> mx.array | None:
        """The final-norm hidden states (batch, 1, hidden) of a decode step, with every
        cache appended; None (nothing done) when this input is not one the step takes."""
        if self.decode_off_why is not None:
            return None
        if inputs.ndim != 2 or inputs.shape[1] != 1 or not 1 <= inputs.shape[0] <= MAX_ROWS:
            return None
        if len(caches) != self.num_layers:
            return None
        first = caches[0]
        for c in caches:
            if type(c) is not BatchKVCache or c.keys is None or right_padding(c) is not None:
                return None
            if cache_index(c) != cache_index(first) or c.keys.dtype != mx.float32:
                return None
        batch = inputs.shape[0]
        h = backbone.embed_tokens(inputs.reshape(-1))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        mx.eval(h, first.left_padding, first.offset, [(c.keys, c.values) for c in caches])
        positions = np.asarray(first.offset).astype(np.int32)
        if batch != first.keys.shape[0] or int(positions.max()) >= self.rope_size:
            return None
        if h.dtype != mx.float32:
            return None
        starts = np.asarray(first.left_padding).astype(np.int32)
        hidden = np.array(h, dtype=np.float32)  # a copy: the step writes it
        k_new = np.empty((self.num_layers, batch, self.kv_heads, self.head_dim), np.float32)
        v_new = np.empty_like(k_new)
        views = self._point_at(caches)
        if views is None:
            return None
        code = self._step(
            hidden.ctypes.data_as(_F32P), batch, self.hidden, self.heads, self.kv_heads,
            self.head_dim, self.inter, self.num_layers, self._layers, self.eps, self.scale,
            cache_index(first), starts.ctypes.data_as(_I32P), positions.ctypes.data_as(_I32P),
            self._cos.ctypes.data_as(_F32P), self._sin.ctypes.data_as(_F32P),
            self._cos.shape[1], int(self.rope_pairs), k_new.ctypes.data_as(_F32P),
            v_new.ctypes.data_as(_F32P),
        )  # fmt: skip
        self._unpoint()
        del views  # no host view may keep a cache buffer alive: MLX then updates it in place
        if code != 0:
            raise RuntimeError(f"native decode step failed ({code})")
        for i, c in enumerate(caches):  # one array per layer: cheaper than slicing one (measured)
            append_columns(c, mx.array(k_new[i, :, :, None]), mx.array(v_new[i, :, :, None]))
        return backbone.norm(mx.array(hidden)).reshape(batch, 1, self.hidden)

    def chunk(self, backbone: Any, inputs: mx.array, caches: list[Any]) -> mx.array | None:
        """The final-norm hidden states (batch, length, hidden) of a prefill chunk (`length`
        tokens per row, left-padded rows as `BatchKVCache` describes them), with every cache
        appended; None (nothing done) when this input is not one the chunk step takes.

        A right-padded chunk (rows with fewer tokens, `BatchKVCache.prepare(right_padding=)`)
        is computed as it stands: attention is causal, so a row's tokens never see the padding
        after them, and the padding's keys and values are rolled to the left by the cache's
        `finalize()` as after the model's own forward."""
        if self._chunk is None or inputs.ndim != 2 or inputs.shape[1] < 2:
            return None
        batch, length = inputs.shape
        if batch * length < CHUNK_MIN_TOKENS or len(caches) != self.num_layers:
            return None
        first = caches[0]
        for c in caches:
            if type(c) is not BatchKVCache:
                return None
            if cache_index(c) != cache_index(first) or (c.keys is None) != (first.keys is None):
                return None
            if c.keys is not None and c.keys.dtype != mx.float32:
                return None
        h = backbone.embed_tokens(inputs)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        history = [(c.keys, c.values) for c in caches if c.keys is not None]
        mx.eval(h, first.left_padding, first.offset, history)
        if h.dtype != mx.float32 or first.left_padding.shape[0] != batch:
            return None
        positions = np.asarray(first.offset).astype(np.int32)
        if int(positions.max()) + length > self.rope_size:
            return None
        starts = np.asarray(first.left_padding).astype(np.int32)
        cached = cache_index(first) if first.keys is not None else 0
        hidden = np.array(h, dtype=np.float32).reshape(batch * length, self.hidden)
        shape = (self.num_layers, batch, self.kv_heads, length, self.head_dim)
        k_new = np.empty(shape, np.float32)
        v_new = np.empty_like(k_new)
        views = self._point_at(caches)
        if views is None:
            return None
        code = self._chunk(
            hidden.ctypes.data_as(_F32P), batch, length, self.hidden, self.heads,
            self.kv_heads, self.head_dim, self.inter, self.num_layers, self._layers, self.eps,
            self.scale, cached, starts.ctypes.data_as(_I32P), positions.ctypes.data_as(_I32P),
            self._cos.ctypes.data_as(_F32P), self._sin.ctypes.data_as(_F32P),
            self._cos.shape[1], int(self.rope_pairs), k_new.ctypes.data_as(_F32P),
            v_new.ctypes.data_as(_F32P),
        )  # fmt: skip
        self._unpoint()
        del views, history  # no host view may keep a cache buffer alive (see __call__)
        if code != 0:
            raise RuntimeError(f"native chunk step failed ({code})")
        for i, c in enumerate(caches):
            append_columns(c, mx.array(k_new[i]), mx.array(v_new[i]))
        out = mx.array(hidden).reshape(batch, length, self.hidden)
        return backbone.norm(out)


_classes: dict[type, type] = {}


def _native_class(base: type) -> type:
    """`base` with a __call__ that tries the native step first."""
    if base not in _classes:

        def __call__(
            self: Any, inputs: mx.array, cache: Any = None, input_embeddings: Any = None
        ) -> Any:
            native = self.__dict__.get("_mlxcel_native")
            if native is not None and cache is not None and input_embeddings is None:
                out = native(self, inputs, cache)
                if out is None:
                    out = native.chunk(self, inputs, cache)
                if out is not None:
                    return out
            if input_embeddings is None:  # phi3's backbone takes no input_embeddings
                return base.__call__(self, inputs, cache)
            return base.__call__(self, inputs, cache, input_embeddings)

        _classes[base] = type(f"NativeDecode{base.__name__}", (base,), {"__call__": __call__})
    return _classes[base]


def install(model: Any) -> bool:
    """Put the native step in front of `model.model`; True when installed (logged either way)."""
    backbone = getattr(model, "model", None)
    if backbone is None:
        return False
    native, why = NativeDecode.for_backbone(backbone)
    if native is None:
        logger.info("native decode step: not in use (%s)", why)
        return False
    backbone.__class__ = _native_class(type(backbone))
    backbone._mlxcel_native = native
    chunk = "on" if native._chunk is not None else "off (no cblas_sgemm in this process)"
    if switch_flag(CHUNK_DISABLE_ENV):
        chunk = f"off ({CHUNK_DISABLE_ENV})"
    if native.decode_off_why is not None:
        logger.info(
            "native decode step: off (%s); prefill chunk step %s", native.decode_off_why, chunk
        )
        return True
    logger.info(
        "native decode step: active on the %s path (1-%d rows, %d layers%s); prefill chunk step %s",
        native_ops.path(),
        MAX_ROWS,
        native.num_layers,
        f", quantized weights on the {native_ops.quant_path()} kernels" if native.quantized else "",
        chunk,
    )
    return True


def is_installed(model: Any) -> bool:
    backbone = getattr(model, "model", None)
    return backbone is not None and backbone.__dict__.get("_mlxcel_native") is not None
