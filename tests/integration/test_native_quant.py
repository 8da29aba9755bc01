"""Quantized layers on the native kernels (daemon/forward/native/quant_kernels.h): the kernels
against numpy's dequantized matmul on every path this CPU has (AVX-512, AVX2, portable C) and
both the few-row and the tile path; the native decode and chunk steps and the output head on
a tiny quantized llama against stock mlx-lm's quantized forward; formats it does not take are
refused with a reason. The kernel checks and the tiny quantized llama are
tests/native_quant_checks.py's; SmolLM2 quantized against its float32 copy is
tests/e2e/test_native_quant_smollm2.py's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from blas_process import run_with_fast_blas
from mlx_lm.models import llama
from mlxcel.daemon.forward import native_decode, native_ops
from mlxcel.daemon.forward.blas import cpu_flags
from mlxcel.daemon.forward.fast_forward import apply_fast_forward
from native_quant_checks import (
    FORMATS,
    IN,
    OUT,
    ROWS,
    check_kernel,
    counted_calls,
    greedy_both,
    llama_args,
    narrow_kernel_same,
    quantized_pair,
)
from platform_marks import cpu_only
from repo_paths import TESTS

pytestmark = [
    cpu_only,
    pytest.mark.skipif(native_ops.quant_path() is None, reason="native quantized kernels absent"),
]
# Logits of the tiny models (|logit| up to ~5) through 3 layers: float32 summation order alone
# moves them by ~1e-5 (measured 8e-6 .. 2e-5); 1e-4 is the float native step's own tolerance
# (test_native_decode.py). A wrong nibble order or a dropped bias moves them by ~1.
ATOL = 1e-4
BOUND = IN * 2.0**-23
KERNELS = TESTS / "child_scripts" / "native_quant_kernels.py"
CHUNK = TESTS / "child_scripts" / "native_quant_chunk.py"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits,group", FORMATS, ids=lambda v: str(v))
def test_kernel_matches_the_dequantized_matmul(bits: int, group: int, rows: int) -> None:
    """This process's path (the best this CPU has); rows past 16 in 16-row blocks (no
    cblas_sgemm in a pytest process)."""
    _, ratio = check_kernel(bits, group, rows)
    assert ratio <= BOUND


def _child(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(KERNELS)],
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


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits,group", FORMATS, ids=lambda v: str(v))
def test_float16_and_bfloat16_scales_give_the_float32_results_bit_for_bit(
    bits: int, group: int, rows: int
) -> None:
    """Scales and biases stored as float16 or bfloat16 are read as the same float32 values:
    the kernel's result is the float32 scales' one exactly (this process's path)."""
    assert narrow_kernel_same(bits, group, rows)


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("bits", [4, 8])
def test_narrow_scales_of_a_column_past_the_stack_buffer_are_read_one_by_one(
    bits: int, rows: int
) -> None:
    """513 groups a column (more than the kernels convert at once on the stack): the scales
    are converted per group, with the same results."""
    assert narrow_kernel_same(bits, 32, rows, shape=(9, 513 * 32))


@pytest.mark.parametrize("path", _paths())
def test_forced_paths_match(path: str) -> None:
    """MLXCEL_GEMM_ISA=avx2 / =portable in a child process: that path runs and matches, with
    float16 and bfloat16 scales bit for bit as with float32 ones."""
    out = _child({"MLXCEL_GEMM_ISA": path})
    assert out["path"] == path
    assert out["ratio"] <= BOUND, out
    assert out["narrow_same"], out


def test_few_row_kernel_without_strips_matches() -> None:
    """MLXCEL_QUANT_STRIP=0: 4-16 rows on the in-register few-row kernel (as before the
    strips) still match."""
    out = _child({"MLXCEL_QUANT_STRIP": "0"})
    assert out["ratio"] <= BOUND, out


def test_one_row_tiles_without_the_column_blocks_match() -> None:
    """MLXCEL_QUANT_ROW1=0: one row on the older per-column tiles (q512_tile4 / q512_tile on
    AVX-512, as before the 16-column blocks of qrow1_512) still matches."""
    out = _child({"MLXCEL_QUANT_ROW1": "0"})
    assert out["ratio"] <= BOUND, out
    assert out["narrow_same"], out


def test_one_row_on_codes_widened_per_byte_matches() -> None:
    """MLXCEL_QUANT_ROW1W=0: one 4-bit row on AVX-512 widens each byte's codes as before
    (qrow1_pair512) instead of reading whole words (qrow1w_pair512); it still matches."""
    out = _child({"MLXCEL_QUANT_ROW1W": "0"})
    assert out["ratio"] <= BOUND, out
    assert out["narrow_same"], out


@pytest.mark.parametrize(
    "bits,group,width",
    [(4, 32, 288), (4, 32, 320), (4, 32, 352), (4, 64, 320), (8, 32, 352)],
    ids=lambda v: str(v),
)
def test_one_row_whose_width_ends_in_a_partial_block_matches(
    bits: int, group: int, width: int
) -> None:
    """One row whose width is not a multiple of the one-row AVX-512 kernel's 128-value blocks
    (SmolLM2's 576 is 4.5 of them): the last block's codes, scales and x are masked."""
    _, ratio = check_kernel(bits, group, 1, shape=(OUT, width))
    assert ratio <= width * 2.0**-23


@pytest.mark.parametrize("bits,group", [(4, 128), (8, 32)], ids=lambda v: str(v))
def test_strips_of_a_wide_input_match(bits: int, group: int) -> None:
    """An input wider than the strips' stack scratch (4096 floats a column): the heap one."""
    _, ratio = check_kernel(bits, group, 8, shape=(37, 4224))
    assert ratio <= 4224 * 2.0**-23


def test_tile_path_through_cblas_sgemm_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the daemon's BLAS preload (a cblas_sgemm in the process) and the tiles forced,
    rows past 16 go through dequantized tiles and cblas_sgemm."""
    monkeypatch.setenv("MLXCEL_QUANT_BIG", "tiles")
    out = run_with_fast_blas(KERNELS)
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
    assert lib.mlxcel_qmatmul(*args, s.ctypes.data, s.ctypes.data, 3, 16, 0,
                              y.ctypes.data_as(f32)) == -2  # fmt: skip
    assert (
        lib.mlxcel_qmatmul(*args, s.ctypes.data, s.ctypes.data, 4, 64, 3, y.ctypes.data_as(f32))
        == -2
    )  # a scales type it does not know


# ---- the steps on a tiny quantized llama ---------------------------------------------------


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128)], ids=lambda v: str(v))
def test_decode_steps_equal_stock_quantized_forward(bits: int, group: int) -> None:
    """32 greedy decode steps of 3 rows: every one through the native step on the quantized
    weights, tokens identical to stock mlx-lm's quantized forward, logits within ATOL."""
    stock, native = quantized_pair(bits, group, seed=3)
    assert native_decode.is_installed(native) and native.model._mlxcel_native.quantized
    steps = counted_calls(native.model._mlxcel_native, "_step")
    head = counted_calls(native.lm_head, "_mlxcel_quant")
    rows = [list(range(1, 41)), [5, 6, 7], [9] * 17]
    worst = greedy_both((stock, native), rows, steps=32)
    assert worst <= ATOL
    assert steps[0] == 32
    assert head[0] == 33  # the prefill's head and every step's


def test_scales_are_stored_narrow_only_in_a_type_that_holds_them_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def layer(scale: Any = None, factor: float = 1.0) -> nn.QuantizedLinear:
        q = nn.QuantizedLinear(128, 16, group_size=32, bits=4)
        for name in ("scales", "biases"):
            values = getattr(q, name) if scale is None else getattr(q, name).astype(scale)
            setattr(q, name, values.astype(mx.float32) * factor)
        return q

    fp16 = layer(mx.float16)
    before = np.asarray(fp16.scales).copy()
    assert native_ops.narrow_scales(fp16) == "float16" and fp16.scales.dtype == mx.float16
    assert np.array_equal(np.asarray(fp16.scales.astype(mx.float32)), before)
    # past float16's range (x 2^20), still bfloat16 values
    assert native_ops.narrow_scales(layer(mx.bfloat16, 2.0**20)) == "bfloat16"
    arbitrary = layer()  # float32 values neither holds
    assert native_ops.narrow_scales(arbitrary) is None and arbitrary.scales.dtype == mx.float32
    monkeypatch.setenv("MLXCEL_QUANT_F32_SCALES", "1")
    assert native_ops.narrow_scales(layer(mx.float16)) is None


@pytest.mark.parametrize(
    "scales,factor", [(mx.float16, 1.0), (mx.bfloat16, 2.0**-16)], ids=["float16", "bfloat16"]
)
@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_narrow_scales_steps_equal_float32_scales_steps_bit_for_bit(
    scales: Any, factor: float, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's float16 scales (bfloat16 ones where float16 does not hold them): the
    fast forward stores them so, and every native step, the head and a tied embedding's lookup
    (float32 rows) give what the same model with float32 scales (MLXCEL_QUANT_F32_SCALES=1)
    gives, bit for bit."""
    pair = dict(seed=7, scales=scales, factor=factor, tie_word_embeddings=tied)
    stock, narrow = quantized_pair(4, 32, **pair)
    monkeypatch.setenv("MLXCEL_QUANT_F32_SCALES", "1")
    _, wide = quantized_pair(4, 32, **pair)
    assert narrow.layers[0].self_attn.qkv_proj.scales.dtype == scales
    assert wide.layers[0].self_attn.qkv_proj.scales.dtype == mx.float32
    head = narrow.model.embed_tokens if tied else narrow.lm_head
    assert head.scales.dtype == scales
    assert narrow.model.embed_tokens(mx.array([[3, 4]])).dtype == mx.float32
    steps = counted_calls(narrow.model._mlxcel_native, "_step")
    rows = [list(range(1, 30)), [5, 6, 7]]
    assert greedy_both((wide, narrow), rows, steps=12) == 0.0
    assert steps[0] == 12
    assert greedy_both((stock, narrow), rows, steps=4) <= ATOL


def test_tied_quantized_embedding_head_runs_natively() -> None:
    """A tied head: the QuantizedEmbedding's as_linear goes through the native kernels; the
    lookup stays MLX's."""
    stock, native = quantized_pair(4, 64, seed=5, tie_word_embeddings=True)
    embed = native.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding) and "_mlxcel_quant" in embed.__dict__
    head = counted_calls(embed, "_mlxcel_quant")
    assert greedy_both((stock, native), [[3, 1, 4, 1, 5, 9, 2, 6]], steps=8) <= ATOL
    assert head[0] == 9


def test_a_format_the_kernels_do_not_take_is_not_taken(caplog: pytest.LogCaptureFixture) -> None:
    """3-bit layers: the fast forward (and so the native steps) is not applied, and the log
    says why; the model keeps running on MLX."""
    caplog.set_level(logging.INFO, logger="mlxcel.daemon.forward.fast_forward")
    model = llama.Model(llama_args())
    nn.quantize(model, group_size=64, bits=3)
    assert not apply_fast_forward(model, "cpu")
    assert "a quantized layer it does not take (3-bit, group 64" in caplog.text
    assert not native_decode.is_installed(model)


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
    out = run_with_fast_blas(CHUNK, str(bits), str(group))
    assert out["calls"] == 2
    assert max(out["diffs"]) <= ATOL, out["diffs"]
    assert out["same"]


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
  mlxcel_matrix m = {w, &s, &b, NULL, 4, 32, QUANT_F32};
  if (!quant_format_ok(4, 32)) return 2;
  int code = quant_any_rows(x, 1, 32, 1, &m, NULL, &y);
  if (code != 0 || y != want || strcmp(quant_name, "portable") != 0) return 1;
  /* the same scale and bias as float16 (0x3800 = 0.5, 0xBC00 = -1) and bfloat16 */
  uint16_t s16 = 0x3800u, b16 = 0xBC00u, sb = 0x3F00u, bb = 0xBF80u;
  mlxcel_matrix h = {w, &s16, &b16, NULL, 4, 32, QUANT_F16};
  mlxcel_matrix hb = {w, &sb, &bb, NULL, 4, 32, QUANT_BF16};
  float yh = 0.0f, yb = 0.0f;
  if (quant_any_rows(x, 1, 32, 1, &h, NULL, &yh)) return 3;
  if (quant_any_rows(x, 1, 32, 1, &hb, NULL, &yb)) return 3;
  /* every finite float16 (normal, subnormal, zero) converts as the C compiler's does */
  for (unsigned v = 0; v < 65536; v++) {
    float f = quant_f16((uint16_t)v);
    _Float16 c;
    uint16_t bits = (uint16_t)v;
    memcpy(&c, &bits, 2);
    if (((v >> 10) & 31u) != 31u && f != (float)c) return 4;
  }
  return yh != want || yb != want;
}
"""


def test_the_header_builds_and_runs_without_x86_code(tmp_path: Path) -> None:
    """quant_kernels.h with its x86 parts left out (-DMLXCEL_QUANT_X86=0, as on aarch64):
    nothing x86 remains after the preprocessor, it compiles warning-free, and its portable path
    computes a group of 32 4-bit values like the dequantized dot, with float32, float16 and
    bfloat16 scales, and converts every finite float16 as the compiler does."""
    import shutil

    from mlxcel.daemon.forward.blas import native_dir

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


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fused_ops.c built with -DMLXCEL_OPS_X86=0: what an aarch64 build compiles (only pool.h's
    spin hint is x86 there), the float ops and the quantized kernels in plain C."""
    import shutil

    from mlxcel.daemon.forward.blas import native_dir

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path_factory.mktemp("portable") / "libportable.so"
    cmd = [cc, "-O3", "-shared", "-fPIC", "-pthread", "-DMLXCEL_OPS_X86=0", "-o", str(lib_path)]
    subprocess.run([*cmd, str(native_dir() / "fused_ops.c"), "-lm", "-ldl"], check=True)
    return lib_path


def test_the_library_without_x86_code_has_the_portable_float_ops_and_quantized_kernels(
    portable_lib: Path,
) -> None:
    """Both report "portable", and its mlxcel_qmatmul matches the dequantized matmul."""
    import ctypes

    lib = ctypes.CDLL(str(portable_lib))
    lib.mlxcel_ops_path.restype = lib.mlxcel_quant_path.restype = ctypes.c_char_p
    assert lib.mlxcel_ops_path() == b"portable" and lib.mlxcel_quant_path() == b"portable"
    w = mx.random.normal((37, 256), key=mx.random.key(3))
    q, scales, biases = mx.quantize(w, group_size=64, bits=4)
    arrays = [np.ascontiguousarray(np.asarray(a)) for a in (q, scales, biases)]
    x = np.asarray(mx.random.normal((5, 256), key=mx.random.key(4)))
    y = np.empty((5, 37), np.float32)
    ptrs = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, *arrays, y)]
    code = lib.mlxcel_qmatmul(
        ptrs[0], ctypes.c_long(5), ctypes.c_long(256), ctypes.c_long(37), ptrs[1], ptrs[2],
        ptrs[3], 4, 64, 0, ptrs[4],
    )  # fmt: skip
    assert code == 0
    deq = np.asarray(mx.dequantize(q, scales, biases, group_size=64, bits=4), np.float64)
    want = x.astype(np.float64) @ deq.T
    assert (np.abs(y - want) / (np.abs(x) @ np.abs(deq).T)).max() <= 256 * 2.0**-23


def test_the_portable_library_runs_the_prefill_ops_and_the_steps(
    portable_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The portable build as the process's ops library (MLXCEL_OPS_LIB), in child processes:
    attention and SwiGLU match numpy; greedy decode steps of a float32 and a 4-bit tiny llama
    give stock mlx-lm's tokens, on MLX's ops by default and all on its native decode step with
    MLXCEL_PORTABLE_DECODE=1; prefill chunks through its chunk step give the model forward's
    hidden states and keys (with the daemon's BLAS)."""
    from mlxcel.daemon.forward.blas import OPS_LIB_ENV
    from mlxcel.daemon.models.tiny import make_tiny_model
    from native_ops_checks import RTOL

    def child(script: str) -> tuple[dict[str, Any], str]:
        proc = subprocess.run(
            [sys.executable, str(TESTS / "child_scripts" / script)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr

    monkeypatch.setenv(OPS_LIB_ENV, str(portable_lib))
    out, log = child("native_ops_paths.py")
    assert out["path"] == "portable", out
    assert out["attention"] <= RTOL and out["swiglu"] <= RTOL, out
    assert "on the portable path" in log
    # by default the decode steps run MLX's ops there (slower in C: native_ops.py), the tokens
    # unchanged; MLXCEL_PORTABLE_DECODE=1 runs every step on the portable C decode step
    out, _ = child("native_quant_portable_steps.py")
    assert out["path"] == out["quant_path"] == "portable", out
    for name in ("float32", "4-bit"):
        assert out[name]["installed"] and out[name]["steps"] == 0, out
        assert out[name]["diff"] <= ATOL, out
    monkeypatch.setenv(native_ops.PORTABLE_DECODE_ENV, "1")
    out, _ = child("native_quant_portable_steps.py")
    for name in ("float32", "4-bit"):
        assert out[name]["installed"] and out[name]["steps"] == 12, out
        assert out[name]["diff"] <= ATOL, out
    model_dir = make_tiny_model(portable_lib.parent / "llama", "llama", seed=2)
    chunk = run_with_fast_blas(
        TESTS / "child_scripts" / "native_decode_chunk_step.py", str(model_dir)
    )
    assert chunk["calls"] == 5
    assert max(chunk["diffs"]) <= ATOL and chunk["keys"] <= ATOL, chunk
