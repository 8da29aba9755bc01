"""A faster CPU forward for llama-like mlx-lm models, with the same results.

`apply_fast_forward(model, backend)` swaps, in place, each layer's attention and MLP for fused
versions: q/k/v in one matmul, gate/up in one, RoPE on q and k in one call, attention and
SwiGLU from `fast_ops` (a vectorised exp). Everything else (model.model, embed_tokens,
lm_head, layers, args, the caches) stays mlx-lm's own.

Why it is faster on MLX's CPU backend: every op costs a fixed overhead, so fewer and larger
ops win; MLX's exp is scalar (see fast_ops); and OpenBLAS's sgemm on a single row (a decode
step at batch 1) is faster on blocks of a few hundred output rows than on one tall matrix, so
one-row matmuls run as a batched matmul over row blocks (one MLX op, the same dot products).

Off with MLXCEL_NO_FAST_FORWARD=1; only applied on the CPU backend, to model structures it
recognises (llama/mistral/qwen2 attention and SwiGLU MLP, plain float Linear layers).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.models import native_ops
from mlxcel.daemon.models.blas import log_blas_choice, native_gemm_path
from mlxcel.daemon.models.fast_ops import (
    RopeTable,
    attention,
    rms_norm,
    rms_norm_matches,
    swiglu,
)

logger = logging.getLogger(__name__)

DISABLE_ENV = "MLXCEL_NO_FAST_FORWARD"
BLOCK_ROWS = 768  # output rows per sgemm on the small-row path (measured on OpenBLAS 0.3.21)
SMALL_ROWS = 1  # inputs with at most this many rows take the row-block path
ROPE_TABLE_MAX = 32768  # positions in the RoPE table at most (later ones use the module)

_ATTENTION_CLASSES = {("mlx_lm.models.llama", "Attention"), ("mlx_lm.models.qwen2", "Attention")}
_MLP_CLASSES = {("mlx_lm.models.llama", "MLP"), ("mlx_lm.models.qwen2", "MLP")}


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


def _concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose outputs are those of `linears`, in order (a missing bias is zeros)."""
    weight = mx.concatenate([m.weight for m in linears])
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
    inputs (`native_ops`)."""

    def __init__(self, attn: nn.Module, rope_table: RopeTable | None = None) -> None:
        super().__init__()
        self.n_heads = attn.n_heads
        self.n_kv_heads = attn.n_kv_heads
        self.head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
        self.scale = attn.scale
        self.rope = attn.rope
        self.o_proj = attn.o_proj
        self.qkv_proj = _concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self._qkv = FusedProjection(self.qkv_proj.weight, self.qkv_proj.get("bias"))
        self._out = FusedProjection(self.o_proj.weight, self.o_proj.get("bias"))
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
        (models/packed_forward.py) projects several groups of rows at once and calls this per
        group."""
        num_qk = self.n_heads + self.n_kv_heads
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
        if hasattr(cache, "bits"):  # a quantized KV cache: mlx-lm's own attention
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


def _rope_end(cache: Any, length: int) -> int | None:
    """One past the last position any row of `cache` reaches with `length` more tokens, or
    None when the cache does not say (the layer then uses its RoPE module)."""
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int) and not isinstance(offset, bool):
        return offset + length
    if type(cache) is BatchKVCache:  # every row's offset is at most _idx
        return cache._idx + length
    return None


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one matmul."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.hidden = mlp.gate_proj.weight.shape[0]
        self.gate_up_proj = _concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self._gate_up = FusedProjection(self.gate_up_proj.weight, self.gate_up_proj.get("bias"))
        self._down = FusedProjection(self.down_proj.weight, self.down_proj.get("bias"))

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = self._gate_up(x)
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


def _fast_norm(norm: Any) -> Any:
    """`norm` as a FastRMSNorm when it is a plain float32 nn.RMSNorm that rms_norm matches."""
    if type(norm) is not nn.RMSNorm or norm.weight.dtype != mx.float32:
        return norm
    if not rms_norm_matches(norm.eps, norm.weight.shape[0]):
        return norm
    fast = FastRMSNorm(norm.weight.shape[0], eps=norm.eps)
    fast.weight = norm.weight
    return fast


def _plain_linear(module: Any) -> bool:
    return type(module) is nn.Linear and module.weight.dtype in (
        mx.float32,
        mx.float16,
        mx.bfloat16,
    )


def supported(model: nn.Module) -> bool:
    """True when every layer has the attention and MLP structure this module rewrites."""
    layers = getattr(model, "layers", None)
    if not layers:
        return False
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if _class_key(attn) not in _ATTENTION_CLASSES or _class_key(mlp) not in _MLP_CLASSES:
            return False
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(_plain_linear(m) for m in linears):
            return False
        if len({m.weight.dtype for m in linears}) != 1:
            return False
    return True


def is_fast(model: nn.Module) -> bool:
    layers = getattr(model, "layers", None) or []
    return bool(layers) and all(
        isinstance(getattr(layer, "self_attn", None), FusedAttention) for layer in layers
    )


def apply_fast_forward(model: nn.Module, backend: str) -> bool:
    """Install the fused modules into `model` when it is safe and useful; True if installed."""
    if backend == "cpu":
        log_blas_choice()
        native_ops.log_choice()
    if os.environ.get(DISABLE_ENV) or backend != "cpu" or is_fast(model):
        return False
    if not supported(model):
        logger.info("fast forward: not applied (model structure not recognised)")
        return False
    first = model.layers[0].self_attn
    head_dim = first.q_proj.weight.shape[0] // first.n_heads
    positions = getattr(getattr(model, "args", None), "max_position_embeddings", None) or 8192
    table = RopeTable(first.rope, head_dim, min(int(positions), ROPE_TABLE_MAX))
    for layer in model.layers:
        layer.self_attn = FusedAttention(layer.self_attn, table)
        layer.mlp = FusedMLP(layer.mlp)
        for name in ("input_layernorm", "post_attention_layernorm"):
            if name in layer:
                layer[name] = _fast_norm(layer[name])
    backbone = getattr(model, "model", None)
    if isinstance(backbone, nn.Module) and "norm" in backbone:
        backbone["norm"] = _fast_norm(backbone["norm"])  # the final norm over every row
    logger.info("fast forward: active (fused q/k/v and gate/up, %d layers)", len(model.layers))
    from mlxcel.daemon.models import native_decode  # it builds on the modules above

    native_decode.install(model)
    return True
