"""The native quantized kernels and steps against MLX, for tests/integration/test_native_quant.py
and its child processes (tests/child_scripts/native_quant_*.py): `check_kernel` (the native
quantized matmul against float64 numpy on the dequantized weight) over `FORMATS` x `ROWS`,
`quantized_pair` (a tiny quantized llama: stock mlx-lm, and the same weights on the fast forward
and the native steps), `float_pair` (the same, float32), `greedy_both` (greedy steps on both, the
tokens checked equal), `counted_calls`."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.forward import native_ops
from mlxcel.daemon.forward.fast_forward import apply_fast_forward
from mlxcel.daemon.models.tiny import _randomize

IN, OUT = 384, 197  # every group size divides IN; OUT leaves a tail after the column blocks
FORMATS = [(b, g) for b in (4, 8) for g in (32, 64, 128)]
# few-row kernel (1-16: from 4 rows dequantized column strips under float tiles of up to 6 rows
# on AVX-512, 3 on AVX2, so 4/5/8/16 take each tile height), then 16-row blocks or tiles
ROWS = (1, 3, 4, 5, 8, 16, 64, 300)


def check_kernel(
    bits: int, group: int, rows: int, shape: tuple[int, int] | None = None
) -> tuple[float, float]:
    """(max |y - want|, max |y - want| / (|x| @ |W|^T)) of the native quantized matmul against
    float64 numpy on the dequantized weight. A float32 dot product of n terms errs by at most
    ~n * 2^-24 of the sum of |terms| (summation order), so the ratio stays below IN * 2^-23."""
    out_features, in_features = shape or (OUT, IN)
    key = mx.random.split(mx.random.key(bits * 1000 + group * 10 + rows), 2)
    w = mx.random.normal((out_features, in_features), key=key[0])
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    deq = np.asarray(mx.dequantize(q, scales, biases, group_size=group, bits=bits), np.float64)
    x = mx.random.normal((rows, in_features), key=key[1])
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in (q, scales, biases)]
    got = np.asarray(native_ops.qmatmul(x, *arrays, bits, group), dtype=np.float64)
    xs = np.asarray(x, dtype=np.float64)
    diff = np.abs(got - xs @ deq.T)
    return float(diff.max()), float((diff / (np.abs(xs) @ np.abs(deq).T)).max())


def llama_args(**overrides: Any) -> Any:
    base = dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=3,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    return llama.ModelArgs(**{**base, **overrides})


def quantized_pair(
    bits: int, group: int, seed: int, scales: Any = None, factor: float = 1.0, **overrides: Any
) -> tuple[Any, Any]:
    """(stock mlx-lm quantized model, the same weights with the fast forward and the native
    steps): random weights quantized by nn.quantize, scales and biases cast to float32; with
    `scales` (mx.float16 / mx.bfloat16) rounded to that type first, as a checkpoint's are, so
    the fast forward stores them narrow (native_ops.narrow_scales), then times `factor` (a
    power of two: 2^-16 puts them below float16's normal range, so only bfloat16 holds them)."""
    args = llama_args(**overrides)
    stock = _random_llama(args, seed)
    nn.quantize(stock, group_size=group, bits=bits)
    cast = [
        (k, (v if scales is None else v.astype(scales)).astype(mx.float32) * factor)
        for k, v in tree_flatten(stock.parameters())
        if k.endswith(("scales", "biases"))
    ]
    stock.update(tree_unflatten(cast))
    native = llama.Model(args)
    nn.quantize(native, group_size=group, bits=bits)
    return stock, _on_the_native_steps(native, stock)


def float_pair(seed: int, **overrides: Any) -> tuple[Any, Any]:
    """(stock mlx-lm llama, the same random float32 weights on the fast forward and the native
    steps)."""
    args = llama_args(**overrides)
    stock = _random_llama(args, seed)
    return stock, _on_the_native_steps(llama.Model(args), stock)


def _random_llama(args: Any, seed: int) -> Any:
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_unflatten(list(_randomize(dict(tree_flatten(model.parameters()))).items())))
    return model


def _on_the_native_steps(native: Any, stock: Any) -> Any:
    """`native` (the same layout as `stock`) with stock's weights, on the fast forward."""
    native.update(stock.parameters())
    mx.eval(stock.parameters(), native.parameters())
    assert apply_fast_forward(native, "cpu")
    return native


def greedy_both(pair: tuple[Any, Any], rows: list[list[int]], steps: int) -> float:
    """Left-padded prefill, then `steps` greedy steps on both; asserts identical tokens each
    step; returns the largest logit difference seen."""
    longest = max(len(r) for r in rows)
    padding = [longest - len(r) for r in rows]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    worst = 0.0
    for _ in range(steps):
        worst = max(worst, mx.abs(last[0] - last[1]).max().item())
        token = mx.argmax(last[0], axis=-1)[:, None]
        assert mx.array_equal(token, mx.argmax(last[1], axis=-1)[:, None]).item()
        last = [m(token, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    return worst


def narrow_kernel_same(
    bits: int, group: int, rows: int, shape: tuple[int, int] = (OUT, IN)
) -> bool:
    """Whether the native quantized matmul with float16, and with bfloat16, scales and biases
    gives bit for bit its result with the same values in float32."""
    key = mx.random.split(mx.random.key(bits * 7 + group * 3 + rows), 2)
    w = mx.random.normal(shape, key=key[0])
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, shape[1]), key=key[1])
    packed = np.ascontiguousarray(np.asarray(q))
    same = True
    for dtype in (mx.float16, mx.bfloat16):
        narrow = [a.astype(dtype) for a in (scales, biases)]
        wide = [np.ascontiguousarray(np.asarray(a.astype(mx.float32))) for a in narrow]
        host = [np.ascontiguousarray(native_ops.host_scales(a)) for a in narrow]
        y_wide = np.asarray(native_ops.qmatmul(x, packed, *wide, bits, group))
        y_narrow = np.asarray(native_ops.qmatmul(x, packed, *host, bits, group))
        same = same and bool(np.array_equal(y_wide, y_narrow))
    return same


def counted_calls(obj: Any, name: str) -> list[int]:
    """Counts the calls of `obj.name` from now on (the returned list's one item)."""
    real, calls = getattr(obj, name), [0]

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return real(*args)

    setattr(obj, name, counted)
    return calls
