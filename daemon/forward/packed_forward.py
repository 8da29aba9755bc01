"""One forward for a decode batch and a prefill chunk together (the engine's packed step).

The decoding rows (one token each, on the decode batch's KV caches) and the prefill cohort's
chunk (rows x chunk length, on the cohort's caches) are embedded, normalised and projected as
one packed activation of shape (decode rows + prefill rows x chunk, hidden): every Linear, norm
and MLP reads its weights once for both groups. Only attention splits: each group runs against
its own cache with its own mask, exactly as the model's own layer would, and the two outputs
are concatenated back in the same order before the output projection.

Each row's values equal what the model's own forward computes for it (per-row ops, the same
attention code per group): the engine's greedy parity tests check it token for token.

`PackedForward.for_model(model)` recognises mlx-lm's llama / qwen2 stacks (stock attention or
the fused one of `fast_forward.py`) and qwen3 / phi3 ones (the fused attention only), with no
sliding-window layers and no pipeline split, and returns None for anything else; the engine
then runs the two forwards per step.

With the native steps installed (native_decode.py) the two groups run as two native calls
instead, the decode rows' step then the chunk's, each reading the weights once: on a CPU that
is faster than one MLX graph for both (7 decode rows and a 256-token chunk: ~300 ms against
~400 ms for SmolLM2 on 2 cores). A group the native steps do not take runs as above.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlxcel.daemon.forward.fast_forward import FusedAttention

_MODEL_CLASSES = {
    ("mlx_lm.models.llama", "LlamaModel"),
    ("mlx_lm.models.qwen2", "Qwen2Model"),
    ("mlx_lm.models.qwen3", "Qwen3Model"),  # its q/k norms: the fused attention only
    ("mlx_lm.models.phi3", "Phi3Model"),  # its fused projections: the fused attention only
}
_STOCK_ATTENTION = {("mlx_lm.models.llama", "Attention"), ("mlx_lm.models.qwen2", "Attention")}


def _class_key(obj: Any) -> tuple[str, str]:
    return type(obj).__module__, type(obj).__name__


def plain_stack(backbone: Any) -> bool:
    """True for mlx-lm's llama / qwen2 / qwen3 / phi3 backbone (or a subclass: the native
    decode step, native_decode.py, subclasses it) without a pipeline split or sliding-window
    layers."""
    if not any((c.__module__, c.__name__) in _MODEL_CLASSES for c in type(backbone).__mro__):
        return False
    if getattr(backbone, "pipeline_size", 1) != 1 or getattr(backbone, "swa_idx", None):
        return False
    return not any(getattr(layer, "use_sliding", False) for layer in backbone.layers)


class PackedForward:
    """`(decode hidden, prefill hidden) = packed(dec_tokens, dec_cache, pre_tokens, pre_cache)`.

    `dec_tokens` (B_dec,) int, `pre_tokens` (B_pre, L) int (right-padded chunk); the caches are
    per-layer lists (mlx-lm `BatchKVCache`s). Returns the backbone's final-norm hidden states:
    (B_dec, 1, hidden) and (B_pre, L, hidden); the caller applies the output head.
    """

    def __init__(self, backbone: Any) -> None:
        self.backbone = backbone
        self.ran_native = False  # the last call's decode rows went through the native step

    @classmethod
    def for_model(cls, model: Any) -> PackedForward | None:
        """A packed forward for `model`, or None when its structure is not one this handles."""
        backbone: Any = getattr(model, "model", None)
        if not plain_stack(backbone):
            return None
        for layer in backbone.layers:
            attn = getattr(layer, "self_attn", None)
            if not isinstance(attn, FusedAttention) and _class_key(attn) not in _STOCK_ATTENTION:
                return None
            needed = ("input_layernorm", "post_attention_layernorm", "mlp")
            if not all(hasattr(layer, name) for name in needed):
                return None
        return cls(backbone)

    def __call__(
        self, dec_tokens: mx.array, dec_cache: list[Any], pre_tokens: mx.array, pre_cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        native = self.backbone.__dict__.get("_mlxcel_native")
        self.ran_native = False
        if native is not None:  # the native steps (native_decode.py), one call per group
            dec_hidden = native(self.backbone, dec_tokens.reshape(-1, 1), dec_cache)
            if dec_hidden is not None:
                self.ran_native = True  # computed now, not queued
                pre_hidden = native.chunk(self.backbone, pre_tokens, pre_cache)
                if pre_hidden is None:
                    pre_hidden = self.backbone(pre_tokens, cache=pre_cache)
                return dec_hidden, pre_hidden
        num_dec = dec_tokens.shape[0]
        num_pre, length = pre_tokens.shape
        embed = self.backbone.embed_tokens
        h = embed(mx.concatenate([dec_tokens.reshape(-1), pre_tokens.reshape(-1)]))
        hidden = h.shape[-1]
        # the masks each group's own forward would use (mlx-lm's, from its cache)
        dec_mask = create_attention_mask(h[:num_dec].reshape(num_dec, 1, hidden), dec_cache[0])
        pre_mask = create_attention_mask(h[num_dec:].reshape(num_pre, length, hidden), pre_cache[0])
        groups = ((num_dec, 1, dec_mask), (num_pre, length, pre_mask))
        for i, layer in enumerate(self.backbone.layers):
            attn_out = _attention(
                layer.self_attn, layer.input_layernorm(h), groups, (dec_cache[i], pre_cache[i])
            )
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.backbone.norm(h)
        return (
            h[:num_dec].reshape(num_dec, 1, hidden),
            h[num_dec:].reshape(num_pre, length, hidden),
        )


def _attention(
    attn: Any,
    x: mx.array,
    groups: tuple[tuple[int, int, Any], ...],
    caches: tuple[Any, Any],
) -> mx.array:
    """The attention block on packed rows: projections once, attention per group (the fused
    layer's own `attend`, or mlx-lm's Attention as written)."""
    fused = isinstance(attn, FusedAttention)
    if fused:
        qkv = attn._qkv(x)
    else:
        qkv = mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], axis=-1)
    outs = []
    start = 0
    for (batch, length, mask), cache in zip(groups, caches, strict=True):
        rows = qkv[start : start + batch * length]
        start += batch * length
        if fused:
            out = attn.attend(rows, batch, length, mask, cache)
        else:
            out = _stock_attention(attn, rows, batch, length, mask, cache)
        outs.append(out.reshape(batch * length, -1))
    out = mx.concatenate(outs)
    return attn._out(out) if fused else attn.o_proj(out)


def _stock_attention(
    attn: Any, qkv: mx.array, batch: int, length: int, mask: Any, cache: Any
) -> mx.array:
    """mlx-lm's llama / qwen2 `Attention.__call__` after its projections; (B, L, heads x dim)."""
    num_q, num_kv = attn.n_heads, attn.n_kv_heads
    head_dim = qkv.shape[-1] // (num_q + 2 * num_kv)
    qkv = qkv.reshape(batch, length, -1, head_dim).transpose(0, 2, 1, 3)
    queries = attn.rope(qkv[:, :num_q], offset=cache.offset)
    keys = attn.rope(qkv[:, num_q : num_q + num_kv], offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, qkv[:, num_q + num_kv :])
    out = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=attn.scale, mask=mask
    )
    return out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
