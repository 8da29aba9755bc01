"""The fused native ops (daemon/forward/native/fused_ops.c): attention and SwiGLU against numpy
on every shape the models use (odd sizes included), on both paths (AVX2 forced in a child
process), and the MLX fallback the log names when the library is missing. The checks against
numpy are tests/native_ops_checks.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlxcel.daemon.forward import native_ops
from mlxcel.daemon.forward.blas import OPS_LIB_ENV, build_native_ops, cpu_flags
from native_ops_checks import (
    ATTN_SHAPES,
    RTOL,
    SWIGLU_SHAPES,
    check_attention,
    check_swiglu,
)
from repo_paths import TESTS

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "avx2" not in cpu_flags(),
    reason="the fused ops are built for x86-64 Linux CPUs with AVX2",
)


@pytest.fixture(scope="module")
def ops_lib() -> Iterator[Path]:
    """The library built from these sources (the package's or the per-user cache's, compiled
    there when missing: the same file a build into a folder of the test's own would give,
    without the compiler's ~15 s), named by the override so this process loads it."""
    lib = build_native_ops()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(OPS_LIB_ENV, str(lib))
        patch.delenv(native_ops.DISABLE_ENV, raising=False)
        native_ops._load.cache_clear()
        yield lib
    native_ops._load.cache_clear()


def _count_calls(monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, int]:
    """Counts the calls of these `native_ops` functions (the returned dict fills in)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(native_ops, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(native_ops, name, counted)
    return calls


@pytest.mark.parametrize("mask_name", ["none", "causal", "left-padded", "shared-2d"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_numpy(ops_lib: Path, shape: tuple[int, ...], mask_name: str) -> None:
    assert check_attention(shape, mask_name) <= RTOL


@pytest.mark.parametrize("rows,hidden", SWIGLU_SHAPES)
def test_swiglu_matches_numpy(ops_lib: Path, rows: int, hidden: int) -> None:
    assert check_swiglu(rows, hidden) <= RTOL


def test_unsupported_inputs_are_refused_not_guessed(ops_lib: Path) -> None:
    q = mx.zeros((1, 2, 3, 24))  # head_dim not a multiple of 16
    assert native_ops.attention(q, q, q, 1.0, None) is None
    q = mx.zeros((1, 2, 3, 16))
    assert native_ops.attention(q, q, q, 1.0, "sliding") is None
    assert native_ops.attention(q, q, q, 1.0, mx.zeros((1, 1, 3, 3))) is None  # additive mask
    assert native_ops.attention(q.astype(mx.float16), q, q, 1.0, None) is None


def _child(env: dict[str, str]) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, str(TESTS / "child_scripts" / "native_ops_paths.py")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_forced_avx2_path_runs_matches_and_says_so(ops_lib: Path) -> None:
    out, log = _child({OPS_LIB_ENV: str(ops_lib), "MLXCEL_GEMM_ISA": "avx2"})
    assert out["path"] == "avx2"
    assert out["attention"] <= RTOL and out["swiglu"] <= RTOL
    assert "native ops: prefill attention and SwiGLU on the avx2 path" in log
    assert "MLXCEL_GEMM_ISA=avx2" in log
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu_flags():
        out, log = _child({OPS_LIB_ENV: str(ops_lib)})
        assert out["path"] == "avx512" and "on the avx512 path" in log


def test_missing_library_falls_back_and_the_log_says_why(tmp_path: Path) -> None:
    out, log = _child({OPS_LIB_ENV: str(tmp_path / "absent.so")})
    assert out["path"] is None
    assert "native ops: not in use (not built" in log
    out, log = _child({native_ops.DISABLE_ENV: "1"})
    assert out["path"] is None and f"turned off by {native_ops.DISABLE_ENV}" in log


def test_the_fast_forward_takes_the_native_ops_and_matches_stock(
    ops_lib: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A left-padded batch prefill and a B=8 decode step of the tiny llama go through the
    native ops (counted) and give stock mlx-lm's logits."""
    from mlx_lm.models.cache import BatchKVCache
    from mlxcel.daemon.forward.fast_forward import DISABLE_ENV, is_fast
    from mlxcel.daemon.models import load_model

    monkeypatch.setenv(DISABLE_ENV, "1")
    stock = load_model(str(tiny_model_dir)).model
    monkeypatch.delenv(DISABLE_ENV)
    # the decode step through the fused MLX layers (the native decode step is
    # test_native_decode.py's)
    monkeypatch.setenv("MLXCEL_NO_NATIVE_DECODE", "1")
    fast = load_model(str(tiny_model_dir)).model
    assert is_fast(fast) and not is_fast(stock)
    calls = _count_calls(monkeypatch, "attention", "swiglu")
    padding = [(3 * i) % 7 for i in range(8)]
    prompt = mx.random.randint(1, 200, (8, 12), key=mx.random.key(21))
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in (stock, fast)]
    logits = [m(prompt, cache=c) for m, c in zip((stock, fast), caches, strict=True)]
    token = mx.argmax(logits[0][:, -1, :], axis=-1)[:, None]
    logits += [m(token, cache=c) for m, c in zip((stock, fast), caches, strict=True)]
    layers = len(fast.layers)
    assert calls == {"attention": 2 * layers, "swiglu": 2 * layers}
    for want, got in ((logits[0], logits[1]), (logits[2], logits[3])):
        keep = np.asarray(mx.arange(12)[None] >= mx.array(padding)[:, None])[..., None]
        diff = np.abs(np.asarray(want) - np.asarray(got))
        assert float(np.max(np.where(keep[:, -want.shape[1] :], diff, 0.0))) <= 1e-4


# (rows, width): SmolLM2's hidden 576, odd widths, one row.
NORM_SHAPES = [(256, 576), (64, 577), (1, 16), (7, 33), (130, 128)]


@pytest.mark.parametrize("rows,width", NORM_SHAPES)
def test_rms_norm_matches_numpy(ops_lib: Path, rows: int, width: int) -> None:
    x = mx.random.normal((rows, width), key=mx.random.key(rows + width)) * 3
    weight = mx.random.normal((width,), key=mx.random.key(5))
    got = native_ops.rms_norm(x, weight, 1e-5)
    assert got is not None
    xs = np.asarray(x, dtype=np.float64)
    want = xs / np.sqrt((xs * xs).mean(axis=-1, keepdims=True) + 1e-5) * np.asarray(weight)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(mx.fast.rms_norm(x, weight, 1e-5)), rtol=RTOL, atol=1e-5
    )


@pytest.mark.parametrize("traditional", [False, True], ids=["halves", "pairs"])
def test_rope_rows_match_the_rope_module(ops_lib: Path, traditional: bool) -> None:
    """q and k heads rotated in place at per-row positions (negative: clamped to 0, as the
    table does for left padding); the v heads untouched."""
    import mlx.nn as nn
    from mlxcel.daemon.forward.fast_ops import RopeTable

    heads, kv_heads, head_dim, batch, length = 9, 3, 64, 3, 40
    rope = nn.RoPE(head_dim, traditional=traditional, base=100000.0)
    table = RopeTable(rope, head_dim, 4096)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = mx.random.normal((batch, length, width), key=mx.random.key(8))
    offsets = np.array([-5, 0, 3000])
    positions = offsets[:, None] + np.arange(length)[None]
    got = native_ops.rope_rows(qkv, heads + kv_heads, head_dim, positions, table)
    assert got is not None
    split = qkv.reshape(batch, length, -1, head_dim).transpose(0, 2, 1, 3)
    want = rope(split[:, : heads + kv_heads], offset=mx.array(offsets))
    got_heads = got.reshape(batch, length, -1, head_dim).transpose(0, 2, 1, 3)
    keep = np.maximum(positions, 0) == positions  # rows at a clamped position: position 0
    diff = np.abs(np.asarray(got_heads[:, : heads + kv_heads]) - np.asarray(want))
    assert diff.transpose(0, 2, 1, 3)[keep].max() < 1e-5
    at_zero = [rope(split[:1, : heads + kv_heads, i : i + 1], offset=0) for i in range(5)]
    np.testing.assert_allclose(
        np.asarray(got_heads[:1, : heads + kv_heads, :5]),
        np.asarray(mx.concatenate(at_zero, axis=2)),
        atol=1e-5,
    )
    assert mx.array_equal(got_heads[:, heads + kv_heads :], split[:, heads + kv_heads :]).item()


def test_prefill_with_native_norm_and_rope_matches_mlx(
    ops_lib: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A left-padded 96-row prefill of the tiny llama through the native RMSNorm and RoPE
    (counted) gives the fused forward's MLX-op logits."""
    from mlx_lm.models.cache import BatchKVCache
    from mlxcel.daemon.models import load_model

    model = load_model(str(tiny_model_dir)).model
    calls = _count_calls(monkeypatch, "rms_norm", "rope_rows")
    padding = [0, 7, 20]
    prompt = mx.random.randint(1, 200, (3, 32), key=mx.random.key(31))
    outs = []
    for threshold in (0, 1 << 30):  # native at any size, then never
        monkeypatch.setattr(native_ops, "NATIVE_ELEMENTWISE_MIN", threshold)
        caches = [BatchKVCache(padding) for _ in model.layers]
        outs.append(model(prompt, cache=caches))
    layers = len(model.layers)
    assert calls == {"rms_norm": 2 * layers + 1, "rope_rows": layers}
    keep = np.asarray(mx.arange(32)[None] >= mx.array(padding)[:, None])
    diff = np.abs(np.asarray(outs[0]) - np.asarray(outs[1]))[keep]
    assert diff.max() < 1e-4
