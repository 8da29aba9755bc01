"""A faster CPU forward for llama-like mlx-lm models, with the same results.

`apply_fast_forward(model, backend)` swaps, in place, each layer's attention and MLP for fused
versions: q/k/v in one matmul, gate/up in one, RoPE on q and k in one call, attention and
SwiGLU from `fast_ops` (a vectorised exp). Everything else (model.model, embed_tokens,
lm_head, layers, args, the caches) stays mlx-lm's own.

Why it is faster on MLX's CPU backend: every op costs a fixed overhead, so fewer and larger
ops win; MLX's exp is scalar (see fast_ops); and OpenBLAS's sgemm on a single row (a decode
step at batch 1) is faster on blocks of a few hundred output rows than on one tall matrix, so
one-row matmuls run as a batched matmul over row blocks (one MLX op, the same dot products).

Quantized layers (nn.QuantizedLinear in MLX's affine format, 4 or 8 bits, groups 32/64/128,
float32 scales and biases) stay quantized: q/k/v and gate/up are fused by concatenating their
packed weights, scales and biases along the output axis (exact when the parts share bits and
group), and every quantized projection, the output head included (a quantized lm_head or the
tied QuantizedEmbedding's `as_linear`), runs through the native quantized kernels
(`native_ops.qmatmul`, native/quant_kernels.h) when the library has them, MLX's
quantized_matmul otherwise.

Off with MLXCEL_NO_FAST_FORWARD=1; only applied on the CPU backend, to model structures it
recognises: mlx-lm's llama (mistral maps to it; any rotation-only RoPE: plain, linear, llama3,
yarn), qwen2, qwen3 (per-head q/k RMSNorm before RoPE) and phi3 (q/k/v and gate/up already
fused, longrope) attention and SwiGLU MLP, and gemma2 / gemma3_text (their 1 + w RMSNorms
folded into plain ones at install, GELU-approx MLP, gemma2's soft-capped attention logits,
gemma3's q/k norms and local/global RoPE tables; the blocks, masks and caches stay mlx-lm's),
plain float or quantized Linear layers. Anything else keeps mlx-lm's forward, and the log
says which family and why (`unsupported_reason`).

Why one module: the fused layers (attention, MLP, norms) of every family the fused forward
covers, and the one function that installs them on a loaded model, kept side by side so a
family's parts are checked together against mlx-lm's.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.forward import native_ops
from mlxcel.daemon.forward.blas import log_blas_choice, native_gemm_path
from mlxcel.daemon.forward.fast_ops import (
    RopeTable,
    attention,
    rms_norm,
    rms_norm_matches,
    swiglu,
)
from mlxcel.daemon.mlx_lm_compat import cache_index
from mlxcel.shared.switches import switch_flag

logger = logging.getLogger(__name__)

DISABLE_ENV = "MLXCEL_NO_FAST_FORWARD"
BLOCK_ROWS = 768  # output rows per sgemm on the small-row path (measured on OpenBLAS 0.3.21)
SMALL_ROWS = 1  # inputs with at most this many rows take the row-block path
ROPE_TABLE_MAX = 32768  # positions in the RoPE table at most (later ones use the module)

# mlx-lm's families whose attention and MLP the fused modules take (mistral is llama there).
FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# Gemma's RMSNorm scales by 1 + weight: folded into a plain RMSNorm's weight at install.
_GEMMA_NORMS = {("mlx_lm.models.gemma2", "RMSNorm"), ("mlx_lm.models.gemma3_text", "RMSNorm")}
_GELU_MLPS = {("mlx_lm.models.gemma2", "MLP"), ("mlx_lm.models.gemma3_text", "MLP")}
ROPE_TABLES_MAX = 2  # distinct RoPE tables per model (gemma3: its local and global layers)
_ATTENTION_CLASSES = {(f"mlx_lm.models.{family}", "Attention") for family in FAMILIES}
_MLP_CLASSES = {(f"mlx_lm.models.{family}", "MLP") for family in FAMILIES}


def _class_key(obj: Any) -> tuple[str, str]:
    return type(obj).__module__, type(obj).__name__


def _block_view(weight: mx.array) -> mx.array | None:
    """`weight` (out, in) as (blocks, in, BLOCK_ROWS): a view, or None when it does not split."""
    rows, cols = weight.shape
    if rows <= BLOCK_ROWS or rows % BLOCK_ROWS or native_gemm_path() is not None:
        # The few-row kernel already splits a one-row product over threads by output columns.
        return None
    return weight.reshape(rows // BLOCK_ROWS, BLOCK_ROWS, cols).transpose(0, 2, 1)


class FusedProjection:
    """x @ weight.T (+ bias), with the weight's transposes prepared once.

    Not a Module: the views must not show up as parameters (they share the weight's memory).
    """

    def __init__(self, weight: mx.array, bias: mx.array | None) -> None:
        self.weight_t = weight.T
        self.blocks = _block_view(weight)
        self.bias = bias
        mx.eval(self.weight_t, self.blocks)

    def __call__(self, x: mx.array) -> mx.array:
        *lead, cols = x.shape
        rows = 1
        for n in lead:
            rows *= n
        if self.blocks is None or rows > SMALL_ROWS:
            if self.bias is None:
                return x @ self.weight_t
            return mx.addmm(self.bias, x, self.weight_t)
        # (blocks, rows, BLOCK_ROWS): with one row that is already the (1, out) layout.
        y = x.reshape(1, 1, cols) @ self.blocks
        y = y.reshape(*lead, -1)
        return y if self.bias is None else y + self.bias


class _HostQuant:
    """A quantized layer's host arrays for the native kernels (not a Module attribute tree)."""

    def __init__(self, layer: Any) -> None:
        native_ops.narrow_scales(layer)  # fewer bytes a token, the same values
        self.arrays = native_ops.quant_arrays(layer)
        self.bits, self.group = layer.bits, layer.group_size

    def __call__(self, x: mx.array) -> mx.array:
        return native_ops.qmatmul(x, *self.arrays, self.bits, self.group)


def _host_quant(layer: Any) -> _HostQuant | None:
    """The native kernels for `layer` (a QuantizedLinear / QuantizedEmbedding), or None when
    the library does not take it (MLX's quantized_matmul then runs it)."""
    try:
        return _HostQuant(layer)
    except (TypeError, ValueError):
        return None


class QuantizedProjection:
    """x @ W.T (+ bias) for a quantized layer: the native kernels (a sync: x is evaluated)
    when they take it, else the layer's own quantized_matmul."""

    def __init__(self, layer: nn.QuantizedLinear) -> None:
        self.layer = layer
        self.native = _host_quant(layer)
        self.bias = layer.get("bias")

    def __call__(self, x: mx.array) -> mx.array:
        if self.native is None or x.dtype != mx.float32:
            return self.layer(x)
        y = self.native(x)
        return y if self.bias is None else y + self.bias


def _projection(layer: Any) -> FusedProjection | QuantizedProjection:
    if isinstance(layer, nn.QuantizedLinear):
        return QuantizedProjection(layer)
    return FusedProjection(layer.weight, layer.get("bias"))


def _concat_linears(linears: list[Any]) -> Any:
    """One Linear whose outputs are those of `linears`, in order (a missing bias is zeros);
    quantized ones (sharing bits and group: `supported` checks) give a QuantizedLinear whose
    packed weight, scales and biases are theirs concatenated."""
    weight = mx.concatenate([m.weight for m in linears])
    if isinstance(linears[0], nn.QuantizedLinear):
        first = linears[0]
        in_dims = first.scales.shape[1] * first.group_size
        fused = nn.QuantizedLinear(
            in_dims, weight.shape[0], bias=False, group_size=first.group_size, bits=first.bits
        )
        fused.weight = weight
        fused.scales = mx.concatenate([m.scales for m in linears])
        fused.biases = mx.concatenate([m.biases for m in linears])
    else:
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        fused.weight = weight
    if any("bias" in m for m in linears):
        zeros = [mx.zeros((m.weight.shape[0],), dtype=weight.dtype) for m in linears]
        fused.bias = mx.concatenate([m.get("bias", z) for m, z in zip(linears, zeros, strict=True)])
    mx.eval(fused.parameters())
    return fused


class FusedAttention(nn.Module):
    """mlx-lm's llama Attention with q/k/v in one matmul and one RoPE call for q and k (from
    `rope_table` when it matches this layer's RoPE), the native attention for prefill-sized
    inputs (`native_ops`). Qwen3's and gemma3's per-head q/k RMSNorms (`q_norm`, `k_norm`) run
    on q and k before RoPE, as in their Attention; phi3's `qkv_proj` is already the fused
    projection; gemma2's soft-capped scores (`attn_logit_softcapping`) take `capped_attention`."""

    def __init__(self, attn: nn.Module, rope_table: RopeTable | None = None) -> None:
        super().__init__()
        self.n_heads = attn.n_heads
        self.n_kv_heads = attn.n_kv_heads
        self.scale = attn.scale
        self.rope = attn.rope
        self.o_proj = attn.o_proj
        self.head_dim = _head_dim(attn)
        if "qkv_proj" in attn:  # phi3: [q; k; v] rows in one Linear already
            self.qkv_proj = attn.qkv_proj
        else:
            self.qkv_proj = _concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.q_norm = _fast_norm(_plain_norm(attn["q_norm"])) if "q_norm" in attn else None
        self.k_norm = _fast_norm(_plain_norm(attn["k_norm"])) if "k_norm" in attn else None
        cap = getattr(attn, "attn_logit_softcapping", None)
        self.softcap = float(cap) if cap else None
        self._qkv = _projection(self.qkv_proj)
        self._out = _projection(self.o_proj)
        self._rope_table = rope_table if rope_table and rope_table.matches(attn.rope) else None

    def _rope(self, x: mx.array, offset: Any, end: int | None) -> mx.array:
        if self._rope_table is not None:
            out = self._rope_table(x, offset, end)
            if out is not None:
                return out
        return self.rope(x, offset=offset)

    def _native_rope(self, qkv: mx.array, batch: int, length: int, cache: Any) -> mx.array | None:
        """q/k/v rows with q and k rotated by the native library, for prefill-sized inputs with
        a RoPE table; None otherwise (the caller rotates in MLX)."""
        table = self._rope_table
        rotated = batch * length * (self.n_heads + self.n_kv_heads) * self.head_dim
        if table is None or rotated < native_ops.NATIVE_ELEMENTWISE_MIN:
            return None
        if cache is None:
            offsets = np.zeros((batch, 1), dtype=np.int64)
        else:
            end = _rope_end(cache, length)
            if end is None or end > table.size:
                return None
            offset = cache.offset
            offsets = np.asarray(offset).reshape(-1, 1).astype(np.int64)
            if offsets.shape[0] not in (1, batch):
                return None
        positions = np.broadcast_to(offsets + np.arange(length)[None], (batch, length))
        return native_ops.rope_rows(
            qkv, self.n_heads + self.n_kv_heads, self.head_dim, positions, table
        )

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        batch, length, _ = x.shape
        return self._out(self.attend(self._qkv(x), batch, length, mask, cache))

    def attend(self, qkv: mx.array, batch: int, length: int, mask: Any, cache: Any) -> mx.array:
        """Attention from projected q/k/v rows ((batch x length, q+k+v) or (batch, length, ..));
        (batch, length, heads x dim), before the output projection. The engine's packed step
        (forward/packed_forward.py) projects several groups of rows at once and calls this per
        group."""
        num_qk = self.n_heads + self.n_kv_heads
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        rotated = self._native_rope(qkv, batch, length, cache)
        if rotated is not None:
            qkv = rotated
        qkv = qkv.reshape(batch, length, -1, self.head_dim).transpose(0, 2, 1, 3)
        values = qkv[:, num_qk:]
        if rotated is not None:
            qk = qkv[:, :num_qk]
            if cache is not None:
                keys, values = cache.update_and_fetch(qk[:, self.n_heads :], values)
            else:
                keys = qk[:, self.n_heads :]
        elif cache is not None:
            qk = self._rope(qkv[:, :num_qk], cache.offset, _rope_end(cache, length))
            keys, values = cache.update_and_fetch(qk[:, self.n_heads :], values)
        else:
            qk = self._rope(qkv[:, :num_qk], 0, length)
            keys = qk[:, self.n_heads :]
        queries = qk[:, : self.n_heads]
        if self.softcap is not None:
            out = capped_attention(queries, keys, values, self.scale, mask, self.softcap)
        elif hasattr(cache, "bits"):  # a quantized KV cache: mlx-lm's own attention
            out = scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=self.scale, mask=mask
            )
        else:
            out = None
            if batch * length >= native_ops.NATIVE_MIN_ROWS:
                out = native_ops.attention(queries, keys, values, self.scale, mask)
            if out is None:
                out = attention(queries, keys, values, self.scale, mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, -1)

    def _norm_qk(self, qkv: mx.array) -> mx.array:
        """q/k/v rows with each q head through `q_norm` and each k head through `k_norm`."""
        shape = qkv.shape
        heads = qkv.reshape(*shape[:-1], -1, self.head_dim)
        num_qk = self.n_heads + self.n_kv_heads
        q_norm, k_norm = self.q_norm, self.k_norm
        assert q_norm is not None and k_norm is not None  # attend() calls this only with them
        q = q_norm(heads[..., : self.n_heads, :])
        k = k_norm(heads[..., self.n_heads : num_qk, :])
        return mx.concatenate([q, k, heads[..., num_qk:, :]], axis=-2).reshape(shape)


def capped_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, cap: float
) -> mx.array:
    """gemma2's attention after RoPE (mlx_lm.models.gemma2.Attention), op for op: scores
    soft-capped as tanh(s / cap) * cap, a boolean mask as the dtype's min, a precise softmax;
    grouped-query heads without repeating k and v, the mask broadcast over each group."""
    batch, num_heads, length, head_dim = queries.shape
    num_kv, num_keys = keys.shape[1], keys.shape[2]
    queries = (queries * scale).reshape(batch, num_kv, num_heads // num_kv, length, head_dim)
    scores = queries @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        mask = mx.arange(num_keys - length, num_keys)[:, None] >= mx.arange(num_keys)[None]
    if mask is not None:
        if mask.ndim == 4:  # (batch or 1, 1, length, keys): add the group axis
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, precise=True, axis=-1) @ mx.expand_dims(values, 2)
    return out.reshape(batch, num_heads, length, head_dim)


def _rope_end(cache: Any, length: int) -> int | None:
    """One past the last position any row of `cache` reaches with `length` more tokens, or
    None when the cache does not say (the layer then uses its RoPE module)."""
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int) and not isinstance(offset, bool):
        return offset + length
    if type(cache) is BatchKVCache:  # every row's offset is at most its written columns
        return cache_index(cache) + length
    return None


class FusedMLP(nn.Module):
    """SwiGLU (gemma: gelu_approx(gate) * up) with gate and up in one matmul."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        if "gate_up_proj" in mlp:  # phi3: [gate; up] rows in one Linear already
            self.hidden = mlp.gate_up_proj.weight.shape[0] // 2
            self.gate_up_proj = mlp.gate_up_proj
        else:
            self.hidden = mlp.gate_proj.weight.shape[0]
            self.gate_up_proj = _concat_linears([mlp.gate_proj, mlp.up_proj])
        self.gelu = _class_key(mlp) in _GELU_MLPS
        self.down_proj = mlp.down_proj
        self._gate_up = _projection(self.gate_up_proj)
        self._down = _projection(self.down_proj)

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self._gate_up(x)
        if self.gelu:
            return self._down(
                nn.gelu_approx(gate_up[..., : self.hidden]) * gate_up[..., self.hidden :]
            )
        rows = gate_up.size // gate_up.shape[-1]
        if rows >= native_ops.NATIVE_MIN_ROWS and native_ops.path() and gate_up.dtype == mx.float32:
            return self._down(native_ops.swiglu(gate_up, self.hidden))
        return self._down(swiglu(gate_up[..., : self.hidden], gate_up[..., self.hidden :]))


class FastRMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters) through `fast_ops.rms_norm`: the same bits, fewer ops; from
    `native_ops.NATIVE_ELEMENTWISE_MIN` floats up (prefill chunks), one native multi-threaded pass
    (within float rounding)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.size >= native_ops.NATIVE_ELEMENTWISE_MIN:
            out = native_ops.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        return rms_norm(x, self.weight, self.eps)


def _plain_norm(norm: Any) -> Any:
    """Gemma's RMSNorm (1 + weight) as an nn.RMSNorm with that weight: the same bits (the sum
    is the one its forward computes every call); any other norm as it is."""
    if _class_key(norm) not in _GEMMA_NORMS:
        return norm
    plain = nn.RMSNorm(norm.weight.shape[0], eps=norm.eps)
    plain.weight = 1.0 + norm.weight
    mx.eval(plain.weight)
    return plain


def _fast_norm(norm: Any) -> Any:
    """`norm` as a FastRMSNorm when it is a plain float32 nn.RMSNorm that rms_norm matches."""
    if type(norm) is not nn.RMSNorm or norm.weight.dtype != mx.float32:
        return norm
    if not rms_norm_matches(norm.eps, norm.weight.shape[0]):
        return norm
    fast = FastRMSNorm(norm.weight.shape[0], eps=norm.eps)
    fast.weight = norm.weight
    return fast


QUANT_BITS = (4, 8)
QUANT_GROUPS = (32, 64, 128)


def _quantized_linear(module: Any) -> bool:
    """An nn.QuantizedLinear this module takes: affine, 4/8 bits, groups 32/64/128, float32
    scales and biases (the loader casts them)."""
    return (
        type(module) is nn.QuantizedLinear
        and getattr(module, "mode", "affine") == "affine"
        and module.bits in QUANT_BITS
        and module.group_size in QUANT_GROUPS
        and module.get("biases") is not None
        and module.scales.dtype == mx.float32
        and module.biases.dtype == mx.float32
    )


def _plain_linear(module: Any) -> bool:
    if _quantized_linear(module):
        return True
    return type(module) is nn.Linear and module.weight.dtype in (
        mx.float32,
        mx.float16,
        mx.bfloat16,
    )


def _kind(module: Any) -> tuple[Any, ...]:
    """What must agree between layers fused into one: the float dtype, or bits and group."""
    if isinstance(module, nn.QuantizedLinear):
        return ("quantized", module.bits, module.group_size)
    return ("float", module.weight.dtype)


def family(model: Any) -> str:
    """The model's mlx-lm family (its `model_type`, else its module's name) for log lines."""
    for owner in (model, getattr(model, "args", None)):
        name = getattr(owner, "model_type", None)
        if isinstance(name, str) and name:
            return name
    return type(model).__module__.rsplit(".", 1)[-1]


def _head_dim(attn: Any) -> int:
    """A layer's head size from its q (or fused q/k/v) projection's output rows."""
    if "qkv_proj" in attn:
        return attn.qkv_proj.weight.shape[0] // (attn.n_heads + 2 * attn.n_kv_heads)
    return attn.q_proj.weight.shape[0] // attn.n_heads


def _qk_norm_ok(norm: Any, head_dim: int) -> bool:
    return (
        (type(norm) in (nn.RMSNorm, FastRMSNorm) or _class_key(norm) in _GEMMA_NORMS)
        and norm.weight.dtype == mx.float32
        and norm.weight.shape == (head_dim,)
    )


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this module cannot rewrite `model`'s layers ("family: reason"), or None when every
    layer has an attention and MLP structure it rewrites."""
    name = family(model)
    layers = getattr(model, "layers", None)
    if not layers:
        return f"{name}: no transformer layers"
    covered = ", ".join(FAMILIES)
    for layer in layers:
        # mlx modules (untyped); None fails the class check below
        attn: Any = getattr(layer, "self_attn", None)
        mlp: Any = getattr(layer, "mlp", None)
        for part, key, known in (
            (attn, "attention", _ATTENTION_CLASSES),
            (mlp, "MLP", _MLP_CLASSES),
        ):
            if _class_key(part) not in known:
                where = ".".join(_class_key(part)) if part is not None else "none"
                return f"{name}: {key} {where} is not one it fuses (those of {covered})"
        if "qkv_proj" in attn:
            linears = [attn.qkv_proj, attn.o_proj]
        else:
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if "gate_up_proj" in mlp:
            linears += [mlp.gate_up_proj, mlp.down_proj]
        else:
            linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        for m in linears:
            if not _plain_linear(m):
                if isinstance(m, nn.QuantizedLinear):
                    return (
                        f"{name}: a quantized layer it does not take ({m.bits}-bit, group"
                        f" {m.group_size}, {getattr(m, 'mode', 'affine')}, {m.scales.dtype}"
                        " scales)"
                    )
                return f"{name}: a {type(m).__name__} layer"
        kinds = {_kind(m) for m in linears}
        if len(kinds) != 1:
            # q/k/v and gate/up are fused (their formats must agree); o and down on their own
            # would do, but one format per layer keeps one path.
            kinds_text = ", ".join(sorted(map(str, kinds)))
            return f"{name}: layers of mixed formats in one block: {kinds_text}"
        if "q_norm" in attn or "k_norm" in attn:
            head_dim = _head_dim(attn)
            if not all(_qk_norm_ok(attn.get(n), head_dim) for n in ("q_norm", "k_norm")):
                return f"{name}: q/k norms that are not float32 RMSNorms over a head"
    return None


def supported(model: nn.Module) -> bool:
    """True when every layer has the attention and MLP structure this module rewrites."""
    return unsupported_reason(model) is None


class _NativeHead:
    """The output head through the native quantized kernels, for a model's quantized lm_head
    (a QuantizedLinear) or tied QuantizedEmbedding (`as_linear`)."""


def _head_class(base: type, method: str) -> type:
    """`base` with `method` (`__call__` or `as_linear`) through the layer's `_mlxcel_quant`;
    a tied embedding's lookup (`__call__`) dequantizes its rows in float32 whatever type its
    scales are stored in (`native_ops.narrow_scales`), as with float32 ones."""
    original = getattr(base, method)

    def through_native(self: Any, x: mx.array) -> mx.array:
        native = self.__dict__.get("_mlxcel_quant")
        if native is None or x.dtype != mx.float32:
            return original(self, x)
        y = native(x)
        return y + self["bias"] if "bias" in self else y

    methods: dict[str, Any] = {method: through_native}
    if method == "as_linear":
        lookup = base.__call__

        def rows_in_float32(self: Any, x: mx.array) -> mx.array:
            scales, biases = self["scales"], self.get("biases")
            if scales.dtype == mx.float32 or biases is None:
                return lookup(self, x)
            return mx.dequantize(
                self["weight"][x],
                scales=scales[x].astype(mx.float32),
                biases=biases[x].astype(mx.float32),
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )

        methods["__call__"] = rows_in_float32
    return type(f"Native{base.__name__}", (base, _NativeHead), methods)


_HEAD_CLASSES: dict[type, type] = {}


def _native_head(model: nn.Module) -> str | None:
    """Route a quantized output head through the native kernels; which one, or None."""
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    backbone = getattr(model, "model", None)
    head: Any = getattr(model, "lm_head", None)
    method = "__call__"
    if head is None or tied:
        head, method = getattr(backbone, "embed_tokens", None), "as_linear"
    if type(head) not in (nn.QuantizedLinear, nn.QuantizedEmbedding):
        return None
    if head.get("biases") is None or head.scales.dtype != mx.float32:
        return None
    native = _host_quant(head)
    if native is None:
        return None
    key = type(head)
    if key not in _HEAD_CLASSES:
        _HEAD_CLASSES[key] = _head_class(key, method)
    head.__class__ = _HEAD_CLASSES[key]
    head._mlxcel_quant = native
    return "tied embedding" if method == "as_linear" else "lm_head"


def is_fast(model: nn.Module) -> bool:
    layers = getattr(model, "layers", None) or []
    return bool(layers) and all(
        isinstance(getattr(layer, "self_attn", None), FusedAttention) for layer in layers
    )


# A layer's norms around its attention and MLP (gemma2/3: pre and post feed-forward too).
_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _table_for(attn: Any, tables: list[RopeTable | None], size: int) -> RopeTable | None:
    """The table of `tables` that `attn`'s RoPE matches, else a new one read off it (kept in
    `tables`; a RoPE a table cannot give, e.g. dynamic NTK, leaves a None there), up to
    ROPE_TABLES_MAX tries; None when none fits (the layer then uses its RoPE module)."""
    for table in tables:
        if table is not None and table.matches(attn.rope):
            return table
    if len(tables) >= ROPE_TABLES_MAX:
        return None
    head_dim = _head_dim(attn)
    table = RopeTable(attn.rope, head_dim, size)
    tables.append(table if table.matches(attn.rope) else None)
    return tables[-1]


def apply_fast_forward(model: nn.Module, backend: str) -> bool:
    """Install the fused modules into `model` when it is safe and useful; True if installed."""
    if backend == "cpu":
        log_blas_choice()
        native_ops.log_choice()
    if switch_flag(DISABLE_ENV) or backend != "cpu" or is_fast(model):
        return False
    why = unsupported_reason(model)
    if why is not None:
        logger.info("fast forward: not applied (%s): mlx-lm's own forward", why)
        return False
    positions = getattr(getattr(model, "args", None), "max_position_embeddings", None) or 8192
    size = min(int(positions), ROPE_TABLE_MAX)
    tables: list[RopeTable | None] = []
    for layer in model.layers:
        layer.self_attn = FusedAttention(layer.self_attn, _table_for(layer.self_attn, tables, size))
        layer.mlp = FusedMLP(layer.mlp)
        for name in _LAYER_NORMS:
            if name in layer:
                layer[name] = _fast_norm(_plain_norm(layer[name]))
    backbone = getattr(model, "model", None)
    if isinstance(backbone, nn.Module) and "norm" in backbone:
        # the final norm over every row
        backbone["norm"] = _fast_norm(_plain_norm(backbone["norm"]))
    qkv = model.layers[0].self_attn.qkv_proj
    quantized = isinstance(qkv, nn.QuantizedLinear)
    head = _native_head(model)
    scales = str(qkv.scales.dtype).removeprefix("mlx.core.") if quantized else ""
    logger.info(
        "fast forward: active (fused q/k/v and gate/up, %d layers%s%s)",
        len(model.layers),
        f", quantized weights on the {native_ops.quant_path()} kernels (scales and biases"
        f" in {scales})"
        if quantized and native_ops.quant_path()
        else ", quantized weights on MLX's quantized_matmul"
        if quantized
        else "",
        f", quantized head ({head}) native" if head else "",
    )
    from mlxcel.daemon.forward import native_decode  # it builds on the modules above

    native_decode.install(model)
    return True
