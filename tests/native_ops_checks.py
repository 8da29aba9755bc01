"""The fused native ops (daemon/forward/native/fused_ops.c) against float64 numpy, for
tests/integration/test_native_ops.py and its child process
(tests/child_scripts/native_ops_paths.py): `check_attention` on `ATTN_SHAPES` under each mask,
`check_swiglu` on `SWIGLU_SHAPES`, each the largest relative error (`RTOL` the bound)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlxcel.daemon.forward import native_ops

RTOL = 2e-5

# (batch, heads, kv_heads, length, keys, head_dim): SmolLM2 (9/3 heads of 64) at prefill
# sizes, with a cache before the chunk, the tiny model (4/2 heads of 16), qwen-like 128-wide
# heads, odd lengths and key counts, one query row.
ATTN_SHAPES = [
    (1, 9, 3, 256, 256, 64),
    (4, 9, 3, 64, 64, 64),
    (2, 9, 3, 33, 301, 64),
    (3, 4, 2, 7, 19, 16),
    (1, 8, 8, 1, 5, 128),
    (2, 14, 2, 17, 17, 64),
    (8, 9, 3, 1, 300, 64),
    # the grouped path (2-4 query heads per kv head, head_dim 64 or 128) and its fallbacks
    (2, 4, 2, 24, 40, 64),
    (2, 8, 2, 40, 40, 128),
    (1, 4, 4, 33, 50, 128),
    (1, 6, 2, 70, 90, 128),
    # keys over several of the tiled path's 256-key tiles
    (1, 9, 3, 40, 1100, 64),
    (2, 8, 2, 20, 700, 128),
]
# (rows, hidden): SmolLM2's 1536 and the tiny model's 128, odd widths around a vector.
SWIGLU_SHAPES = [(256, 1536), (37, 1536), (1, 1), (5, 15), (3, 16), (64, 17), (9, 128), (2, 33)]


def reference_attention(q: Any, k: Any, v: Any, scale: float, keep: Any) -> Any:
    """float64 softmax(q k^T * scale over the kept keys) v; queries with no key give 0."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("bhld,bhsd->bhls", q * scale, k)
    scores = np.where(keep, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhls,bhsd->bhld", weights, v) / np.where(total > 0, total, 1.0)
    return np.where(total > 0, out, 0.0)


def _masks(batch: int, length: int, keys: int) -> dict[str, tuple[Any, Any]]:
    """name -> (mask as the model passes it, boolean keep of shape (b|1, 1, length, keys))."""
    causal = np.arange(keys - length, keys)[:, None] >= np.arange(keys)[None]
    padding = np.array([(5 * i) % (keys // 2 + 1) for i in range(batch)])
    padded = causal[None, None] & (
        np.arange(keys)[None, None, None] >= padding[:, None, None, None]
    )
    return {
        "none": (None, np.ones((1, 1, length, keys), bool)),
        "causal": ("causal", causal[None, None]),
        "left-padded": (mx.array(padded), padded),
        "shared-2d": (mx.array(causal), causal[None, None]),
    }


def check_attention(shape: tuple[int, ...], mask_name: str) -> float:
    """The largest relative error of the native attention on `shape` against numpy."""
    batch, heads, kv_heads, length, keys, head_dim = shape
    keys_ = mx.random.split(mx.random.key(sum(shape)), 3)
    q = mx.random.normal((batch, heads, length, head_dim), key=keys_[0])
    # k and v as views into a longer cache buffer, as BatchKVCache returns them.
    k = (mx.random.normal((batch, kv_heads, keys + 13, head_dim), key=keys_[1]) * 3)[:, :, :keys]
    v = mx.random.normal((batch, kv_heads, keys + 13, head_dim), key=keys_[2])[:, :, :keys]
    mask, keep = _masks(batch, length, keys)[mask_name]
    got = native_ops.attention(q, k, v, head_dim**-0.5, mask)
    assert got is not None, "the kernel refused a shape the models use"
    want = reference_attention(q, k, v, head_dim**-0.5, keep)
    return float(np.max(np.abs(np.asarray(got) - want)) / max(np.max(np.abs(want)), 1e-30))


def check_swiglu(rows: int, hidden: int) -> float:
    gate = mx.random.normal((rows, hidden), key=mx.random.key(rows * 7 + hidden)) * 6
    gate = (
        mx.concatenate([gate[:, :-1], mx.full((rows, 1), -100.0)], axis=-1) if hidden > 2 else gate
    )
    up = mx.random.normal((rows, hidden), key=mx.random.key(hidden))
    got = np.asarray(native_ops.swiglu(mx.concatenate([gate, up], axis=-1)[None], hidden))[0]
    g, u = np.asarray(gate, dtype=np.float64), np.asarray(up, dtype=np.float64)
    want = g / (1.0 + np.exp(-g)) * u
    return float(np.max(np.abs(got - want) / (np.abs(want) + 1e-6)))
