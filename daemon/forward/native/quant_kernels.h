/* Matmuls on MLX's affine quantized weights, dequantized in registers (never stored whole).
 *
 * The format is nn.QuantizedLinear's: `w` uint32 (out, in * bits / 32), value j of a word at
 * bits [bits * j, bits * j + bits) (low bits first), `scales` and `biases` (out, in / group)
 * as float32, or as float16 or bfloat16 (`half`) when those hold them exactly (the Python
 * side decides: forward/native_ops.py); either way the weight is w[o][i] = scale[o][g] *
 * q[o][i] + bias[o][g] in float32, g = i / group, so the narrow types give the same results
 * bit for bit and read fewer bytes (at group 32, 1/6 of a 4-bit layer's bytes less). Bits 4
 * and 8, groups 32/64/128.
 *
 * Few rows (1-16: a decode step, the output head): y[r][o] = sum_g scale[o][g] *
 * dot(q[o][g], x[r][g]) + bias[o][g] * sum(x[r][g]); the per-group sums of x are computed
 * once per call, and x is permuted once per call into the lane order the ISA's unpacking
 * produces (AVX-512 unpacks 32 4-bit values as the 16 even then the 16 odd ones, AVX2 16 as 8
 * and 8), so the inner loop is load, widen, mask/shift, convert, multiply by the scale, FMA.
 * Threaded over output columns on the pool (pool.h). Paths: AVX-512, AVX2 + FMA (chosen from
 * the CPU flags; MLXCEL_GEMM_ISA=avx2 forces AVX2, =portable the plain C one) and a portable
 * C path that any compiler builds for any CPU (the x86 parts are compiled only on x86).
 *
 * From 4 rows on AVX-512 (8 on AVX2), strips of 4 output columns are dequantized once into a
 * small float32 scratch and float FMA tiles run over every row against them (qstrip_512/256).
 *
 * Many rows (a prefill chunk): with the strips, the few-row kernel in 16-row blocks (faster than
 * the tiles at every size, measured: quant_any_rows). Without them: past
 * QUANT_DIRECT_MAX_ROWS rows, tiles of the weight (whole
 * matrices up to 8 MB of float32) dequantized into a kept scratch (AVX-512, or plain C), then
 * the process's cblas_sgemm on each tile (`quant_big`); up to it, the few-row kernel in
 * 16-row blocks (faster there: measured, see quant_any_rows).
 *
 * Include after pool.h. Every definition is static.
 */
#ifndef MLXCEL_QUANT_KERNELS_H
#define MLXCEL_QUANT_KERNELS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The x86 paths are compiled on x86 only (-DMLXCEL_QUANT_X86=0 leaves them out anywhere, as
 * an aarch64 build does: tests/integration/test_native_quant.py compiles the header that way). */
#ifndef MLXCEL_QUANT_X86
#if defined(__x86_64__) || defined(__i386__)
#define MLXCEL_QUANT_X86 1
#else
#define MLXCEL_QUANT_X86 0
#endif
#endif
#if MLXCEL_QUANT_X86
#include <immintrin.h>
#endif

/* One matrix of a layer: bits 0 is float32 (out, in) row-major in `w` (scales/biases
 * unused), bits 4 or 8 the quantized format above. `bias` (out) may be NULL. */
#define QUANT_F32 0  /* scales and biases as float32 */
#define QUANT_F16 1  /* ... as IEEE float16 */
#define QUANT_BF16 2 /* ... as bfloat16 */

typedef struct {
  const void *w;
  const void *scales, *biases; /* float32, float16 or bfloat16: `half` */
  const float *bias;
  int bits, group;
  int half; /* QUANT_F32, QUANT_F16 or QUANT_BF16 */
} mlxcel_matrix;

static int quant_format_ok(int bits, int group) {
  return (bits == 4 || bits == 8) && (group == 32 || group == 64 || group == 128);
}

static inline int quant_half_ok(int half) { return half == QUANT_F32 || half == QUANT_F16 || half == QUANT_BF16; }

/* IEEE float16 to float32, exactly (any compiler, any CPU). */
static inline float quant_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  float f;
  if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float32 */
    f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  bits = exp == 31 ? sign | 0x7F800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline float quant_bf16(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Element i of a scales or biases array of type `half`, as float32. */
static inline float quant_at(const void *p, long i, int half) {
  if (half == QUANT_F16) return quant_f16(((const uint16_t *)p)[i]);
  if (half == QUANT_BF16) return quant_bf16(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

/* The address of element i (for prefetching). */
static inline const char *quant_addr(const void *p, long i, int half) {
  return (const char *)p + i * (half == QUANT_F32 ? 4 : 2);
}

typedef struct {
  const float *xp;   /* rows x in, permuted to the path's lane order (x itself for 8-bit) */
  const float *xsum; /* rows x groups: per-group sums of x */
  const uint32_t *w;
  const void *scales, *biases; /* of type `half` */
  int rows, in, out, bits, group;
  float *y;
  long ldy;
  int half;
} qjob;

#define QCOL_MAX_G 512 /* columns of up to this many groups convert into a stack buffer */
#define QUANT_PREFETCH_COLS 4 /* weight rows read ahead of the one computed (x86 paths) */

typedef void (*qpart_fn)(const qjob *, int, int);

/* Rows from which the x86 paths dequantize strips of columns once and run float tiles over
 * them (the strips below); 0: never (MLXCEL_QUANT_STRIP=0, for comparison). Set by quant_pick. */
static int quant_strip_rows = 4; /* AVX-512 4, AVX2 8 (quant_pick) */
static int quant_row1_nc = 2; /* AVX2 1-row 4-bit: columns interleaved (0: the tiles) */
static int quant_row1_words = 1; /* AVX-512 1-row 4-bit: qrow1w_pair512 (MLXCEL_QUANT_ROW1W=0: off) */
#define QW_BLOCK 128 /* its block of values (quant_permute_words) */

/* sum_g biases[o][g] * xsum[r][g] */
static inline float quant_bias_term(const qjob *j, int r, int o) {
  int G = j->in / j->group;
  const float *s = j->xsum + (long)r * G;
  float t = 0.0f;
  for (int g = 0; g < G; g++) t += quant_at(j->biases, (long)o * G + g, j->half) * s[g];
  return t;
}

/* ---------------- portable C ---------------- */

/* A group's codes as floats: 4-bit in the permuted lane order (each 32 values as the 16 low
 * nibbles of its 16 bytes, then the 16 high ones: x is permuted to match, quant_permute with
 * chunk 32), 8-bit in order. Constant shifts and byte loads: a compiler vectorizes both. */
static inline __attribute__((always_inline)) void qport_unpack(const uint8_t *b, int group,
                                                               const int BITS, float *q) {
  if (BITS == 4) {
    for (int k = 0; k < group; k += 32)
      for (int m = 0; m < 16; m++) {
        q[k + m] = (float)(b[k / 2 + m] & 15u);
        q[k + 16 + m] = (float)(b[k / 2 + m] >> 4);
      }
  } else {
    for (int m = 0; m < group; m++) q[m] = (float)b[m];
  }
}

/* acc[l] += s * sum_k q[16k + l] * x[16k + l] for n a multiple of 16: 16 independent partial
 * sums (no reduction in the loop, so it vectorizes without -ffast-math). */
static inline __attribute__((always_inline)) void qport_dot16(const float *q, const float *x, int n,
                                                              float s, float *acc) {
  float t[16] = {0.0f};
  for (int k = 0; k < n; k += 16)
    for (int l = 0; l < 16; l++) t[l] += q[k + l] * x[k + l];
  for (int l = 0; l < 16; l++) acc[l] += s * t[l];
}

static inline __attribute__((always_inline)) void qport_bits(const qjob *j, int o0, int o1,
                                                             const int BITS) {
  const int G = j->in / j->group, group = j->group;
  const long wbytes = (long)j->in * BITS / 8;
  float q[128], acc[16][16];
  for (int o = o0; o < o1; o++) {
    const uint8_t *wr = (const uint8_t *)j->w + (long)o * wbytes;
    for (int r = 0; r < j->rows; r++)
      for (int l = 0; l < 16; l++) acc[r][l] = 0.0f;
    for (int g = 0; g < G; g++) {
      qport_unpack(wr + (long)g * group * BITS / 8, group, BITS, q);
      float s = quant_at(j->scales, (long)o * G + g, j->half);
      for (int r = 0; r < j->rows; r++)
        qport_dot16(q, j->xp + (long)r * j->in + (long)g * group, group, s, acc[r]);
    }
    for (int r = 0; r < j->rows; r++) {
      float t = 0.0f;
      for (int l = 0; l < 16; l++) t += acc[r][l];
      j->y[(long)r * j->ldy + o] = t + quant_bias_term(j, r, o);
    }
  }
}

/* Any CPU: rows <= 16, bits 4 or 8, groups 32/64/128. */
static void qpart_portable(const qjob *j, int o0, int o1) {
  if (j->bits == 4) qport_bits(j, o0, o1, 4);
  else qport_bits(j, o0, o1, 8);
}

#if MLXCEL_QUANT_X86
/* Prefetch NC columns QUANT_PREFETCH_COLS after column o (codes, scales and biases), when
 * there are such columns. */
static inline __attribute__((always_inline)) void qprefetch_cols(const qjob *j, int o, const int NC,
                                                                 long wbytes) {
  if (o + NC + QUANT_PREFETCH_COLS >= j->out) return;
  const int G = j->in / j->group;
  for (int c = 0; c < NC; c++) {
    long a = o + c + QUANT_PREFETCH_COLS;
    const char *next = (const char *)j->w + a * wbytes;
    for (long b = 0; b < wbytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    _mm_prefetch(quant_addr(j->scales, a * G, j->half), _MM_HINT_T0);
    _mm_prefetch(quant_addr(j->biases, a * G, j->half), _MM_HINT_T0);
  }
}

/* ---------------- AVX-512 ---------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx2,f16c")

/* quant_at with the CPU's conversion */
static inline __attribute__((always_inline)) float qs512(const void *p, long i, int half) {
  if (half == QUANT_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
  if (half == QUANT_BF16) return quant_bf16(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

/* The bias term sum_g biases[o][g] * xsum[r][g] as a vector to add before the final sum (a
 * scalar loop is one dependent chain of G FMAs: as long as the column's dot product). */
static inline __attribute__((always_inline)) __m512 bias512(const qjob *j, int r, int o) {
  const int G = j->in / j->group;
  const float *s = j->xsum + (long)r * G;
  __m512 t = _mm512_setzero_ps();
  if (j->half == QUANT_F32) {
    const float *b = (const float *)j->biases + (long)o * G;
    for (int g = 0; g < G; g += 16) {
      __mmask16 m = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1u);
      t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, b + g), _mm512_maskz_loadu_ps(m, s + g), t);
    }
    return t;
  }
  const uint16_t *b = (const uint16_t *)j->biases + (long)o * G;
  for (int g = 0; g < G; g += 16) {
    __mmask16 m = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1u);
    __m256i h = _mm256_maskz_loadu_epi16(m, b + g);
    __m512 bv = j->half == QUANT_F16
                    ? _mm512_cvtph_ps(h)
                    : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    t = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(m, s + g), t);
  }
  return t;
}

/* A column's G scales or biases from `at` as float32: the array itself when it is float32,
 * else converted into `buf` 16 at a time, or NULL when G > QCOL_MAX_G (then read per group:
 * one conversion per group on the critical path costs the 1-row kernel ~3 %, the strips ~8 %). */
static inline __attribute__((always_inline)) const float *qcol512(const void *p, long at, int G,
                                                                  int half, float *buf) {
  if (half == QUANT_F32) return (const float *)p + at;
  if (G > QCOL_MAX_G) return NULL;
  const uint16_t *h = (const uint16_t *)p + at;
  for (int g = 0; g < G; g += 16) {
    __mmask16 m = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1u);
    __m256i v = _mm256_maskz_loadu_epi16(m, h + g);
    __m512 f = half == QUANT_F16
                   ? _mm512_cvtph_ps(v)
                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    _mm512_mask_storeu_ps(buf + g, m, f);
  }
  return buf;
}


/* R rows (from r0) against NC output columns (from o0), BITS constant: two accumulators per
 * (column, row) (the 32 values of a step go to separate FMA chains). */
static inline __attribute__((always_inline)) void q512_tile(const qjob *j, int r0, const int R,
                                                            int o0, const int NC,
                                                            const int BITS) {
  __m512 acc[2][8][2];
#pragma GCC unroll 8
  for (int c = 0; c < NC; c++)
  #pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[c][r][0] = acc[c][r][1] = _mm512_setzero_ps();
  const int G = j->in / j->group, group = j->group, in = j->in;
  const long wbytes = (long)in * BITS / 8;
  float sbuf[2][QCOL_MAX_G];
  const float *sc[2];
#pragma GCC unroll 8
  for (int c = 0; c < NC; c++) sc[c] = qcol512(j->scales, (long)(o0 + c) * G, G, j->half, sbuf[c]);
  if (r0 == 0) qprefetch_cols(j, o0, NC, wbytes); /* the columns after these */
  for (int g = 0; g < G; g++) {
  #pragma GCC unroll 8
    for (int c = 0; c < NC; c++) {
      float scale = sc[c] ? sc[c][g] : qs512(j->scales, (long)(o0 + c) * G + g, j->half);
      const uint8_t *p = (const uint8_t *)j->w + (long)(o0 + c) * wbytes + (long)g * group * BITS / 8;
      const float *xg = j->xp + (long)r0 * in + (long)g * group;
      {   /* 8-bit (4-bit: q512_tile4): the group's sums of q * x, then times the scale */
        __m512 ga[8][2];
  #pragma GCC unroll 8
        for (int r = 0; r < R; r++) ga[r][0] = ga[r][1] = _mm512_setzero_ps();
        for (int k = 0; k < group; k += 32) {
          __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k)));
          __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k + 16)));
          __m512 lo = _mm512_cvtepi32_ps(v0), hi = _mm512_cvtepi32_ps(v1);
    #pragma GCC unroll 8
          for (int r = 0; r < R; r++) {
            const float *xr = xg + (long)r * in + k;
            ga[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), ga[r][0]);
            ga[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), ga[r][1]);
          }
        }
        __m512 s = _mm512_set1_ps(scale);
  #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          acc[c][r][0] = _mm512_fmadd_ps(s, ga[r][0], acc[c][r][0]);
          acc[c][r][1] = _mm512_fmadd_ps(s, ga[r][1], acc[c][r][1]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; c++)
  #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      __m512 t = _mm512_add_ps(acc[c][r][0], acc[c][r][1]);
      j->y[(long)(r0 + r) * j->ldy + o0 + c] =
          _mm512_reduce_add_ps(_mm512_add_ps(t, bias512(j, r0 + r, o0 + c)));
    }
}

/* 4-bit, R <= 4 rows against NC <= 2 columns, the columns' steps interleaved (each step's x
 * loaded once for both): at one row 2x the one-column-at-a-time loop (measured, 1 thread:
 * 576 -> 3072 0.21 -> 0.10 ms, 1536 -> 65536 11.5 -> 4.9 ms); at 8-16 rows about even. */
static inline __attribute__((always_inline)) void q512_tile4(const qjob *j, int r0, const int R,
                                                             int o0, const int NC) {
  __m512 acc[2][4][2];
#pragma GCC unroll 8
  for (int c = 0; c < NC; c++)
  #pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[c][r][0] = acc[c][r][1] = _mm512_setzero_ps();
  const int G = j->in / j->group, group = j->group, in = j->in;
  const long wbytes = (long)in / 2;
  /* the 16 values q * scale of a group in one register, picked by the nibbles (vpermps reads
   * an index's low 4 bits: no masking), instead of convert and multiply */
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float sbuf[2][QCOL_MAX_G];
  const float *sc[2];
#pragma GCC unroll 8
  for (int c = 0; c < NC; c++) sc[c] = qcol512(j->scales, (long)(o0 + c) * G, G, j->half, sbuf[c]);
  if (r0 == 0) qprefetch_cols(j, o0, NC, wbytes); /* the columns after these */
  for (int g = 0; g < G; g++) {
    __m512 ts[2];
    const uint8_t *p[2];
  #pragma GCC unroll 8
    for (int c = 0; c < NC; c++) {
      float scale = sc[c] ? sc[c][g] : qs512(j->scales, (long)(o0 + c) * G + g, j->half);
      ts[c] = _mm512_mul_ps(table, _mm512_set1_ps(scale));
      p[c] = (const uint8_t *)j->w + (long)(o0 + c) * wbytes + (long)g * group / 2;
    }
    const float *xg = j->xp + (long)r0 * in + (long)g * group;
    for (int k = 0; k < group; k += 32) {
      __m512 lo[2], hi[2];
#pragma GCC unroll 8
      for (int c = 0; c < NC; c++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p[c] + k / 2)));
        lo[c] = _mm512_permutexvar_ps(v, ts[c]);
        hi[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts[c]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        const float *xr = xg + (long)r * in + k;
        __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16);
  #pragma GCC unroll 8
        for (int c = 0; c < NC; c++) {
          acc[c][r][0] = _mm512_fmadd_ps(lo[c], xa, acc[c][r][0]);
          acc[c][r][1] = _mm512_fmadd_ps(hi[c], xb, acc[c][r][1]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; c++)
  #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      __m512 t = _mm512_add_ps(acc[c][r][0], acc[c][r][1]);
      j->y[(long)(r0 + r) * j->ldy + o0 + c] =
          _mm512_reduce_add_ps(_mm512_add_ps(t, bias512(j, r0 + r, o0 + c)));
    }
}

static void qpart_512_4bit(const qjob *j, int o0, int o1) {
  for (int r0 = 0; r0 < j->rows; r0 += 4) {
    int R = j->rows - r0 < 4 ? j->rows - r0 : 4;
    int o = o0;
    for (; o + 2 <= o1; o += 2) {
      switch (R) {
        case 1: q512_tile4(j, r0, 1, o, 2); break;
        case 2: q512_tile4(j, r0, 2, o, 2); break;
        case 3: q512_tile4(j, r0, 3, o, 2); break;
        default: q512_tile4(j, r0, 4, o, 2); break;
      }
    }
    for (; o < o1; o++) {
      switch (R) {
        case 1: q512_tile4(j, r0, 1, o, 1); break;
        case 2: q512_tile4(j, r0, 2, o, 1); break;
        case 3: q512_tile4(j, r0, 3, o, 1); break;
        default: q512_tile4(j, r0, 4, o, 1); break;
      }
    }
  }
}

#define Q512_CASE(R, NC) q512_tile(j, r0, R, o, NC, 8);

static void qpart_512_few(const qjob *j, int o0, int o1) {
  const int bits = j->bits;
  if (bits == 4) {
    qpart_512_4bit(j, o0, o1);
    return;
  }
  for (int r0 = 0; r0 < j->rows; r0 += 8) {
    int R = j->rows - r0 < 8 ? j->rows - r0 : 8;
    int o = o0;
    if (R <= 2)
      for (; o + 2 <= o1; o += 2) {
        if (R == 1) { Q512_CASE(1, 2) } else { Q512_CASE(2, 2) }
      }
    for (; o < o1; o++) {
      switch (R) {
        case 1: Q512_CASE(1, 1) break;
        case 2: Q512_CASE(2, 1) break;
        case 3: Q512_CASE(3, 1) break;
        case 4: Q512_CASE(4, 1) break;
        case 5: Q512_CASE(5, 1) break;
        case 6: Q512_CASE(6, 1) break;
        case 7: Q512_CASE(7, 1) break;
        default: Q512_CASE(8, 1) break;
      }
    }
  }
}
#undef Q512_CASE

/* ---- strips (AVX-512): several rows (QUANT_STRIP_MIN_ROWS..16) ----
 * The few-row kernel above dequantizes in registers per row block, so at 8 rows it spends its
 * time unpacking (it is out of arithmetic, not memory). Here QSTRIP output columns at a time
 * are dequantized once (w = scale * q + bias, in x's permuted lane order) into a small
 * L1-resident float32 scratch, then a register tile of float FMAs (R rows x 4 columns, the
 * float few-row kernel's dot-product form) runs over every row against it. */
#define QSTRIP 4
#define QSTRIP_STACK_IN 4096 /* `in` up to this: the scratch on the stack (64 KB), else malloc */


static void qdeq_strip512(const qjob *j, int o0, int nc, float *dst) {
  const int G = j->in / j->group, group = j->group, in = j->in;
  const long wbytes = (long)in * j->bits / 8;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float sbuf[QCOL_MAX_G], bbuf[QCOL_MAX_G];
  for (int c = 0; c < nc; c++) {
    const long o = o0 + c;
    const uint8_t *wr = (const uint8_t *)j->w + o * wbytes;
    float *d = dst + (long)c * in;
    const float *sc = qcol512(j->scales, o * G, G, j->half, sbuf);
    const float *bc = qcol512(j->biases, o * G, G, j->half, bbuf);
    for (int g = 0; g < G; g++) {
      __m512 s = _mm512_set1_ps(sc ? sc[g] : qs512(j->scales, o * G + g, j->half));
      __m512 b = _mm512_set1_ps(bc ? bc[g] : qs512(j->biases, o * G + g, j->half));
      float *dg = d + (long)g * group;
      if (j->bits == 4) { /* lanes as xp: a chunk's 16 even values, then its 16 odd ones */
        __m512 ts = _mm512_add_ps(_mm512_mul_ps(table, s), b);
        const uint8_t *p = wr + (long)g * group / 2;
        for (int k = 0; k < group; k += 32) {
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k / 2)));
          _mm512_storeu_ps(dg + k, _mm512_permutexvar_ps(v, ts));
          _mm512_storeu_ps(dg + k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts));
        }
      } else {
        const uint8_t *p = wr + (long)g * group;
        for (int k = 0; k < group; k += 16) {
          __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k))));
          _mm512_storeu_ps(dg + k, _mm512_add_ps(_mm512_mul_ps(q, s), b));
        }
      }
    }
  }
}

/* y[r0 .. r0+R)[o0 .. o0+NC) = x rows . the strip's columns (float FMAs, 16 lanes a step) */
static inline __attribute__((always_inline)) void qstrip512_tile(const qjob *j, int r0, const int R,
                                                                 const float *ws, int o0,
                                                                 const int NC) {
  const int in = j->in;
  __m512 acc[6][QSTRIP];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
  const float *x = j->xp + (long)r0 * in;
  for (int k = 0; k < in; k += 16) {
    __m512 w[QSTRIP];
    for (int c = 0; c < NC; c++) w[c] = _mm512_loadu_ps(ws + (long)c * in + k);
    for (int r = 0; r < R; r++) {
      __m512 xv = _mm512_loadu_ps(x + (long)r * in + k);
      for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(w[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++) {
    float *yr = j->y + (long)(r0 + r) * j->ldy + o0;
    if (NC == 4) { /* the four sums at once: halves added, then two rounds of hadd */
      __m256 h[4];
      for (int c = 0; c < 4; c++)
        h[c] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1)));
      __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
      _mm_storeu_ps(yr, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    } else {
      for (int c = 0; c < NC; c++) yr[c] = _mm512_reduce_add_ps(acc[r][c]);
    }
  }
}

#define QSTRIP512_ROWS(NC)                                          \
  for (int r0 = 0; r0 < j->rows;) {                                 \
    int left = j->rows - r0;                                        \
    if (left >= 6) { qstrip512_tile(j, r0, 6, ws, o, NC); r0 += 6; }  \
    else if (left == 5) { qstrip512_tile(j, r0, 5, ws, o, NC); r0 += 5; } \
    else if (left == 4) { qstrip512_tile(j, r0, 4, ws, o, NC); r0 += 4; } \
    else if (left == 3) { qstrip512_tile(j, r0, 3, ws, o, NC); r0 += 3; } \
    else if (left == 2) { qstrip512_tile(j, r0, 2, ws, o, NC); r0 += 2; } \
    else { qstrip512_tile(j, r0, 1, ws, o, NC); r0 += 1; }          \
  }

static void qstrip_512(const qjob *j, int o0, int o1) {
  float stack[QSTRIP * QSTRIP_STACK_IN] __attribute__((aligned(64)));
  float *ws = j->in <= QSTRIP_STACK_IN ? stack : malloc(sizeof(float) * QSTRIP * j->in);
  if (!ws) { qpart_512_few(j, o0, o1); return; }
  for (int o = o0; o < o1; o += QSTRIP) {
    int nc = o1 - o < QSTRIP ? o1 - o : QSTRIP;
    qdeq_strip512(j, o, nc, ws);
    switch (nc) {
      case 1: QSTRIP512_ROWS(1) break;
      case 2: QSTRIP512_ROWS(2) break;
      case 3: QSTRIP512_ROWS(3) break;
      default: QSTRIP512_ROWS(4) break;
    }
  }
  if (ws != stack) free(ws);
}
#undef QSTRIP512_ROWS

/* ---- one row (a decode step of one sequence, its output head): 16 columns at a time ----
 * With SmolLM2's 576-wide layers a column is only 18 groups, and the tiles above spend about
 * as long on each column's fixed work (its scales converted, its bias term, a horizontal sum,
 * a scalar store) as on its weights. Here each column's dot product (bias term included) stays
 * a vector, and 16 of them are summed at once by a transpose tree (qsum16_512: ~2 shuffles a
 * column instead of ~8) and stored as one vector. Same arithmetic as q512_tile4 / q512_tile
 * (per-group sums times the scale, the bias term from the per-group sums of x), so the same
 * results up to summation order. */

/* per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3] */
static inline __attribute__((always_inline)) __m512 qhadd512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* [a.l0+a.l1, a.l2+a.l3, b.l0+b.l1, b.l2+b.l3] over the four 128-bit lanes */
static inline __attribute__((always_inline)) __m512 qlanes512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

/* The 16 lane sums of v[0..15], in order, in one vector (~3 instructions a sum, not ~12; also
 * fused_ops.c's scores512). */
static inline __attribute__((always_inline)) __m512 qsum16_512(const __m512 *v) {
  __m512 g[4];
  for (int k = 0; k < 4; k++)
    g[k] = qhadd512(qhadd512(v[4 * k], v[4 * k + 1]), qhadd512(v[4 * k + 2], v[4 * k + 3]));
  return qlanes512(qlanes512(g[0], g[1]), qlanes512(g[2], g[3]));
}

/* Columns o and o + 1 (NC of them) of one row as vectors (lane sums = the outputs). */
static inline __attribute__((always_inline)) void qrow1_pair512(const qjob *j, int o, const int NC,
                                                                const int BITS, const int GROUP,
                                                                __m512 *out) {
  const int group = GROUP ? GROUP : j->group, G = j->in / group, in = j->in;
  const long wbytes = (long)in * BITS / 8;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[2][2];
  float sbuf[2][QCOL_MAX_G];
  const float *sc[2];
#pragma GCC unroll 2
  for (int c = 0; c < NC; c++) {
    acc[c][0] = bias512(j, 0, o + c); /* the bias term's partial sums */
    acc[c][1] = _mm512_setzero_ps();
    sc[c] = qcol512(j->scales, (long)(o + c) * G, G, j->half, sbuf[c]);
  }
  const uint8_t *p[2];
#pragma GCC unroll 2
  for (int c = 0; c < NC; c++) p[c] = (const uint8_t *)j->w + (long)(o + c) * wbytes;
  qprefetch_cols(j, o, NC, wbytes);
  for (int g = 0; g < G; g++) {
    const float *xg = j->xp + (long)g * group;
    if (BITS == 4) {
      __m512 ts[2];
#pragma GCC unroll 2
      for (int c = 0; c < NC; c++)
        ts[c] = _mm512_mul_ps(table, _mm512_set1_ps(sc[c] ? sc[c][g] : qs512(j->scales, (long)(o + c) * G + g, j->half)));
      for (int k = 0; k < group; k += 32) {
        __m512 xa = _mm512_loadu_ps(xg + k), xb = _mm512_loadu_ps(xg + k + 16);
  #pragma GCC unroll 2
        for (int c = 0; c < NC; c++) {
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p[c] + ((long)g * group + k) / 2)));
          acc[c][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, ts[c]), xa, acc[c][0]);
          acc[c][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts[c]), xb, acc[c][1]);
        }
      }
    } else {
#pragma GCC unroll 2
      for (int c = 0; c < NC; c++) {
        __m512 ga0 = _mm512_setzero_ps(), ga1 = _mm512_setzero_ps();
        const uint8_t *pg = p[c] + (long)g * group;
        for (int k = 0; k < group; k += 32) {
          __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pg + k))));
          __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pg + k + 16))));
          ga0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg + k), ga0);
          ga1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + k + 16), ga1);
        }
        __m512 s = _mm512_set1_ps(sc[c] ? sc[c][g] : qs512(j->scales, (long)(o + c) * G + g, j->half));
        acc[c][0] = _mm512_fmadd_ps(s, ga0, acc[c][0]);
        acc[c][1] = _mm512_fmadd_ps(s, ga1, acc[c][1]);
      }
    }
  }
#pragma GCC unroll 2
  for (int c = 0; c < NC; c++) out[c] = _mm512_add_ps(acc[c][0], acc[c][1]);
}

/* A block's 128 codes (16 words) against x in quant_permute_words' order: acc + sv * the
 * per-lane sums (sv: each lane's group scale). */
static inline __attribute__((always_inline)) __m512 qw_block(__m512i v, const __m512 *x, __m512 sv,
                                                             __m512 acc) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 g0 = _mm512_mul_ps(_mm512_permutexvar_ps(v, table), x[0]);
  __m512 g1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), x[1]);
  g0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), table), x[2], g0);
  g1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), table), x[3], g1);
  g0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 16), table), x[4], g0);
  g1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 20), table), x[5], g1);
  g0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 24), table), x[6], g0);
  g1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 28), table), x[7], g1);
  return _mm512_fmadd_ps(sv, _mm512_add_ps(g0, g1), acc);
}

/* The scale vector of `n` groups from group g0 of column o, converted one by one (columns of
 * more than QCOL_MAX_G groups). */
static inline __attribute__((always_inline)) __m512 qw_scales(const qjob *j, int o, int g0, int n,
                                                              __m512i sidx) {
  const int G = j->in / j->group;
  float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int g = 0; g < n; g++) t[g] = qs512(j->scales, (long)o * G + g0 + g, j->half);
  return _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(t)));
}

/* One row, 4-bit, on whole words (MLXCEL_QUANT_ROW1W, on by default): a 64-byte load is 16
 * words of 8 codes each (word i: the values 8i..8i+7 of a 128-value block, code k in bits
 * 4k..4k+3), and code k of every word is the k-th shift's permute index (vpermps reads an
 * index's low 4 bits: no widening load, no mask). x comes permuted to match
 * (quant_permute_words: value 8i + k of each block at 16k + i, zero past `in`), so a block is
 * 8 permutes and 8 FMAs into per-lane sums, each lane's group scale applied once a block (the
 * scales of the block's groups spread over its lanes). Same arithmetic as qrow1_pair512 (per
 * group sums times the scale, the bias term from the per-group sums of x), summed in another
 * order. Measured on SmolLM2's 4-bit group-32 shapes: docs/benchmarks.md. */
static inline __attribute__((always_inline)) void qrow1w_pair512(const qjob *j, int o, const int NC,
                                                                 const int GROUP, __m512 *out) {
  const int group = GROUP ? GROUP : j->group, G = j->in / group, in = j->in;
  const long wbytes = in / 2;
  /* lane i of a block covers values 8i..8i+7: group 8i / group of the block's 128 / group */
  const __m512i sidx = group == 32   ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                       : group == 64 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                     : _mm512_setzero_si512();
  const int per = QW_BLOCK / group; /* groups a block: 4, 2 or 1 */
  __m512 acc[2];
  float sbuf[2][QCOL_MAX_G];
  const float *sc[2];
  const uint8_t *p[2];
#pragma GCC unroll 2
  for (int c = 0; c < NC; c++) {
    acc[c] = bias512(j, 0, o + c);
    sc[c] = qcol512(j->scales, (long)(o + c) * G, G, j->half, sbuf[c]);
    p[c] = (const uint8_t *)j->w + (long)(o + c) * wbytes;
  }
  qprefetch_cols(j, o, NC, wbytes);
  const int full = in / QW_BLOCK, left = in % QW_BLOCK; /* left: a multiple of the group */
  for (int b = 0; b < full; b++) {
    const float *xb = j->xp + (long)b * QW_BLOCK;
    __m512 x[8];
    for (int k = 0; k < 8; k++) x[k] = _mm512_loadu_ps(xb + 16 * k);
#pragma GCC unroll 2
    for (int c = 0; c < NC; c++) {
      __m512 sv;
      const float *sb = sc[c] ? sc[c] + (long)b * per : NULL;
      if (!sb) sv = qw_scales(j, o + c, b * per, per, sidx);
      else if (group == 32) sv = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(sb)));
      else if (group == 64) sv = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)sb))));
      else sv = _mm512_set1_ps(sb[0]);
      acc[c] = qw_block(_mm512_loadu_si512(p[c] + (long)b * (QW_BLOCK / 2)), x, sv, acc[c]);
    }
  }
  if (left) { /* the last, partial block: its words and groups masked, x zero past `in` */
    const float *xb = j->xp + (long)full * QW_BLOCK;
    const __mmask16 wm = (__mmask16)((1u << (left / 8)) - 1u), sm = (__mmask16)((1u << (left / group)) - 1u);
    __m512 x[8];
    for (int k = 0; k < 8; k++) x[k] = _mm512_loadu_ps(xb + 16 * k);
#pragma GCC unroll 2
    for (int c = 0; c < NC; c++) {
      __m512 sv = sc[c] ? _mm512_permutexvar_ps(sidx, _mm512_maskz_loadu_ps(sm, sc[c] + (long)full * per))
                        : qw_scales(j, o + c, full * per, left / group, sidx);
      acc[c] = qw_block(_mm512_maskz_loadu_epi32(wm, p[c] + (long)full * (QW_BLOCK / 2)), x, sv, acc[c]);
    }
  }
  for (int c = 0; c < NC; c++) out[c] = acc[c];
}

/* qrow1_512 for BITS and GROUP constant (each format quant_format_ok takes). */
static inline __attribute__((always_inline)) void qrow1_512_as(const qjob *j, int o0, int o1,
                                                               const int BITS, const int GROUP) {
  __m512 v[16];
  for (int ob = o0; ob < o1; ob += 16) {
    int n = o1 - ob < 16 ? o1 - ob : 16, c = 0;
    if (BITS == 4 && quant_row1_words) {
      for (; c + 2 <= n; c += 2) qrow1w_pair512(j, ob + c, 2, GROUP, v + c);
      if (c < n) qrow1w_pair512(j, ob + c, 1, GROUP, v + c), c++;
    } else {
      for (; c + 2 <= n; c += 2) qrow1_pair512(j, ob + c, 2, BITS, GROUP, v + c);
      if (c < n) qrow1_pair512(j, ob + c, 1, BITS, GROUP, v + c), c++;
    }
    for (; c < 16; c++) v[c] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(j->y + ob, (__mmask16)((1u << n) - 1u), qsum16_512(v));
  }
}

/* One row: the common groups as constants (the compiler unrolls a group's steps). */
static void qrow1_512(const qjob *j, int o0, int o1) {
  if (j->bits == 4) {
    if (j->group == 32) qrow1_512_as(j, o0, o1, 4, 32);
    else if (j->group == 64) qrow1_512_as(j, o0, o1, 4, 64);
    else qrow1_512_as(j, o0, o1, 4, 128);
  } else {
    if (j->group == 32) qrow1_512_as(j, o0, o1, 8, 32);
    else if (j->group == 64) qrow1_512_as(j, o0, o1, 8, 64);
    else qrow1_512_as(j, o0, o1, 8, 128);
  }
}

static void qpart_512(const qjob *j, int o0, int o1) {
  if (j->rows == 1 && quant_row1_nc) qrow1_512(j, o0, o1);
  else if (quant_strip_rows && j->rows >= quant_strip_rows) qstrip_512(j, o0, o1);
  else qpart_512_few(j, o0, o1);
}

/* quant_dequantize (below) with AVX-512: w = scale * q + bias, 32 values a step, in order. */
static void dequant512(const mlxcel_matrix *m, int in, int o0, int o1, float *dst) {
  const int G = in / m->group, group = m->group;
  const long wbytes = (long)in * m->bits / 8;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int o = o0; o < o1; o++) {
    const uint8_t *wr = (const uint8_t *)m->w + (long)o * wbytes;
    float *d = dst + (long)(o - o0) * in;
    for (int g = 0; g < G; g++) {
      __m512 s = _mm512_set1_ps(qs512(m->scales, (long)o * G + g, m->half));
      __m512 b = _mm512_set1_ps(qs512(m->biases, (long)o * G + g, m->half));
      float *dg = d + (long)g * group;
      if (m->bits == 4) {
        __m512 ts = _mm512_add_ps(_mm512_mul_ps(table, s), b);
        const uint8_t *p = wr + (long)g * group / 2;
        for (int k = 0; k < group; k += 32) {
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k / 2)));
          __m512 lo = _mm512_permutexvar_ps(v, ts);
          __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts);
          _mm512_storeu_ps(dg + k, _mm512_permutex2var_ps(lo, even, hi));
          _mm512_storeu_ps(dg + k + 16, _mm512_permutex2var_ps(lo, odd, hi));
        }
      } else {
        const uint8_t *p = wr + (long)g * group;
        for (int k = 0; k < group; k += 16) {
          __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k))));
          _mm512_storeu_ps(dg + k, _mm512_add_ps(_mm512_mul_ps(q, s), b));
        }
      }
    }
  }
}
#pragma GCC pop_options

/* ---------------- AVX2 + FMA ---------------- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* quant_at with the CPU's conversion */
static inline __attribute__((always_inline)) float qs256(const void *p, long i, int half) {
  if (half == QUANT_F16) return _cvtsh_ss(((const uint16_t *)p)[i]);
  if (half == QUANT_BF16) return quant_bf16(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

static inline __attribute__((always_inline)) __m256 bias256(const qjob *j, int r, int o) {
  const int G = j->in / j->group;
  const float *s = j->xsum + (long)r * G;
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 t = _mm256_setzero_ps();
  if (j->half == QUANT_F32) {
    const float *b = (const float *)j->biases + (long)o * G;
    for (int g = 0; g < G; g += 8) {
      __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(G - g), idx);
      t = _mm256_fmadd_ps(_mm256_maskload_ps(b + g, m), _mm256_maskload_ps(s + g, m), t);
    }
    return t;
  }
  const uint16_t *b = (const uint16_t *)j->biases + (long)o * G;
  for (int g = 0; g < G; g += 8) {
    __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(G - g), idx);
    uint16_t tail[8] = {0};
    const uint16_t *bg = b + g;
    if (G - g < 8) { /* the lanes past G read as 0, as the masked float32 load gives */
      memcpy(tail, bg, sizeof(uint16_t) * (size_t)(G - g));
      bg = tail;
    }
    __m128i h = _mm_loadu_si128((const __m128i *)bg);
    __m256 bv = j->half == QUANT_F16
                    ? _mm256_cvtph_ps(h)
                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    t = _mm256_fmadd_ps(bv, _mm256_maskload_ps(s + g, m), t);
  }
  return t;
}

/* qcol512 with AVX2: 8 at a time, the tail one at a time. */
static inline __attribute__((always_inline)) const float *qcol256(const void *p, long at, int G,
                                                                  int half, float *buf) {
  if (half == QUANT_F32) return (const float *)p + at;
  if (G > QCOL_MAX_G) return NULL;
  const uint16_t *h = (const uint16_t *)p + at;
  int g = 0;
  for (; g + 8 <= G; g += 8) {
    __m128i v = _mm_loadu_si128((const __m128i *)(h + g));
    __m256 f = half == QUANT_F16
                   ? _mm256_cvtph_ps(v)
                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    _mm256_storeu_ps(buf + g, f);
  }
  for (; g < G; g++) buf[g] = qs256(h, g, half);
  return buf;
}

static inline __attribute__((always_inline)) void q256_tile(const qjob *j, int r0, const int R,
                                                            int o0, const int NC,
                                                            const int BITS) {
  __m256 acc[2][4][2];
#pragma GCC unroll 4
  for (int c = 0; c < NC; c++)
  #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[c][r][0] = acc[c][r][1] = _mm256_setzero_ps();
  const int G = j->in / j->group, group = j->group, in = j->in;
  const long wbytes = (long)in * BITS / 8;
  const __m256i low = _mm256_set1_epi32(0xF);
  float sbuf[2][QCOL_MAX_G];
  const float *sc[2];
#pragma GCC unroll 4
  for (int c = 0; c < NC; c++) sc[c] = qcol256(j->scales, (long)(o0 + c) * G, G, j->half, sbuf[c]);
  if (r0 == 0) qprefetch_cols(j, o0, NC, wbytes); /* the columns after these */
  for (int g = 0; g < G; g++) {
  #pragma GCC unroll 4
    for (int c = 0; c < NC; c++) {
      const uint8_t *p = (const uint8_t *)j->w + (long)(o0 + c) * wbytes + (long)g * group * BITS / 8;
      const float *xg = j->xp + (long)r0 * in + (long)g * group;
      /* the group's sums of q * x, then times the scale */
      __m256 ga[4][2];
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) ga[r][0] = ga[r][1] = _mm256_setzero_ps();
      for (int k = 0; k < group; k += 16) {
        __m256 lo, hi;
        if (BITS == 4) {
          __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + k / 2)));
          lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        } else {
          __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + k)));
          __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + k + 8)));
          lo = _mm256_cvtepi32_ps(v0);
          hi = _mm256_cvtepi32_ps(v1);
        }
  #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
          const float *xr = xg + (long)r * in + k;
          ga[r][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xr), ga[r][0]);
          ga[r][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xr + 8), ga[r][1]);
        }
      }
      __m256 s = _mm256_set1_ps(sc[c] ? sc[c][g] : qs256(j->scales, (long)(o0 + c) * G + g, j->half));
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        acc[c][r][0] = _mm256_fmadd_ps(s, ga[r][0], acc[c][r][0]);
        acc[c][r][1] = _mm256_fmadd_ps(s, ga[r][1], acc[c][r][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < NC; c++)
  #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      __m256 t = _mm256_add_ps(_mm256_add_ps(acc[c][r][0], acc[c][r][1]), bias256(j, r0 + r, o0 + c));
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      j->y[(long)(r0 + r) * j->ldy + o0 + c] = _mm_cvtss_f32(h);
    }
}

/* 1 row, 4-bit, NC columns with their steps interleaved (x loaded once for all), the scale
 * applied to the unpacked values (no per-group partial sums): the AVX-512 1-row scheme
 * (q512_tile4) without its 16-entry table lookup (AVX2 permutes 8 entries). */
static inline __attribute__((always_inline)) void q256_row4(const qjob *j, int o0, const int NC) {
  __m256 acc[4][2];
#pragma GCC unroll 4
  for (int c = 0; c < NC; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  const int G = j->in / j->group, group = j->group, in = j->in;
  const long wbytes = (long)in / 2;
  const __m256i low = _mm256_set1_epi32(0xF);
  float sbuf[4][QCOL_MAX_G];
  const float *sc[4];
#pragma GCC unroll 4
  for (int c = 0; c < NC; c++) sc[c] = qcol256(j->scales, (long)(o0 + c) * G, G, j->half, sbuf[c]);
  qprefetch_cols(j, o0, NC, wbytes); /* the columns after these */
  for (int g = 0; g < G; g++) {
    __m256 s[4];
    const uint8_t *p[4];
  #pragma GCC unroll 4
    for (int c = 0; c < NC; c++) {
      s[c] = _mm256_set1_ps(sc[c] ? sc[c][g] : qs256(j->scales, (long)(o0 + c) * G + g, j->half));
      p[c] = (const uint8_t *)j->w + (long)(o0 + c) * wbytes + (long)g * group / 2;
    }
    const float *xg = j->xp + (long)g * group;
    for (int k = 0; k < group; k += 16) {
      __m256 xa = _mm256_loadu_ps(xg + k), xb = _mm256_loadu_ps(xg + k + 8);
#pragma GCC unroll 4
      for (int c = 0; c < NC; c++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p[c] + k / 2)));
        __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), s[c]);
        __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), s[c]);
        acc[c][0] = _mm256_fmadd_ps(lo, xa, acc[c][0]);
        acc[c][1] = _mm256_fmadd_ps(hi, xb, acc[c][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < NC; c++) {
    __m256 t = _mm256_add_ps(_mm256_add_ps(acc[c][0], acc[c][1]), bias256(j, 0, o0 + c));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    j->y[o0 + c] = _mm_cvtss_f32(h);
  }
}

#define Q256_CASE(R, NC)                                  \
  if (bits == 4) q256_tile(j, r0, R, o, NC, 4);           \
  else q256_tile(j, r0, R, o, NC, 8);

static void qpart_256_few(const qjob *j, int o0, int o1) {
  const int bits = j->bits;
  if (bits == 4 && j->rows == 1 && quant_row1_nc) {
    int o = o0;
    if (quant_row1_nc == 4)
      for (; o + 4 <= o1; o += 4) q256_row4(j, o, 4);
    for (; o + 2 <= o1; o += 2) q256_row4(j, o, 2);
    for (; o < o1; o++) q256_row4(j, o, 1);
    return;
  }
  for (int r0 = 0; r0 < j->rows; r0 += 4) {
    int R = j->rows - r0 < 4 ? j->rows - r0 : 4;
    int o = o0;
    if (R <= 2)
      for (; o + 2 <= o1; o += 2) {
        if (R == 1) { Q256_CASE(1, 2) } else { Q256_CASE(2, 2) }
      }
    for (; o < o1; o++) {
      switch (R) {
        case 1: Q256_CASE(1, 1) break;
        case 2: Q256_CASE(2, 1) break;
        case 3: Q256_CASE(3, 1) break;
        default: Q256_CASE(4, 1) break;
      }
    }
  }
}
#undef Q256_CASE

/* ---- strips (AVX2): as the AVX-512 ones, 8 lanes a step, tiles of up to 3 rows x 4 columns
 * (12 accumulators and the 4 columns' values in the 16 registers, x read from memory) ---- */
static void qdeq_strip256(const qjob *j, int o0, int nc, float *dst) {
  const int G = j->in / j->group, group = j->group, in = j->in;
  const long wbytes = (long)in * j->bits / 8;
  const __m256i low = _mm256_set1_epi32(0xF);
  float sbuf[QCOL_MAX_G], bbuf[QCOL_MAX_G];
  for (int c = 0; c < nc; c++) {
    const long o = o0 + c;
    const uint8_t *wr = (const uint8_t *)j->w + o * wbytes;
    float *d = dst + (long)c * in;
    const float *sc = qcol256(j->scales, o * G, G, j->half, sbuf);
    const float *bc = qcol256(j->biases, o * G, G, j->half, bbuf);
    for (int g = 0; g < G; g++) {
      __m256 s = _mm256_set1_ps(sc ? sc[g] : qs256(j->scales, o * G + g, j->half));
      __m256 b = _mm256_set1_ps(bc ? bc[g] : qs256(j->biases, o * G + g, j->half));
      float *dg = d + (long)g * group;
      if (j->bits == 4) { /* lanes as xp: a chunk's 8 even values, then its 8 odd ones */
        const uint8_t *p = wr + (long)g * group / 2;
        for (int k = 0; k < group; k += 16) {
          __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + k / 2)));
          __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(dg + k, _mm256_add_ps(_mm256_mul_ps(lo, s), b));
          _mm256_storeu_ps(dg + k + 8, _mm256_add_ps(_mm256_mul_ps(hi, s), b));
        }
      } else {
        const uint8_t *p = wr + (long)g * group;
        for (int k = 0; k < group; k += 8) {
          __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + k))));
          _mm256_storeu_ps(dg + k, _mm256_add_ps(_mm256_mul_ps(q, s), b));
        }
      }
    }
  }
}

static inline __attribute__((always_inline)) void qstrip256_tile(const qjob *j, int r0, const int R,
                                                                 const float *ws, int o0,
                                                                 const int NC) {
  const int in = j->in;
  __m256 acc[3][QSTRIP];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
  const float *x = j->xp + (long)r0 * in;
  for (int k = 0; k < in; k += 8) {
    __m256 w[QSTRIP];
    for (int c = 0; c < NC; c++) w[c] = _mm256_loadu_ps(ws + (long)c * in + k);
    for (int r = 0; r < R; r++) {
      __m256 xv = _mm256_loadu_ps(x + (long)r * in + k);
      for (int c = 0; c < NC; c++) acc[r][c] = _mm256_fmadd_ps(w[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++) {
    float *yr = j->y + (long)(r0 + r) * j->ldy + o0;
    __m256 h[QSTRIP];
    for (int c = 0; c < 4; c++) h[c] = c < NC ? acc[r][c] : _mm256_setzero_ps();
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    float sums[4];
    _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    for (int c = 0; c < NC; c++) yr[c] = sums[c];
  }
}

#define QSTRIP256_ROWS(NC)                                              \
  for (int r0 = 0; r0 < j->rows;) {                                     \
    int left = j->rows - r0;                                            \
    if (left >= 3) { qstrip256_tile(j, r0, 3, ws, o, NC); r0 += 3; }    \
    else if (left == 2) { qstrip256_tile(j, r0, 2, ws, o, NC); r0 += 2; } \
    else { qstrip256_tile(j, r0, 1, ws, o, NC); r0 += 1; }              \
  }

static void qstrip_256(const qjob *j, int o0, int o1) {
  float stack[QSTRIP * QSTRIP_STACK_IN] __attribute__((aligned(64)));
  float *ws = j->in <= QSTRIP_STACK_IN ? stack : malloc(sizeof(float) * QSTRIP * j->in);
  if (!ws) { qpart_256_few(j, o0, o1); return; }
  for (int o = o0; o < o1; o += QSTRIP) {
    int nc = o1 - o < QSTRIP ? o1 - o : QSTRIP;
    qdeq_strip256(j, o, nc, ws);
    switch (nc) {
      case 1: QSTRIP256_ROWS(1) break;
      case 2: QSTRIP256_ROWS(2) break;
      case 3: QSTRIP256_ROWS(3) break;
      default: QSTRIP256_ROWS(4) break;
    }
  }
  if (ws != stack) free(ws);
}
#undef QSTRIP256_ROWS

static void qpart_256(const qjob *j, int o0, int o1) {
  if (quant_strip_rows && j->rows >= quant_strip_rows) qstrip_256(j, o0, o1);
  else qpart_256_few(j, o0, o1);
}
#pragma GCC pop_options
#endif /* MLXCEL_QUANT_X86 */

/* ---- dispatch ----------------------------------------------------------------------------- */

static qpart_fn quant_part;      /* the few-row kernel of this CPU (or the forced one) */
static int quant_chunk;          /* its x permutation: values unpacked per chunk (0: none) */
static const char *quant_name = "portable";

/* Called once from pick_isa (fused_ops.c). force: NULL, "avx2" or "portable". */
static void quant_pick(const char *force) {
  quant_part = qpart_portable, quant_chunk = 32, quant_name = "portable", quant_strip_rows = 4;
  const char *strip = getenv("MLXCEL_QUANT_STRIP");
  const char *nc = getenv("MLXCEL_QUANT_ROW1");
  quant_row1_nc = nc && nc[0] ? atoi(nc) : 2;
  const char *words = getenv("MLXCEL_QUANT_ROW1W");
  quant_row1_words = !(words && strcmp(words, "0") == 0);
  if (force && strcmp(force, "portable") == 0) return;
#if MLXCEL_QUANT_X86
  __builtin_cpu_init();
  int want512 = !(force && strcmp(force, "avx2") == 0);
  if (want512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    quant_part = qpart_512, quant_chunk = 32, quant_name = "avx512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c")) {
    quant_part = qpart_256, quant_chunk = 16, quant_name = "avx2";
    /* AVX2 unpacks with convert and multiply (no 16-entry permute): at 4 rows the strips only
     * matched the in-register kernel, from 8 they win (measured, 1 thread) */
    quant_strip_rows = 8;
  }
#endif
  if (strip && strip[0]) quant_strip_rows = atoi(strip);
  if (quant_strip_rows < 0) quant_strip_rows = 0;
}

/* Whether one row of `m` through `part` takes x in quant_permute_words' order. */
static int quant_words(int rows, const mlxcel_matrix *m, qpart_fn part) {
#if MLXCEL_QUANT_X86
  return rows == 1 && m->bits == 4 && part == qpart_512 && quant_row1_nc && quant_row1_words;
#else
  (void)rows, (void)m, (void)part;
  return 0;
#endif
}

/* One row of x in qrow1w_pair512's order: blocks of QW_BLOCK values, value 8i + k of a block
 * at 16k + i; zeros past `in` up to the next block. */
static void quant_permute_words(const float *x, int in, float *xq) {
  for (int b = 0; b < in; b += QW_BLOCK)
    for (int k = 0; k < 8; k++)
      for (int i = 0; i < 16; i++) {
        int at = b + 8 * i + k;
        xq[b + 16 * k + i] = at < in ? x[at] : 0.0f;
      }
}

/* x (rows x in) into the lane order of the 4-bit unpacking: each chunk of `chunk` values as
 * its even-indexed values, then its odd-indexed ones. */
static void quant_permute(const float *x, long rows, int in, int chunk, float *xp) {
  for (long r = 0; r < rows; r++) {
    const float *xr = x + r * in;
    float *pr = xp + r * in;
    for (int c = 0; c < in; c += chunk)
      for (int k = 0; k < chunk / 2; k++) {
        pr[c + k] = xr[c + 2 * k];
        pr[c + chunk / 2 + k] = xr[c + 2 * k + 1];
      }
  }
}

typedef struct {
  qjob job;
  qpart_fn part;
  int chunk_cols, out;
} qchunks;

static void quant_chunk_task(void *arg, int chunk) {
  const qchunks *c = arg;
  int o0 = chunk * c->chunk_cols, o1 = o0 + c->chunk_cols < c->out ? o0 + c->chunk_cols : c->out;
  c->part(&c->job, o0, o1);
}

/* y[r][o] (row stride ldy) for rows <= 16 through `part`, threaded over output columns.
 * Returns 0, -3 out of memory. */
static int quant_few_rows(const float *x, int rows, int in, int out, const mlxcel_matrix *m,
                          qpart_fn part, int chunk, float *y, long ldy) {
  int G = in / m->group, words = quant_words(rows, m, part);
  size_t xfloats = words ? (size_t)(in + QW_BLOCK - 1) / QW_BLOCK * QW_BLOCK
                   : chunk && m->bits == 4 ? (size_t)rows * in : 0;
  float *buf = malloc(sizeof(float) * (xfloats + (size_t)rows * G + 1));
  if (!buf) return -3;
  float *xsum = buf, *xp = xfloats ? buf + (size_t)rows * G : NULL;
  for (int r = 0; r < rows; r++)
    for (int g = 0; g < G; g++) {
      const float *xr = x + (long)r * in + (long)g * m->group;
      float s = 0.0f;
      for (int i = 0; i < m->group; i++) s += xr[i];
      xsum[(long)r * G + g] = s;
    }
  if (xp && words) quant_permute_words(x, in, xp);
  else if (xp) quant_permute(x, rows, in, chunk, xp);
  qchunks c = {{xp ? xp : x, xsum, (const uint32_t *)m->w, m->scales, m->biases, rows, in, out,
                m->bits, m->group, y, ldy, m->half},
               part, out, out};
  long work = (long)rows * in * out;
  int threads = n_threads();
  if (threads > 1 && work >= 65536) {
    int chunks = threads * 8;
    int cols = (out + chunks - 1) / chunks;
    cols = rows == 1 ? (cols + 15) / 16 * 16 : (cols + 3) / 4 * 4; /* qrow1_512's blocks */
    c.chunk_cols = cols;
    parallel_for((out + cols - 1) / cols, quant_chunk_task, &c);
  } else {
    part(&c.job, 0, out);
  }
  free(buf);
  return 0;
}

/* Output rows [o0, o1) of m's weight as float32 rows of `in` (w = scale * q + bias). */
static void quant_dequantize(const mlxcel_matrix *m, int in, int o0, int o1, float *dst) {
  const int G = in / m->group, per = 32 / m->bits, wpr = in * m->bits / 32;
  const uint32_t mask = (1u << m->bits) - 1u;
  for (int o = o0; o < o1; o++) {
    const uint32_t *wr = (const uint32_t *)m->w + (long)o * wpr;
    float *d = dst + (long)(o - o0) * in;
    for (int g = 0; g < G; g++) {
      float s = quant_at(m->scales, (long)o * G + g, m->half);
      float b = quant_at(m->biases, (long)o * G + g, m->half);
      const uint32_t *wg = wr + (long)g * m->group / per;
      float *dg = d + (long)g * m->group;
      for (int w = 0; w < m->group / per; w++) {
        uint32_t word = wg[w];
        for (int k = 0; k < per; k++) dg[w * per + k] = s * (float)((word >> (m->bits * k)) & mask) + b;
      }
    }
  }
}

typedef struct {
  const mlxcel_matrix *m;
  int in, o0, o1, per_task;
  float *dst;
} deq_ctx;

static void deq_task(void *arg, int task) {
  const deq_ctx *c = arg;
  int a = c->o0 + task * c->per_task, b = a + c->per_task < c->o1 ? a + c->per_task : c->o1;
  if (b <= a) return;
#if MLXCEL_QUANT_X86
  if (quant_part == qpart_512) {
    dequant512(c->m, c->in, a, b, c->dst + (long)(a - c->o0) * c->in);
    return;
  }
#endif
  quant_dequantize(c->m, c->in, a, b, c->dst + (long)(a - c->o0) * c->in);
}

/* Output rows dequantized per sgemm call: whole matrices up to QUANT_TILE_BYTES of float32
 * (each call packs x again: SmolLM2's gate/up in 12 tiles of 256 rows cost ~1.3x one call),
 * at least QUANT_TILE_MIN_ROWS. */
#define QUANT_TILE_BYTES (8L << 20)
#define QUANT_TILE_MIN_ROWS 256

/* The tiles' scratch, kept between calls (a fresh multi-MB malloc is an mmap: its page faults
 * every call); a second caller while it is in use gets its own. */
static pthread_mutex_t quant_scratch_lock = PTHREAD_MUTEX_INITIALIZER;
static float *quant_scratch;
static size_t quant_scratch_floats;

static float *quant_scratch_get(size_t floats, int *shared) {
  *shared = 0;
  if (pthread_mutex_trylock(&quant_scratch_lock) != 0) return malloc(sizeof(float) * floats);
  if (quant_scratch_floats < floats) {
    free(quant_scratch);
    quant_scratch = malloc(sizeof(float) * floats);
    quant_scratch_floats = quant_scratch ? floats : 0;
  }
  if (!quant_scratch) {
    pthread_mutex_unlock(&quant_scratch_lock);
    return NULL;
  }
  *shared = 1;
  return quant_scratch;
}

static void quant_scratch_put(float *buf, int shared) {
  if (shared) pthread_mutex_unlock(&quant_scratch_lock);
  else free(buf);
}

typedef void (*quant_sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                              const float *, int, float, float *, int);

/* y = x m^T for any number of rows: tiles of QUANT_TILE_ROWS output rows dequantized into a
 * float32 scratch (threaded on the pool), each through `sgemm` (cblas_sgemm). Returns 0, -3
 * out of memory. */
static int quant_big(const float *x, long rows, int in, int out, const mlxcel_matrix *m,
                     quant_sgemm_t sgemm, float *y) {
  long fit = QUANT_TILE_BYTES / ((long)in * (long)sizeof(float));
  int tile = fit < QUANT_TILE_MIN_ROWS ? QUANT_TILE_MIN_ROWS : (int)(fit < out ? fit : out);
  if (tile > out) tile = out;
  int shared;
  float *scratch = quant_scratch_get((size_t)tile * in, &shared);
  if (!scratch) return -3;
  for (int o0 = 0; o0 < out; o0 += tile) {
    int o1 = o0 + tile < out ? o0 + tile : out;
    int tasks = n_threads() * 2;
    deq_ctx c = {m, in, o0, o1, (o1 - o0 + tasks - 1) / tasks, scratch};
    parallel_for((o1 - o0 + c.per_task - 1) / c.per_task, deq_task, &c);
    sgemm(101, 111, 112, (int)rows, o1 - o0, in, 1.0f, x, in, scratch, in, 0.0f, y + o0, out);
  }
  quant_scratch_put(scratch, shared);
  return 0;
}

/* Without the strips (MLXCEL_QUANT_STRIP=0, the portable path): rows from which the tiles
 * into cblas_sgemm beat the few-row kernel in 16-row blocks
 * (scripts/bench_forward.py's quantized stage, SmolLM2's shapes, AVX-512 dequantization, whole
 * matrices per tile: tiles 1.1-1.6x faster from 64 rows, within 5-20% of float32 sgemm).
 * MLXCEL_QUANT_BIG=direct or =tiles forces one. */
#define QUANT_DIRECT_MAX_ROWS 32

/* y = x m^T for any number of rows (row stride `out`). Returns 0, -3 out of memory. */
static int quant_any_rows(const float *x, long rows, int in, int out, const mlxcel_matrix *m,
                          quant_sgemm_t sgemm, float *y) {
  const char *force = getenv("MLXCEL_QUANT_BIG");
  int tiles = sgemm && rows > QUANT_DIRECT_MAX_ROWS;
#if MLXCEL_QUANT_X86
  /* with the strips, 16-row blocks beat the tiles at every size (SmolLM2 prefill of 256 rows,
   * 4-bit: 922-965 vs 701 tok/s on AVX-512, 520-535 vs 476-494 on AVX2; float32 ~770 / ~650) */
  if (quant_strip_rows && quant_strip_rows <= 16 && (quant_part == qpart_512 || quant_part == qpart_256))
    tiles = 0;
#endif
  if (force && strcmp(force, "direct") == 0) tiles = 0;
  if (force && strcmp(force, "tiles") == 0 && sgemm) tiles = 1;
  if (tiles) return quant_big(x, rows, in, out, m, sgemm, y);
  for (long r0 = 0; r0 < rows; r0 += 16) {
    int n = rows - r0 < 16 ? (int)(rows - r0) : 16;
    int code = quant_few_rows(x + r0 * in, n, in, out, m, quant_part, quant_chunk, y + r0 * out, out);
    if (code) return code;
  }
  return 0;
}

#endif /* MLXCEL_QUANT_KERNELS_H */
