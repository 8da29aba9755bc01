"""The fast CPU forward gives the stock mlx-lm results: kernels, the tiny llama, qwen2's biases.
SmolLM2's greedy tokens are tests/e2e/test_fast_forward_smollm2.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.activations import swiglu as stock_swiglu
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlxcel.daemon.forward import fast_ops
from mlxcel.daemon.forward.fast_forward import (
    DISABLE_ENV,
    FusedAttention,
    apply_fast_forward,
    is_fast,
)
from mlxcel.daemon.models import load_model
from platform_marks import cpu_only

pytestmark = cpu_only  # the fused forward is installed on the CPU backend only
ATOL = 1e-4


def _load(path: Path, fast: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patch:
        if fast:
            patch.delenv(DISABLE_ENV, raising=False)
        else:
            patch.setenv(DISABLE_ENV, "1")
        return load_model(str(path)).model


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> tuple[Any, Any]:
    with pytest.MonkeyPatch.context() as patch:
        return _load(tiny_model_dir, False, patch), _load(tiny_model_dir, True, patch)


@pytest.fixture(params=["stock-sized", "all-fast"])
def fast_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Tiny shapes stay below the fast kernels' size threshold unless it is lowered."""
    if request.param == "all-fast":
        monkeypatch.setattr(fast_ops, "FAST_MIN_ELEMENTS", 0)
    return request.param


def _close(a: mx.array, b: mx.array) -> None:
    assert a.shape == b.shape
    diff = mx.abs(a - b).max().item()
    assert diff <= ATOL, f"max |diff| {diff}"


def test_load_model_installs_it_on_the_cpu_and_the_switch_turns_it_off(
    pair: tuple[Any, Any],
) -> None:
    stock, fast = pair
    assert is_fast(fast) and not is_fast(stock)
    assert all(isinstance(layer.self_attn, FusedAttention) for layer in fast.layers)
    assert not apply_fast_forward(stock, "metal")
    assert not is_fast(stock)


def test_unknown_structures_are_left_alone(tiny_nobatch_model_dir: Path) -> None:
    model = load_model(str(tiny_nobatch_model_dir)).model
    assert not is_fast(model)
    assert not apply_fast_forward(model, "cpu")


def test_parameters_count_and_split_are_unchanged(pair: tuple[Any, Any]) -> None:
    from mlx.utils import tree_flatten
    from mlxcel.daemon.engine.mlx_support import detect_head

    stock, fast = pair
    count = [sum(v.size for _, v in tree_flatten(m.parameters())) for m in pair]
    assert count[0] == count[1]
    assert detect_head(fast) is not None and detect_head(stock) is not None


def test_logits_without_a_cache(pair: tuple[Any, Any], fast_kernels: str) -> None:
    tokens = mx.random.randint(0, 200, (2, 40), key=mx.random.key(1))
    _close(pair[0](tokens), pair[1](tokens))


def test_prefill_and_decode_on_a_kv_cache(pair: tuple[Any, Any], fast_kernels: str) -> None:
    prompt = mx.random.randint(0, 200, (1, 70), key=mx.random.key(2))
    caches = [make_prompt_cache(m) for m in pair]
    logits = [m(prompt, cache=c) for m, c in zip(pair, caches, strict=True)]
    for step in range(6):
        _close(*logits)
        token = mx.argmax(logits[0][:, -1, :], axis=-1)[:, None]
        assert mx.array_equal(token, mx.argmax(logits[1][:, -1, :], axis=-1)[:, None]).item()
        logits = [m(token + step, cache=c) for m, c in zip(pair, caches, strict=True)]


def test_left_padded_batch_cache(pair: tuple[Any, Any], fast_kernels: str) -> None:
    """BatchKVCache: per-row array offsets for RoPE, left-padding masks, then decode."""
    rows = [[5, 9, 13, 20, 7, 3, 11, 2], [40, 41, 42], [7] * 30]
    longest = max(len(r) for r in rows)
    padding = [longest - len(r) for r in rows]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    logits = [m(inputs, cache=c) for m, c in zip(pair, caches, strict=True)]
    for _ in range(5):
        last = [out[:, -1, :] for out in logits]
        _close(*last)
        token = mx.argmax(last[0], axis=-1)[:, None]
        logits = [m(token, cache=c) for m, c in zip(pair, caches, strict=True)]


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_attention_kernel_matches_mlx(mask_kind: str) -> None:
    keys_ = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((2, 9, 40, 64), key=keys_[0])
    k = mx.random.normal((2, 3, 56, 64), key=keys_[1]) * 3
    v = mx.random.normal((2, 3, 56, 64), key=keys_[2])
    mask: Any = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind in ("bool", "additive"):
        keep = mx.arange(56)[None, None, None, :] >= mx.array([0, 20])[:, None, None, None]
        keep = keep & (mx.arange(16, 56)[:, None] >= mx.arange(56)[None])
        mask = keep if mask_kind == "bool" else mx.where(keep, 0.0, -1e9)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    _close(fast_ops.attention(q, k, v, 0.125, mask), expected)


def test_swiglu_kernel_matches_mlx_including_extremes() -> None:
    gate = mx.random.normal((4, 64, 128), key=mx.random.key(4)) * 8
    gate = mx.concatenate([gate, mx.full((4, 64, 1), 100.0), mx.full((4, 64, 1), -100.0)], -1)
    up = mx.random.normal(gate.shape, key=mx.random.key(5))
    assert gate.size >= fast_ops.FAST_MIN_ELEMENTS
    _close(fast_ops.swiglu(gate, up), stock_swiglu(gate, up))


def test_qwen2_biases_are_fused_too() -> None:
    """qwen2: q/k/v with biases, o_proj without."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256,
    )
    mx.random.seed(6)
    stock = qwen2.Model(args)
    fast = qwen2.Model(args)
    fast.update(stock.parameters())
    assert apply_fast_forward(fast, "cpu") and is_fast(fast)
    assert "bias" in fast.layers[0].self_attn.qkv_proj
    tokens = mx.random.randint(0, 256, (1, 12), key=mx.random.key(7))
    caches = [make_prompt_cache(m) for m in (stock, fast)]
    _close(*[m(tokens, cache=c) for m, c in zip((stock, fast), caches, strict=True)])
    _close(*[m(tokens[:, :1], cache=c) for m, c in zip((stock, fast), caches, strict=True)])
