/* A cblas_sgemm for few-row float32 products (decode steps), in front of OpenBLAS.
 *
 * Preloaded before the system OpenBLAS (LD_PRELOAD="this.so libopenblas.so"), this library's
 * cblas_sgemm wins symbol resolution for MLX's CPU matmuls. Row-major products with
 * M <= 16 rows and an untransposed A run here; everything else is forwarded unchanged to the
 * next cblas_sgemm in the search order (OpenBLAS) through dlsym(RTLD_NEXT).
 *
 * Why: OpenBLAS reads the weights of a few-row product at a fraction of the memory bandwidth.
 * Here every weight is read once per call, by one of the threads (the output columns are split
 * between them), and reused from registers and L1 for all M rows.
 *
 * Two instruction sets, chosen once at the first call from the CPU: AVX-512 (f/bw/dq/vl) and
 * AVX2 + FMA. MLXCEL_GEMM_ISA=avx2 forces the AVX2 path; a CPU with neither forwards every call.
 * MLXCEL_GEMM_THREADS sets the thread count (default: the CPUs this process may run on; the
 * pool is pool.h, shared with fused_ops.c).
 * mlxcel_gemm_path() says which path is in use, mlxcel_gemm_counts() how many calls ran here
 * and how many were forwarded.
 *
 * Build: cc -O3 -shared -fPIC -pthread -o libmlxcel_gemm.so fewrow_sgemm.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "glibc_versions.h"

enum { ROW_MAJOR = 101, COL_MAJOR = 102 };
enum { NO_TRANS = 111, TRANS = 112, CONJ_TRANS = 113 };

#define MAX_ROWS 16
#define MAX_THREADS 64

#include "pool.h"

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

#include "fewrow_kernels.h"

/* ---- dispatch, threads ---------------------------------------------------------------- */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static sgemm_fn next_sgemm;
static part_fn dot_part, axpy_part;
static const char *path_name = "none";
static atomic_long calls_native, calls_forwarded;
static atomic_int enabled = 1; /* mlxcel_gemm_set_enabled(0): forward everything (A/B runs) */

static void init(void) {
  next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  const char *force = getenv("MLXCEL_GEMM_ISA");
  if (force && strcmp(force, "off") == 0) {
    path_name = "off";
    return;
  }
  path_name = fewrow_pick(!(force && strcmp(force, "avx2") == 0), &dot_part, &axpy_part);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
  pthread_once(&init_once, init);
  if (order != ROW_MAJOR || trans_a != NO_TRANS || M < 1 || M > MAX_ROWS || N < 1 || K < 1 ||
      !dot_part || !atomic_load_explicit(&enabled, memory_order_relaxed)) {
    atomic_fetch_add_explicit(&calls_forwarded, 1, memory_order_relaxed);
    if (!next_sgemm) {
      fprintf(stderr, "mlxcel gemm: no cblas_sgemm after this library; preload OpenBLAS\n");
      abort();
    }
    next_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  atomic_fetch_add_explicit(&calls_native, 1, memory_order_relaxed);
  gemm_job j = {M, N, K, lda, ldb, ldc, trans_b != NO_TRANS, alpha, beta, A, B, C};
  run_job(&j, j.trans_b ? dot_part : axpy_part);
}

const char *mlxcel_gemm_path(void) {
  pthread_once(&init_once, init);
  return path_name;
}

int mlxcel_gemm_threads(void) {
  pthread_once(&init_once, init);
  return dot_part ? n_threads() : 1;
}

void mlxcel_gemm_counts(long *native, long *forwarded) {
  *native = atomic_load(&calls_native);
  *forwarded = atomic_load(&calls_forwarded);
}

void mlxcel_gemm_set_enabled(int on) { atomic_store(&enabled, on != 0); }

/* The ABI version of this library (its exported functions' signatures): forward/blas.py refuses a
 * library whose version is not its GEMM_ABI, by name. Bump both on any change. */
#define MLXCEL_GEMM_ABI 1
int mlxcel_gemm_abi(void) { return MLXCEL_GEMM_ABI; }
