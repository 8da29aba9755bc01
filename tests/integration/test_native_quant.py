"""Quantized layers on the native kernels (daemon/models/native/quant_kernels.h): the kernels
against numpy's dequantized matmul on every path this CPU has (AVX-512, AVX2, portable C) and
both the few-row and the tile path; the native decode and chunk steps and the output head on
a tiny quantized llama against stock mlx-lm's quantized forward; formats it does not take are
refused with a reason; SmolLM2 quantized against its float32 copy (greedy tokens)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from blas_process import run_with_fast_blas
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache
from mlxcel.daemon.models import native_decode, native_ops
from mlxcel.daemon.models.blas import cpu_flags
from mlxcel.daemon.models.fast_forward import apply_fast_forward
from mlxcel.daemon.models.tiny import _randomize
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = [
    pytest.mark.integration,
    cpu_only,
    pytest.mark.skipif(native_ops.quant_path() is None, reason="native quantized kernels absent"),
]
IN, OUT = 384, 197  # every group size divides IN; OUT leaves a tail after the column blocks
FORMATS = [(b, g) for b in (4, 8) for g in (32, 64, 128)]
# few-row kernel (1-16: from 4 rows dequantized column strips under float tiles of up to 6 rows
# on AVX-512, 3 on AVX2, so 4/5/8/16 take each tile height), then 16-row blocks or tiles
ROWS = (1, 3, 4, 5, 8, 16, 64, 300)
# Logits of the tiny models (|logit| up to ~5) through 3 layers: float32 summation order alone
# moves them by ~1e-5 (measured 8e-6 .. 2e-5); 1e-4 is the float native step's own tolerance
# (test_native_decode.py). A wrong nibble order or a dropped bias moves them by ~1.
ATOL = 1e-4


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


BOUND = IN * 2.0**-23


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits,group", FORMATS, ids=lambda v: str(v))
def test_kernel_matches_the_dequantized_matmul(bits: int, group: int, rows: int) -> None:
    """This process's path (the best this CPU has); rows past 16 in 16-row blocks (no
    cblas_sgemm in a pytest process)."""
    _, ratio = check_kernel(bits, group, rows)
    assert ratio <= BOUND


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_native_quant as t
    from mlxcel.daemon.models import native_ops
    worst = [0.0, 0.0]
    for bits, group in t.FORMATS:
        for rows in t.ROWS:
            diff, ratio = t.check_kernel(bits, group, rows)
            worst = [max(worst[0], diff), max(worst[1], ratio)]
    print(json.dumps({"available": True, "path": native_ops.quant_path(), "diff": worst[0],
                      "ratio": worst[1]}))
    """
)


def _child(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(TESTS)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _paths() -> list[str]:
    paths = ["portable"]
    if {"avx2", "fma"} <= cpu_flags():
        paths.append("avx2")
    return paths


@pytest.mark.parametrize("path", _paths())
def test_forced_paths_match(path: str) -> None:
    """MLXCEL_GEMM_ISA=avx2 / =portable in a child process: that path runs and matches."""
    out = _child({"MLXCEL_GEMM_ISA": path})
    assert out["path"] == path
    assert out["ratio"] <= BOUND, out


def test_few_row_kernel_without_strips_matches() -> None:
    """MLXCEL_QUANT_STRIP=0: 4-16 rows on the in-register few-row kernel (as before the
    strips) still match."""
    out = _child({"MLXCEL_QUANT_STRIP": "0"})
    assert out["ratio"] <= BOUND, out


@pytest.mark.parametrize("bits,group", [(4, 128), (8, 32)], ids=lambda v: str(v))
def test_strips_of_a_wide_input_match(bits: int, group: int) -> None:
    """An input wider than the strips' stack scratch (4096 floats a column): the heap one."""
    _, ratio = check_kernel(bits, group, 8, shape=(37, 4224))
    assert ratio <= 4224 * 2.0**-23


def test_tile_path_through_cblas_sgemm_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the daemon's BLAS preload (a cblas_sgemm in the process) and the tiles forced,
    rows past 16 go through dequantized tiles and cblas_sgemm."""
    monkeypatch.setenv("MLXCEL_QUANT_BIG", "tiles")
    out = run_with_fast_blas(CHILD, str(TESTS))
    assert out["ratio"] <= BOUND, out


def test_formats_it_does_not_take_are_refused_with_a_reason() -> None:
    assert native_ops.quant_unsupported(4, 64) is None
    assert native_ops.quant_unsupported(8, 128) is None
    assert "3-bit" in (native_ops.quant_unsupported(3, 64) or "")
    assert "group size 16" in (native_ops.quant_unsupported(4, 16) or "")
    assert "mode" in (native_ops.quant_unsupported(4, 32, "mxfp4") or "")
    lib, _ = native_ops._quant_lib()
    x = np.zeros((1, 64), np.float32)
    y = np.zeros((1, 4), np.float32)
    w = np.zeros((4, 6), np.uint32)
    s = np.zeros((4, 4), np.float32)
    f32 = native_ops._F32P
    args = (x.ctypes.data_as(f32), 1, 64, 4, w.ctypes.data_as(native_ops._U32P))
    assert lib.mlxcel_qmatmul(*args, s.ctypes.data_as(f32), s.ctypes.data_as(f32), 3, 16,
                              y.ctypes.data_as(f32)) == -2  # fmt: skip


# ---- the steps on a tiny quantized llama ---------------------------------------------------


def _llama_args(**overrides: Any) -> Any:
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


def quantized_pair(bits: int, group: int, seed: int, **overrides: Any) -> tuple[Any, Any]:
    """(stock mlx-lm quantized model, the same weights with the fast forward and the native
    steps): random weights quantized by nn.quantize, scales and biases cast to float32."""
    args = _llama_args(**overrides)
    mx.random.seed(seed)
    stock = llama.Model(args)
    stock.update(tree_unflatten(list(_randomize(dict(tree_flatten(stock.parameters()))).items())))
    nn.quantize(stock, group_size=group, bits=bits)
    cast = [
        (k, v.astype(mx.float32))
        for k, v in tree_flatten(stock.parameters())
        if k.endswith(("scales", "biases"))
    ]
    stock.update(tree_unflatten(cast))
    native = llama.Model(args)
    nn.quantize(native, group_size=group, bits=bits)
    native.update(stock.parameters())
    mx.eval(stock.parameters(), native.parameters())
    assert apply_fast_forward(native, "cpu")
    return stock, native


def _counted(obj: Any, name: str) -> list[int]:
    real, calls = getattr(obj, name), [0]

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return real(*args)

    setattr(obj, name, counted)
    return calls


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


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128)], ids=lambda v: str(v))
def test_decode_steps_equal_stock_quantized_forward(bits: int, group: int) -> None:
    """32 greedy decode steps of 3 rows: every one through the native step on the quantized
    weights, tokens identical to stock mlx-lm's quantized forward, logits within ATOL."""
    stock, native = quantized_pair(bits, group, seed=3)
    assert native_decode.is_installed(native) and native.model._mlxcel_native.quantized
    steps = _counted(native.model._mlxcel_native, "_step")
    head = _counted(native.lm_head, "_mlxcel_quant")
    rows = [list(range(1, 41)), [5, 6, 7], [9] * 17]
    worst = greedy_both((stock, native), rows, steps=32)
    assert worst <= ATOL
    assert steps[0] == 32
    assert head[0] == 33  # the prefill's head and every step's


def test_tied_quantized_embedding_head_runs_natively() -> None:
    """A tied head: the QuantizedEmbedding's as_linear goes through the native kernels; the
    lookup stays MLX's."""
    stock, native = quantized_pair(4, 64, seed=5, tie_word_embeddings=True)
    embed = native.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding) and "_mlxcel_quant" in embed.__dict__
    head = _counted(embed, "_mlxcel_quant")
    assert greedy_both((stock, native), [[3, 1, 4, 1, 5, 9, 2, 6]], steps=8) <= ATOL
    assert head[0] == 9


def test_a_format_the_kernels_do_not_take_is_not_taken(caplog: pytest.LogCaptureFixture) -> None:
    """3-bit layers: the fast forward (and so the native steps) is not applied, and the log
    says why; the model keeps running on MLX."""
    caplog.set_level(logging.INFO, logger="mlxcel.daemon.models.fast_forward")
    model = llama.Model(_llama_args())
    nn.quantize(model, group_size=64, bits=3)
    assert not apply_fast_forward(model, "cpu")
    assert "a quantized layer it does not take (3-bit, group 64" in caplog.text
    assert not native_decode.is_installed(model)


CHUNK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache
    import test_native_quant as t

    stock, native = t.quantized_pair(int(sys.argv[2]), int(sys.argv[3]), seed=2)
    step = native.model._mlxcel_native
    if step._chunk is None:
        print(json.dumps({"available": False}))
        raise SystemExit
    calls = t._counted(step, "_chunk")
    padding = [0, 5, 17]
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in (stock, native)]
    diffs = []
    keep = (mx.arange(40)[None] >= mx.array(padding)[:, None])[..., None]
    for n, key in ((40, 1), (24, 2)):  # a fresh cache, then a chunk on top of it
        chunk = mx.random.randint(1, 250, (3, n), key=mx.random.key(key))
        outs = [m(chunk, cache=c) for m, c in zip((stock, native), caches)]
        d = mx.abs(outs[0] - outs[1]) * (keep if n == 40 else 1)
        diffs.append(d.max().item())
    token = mx.argmax(outs[0][:, -1, :], axis=-1)[:, None]
    same = True
    for _ in range(8):
        outs = [m(token, cache=c)[:, -1, :] for m, c in zip((stock, native), caches)]
        diffs.append(mx.abs(outs[0] - outs[1]).max().item())
        token = mx.argmax(outs[0], axis=-1)[:, None]
        same &= mx.array_equal(token, mx.argmax(outs[1], axis=-1)[:, None]).item()
    print(json.dumps({"available": True, "calls": calls[0], "diffs": diffs, "same": same}))
    """
)


@pytest.mark.parametrize("mode", ["tiles", "direct"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 128)], ids=lambda v: str(v))
def test_prefill_chunks_through_the_chunk_step_equal_stock(
    bits: int, group: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a process with the daemon's BLAS preload: two prefill chunks through the native
    chunk step on the quantized weights (dequantized tiles into cblas_sgemm, or the few-row
    kernel in 16-row blocks: MLXCEL_QUANT_BIG forces each), then decode steps, give stock
    mlx-lm's quantized forward."""
    monkeypatch.setenv("MLXCEL_QUANT_BIG", mode)
    out = run_with_fast_blas(CHUNK_SCRIPT, str(TESTS), str(bits), str(group))
    assert out["calls"] == 2
    assert max(out["diffs"]) <= ATOL, out["diffs"]
    assert out["same"]


# ---- SmolLM2: quantized against its float32 copy --------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three prime numbers.",
    "Tell me a short story about a robot.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]

GREEDY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_native_quant as t
    print(json.dumps({"available": True, **t.smollm2_greedy(sys.argv[2], int(sys.argv[3]))}))
    """
)


def smollm2_greedy(model_dir: str, tokens: int) -> dict[str, Any]:
    """SmolLM2 (4-bit group 32 from its GGUF, an 8-bit embedding) kept quantized on the native
    steps, and dequantized to float32 on the float native steps: each prompt's greedy tokens,
    as a batch of 8 left-padded rows; where a row first diverges, the float32 path's top-2
    logit gap; the largest logit difference after the (same) prefill."""
    import mlx_lm
    from mlxcel.daemon.models.loader import apply_dtype

    quant, tokenizer = mlx_lm.load(model_dir)
    cast = [  # float16 scales and norms to float32 (exact), as the loader does on the CPU
        (k, v.astype(mx.float32))
        for k, v in tree_flatten(quant.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    ]
    quant.update(tree_unflatten(cast))
    plain, _ = mlx_lm.load(model_dir)
    apply_dtype(plain, "float32", "cpu")  # today's CPU path: every layer float32
    mx.eval(quant.parameters(), plain.parameters())
    assert apply_fast_forward(quant, "cpu") and apply_fast_forward(plain, "cpu")
    assert quant.model._mlxcel_native.quantized and not plain.model._mlxcel_native.quantized
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    longest = max(len(r) for r in rows)
    padding = [longest - len(r) for r in rows]
    inputs = mx.array([[0] * p + r for p, r in zip(padding, rows, strict=True)])
    pair = (plain, quant)
    caches = [[BatchKVCache(padding) for _ in m.layers] for m in pair]
    last = [m(inputs, cache=c)[:, -1, :] for m, c in zip(pair, caches, strict=True)]
    prefill_diff = mx.abs(last[0] - last[1]).max().item()  # the same inputs: the two paths
    out: list[list[list[int]]] = [[], []]
    gaps: list[list[float]] = [[], []]
    for _ in range(tokens):
        for k in range(2):
            top = np.sort(np.asarray(last[k]), axis=-1)
            gaps[k].append((top[:, -1] - top[:, -2]).tolist())
            out[k].append(np.asarray(mx.argmax(last[k], axis=-1)).tolist())
        # each model continues its own tokens (a divergence then shows as it happened)
        last = [
            m(mx.array(out[k][-1])[:, None], cache=c)[:, -1, :]
            for k, (m, c) in enumerate(zip(pair, caches, strict=True))
        ]
    result = {"identical": 0, "divergences": [], "prefill_logit_diff": prefill_diff}
    for i in range(len(PROMPTS)):
        a, b = [t[i] for t in out[0]], [t[i] for t in out[1]]
        if a == b:
            result["identical"] += 1
            continue
        at = next(j for j in range(tokens) if a[j] != b[j])
        result["divergences"].append({"prompt": i, "at": at, "float32_gap": gaps[0][at][i]})
    return result


@pytest.mark.e2e
def test_smollm2_quantized_greedy_tokens_equal_float32(default_model_dir: Path) -> None:
    """8 prompts x 64 tokens: at least 7 identical; a divergence only at a near-tie (the float32
    path's top-2 logits within 0.05 where the two first differ)."""
    out = run_with_fast_blas(GREEDY_SCRIPT, str(TESTS), str(default_model_dir), "64", timeout=900)
    assert out["identical"] >= 7, out
    for d in out["divergences"]:
        assert d["float32_gap"] < 0.05, out


PORTABLE_TU = """
#include <stddef.h>
#include <pthread.h>
static int n_threads(void) { return 1; }
typedef void (*task_fn)(void *, int);
static void parallel_for(int n, task_fn f, void *c) { for (int i = 0; i < n; i++) f(c, i); }
#include "quant_kernels.h"
int main(void) {
  quant_pick(NULL);
  uint32_t w[4] = {0x76543210u, 0xFEDCBA98u, 0x01234567u, 0x89ABCDEFu};
  float s = 0.5f, b = -1.0f, x[32], y = 0.0f, want = 0.0f;
  for (int i = 0; i < 32; i++) {
    x[i] = (float)(i % 5) - 2.0f;
    want += (s * (float)((w[i / 8] >> (4 * (i % 8))) & 15u) + b) * x[i];
  }
  mlxcel_matrix m = {w, &s, &b, NULL, 4, 32};
  if (!quant_format_ok(4, 32)) return 2;
  int code = quant_any_rows(x, 1, 32, 1, &m, NULL, &y);
  return code != 0 || y != want || strcmp(quant_name, "portable") != 0;
}
"""


def test_the_header_builds_and_runs_without_x86_code(tmp_path: Path) -> None:
    """quant_kernels.h with its x86 parts left out (-DMLXCEL_QUANT_X86=0, as on aarch64):
    nothing x86 remains after the preprocessor, it compiles warning-free, and its portable path
    computes a group of 32 4-bit values like the dequantized dot."""
    import shutil

    from mlxcel.daemon.models.blas import native_dir

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "portable.c"
    source.write_text(PORTABLE_TU)
    flags = [cc, "-std=gnu11", "-O2", "-Wall", "-Werror", "-DMLXCEL_QUANT_X86=0"]
    flags += ["-I", str(native_dir()), str(source)]
    pre = subprocess.run([*flags, "-E"], capture_output=True, text=True, check=True).stdout
    assert not any(s in pre for s in ("immintrin", "_mm_", "_mm256", "_mm512", "__builtin_cpu"))
    subprocess.run([*flags, "-o", str(tmp_path / "portable")], check=True)
    assert subprocess.run([str(tmp_path / "portable")]).returncode == 0


def test_the_library_without_x86_code_has_the_portable_quantized_kernels(tmp_path: Path) -> None:
    """fused_ops.c built with -DMLXCEL_OPS_X86=0 (what an aarch64 build compiles; only pool.h's
    spin hint is x86 there): the float ops report "none", the quantized kernels "portable",
    and its mlxcel_qmatmul matches the dequantized matmul."""
    import ctypes
    import shutil

    from mlxcel.daemon.models.blas import native_dir

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path / "libportable.so"
    cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", "-DMLXCEL_OPS_X86=0", "-o", str(lib_path)]
    subprocess.run([*cmd, str(native_dir() / "fused_ops.c"), "-lm", "-ldl"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.mlxcel_ops_path.restype = lib.mlxcel_quant_path.restype = ctypes.c_char_p
    assert lib.mlxcel_ops_path() == b"none" and lib.mlxcel_quant_path() == b"portable"
    w = mx.random.normal((37, 256), key=mx.random.key(3))
    q, scales, biases = mx.quantize(w, group_size=64, bits=4)
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in (q, scales, biases)]
    x = np.asarray(mx.random.normal((5, 256), key=mx.random.key(4)))
    y = np.empty((5, 37), np.float32)
    ptrs = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, *arrays, y)]
    code = lib.mlxcel_qmatmul(
        ptrs[0], ctypes.c_long(5), ctypes.c_long(256), ctypes.c_long(37), ptrs[1], ptrs[2],
        ptrs[3], 4, 64, ptrs[4],
    )  # fmt: skip
    assert code == 0
    deq = np.asarray(mx.dequantize(q, scales, biases, group_size=64, bits=4), np.float64)
    want = x.astype(np.float64) @ deq.T
    assert (np.abs(y - want) / (np.abs(x) @ np.abs(deq).T)).max() <= 256 * 2.0**-23
