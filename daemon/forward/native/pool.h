/* A parallel for on a persistent thread pool, shared by fewrow_sgemm.c and fused_ops.c (each
 * library has its own pool: every definition here is static). Include after _GNU_SOURCE and
 * with MAX_THREADS defined.
 *
 * The caller and the workers claim tasks one by one, so a worker the OS has not scheduled (a
 * busy machine) only means the caller runs more tasks itself; it never waits for a thread to
 * start. Workers spin briefly after a job, then sleep on a futex. MLXCEL_GEMM_THREADS sets the
 * thread count (default: the CPUs this process may run on); the pool starts at first use.
 */
#ifndef MLXCEL_POOL_H
#define MLXCEL_POOL_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define pool_pause() _mm_pause()
#else
#define pool_pause() ((void)0)
#endif
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef void (*task_fn)(void *ctx, int task);

#define SPIN_NS 40000L
#define CLOSED 0x7FFFFFFFu

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static int pool_threads = 1;
static task_fn job_fn;
static void *job_ctx;
static int job_tasks;
static atomic_uint generation;
static _Atomic uint64_t claim; /* (generation << 32) | next task */
static atomic_int tasks_done;

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void work_on(unsigned gen) {
  for (;;) {
    uint64_t word = atomic_load_explicit(&claim, memory_order_acquire);
    for (;;) {
      if ((unsigned)(word >> 32) != gen || (int)(word & 0xFFFFFFFFu) >= job_tasks) return;
      if (atomic_compare_exchange_weak_explicit(&claim, &word, word + 1, memory_order_acq_rel,
                                                memory_order_acquire))
        break;
    }
    job_fn(job_ctx, (int)(word & 0xFFFFFFFFu));
    atomic_fetch_add_explicit(&tasks_done, 1, memory_order_release);
  }
}

static void *pool_worker(void *arg) {
  (void)arg;
  unsigned seen = 0;
  for (;;) {
    long start = now_ns();
    unsigned gen;
    while ((gen = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
      if (now_ns() - start > SPIN_NS) {
        syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        start = now_ns();
      } else {
        pool_pause();
      }
    }
    seen = gen;
    work_on(gen);
  }
  return NULL;
}

static int cpu_threads(void) {
  const char *env = getenv("MLXCEL_GEMM_THREADS");
  if (env && atoi(env) > 0) return atoi(env) < MAX_THREADS ? atoi(env) : MAX_THREADS;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    return n < MAX_THREADS ? n : MAX_THREADS;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : n < MAX_THREADS ? (int)n : MAX_THREADS;
}

static void start_pool(void) {
  pool_threads = cpu_threads();
  for (int i = 1; i < pool_threads; i++) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&t, &attr, pool_worker, NULL);
    pthread_attr_destroy(&attr);
    if (failed) {
      pool_threads = i;
      break;
    }
  }
}

static int n_threads(void) {
  pthread_once(&pool_once, start_pool);
  return pool_threads;
}

static void parallel_for(int tasks, task_fn fn, void *ctx) {
  if (n_threads() == 1 || tasks < 2 || pthread_mutex_trylock(&pool_lock) != 0) {
    for (int t = 0; t < tasks; t++) fn(ctx, t); /* one at a time; a second caller runs alone */
    return;
  }
  unsigned gen = atomic_load_explicit(&generation, memory_order_relaxed) + 1;
  atomic_store(&claim, ((uint64_t)gen << 32) | CLOSED); /* no late claims while writing */
  job_fn = fn;
  job_ctx = ctx;
  job_tasks = tasks;
  atomic_store_explicit(&tasks_done, 0, memory_order_relaxed);
  atomic_store(&claim, (uint64_t)gen << 32);
  atomic_store(&generation, gen);
  syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, pool_threads, NULL, NULL, 0);
  work_on(gen);
  while (atomic_load_explicit(&tasks_done, memory_order_acquire) < tasks) pool_pause();
  pthread_mutex_unlock(&pool_lock);
}

#endif /* MLXCEL_POOL_H */
