"""The native decode step (daemon/forward/native_decode.py, `mlxcel_decode_step` in
native/fused_ops.c) gives the fused MLX forward's logits on the engine's caches, and steps
aside for everything it does not take."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from blas_process import run_with_fast_blas
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from mlxcel.daemon.forward import native_decode, native_ops
from mlxcel.daemon.forward.fast_forward import apply_fast_forward
from mlxcel.daemon.models import load_model
from mlxcel.daemon.models.tiny import _randomize
from native_quant_checks import counted_calls, llama_args
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = [
    cpu_only,
    pytest.mark.skipif(native_ops.path() is None, reason="native ops library not built"),
]
ATOL = 1e-4


def _pair(model_cls: Any, args: Any, seed: int) -> tuple[Any, Any]:
    """(fused MLX forward, fused + native step): the same random weights."""
    mx.random.seed(seed)
    reference = model_cls(args)
    reference.update(
        tree_unflatten(list(_randomize(dict(tree_flatten(reference.parameters()))).items()))
    )
    native = model_cls(args)
    native.update(reference.parameters())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(native_decode.DISABLE_ENV, "1")
        assert apply_fast_forward(reference, "cpu")
    assert apply_fast_forward(native, "cpu")
    assert native_decode.is_installed(native) and not native_decode.is_installed(reference)
    return reference, native


def _close(a: mx.array, b: mx.array) -> None:
    diff = mx.abs(a - b).max().item()
    assert diff <= ATOL, f"max |diff| {diff}"


def _decode_both(pair: tuple[Any, Any], rows: list[list[int]], steps: int) -> list[int]:
    """Left-padded prefill of `rows`, then `steps` greedy decode steps on both models; checks
    the logits every step and returns how many C steps the native model ran."""
    calls = counted_calls(pair[1].model._mlxcel_native, "_step")
    longest = max(len(r) for r in rows)
    padding = [longest - len(r) for r in rows]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    for _ in range(steps):
        _close(*last)
        token = mx.argmax(last[0], axis=-1)[:, None]
        assert mx.array_equal(token, mx.argmax(last[1], axis=-1)[:, None]).item()
        last = [m(token, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    assert caches[0][0]._idx == caches[1][0]._idx
    np.testing.assert_allclose(
        np.array(caches[0][-1].keys[..., : caches[0][-1]._idx, :]),
        np.array(caches[1][-1].keys[..., : caches[1][-1]._idx, :]),
        atol=ATOL,
    )
    return calls


@pytest.mark.parametrize("traditional", [False, True], ids=["rotate-halves", "traditional"])
def test_llama_logits_match_the_fused_forward_across_cache_growth(traditional: bool) -> None:
    """Rows of different lengths (left padding), past the cache's 256-column growth."""
    pair = _pair(llama.Model, llama_args(rope_traditional=traditional), seed=3)
    rows = [list(range(1, 241)), [40, 41, 42], [7] * 30, list(range(100, 199))]
    calls = _decode_both(pair, rows, steps=24)
    assert calls[0] == 24  # every decode step ran natively


def test_a_long_cache_split_over_key_ranges_matches_the_fused_forward() -> None:
    """Past 1,024 cached columns the decode step splits a (row, kv head)'s keys over several
    tasks and merges their partial softmaxes (fused_ops.c `step_splits`): one row alone (two
    kv heads, so three ranges on any thread count), then with a left-padded short row."""
    pair = _pair(llama.Model, llama_args(), seed=4)
    long_row = [1 + (i * 7) % 290 for i in range(1600)]
    assert _decode_both(pair, [long_row], steps=6)[0] == 6
    assert _decode_both(pair, [long_row[:1300], [9, 8, 7]], steps=6)[0] == 6


def test_qwen2_with_biases_and_one_row() -> None:
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256,
    )
    pair = _pair(qwen2.Model, args, seed=6)
    assert "bias" in pair[1].layers[0].self_attn.qkv_proj
    assert _decode_both(pair, [[3, 1, 4, 1, 5, 9, 2, 6]], steps=12)[0] == 12


def test_rows_filtered_and_extended_like_the_engine() -> None:
    """A row leaves (filter shifts the left padding away) and another joins (extend pads the
    shorter side): the step follows the cache's own bookkeeping."""
    pair = _pair(llama.Model, llama_args(), seed=4)
    calls = counted_calls(pair[1].model._mlxcel_native, "_step")
    rows = [[5] * 12, list(range(2, 40)), [9, 8, 7]]
    padding = [38 - len(r) for r in rows]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    joiner = mx.array([[11, 12, 13, 14, 15]])
    for step in range(10):
        _close(*last)
        token = mx.argmax(last[0], axis=-1)[:, None]
        if step == 3:  # the long row finishes
            keep = [0, 2]
            for cache in caches:
                for c in cache:
                    c.filter(keep)
            token = token[mx.array(keep)]
        if step == 6:  # a new row joins after its own prefill
            extra = []
            for m in pair:
                cache = [BatchKVCache([0]) for _ in m.layers]
                extra.append((m(joiner, cache=cache)[:, -1, :], cache))
            for cache, (_, new) in zip(caches, extra, strict=True):
                for c, n in zip(cache, new, strict=True):
                    c.extend(n)
            token = mx.concatenate([token, mx.argmax(extra[0][0], axis=-1)[:, None]])
        last = [m(token, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    _close(*last)
    assert calls[0] == 10


def test_inputs_it_does_not_take_run_the_model_forward() -> None:
    """Prefill-length inputs, more rows than the kernel takes, and plain KVCaches."""
    pair = _pair(llama.Model, llama_args(), seed=5)
    calls = counted_calls(pair[1].model._mlxcel_native, "_step")
    wide = mx.random.randint(1, 300, (native_decode.MAX_ROWS + 1, 6), key=mx.random.key(1))
    caches = [[BatchKVCache([0] * wide.shape[0]) for _ in m.layers] for m in pair]
    _close(*[m(wide, cache=c) for m, c in zip(pair, caches, strict=True)])
    token = wide[:, -1:]
    _close(*[m(token, cache=c) for m, c in zip(pair, caches, strict=True)])
    plain = [make_prompt_cache(m) for m in pair]
    _close(*[m(wide[:1], cache=c) for m, c in zip(pair, plain, strict=True)])
    _close(*[m(wide[:1, -1:], cache=c) for m, c in zip(pair, plain, strict=True)])
    assert calls[0] == 0


def test_switch_and_log_line(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.daemon.forward.native_decode")
    assert native_decode.is_installed(load_model(str(tiny_model_dir)).model)
    assert f"native decode step: active on the {native_ops.path()} path" in caplog.text
    monkeypatch.setenv(native_decode.DISABLE_ENV, "1")
    caplog.clear()
    assert not native_decode.is_installed(load_model(str(tiny_model_dir)).model)
    assert f"not in use (turned off by {native_decode.DISABLE_ENV})" in caplog.text


CHUNK_SCRIPT = TESTS / "child_scripts" / "native_decode_chunk_step.py"


@pytest.mark.parametrize("biases", [False, True], ids=["llama", "llama-with-biases"])
def test_prefill_chunks_through_the_chunk_step_match_the_model_forward(
    tmp_path: Path, biases: bool
) -> None:
    """In a process with the daemon's BLAS setup (the chunk step needs its cblas_sgemm): a
    left-padded prefill on a fresh cache, a second chunk on top of it and a right-padded third
    go through the native chunk step and give the model forward's hidden states, keys, and the
    decode steps after."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    extra = {"attention_bias": True, "mlp_bias": True} if biases else {}
    model_dir = make_tiny_model(tmp_path / "llama", "llama", seed=2, **extra)
    out = run_with_fast_blas(CHUNK_SCRIPT, str(model_dir))
    assert out["calls"] == 5
    assert max(out["diffs"]) <= ATOL, out["diffs"]
    assert out["keys"] <= ATOL
