"""CPU kernels for the fast forward: attention, softmax and SwiGLU with a vectorisable exp.

MLX's CPU `exp` (and so softmax, sigmoid, silu) evaluates its polynomial one float at a time
through libm `fma` calls (~12 ns each on x86), a third of a prefill's time. Here the same
polynomial (the same coefficients, so results agree to an ulp or so) is written as plain
compiled elementwise ops, which g++ vectorises; the power of two comes from the exponent
bits, which needs a `view` between two compiled kernels. Small attention scores keep MLX's
own softmax: the extra graph nodes would cost more than they save.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
from mlxcel.daemon.mlx_lm_compat import longrope_scale, rope_frequencies

# MLX's CPU exp polynomial (mlx/backend/cpu/simd/math.h), highest degree first.
_EXP_COEFFS = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to an integer
_EXP_MIN = -88.0  # below this exp underflows to 0, as in MLX
FAST_MIN_ELEMENTS = 16384  # smaller inputs use MLX's own softmax / silu


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) for x <= 0 as (mantissa polynomial, int32 bits of the power of two)."""
    scaled = mx.maximum(x, _EXP_MIN) * 1.442695
    whole = (scaled + _ROUND_MAGIC) - _ROUND_MAGIC
    frac = scaled - whole
    poly = mx.array(_EXP_COEFFS[0], dtype=x.dtype)
    for coeff in _EXP_COEFFS[1:]:
        poly = poly * frac + coeff
    return poly, mx.left_shift(whole.astype(mx.int32) + 127, 23)


@partial(mx.compile, shapeless=True)
def _softmax_parts(scores: mx.array, row_max: mx.array) -> tuple[mx.array, mx.array]:
    return _exp_parts(scores - row_max)


@partial(mx.compile, shapeless=True)
def _softmax_exp(poly: mx.array, power: mx.array, scores: mx.array, row_max: mx.array) -> mx.array:
    return mx.where(scores - row_max < _EXP_MIN, 0.0, poly * power)


def _exp_shifted(scores: mx.array, row_max: mx.array) -> mx.array:
    """exp(scores - row_max), scores <= row_max."""
    poly, bits = _softmax_parts(scores, row_max)
    return _softmax_exp(poly, bits.view(mx.float32), scores, row_max)


@partial(mx.compile, shapeless=True)
def _swiglu_parts(gate: mx.array) -> tuple[mx.array, mx.array]:
    return _exp_parts(-mx.abs(gate))


@partial(mx.compile, shapeless=True)
def _swiglu_finish(poly: mx.array, power: mx.array, gate: mx.array, up: mx.array) -> mx.array:
    # decay = exp(-|gate|) (past -88 it is ~1e-38, and 1 + decay == 1, as MLX's inf gives);
    # sigmoid(gate) = 1 / (1 + decay) for gate >= 0, decay / (1 + decay) below.
    decay = poly * power
    return gate * up * (mx.where(gate < 0, decay, 1.0) / (1.0 + decay))


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up; the vectorised exp at every size (even one decode row: measured)."""
    if gate.dtype != mx.float32:
        from mlx_lm.models.activations import swiglu as stock_swiglu

        return stock_swiglu(gate, up)
    poly, bits = _swiglu_parts(gate)
    return _swiglu_finish(poly, bits.view(mx.float32), gate, up)


def _bool_mask(mask: Any, num_queries: int, num_keys: int) -> mx.array | None:
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        queries = mx.arange(num_keys - num_queries, num_keys)
        return queries[:, None] >= mx.arange(num_keys)[None]
    return mask


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """softmax(q k^T * scale, masked) v, grouped-query heads without repeating k and v.

    Masks as in mlx-lm: None, "causal", boolean (True = attend) or additive float arrays.
    """
    batch, num_heads, length, head_dim = queries.shape
    num_kv, num_keys = keys.shape[1], keys.shape[2]
    repeats = num_heads // num_kv
    queries = (queries * scale).reshape(batch, num_kv, repeats * length, head_dim)
    scores = queries @ keys.swapaxes(-1, -2)
    mask = _bool_mask(mask, length, num_keys)
    if mask is not None:
        scores = scores.reshape(batch, num_kv, repeats, length, num_keys)
        if mask.ndim == 4:  # (batch or 1, 1, length, keys): add the repeats axis
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        scores = scores.reshape(batch, num_kv, repeats * length, num_keys)
    if scores.size < FAST_MIN_ELEMENTS or scores.dtype != mx.float32:
        out = mx.softmax(scores, axis=-1, precise=True) @ values
    else:
        weights = _exp_shifted(scores, scores.max(axis=-1, keepdims=True))
        # Normalising after the product divides head_dim values per row instead of keys.
        out = (weights @ values) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(batch, num_heads, length, head_dim)


@partial(mx.compile, shapeless=True)
def _rotate_halves(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # mx.fast.rope's arithmetic (non-traditional layout), in one compiled kernel.
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@partial(mx.compile, shapeless=True)
def _rotate_pairs(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    # the traditional layout: (even, odd) pairs, interleaved back by the caller's reshape
    return mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class RopeTable:
    """RoPE from a table of cos/sin per position, bit for bit `rope(x, offset)`.

    On the CPU, mx.fast.rope is a fallback of ~20 ops (positions, frequencies, cos, sin, the
    rotation) per call; here it is a gather and one compiled kernel. The table is read off the
    module itself (rotating ones and zeros gives its cos and sin at every position), so any
    rotation-only RoPE (plain, llama3-scaled) gives the same bits; `matches` checks a module
    against it. Positions past the table (or a cache whose length is unknown) return None:
    the caller uses the module.
    """

    def __init__(self, rope: Any, head_dim: int, size: int) -> None:
        half = head_dim // 2
        # `traditional` RoPE (GGUF-converted llamas) rotates adjacent pairs, not the halves
        self.traditional = bool(getattr(rope, "traditional", False))
        # A RoPE that scales its input before rotating (yarn's mscale, longrope's scale):
        # the table holds the rotation alone and `__call__` scales first, as the module does.
        rope, self.input_scale = _rotation(rope)
        if self.traditional:
            pairs = mx.broadcast_to(mx.array([1.0, 0.0]), (size, half, 2))
            rotated = rope(pairs.reshape(1, 1, size, head_dim))[0, 0]
            cos, sin = rotated[:, 0::2], rotated[:, 1::2]
        else:
            probe = mx.concatenate(
                [mx.ones((1, 1, size, half)), mx.zeros((1, 1, size, half))], axis=-1
            )
            rotated = rope(probe)[0, 0]
            cos, sin = rotated[:, :half], rotated[:, half:]
        self.cos, self.sin = mx.contiguous(cos), mx.contiguous(sin)
        self.half, self.size, self.head_dim = half, size, head_dim
        # What the native kernels read: the rotation times the input scale (rope is linear),
        # so they need no scale of their own (within float rounding of the module).
        self.native_cos, self.native_sin = self.cos, self.sin
        if self.input_scale != 1.0:
            self.native_cos = mx.contiguous(self.cos * self.input_scale)
            self.native_sin = mx.contiguous(self.sin * self.input_scale)
        mx.eval(self.cos, self.sin, self.native_cos, self.native_sin)

    def matches(self, rope: Any, atol: float = 0.0) -> bool:
        """True when `rope` gives this table's results (checked on random input, 3 offsets):
        the same bits, or within `atol` (what a kernel that reads the table needs)."""

        def same(got: mx.array | None, expected: mx.array) -> bool:
            if got is None:
                return False
            if atol == 0.0:
                return mx.array_equal(got, expected).item()
            return mx.abs(got - expected).max().item() <= atol

        x = mx.random.normal((2, 3, 5, self.head_dim), key=mx.random.key(11))
        try:
            for offset in (0, 37, self.size - 5):
                if not same(self(x, offset, offset + 5), rope(x, offset=offset)):
                    return False
            batch_offsets = mx.array([3, self.size - 5])
            return same(self(x, batch_offsets, self.size), rope(x, offset=batch_offsets))
        except (TypeError, ValueError):  # a RoPE that takes no per-row offsets (dynamic NTK)
            return False

    def __call__(self, x: mx.array, offset: Any, end: int | None) -> mx.array | None:
        """rope(x, offset) with x (batch, heads, length, head_dim); `end` bounds every row's
        last position + 1 (None: unknown)."""
        length = x.shape[2]
        if end is None or end > self.size or x.shape[-1] != self.head_dim:
            return None
        if self.input_scale != 1.0:
            x = x * self.input_scale
        steps = mx.arange(length)
        if isinstance(offset, int):
            positions = (steps + offset)[None]
        else:
            # Left padding gives negative positions: masked out everywhere, any row will do.
            positions = mx.maximum(offset.reshape(-1, 1) + steps[None], 0)
        cos = mx.expand_dims(self.cos[positions], 1)
        sin = mx.expand_dims(self.sin[positions], 1)
        if self.traditional:
            return _rotate_pairs(x[..., 0::2], x[..., 1::2], cos, sin).reshape(x.shape)
        return _rotate_halves(x[..., : self.half], x[..., self.half :], cos, sin)


def _rotation(rope: Any) -> tuple[Any, float]:
    """(a RoPE callable that only rotates, the scale `rope` applies to its input first).

    mlx-lm's YarnRoPE multiplies its input by `mscale` and SuScaledRoPE (longrope) by its
    scale, then rotates with its frequencies (models/rope_utils.py; both private, read through
    daemon/mlx_lm_compat.py); a table read off the module would hold cos and sin times that
    scale, one rounding away from the module's results.
    """
    name = type(rope).__name__
    if name == "YarnRoPE" and float(rope.mscale) != 1.0:
        dims, traditional, scale = rope.dims, rope.traditional, float(rope.mscale)
    elif name == "SuScaledRoPE" and longrope_scale(rope) != 1.0:
        dims, traditional, scale = rope.dim, False, longrope_scale(rope)
    else:
        return rope, 1.0
    freqs = rope_frequencies(rope)

    def rotate(x: mx.array, offset: Any = 0) -> mx.array:
        return mx.fast.rope(
            x, dims, traditional=traditional, base=None, scale=1.0, offset=offset, freqs=freqs
        )

    return rotate, scale


@partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    # mx.fast.rms_norm's CPU fallback, op for op, with the elementwise tail in one kernel.
    return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps) * weight


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """mx.fast.rms_norm(x, weight, eps) in 4 kernels instead of its fallback's 8 ops."""
    if x.dtype != mx.float32 or weight.dtype != mx.float32:
        return mx.fast.rms_norm(x, weight, eps)
    return _rms_norm(x, weight, mx.array(eps, dtype=mx.float32))


def rms_norm_matches(eps: float, dims: int) -> bool:
    """True when `rms_norm` gives mx.fast.rms_norm's bits on this MLX (checked on a probe)."""
    x = mx.random.normal((3, 5, dims), key=mx.random.key(12)) * 3
    weight = mx.random.normal((dims,), key=mx.random.key(13))
    return mx.array_equal(rms_norm(x, weight, eps), mx.fast.rms_norm(x, weight, eps)).item()
