/* ---- The thread pool: every core for one decode row ----
   Batch-1 decode streams every weight once per token, and one core's stream reads well below the
   machine's bandwidth. The kernels below therefore split their work across a persistent pool of
   pthreads: the caller works too, and the workers wait for the next call by spinning briefly (it
   is usually microseconds away) and then sleep on a futex. A call is a few sections run in order
   (a GEMV: one; a fused layer half: three or four, e.g. RMSNorm, then the q/k/v rows with their
   RoPE, then attention, then the o rows); a section's work is cut into chunks of rows (or heads)
   that the threads claim from an atomic counter, and the next section starts when every chunk of
   this one is done. Claiming instead of fixed shares keeps a thread that the OS has descheduled
   (a busy machine) from holding the others up: whoever runs takes the next chunk. An OpenMP
   region per small op costs a fork/join each; this costs one wake-up per call and an atomic per
   chunk. Each output is computed by one thread with the one-thread code, so results equal the
   one-thread results bit for bit. tprt_pool_set_threads(1), the start-up state, runs everything
   on the caller. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#define POOL_MAX_THREADS 256
#define POOL_SPIN_NS 200000           /* a worker spins this long for the next call before it sleeps */
#define WAIT_SPIN_NS 20000            /* a waiter spins this long before it yields the core between checks */
#define PARALLEL_MIN_ELEMENTS 65536   /* smaller products are not worth a wake-up */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (1024 * 1024)     /* weight bytes per chunk at most: a descheduled thread holds little */
#endif
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 2           /* at least, where the section is large enough */
#endif

typedef void (*section_fn)(void *arg, int64_t lo, int64_t hi);  /* units [lo, hi) of a section */
typedef struct {
    section_fn run;
    void *arg;
    int64_t units, block;  /* units in all, and per chunk */
} section;
typedef struct {
    const section *s;
    int64_t n;
    _Atomic int64_t *next, *done;  /* per section: chunks claimed, chunks finished */
} pool_job;

static struct {
    pthread_mutex_t lock;          /* held by the caller of a job, and while resizing */
    _Atomic int threads;           /* workers + the caller */
    pthread_t workers[POOL_MAX_THREADS];
    _Atomic uint32_t generation;   /* bumped to hand out a job (the workers' futex word) */
    uint32_t start_generation;     /* the generation workers created by a resize start from */
    _Atomic uint32_t open;         /* the generation whose job may still be joined; 0: none */
    _Atomic int active;            /* workers that may be touching the open job */
    _Atomic int sleepers;          /* workers asleep (or about to be) on the futex */
    _Atomic int stop;
    pool_job *_Atomic job;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* One round of waiting: pause, and after WAIT_SPIN_NS yield the core between checks (on a busy
   machine the thread being waited for may need it). `start` is 0 on the first round. */
static inline void wait_round(unsigned spins, int64_t *start) {
    if ((spins & 63) != 63) { cpu_relax(); return; }
    int64_t t = now_ns();
    if (!*start) *start = t;
    else if (t - *start > WAIT_SPIN_NS) sched_yield();
}

/* The job's sections in order, claiming chunks until none is left, then waiting for the
   section's last chunks (another thread's) before the next. */
static void run_sections(pool_job *j) {
    for (int64_t s = 0; s < j->n; s++) {
        const section *sec = &j->s[s];
        int64_t chunks = (sec->units + sec->block - 1) / sec->block, c;
        while ((c = atomic_fetch_add_explicit(&j->next[s], 1, memory_order_relaxed)) < chunks) {
            int64_t lo = c * sec->block, hi = lo + sec->block < sec->units ? lo + sec->block : sec->units;
            sec->run(sec->arg, lo, hi);
            atomic_fetch_add_explicit(&j->done[s], 1, memory_order_release);
        }
        int64_t start = 0;
        for (unsigned spins = 0; atomic_load_explicit(&j->done[s], memory_order_acquire) < chunks; spins++)
            wait_round(spins, &start);
    }
}

static void *pool_worker(void *unused) {
    (void)unused;
    uint32_t seen = pool.start_generation;
    for (;;) {
        int64_t start = now_ns();
        uint32_t g;
        for (unsigned spins = 0; (g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen; spins++) {
            if ((spins & 63) != 63 || now_ns() - start < POOL_SPIN_NS) { cpu_relax(); continue; }
            atomic_fetch_add(&pool.sleepers, 1);  /* then re-checked by the kernel: no lost wake-up */
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
            start = now_ns();
        }
        seen = g;
        if (atomic_load(&pool.stop)) return NULL;
        /* Join only while the job is open: the caller closes it, then waits for `active` to
           drop to 0, so a worker that comes too late never touches a finished job. */
        atomic_fetch_add(&pool.active, 1);
        if (atomic_load(&pool.open) == g) run_sections(atomic_load(&pool.job));
        atomic_fetch_sub(&pool.active, 1);
    }
}

static void pool_release(void) {  /* the pool's lock held */
    if (pool.threads == 1) return;
    atomic_store(&pool.stop, 1);
    atomic_fetch_add(&pool.generation, 1);
    syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    for (int i = 1; i < pool.threads; i++) pthread_join(pool.workers[i], NULL);
    atomic_store(&pool.stop, 0);
    pool.threads = 1;
}

/* A forked child has none of the parent's workers: it starts over on one thread. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.threads = 1;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.active, 0);
    atomic_store(&pool.open, 0);
}

static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Sets the pool to n threads (the caller included; at least 1); returns how many it has (fewer
   when the system refused to create more). */
int64_t tprt_pool_set_threads(int64_t n) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pool_register_fork);
    n = n < 1 ? 1 : n > POOL_MAX_THREADS ? POOL_MAX_THREADS : n;
    pthread_mutex_lock(&pool.lock);
    if (n != pool.threads) {
        pool_release();
        pool.start_generation = atomic_load(&pool.generation);
        while (pool.threads < n && pthread_create(&pool.workers[pool.threads], NULL, pool_worker, NULL) == 0)
            pool.threads++;
    }
    int64_t got = pool.threads;
    pthread_mutex_unlock(&pool.lock);
    return got;
}

int64_t tprt_pool_threads(void) { return pool.threads; }

/* Units per chunk for a section of `units` units of `unit_bytes` weight bytes each: blocks of
   `align` units (outputs of different chunks then do not share a cache line, and vector loops
   see the same blocks as on one thread), at least CHUNKS_PER_THREAD chunks per thread where
   possible, at most CHUNK_BYTES of weights per chunk unless one block is larger. */
static int64_t chunk_units(int64_t units, int64_t unit_bytes, int64_t align) {
    int64_t per = (units + CHUNKS_PER_THREAD * pool.threads - 1) / (CHUNKS_PER_THREAD * pool.threads);
    int64_t cap = CHUNK_BYTES / (unit_bytes > 0 ? unit_bytes : 1);
    per = per < cap ? per : cap;
    per = (per + align - 1) / align * align;
    return per > 0 ? per : align;
}

/* Runs the job's sections on the pool, the caller included; returns when all are done. A caller
   finding the pool in use by another thread runs them alone. */
static void pool_run(pool_job *j) {
    if (pool.threads == 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        run_sections(j);
        return;
    }
    if (pool.threads > 1) {
        atomic_store(&pool.job, j);
        uint32_t g = atomic_load(&pool.generation) + 1;
        if (!g) g = 1;  /* 0 means "none open" */
        atomic_store(&pool.open, g);
        atomic_store(&pool.generation, g);
        if (atomic_load(&pool.sleepers) > 0)
            syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    run_sections(j);
    atomic_store(&pool.open, 0);
    int64_t start = 0;
    for (unsigned spins = 0; atomic_load(&pool.active) != 0; spins++) wait_round(spins, &start);
    pthread_mutex_unlock(&pool.lock);
}

/* Runs sections s[0..n) in order: on the pool when `parallel` (worth a wake-up), else on the caller. */
static void run_job(const section *s, int64_t n, int parallel) {
    _Atomic int64_t counters[2 * n];
    for (int64_t i = 0; i < 2 * n; i++) atomic_init(&counters[i], 0);
    pool_job j = {s, n, counters, counters + n};
    if (parallel) pool_run(&j);
    else run_sections(&j);
}
/* Software prefetch PREFETCH_BYTES ahead of a weight stream, two cache lines at a time (the 128
   bytes a GEMV loop step reads). The hardware prefetcher alone keeps too few lines in flight: a
   plain read of a large buffer measured 15 GB/s on one thread and 30 on two, and 19 and 37 with
   this (a C harness, docs/perf/generation.md, 2026-11-23; bench/kernel_bench.py shows it in the GEMVs).
   Prefetches never fault, so running past a matrix's end is harmless. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
static inline void prefetch_ahead(const void *p) {
#if defined(__x86_64__)
    _mm_prefetch((const char *)p + PREFETCH_BYTES, PREFETCH_HINT);
    _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, PREFETCH_HINT);
#else
    (void)p;
#endif
}

/* The first PREFETCH_BYTES of a stream, which prefetch_ahead's distance skips: a chunk of rows
   starts with them all in flight rather than waiting for each in turn. */
static inline void prefetch_start(const void *p) {
#if defined(__x86_64__)
    for (int64_t i = 0; i < PREFETCH_BYTES; i += 64) _mm_prefetch((const char *)p + i, PREFETCH_HINT);
#else
    (void)p;
#endif
}

/* The sum of x[0..n) float32, on the pool: a plain read of memory with the GEMVs' prefetching,
   for benchmarks' bandwidth floor (bench/generate_bench.py). Partial sums per chunk, added in
   chunk order, so the result does not depend on the thread count. */
typedef struct {
    const float *x;
    int64_t n, block;
    double *parts;
} sum_args;

static void sum_section(void *arg, int64_t lo, int64_t hi) {
    const sum_args *a = arg;
    const float *x = a->x + lo;
    int64_t n = hi - lo, i = 0;
    float s = 0;
#if defined(__AVX512F__)
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    /* The prefetches on a pointer of their own, hidden from the compiler: addressed off the loads'
       register (what it otherwise makes of x + i + PREFETCH_BYTES), this read measured 32 GB/s on
       two threads here instead of 38. */
    const char *ahead = (const char *)x + PREFETCH_BYTES;
    __asm__("" : "+r"(ahead));
    prefetch_start(x);
    for (; i + 64 <= n; i += 64, ahead += 256) {
        for (int line = 0; line < 256; line += 64) _mm_prefetch(ahead + line, PREFETCH_HINT);
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(x + i));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(x + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(x + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(x + i + 48));
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#endif
    for (; i < n; i++) s += x[i];
    a->parts[lo / a->block] = s;
}

double tprt_stream_sum_f32(const float *x, int64_t n) {
    int64_t block = chunk_units(n, 4, 1024), chunks = (n + block - 1) / block;
    double parts[chunks], total = 0;
    sum_args a = {x, n, block, parts};
    section s = {sum_section, &a, n, block};
    run_job(&s, 1, 1);
    for (int64_t c = 0; c < chunks; c++) total += parts[c];
    return total;
}
