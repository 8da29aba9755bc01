/* Fused float32 CPU ops for the prefill forward: attention and SwiGLU.
 *
 * MLX's CPU backend runs every elementwise op on one thread with scalar code (its exp costs
 * 20+ ns a float here), so a prefill's softmax and SwiGLU cost more than its matmuls. These
 * run the same arithmetic with AVX-512 or AVX2/FMA on every core, in one pass over the data.
 * Called through ctypes on evaluated arrays (daemon/forward/native_ops.py); MLX-free.
 *
 * exp is MLX's own polynomial (mlx/backend/cpu/simd/math.h: the same coefficients, evaluated
 * with FMAs), so results stay within an ulp or so of the MLX ops they replace.
 *
 * MLXCEL_GEMM_ISA=avx2 forces the AVX2 path (as for the few-row sgemm); MLXCEL_GEMM_THREADS
 * sets the thread count (a pool started at the first call). mlxcel_ops_path() says which path
 * runs ("avx512", "avx2", or "portable": plain C that any compiler builds for any CPU, what an
 * aarch64 build and an x86 CPU without AVX2/FMA run).
 *
 * mlxcel_decode_step() runs a whole decode step of a llama-style model (one new token per row,
 * every layer) in one call: see its section at the end.
 *
 * Build: cc -O3 -shared -fPIC -pthread -o libmlxcel_ops.so fused_ops.c -lm
 */
#define _GNU_SOURCE
/* The vector paths are x86 (AVX-512, AVX2); elsewhere (aarch64) the portable C paths of the
 * float ops and of the quantized kernels are compiled in, and the float ops report "portable".
 * -DMLXCEL_OPS_X86=0 builds that way on x86 too. */
#ifndef MLXCEL_OPS_X86
#if defined(__x86_64__) || defined(__i386__)
#define MLXCEL_OPS_X86 1
#else
#define MLXCEL_OPS_X86 0
#endif
#endif
#ifndef MLXCEL_QUANT_X86
#define MLXCEL_QUANT_X86 MLXCEL_OPS_X86
#endif
#include <dlfcn.h>
#if MLXCEL_OPS_X86
#include <immintrin.h>
#endif
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64
#define HEAD_DIM_MAX 256

#include "glibc_versions.h"
#include "pool.h"
#if MLXCEL_OPS_X86
#include "fewrow_kernels.h"
#endif
#include "quant_kernels.h"

/* ---- exp, the MLX polynomial ----------------------------------------------------------- */

static const float EXP_C[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                               1.0f};

/* a * b + c in one rounding where the CPU has an FMA instruction (FP_FAST_FMAF: aarch64, or x86
 * built with -mfma), else a multiply and an add: without the instruction fmaf is a slow libm
 * routine (an x86 build without -march, which runs this code only in scalar tails and on CPUs
 * without AVX2/FMA). */
#ifdef FP_FAST_FMAF
#define FMA_C(a, b, c) fmaf(a, b, c)
#else
#define FMA_C(a, b, c) ((a) * (b) + (c))
#endif

static inline float exp_scalar(float x) {
  if (x < -88.0f) return 0.0f;
  float s = x * 1.442695f;
  float whole = (s + 12582912.0f) - 12582912.0f;
  float frac = s - whole;
  float p = EXP_C[0];
  for (int i = 1; i < 7; i++) p = FMA_C(p, frac, EXP_C[i]);
  int32_t bits = ((int32_t)whole + 127) << 23;
  float two;
  memcpy(&two, &bits, sizeof two);
  return p * two;
}

#if MLXCEL_OPS_X86
#pragma GCC push_options
/* f16c as quant_kernels.h's AVX-512 helpers (qsum16_512), inlined here; every AVX-512 CPU
 * has it */
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx2,f16c")
/* exp(x) for x <= 0 (softmax and sigmoid only need those). */
static inline __m512 exp512(__m512 x) {
  __m512 s = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(1.442695f));
  __m512 magic = _mm512_set1_ps(12582912.0f);
  __m512 whole = _mm512_sub_ps(_mm512_add_ps(s, magic), magic);
  __m512 frac = _mm512_sub_ps(s, whole);
  __m512 p = _mm512_set1_ps(EXP_C[0]);
  for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, frac, _mm512_set1_ps(EXP_C[i]));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
  __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_GE_OQ), r);
}

static void swiglu_row512(const float *gate, const float *up, float *out, int n) {
  for (int i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
    __m512 g = _mm512_maskz_loadu_ps(m, gate + i), u = _mm512_maskz_loadu_ps(m, up + i);
    __m512 decay = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), one,
                                      decay);
    __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, decay));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
  }
}

/* scores[j] = dot(q, K[j]) for j < n, K rows `ks` floats apart, head_dim d (multiple of 16):
 * 16 keys at a time, each in its own accumulator, summed together by sum16. */
static void scores512(const float *q, const float *k, long ks, int n, int d, float *scores) {
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
      __m512 qc = _mm512_loadu_ps(q + c);
      for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + (long)(j + r) * ks + c), acc[r]);
    }
    _mm512_storeu_ps(scores + j, qsum16_512(acc)); /* quant_kernels.h */
  }
  for (; j < n; j++) {
    const float *kr = k + (long)j * ks;
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(kr + c), acc);
    scores[j] = _mm512_reduce_add_ps(acc);
  }
}

/* The same scores from K transposed (kt: head_dim rows of `kts` floats, keys along a row): 64
 * keys per pass in four accumulators, no horizontal sums. */
static void scores512_t(const float *q, const float *kt, long kts, int n, int d, float *scores) {
  int j = 0;
  for (; j + 64 <= n; j += 64) {
    /* Two sets of accumulators, even and odd dims (d is a multiple of 16): eight FMA chains
     * instead of four, so the FMA latency no longer bounds the loop. */
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int c = 0; c < d; c += 2) {
      const float *row = kt + (long)c * kts + j, *row2 = row + kts;
      __m512 qc = _mm512_set1_ps(q[c]), qd = _mm512_set1_ps(q[c + 1]);
      a0 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(row), a0);
      a1 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(row + 16), a1);
      a2 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(row + 32), a2);
      a3 = _mm512_fmadd_ps(qc, _mm512_loadu_ps(row + 48), a3);
      b0 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(row2), b0);
      b1 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(row2 + 16), b1);
      b2 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(row2 + 32), b2);
      b3 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(row2 + 48), b3);
    }
    _mm512_storeu_ps(scores + j, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(scores + j + 16, _mm512_add_ps(a1, b1));
    _mm512_storeu_ps(scores + j + 32, _mm512_add_ps(a2, b2));
    _mm512_storeu_ps(scores + j + 48, _mm512_add_ps(a3, b3));
  }
  for (; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
    __m512 a0 = _mm512_setzero_ps();
    for (int c = 0; c < d; c++)
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[c]), _mm512_maskz_loadu_ps(m, kt + (long)c * kts + j), a0);
    _mm512_mask_storeu_ps(scores + j, m, a0);
  }
}

/* p[j] = exp(scores[j] - max) in place (masked entries are -inf: 0); returns the sum. */
static float softmax_exp512(float *s, int n, float max) {
  __m512 vmax = _mm512_set1_ps(max), sum = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmax));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(s + j, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

/* out = sum_j p[j] * V[j] / total, head_dim d. */
static void weighted512(const float *p, const float *v, long vs, int n, int d, float total,
                        float *out) {
  /* Even and odd keys into two sets of accumulators (twice the FMA chains), summed at the end. */
  __m512 acc[HEAD_DIM_MAX / 16], acc2[HEAD_DIM_MAX / 16];
  for (int c = 0; c < d / 16; c++) acc[c] = acc2[c] = _mm512_setzero_ps();
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    if (p[j] == 0.0f && p[j + 1] == 0.0f) continue; /* masked keys (left padding) */
    __m512 w = _mm512_set1_ps(p[j]), w2 = _mm512_set1_ps(p[j + 1]);
    const float *vr = v + (long)j * vs, *vr2 = vr + vs;
    for (int c = 0; c < d / 16; c++) {
      acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), acc[c]);
      acc2[c] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(vr2 + 16 * c), acc2[c]);
    }
  }
  if (j < n) {
    __m512 w = _mm512_set1_ps(p[j]);
    const float *vr = v + (long)j * vs;
    for (int c = 0; c < d / 16; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), acc[c]);
  }
  __m512 t = _mm512_set1_ps(total);
  for (int c = 0; c < d / 16; c++)
    _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(_mm512_add_ps(acc[c], acc2[c]), t));
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
static inline __m256 exp256(__m256 x) {
  __m256 s = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(1.442695f));
  __m256 magic = _mm256_set1_ps(12582912.0f);
  __m256 whole = _mm256_sub_ps(_mm256_add_ps(s, magic), magic);
  __m256 frac = _mm256_sub_ps(s, whole);
  __m256 p = _mm256_set1_ps(EXP_C[0]);
  for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, frac, _mm256_set1_ps(EXP_C[i]));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-88.0f), _CMP_GE_OQ));
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static void swiglu_row256(const float *gate, const float *up, float *out, int n) {
  int i = 0;
  __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  __m256 sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
    __m256 decay = exp256(_mm256_or_ps(g, sign)); /* exp(-|g|) */
    __m256 num = _mm256_blendv_ps(one, decay, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, decay));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
  }
  for (; i < n; i++) {
    float g = gate[i], decay = exp_scalar(-fabsf(g));
    float sig = (g < 0.0f ? decay : 1.0f) / (1.0f + decay);
    out[i] = g * sig * up[i];
  }
}

static void scores256(const float *q, const float *k, long ks, int n, int d, float *scores) {
  for (int j = 0; j < n; j++) {
    const float *kr = k + (long)j * ks;
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(kr + c), acc);
    scores[j] = hsum256(acc);
  }
}

static float softmax_exp256(float *s, int n, float max) {
  __m256 vmax = _mm256_set1_ps(max), sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum256(sum);
  for (; j < n; j++) {
    s[j] = exp_scalar(s[j] - max);
    total += s[j];
  }
  return total;
}

static void weighted256(const float *p, const float *v, long vs, int n, int d, float total,
                        float *out) {
  __m256 acc[HEAD_DIM_MAX / 8];
  for (int c = 0; c < d / 8; c++) acc[c] = _mm256_setzero_ps();
  for (int j = 0; j < n; j++) {
    if (p[j] == 0.0f) continue;
    __m256 w = _mm256_set1_ps(p[j]);
    const float *vr = v + (long)j * vs;
    for (int c = 0; c < d / 8; c++) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), acc[c]);
  }
  __m256 t = _mm256_set1_ps(total);
  for (int c = 0; c < d / 8; c++) _mm256_storeu_ps(out + 8 * c, _mm256_div_ps(acc[c], t));
}

/* AVX2's tiled attention kernels (attn_group_tiled): R (query row, head) pairs at once, R up
 * to TILE_ROWS, so 2R accumulators and the loads fit the 16 registers. Scores from K
 * transposed, 16 keys per pass; the weighted sum 16 dims per pass (p re-read from L1). */
#define TILE_ROWS 6

static inline __m256i lanes_below(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void scores_t_rows256(const float *q, const int R,
                                                                   const float *kt, long kts,
                                                                   int n, int d, float *scores,
                                                                   long stride) {
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 a[TILE_ROWS][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
      const float *row = kt + (long)c * kts + j;
      __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);
      for (int r = 0; r < R; r++) {
        __m256 qc = _mm256_broadcast_ss(q + r * d + c);
        a[r][0] = _mm256_fmadd_ps(qc, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qc, k1, a[r][1]);
      }
    }
    for (int r = 0; r < R; r++) {
      _mm256_storeu_ps(scores + r * stride + j, a[r][0]);
      _mm256_storeu_ps(scores + r * stride + j + 8, a[r][1]);
    }
  }
  for (; j < n; j += 8) {
    __m256i m = lanes_below(n - j);
    __m256 a[TILE_ROWS];
    for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
      __m256 kc = _mm256_maskload_ps(kt + (long)c * kts + j, m);
      for (int r = 0; r < R; r++) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * d + c), kc, a[r]);
    }
    for (int r = 0; r < R; r++) _mm256_maskstore_ps(scores + r * stride + j, m, a[r]);
  }
}

/* outs[r] = sum_j p[r * stride + j] * V[j] (no division: the caller's running sums do it). */
static inline __attribute__((always_inline)) void weighted_rows256(const float *p, long stride,
                                                                   const int R, const float *v,
                                                                   long vs, int n, int d,
                                                                   float *const *outs) {
  for (int c0 = 0; c0 < d; c0 += 16) {
    __m256 a[TILE_ROWS][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
      const float *vr = v + (long)j * vs + c0;
      __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
      for (int r = 0; r < R; r++) {
        __m256 w = _mm256_broadcast_ss(p + r * stride + j);
        a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
      }
    }
    for (int r = 0; r < R; r++) {
      _mm256_storeu_ps(outs[r] + c0, a[r][0]);
      _mm256_storeu_ps(outs[r] + c0 + 8, a[r][1]);
    }
  }
}

#define ROWS256_CASES(F, ...)              \
  switch (R) {                             \
    case 1: F(__VA_ARGS__, 1); break;      \
    case 2: F(__VA_ARGS__, 2); break;      \
    case 3: F(__VA_ARGS__, 3); break;      \
    case 4: F(__VA_ARGS__, 4); break;      \
    case 5: F(__VA_ARGS__, 5); break;      \
    default: F(__VA_ARGS__, 6); break;     \
  }
#define SCORES256_R(q, kt, kts, n, d, scores, stride, RR) \
  scores_t_rows256(q, RR, kt, kts, n, d, scores, stride)
#define WEIGHTED256_R(p, stride, v, vs, n, d, outs, RR) \
  weighted_rows256(p, stride, RR, v, vs, n, d, outs)

static void scores256_tile(const float *q, int R, const float *kt, long kts, int n, int d,
                           float *scores, long stride) {
  ROWS256_CASES(SCORES256_R, q, kt, kts, n, d, scores, stride)
}

static void weighted256_tile(const float *p, long stride, int R, const float *v, long vs, int n,
                             int d, float *const *outs) {
  ROWS256_CASES(WEIGHTED256_R, p, stride, v, vs, n, d, outs)
}

/* One row's scores from K transposed (attn_row, when the keys were transposed). */
static void scores256_t(const float *q, const float *kt, long kts, int n, int d, float *scores) {
  scores_t_rows256(q, 1, kt, kts, n, d, scores, 0);
}
#pragma GCC pop_options
#endif /* MLXCEL_OPS_X86 */

/* ---- dispatch --------------------------------------------------------------------------- */

/* ---- portable C: any CPU (aarch64 Linux, x86 without AVX2/FMA) ----------------------------
 * The same arithmetic as the vector paths, written so that a compiler vectorizes it without
 * -ffast-math: dot products in 8 independent partial sums. */

static inline float dot_c(const float *a, const float *b, int d) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int c = 0;
  for (; c + 8 <= d; c += 8)
    for (int i = 0; i < 8; i++) acc[i] = FMA_C(a[c + i], b[c + i], acc[i]);
  for (; c < d; c++) acc[c % 8] = FMA_C(a[c], b[c], acc[c % 8]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void swiglu_row_c(const float *gate, const float *up, float *out, int n) {
  for (int i = 0; i < n; i++) {
    float g = gate[i], decay = exp_scalar(-fabsf(g)); /* sigmoid without overflow */
    out[i] = g * ((g < 0.0f ? decay : 1.0f) / (1.0f + decay)) * up[i];
  }
}

static void scores_c(const float *q, const float *k, long ks, int n, int d, float *scores) {
  for (int j = 0; j < n; j++) scores[j] = dot_c(q, k + (long)j * ks, d);
}

/* The same scores from K transposed (kt: head_dim rows of `kts` floats, keys along a row): a
 * row of keys at a time, scaled by q[c] and summed into the scores. */
static void scores_t_c(const float *q, const float *kt, long kts, int n, int d, float *scores) {
  for (int j = 0; j < n; j++) scores[j] = 0.0f;
  for (int c = 0; c < d; c++) {
    const float *row = kt + (long)c * kts;
    for (int j = 0; j < n; j++) scores[j] = FMA_C(q[c], row[j], scores[j]);
  }
}

/* p[j] = exp(scores[j] - max) in place (masked entries are -inf: 0); returns the sum. */
static float softmax_exp_c(float *s, int n, float max) {
  float sum = 0.0f;
  for (int j = 0; j < n; j++) {
    s[j] = exp_scalar(s[j] - max);
    sum += s[j];
  }
  return sum;
}

/* out = sum_j p[j] * V[j] / total, head_dim d. */
static void weighted_c(const float *p, const float *v, long vs, int n, int d, float total,
                       float *out) {
  float acc[HEAD_DIM_MAX];
  for (int c = 0; c < d; c++) acc[c] = 0.0f;
  for (int j = 0; j < n; j++) {
    if (p[j] == 0.0f) continue; /* masked keys (left padding) */
    const float *vr = v + (long)j * vs;
    for (int c = 0; c < d; c++) acc[c] = FMA_C(p[j], vr[c], acc[c]);
  }
  for (int c = 0; c < d; c++) out[c] = acc[c] / total;
}

typedef struct {
  void (*swiglu_row)(const float *, const float *, float *, int);
  void (*scores)(const float *, const float *, long, int, int, float *);
  void (*scores_t)(const float *, const float *, long, int, int, float *); /* or NULL */
  float (*softmax_exp)(float *, int, float);
  void (*weighted)(const float *, const float *, long, int, int, float, float *);
  const char *name;
  /* attn_group_tiled's kernels (or NULL): scores of R pairs from K transposed, and their
   * undivided weighted sums; `grouped`: attn_group's AVX-512 kernels exist. */
  void (*tile_scores)(const float *, int, const float *, long, int, int, float *, long);
  void (*tile_weighted)(const float *, long, int, const float *, long, int, int, float *const *);
  int grouped;
} isa_t;

#if MLXCEL_OPS_X86
static void scores_t_tile(const float *q, int R, const float *kt, long kts, int n, int d,
                          float *scores, long stride);
static void weighted_tile(const float *p, long stride, int R, const float *v, long vs, int n,
                          int d, float *const *outs);
#endif

static isa_t isa;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;
#if MLXCEL_OPS_X86
static part_fn gemm_dot; /* the few-row kernel (fewrow_kernels.h) for the decode step */
#endif

#define ISA_PORTABLE \
  ((isa_t){swiglu_row_c, scores_c, scores_t_c, softmax_exp_c, weighted_c, "portable", NULL, NULL, 0})

static void pick_isa(void) {
  const char *force = getenv("MLXCEL_GEMM_ISA");
  /* "portable" forces the quantized kernels' plain C path; the float ops then run AVX2. */
  int want512 = !(force && (strcmp(force, "avx2") == 0 || strcmp(force, "portable") == 0));
  quant_pick(force);
#if MLXCEL_OPS_X86
  part_fn axpy_unused;
  fewrow_pick(want512, &gemm_dot, &axpy_unused);
  __builtin_cpu_init();
  if (want512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma")) {
    isa = (isa_t){swiglu_row512, scores512,     scores512_t,   softmax_exp512,   weighted512,
                  "avx512",      scores_t_tile, weighted_tile, 1};
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    isa = (isa_t){swiglu_row256, scores256,      scores256_t,      softmax_exp256, weighted256,
                  "avx2",        scores256_tile, weighted256_tile, 0};
  } else {
    isa = ISA_PORTABLE;
  }
#else
  (void)want512;
  isa = ISA_PORTABLE;
#endif
}

const char *mlxcel_ops_path(void) {
  pthread_once(&isa_once, pick_isa);
  return isa.name;
}

/* The ABI version of this library (the layout of mlxcel_layer, the exported functions'
 * signatures): forward/blas.py refuses a library whose version is not its OPS_ABI, by name.
 * Bump both on any change. */
#define MLXCEL_OPS_ABI 5 /* 5: mlxcel_layer gains gemma2's post norms, soft cap and GELU; 4: mlxcel_matrix gains half */
int mlxcel_ops_abi(void) { return MLXCEL_OPS_ABI; }

/* ---- SwiGLU: out[r][i] = silu(gate_up[r][i]) * gate_up[r][hidden + i] -------------------- */

typedef struct {
  const float *in;
  float *out;
  long rows, hidden, per_task;
  int gelu; /* gemma's gelu_approx(gate) * up instead (gated_row) */
} swiglu_ctx;

/* gemma's MLP activation, as mlx.nn.gelu_approx(gate) * up:
 * 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) * up. */
static void gelu_row(const float *gate, const float *up, float *out, int n) {
  for (int i = 0; i < n; i++) {
    float x = gate[i];
    out[i] = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * (x * x * x)))) * up[i];
  }
}

/* One row of a gated MLP's activation: SwiGLU, or gemma's GELU with `gelu`. */
static void gated_row(const float *gate, const float *up, float *out, int n, int gelu) {
  if (gelu) gelu_row(gate, up, out, n);
  else isa.swiglu_row(gate, up, out, n);
}

static void swiglu_task(void *arg, int task) {
  swiglu_ctx *c = (swiglu_ctx *)arg;
  long r1 = (task + 1) * c->per_task < c->rows ? (task + 1) * c->per_task : c->rows;
  for (long r = task * c->per_task; r < r1; r++) {
    const float *row = c->in + r * 2 * c->hidden;
    gated_row(row, row + c->hidden, c->out + r * c->hidden, (int)c->hidden, c->gelu);
  }
}

/* Tasks for a row-wise op over `rows` rows: one (run on the caller) for a few rows, as a
 * verification's short chunk has: waking the pool costs more than a few rows' work (a chunk
 * step makes ~6 such calls a layer), else up to 64. */
#define SERIAL_ROWS 16
static long row_tasks(long rows) { return rows <= SERIAL_ROWS ? (rows > 0) : (rows < 64 ? rows : 64); }

/* A gated MLP's activation over `rows` rows of [gate | up], on the pool. */
static void gated_rows(const float *gate_up, float *out, long rows, long hidden, int gelu) {
  long tasks = row_tasks(rows);
  if (tasks < 1) return;
  swiglu_ctx c = {gate_up, out, rows, hidden, (rows + tasks - 1) / tasks, gelu};
  parallel_for((int)((rows + c.per_task - 1) / c.per_task), swiglu_task, &c);
}

/* Returns 0 (-1: no path for this CPU, which the portable one rules out). */
int mlxcel_swiglu(const float *gate_up, float *out, long rows, long hidden) {
  pthread_once(&isa_once, pick_isa);
  if (!isa.swiglu_row) return -1;
  gated_rows(gate_up, out, rows, hidden, 0);
  return 0;
}

/* ---- attention -------------------------------------------------------------------------
 * out[b][h][i] = softmax_j(scale * q[b][h][i] . k[b][h/rep][j], allowed j) @ v[b][h/rep]
 * q, k, v: element strides (batch, head, position), head_dim contiguous. out: contiguous
 * (batch, heads, length, head_dim). Allowed keys: all, or causal (j <= i + keys - length),
 * and, when `mask` is given, mask[b * mask_bs + i * mask_is + j] != 0. A query with no allowed
 * key gets zeros (only padding positions have none; nothing reads them).
 */
typedef struct {
  const float *q, *k, *v;
  const uint8_t *mask;
  float *out;
  long qs[3], ks[3], vs[3], mask_bs, mask_is;
  int batch, heads, kv_heads, length, keys, head_dim, causal, q_block;
  float scale;
  int blocks_per_head;
  long os[3];        /* output element strides: batch, head, query row (head_dim contiguous) */
  const int *first;  /* per batch row: keys before it are masked (NULL: none) */
  /* Keys already transposed (NULL: each task transposes its own): per (batch row, kv head),
   * `kt_pair` floats apart, head_dim rows of `kt_stride` floats, key 0 first. */
  const float *kt_all;
  long kt_stride, kt_pair;
  float softcap; /* gemma2: scores as tanh(s / softcap) * softcap before the mask (0: none) */
} attn_ctx;

/* How many keys from the start query row i may see: causal, and a mask's last allowed key
 * (a causal mask with left padding allows nothing after the diagonal: no scores there). */
static int allowed_keys(const attn_ctx *c, const uint8_t *m, int i) {
  int n = c->causal ? i + c->keys - c->length + 1 : c->keys;
  if (n > c->keys) n = c->keys;
  if (m)
    while (n > 0 && !m[n - 1]) n--;
  return n;
}

/* max(s[0..n)), eight running maxima (the compiler vectorises it). */
static float max_of(const float *s, int n) {
  float m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                -INFINITY};
  int j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; l++) m[l] = s[j + l] > m[l] ? s[j + l] : m[l];
  float out = -INFINITY;
  for (int l = 0; l < 8; l++) out = m[l] > out ? m[l] : out;
  for (; j < n; j++) out = s[j] > out ? s[j] : out;
  return out;
}

/* gemma2's soft cap on n scores, as its attention computes it: tanh(s / cap) * cap (0: none). */
static void soft_cap(float *s, int n, float cap) {
  if (cap == 0.0f) return;
  for (int j = 0; j < n; j++) s[j] = tanhf(s[j] / cap) * cap;
}

/* Masked keys' scores to -inf; the max of the others (-inf when there is none). */
static float mask_and_max(float *sc, const uint8_t *m, int n) {
  if (!m) return max_of(sc, n);
  float max = -INFINITY;
  for (int j = 0; j < n; j++) {
    if (!m[j]) sc[j] = -INFINITY;
    else if (sc[j] > max) max = sc[j];
  }
  return max;
}

/* One query row of one head: scores (from K, or K transposed when kt), mask, softmax, sum. */
static void attn_row(const attn_ctx *c, int b, int h, int i, const float *k, const float *kt,
                     long kts, const float *v, float *scores, int f) {
  int d = c->head_dim;
  float qrow[HEAD_DIM_MAX] __attribute__((aligned(64)));
  const float *q = c->q + b * c->qs[0] + h * c->qs[1] + (long)i * c->qs[2];
  for (int t = 0; t < d; t++) qrow[t] = q[t] * c->scale; /* as (queries * scale) @ keys^T */
  const uint8_t *m = c->mask ? c->mask + b * c->mask_bs + (long)i * c->mask_is : NULL;
  int n = allowed_keys(c, m, i) - f; /* k, kt and v start at key f */
  if (m) m += f;
  float *out = c->out + b * c->os[0] + h * c->os[1] + (long)i * c->os[2];
  if (n <= 0) {
    memset(out, 0, sizeof(float) * d);
    return;
  }
  if (kt) isa.scores_t(qrow, kt, kts, n, d, scores);
  else isa.scores(qrow, k, c->ks[2], n, d, scores);
  soft_cap(scores, n, c->softcap);
  float max = mask_and_max(scores, m, n);
  if (max == -INFINITY) {
    memset(out, 0, sizeof(float) * d);
    return;
  }
  float total = isa.softmax_exp(scores, n, max);
  isa.weighted(scores, v, c->vs[2], n, d, total, out);
}

/* ---- attention for the query heads that share a kv head, together (AVX-512) ----------------
 * Prefill attention reads every key and value once per query row and head; from L2 that costs
 * more than the arithmetic. The heads that share a kv head (GQA) see the same keys with the
 * same mask, so up to 4 of them go through each key block together: each block is loaded once
 * for all of them. Head dims 64 and 128. */
#if MLXCEL_OPS_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx2")

#define GROUP_MAX 4

static inline __attribute__((always_inline)) void scores_t_rows(const float *q, const int R,
                                                                const float *kt, long kts, int n,
                                                                const int d, float *scores,
                                                                long stride) {
  int j = 0;
  for (; j + 64 <= n; j += 64) {
    __m512 a[TILE_ROWS][4];
    for (int r = 0; r < R; r++)
      for (int v = 0; v < 4; v++) a[r][v] = _mm512_setzero_ps();
    for (int c = 0; c < d; c++) {
      const float *row = kt + (long)c * kts + j;
      __m512 k0 = _mm512_loadu_ps(row), k1 = _mm512_loadu_ps(row + 16);
      __m512 k2 = _mm512_loadu_ps(row + 32), k3 = _mm512_loadu_ps(row + 48);
      for (int r = 0; r < R; r++) {
        __m512 qc = _mm512_set1_ps(q[r * d + c]);
        a[r][0] = _mm512_fmadd_ps(qc, k0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(qc, k1, a[r][1]);
        a[r][2] = _mm512_fmadd_ps(qc, k2, a[r][2]);
        a[r][3] = _mm512_fmadd_ps(qc, k3, a[r][3]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int v = 0; v < 4; v++) _mm512_storeu_ps(scores + r * stride + j + 16 * v, a[r][v]);
  }
  for (; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
    __m512 a[TILE_ROWS];
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    for (int c = 0; c < d; c++) {
      __m512 kc = _mm512_maskz_loadu_ps(m, kt + (long)c * kts + j);
      for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + c]), kc, a[r]);
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(scores + r * stride + j, m, a[r]);
  }
}

static inline __attribute__((always_inline)) void weighted_rows(const float *p, long stride,
                                                                const int R, const float *v,
                                                                long vs, int n, const int d,
                                                                const float *totals,
                                                                float *const *outs,
                                                                const int skip) {
  __m512 acc[TILE_ROWS][HEAD_DIM_MAX / 16 < 8 ? HEAD_DIM_MAX / 16 : 8];
  const int dv = d / 16;
  for (int r = 0; r < R; r++)
    for (int c = 0; c < dv; c++) acc[r][c] = _mm512_setzero_ps();
  for (int j = 0; j < n; j++) {
    __m512 w[TILE_ROWS];
    int any = !skip;
    for (int r = 0; r < R; r++) {
      float pr = p[r * stride + j];
      if (skip) any |= pr != 0.0f;
      w[r] = _mm512_set1_ps(pr);
    }
    if (!any) continue; /* masked for every head (left padding); `skip` only */
    const float *vr = v + (long)j * vs;
    for (int c = 0; c < dv; c++) {
      __m512 vv = _mm512_loadu_ps(vr + 16 * c);
      for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(w[r], vv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++) {
    __m512 t = _mm512_set1_ps(totals[r]);
    for (int c = 0; c < dv; c++) _mm512_storeu_ps(outs[r] + 16 * c, _mm512_div_ps(acc[r][c], t));
  }
}

/* The R and d combinations as constants, so the accumulators stay in registers. */
#define GROUP_CASES(F, ...)                                                                   \
  switch (R * 1000 + d) {                                                                     \
    case 1064: F(__VA_ARGS__, 1, 64); break;                                                  \
    case 2064: F(__VA_ARGS__, 2, 64); break;                                                  \
    case 3064: F(__VA_ARGS__, 3, 64); break;                                                  \
    case 4064: F(__VA_ARGS__, 4, 64); break;                                                  \
    case 1128: F(__VA_ARGS__, 1, 128); break;                                                 \
    case 2128: F(__VA_ARGS__, 2, 128); break;                                                 \
    case 3128: F(__VA_ARGS__, 3, 128); break;                                                 \
    default: F(__VA_ARGS__, 4, 128); break;                                                   \
  }
#define SCORES_RC(q, kt, kts, n, scores, stride, RR, DD) \
  scores_t_rows(q, RR, kt, kts, n, DD, scores, stride)
#define WEIGHTED_RC(p, stride, v, vs, n, totals, outs, RR, DD) \
  weighted_rows(p, stride, RR, v, vs, n, DD, totals, outs, 1)
#define WEIGHTED_ALL(p, stride, v, vs, n, totals, outs, RR, DD) \
  weighted_rows(p, stride, RR, v, vs, n, DD, totals, outs, 0)

/* attn_group_tiled's combinations: up to TILE_ROWS pairs at head_dim 64, 3 at 128 (the
 * weighted sum keeps R * d / 16 accumulators: 24 of the 32 registers). */
#define TILE_CASES(F, ...)                                                                    \
  switch (R * 1000 + d) {                                                                     \
    case 1064: F(__VA_ARGS__, 1, 64); break;                                                  \
    case 2064: F(__VA_ARGS__, 2, 64); break;                                                  \
    case 3064: F(__VA_ARGS__, 3, 64); break;                                                  \
    case 4064: F(__VA_ARGS__, 4, 64); break;                                                  \
    case 5064: F(__VA_ARGS__, 5, 64); break;                                                  \
    case 6064: F(__VA_ARGS__, 6, 64); break;                                                  \
    case 1128: F(__VA_ARGS__, 1, 128); break;                                                 \
    case 2128: F(__VA_ARGS__, 2, 128); break;                                                 \
    default: F(__VA_ARGS__, 3, 128); break;                                                   \
  }

static void scores_t_tile(const float *q, int R, const float *kt, long kts, int n, int d,
                          float *scores, long stride) {
  TILE_CASES(SCORES_RC, q, kt, kts, n, scores, stride)
}

static void weighted_tile(const float *p, long stride, int R, const float *v, long vs, int n,
                          int d, float *const *outs) {
  static const float ones[TILE_ROWS] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  TILE_CASES(WEIGHTED_ALL, p, stride, v, vs, n, ones, outs)
}

static void scores_t_group(const float *q, int R, const float *kt, long kts, int n, int d,
                           float *scores, long stride) {
  GROUP_CASES(SCORES_RC, q, kt, kts, n, scores, stride)
}

static void weighted_group(const float *p, long stride, int R, const float *v, long vs, int n,
                           int d, const float *totals, float *const *outs) {
  GROUP_CASES(WEIGHTED_RC, p, stride, v, vs, n, totals, outs)
}
#pragma GCC pop_options
#else /* never called: attn_group runs only where isa.grouped (AVX-512) */
#define GROUP_MAX 4
static void scores_t_group(const float *q, int R, const float *kt, long kts, int n, int d,
                           float *scores, long stride) {
  (void)q, (void)R, (void)kt, (void)kts, (void)n, (void)d, (void)scores, (void)stride;
}
static void weighted_group(const float *p, long stride, int R, const float *v, long vs, int n,
                           int d, const float *totals, float *const *outs) {
  (void)p, (void)stride, (void)R, (void)v, (void)vs, (void)n, (void)d, (void)totals, (void)outs;
}
#define TILE_ROWS 6
#endif /* MLXCEL_OPS_X86 */

/* Whether attn_group takes these heads: AVX-512 (the transposed keys exist only there), up to
 * GROUP_MAX heads per kv head, head_dim 64 or 128 (and 4 x 128 only). */
static int group_takes(int rep, int d) {
  return rep >= 1 && rep <= GROUP_MAX && (d == 64 || d == 128);
}

/* Query row i of the `rep` heads sharing kv head kvh, from the transposed keys. */
static void attn_group(const attn_ctx *c, int b, int kvh, int i, int rep, const float *kt,
                       long kts, const float *v, float *scores, long stride, int f) {
  int d = c->head_dim;
  const uint8_t *m = c->mask ? c->mask + b * c->mask_bs + (long)i * c->mask_is : NULL;
  int n = allowed_keys(c, m, i) - f; /* kt and v start at key f */
  if (m) m += f;
  float *outs[GROUP_MAX];
  for (int r = 0; r < rep; r++)
    outs[r] = c->out + b * c->os[0] + (kvh * rep + r) * c->os[1] + (long)i * c->os[2];
  if (n <= 0) {
    for (int r = 0; r < rep; r++) memset(outs[r], 0, sizeof(float) * d);
    return;
  }
  float qs[GROUP_MAX * HEAD_DIM_MAX] __attribute__((aligned(64)));
  for (int r = 0; r < rep; r++) {
    const float *q = c->q + b * c->qs[0] + (kvh * rep + r) * c->qs[1] + (long)i * c->qs[2];
    for (int t = 0; t < d; t++) qs[r * d + t] = q[t] * c->scale; /* as (queries * scale) @ k^T */
  }
  scores_t_group(qs, rep, kt, kts, n, d, scores, stride);
  float totals[GROUP_MAX];
  for (int r = 0; r < rep; r++) {
    float *sc = scores + r * stride;
    soft_cap(sc, n, c->softcap);
    float max = mask_and_max(sc, m, n);
    if (max == -INFINITY) { /* no key: zeros, as attn_row */
      memset(sc, 0, sizeof(float) * n);
      totals[r] = 1.0f;
    } else {
      totals[r] = isa.softmax_exp(sc, n, max);
    }
  }
  weighted_group(scores, stride, rep, v, c->vs[2], n, d, totals, outs);
}

/* The task's query rows [i0, i1) of the `rep` heads sharing kv head kvh, flash-style: the
 * keys go by in tiles of ATTN_TILE, and every query row takes each tile while it is in L1/L2,
 * so the keys and values are read from memory once per task, not once per query row (over a
 * long cache, streaming all of K and V for each row made attention memory-bound: an agent's
 * turn of 200 tokens over 6k cached ones spent 85 % of its prefill there). Softmax online: a
 * running max and sum per row and head, the output rescaled when the max grows. Returns 0,
 * -3 out of memory (the caller takes the row-at-a-time path). */
#define ATTN_TILE 512

/* Pairs per kernel call on this CPU at head_dim d; 0: the tiled path does not take d. */
static int tile_group(int d) {
  if (!isa.tile_scores) return 0;
  if (!isa.grouped) return TILE_ROWS; /* AVX2: accumulators independent of d */
  return d == 64 ? TILE_ROWS : d == 128 ? 3 : 0;
}

static int attn_group_tiled(const attn_ctx *c, int b, int kvh, int i0, int i1, int rep,
                            const float *kt, long kts, const float *v, int f) {
  int d = c->head_dim, rows = i1 - i0, group = tile_group(d);
  long pairs = (long)rows * rep; /* (query row, head) pairs, row-major: one kv head's */
  float *buf = malloc(sizeof(float) * (2 * pairs * d + 2 * pairs + TILE_ROWS * (ATTN_TILE + d)));
  int *ns = malloc(sizeof(int) * rows);
  if (!buf || !ns) {
    free(buf);
    free(ns);
    return -3;
  }
  float *acc = buf, *qs = acc + pairs * d, *top = qs + pairs * d, *sum = top + pairs;
  float *sc = sum + pairs, *part = sc + TILE_ROWS * ATTN_TILE;
  float *parts[TILE_ROWS];
  for (int r = 0; r < TILE_ROWS; r++) parts[r] = part + r * d;
  int n_max = 0;
  for (int i = i0; i < i1; i++) {
    const uint8_t *m = c->mask ? c->mask + b * c->mask_bs + (long)i * c->mask_is : NULL;
    ns[i - i0] = allowed_keys(c, m, i) - f;
    if (ns[i - i0] > n_max) n_max = ns[i - i0];
    for (int r = 0; r < rep; r++) {
      const float *q = c->q + b * c->qs[0] + (kvh * rep + r) * c->qs[1] + (long)i * c->qs[2];
      float *qd = qs + ((long)(i - i0) * rep + r) * d;
      for (int t = 0; t < d; t++) qd[t] = q[t] * c->scale; /* as (queries * scale) @ k^T */
    }
  }
  memset(acc, 0, sizeof(float) * pairs * d);
  for (long p = 0; p < pairs; p++) top[p] = -INFINITY, sum[p] = 0.0f;
  for (int j0 = 0; j0 < n_max; j0 += ATTN_TILE) {
    for (long p0 = 0; p0 < pairs; p0 += group) {
      int g = pairs - p0 < group ? (int)(pairs - p0) : group, n = 0;
      for (int r = 0; r < g; r++) {
        int own = ns[(p0 + r) / rep] - j0;
        if (own > n) n = own;
      }
      if (n <= 0) continue;
      if (n > ATTN_TILE) n = ATTN_TILE;
      /* every pair's scores over the group's n keys; each keeps its own (causal, mask) */
      isa.tile_scores(qs + p0 * d, g, kt + j0, kts, n, d, sc, ATTN_TILE);
      float keep[TILE_ROWS];
      for (int r = 0; r < g; r++) {
        long at = p0 + r;
        int row = (int)(at / rep), own = ns[row] - j0;
        if (own > n) own = n;
        if (own < 0) own = 0;
        float *s = sc + r * ATTN_TILE, was = top[at];
        const uint8_t *m =
            c->mask ? c->mask + b * c->mask_bs + (long)(i0 + row) * c->mask_is + f + j0 : NULL;
        soft_cap(s, own, c->softcap);
        float most = mask_and_max(s, m, own);
        if (most < was) most = was;
        keep[r] = 1.0f;
        if (most != -INFINITY) {
          keep[r] = was == -INFINITY ? 0.0f : expf(was - most);
          sum[at] = sum[at] * keep[r] + isa.softmax_exp(s, own, most);
          top[at] = most;
        } else {
          own = 0; /* no key yet for this pair: it adds nothing */
        }
        memset(s + own, 0, sizeof(float) * (n - own));
      }
      isa.tile_weighted(sc, ATTN_TILE, g, v + (long)j0 * c->vs[2], c->vs[2], n, d, parts);
      for (int r = 0; r < g; r++) {
        float *o = acc + (p0 + r) * d;
        for (int t = 0; t < d; t++) o[t] = o[t] * keep[r] + parts[r][t];
      }
    }
  }
  for (long at = 0; at < pairs; at++) {
    int row = (int)(at / rep), r = (int)(at % rep);
    float *out = c->out + b * c->os[0] + (kvh * rep + r) * c->os[1] + (long)(i0 + row) * c->os[2];
    float total = sum[at]; /* 0: no allowed key, zeros as attn_row */
    for (int t = 0; t < d; t++) out[t] = total > 0.0f ? acc[at * d + t] / total : 0.0f;
  }
  free(ns);
  free(buf);
  return 0;
}

/* A task: one batch row, one kv head (all the query heads that share it), a block of query
 * rows. With a transposed-scores kernel and 16+ rows, the block's keys are transposed once. */
static void attn_task(void *arg, int task) {
  attn_ctx *c = (attn_ctx *)arg;
  int group = task / c->blocks_per_head, blk = task % c->blocks_per_head;
  int b = group / c->kv_heads, kvh = group % c->kv_heads, rep = c->heads / c->kv_heads;
  int d = c->head_dim;
  int f = c->first && c->first[b] > 0 ? c->first[b] : 0; /* keys before f are masked */
  if (f > c->keys) f = c->keys;
  const float *k = c->k ? c->k + b * c->ks[0] + kvh * c->ks[1] + (long)f * c->ks[2] : NULL;
  const float *v = c->v + b * c->vs[0] + kvh * c->vs[1] + (long)f * c->vs[2];
  int i0 = blk * c->q_block;
  int i1 = i0 + c->q_block < c->length ? i0 + c->q_block : c->length;
  int n_max = 0;
  for (int i = i0; i < i1; i++) {
    const uint8_t *m = c->mask ? c->mask + b * c->mask_bs + (long)i * c->mask_is : NULL;
    int n = allowed_keys(c, m, i) - f;
    if (n > n_max) n_max = n;
  }
  long stride = c->keys + 64;
  float *scores = NULL; /* the row-at-a-time paths' scores (the tiled one keeps its own) */
  float *kt = NULL;
  long kts = ((long)(n_max > 0 ? n_max : 1) + 15) / 16 * 16;
  /* Transposing pays only when enough query rows share the keys (not at a decode step). */
  int shared_rows = (i1 - i0) * rep;
  int own_kt = 0;
  if (c->kt_all && n_max > 0) { /* transposed once for every task of this kv head */
    kt = (float *)c->kt_all + (long)group * c->kt_pair + f, kts = c->kt_stride;
  } else if (isa.scores_t && k && n_max > 0 && shared_rows >= 16 &&
             (kt = (float *)malloc(sizeof(float) * kts * d)) != NULL) {
    own_kt = 1;
    for (int j = 0; j < n_max; j++) {
      const float *row = k + (long)j * c->ks[2];
      for (int t = 0; t < d; t++) kt[(long)t * kts + j] = row[t];
    }
  }
  if (kt && tile_group(d) && attn_group_tiled(c, b, kvh, i0, i1, rep, kt, kts, v, f) == 0) {
    /* done: tiled */
  } else if (!(scores = (float *)malloc(sizeof(float) * stride * (rep <= GROUP_MAX ? rep : 1)))) {
    /* out of memory: nothing computed (as before, the caller checks nothing here) */
  } else if (kt && isa.grouped && group_takes(rep, d)) {
    for (int i = i0; i < i1; i++) attn_group(c, b, kvh, i, rep, kt, kts, v, scores, stride, f);
  } else {
    for (int i = i0; i < i1; i++)
      for (int r = 0; r < rep; r++) attn_row(c, b, kvh * rep + r, i, k, kt, kts, v, scores, f);
  }
  if (own_kt) free(kt);
  free(scores);
}

static void run_attention(attn_ctx *c);

/* Returns 0, -2 for a head_dim it does not take. */
int mlxcel_attention(const float *q, const long *q_strides, const float *k, const long *k_strides,
                     const float *v, const long *v_strides, const uint8_t *mask, long mask_bs,
                     long mask_is, float *out, int batch, int heads, int kv_heads, int length,
                     int keys, int head_dim, int causal, float scale) {
  pthread_once(&isa_once, pick_isa);
  if (!isa.scores) return -1;
  if (head_dim > HEAD_DIM_MAX || head_dim % 16 || heads % kv_heads) return -2;
  attn_ctx c = {q, k, v, mask, out, {0}, {0}, {0}, mask_bs, mask_is, batch, heads, kv_heads,
                length, keys, head_dim, causal, 0, scale, 0, {0}, NULL, NULL, 0, 0};
  memcpy(c.qs, q_strides, sizeof c.qs);
  memcpy(c.ks, k_strides, sizeof c.ks);
  memcpy(c.vs, v_strides, sizeof c.vs);
  c.os[0] = (long)heads * length * head_dim, c.os[1] = (long)length * head_dim, c.os[2] = head_dim;
  run_attention(&c);
  return 0;
}

/* Splits an attention over the pool: (batch row, kv head, block of query rows) tasks. */
static void run_attention(attn_ctx *c_) {
  attn_ctx c = *c_;
  int batch = c.batch, kv_heads = c.kv_heads, length = c.length;
  int threads = n_threads();
  long pairs = (long)batch * kv_heads;
  /* Enough blocks per head for every thread to have several tasks. */
  int blocks = (int)((threads * 4 + pairs - 1) / pairs);
  if (blocks > length) blocks = length;
  if (blocks < 1) blocks = 1;
  c.q_block = (length + blocks - 1) / blocks;
  c.blocks_per_head = (length + c.q_block - 1) / c.q_block;
  parallel_for((int)(pairs * c.blocks_per_head), attn_task, &c);
}

/* ---- the decode step ---------------------------------------------------------------------
 * One new token per row through every layer of a llama-style model (pre-norm RMSNorm, fused
 * q/k/v with optional bias, rotate-halves RoPE from a table, grouped-query attention over the
 * KV cache plus the new token, output projection, fused gate/up SwiGLU MLP, residuals), in one
 * call instead of ~50 MLX ops a layer. The caller (daemon/forward/native_decode.py) embeds the
 * tokens, passes the residual stream `h` (batch, hidden), and gets back the last layer's output
 * in `h` and each layer's new key (after RoPE) and value in k_new / v_new (layers, batch,
 * kv_heads, head_dim), which it appends to its caches; the caches are only read here.
 *
 * Row b attends to cache columns [first[b], cached) of its layer's cache and to its new token;
 * its RoPE position is pos[b], cos/sin rows `rope_stride` floats apart (rope_pairs: the
 * traditional layout). Matmuls are the few-row kernel (dot layout: weights are
 * (out, in) row-major), split over the pool by output columns; attention runs one task per
 * (row, kv head); norms, RoPE and SwiGLU are a few thousand floats a row, on the caller.
 */
typedef struct {
  const float *attn_norm;
  mlxcel_matrix qkv, o; /* float32 or quantized (quant_kernels.h), each with its bias */
  const float *mlp_norm;
  mlxcel_matrix gate_up, down;
  const float *k_cache, *v_cache; /* (batch, kv_heads, columns, head_dim), strided */
  long ks[3], vs[3];              /* element strides: batch, head, column */
  /* qwen3: per-head RMSNorm weights (head_dim) of q and k, applied before RoPE with eps
   * qk_eps; NULL when the model has none. */
  const float *q_norm, *k_norm;
  float qk_eps;
  /* gemma2: RMSNorm weights (eps as the others) applied to the attention's output and to the
   * MLP's before their residual adds, NULL when the model has none; the attention's soft cap
   * (scores as tanh(s / softcap) * softcap, 0: none); the MLP's activation (0: SwiGLU, 1:
   * gelu_approx(gate) * up). */
  const float *post_attn_norm, *post_mlp_norm;
  float softcap;
  int gelu;
} mlxcel_layer;

static void add_bias(float *y, long rows, int out, const float *bias) {
  if (bias)
    for (long r = 0; r < rows; r++)
      for (int n = 0; n < out; n++) y[r * out + n] += bias[n];
}

/* y = x w^T for a few rows of x and a float32 w (out x in), in plain C: the few-row kernel
 * where fewrow_kernels.h has none (not x86, or no AVX2/FMA), threaded over output columns. */
typedef struct {
  const float *x, *w;
  float *y;
  int rows, in, out, per_task;
} linear_c_ctx;

static void linear_c_task(void *arg, int task) {
  const linear_c_ctx *c = arg;
  int o0 = task * c->per_task, o1 = o0 + c->per_task < c->out ? o0 + c->per_task : c->out;
  for (int o = o0; o < o1; o++)
    for (int r = 0; r < c->rows; r++)
      c->y[(long)r * c->out + o] = dot_c(c->x + (long)r * c->in, c->w + (long)o * c->in, c->in);
}

static void linear_c(const float *x, int rows, int in, const float *w, int out, float *y) {
  int tasks = n_threads() * 8;
  linear_c_ctx c = {x, w, y, rows, in, out, (out + tasks - 1) / tasks};
  parallel_for((out + c.per_task - 1) / c.per_task, linear_c_task, &c);
}

/* y = x m^T (+ bias) for a few rows; returns 0, -3 out of memory. */
static int linear_rows(const float *x, int rows, int in, const mlxcel_matrix *m, int out,
                       float *y) {
  if (m->bits) {
    int code = quant_few_rows(x, rows, in, out, m, quant_part, quant_chunk, y, out);
    if (code) return code;
  } else {
#if MLXCEL_OPS_X86
    if (gemm_dot) {
      gemm_job j = {rows, out, in, in, in, out, 1, 1.0f, 0.0f, x, (const float *)m->w, y};
      run_job(&j, gemm_dot);
    } else {
      linear_c(x, rows, in, (const float *)m->w, out, y);
    }
#else
    linear_c(x, rows, in, (const float *)m->w, out, y);
#endif
  }
  add_bias(y, rows, out, m->bias);
  return 0;
}

/* Whether every matrix of the layers is float32 or a quantized format the kernels take. */
static int layers_ok(const mlxcel_layer *layers, int n) {
  for (int l = 0; l < n; l++) {
    const mlxcel_matrix *ms[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
    for (int i = 0; i < 4; i++)
      if (ms[i]->bits && (!quant_format_ok(ms[i]->bits, ms[i]->group) || !quant_half_ok(ms[i]->half)))
        return 0;
  }
  return 1;
}

/* out = x * rsqrt(mean(x^2) + eps) * w, as mlx's rms_norm. */
static void rms_norm_rows(const float *x, const float *w, float eps, int rows, int n, float *out) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (long)r * n;
    float *o = out + (long)r * n;
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) o[i] = xr[i] * inv * w[i];
  }
}

/* Each q head of a q/k/v row through the layer's q norm and each k head through its k norm
 * (in place; nothing without them). */
static void qk_norm_row(const mlxcel_layer *L, float *row, int heads, int kv_heads, int d) {
  if (!L->q_norm) return;
  rms_norm_rows(row, L->q_norm, L->qk_eps, heads, d, row);
  rms_norm_rows(row + (long)heads * d, L->k_norm, L->qk_eps, kv_heads, d, row + (long)heads * d);
}

/* Rotate-halves layout: (x[i], x[i + half]); `pairs` (mlx's traditional RoPE): (x[2i], x[2i+1]). */
static void rope_head(float *x, const float *cos, const float *sin, int half, int pairs) {
  if (pairs) {
    for (int i = 0; i < half; i++) {
      float x1 = x[2 * i], x2 = x[2 * i + 1];
      x[2 * i] = x1 * cos[i] - x2 * sin[i];
      x[2 * i + 1] = x1 * sin[i] + x2 * cos[i];
    }
    return;
  }
  for (int i = 0; i < half; i++) {
    float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x1 * sin[i] + x2 * cos[i];
  }
}

/* Row b's cache keys and values for kv head kvh from its first live column (the columns
 * before first[b] are left padding) up to `cached`; returns how many there are. */
static int cache_span(const mlxcel_layer *L, const int *first, int b, int kvh, int cached,
                      const float **k, const float **v) {
  int f = first[b] < 0 ? 0 : first[b];
  *k = L->k_cache + b * L->ks[0] + kvh * L->ks[1] + (long)f * L->ks[2];
  *v = L->v_cache + b * L->vs[0] + kvh * L->vs[1] + (long)f * L->vs[2];
  return cached > f ? cached - f : 0;
}

typedef struct {
  const mlxcel_layer *layer;
  const float *qkv; /* (batch, (heads + 2 kv_heads) * head_dim), RoPE applied */
  float *out;       /* (batch, heads * head_dim) */
  const int *first;
  int heads, kv_heads, head_dim, cached;
  float scale;
  int splits;  /* key ranges per (row, kv head): 1, or each task's partial results in `part` */
  float *part; /* splits > 1: per task and query head: max, sum, head_dim undivided outputs */
} step_attn_ctx;

/* The scores of `rep` query rows (q: rep rows of d) over n keys (K rows `ks` apart), into
 * scores + r * stride: a block of keys at a time for every row, so each block is read from
 * memory once for all the query heads that share it (GQA) and from L1 for the others. */
#define KEY_BLOCK 64
#define REP_MAX 64 /* query heads per kv head the decode step takes */

static void scores_rows(const float *q, int rep, const float *k, long ks, int n, int d,
                        float *scores, long stride) {
  for (int j0 = 0; j0 < n; j0 += KEY_BLOCK) {
    int cnt = n - j0 < KEY_BLOCK ? n - j0 : KEY_BLOCK;
    for (int r = 0; r < rep; r++)
      isa.scores(q + (long)r * d, k + (long)j0 * ks, ks, cnt, d, scores + r * stride + j0);
  }
}

/* outs[r] = sum_j p[r * stride + j] * V[j] for the `rep` rows (undivided), V read once per
 * group of rows the tile kernel takes, not once per row. */
static void weighted_rows_all(const float *p, long stride, int rep, const float *v, long vs,
                              int n, int d, float *const *outs) {
  int group = tile_group(d);
  if (group <= 0) {
    for (int r = 0; r < rep; r++) isa.weighted(p + r * stride, v, vs, n, d, 1.0f, outs[r]);
    return;
  }
  for (int r0 = 0; r0 < rep; r0 += group) {
    int g = rep - r0 < group ? rep - r0 : group;
    isa.tile_weighted(p + r0 * stride, stride, g, v, vs, n, d, outs + r0);
  }
}

/* The rep query heads sharing kv head kvh of row b over cache columns [j0, j1) of the row's
 * span and, when `with_new`, the row's new key: each head's undivided output (outs), its
 * max and its sum of exponentials. Returns -3 out of memory. */
static int step_attn_range(const step_attn_ctx *c, int b, int kvh, int j0, int j1, int with_new,
                           float *const *outs, float *tops, float *sums) {
  int d = c->head_dim, rep = c->heads / c->kv_heads, width = (c->heads + 2 * c->kv_heads) * d;
  const mlxcel_layer *L = c->layer;
  const float *k, *v;
  int n_old = cache_span(L, c->first, b, kvh, c->cached, &k, &v);
  if (j1 > n_old) j1 = n_old;
  int n = j1 > j0 ? j1 - j0 : 0;
  k += (long)j0 * L->ks[2], v += (long)j0 * L->vs[2];
  const float *row = c->qkv + (long)b * width;
  const float *k_new = row + (c->heads + kvh) * d;
  const float *v_new = row + (c->heads + c->kv_heads + kvh) * d;
  long stride = n + 64;
  float *scores = malloc(sizeof(float) * (stride * rep + (long)rep * d));
  if (!scores) return -3;
  float *qs = scores + stride * rep; /* the rep query rows, scaled */
  for (int r = 0; r < rep; r++) {
    const float *q = row + (kvh * rep + r) * d;
    for (int t = 0; t < d; t++) qs[r * d + t] = q[t] * c->scale;
  }
  if (n) scores_rows(qs, rep, k, L->ks[2], n, d, scores, stride);
  int keys = n + (with_new ? 1 : 0);
  for (int r = 0; r < rep; r++) {
    float *sc = scores + r * stride;
    if (with_new) {
      float last = 0.0f;
      for (int t = 0; t < d; t++) last += qs[r * d + t] * k_new[t];
      sc[n] = last;
    }
    soft_cap(sc, keys, L->softcap);
    tops[r] = keys ? max_of(sc, keys) : -INFINITY;
    sums[r] = keys ? isa.softmax_exp(sc, keys, tops[r]) : 0.0f;
  }
  if (n) weighted_rows_all(scores, stride, rep, v, L->vs[2], n, d, outs);
  for (int r = 0; r < rep; r++) {
    float *o = outs[r];
    if (!n) memset(o, 0, sizeof(float) * d);
    if (with_new) {
      float p_new = scores[r * stride + n];
      for (int t = 0; t < d; t++) o[t] += p_new * v_new[t];
    }
  }
  free(scores);
  return 0;
}

/* One task: a (row, kv head), or with c->splits > 1 one of its key ranges (the last takes the
 * new key), whose partial results step_attn_combine merges. */
static void step_attn_task(void *arg, int task) {
  const step_attn_ctx *c = arg;
  int pair = task / c->splits, split = task % c->splits;
  int b = pair / c->kv_heads, kvh = pair % c->kv_heads, d = c->head_dim;
  int rep = c->heads / c->kv_heads;
  float *outs[REP_MAX], tops[REP_MAX], sums[REP_MAX];
  if (c->splits == 1) {
    for (int r = 0; r < rep; r++) outs[r] = c->out + (long)b * c->heads * d + (kvh * rep + r) * d;
    if (step_attn_range(c, b, kvh, 0, INT_MAX, 1, outs, tops, sums)) return; /* see below */
    for (int r = 0; r < rep; r++)
      for (int t = 0; t < d; t++) outs[r][t] /= sums[r];
    return;
  }
  const float *kk, *vv;
  int n_old = cache_span(c->layer, c->first, b, kvh, c->cached, &kk, &vv);
  int per = (n_old + c->splits - 1) / c->splits, j0 = split * per;
  float *part = c->part + (long)task * rep * (d + 2);
  for (int r = 0; r < rep; r++) outs[r] = part + (long)r * (d + 2) + 2;
  if (step_attn_range(c, b, kvh, j0, j0 + per, split == c->splits - 1, outs, tops, sums)) {
    for (int r = 0; r < rep; r++) part[(long)r * (d + 2)] = NAN; /* step_attn_combine fails */
    return;
  }
  for (int r = 0; r < rep; r++) part[(long)r * (d + 2)] = tops[r], part[(long)r * (d + 2) + 1] = sums[r];
}

/* Merges the key ranges' partial results: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M). */
static void step_attn_combine(const step_attn_ctx *c, int batch) {
  int d = c->head_dim, rep = c->heads / c->kv_heads, splits = c->splits;
  for (int pair = 0; pair < batch * c->kv_heads; pair++) {
    int b = pair / c->kv_heads, kvh = pair % c->kv_heads;
    for (int r = 0; r < rep; r++) {
      float *out = c->out + (long)b * c->heads * d + (kvh * rep + r) * d, top = -INFINITY;
      for (int s = 0; s < splits; s++) {
        float m = c->part[((long)(pair * splits + s) * rep + r) * (d + 2)];
        if (m > top) top = m;
      }
      float total = 0.0f;
      memset(out, 0, sizeof(float) * d);
      for (int s = 0; s < splits; s++) {
        const float *pt = c->part + ((long)(pair * splits + s) * rep + r) * (d + 2);
        if (pt[0] == -INFINITY) continue; /* an empty range */
        float w = expf(pt[0] - top);
        total += pt[1] * w;
        for (int t = 0; t < d; t++) out[t] += pt[2 + t] * w;
      }
      for (int t = 0; t < d; t++) out[t] /= total;
    }
  }
}

/* Key ranges per (row, kv head) for the decode step's attention: enough tasks for every
 * thread when few rows and kv heads meet a long cache, each range at least STEP_SPLIT_MIN. */
#define STEP_SPLIT_MIN 512
static int step_splits(int pairs, int cached) {
  int threads = n_threads(), want = (4 * threads + pairs - 1) / pairs;
  int most = cached / STEP_SPLIT_MIN;
  if (want > most) want = most;
  if (want > 16) want = 16;
  return want < 2 ? 1 : want;
}

/* Returns 0; -2 for a shape it does not take, -3 out of memory. */
int mlxcel_decode_step(float *h, int batch, int hidden, int heads, int kv_heads, int head_dim,
                       int inter, int n_layers, const mlxcel_layer *layers, float eps,
                       float scale, int cached, const int *first, const int *pos,
                       const float *cos, const float *sin, long rope_stride, int rope_pairs,
                       float *k_new, float *v_new) {
  pthread_once(&isa_once, pick_isa);
  if (!isa.scores) return -1;
  if (head_dim > HEAD_DIM_MAX || head_dim % 16 || heads % kv_heads || heads / kv_heads > REP_MAX ||
      batch < 1 || batch > 16 || !layers_ok(layers, n_layers))
    return -2;
  int d = head_dim, half = head_dim / 2, width = (heads + 2 * kv_heads) * d;
  long kv_row = (long)kv_heads * d;
  int splits = step_splits(batch * kv_heads, cached);
  size_t floats = (size_t)batch * (2 * hidden + width + heads * d + 3 * inter);
  size_t parts = splits > 1 ? (size_t)batch * heads * splits * (d + 2) : 0;
  float *buf = malloc(sizeof(float) * (floats + parts));
  if (!buf) return -3;
  float *x = buf, *qkv = x + (long)batch * hidden, *attn = qkv + (long)batch * width;
  float *gate_up = attn + (long)batch * heads * d, *act = gate_up + (long)batch * 2 * inter;
  float *proj = act + (long)batch * inter, *part = splits > 1 ? buf + floats : NULL;
  int failed = 0;
  for (int l = 0; l < n_layers && !failed; l++) {
    const mlxcel_layer *L = &layers[l];
    rms_norm_rows(h, L->attn_norm, eps, batch, hidden, x);
    if ((failed = linear_rows(x, batch, hidden, &L->qkv, width, qkv))) break;
    for (int b = 0; b < batch; b++) {
      int p = pos[b] < 0 ? 0 : pos[b]; /* left padding: masked out anyway */
      const float *cs = cos + (long)p * rope_stride, *sn = sin + (long)p * rope_stride;
      float *row = qkv + (long)b * width;
      qk_norm_row(L, row, heads, kv_heads, d);
      for (int hd = 0; hd < heads + kv_heads; hd++) rope_head(row + hd * d, cs, sn, half, rope_pairs);
      float *kn = k_new + ((long)l * batch + b) * kv_row, *vn = v_new + ((long)l * batch + b) * kv_row;
      memcpy(kn, row + heads * d, sizeof(float) * kv_row);
      memcpy(vn, row + (heads + kv_heads) * d, sizeof(float) * kv_row);
    }
    step_attn_ctx ac = {L, qkv, attn, first, heads, kv_heads, d, cached, scale, splits, part};
    parallel_for(batch * kv_heads * splits, step_attn_task, &ac);
    if (splits > 1) step_attn_combine(&ac, batch);
    if ((failed = linear_rows(attn, batch, heads * d, &L->o, hidden, proj))) break;
    if (L->post_attn_norm) rms_norm_rows(proj, L->post_attn_norm, eps, batch, hidden, proj);
    for (long i = 0; i < (long)batch * hidden; i++) h[i] += proj[i];
    rms_norm_rows(h, L->mlp_norm, eps, batch, hidden, x);
    if ((failed = linear_rows(x, batch, hidden, &L->gate_up, 2 * inter, gate_up))) break;
    for (int b = 0; b < batch; b++) {
      const float *row = gate_up + (long)b * 2 * inter;
      gated_row(row, row + inter, act + (long)b * inter, inter, L->gelu);
    }
    if ((failed = linear_rows(act, batch, inter, &L->down, hidden, proj))) break;
    if (L->post_mlp_norm) rms_norm_rows(proj, L->post_mlp_norm, eps, batch, hidden, proj);
    for (long i = 0; i < (long)batch * hidden; i++) h[i] += proj[i];
  }
  free(buf);
  return failed;
}

/* ---- RMSNorm and RoPE over many rows (prefill chunks) ---------------------------------- */

typedef struct {
  const float *x, *w;
  float *out;
  float eps;
  long rows, n, per_task;
} norm_ctx;

static void norm_task(void *arg, int task) {
  const norm_ctx *c = arg;
  long r0 = task * c->per_task, r1 = r0 + c->per_task < c->rows ? r0 + c->per_task : c->rows;
  if (r1 > r0) rms_norm_rows(c->x + r0 * c->n, c->w, c->eps, (int)(r1 - r0), (int)c->n, c->out + r0 * c->n);
}

/* out = x * rsqrt(mean(x^2) + eps) * w for each of `rows` rows of n floats. Returns 0. */
int mlxcel_rms_norm(const float *x, const float *w, float eps, long rows, long n, float *out) {
  pthread_once(&isa_once, pick_isa);
  long tasks = row_tasks(rows);
  if (tasks < 1) return 0;
  norm_ctx c = {x, w, out, eps, rows, n, (rows + tasks - 1) / tasks};
  parallel_for((int)((rows + c.per_task - 1) / c.per_task), norm_task, &c);
  return 0;
}

typedef struct {
  float *x;
  const int *pos;
  const float *cos, *sin;
  long rows, row_stride, rope_stride, per_task;
  int heads, head_dim, pairs;
} rope_ctx;

static void rope_task(void *arg, int task) {
  const rope_ctx *c = arg;
  long r0 = task * c->per_task, r1 = r0 + c->per_task < c->rows ? r0 + c->per_task : c->rows;
  for (long r = r0; r < r1; r++) {
    int p = c->pos[r] < 0 ? 0 : c->pos[r];
    const float *cs = c->cos + (long)p * c->rope_stride, *sn = c->sin + (long)p * c->rope_stride;
    float *row = c->x + r * c->row_stride;
    for (int h = 0; h < c->heads; h++) rope_head(row + h * c->head_dim, cs, sn, c->head_dim / 2, c->pairs);
  }
}

/* RoPE in place on the first `heads` heads of each row (row r at position pos[r], clamped at
 * 0), as the decode step does. Returns 0. */
int mlxcel_rope_rows(float *x, long rows, long row_stride, int heads, int head_dim,
                     const int *pos, const float *cos, const float *sin, long rope_stride,
                     int pairs) {
  pthread_once(&isa_once, pick_isa);
  long tasks = row_tasks(rows);
  if (tasks < 1) return 0;
  rope_ctx c = {x, pos, cos, sin, rows, row_stride, rope_stride, (rows + tasks - 1) / tasks,
                heads, head_dim, pairs};
  parallel_for((int)((rows + c.per_task - 1) / c.per_task), rope_task, &c);
  return 0;
}

/* ---- the chunk step: a prefill chunk through every layer -----------------------------------
 * The decode step's layer for `length` new tokens per row (a prompt chunk): the same norms,
 * RoPE and SwiGLU (multi-threaded over rows), the matmuls through the process's cblas_sgemm
 * (the preloaded few-row kernel in front of OpenBLAS: found with dlsym(RTLD_DEFAULT); without
 * one in the global scope the step is unavailable), causal attention over the row's cache
 * columns [first, cached) and the chunk's own keys. Nothing goes back to MLX between layers:
 * no syncs, no copies. New keys/values come back in k_new / v_new (layers, batch, kv_heads,
 * length, head_dim) for the caller to append.
 */
typedef void (*cblas_sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                              const float *, int, float, float *, int);
static cblas_sgemm_t big_sgemm;
static pthread_once_t big_once = PTHREAD_ONCE_INIT;

static void find_big_sgemm(void) { big_sgemm = (cblas_sgemm_t)dlsym(RTLD_DEFAULT, "cblas_sgemm"); }

/* 1 when mlxcel_chunk_step can run in this process. */
int mlxcel_chunk_step_available(void) {
  pthread_once(&isa_once, pick_isa);
  pthread_once(&big_once, find_big_sgemm);
  return big_sgemm != NULL && isa.scores != NULL;
}

/* y = x m^T (+ bias) for a chunk's rows: float32 straight to cblas_sgemm, quantized through
 * dequantized tiles (quant_big); returns 0, -3 out of memory. */
static int linear_big(const float *x, long rows, int in, const mlxcel_matrix *m, int out,
                      float *y) {
  if (m->bits) {
    int code = quant_any_rows(x, rows, in, out, m, big_sgemm, y);
    if (code) return code;
  } else {
    big_sgemm(101, 111, 112, (int)rows, out, in, 1.0f, x, in, (const float *)m->w, in, 0.0f, y,
              out);
  }
  add_bias(y, rows, out, m->bias);
  return 0;
}

typedef struct {
  float *h;
  const float *delta;
  long n, per_task;
} add_ctx;

static void add_task(void *arg, int task) {
  const add_ctx *c = arg;
  long i0 = task * c->per_task, i1 = i0 + c->per_task < c->n ? i0 + c->per_task : c->n;
  for (long i = i0; i < i1; i++) c->h[i] += c->delta[i];
}

static void add_into(float *h, const float *delta, long n, long rows) {
  add_ctx c = {h, delta, n, (n + 63) / 64};
  if (rows <= SERIAL_ROWS) c.per_task = n; /* one task: see row_tasks */
  parallel_for((int)((n + c.per_task - 1) / c.per_task), add_task, &c);
}

typedef struct {
  const mlxcel_layer *layer;
  float *qkv;
  long rows, width, per_task;
  int heads, kv_heads, d;
} qk_norm_ctx;

static void qk_norm_task(void *arg, int task) {
  const qk_norm_ctx *c = arg;
  long r0 = task * c->per_task, r1 = r0 + c->per_task < c->rows ? r0 + c->per_task : c->rows;
  for (long r = r0; r < r1; r++) qk_norm_row(c->layer, c->qkv + r * c->width, c->heads, c->kv_heads, c->d);
}

/* A short chunk's attention (a verification's few tokens a row, CHUNK_DIRECT_MAX or fewer)
 * read from the cache in place, as the decode step reads it: query i of row b sees cache
 * columns [first[b], cached) and the chunk's keys 0..i. Copying the cache's columns next to
 * the chunk's, as long chunks do, would cost more than the attention itself here. One task
 * per (row, kv head). */
#define CHUNK_DIRECT_MAX 16

typedef struct {
  const mlxcel_layer *layer;
  const float *qkv;          /* (batch * length, (heads + 2 kv_heads) * head_dim), RoPE applied */
  const float *k_new, *v_new; /* (batch, kv_heads, length, head_dim) */
  float *out;                /* (batch * length, heads * head_dim) */
  const int *first;
  int length, heads, kv_heads, head_dim, cached;
  float scale;
} chunk_attn_ctx;

static void chunk_attn_task(void *arg, int task) {
  const chunk_attn_ctx *c = arg;
  int b = task / c->kv_heads, kvh = task % c->kv_heads, d = c->head_dim, len = c->length;
  int rep = c->heads / c->kv_heads, width = (c->heads + 2 * c->kv_heads) * d;
  const mlxcel_layer *L = c->layer;
  const float *k, *v;
  int n_old = cache_span(L, c->first, b, kvh, c->cached, &k, &v);
  const float *kn = c->k_new + ((long)b * c->kv_heads + kvh) * len * d;
  const float *vn = c->v_new + ((long)b * c->kv_heads + kvh) * len * d;
  float *scores = malloc(sizeof(float) * (n_old + 64));
  float fresh[CHUNK_DIRECT_MAX];
  float qrow[HEAD_DIM_MAX] __attribute__((aligned(64)));
  if (!scores) return; /* as step_attn_task */
  for (int i = 0; i < len; i++) {
    const float *row = c->qkv + ((long)b * len + i) * width;
    for (int r = 0; r < rep; r++) {
      int h = kvh * rep + r;
      const float *q = row + h * d;
      for (int t = 0; t < d; t++) qrow[t] = q[t] * c->scale;
      if (n_old) isa.scores(qrow, k, L->ks[2], n_old, d, scores);
      soft_cap(scores, n_old, L->softcap);
      float max = n_old ? max_of(scores, n_old) : -INFINITY;
      for (int j = 0; j <= i; j++) {
        float dot = 0.0f;
        for (int t = 0; t < d; t++) dot += qrow[t] * kn[(long)j * d + t];
        soft_cap(&dot, 1, L->softcap);
        fresh[j] = dot;
        if (dot > max) max = dot;
      }
      float total = n_old ? isa.softmax_exp(scores, n_old, max) : 0.0f;
      for (int j = 0; j <= i; j++) {
        fresh[j] = expf(fresh[j] - max);
        total += fresh[j];
      }
      float *o = c->out + ((long)b * len + i) * c->heads * d + h * d;
      if (n_old) isa.weighted(scores, v, L->vs[2], n_old, d, 1.0f, o);
      else memset(o, 0, sizeof(float) * d);
      for (int j = 0; j <= i; j++)
        for (int t = 0; t < d; t++) o[t] += fresh[j] * vn[(long)j * d + t];
      for (int t = 0; t < d; t++) o[t] /= total;
    }
  }
  free(scores);
}

/* The keys of one (batch row, kv head), transposed for the attention's score kernels: the
 * cache's columns read in place, then the chunk's; a task per pair and block of keys. */
#define KT_BLOCK 512

typedef struct {
  const mlxcel_layer *layer;
  const float *k_new; /* (batch, kv_heads, length, head_dim) */
  float *kt;          /* per pair: head_dim rows of `kts`, pairs d * kts floats apart */
  long kts;
  int kv_heads, length, cached, d, blocks;
} transpose_ctx;

static void transpose_task(void *arg, int task) {
  const transpose_ctx *c = arg;
  int pair = task / c->blocks, blk = task % c->blocks, d = c->d;
  int b = pair / c->kv_heads, kh = pair % c->kv_heads, keys = c->cached + c->length;
  int j0 = blk * KT_BLOCK, j1 = j0 + KT_BLOCK < keys ? j0 + KT_BLOCK : keys;
  const mlxcel_layer *L = c->layer;
  const float *cache = L->k_cache + b * L->ks[0] + kh * L->ks[1];
  const float *fresh = c->k_new + ((long)b * c->kv_heads + kh) * c->length * d;
  float *dst = c->kt + (long)pair * d * c->kts;
  for (int jb = j0; jb < j1; jb += 64) { /* 64 keys' rows stay in L1 across the head dims */
    int je = jb + 64 < j1 ? jb + 64 : j1;
    for (int t = 0; t < d; t++) {
      float *out = dst + (long)t * c->kts;
      for (int j = jb; j < je; j++)
        out[j] = j < c->cached ? cache[(long)j * L->ks[2] + t] : fresh[(long)(j - c->cached) * d + t];
    }
  }
}

/* The chunk's attention over each row's cache columns followed by the chunk's keys: the
 * values copied into one buffer per row and head (v_all: (batch, kv_heads, cached + length,
 * head_dim)), the keys transposed into kt_all once for all of that head's tasks (the score
 * kernels read keys transposed; unused without a cache). */
static void attend_copied(const chunk_attn_ctx *c, int batch, float *kt_all, float *v_all) {
  const mlxcel_layer *L = c->layer;
  const float *kn = c->k_new, *vn = c->v_new;
  int heads = c->heads, kv_heads = c->kv_heads, d = c->head_dim, length = c->length;
  int cached = c->cached, width = (heads + 2 * kv_heads) * d, keys = cached + length;
  const float *ks = kn, *vs = vn;
  long kstr[3] = {(long)kv_heads * length * d, (long)length * d, d}, vstr[3];
  long kts = ((long)keys + 15) / 16 * 16;
  memcpy(vstr, kstr, sizeof kstr);
  if (cached) {
    for (int b = 0; b < batch; b++)
      for (int kh = 0; kh < kv_heads; kh++) {
        float *vd = v_all + ((long)b * kv_heads + kh) * keys * d;
        for (int j = 0; j < cached; j++)
          memcpy(vd + (long)j * d, L->v_cache + b * L->vs[0] + kh * L->vs[1] + j * L->vs[2],
                 sizeof(float) * d);
        memcpy(vd + (long)cached * d, vn + ((long)b * kv_heads + kh) * length * d,
               sizeof(float) * length * d);
      }
    transpose_ctx tc = {L, kn, kt_all, kts, kv_heads, length, cached, d,
                        (keys + KT_BLOCK - 1) / KT_BLOCK};
    parallel_for(batch * kv_heads * tc.blocks, transpose_task, &tc);
    ks = NULL, vs = v_all;
    vstr[0] = (long)kv_heads * keys * d, vstr[1] = (long)keys * d;
  }
  attn_ctx ac = {c->qkv, ks, vs, NULL, c->out, {(long)length * width, d, width}, {0}, {0}, 0, 0,
                 batch, heads, kv_heads, length, keys, d, 1, 0, c->scale, 0,
                 {(long)length * heads * d, d, (long)heads * d}, c->first,
                 cached ? kt_all : NULL, kts, (long)d * kts};
  memcpy(ac.ks, kstr, sizeof kstr);
  memcpy(ac.vs, vstr, sizeof vstr);
  ac.softcap = L->softcap;
  run_attention(&ac);
}

/* Returns 0; -1 unavailable (no cblas_sgemm in the process), -2 a shape it does not take,
 * -3 out of memory. */
int mlxcel_chunk_step(float *h, int batch, int length, int hidden, int heads, int kv_heads,
                      int head_dim, int inter, int n_layers, const mlxcel_layer *layers,
                      float eps, float scale, int cached, const int *first, const int *pos,
                      const float *cos, const float *sin, long rope_stride, int rope_pairs,
                      float *k_new, float *v_new) {
  if (!mlxcel_chunk_step_available()) return -1;
  if (head_dim > HEAD_DIM_MAX || head_dim % 16 || heads % kv_heads || batch < 1 || length < 1 ||
      cached < 0 || !layers_ok(layers, n_layers))
    return -2;
  int d = head_dim, width = (heads + 2 * kv_heads) * d, keys = cached + length;
  long rows = (long)batch * length, kv_layer = rows * kv_heads * d;
  size_t floats = (size_t)rows * (2 * hidden + width + heads * d + 3 * inter);
  int direct = cached && length <= CHUNK_DIRECT_MAX; /* chunk_attn_task: no copy of the cache */
  size_t kts = ((size_t)keys + 15) / 16 * 16; /* attend_copied's transposed keys */
  size_t hist = cached && !direct ? (size_t)batch * kv_heads * (keys + kts) * d : 0;
  float *buf = malloc(sizeof(float) * (floats + hist));
  int *positions = malloc(sizeof(int) * rows);
  if (!buf || !positions) {
    free(buf);
    free(positions);
    return -3;
  }
  float *x = buf, *qkv = x + rows * hidden, *attn = qkv + rows * width;
  float *gate_up = attn + rows * heads * d, *act = gate_up + rows * 2 * inter;
  float *proj = act + rows * inter, *kt_all = proj + rows * hidden;
  float *v_all = kt_all + (cached ? (size_t)batch * kv_heads * kts * d : 0);
  for (int b = 0; b < batch; b++)
    for (int i = 0; i < length; i++) positions[(long)b * length + i] = pos[b] + i;
  int failed = 0;
  for (int l = 0; l < n_layers && !failed; l++) {
    const mlxcel_layer *L = &layers[l];
    float *kn = k_new + (long)l * kv_layer, *vn = v_new + (long)l * kv_layer;
    mlxcel_rms_norm(h, L->attn_norm, eps, rows, hidden, x);
    if ((failed = linear_big(x, rows, hidden, &L->qkv, width, qkv))) break;
    if (L->q_norm) {
      qk_norm_ctx nc = {L, qkv, rows, width, rows <= SERIAL_ROWS ? rows : (rows + 63) / 64, heads, kv_heads, d};
      parallel_for((int)((rows + nc.per_task - 1) / nc.per_task), qk_norm_task, &nc);
    }
    mlxcel_rope_rows(qkv, rows, width, heads + kv_heads, d, positions, cos, sin, rope_stride,
                     rope_pairs);
    for (int b = 0; b < batch; b++)
      for (int kh = 0; kh < kv_heads; kh++)
        for (int i = 0; i < length; i++) {
          const float *row = qkv + ((long)b * length + i) * width;
          long at = (((long)b * kv_heads + kh) * length + i) * d;
          memcpy(kn + at, row + (heads + kh) * d, sizeof(float) * d);
          memcpy(vn + at, row + (heads + kv_heads + kh) * d, sizeof(float) * d);
        }
    chunk_attn_ctx cc = {L, qkv, kn, vn, attn, first, length, heads, kv_heads, d, cached, scale};
    if (direct) parallel_for(batch * kv_heads, chunk_attn_task, &cc);
    else attend_copied(&cc, batch, kt_all, v_all);
    if ((failed = linear_big(attn, rows, heads * d, &L->o, hidden, proj))) break;
    if (L->post_attn_norm) mlxcel_rms_norm(proj, L->post_attn_norm, eps, rows, hidden, proj);
    add_into(h, proj, rows * hidden, rows);
    mlxcel_rms_norm(h, L->mlp_norm, eps, rows, hidden, x);
    if ((failed = linear_big(x, rows, hidden, &L->gate_up, 2 * inter, gate_up))) break;
    gated_rows(gate_up, act, rows, inter, L->gelu);
    if ((failed = linear_big(act, rows, inter, &L->down, hidden, proj))) break;
    if (L->post_mlp_norm) mlxcel_rms_norm(proj, L->post_mlp_norm, eps, rows, hidden, proj);
    add_into(h, proj, rows * hidden, rows);
  }
  free(positions);
  free(buf);
  return failed;
}

/* ---- quantized matmul (the output head, the tests) ------------------------------------------
 * y = x W^T for W in MLX's affine format (quant_kernels.h), any number of rows: the few-row
 * kernel in 16-row blocks, past QUANT_DIRECT_MAX_ROWS rows dequantized tiles into the
 * process's cblas_sgemm when there is one (MLXCEL_QUANT_BIG=direct / =tiles forces either).
 * Returns 0; -2 a format it does not take (bits not 4/8, group not 32/64/128, in not a
 * multiple of the group, `half` not QUANT_F32/F16/BF16); -3 out of memory. */
int mlxcel_qmatmul(const float *x, long rows, long in, long out, const uint32_t *w,
                   const void *scales, const void *biases, int bits, int group, int half,
                   float *y) {
  pthread_once(&isa_once, pick_isa);
  pthread_once(&big_once, find_big_sgemm);
  if (!quant_format_ok(bits, group) || !quant_half_ok(half) || in % group || in < group ||
      out < 1 || rows < 0)
    return -2;
  mlxcel_matrix m = {w, scales, biases, NULL, bits, group, half};
  return quant_any_rows(x, rows, (int)in, (int)out, &m, big_sgemm, y);
}

/* 1 when mlxcel_qmatmul and the steps take this format. */
int mlxcel_quant_supported(int bits, int group) { return quant_format_ok(bits, group); }

/* The quantized kernels' path: "avx512", "avx2" or "portable". */
const char *mlxcel_quant_path(void) {
  pthread_once(&isa_once, pick_isa);
  return quant_name;
}
