/* The few-row float32 matmul kernels (C = alpha * A B' + beta * C for up to 16 rows of A),
 * shared by fewrow_sgemm.c (the cblas_sgemm in front of OpenBLAS) and fused_ops.c (the native
 * decode step). Every definition is static: each library gets its own copy. Include after
 * pool.h (run_job uses its parallel_for).
 */
#ifndef MLXCEL_FEWROW_KERNELS_H
#define MLXCEL_FEWROW_KERNELS_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* ---- the kernels --------------------------------------------------------------------------
 * C[m][n] = alpha * sum_k A[m][k] * B'[k][n] + beta * C[m][n], beta == 0 never reads C.
 * "dot" layout (transB): B is N x K row-major, so each output is a dot product of two rows.
 * "axpy" layout (no transB): B is K x N row-major, rows of B are scaled and summed.
 * Each kernel computes the columns [n0, n1).
 */

typedef struct {
  int M, N, K, lda, ldb, ldc, trans_b;
  float alpha, beta;
  const float *A, *B;
  float *C;
} gemm_job;

static inline void store_out(const gemm_job *j, int m, int n, float v) {
  float *c = j->C + (size_t)m * j->ldc + n;
  *c = j->beta == 0.0f ? j->alpha * v : j->alpha * v + j->beta * *c;
}

/* ---------------- AVX-512 ---------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx2")

/* Up to 4 rows of A against NT rows of B (dot layout). */
static inline __attribute__((always_inline)) void dot512(const gemm_job *j, int m0, int mt,
                                                         int n0, int NT, const float *pf) {
  __m512 acc[4][4];
  for (int m = 0; m < 4; m++)
    for (int n = 0; n < 4; n++) acc[m][n] = _mm512_setzero_ps();
  const float *a = j->A + (size_t)m0 * j->lda;
  const float *b = j->B + (size_t)n0 * j->ldb;
  const int K = j->K, lda = j->lda, ldb = j->ldb;
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 bv[4];
    for (int n = 0; n < NT; n++) bv[n] = _mm512_loadu_ps(b + (size_t)n * ldb + k);
    if (pf)
      for (int n = 0; n < 4; n++) _mm_prefetch((const char *)(pf + (size_t)n * ldb + k), _MM_HINT_T0);
    for (int m = 0; m < 4; m++) {
      if (m >= mt) break;
      __m512 av = _mm512_loadu_ps(a + (size_t)m * lda + k);
      for (int n = 0; n < NT; n++) acc[m][n] = _mm512_fmadd_ps(av, bv[n], acc[m][n]);
    }
  }
  if (k < K) {
    __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
    __m512 bv[4];
    for (int n = 0; n < NT; n++) bv[n] = _mm512_maskz_loadu_ps(mask, b + (size_t)n * ldb + k);
    for (int m = 0; m < 4; m++) {
      if (m >= mt) break;
      __m512 av = _mm512_maskz_loadu_ps(mask, a + (size_t)m * lda + k);
      for (int n = 0; n < NT; n++) acc[m][n] = _mm512_fmadd_ps(av, bv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < 4; m++) {
    if (m >= mt) break;
    for (int n = 0; n < NT; n++) store_out(j, m0 + m, n0 + n, _mm512_reduce_add_ps(acc[m][n]));
  }
}

/* dot512 with the row and column counts as constants, so the accumulators stay in registers
 * (with a run-time count gcc spills them to the stack: 2-3x slower at 8 rows). */
static void dot512_rows(const gemm_job *j, int m0, int mt, int n, int NT, const float *pf) {
  if (NT == 4) {
    switch (mt) {
      case 4: dot512(j, m0, 4, n, 4, pf); break;
      case 3: dot512(j, m0, 3, n, 4, pf); break;
      case 2: dot512(j, m0, 2, n, 4, pf); break;
      default: dot512(j, m0, 1, n, 4, pf); break;
    }
  } else {
    switch (mt) {
      case 4: dot512(j, m0, 4, n, 1, pf); break;
      case 3: dot512(j, m0, 3, n, 1, pf); break;
      case 2: dot512(j, m0, 2, n, 1, pf); break;
      default: dot512(j, m0, 1, n, 1, pf); break;
    }
  }
}

static void run_dot512(const gemm_job *j, int n0, int n1) {
  /* Columns outermost: a group of 4 rows of B is read from memory once, then from L1 for
   * every group of 4 rows of A. */
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    /* Prefetch the rows of B a group ahead while this group's FMAs run: left to the hardware
     * prefetcher, the loads and the arithmetic serialise at 8+ rows. */
    const float *pf = n + 8 <= n1 ? j->B + (size_t)(n + 4) * j->ldb : NULL;
    for (int m0 = 0; m0 < j->M; m0 += 4) {
      dot512_rows(j, m0, j->M - m0 < 4 ? j->M - m0 : 4, n, 4, pf);
      pf = NULL;
    }
  }
  for (; n < n1; n++)
    for (int m0 = 0; m0 < j->M; m0 += 4)
      dot512_rows(j, m0, j->M - m0 < 4 ? j->M - m0 : 4, n, 1, NULL);
}

/* Up to 4 rows of A against a column block of up to 64 (axpy layout). */
static inline __attribute__((always_inline)) void axpy512(const gemm_job *j, int m0, int mt,
                                                          int n0, int width) {
  __m512 acc[4][4];
  for (int m = 0; m < 4; m++)
    for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
  __mmask16 masks[4];
  for (int v = 0; v < 4; v++) {
    int left = width - 16 * v;
    masks[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
  }
  const float *a = j->A + (size_t)m0 * j->lda;
  for (int k = 0; k < j->K; k++) {
    const float *brow = j->B + (size_t)k * j->ldb + n0;
    __m512 bv[4];
    for (int v = 0; v < 4; v++) bv[v] = _mm512_maskz_loadu_ps(masks[v], brow + 16 * v);
    for (int m = 0; m < 4; m++) {
      if (m >= mt) break;
      __m512 av = _mm512_set1_ps(a[(size_t)m * j->lda + k]);
      for (int v = 0; v < 4; v++) acc[m][v] = _mm512_fmadd_ps(av, bv[v], acc[m][v]);
    }
  }
  float tmp[64];
  for (int m = 0; m < 4; m++) {
    if (m >= mt) break;
    for (int v = 0; v < 4; v++) _mm512_storeu_ps(tmp + 16 * v, acc[m][v]);
    for (int n = 0; n < width; n++) store_out(j, m0 + m, n0 + n, tmp[n]);
  }
}

static void run_axpy512(const gemm_job *j, int n0, int n1) {
  for (int n = n0; n < n1; n += 64)
    for (int m0 = 0; m0 < j->M; m0 += 4)
      axpy512(j, m0, j->M - m0 < 4 ? j->M - m0 : 4, n, n1 - n < 64 ? n1 - n : 64);
}

#pragma GCC pop_options

/* ---------------- AVX2 + FMA ---------------- */
#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __attribute__((always_inline)) float gemm_hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) __m256i gemm_mask256(int left) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), idx);
}

static inline __attribute__((always_inline)) void dot256(const gemm_job *j, int m0, int mt,
                                                         int n0, int NT) {
  __m256 acc[4][2];
  for (int m = 0; m < 4; m++)
    for (int n = 0; n < 2; n++) acc[m][n] = _mm256_setzero_ps();
  const float *a = j->A + (size_t)m0 * j->lda;
  const float *b = j->B + (size_t)n0 * j->ldb;
  const int K = j->K, lda = j->lda, ldb = j->ldb;
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 bv[2];
    for (int n = 0; n < NT; n++) bv[n] = _mm256_loadu_ps(b + (size_t)n * ldb + k);
    for (int m = 0; m < 4; m++) {
      if (m >= mt) break;
      __m256 av = _mm256_loadu_ps(a + (size_t)m * lda + k);
      for (int n = 0; n < NT; n++) acc[m][n] = _mm256_fmadd_ps(av, bv[n], acc[m][n]);
    }
  }
  if (k < K) {
    __m256i mask = gemm_mask256(K - k);
    __m256 bv[2];
    for (int n = 0; n < NT; n++) bv[n] = _mm256_maskload_ps(b + (size_t)n * ldb + k, mask);
    for (int m = 0; m < 4; m++) {
      if (m >= mt) break;
      __m256 av = _mm256_maskload_ps(a + (size_t)m * lda + k, mask);
      for (int n = 0; n < NT; n++) acc[m][n] = _mm256_fmadd_ps(av, bv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < 4; m++) {
    if (m >= mt) break;
    for (int n = 0; n < NT; n++) store_out(j, m0 + m, n0 + n, gemm_hsum256(acc[m][n]));
  }
}

static void run_dot256(const gemm_job *j, int n0, int n1) {
  int n = n0;
  for (; n + 2 <= n1; n += 2)
    for (int m0 = 0; m0 < j->M; m0 += 4) dot256(j, m0, j->M - m0 < 4 ? j->M - m0 : 4, n, 2);
  for (; n < n1; n++)
    for (int m0 = 0; m0 < j->M; m0 += 4) dot256(j, m0, j->M - m0 < 4 ? j->M - m0 : 4, n, 1);
}

static inline __attribute__((always_inline)) void axpy256(const gemm_job *j, int m0, int mt,
                                                          int n0, int width) {
  __m256 acc[4][3];
  for (int m = 0; m < 4; m++)
    for (int v = 0; v < 3; v++) acc[m][v] = _mm256_setzero_ps();
  __m256i masks[3];
  for (int v = 0; v < 3; v++) masks[v] = gemm_mask256(width - 8 * v);
  const float *a = j->A + (size_t)m0 * j->lda;
  for (int k = 0; k < j->K; k++) {
    const float *brow = j->B + (size_t)k * j->ldb + n0;
    __m256 bv[3];
    for (int v = 0; v < 3; v++) bv[v] = _mm256_maskload_ps(brow + 8 * v, masks[v]);
    for (int m = 0; m < 4; m++) {
      if (m >= mt) break;
      __m256 av = _mm256_broadcast_ss(a + (size_t)m * j->lda + k);
      for (int v = 0; v < 3; v++) acc[m][v] = _mm256_fmadd_ps(av, bv[v], acc[m][v]);
    }
  }
  float tmp[24];
  for (int m = 0; m < 4; m++) {
    if (m >= mt) break;
    for (int v = 0; v < 3; v++) _mm256_storeu_ps(tmp + 8 * v, acc[m][v]);
    for (int n = 0; n < width; n++) store_out(j, m0 + m, n0 + n, tmp[n]);
  }
}

static void run_axpy256(const gemm_job *j, int n0, int n1) {
  for (int n = n0; n < n1; n += 24)
    for (int m0 = 0; m0 < j->M; m0 += 4)
      axpy256(j, m0, j->M - m0 < 4 ? j->M - m0 : 4, n, n1 - n < 24 ? n1 - n : 24);
}

#pragma GCC pop_options

/* ---- dispatch, threads ---------------------------------------------------------------- */

typedef void (*part_fn)(const gemm_job *, int, int);

/* One parallel job at a time on the pool (pool.h): its columns are cut into chunks that the
 * caller and the workers claim one by one. */
typedef struct {
  gemm_job job;
  part_fn part;
  int chunk_cols;
} gemm_chunks;

static void gemm_chunk_task(void *ctx, int chunk) {
  const gemm_chunks *c = ctx;
  int n0 = chunk * c->chunk_cols;
  int n1 = n0 + c->chunk_cols < c->job.N ? n0 + c->chunk_cols : c->job.N;
  c->part(&c->job, n0, n1);
}

static void run_job(const gemm_job *j, part_fn part) {
  /* Small products stay on the calling thread: waking a worker costs more than it saves. */
  long work = (long)j->N * j->K * j->M;
  int threads = n_threads();
  if (threads == 1 || work < 65536) {
    part(j, 0, j->N);
    return;
  }
  int align = j->trans_b ? 4 : 64;
  int chunks = threads * 8;
  int cols = (j->N + chunks - 1) / chunks;
  cols = (cols + align - 1) / align * align;
  gemm_chunks c = {*j, part, cols};
  parallel_for((j->N + cols - 1) / cols, gemm_chunk_task, &c);
}


/* The dot and axpy parts for this CPU: AVX-512 (f/bw/dq/vl) unless want512 is 0, else AVX2 +
 * FMA; the path's name, or "none" (both parts NULL) on a CPU with neither. */
static const char *fewrow_pick(int want512, part_fn *dot, part_fn *axpy) {
  __builtin_cpu_init();
  if (want512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma")) {
    *dot = run_dot512, *axpy = run_axpy512;
    return "avx512";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    *dot = run_dot256, *axpy = run_axpy256;
    return "avx2";
  }
  *dot = *axpy = NULL;
  return "none";
}

#endif /* MLXCEL_FEWROW_KERNELS_H */
