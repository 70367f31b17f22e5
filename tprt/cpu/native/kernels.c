/* tprt's CPU kernels for decoding, where torch's general-purpose ones leave time on the table.
   Built at first use with -march=native by tprt.native (plain C, no torch headers) and called
   through ctypes with raw pointers; tprt/native/__init__.py checks shapes, dtypes and contiguity.

   Matrix-vector products for one-row (batch-1 decode) inputs: y[n] = sum_k W[n,k] x[k].
   oneDNN's and torch's one-row kernels stream the weight at 10-15 GB/s on one core where a plain
   read reaches ~20; these read each row front to back, one sequential stream the hardware
   prefetcher follows at full bandwidth. W is [n, k] row-major and contiguous; bf16 values are
   uint16_t.
   Sums are in float32, bf16 outputs rounded to nearest even, as torch rounds. */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}

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
   this (a C harness, docs/PERF.md session 8; bench/kernel_bench.py shows it in the GEMVs).
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

#if defined(__AVX512BF16__)
/* One row at a time, front to back: the weight is read as one sequential stream, which the
   hardware prefetcher follows at full bandwidth (interleaving several rows measured up to 2x slower). */
static void gemv_bf16_serial(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t n, int64_t k) {
    int64_t full = k / 64 * 64, rest = k - full;
    __mmask32 m0 = (__mmask32)(rest >= 32 ? 0xffffffffu : (1ull << rest) - 1);
    __mmask32 m1 = (__mmask32)(rest > 32 ? (1ull << (rest - 32)) - 1 : 0);
    prefetch_start(w);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        int64_t c = 0;
        for (; c < full; c += 64) {
            prefetch_ahead(row + c);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(row + c), (__m512bh)_mm512_loadu_si512(x + c));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(row + c + 32), (__m512bh)_mm512_loadu_si512(x + c + 32));
        }
        if (rest) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m0, row + c), (__m512bh)_mm512_maskz_loadu_epi16(m0, x + c));
            if (m1)
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m1, row + c + 32), (__m512bh)_mm512_maskz_loadu_epi16(m1, x + c + 32));
        }
        y[r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)));
    }
}
#else
static void gemv_bf16_serial(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t n, int64_t k) {
    float xf[k];
    for (int64_t c = 0; c < k; c++) xf[c] = bf16_to_f32(x[c]);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        float part[16] = {0};
        int64_t c = 0;
        for (; c + 16 <= k; c += 16)
            for (int j = 0; j < 16; j++) part[j] += bf16_to_f32(row[c + j]) * xf[c + j];
        float acc = 0;
        for (; c < k; c++) acc += bf16_to_f32(row[c]) * xf[c];
        for (int j = 0; j < 16; j++) acc += part[j];
        y[r] = f32_to_bf16(acc);
    }
}
#endif

/* a . b in float32 with 32 partial sums (vectorised by the compiler without -ffast-math). */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float p[32] = {0}, s = 0;
    int64_t c = 0;
    for (; c + 32 <= n; c += 32)
        for (int j = 0; j < 32; j++) p[j] += a[c + j] * b[c + j];
    for (; c < n; c++) s += a[c] * b[c];
    for (int j = 0; j < 32; j++) s += p[j];
    return s;
}

/* fp32: one row at a time (a sequential stream). With AVX-512, four independent accumulators and
   one tree reduction per row: dot_f32's 32 partial sums end in 32 dependent scalar adds per row,
   which on rows of a few hundred values cost more than reading the row (about 10 GB/s a thread). */
#if defined(__AVX512F__)
static void gemv_f32_serial(const float *w, const float *x, float *y, int64_t n, int64_t k) {
    int64_t full = k / 64 * 64;
    prefetch_start(w);
    for (int64_t r = 0; r < n; r++) {
        const float *row = w + r * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t c = 0;
        for (; c < full; c += 64) {
            prefetch_ahead(row + c);
            prefetch_ahead(row + c + 32);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + c), _mm512_loadu_ps(x + c), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + c + 16), _mm512_loadu_ps(x + c + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(row + c + 32), _mm512_loadu_ps(x + c + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(row + c + 48), _mm512_loadu_ps(x + c + 48), a3);
        }
        for (; c < k; c += 16) {
            __mmask16 m = (__mmask16)(k - c >= 16 ? 0xffff : (1u << (k - c)) - 1);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, row + c), _mm512_maskz_loadu_ps(m, x + c), a0);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
}
#else
static void gemv_f32_serial(const float *w, const float *x, float *y, int64_t n, int64_t k) {
    for (int64_t r = 0; r < n; r++) y[r] = dot_f32(w + r * k, x, k);
}
#endif

/* RMSNorm of each row of x [rows, n]: normalised in float32. bf16: the normalised value is
   rounded to bf16 before the weight scales it (and the product rounded again), as transformers
   computes it; float32: x * rsqrt(mean(x^2) + eps) * w. */
static float inv_rms(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(dot_f32(x, x, n) / (float)n + eps);
}

void tprt_rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float inv = inv_rms(xr, n, eps);
        for (int64_t c = 0; c < n; c++) y[r * n + c] = xr[c] * inv * w[c];
    }
}

void tprt_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n, float eps) {
    float scratch[n];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < n; c++) scratch[c] = bf16_to_f32(x[r * n + c]);
        float inv = inv_rms(scratch, n, eps);
        for (int64_t c = 0; c < n; c++)
            y[r * n + c] = f32_to_bf16(bf16_to_f32(w[c]) * bf16_to_f32(f32_to_bf16(scratch[c] * inv)));
    }
}

/* Decode step of attention's input side, one token per row: rotates q and k of the fused
   projection qkv [rows, nh + 2 nkv, d] by RoPE (rotate-half; sin [rows, d] has its first half
   negated, as tprt.rope makes it), writes k and v into the float32 cache at each row's slot and
   position, and writes q as float32 to q_out [rows, nh, d]. cache points at one layer:
   [slot, k/v, kv_head, position, d] with element strides s_slot, s_kv, s_head, s_pos (the paged
   cache passes each row's block as its slot and the offset in it as its position). Rounds as
   torch's in-place ops in the model dtype: x * cos, rounded, plus rotate_half(x) * sin, rounded. */
/* One head h of one row's fused projection qkv [nh + 2 nkv, d] to its place: a q head rotated into
   q_out [nh, d], a k head rotated into the cache at `slot` (the row's slot and position), a v head
   copied there. */
#define ROPE_HEAD(SUFFIX, T, LOAD, ROUND)                                                                    \
static void rope_head_##SUFFIX(const T *qkv, const T *c, const T *s, float *q_out, float *slot, int64_t h,   \
                               int64_t nh, int64_t nkv, int64_t d, int64_t s_kv, int64_t s_head) {            \
    const T *x = qkv + h * d;                                                                                 \
    int64_t half = d / 2;                                                                                     \
    if (h >= nh + nkv) {                                                                                      \
        float *o = slot + s_kv + (h - nh - nkv) * s_head;                                                     \
        for (int64_t i = 0; i < d; i++) o[i] = LOAD(x[i]);                                                    \
        return;                                                                                               \
    }                                                                                                         \
    float *o = h < nh ? q_out + h * d : slot + (h - nh) * s_head;                                             \
    for (int64_t i = 0; i < d; i++) {                                                                         \
        float rotated = LOAD(x[i < half ? i + half : i - half]);                                              \
        o[i] = ROUND(ROUND(LOAD(x[i]) * LOAD(c[i])) + rotated * LOAD(s[i]));                                  \
    }                                                                                                         \
}

/* ---- The int8 KV cache (tprt.model.kv_cache.quantize): each key or value head vector of d values is
   stored as int8 with its own scale, amax / 127 rounded up to a bfloat16 (1 for an all-zero
   vector), kept as its bf16 bits; the values round(x / scale) to nearest even, as torch rounds.
   The cache is contiguous, so a vector's scale sits at its element offset / d in the scales array
   [.., k/v, kv_head, position]. */
static void quantize_q8(const float *x, int64_t d, int8_t *out, uint16_t *scale) {
    float amax = 0;
    for (int64_t i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float ratio = amax / 127.0f, sc;
    uint32_t bits;
    memcpy(&bits, &ratio, 4);
    bits = (bits + 0xFFFFu) & 0xFFFF0000u;  /* up to the next bfloat16 */
    memcpy(&sc, &bits, 4);
    sc = ratio == 0.0f ? 1.0f : sc;
    for (int64_t i = 0; i < d; i++) {
        float v = nearbyintf(x[i] / sc);
        out[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
    *scale = f32_to_bf16(sc);  /* exact: sc is a bfloat16 */
}

/* The int8 cache with static scales (tprt.model.kv_cache.quantize_fixed): one float32 scale per
   layer, k/v and kv head, nothing stored per vector; round(x / scale) clipped to +-127. */
static void quantize_fixed_q8(const float *x, int64_t d, int8_t *out, float scale) {
    for (int64_t i = 0; i < d; i++) {
        float v = nearbyintf(x[i] / scale);
        out[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
}

/* The k/v heads among heads [lo, hi) of one token, staged in float32 as [k/v, kv_head, d]
   (rope_head with s_kv = nkv d, s_head = d), quantized into the int8 cache at `at` (the token's
   block and offset): with the layer's static scales `fixed` [k/v, kv_head] where given, else
   with their own scales, written at `scale_at` (at's element offset / d). */
static void store_q8_heads(const float *stage, int8_t *at, uint16_t *scale_at, const float *fixed, int64_t lo,
                           int64_t hi, int64_t nh, int64_t nkv, int64_t d, int64_t s_kv, int64_t s_head) {
    for (int64_t h = lo > nh ? lo : nh; h < hi; h++) {
        int64_t kv = h >= nh + nkv, j = h - nh - kv * nkv, e = kv * s_kv + j * s_head;
        if (fixed) quantize_fixed_q8(stage + (kv * nkv + j) * d, d, at + e, fixed[kv * nkv + j]);
        else quantize_q8(stage + (kv * nkv + j) * d, d, at + e, scale_at + e / d);
    }
}

/* Decode step of attention's input side, one token per row: rotates q and k of the fused
   projection qkv [rows, nh + 2 nkv, d] by RoPE (rotate-half; sin [rows, d] has its first half
   negated, as tprt.rope makes it), writes k and v into the cache at each row's slot and
   position, and writes q as float32 to q_out [rows, nh, d]. cache points at one layer:
   [slot, k/v, kv_head, position, d] with element strides s_slot, s_kv, s_head, s_pos; float32,
   or int8 when `scales` (the layer's, see quantize_q8) or `fixed` (the layer's static scales
   [k/v, kv_head], see quantize_fixed_q8) is not NULL. Rounds as torch's in-place ops in the model
   dtype: x * cos, rounded, plus rotate_half(x) * sin, rounded. */
#define ROPE_CACHE(SUFFIX, T)                                                                                \
void tprt_rope_cache_##SUFFIX(const T *qkv, const T *cos, const T *sin, float *q_out, void *cache,           \
                              uint16_t *scales, const float *fixed, const int64_t *slots,                     \
                              const int64_t *positions, int64_t rows,                                         \
                              int64_t nh, int64_t nkv, int64_t d, int64_t s_slot, int64_t s_kv,               \
                              int64_t s_head, int64_t s_pos) {                                                \
    int64_t heads = nh + 2 * nkv, q8 = scales || fixed;                                                       \
    float stage[q8 ? 2 * nkv * d : 1];                                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                                      \
        int64_t at = slots[r] * s_slot + positions[r] * s_pos;                                                \
        float *slot = q8 ? stage : (float *)cache + at;                                                       \
        for (int64_t h = 0; h < heads; h++)                                                                   \
            rope_head_##SUFFIX(qkv + r * heads * d, cos + r * d, sin + r * d, q_out + r * nh * d, slot, h,    \
                               nh, nkv, d, q8 ? nkv * d : s_kv, q8 ? d : s_head);                             \
        if (q8) store_q8_heads(stage, (int8_t *)cache + at, scales ? scales + at / d : NULL, fixed, nh,       \
                               nh + 2 * nkv, nh, nkv, d, s_kv, s_head);                                       \
    }                                                                                                         \
}

static inline float f32_load(float x) { return x; }
static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline float f32_store(float x) { return x; }
ROPE_HEAD(f32, float, f32_load, f32_round)
ROPE_HEAD(bf16, uint16_t, bf16_to_f32, bf16_round)
ROPE_CACHE(f32, float)
ROPE_CACHE(bf16, uint16_t)

/* exp(x) for x <= 0 (softmax after subtracting the max), branch-free so the loop calling it
   vectorises: x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative
   error < 2e-7), times 2^n built in the exponent bits. Below -87 it returns exp(-87) ~ 1.6e-38. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#if defined(__AVX512F__)
static inline __m512 exp512_nonpositive(__m512 x) {  /* exp_nonpositive, 16 lanes at once */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    static const float coef[] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coef[i]));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* softmax of s[0..len) in place (unnormalised); returns the sum. */
static inline float softmax512(float *s, int64_t len) {
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, m, s + t));
    }
    __m512 topv = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        __m512 e = exp512_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), topv));
        _mm512_mask_storeu_ps(s + t, m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(sum);
}

#endif

/* silu(g) = g * sigmoid(g) in place, float32, with e = exp(-|g|) <= 1 so one exp serves both signs:
   sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below. */
static void silu_inplace(float *g, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = exp512_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, _mm512_set1_ps(1.0f));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e))));
    }
#endif
    for (; i < n; i++) {
        float e = exp_nonpositive(-fabsf(g[i]));
        g[i] *= (g[i] >= 0 ? 1.0f : e) / (1.0f + e);
    }
}

/* Matrix products for a few rows (decode of 2-8 sequences): Y[m, :] = X[m, :] W^T, Y's rows
   `ldy` apart. Like the one-row GEMV, each weight row is read once, front to back, and serves
   every input row: oneDNN's kernels for so few rows stream the weights at half the bandwidth.
   One function per row count keeps its accumulators in registers; gemv_rows_*_serial dispatches
   on m (other counts, 1 included, go one row at a time). */
#define GEMV_ROWS_DISPATCH(SUFFIX, T)                                                                        \
static void gemv_rows_##SUFFIX##_serial(const T *w, const T *x, T *y, int64_t m, int64_t n, int64_t k,        \
                                        int64_t ldy) {                                                        \
    static void (*const kernel[])(const T *, const T *, T *, int64_t, int64_t, int64_t) = {                 \
        0, 0, gemv_rows_##SUFFIX##_2, gemv_rows_##SUFFIX##_3, gemv_rows_##SUFFIX##_4, gemv_rows_##SUFFIX##_5,  \
        gemv_rows_##SUFFIX##_6, gemv_rows_##SUFFIX##_7, gemv_rows_##SUFFIX##_8};                              \
    if (m >= 2 && m <= 8) {                                                                                   \
        kernel[m](w, x, y, n, k, ldy);                                                                        \
        return;                                                                                               \
    }                                                                                                         \
    for (int64_t i = 0; i < m; i++) gemv_##SUFFIX##_serial(w, x + i * k, y + i * ldy, n, k);                 \
}                                                                                                             \
static void gemv_section_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                       \
    const gemv_args *a = arg;                                                                                 \
    gemv_rows_##SUFFIX##_serial((const T *)a->w + lo * a->k, a->x, (T *)a->y + lo, a->m, hi - lo, a->k, a->n); \
}                                                                                                             \
/* x [m, k] times w [n, k] transposed into y [m, n], chunks of w's rows shared by the pool. */               \
void tprt_gemv_rows_##SUFFIX(const T *w, const T *x, T *y, int64_t m, int64_t n, int64_t k) {                \
    gemv_args a = {w, x, y, m, n, k};                                                                         \
    section s = {gemv_section_##SUFFIX, &a, n, chunk_units(n, k * (int64_t)sizeof(T), 16)};                    \
    run_job(&s, 1, n * k >= PARALLEL_MIN_ELEMENTS);                                                           \
}                                                                                                             \
/* The one-row product y [n] = w [n, k] x [k]. */                                                            \
void tprt_gemv_##SUFFIX(const T *w, const T *x, T *y, int64_t n, int64_t k) {                                 \
    tprt_gemv_rows_##SUFFIX(w, x, y, 1, n, k);                                                                \
}

typedef struct {
    const void *w, *x;
    void *y;
    int64_t m, n, k;
} gemv_args;

/* Without AVX-512: the same functions, one row at a time. */
#define GEMV_ROWS_ONE(SUFFIX, T, M)                                                                          \
static void gemv_rows_##SUFFIX##_##M(const T *w, const T *x, T *y, int64_t n, int64_t k, int64_t ldy) {      \
    for (int64_t i = 0; i < M; i++) gemv_##SUFFIX##_serial(w, x + i * k, y + i * ldy, n, k);                 \
}
#define GEMV_ROWS_BY_ROW(SUFFIX, T)                                                                          \
    GEMV_ROWS_ONE(SUFFIX, T, 2) GEMV_ROWS_ONE(SUFFIX, T, 3) GEMV_ROWS_ONE(SUFFIX, T, 4)                     \
    GEMV_ROWS_ONE(SUFFIX, T, 5) GEMV_ROWS_ONE(SUFFIX, T, 6) GEMV_ROWS_ONE(SUFFIX, T, 7)                     \
    GEMV_ROWS_ONE(SUFFIX, T, 8)

/* bf16: each input row's sum is taken in the one-row GEMV's order (its two accumulators, chunks,
   tail and final reduction), so a row's result has the same bits whichever number of rows came
   with it: a decode row of k drafted tokens verifies them with exactly the logits one-token steps
   would give (greedy speculative decoding is then plain decoding token for token in bf16, where
   rounding to 8 bits made near-ties flip). */
#if defined(__AVX512BF16__)
#define GEMV_ROWS_BF16(M)                                                                                    \
static void gemv_rows_bf16_##M(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t n, int64_t k,        \
                               int64_t ldy) {                                                                  \
    int64_t full = k / 64 * 64, rest = k - full;                                                              \
    __mmask32 m0 = (__mmask32)(rest >= 32 ? 0xffffffffu : (1ull << rest) - 1);                                \
    __mmask32 m1 = (__mmask32)(rest > 32 ? (1ull << (rest - 32)) - 1 : 0);                                    \
    prefetch_start(w);                                                                                        \
    for (int64_t r = 0; r < n; r++) {                                                                         \
        const uint16_t *row = w + r * k;                                                                      \
        __m512 a0[M], a1[M];  /* as gemv_bf16_serial's a0 and a1, per input row */                            \
        for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm512_setzero_ps();                                      \
        int64_t c = 0;                                                                                        \
        for (; c < full; c += 64) {                                                                           \
            _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES, PREFETCH_HINT);                            \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + c), w1 = (__m512bh)_mm512_loadu_si512(row + c + 32); \
            for (int m = 0; m < M; m++) {                                                                     \
                a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * k + c));            \
                a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * k + c + 32));       \
            }                                                                                                 \
        }                                                                                                     \
        if (rest) {                                                                                           \
            __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, row + c);                                    \
            __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, row + c + 32);                               \
            for (int m = 0; m < M; m++) {                                                                     \
                a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(m0, x + m * k + c));   \
                if (m1)                                                                                       \
                    a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_maskz_loadu_epi16(m1, x + m * k + c + 32)); \
            }                                                                                                 \
        }                                                                                                     \
        for (int m = 0; m < M; m++) y[m * ldy + r] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]))); \
    }                                                                                                         \
}
GEMV_ROWS_BF16(2) GEMV_ROWS_BF16(3) GEMV_ROWS_BF16(4) GEMV_ROWS_BF16(5) GEMV_ROWS_BF16(6) GEMV_ROWS_BF16(7)
GEMV_ROWS_BF16(8)
#else
GEMV_ROWS_BY_ROW(bf16, uint16_t)
#endif
GEMV_ROWS_DISPATCH(bf16, uint16_t)

#if defined(__AVX512F__)
/* fp32 keeps one accumulator per input row, not the one-row GEMV's four: summing in its order
   measured 0.65-0.9x as fast for 2-8 rows, and fp32 greedy outputs never differed from one-row
   steps (bf16's did, hence its kernel above). So fp32 rows match the one-row GEMV to rounding. */
#define GEMV_ROWS_F32(M)                                                                                     \
static void gemv_rows_f32_##M(const float *w, const float *x, float *y, int64_t n, int64_t k, int64_t ldy) {  \
    int64_t full = k / 16 * 16, rest = k - full;                                                              \
    __mmask16 tail = (__mmask16)((1u << rest) - 1);                                                           \
    prefetch_start(w);                                                                                        \
    for (int64_t r = 0; r < n; r++) {                                                                         \
        const float *row = w + r * k;                                                                         \
        __m512 acc[M];                                                                                        \
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();                                             \
        for (int64_t c = 0; c < full; c += 16) {                                                              \
            _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES, PREFETCH_HINT);                            \
            __m512 wv = _mm512_loadu_ps(row + c);                                                             \
            for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * k + c), acc[m]);  \
        }                                                                                                     \
        if (rest) {                                                                                           \
            __m512 wv = _mm512_maskz_loadu_ps(tail, row + full);                                              \
            for (int m = 0; m < M; m++)                                                                       \
                acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * k + full), acc[m]);          \
        }                                                                                                     \
        for (int m = 0; m < M; m++) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m]);                              \
    }                                                                                                         \
}
GEMV_ROWS_F32(2) GEMV_ROWS_F32(3) GEMV_ROWS_F32(4) GEMV_ROWS_F32(5) GEMV_ROWS_F32(6) GEMV_ROWS_F32(7)
GEMV_ROWS_F32(8)
#else
GEMV_ROWS_BY_ROW(f32, float)
#endif
GEMV_ROWS_DISPATCH(f32, float)

/* ---- Paged decode attention (tprt.model.kv_cache: the KV cache is a pool of fixed-size blocks).

   One layer of the float32 cache is [block, k/v, kv_head, offset, d] with element strides
   s_block, s_kv, s_head, s_pos; a sequence's position p lives in block table[p / bs] at offset
   p % bs. Decode attention, one query token per row: row r attends to its keys and values at
   positions 0..positions[r] (the causal mask of a decode step, so no mask tensor), read block by
   block through its table (row r's table starts at tables + r * s_table), grouped-query (q head h
   reads kv head h / (nh / nkv), as SDPA's enable_gqa). q [rows, nh, d] float32 (tprt_rope_cache
   writes it, and the new k/v, given each row's block and offset); out [rows, nh * d] in the model
   dtype. Scores live in `scratch` (at least (max position + 1) x nh / nkv floats). Sums run in another order
   than SDPA's (differences in rounding only). */
static void paged_attend_generic(const float *q, const float *head, const int64_t *table, int64_t len,
                                 int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                                 int64_t s_pos, float scale, float *s, float *out) {
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, sum = 0, *o = out + g * d;
        for (int64_t t = 0, b = 0; t < len; b++) {
            const float *keys = head + table[b] * s_block;
            for (int64_t u = 0; u < bs && t < len; u++, t++) {
                s[t] = dot_f32(q + g * d, keys + u * s_pos, d) * scale;
                top = s[t] > top ? s[t] : top;
            }
        }
        for (int64_t t = 0; t < len; t++) { s[t] = exp_nonpositive(s[t] - top); sum += s[t]; }
        for (int64_t i = 0; i < d; i++) o[i] = 0;
        for (int64_t t = 0, b = 0; t < len; b++) {
            const float *values = head + table[b] * s_block + s_kv;
            for (int64_t u = 0; u < bs && t < len; u++, t++)
                for (int64_t i = 0; i < d; i++) o[i] += s[t] * values[u * s_pos + i];
        }
        for (int64_t i = 0; i < d; i++) o[i] /= sum;
    }
}

#if defined(__AVX512F__)
/* The sums of 16 vectors' lanes, in one vector: lane j is the sum of a[j]'s 16 lanes. 45
   shuffles and adds instead of 16 separate reductions (about 140). Each lane adds only its own
   vector's values, always in the same order, so a vector's sum has the same bits whatever the
   other 15 hold (zeros included). */
static inline __m512 q8b_sum16(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: a's lanes 0+2, 1+3 and b's, interleaved */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: the lane sums of 4 vectors, in order */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* The same for head_dim = 16 * M, over a cache of T (float32, or int8 with `scales`): LOAD16 reads
   16 values as floats; where SCALED, POS_SCALE(i) is the scale of the position whose scale index
   is i, and a key's score and a value's weight are multiplied by it. Keys and values are read 16
   positions of a block at a time, and every q head of the group takes its turn on them while
   they are in L1 (the group's heads used to read the whole cache one after the other, from L3
   or memory at long contexts).
   Scores are reduced 16 at a time (q8b_sum16: one reduction per key, a chain of dependent adds,
   had made the score pass wait on latency); s holds group x len of them. The output accumulates
   in `out`. A position's score, and each head's sum, has the same bits whichever positions share
   its group and whatever the other heads hold. */
#define PAGED_ATTEND_512(NAME, M, T, LOAD16, SCALED, POS_SCALE)                                              \
static void NAME(const float *q, const T *head, const uint16_t *scales, const int64_t *table, int64_t len,    \
                 int64_t group, int64_t bs, int64_t s_block, int64_t s_kv, int64_t s_pos, float scale,       \
                 float *s, float *out) {                                                                      \
    int64_t sp = s_pos / (16 * M);  /* scales per position */                                                 \
    __m512 scale16 = _mm512_set1_ps(scale);                                                                   \
    (void)scales, (void)sp;                                                                                   \
    for (int64_t t = 0, b = 0; t < len; b++) {                                                                \
        int64_t at = table[b] * s_block;                                                                      \
        for (int64_t u0 = 0; u0 < bs && t < len; u0 += 16) {                                                  \
            int64_t n = bs - u0 < 16 ? bs - u0 : 16;                                                          \
            n = len - t < n ? len - t : n;                                                                    \
            float sc[16];                                                                                     \
            for (int64_t u = 0; SCALED && u < 16; u++) sc[u] = u < n ? POS_SCALE(at / (16 * M) + (u0 + u) * sp) : 0; \
            for (int64_t g = 0; g < group; g++) {                                                             \
                __m512 qv[M], a[16];                                                                          \
                for (int c = 0; c < M; c++) qv[c] = _mm512_loadu_ps(q + g * 16 * M + 16 * c);                 \
                for (int64_t u = 0; u < 16; u++) {                                                            \
                    if (u >= n) { a[u] = _mm512_setzero_ps(); continue; }                                     \
                    const T *k = head + at + (u0 + u) * s_pos;                                                \
                    a[u] = _mm512_mul_ps(qv[0], LOAD16(k));                                                   \
                    for (int c = 1; c < M; c++) a[u] = _mm512_fmadd_ps(qv[c], LOAD16(k + 16 * c), a[u]);      \
                }                                                                                             \
                __m512 dots = SCALED ? _mm512_mul_ps(q8b_sum16(a), _mm512_loadu_ps(sc)) : q8b_sum16(a);       \
                _mm512_mask_storeu_ps(s + g * len + t, (__mmask16)((1u << n) - 1), _mm512_mul_ps(dots, scale16)); \
            }                                                                                                 \
            t += n;                                                                                           \
        }                                                                                                     \
    }                                                                                                         \
    float total[group];  /* each head's scores to weights; its 1 / sum applied at the end */                 \
    for (int64_t g = 0; g < group; g++) total[g] = softmax512(s + g * len, len);                              \
    for (int64_t i = 0; i < group * 16 * M; i++) out[i] = 0;                                                  \
    for (int64_t t = 0, b = 0; t < len; b++) {                                                                \
        int64_t at = table[b] * s_block + s_kv;                                                               \
        for (int64_t u0 = 0; u0 < bs && t < len; u0 += 16) {                                                  \
            int64_t n = bs - u0 < 16 ? bs - u0 : 16;                                                          \
            n = len - t < n ? len - t : n;                                                                    \
            float vs[16];                                                                                     \
            for (int64_t u = 0; SCALED && u < n; u++) vs[u] = POS_SCALE(at / (16 * M) + (u0 + u) * sp);       \
            for (int64_t g = 0; g < group; g++) {                                                             \
                __m512 acc[M];                                                                                \
                for (int c = 0; c < M; c++) acc[c] = _mm512_loadu_ps(out + g * 16 * M + 16 * c);              \
                for (int64_t u = 0; u < n; u++) {                                                             \
                    __m512 p = _mm512_set1_ps(SCALED ? s[g * len + t + u] * vs[u] : s[g * len + t + u]);       \
                    const T *v = head + at + (u0 + u) * s_pos;                                                \
                    for (int c = 0; c < M; c++) acc[c] = _mm512_fmadd_ps(p, LOAD16(v + 16 * c), acc[c]);      \
                }                                                                                             \
                for (int c = 0; c < M; c++) _mm512_storeu_ps(out + g * 16 * M + 16 * c, acc[c]);              \
            }                                                                                                 \
            t += n;                                                                                           \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t g = 0; g < group; g++) {                                                                     \
        __m512 inv = _mm512_set1_ps(1.0f / total[g]);                                                         \
        for (int c = 0; c < M; c++)                                                                           \
            _mm512_storeu_ps(out + g * 16 * M + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(out + g * 16 * M + 16 * c), inv)); \
    }                                                                                                         \
}
#define NO_SCALE(i) 1.0f  /* never called: SCALED is 0 */
PAGED_ATTEND_512(paged_attend_4, 4, float, _mm512_loadu_ps, 0, NO_SCALE)
PAGED_ATTEND_512(paged_attend_8, 8, float, _mm512_loadu_ps, 0, NO_SCALE)
#endif

/* One (row, kv head): each q head of the group reads the head's keys and values (kept in cache). */
static void paged_attend(const float *q, const float *head, const int64_t *table, int64_t len, int64_t group,
                         int64_t d, int64_t bs, int64_t s_block, int64_t s_kv, int64_t s_pos, float scale,
                         float *scratch, float *out) {
#if defined(__AVX512F__)
    if (d == 64) return paged_attend_4(q, head, NULL, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
    if (d == 128) return paged_attend_8(q, head, NULL, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
#endif
    paged_attend_generic(q, head, table, len, group, d, bs, s_block, s_kv, s_pos, scale, scratch, out);
}

/* paged_attend over an int8 cache: `head` and `scales` at one layer's kv head (scales at head's
   element offset / d); a key's score is its scale times q . its int8 values, a value enters the
   sum times its weight and scale, so nothing is dequantized into memory. */
static void paged_attend_q8_generic(const float *q, const int8_t *head, const uint16_t *scales, const int64_t *table,
                                    int64_t len, int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                                    int64_t s_pos, float scale, float *s, float *out) {
    int64_t sp = s_pos / d;  /* scales per position */
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, sum = 0, *o = out + g * d;
        for (int64_t t = 0, b = 0; t < len; b++) {
            int64_t at = table[b] * s_block;
            for (int64_t u = 0; u < bs && t < len; u++, t++) {
                const int8_t *k = head + at + u * s_pos;
                float dot = 0;
                for (int64_t i = 0; i < d; i++) dot += q[g * d + i] * (float)k[i];
                s[t] = dot * (scales ? bf16_to_f32(scales[at / d + u * sp]) : 1.0f) * scale;
                top = s[t] > top ? s[t] : top;
            }
        }
        for (int64_t t = 0; t < len; t++) { s[t] = exp_nonpositive(s[t] - top); sum += s[t]; }
        for (int64_t i = 0; i < d; i++) o[i] = 0;
        for (int64_t t = 0, b = 0; t < len; b++) {
            int64_t at = table[b] * s_block + s_kv;
            for (int64_t u = 0; u < bs && t < len; u++, t++) {
                const int8_t *v = head + at + u * s_pos;
                float p = scales ? s[t] * bf16_to_f32(scales[at / d + u * sp]) : s[t];
                for (int64_t i = 0; i < d; i++) o[i] += p * (float)v[i];
            }
        }
        for (int64_t i = 0; i < d; i++) o[i] /= sum;
    }
}

#if defined(__AVX512F__)
/* 16 int8 at p as 16 floats */
static inline __m512 load16_q8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* paged_attend_q8 for head_dim = 16 * M: PAGED_ATTEND_512 over int8, each position times its scale */
#define Q8_POS_SCALE(i) bf16_to_f32(scales[i])
PAGED_ATTEND_512(paged_attend_q8_4, 4, int8_t, load16_q8, 1, Q8_POS_SCALE)
PAGED_ATTEND_512(paged_attend_q8_8, 8, int8_t, load16_q8, 1, Q8_POS_SCALE)
/* and with no scale per position (static scales: paged_attend_any) */
PAGED_ATTEND_512(paged_attend_s8_4, 4, int8_t, load16_q8, 0, NO_SCALE)
PAGED_ATTEND_512(paged_attend_s8_8, 8, int8_t, load16_q8, 0, NO_SCALE)
#elif defined(__AVX2__)
/* 8 int8 at p as 8 floats */
static inline __m256 load8_q8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
/* paged_attend_q8 for head_dim a multiple of 8 (up to 256), 8 lanes at a time */
static void paged_attend_q8_avx2(const float *q, const int8_t *head, const uint16_t *scales, const int64_t *table,
                                 int64_t len, int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                                 int64_t s_pos, float scale, float *s, float *out) {
    int64_t n = d / 8, sp = s_pos / d;  /* scales per position */
    for (int64_t g = 0; g < group; g++) {
        __m256 qv[32], acc[32];
        float top = -INFINITY, sum = 0;
        for (int64_t c = 0; c < n; c++) qv[c] = _mm256_loadu_ps(q + g * d + 8 * c);
        for (int64_t t = 0, b = 0; t < len; b++) {
            int64_t at = table[b] * s_block;
            for (int64_t u = 0; u < bs && t < len; u++, t++) {
                const int8_t *k = head + at + u * s_pos;
                __m256 a = _mm256_mul_ps(qv[0], load8_q8(k));
                for (int64_t c = 1; c < n; c++) a = _mm256_fmadd_ps(qv[c], load8_q8(k + 8 * c), a);
                s[t] = hsum256(a) * (scales ? bf16_to_f32(scales[at / d + u * sp]) : 1.0f) * scale;
                top = s[t] > top ? s[t] : top;
            }
        }
        for (int64_t t = 0; t < len; t++) { s[t] = exp_nonpositive(s[t] - top); sum += s[t]; }
        for (int64_t c = 0; c < n; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t t = 0, b = 0; t < len; b++) {
            int64_t at = table[b] * s_block + s_kv;
            for (int64_t u = 0; u < bs && t < len; u++, t++) {
                __m256 p = _mm256_set1_ps(scales ? s[t] * bf16_to_f32(scales[at / d + u * sp]) : s[t]);
                const int8_t *v = head + at + u * s_pos;
                for (int64_t c = 0; c < n; c++) acc[c] = _mm256_fmadd_ps(p, load8_q8(v + 8 * c), acc[c]);
            }
        }
        __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (int64_t c = 0; c < n; c++) _mm256_storeu_ps(out + g * d + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
}
#endif

/* One (row, kv head) over the int8 cache, as paged_attend; `scales` NULL: every position's is 1. */
static void paged_attend_q8(const float *q, const int8_t *head, const uint16_t *scales, const int64_t *table,
                            int64_t len, int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                            int64_t s_pos, float scale, float *scratch, float *out) {
#if defined(__AVX512F__)
    if (d == 64 && !scales) return paged_attend_s8_4(q, head, NULL, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
    if (d == 128 && !scales) return paged_attend_s8_8(q, head, NULL, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
    if (d == 64) return paged_attend_q8_4(q, head, scales, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
    if (d == 128) return paged_attend_q8_8(q, head, scales, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
#elif defined(__AVX2__)
    if (d % 8 == 0 && d <= 256)
        return paged_attend_q8_avx2(q, head, scales, table, len, group, d, bs, s_block, s_kv, s_pos, scale, scratch, out);
#endif
    paged_attend_q8_generic(q, head, scales, table, len, group, d, bs, s_block, s_kv, s_pos, scale, scratch, out);
}

/* paged_attend over the cache of one layer's kv head j (of nkv): float32, or int8 with `scales`
   (the layer's, one per position) or `fixed` (the layer's static scales [k/v, kv_head]). A static
   key scale multiplies the group's queries before the scores, a static value scale the output,
   so the loop over positions reads int8 alone. */
static inline void paged_attend_any(const float *q, const void *cache, const uint16_t *scales, const float *fixed,
                                    int64_t j, int64_t nkv, const int64_t *table, int64_t len, int64_t group,
                                    int64_t d, int64_t bs, int64_t s_block, int64_t s_kv, int64_t s_head,
                                    int64_t s_pos, float scale, float *scratch, float *out) {
    if (fixed) {
        float scaled[group * d];
        for (int64_t i = 0; i < group * d; i++) scaled[i] = q[i] * fixed[j];
        paged_attend_q8(scaled, (const int8_t *)cache + j * s_head, NULL, table, len, group, d, bs, s_block, s_kv,
                        s_pos, scale, scratch, out);
        for (int64_t i = 0; i < group * d; i++) out[i] *= fixed[nkv + j];
    } else if (scales)
        paged_attend_q8(q, (const int8_t *)cache + j * s_head, scales + j * s_head / d, table, len, group, d, bs,
                        s_block, s_kv, s_pos, scale, scratch, out);
    else
        paged_attend(q, (const float *)cache + j * s_head, table, len, group, d, bs, s_block, s_kv, s_pos, scale,
                     scratch, out);
}

#define PAGED_DECODE_ATTENTION(SUFFIX, T, STORE)                                                             \
void tprt_paged_decode_attention_##SUFFIX(const float *q, const void *cache, const uint16_t *scales,          \
                                          const float *fixed,                                                 \
                                          const int64_t *tables, const int64_t *positions, T *out,            \
                                          float *scratch, int64_t rows,                                       \
                                          int64_t nh, int64_t nkv, int64_t d, int64_t bs, int64_t s_table,    \
                                          int64_t s_block, int64_t s_kv, int64_t s_head, int64_t s_pos,       \
                                          float scale) {                                                      \
    int64_t group = nh / nkv;                                                                                 \
    float acc[group * d];                                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                                        \
        for (int64_t j = 0; j < nkv; j++) {                                                                   \
            paged_attend_any(q + (r * nh + j * group) * d, cache, scales, fixed, j, nkv, tables + r * s_table, \
                             positions[r] + 1, group, d, bs, s_block, s_kv, s_head, s_pos, scale, scratch, acc); \
            T *o = out + (r * nh + j * group) * d;                                                            \
            for (int64_t i = 0; i < group * d; i++) o[i] = STORE(acc[i]);                                     \
        }                                                                                                     \
}

PAGED_DECODE_ATTENTION(f32, float, f32_store)
PAGED_DECODE_ATTENTION(bf16, uint16_t, f32_to_bf16)

/* ---- Every decoder layer of a decode step of 1-8 rows in one call ----
   The halves above cost a call from Python each, with its argument checks, and the residual adds
   and the all-reduces between them are more; for a small model that was about a fifth of a token.
   A step of a few rows took the module path, about forty Python-level ops per layer.
   tprt_decode_stack runs every layer as one job of the pool: per layer, the residual add with the
   attention norm (one unit), the attention half's sections, the all-reduce of its partial product
   (one unit, where TP > 1), the residual add with the MLP norm, the MLP half's sections and its
   all-reduce; then the last residual add. The threads stay in the job from the first layer to the
   last, meeting at each section's end. Each weight row is read once for every row of the step
   (gemv_rows_*_serial; one row: the one-row GEMV). One row gets the per-half path's bits: the
   same kernels, chunks and roundings, and h + partial rounded to the model dtype as torch's add
   rounds it. Several rows get the module path's roundings, not its bits (the few-row products
   and SwiGLU's exp are tprt's own). Every row's k and v of a layer are in the cache (the heads
   section) before any row attends (the next section; a section ends when all its chunks have):
   tprt.cpu.native_layers relies on it to run a row of several tokens as one-token rows. */
typedef int64_t (*all_reduce_fn)(void *ctx, void *data, int64_t n, int64_t dtype);
#define DTYPE_CODE_F32 0  /* the all-reduce's dtype codes (tprt/distributed/shm_allreduce.c) */
#define DTYPE_CODE_BF16 1

/* The model, built once by tprt.cpu.native.decode_stack_kernel. */
typedef struct {
    int64_t layers, hidden, inter, nh, nkv, d;
    float eps, scale;
    const void *const *weights;  /* per layer, 6 pointers: input norm, q/k/v, o, post-attention norm, gate/up, down */
    all_reduce_fn all_reduce;    /* sums a partial product over the TP group in place; NULL: TP = 1 */
    void *all_reduce_ctx;
    const float *const *scales;  /* per layer, 6: an int8 weight's float32 scales (tprt.quant); NULL: dense */
    const int64_t *groups;       /* per layer, 6: those scales' group sizes */
    int64_t max_rows;            /* rows a step may have (tprt.cpu.native.stack_max_rows): 8, 32 all int8 */
} decode_stack;

/* y [m, n] float32 = x [m, k] float32 times int8 rows w [n, k] with scales s, on this thread, by the
   int8 products' best path (defined with them below). */
static void q8_matmul(const int8_t *w, const float *s, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                      int64_t g);
/* The same for more than 8 rows of x in bf16 (x_bf16) or float32: tprt_gemv_q8's batched paths. */
static void q8_matmul_rows(const int8_t *w, const float *s, const void *x, int64_t x_bf16, float *y, int64_t m,
                           int64_t n, int64_t k, int64_t g);

/* One decode step's place in the paged cache: layer 0's [block, k/v, kv_head, offset, d] with
   element strides, the next layer's s_layer further on. float32, or int8 where `scales` (layer 0's,
   contiguous: see quantize_q8) or `fixed` is not NULL. */
typedef struct {
    void *cache;
    int64_t s_layer, block_size, s_block, s_kv, s_head, s_pos;
    uint16_t *scales;  /* bfloat16 bits */
    const float *fixed;  /* or static scales, every layer's [layer, k/v, kv_head] (quantize_fixed_q8) */
} decode_cache;

/* What every section of a step shares: the step's rows and their buffers, each [rows, ...]. */
typedef struct {
    const decode_stack *m;
    const decode_cache *c;
    int64_t rows, s_table;
    const int64_t *blocks, *offsets, *tables, *positions;  /* per row; a row's table at tables + r * s_table */
    const void *cos, *sin;                                  /* [rows, d] */
    void *h, *normed, *partial, *qkv, *attn, *gate_up, *act;
    float *q, *work;
    int64_t status;  /* the first all-reduce failure's code; later all-reduces are skipped */
} stack_step;

typedef struct {  /* a section's layer */
    stack_step *t;
    int64_t layer;
    const void *norm;  /* add_norm: the norm to apply after the residual add (NULL: none) */
    int first;         /* add_norm: nothing to add yet (layer 0's input) */
} stack_layer;

/* A layer's attention sections after its norm (over `rows` rows): chunks of q/k/v heads, chunks
   of rows x q heads (a whole GQA group per chunk where there are groups enough to go round),
   chunks of o rows. Its MLP sections after its norm: chunks of intermediate features, chunks of
   down rows. `row`: bytes of a weight row of `hidden` values. */
#define ATTENTION_SECTIONS(SUFFIX, a, rows, hidden, nh, nkv, d, row)                                          \
    {stack_heads_##SUFFIX, a, (nh) + 2 * (nkv), chunk_units((nh) + 2 * (nkv), (d) * (row), 1)},               \
    {stack_attend_##SUFFIX, a, (rows) * (nh), (nkv) >= 2 * pool.threads ? (nh) / (nkv) : 1},                  \
    {stack_o_##SUFFIX, a, hidden, chunk_units(hidden, (row) * (nh) * (d) / (hidden), 16)}
#define MLP_SECTIONS(SUFFIX, a, hidden, inter, row)                                                           \
    {stack_gate_up_##SUFFIX, a, inter, chunk_units(inter, 2 * (row), 16)},                                    \
    {stack_down_##SUFFIX, a, hidden, chunk_units(hidden, (row) * (inter) / (hidden), 16)}

#define DECODE_STACK(SUFFIX, T, LOAD, STORE, DTYPE_CODE)                                                     \
/* Weight `slot` (6 * layer + index), rows [row0, row0 + n), times x [rows, k] into y (rows ldy apart):   \
   the dense GEMV, or the int8 product on x in float32. */                                                   \
static void stack_mm_##SUFFIX(const decode_stack *m, int64_t slot, int64_t row0, const T *x, T *y,          \
                              int64_t rows, int64_t n, int64_t k, int64_t ldy) {                              \
    const float *s = m->scales ? m->scales[slot] : NULL;                                                      \
    if (!s) {                                                                                                 \
        gemv_rows_##SUFFIX##_serial((const T *)m->weights[slot] + row0 * k, x, y, rows, n, k, ldy);           \
        return;                                                                                               \
    }                                                                                                         \
    int64_t g = m->groups[slot];                                                                              \
    float yf[rows * n];                                                                                       \
    if (rows > 8) {  /* as tprt_gemv_q8 computes 9-32 rows: the same bits as the module path's products */   \
        q8_matmul_rows((const int8_t *)m->weights[slot] + row0 * k, s + row0 * (k / g), x, sizeof(T) == 2, yf, \
                       rows, n, k, g);                                                                        \
    } else {                                                                                                  \
        float xf[rows * k];                                                                                   \
        for (int64_t i = 0; i < rows * k; i++) xf[i] = LOAD(x[i]);                                            \
        q8_matmul((const int8_t *)m->weights[slot] + row0 * k, s + row0 * (k / g), xf, yf, rows, n, k, g);    \
    }                                                                                                         \
    for (int64_t r = 0; r < rows; r++)                                                                        \
        for (int64_t j = 0; j < n; j++) y[r * ldy + j] = STORE(yf[r * n + j]);                                \
}                                                                                                             \
static void stack_add_norm_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                      \
    const stack_layer *a = arg;                                                                               \
    stack_step *t = a->t;                                                                                     \
    int64_t n = t->m->hidden;                                                                                 \
    T *h = t->h;                                                                                              \
    const T *partial = t->partial;                                                                            \
    (void)lo, (void)hi;                                                                                       \
    if (!a->first)                                                                                            \
        for (int64_t i = 0; i < t->rows * n; i++) h[i] = STORE(LOAD(h[i]) + LOAD(partial[i]));               \
    if (a->norm) tprt_rms_norm_##SUFFIX(h, a->norm, t->normed, t->rows, n, t->m->eps);                        \
}                                                                                                             \
static void stack_reduce_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                        \
    stack_step *t = ((const stack_layer *)arg)->t;                                                            \
    (void)lo, (void)hi;                                                                                       \
    if (t->status == 0)                                                                                       \
        t->status = t->m->all_reduce(t->m->all_reduce_ctx, t->partial, t->rows * t->m->hidden, DTYPE_CODE);   \
}                                                                                                             \
/* heads [lo, hi): their q/k/v rows for every row, then each row's RoPE or cache write */                  \
static void stack_heads_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                         \
    const stack_layer *a = arg;                                                                               \
    const stack_step *t = a->t;                                                                               \
    const decode_stack *m = t->m;                                                                             \
    const decode_cache *c = t->c;                                                                             \
    int64_t d = m->d, heads = m->nh + 2 * m->nkv;                                                             \
    int64_t q8 = c->scales || c->fixed;                                                                       \
    const float *fixed = c->fixed ? c->fixed + a->layer * 2 * m->nkv : NULL;                                  \
    float stage[q8 ? 2 * m->nkv * d : 1];  /* int8 cache: the row's k/v heads before quantizing */            \
    stack_mm_##SUFFIX(m, 6 * a->layer + 1, lo * d, t->normed, (T *)t->qkv + lo * d, t->rows, (hi - lo) * d,   \
                      m->hidden, heads * d);                                                                  \
    for (int64_t r = 0; r < t->rows; r++) {                                                                   \
        int64_t e = a->layer * c->s_layer + t->blocks[r] * c->s_block + t->offsets[r] * c->s_pos;             \
        float *at = q8 ? stage : (float *)c->cache + e;                                                       \
        for (int64_t h = lo; h < hi; h++)                                                                     \
            rope_head_##SUFFIX((const T *)t->qkv + r * heads * d, (const T *)t->cos + r * d,                  \
                               (const T *)t->sin + r * d, t->q + r * m->nh * d, at, h, m->nh, m->nkv, d,      \
                               q8 ? m->nkv * d : c->s_kv, q8 ? d : c->s_head);                                \
        if (q8)                                                                                               \
            store_q8_heads(stage, (int8_t *)c->cache + e, c->scales ? c->scales + e / d : NULL, fixed, lo, hi,  \
                           m->nh, m->nkv, d, c->s_kv, c->s_head);                                             \
    }                                                                                                         \
}                                                                                                             \
/* units [lo, hi) of rows x q heads: runs of q heads of one row sharing a kv head */                         \
static void stack_attend_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                        \
    const stack_layer *a = arg;                                                                               \
    const stack_step *t = a->t;                                                                               \
    const decode_stack *m = t->m;                                                                             \
    const decode_cache *c = t->c;                                                                             \
    int64_t d = m->d, nh = m->nh, group = nh / m->nkv, longest = 0;                                           \
    for (int64_t r = lo / nh; r <= (hi - 1) / nh; r++)                                                        \
        longest = t->positions[r] + 1 > longest ? t->positions[r] + 1 : longest;                              \
    float acc[group * d];                                                                                     \
    float *scores = malloc(sizeof(float) * (size_t)(longest * group));  /* paged_attend: group x len */      \
    int64_t layer = a->layer * c->s_layer;                                                                    \
    const void *cache = c->scales || c->fixed ? (const void *)((const int8_t *)c->cache + layer)              \
                                              : (const void *)((const float *)c->cache + layer);              \
    const uint16_t *scales = c->scales ? c->scales + layer / d : NULL;                                        \
    const float *fixed = c->fixed ? c->fixed + a->layer * 2 * m->nkv : NULL;                                  \
    T *attn = t->attn;                                                                                        \
    for (int64_t u = lo; u < hi;) {                                                                           \
        int64_t r = u / nh, h = u % nh, kv = h / group;                                                       \
        int64_t end = (kv + 1) * group < nh ? (kv + 1) * group : nh;                                          \
        end = end < h + (hi - u) ? end : h + (hi - u);                                                        \
        paged_attend_any(t->q + (r * nh + h) * d, cache, scales, fixed, kv, m->nkv, t->tables + r * t->s_table, \
                         t->positions[r] + 1, end - h, d, c->block_size, c->s_block, c->s_kv, c->s_head,      \
                         c->s_pos, m->scale, scores, acc);                                                    \
        for (int64_t i = 0; i < (end - h) * d; i++) attn[(r * nh + h) * d + i] = STORE(acc[i]);               \
        u += end - h;                                                                                         \
    }                                                                                                         \
    free(scores);                                                                                             \
}                                                                                                             \
static void stack_o_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                             \
    const stack_layer *a = arg;                                                                               \
    const stack_step *t = a->t;                                                                               \
    const decode_stack *m = t->m;                                                                             \
    int64_t k = m->nh * m->d;                                                                                 \
    stack_mm_##SUFFIX(m, 6 * a->layer + 2, lo, t->attn, (T *)t->partial + lo, t->rows, hi - lo, k, m->hidden); \
}                                                                                                             \
/* features [lo, hi): their gate and up rows for every row, then each row's SwiGLU into act */               \
static void stack_gate_up_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                       \
    const stack_layer *a = arg;                                                                               \
    const stack_step *t = a->t;                                                                               \
    const decode_stack *m = t->m;                                                                             \
    int64_t hidden = m->hidden, inter = m->inter;                                                             \
    T *gate_up = t->gate_up, *act = t->act;                                                                   \
    stack_mm_##SUFFIX(m, 6 * a->layer + 4, lo, t->normed, gate_up + lo, t->rows, hi - lo, hidden, 2 * inter);  \
    stack_mm_##SUFFIX(m, 6 * a->layer + 4, inter + lo, t->normed, gate_up + inter + lo, t->rows, hi - lo,      \
                      hidden, 2 * inter);                                                                     \
    for (int64_t r = 0; r < t->rows; r++) {                                                                   \
        const T *g = gate_up + r * 2 * inter;                                                                 \
        float *work = t->work + r * inter;                                                                    \
        for (int64_t i = lo; i < hi; i++) work[i] = LOAD(g[i]);                                               \
        silu_inplace(work + lo, hi - lo);                                                                     \
        for (int64_t i = lo; i < hi; i++) act[r * inter + i] = STORE(LOAD(STORE(work[i])) * LOAD(g[inter + i])); \
    }                                                                                                         \
}                                                                                                             \
static void stack_down_##SUFFIX(void *arg, int64_t lo, int64_t hi) {                                          \
    const stack_layer *a = arg;                                                                               \
    const stack_step *t = a->t;                                                                               \
    const decode_stack *m = t->m;                                                                             \
    stack_mm_##SUFFIX(m, 6 * a->layer + 5, lo, t->act, (T *)t->partial + lo, t->rows, hi - lo, m->inter,      \
                      m->hidden);                                                                             \
}                                                                                                             \
/* h [rows, hidden]: the embedded tokens in, the last layer's outputs (before the final norm) out.     \
   cos/sin [rows, d] are the step's RoPE angles; blocks/offsets: each row's write block and offset,    \
   tables: each row's block table (s_table apart), positions: each row's position. Returns 0, or the   \
   all-reduce's failure code (tprt_shm_all_reduce's). */                                                 \
int64_t tprt_decode_stack_##SUFFIX(const decode_stack *m, T *h, int64_t rows, const T *cos, const T *sin,    \
                                   const decode_cache *c, const int64_t *blocks, const int64_t *offsets,     \
                                   const int64_t *tables, int64_t s_table, const int64_t *positions) {        \
    int64_t L = m->layers, hidden = m->hidden, inter = m->inter, nh = m->nh, nkv = m->nkv, d = m->d;         \
    int64_t row = (int64_t)sizeof(T) * hidden, reduce = m->all_reduce != NULL;                               \
    if (rows < 1 || rows > m->max_rows) return -2;                                                            \
    T normed[rows * hidden], partial[rows * hidden], qkv[rows * (nh + 2 * nkv) * d], attn[rows * nh * d];     \
    T gate_up[rows * 2 * inter], act[rows * inter];                                                           \
    float q[rows * nh * d], work[rows * inter];                                                               \
    stack_step t = {m, c, rows, s_table, blocks, offsets, tables, positions, cos, sin, h, normed, partial,   \
                    qkv, attn, gate_up, act, q, work, 0};                                                     \
    stack_layer at[L], add[2 * L + 1];                                                                        \
    section s[L * (8 + 2 * reduce) + 1];                                                                      \
    int64_t n = 0;                                                                                            \
    for (int64_t l = 0; l < L; l++) {                                                                         \
        const void *const *w = m->weights + 6 * l;                                                            \
        at[l] = (stack_layer){&t, l, NULL, 0};                                                                \
        add[2 * l] = (stack_layer){&t, l, w[0], l == 0};                                                      \
        add[2 * l + 1] = (stack_layer){&t, l, w[3], 0};                                                       \
        section layer[] = {{stack_add_norm_##SUFFIX, &add[2 * l], 1, 1},                                      \
                           ATTENTION_SECTIONS(SUFFIX, &at[l], rows, hidden, nh, nkv, d, row),                 \
                           {stack_reduce_##SUFFIX, &at[l], 1, 1},                                             \
                           {stack_add_norm_##SUFFIX, &add[2 * l + 1], 1, 1},                                  \
                           MLP_SECTIONS(SUFFIX, &at[l], hidden, inter, row),                                  \
                           {stack_reduce_##SUFFIX, &at[l], 1, 1}};                                            \
        for (int i = 0; i < 9; i++)  /* the all-reduces (layer[4], layer[8]) only where TP > 1 */              \
            if (reduce || (i != 4 && i != 8)) s[n++] = layer[i];                                              \
    }                                                                                                         \
    add[2 * L] = (stack_layer){&t, L, NULL, L == 0};                                                          \
    s[n++] = (section){stack_add_norm_##SUFFIX, &add[2 * L], 1, 1};                                           \
    run_job(s, n, L * ((2 * nh + 2 * nkv) * d + 3 * inter) * hidden >= PARALLEL_MIN_ELEMENTS);               \
    return t.status;                                                                                          \
}

DECODE_STACK(f32, float, f32_load, f32_store, DTYPE_CODE_F32)
DECODE_STACK(bf16, uint16_t, bf16_to_f32, f32_to_bf16, DTYPE_CODE_BF16)

/* The halves of a decoder layer for one row (batch-1 decode), each in one call and one job of the
   pool, from the stack's sections; out is this rank's partial product (the caller all-reduces it
   and adds the residual). Attention: RMSNorm(x), the fused q/k/v GEMV, RoPE with the k/v write
   into the paged float32 cache at (block, offset) (as tprt_rope_cache), the attention over the
   row's blocks (as tprt_paged_decode_attention) and the o GEMV; w_qkv [(nh + 2 nkv) d, hidden],
   w_o [hidden, nh d]; block/offset/position point at one int64 each, table at the row's block
   ids; scratch: qkv [(nh + 2 nkv) d] and attn [nh d] in the model dtype, q [nh d] float32. MLP:
   RMSNorm(x), the fused gate/up GEMV, silu(gate) * up and the down GEMV, rounded as torch's ops
   round in the model dtype; w_gate_up [2 inter, hidden] (gate rows, then up rows), w_down
   [hidden, inter]; scratch: gate_up [2 inter] in the model dtype, work [inter] float32. */
#define DECODE_HALVES(SUFFIX, T)                                                                              \
void tprt_paged_attention_decode_##SUFFIX(const T *x, const T *norm_w, const T *w_qkv, const T *w_o,         \
                                          const T *cos, const T *sin, void *cache, uint16_t *scales,          \
                                          const float *fixed, const int64_t *block,                           \
                                          const int64_t *offset, const int64_t *table,                       \
                                          const int64_t *position, T *out, T *qkv, T *attn, float *q,         \
                                          int64_t hidden, int64_t nh, int64_t nkv, int64_t d, int64_t bs,     \
                                          int64_t s_block, int64_t s_kv, int64_t s_head, int64_t s_pos,       \
                                          float eps, float scale) {                                           \
    const void *weights[6] = {norm_w, w_qkv, w_o, NULL, NULL, NULL};                                          \
    decode_stack m = {1, hidden, 0, nh, nkv, d, eps, scale, weights, NULL, NULL};                             \
    decode_cache c = {cache, 0, bs, s_block, s_kv, s_head, s_pos, scales, fixed};                             \
    T normed[hidden];                                                                                         \
    stack_step t = {&m, &c, 1, 0, block, offset, table, position, cos, sin, (void *)x, normed, out, qkv, attn, \
                    NULL, NULL, q, NULL, 0};                                                                  \
    stack_layer norm = {&t, 0, norm_w, 1}, layer = {&t, 0, NULL, 0};                                          \
    int64_t row = (int64_t)sizeof(T) * hidden;                                                                \
    section s[] = {{stack_add_norm_##SUFFIX, &norm, 1, 1}, ATTENTION_SECTIONS(SUFFIX, &layer, 1, hidden, nh, nkv, d, row)}; \
    run_job(s, 4, (nh + 2 * nkv + nh) * d * hidden >= PARALLEL_MIN_ELEMENTS);                                 \
}                                                                                                             \
void tprt_mlp_decode_##SUFFIX(const T *x, const T *norm_w, const T *w_gate_up, const T *w_down, T *out,      \
                              T *gate_up, float *work, int64_t hidden, int64_t inter, float eps) {            \
    const void *weights[6] = {NULL, NULL, NULL, norm_w, w_gate_up, w_down};                                   \
    decode_stack m = {1, hidden, inter, 0, 0, 0, eps, 0, weights, NULL, NULL};                                \
    T normed[hidden], act[inter];                                                                             \
    stack_step t = {&m, NULL, 1, 0, NULL, NULL, NULL, NULL, NULL, NULL, (void *)x, normed, out, NULL, NULL,   \
                    gate_up, act, NULL, work, 0};                                                             \
    stack_layer norm = {&t, 0, norm_w, 1}, layer = {&t, 0, NULL, 0};                                          \
    int64_t row = (int64_t)sizeof(T) * hidden;                                                                \
    section s[] = {{stack_add_norm_##SUFFIX, &norm, 1, 1}, MLP_SECTIONS(SUFFIX, &layer, hidden, inter, row)}; \
    run_job(s, 3, 3 * inter * hidden >= PARALLEL_MIN_ELEMENTS);                                               \
}

DECODE_HALVES(f32, float)
DECODE_HALVES(bf16, uint16_t)

/* ---- int8 weight-only products (tprt.quant): y[m, n] = sum_k x[m, k] * W[n, k] * s[n, k / g] ----
   W int8 [n, k] row-major, s float32 [n, k / g] (one scale per row and group of g columns; per
   channel g = k). The weight is read once, front to back, for all m <= 8 rows, at one byte per
   value (half of bf16's traffic: decode reads weights, so this is its speed). Weight-only: the
   activations are not quantized; each int8 value is converted exactly to float32 and multiplied
   with x in float32, a group's products summed in float32 and then scaled, the groups summed in
   float32. The vector paths (AVX-512F, AVX2, chosen by -march=native like every kernel here)
   need g % 16 (% 8) == 0, which the format guarantees; otherwise the scalar loop runs. x arrives
   in the model dtype and is converted to float32 once per call. */
#define Q8_TILE_BYTES (16 * 1024)  /* see q8v_section */
typedef struct {
    const int8_t *w;
    const float *s, *x;  /* x: float32 [m, k] */
    float *y;            /* float32 [m, n] */
    int64_t m, n, k, g;
} q8_args;

static void q8_rows_scalar(const int8_t *w, const float *s, const float *x, float *y, int64_t m, int64_t n,
                           int64_t k, int64_t g, int64_t ldy) {
    int64_t groups = k / g;
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i = 0; i < m; i++) {
            float total = 0;
            for (int64_t b = 0; b < groups; b++) {
                float acc = 0;
                for (int64_t c = b * g; c < (b + 1) * g; c++) acc += (float)w[r * k + c] * x[i * k + c];
                total += acc * s[r * groups + b];
            }
            y[i * ldy + r] = total;
        }
    }
}

/* Q8_ROWS(M, U): M input rows, U independent accumulators per row (one FMA chain per row would
   wait on the FMA's latency every 16 weights: at one or two rows that, not memory, was the limit). */
#if defined(__AVX512F__)
#define Q8_LANES 16
#define Q8_ROWS(M, U)                                                                                        \
static void q8_rows_##M##_##U(const int8_t *w, const float *s, const float *x, float *y, int64_t n, int64_t k, \
                              int64_t g, int64_t ldy) {                                                       \
    int64_t groups = k / g;                                                                                   \
    prefetch_start(w);                                                                                        \
    for (int64_t r = 0; r < n; r++) {                                                                         \
        const int8_t *row = w + r * k;                                                                        \
        __m512 tot[M];                                                                                        \
        for (int i = 0; i < M; i++) tot[i] = _mm512_setzero_ps();                                             \
        for (int64_t b = 0; b < groups; b++) {                                                                \
            __m512 acc[M][U];                                                                                 \
            for (int i = 0; i < M; i++)                                                                       \
                for (int u = 0; u < U; u++) acc[i][u] = _mm512_setzero_ps();                                  \
            for (int64_t c = b * g; c < (b + 1) * g; c += 16 * U) {                                           \
                if (!(c & 63)) _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES, PREFETCH_HINT);         \
                for (int u = 0; u < U; u++) {                                                                 \
                    __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                      \
                        _mm_loadu_si128((const __m128i *)(row + c + 16 * u))));                               \
                    for (int i = 0; i < M; i++)                                                               \
                        acc[i][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i * k + c + 16 * u), acc[i][u]);  \
                }                                                                                             \
            }                                                                                                 \
            __m512 sv = _mm512_set1_ps(s[r * groups + b]);                                                    \
            for (int i = 0; i < M; i++) {                                                                     \
                __m512 sum = acc[i][0];                                                                       \
                for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[i][u]);                              \
                tot[i] = _mm512_fmadd_ps(sum, sv, tot[i]);                                                    \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < M; i++) y[i * ldy + r] = _mm512_reduce_add_ps(tot[i]);                            \
    }                                                                                                         \
}
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_LANES 8
static inline float q8_hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#define Q8_ROWS(M, U)                                                                                        \
static void q8_rows_##M##_##U(const int8_t *w, const float *s, const float *x, float *y, int64_t n, int64_t k, \
                              int64_t g, int64_t ldy) {                                                       \
    int64_t groups = k / g;                                                                                   \
    prefetch_start(w);                                                                                        \
    for (int64_t r = 0; r < n; r++) {                                                                         \
        const int8_t *row = w + r * k;                                                                        \
        __m256 tot[M];                                                                                        \
        for (int i = 0; i < M; i++) tot[i] = _mm256_setzero_ps();                                             \
        for (int64_t b = 0; b < groups; b++) {                                                                \
            __m256 acc[M][U];                                                                                 \
            for (int i = 0; i < M; i++)                                                                       \
                for (int u = 0; u < U; u++) acc[i][u] = _mm256_setzero_ps();                                  \
            for (int64_t c = b * g; c < (b + 1) * g; c += 8 * U) {                                            \
                if (!(c & 63)) _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES, PREFETCH_HINT);         \
                for (int u = 0; u < U; u++) {                                                                 \
                    __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                                      \
                        _mm_loadl_epi64((const __m128i *)(row + c + 8 * u))));                                \
                    for (int i = 0; i < M; i++)                                                               \
                        acc[i][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * k + c + 8 * u), acc[i][u]);   \
                }                                                                                             \
            }                                                                                                 \
            __m256 sv = _mm256_set1_ps(s[r * groups + b]);                                                    \
            for (int i = 0; i < M; i++) {                                                                     \
                __m256 sum = acc[i][0];                                                                       \
                for (int u = 1; u < U; u++) sum = _mm256_add_ps(sum, acc[i][u]);                              \
                tot[i] = _mm256_fmadd_ps(sum, sv, tot[i]);                                                    \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < M; i++) y[i * ldy + r] = q8_hsum256(tot[i]);                                      \
    }                                                                                                         \
}
#endif

#if defined(Q8_LANES)
Q8_ROWS(1, 1) Q8_ROWS(1, 2) Q8_ROWS(1, 4) Q8_ROWS(2, 1) Q8_ROWS(2, 2) Q8_ROWS(3, 1) Q8_ROWS(4, 1)
Q8_ROWS(5, 1) Q8_ROWS(6, 1) Q8_ROWS(7, 1) Q8_ROWS(8, 1)
typedef void (*q8_fn)(const int8_t *, const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t);
/* The variant for m rows and group g: as many accumulators per row as the group allows, up to 4
   per row at one row and 2 at two. NULL when g is not a whole number of vectors. */
static q8_fn q8_variant(int64_t m, int64_t g) {
    static const q8_fn one_acc[] = {0, q8_rows_1_1, q8_rows_2_1, q8_rows_3_1, q8_rows_4_1, q8_rows_5_1,
                                    q8_rows_6_1, q8_rows_7_1, q8_rows_8_1};
    if (g % Q8_LANES || m < 1 || m > 8) return NULL;
    if (m == 1 && g % (4 * Q8_LANES) == 0) return q8_rows_1_4;
    if (m == 1 && g % (2 * Q8_LANES) == 0) return q8_rows_1_2;
    if (m == 2 && g % (2 * Q8_LANES) == 0) return q8_rows_2_2;
    return one_acc[m];
}
#endif

/* The AVX-512 VNNI path (as llama.cpp's Q8_0 products): x is quantized per block of 32 columns to
   int8 with a float32 scale (symmetric, round to nearest), held as unsigned bytes x + 128 for
   vpdpbusd (unsigned x signed bytes, four products summed per int32 lane: 64 products per
   instruction instead of 16 FMAs); the +128 comes back out as 128 * sum(w), one more vpdpbusd per
   64 weights shared by all rows. The integer sums are exact; each block's is scaled by its x scale
   (and, group-wise, the weight's group scale) in float32. So the only difference from the
   weight-only float32 path is x's rounding to 8 bits per block (relative error <= 1/254 of the
   block's largest |x|), which bench/quant_bench.py measures in perplexity. Needs k % 64 == 0 and
   g % 32 == 0; other shapes take the float32 path above. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define Q8V_BLOCK 32
typedef struct {
    const int8_t *w;
    const float *s;
    const uint8_t *xu;  /* [m, k]: x quantized + 128 */
    const float *xs;    /* [m, k / 64 * 16]: per 64 columns, lanes 0-7 block 0's scale, 8-15 block 1's */
    float *y;
    int64_t m, n, k, g;
} q8v_args;

#define Q8V_ROWS(M)                                                                                          \
static void q8v_rows_##M(const q8v_args *a, int64_t lo, int64_t hi) {                                         \
    const int64_t k = a->k, g = a->g, groups = k / g;                                                         \
    const __m512i bias = _mm512_set1_epi8((char)128);                                                         \
    const int per_channel = groups == 1;                                                                      \
    prefetch_start(a->w + lo * k);                                                                            \
    for (int64_t r = lo; r < hi; r++) {                                                                       \
        const int8_t *row = a->w + r * k;                                                                     \
        const float *srow = a->s + r * groups;                                                                \
        __m512 tot[M][2];                                                                                     \
        for (int i = 0; i < M; i++) tot[i][0] = tot[i][1] = _mm512_setzero_ps();                              \
        if (g == 32 && k % 128 == 0) { /* Q8_0's groups: the same sums, 128 columns a step, and the  \
            four group scales of a step spread to the lanes by two permutes (not three ops per 64) */ \
            const __m512i lanes01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);           \
            const __m512i lanes23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);           \
            for (int64_t c = 0; c < k; c += 128) {                                                            \
                _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES, PREFETCH_HINT);                        \
                _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES + 64, PREFETCH_HINT);                   \
                __m512i w0 = _mm512_loadu_si512(row + c), w1 = _mm512_loadu_si512(row + c + 64);              \
                __m512i corr0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w0);                        \
                __m512i corr1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w1);                        \
                __m512 s4 = _mm512_castps128_ps512(_mm_loadu_ps(srow + c / 32));                              \
                __m512 ws0 = _mm512_permutexvar_ps(lanes01, s4), ws1 = _mm512_permutexvar_ps(lanes23, s4);    \
                for (int i = 0; i < M; i++) {                                                                 \
                    const uint8_t *xi = a->xu + i * k + c;                                                    \
                    const float *si = a->xs + i * (k / 64 * 16) + c / 4;                                      \
                    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xi), w0);     \
                    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xi + 64), w1); \
                    tot[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d0, corr0)),              \
                                                _mm512_mul_ps(_mm512_loadu_ps(si), ws0), tot[i][0]);          \
                    tot[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d1, corr1)),              \
                                                _mm512_mul_ps(_mm512_loadu_ps(si + 16), ws1), tot[i][1]);     \
                }                                                                                             \
            }                                                                                                 \
        } else                                                                                                \
        for (int64_t c = 0; c < k; c += 64) {                                                                 \
            const int u = (int)((c >> 6) & 1);                                                                \
            _mm_prefetch((const char *)(row + c) + PREFETCH_BYTES, PREFETCH_HINT);                            \
            __m512i wv = _mm512_loadu_si512(row + c);                                                         \
            __m512i corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wv);                             \
            __m512 wsv = per_channel ? _mm512_set1_ps(1.0f)                                                   \
                       : g >= 64 ? _mm512_set1_ps(srow[c / g])                                                \
                       : _mm512_insertf32x8(_mm512_set1_ps(srow[c / g]),                                      \
                                            _mm256_set1_ps(srow[c / g + 1]), 1);                              \
            for (int i = 0; i < M; i++) {                                                                     \
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(),                                       \
                                                _mm512_loadu_si512(a->xu + i * k + c), wv);                   \
                __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(d, corr));                                     \
                __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(a->xs + i * (k / 64 * 16) + c / 4), wsv);            \
                if (u) tot[i][1] = _mm512_fmadd_ps(f, sc, tot[i][1]);                                         \
                else tot[i][0] = _mm512_fmadd_ps(f, sc, tot[i][0]);                                           \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < M; i++) {                                                                         \
            float v = _mm512_reduce_add_ps(_mm512_add_ps(tot[i][0], tot[i][1]));                              \
            a->y[i * a->n + r] = per_channel ? v * srow[0] : v;                                               \
        }                                                                                                     \
    }                                                                                                         \
}
Q8V_ROWS(1) Q8V_ROWS(2) Q8V_ROWS(3) Q8V_ROWS(4) Q8V_ROWS(5) Q8V_ROWS(6) Q8V_ROWS(7) Q8V_ROWS(8)

/* More than 8 rows: the weight rows of a tile of Q8_TILE_BYTES are taken by every group of 8 input
   rows in turn, so they come from memory once and from the cache after (two passes over the whole
   weight would read it twice from memory: batched decode reads weights too). */
static void q8v_section(void *arg, int64_t lo, int64_t hi) {
    static void (*const kernel[])(const q8v_args *, int64_t, int64_t) = {
        0, q8v_rows_1, q8v_rows_2, q8v_rows_3, q8v_rows_4, q8v_rows_5, q8v_rows_6, q8v_rows_7, q8v_rows_8};
    const q8v_args *a = arg;
    if (a->m <= 8) {
        kernel[a->m](a, lo, hi);
        return;
    }
    int64_t tile = Q8_TILE_BYTES / a->k > 0 ? Q8_TILE_BYTES / a->k : 1;
    for (int64_t t0 = lo; t0 < hi; t0 += tile) {
        int64_t t1 = t0 + tile < hi ? t0 + tile : hi;
        for (int64_t i0 = 0; i0 < a->m; i0 += 8) {
            q8v_args part = *a;
            part.m = a->m - i0 < 8 ? a->m - i0 : 8;
            part.xu = a->xu + i0 * a->k;
            part.xs = a->xs + i0 * (a->k / 64 * 16);
            part.y = a->y + i0 * a->n;
            kernel[part.m](&part, t0, t1);
        }
    }
}

/* x [m, k] float32 -> xu (x quantized per block of 32, + 128) and xs (block scales laid out per
   64 columns as 16 lanes). An all-zero block gets scale 0 and bytes 128. */
static void q8v_quantize_x(const float *x, int64_t m, int64_t k, uint8_t *xu, float *xs) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < k / Q8V_BLOCK; b++) {
            const float *v = x + i * k + b * Q8V_BLOCK;
            float amax = 0;
            for (int j = 0; j < Q8V_BLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
            float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
            for (int j = 0; j < Q8V_BLOCK; j++)
                xu[i * k + b * Q8V_BLOCK + j] = (uint8_t)((int)nearbyintf(v[j] * inv) + 128);
            float *lanes = xs + i * (k / 64 * 16) + (b / 2) * 16 + (b % 2) * 8;
            for (int j = 0; j < 8; j++) lanes[j] = scale;
        }
}
#endif

/* Which path q8 products take on this build: 4 AVX-512 VNNI (x quantized per 32), 3 AVX-512F,
   2 AVX2, 1 scalar only (for tests). */
int64_t tprt_q8_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return 4;
#elif defined(__AVX512F__)
    return 3;
#elif defined(Q8_LANES)
    return 2;
#else
    return 1;
#endif
}

static void q8_matmul(const int8_t *w, const float *s, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                      int64_t g) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (k % 64 == 0 && g % 32 == 0 && m >= 1 && m <= 8) {
        static void (*const kernel[])(const q8v_args *, int64_t, int64_t) = {
            0, q8v_rows_1, q8v_rows_2, q8v_rows_3, q8v_rows_4, q8v_rows_5, q8v_rows_6, q8v_rows_7, q8v_rows_8};
        uint8_t xu[m * k];
        float xs[m * (k / 64) * 16];
        q8v_quantize_x(x, m, k, xu, xs);
        q8v_args a = {w, s, xu, xs, y, m, n, k, g};
        kernel[m](&a, 0, n);
        return;
    }
#endif
#if defined(Q8_LANES)
    q8_fn fn = q8_variant(m, g);
    if (fn) {
        fn(w, s, x, y, n, k, g, n);
        return;
    }
#endif
    q8_rows_scalar(w, s, x, y, m, n, k, g, n);
}

static void q8_section(void *arg, int64_t lo, int64_t hi) {
    const q8_args *a = arg;
    int64_t tile = a->m <= 8 ? hi - lo : (Q8_TILE_BYTES / a->k > 0 ? Q8_TILE_BYTES / a->k : 1);
    for (int64_t t0 = lo; t0 < hi; t0 += tile) {  /* as q8v_section: 8 input rows at a time per tile */
        int64_t t1 = t0 + tile < hi ? t0 + tile : hi;
        const int8_t *w = a->w + t0 * a->k;
        const float *s = a->s + t0 * (a->k / a->g);
        for (int64_t i0 = 0; i0 < a->m; i0 += 8) {
            int64_t m = a->m - i0 < 8 ? a->m - i0 : 8;
            const float *x = a->x + i0 * a->k;
            float *y = a->y + i0 * a->n + t0;
#if defined(Q8_LANES)
            q8_fn fn = q8_variant(m, a->g);
            if (fn) {
                fn(w, s, x, y, t1 - t0, a->k, a->g, a->n);
                continue;
            }
#endif
            q8_rows_scalar(w, s, x, y, m, t1 - t0, a->k, a->g, a->n);
        }
    }
}

#if defined(__AVX512BF16__)
/* 9-32 rows of bf16 activations (batched decode). The VNNI loop spends about seven instructions
   per 64 products and input row (each 32-column block's int32 sum converted and scaled, row by
   row), so at 16 rows it is bound by arithmetic, not by the weight's bytes. Here each tile of
   weight rows is dequantized once into bf16 (w * s rounded to bf16, as a bf16 model's weight is
   rounded), and every 8 input rows take it with bf16 dot products (`q8b_dots`): 32 products per
   instruction, no per-row conversions. The weight is still read from memory once, as int8. */
#define Q8B_MIN_ROWS 9
typedef struct {
    const int8_t *w;
    const float *s;
    const uint16_t *x;  /* bf16 [m, k] */
    float *y;           /* [m, n] */
    int64_t m, n, k, g;
} q8b_args;

/* Q8B_DOTS(M): y[i * ldy + r] = w[r] . x[i] in float32 for nw bf16 weight rows and M input rows
   (k % 32 == 0): two weight rows at a time against the M input rows, so each x load serves two
   dot products and each weight load M (2M accumulators in registers: M is a constant). */
#define Q8B_DOTS(M)                                                                                          \
static void q8b_dots_##M(const uint16_t *w, int64_t nw, const uint16_t *x, int64_t k, float *y, int64_t ldy) { \
    int64_t r = 0;                                                                                            \
    for (; r + 2 <= nw; r += 2) {                                                                             \
        const uint16_t *w0 = w + r * k, *w1 = w0 + k;                                                         \
        __m512 a0[M], a1[M];                                                                                  \
        for (int i = 0; i < M; i++) a0[i] = a1[i] = _mm512_setzero_ps();                                      \
        for (int64_t c = 0; c < k; c += 32) {                                                                 \
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + c), v1 = (__m512bh)_mm512_loadu_si512(w1 + c);    \
            for (int i = 0; i < M; i++) {                                                                     \
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * k + c);                                    \
                a0[i] = _mm512_dpbf16_ps(a0[i], v0, xv);                                                      \
                a1[i] = _mm512_dpbf16_ps(a1[i], v1, xv);                                                      \
            }                                                                                                 \
        }                                                                                                     \
        __m512 acc[16];                                                                                       \
        float sums[16];                                                                                       \
        for (int i = 0; i < 8; i++) {                                                                         \
            acc[2 * i] = i < M ? a0[i] : _mm512_setzero_ps();                                                 \
            acc[2 * i + 1] = i < M ? a1[i] : _mm512_setzero_ps();                                             \
        }                                                                                                     \
        _mm512_storeu_ps(sums, q8b_sum16(acc));                                                               \
        for (int i = 0; i < M; i++) {                                                                         \
            y[i * ldy + r] = sums[2 * i];                                                                     \
            y[i * ldy + r + 1] = sums[2 * i + 1];                                                             \
        }                                                                                                     \
    }                                                                                                         \
    for (; r < nw; r++) {                                                                                     \
        const uint16_t *w0 = w + r * k;                                                                       \
        __m512 a0[M];                                                                                         \
        for (int i = 0; i < M; i++) a0[i] = _mm512_setzero_ps();                                              \
        for (int64_t c = 0; c < k; c += 32) {                                                                 \
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + c);                                               \
            for (int i = 0; i < M; i++)                                                                       \
                a0[i] = _mm512_dpbf16_ps(a0[i], v0, (__m512bh)_mm512_loadu_si512(x + i * k + c));            \
        }                                                                                                     \
        __m512 acc[16];                                                                                       \
        float sums[16];                                                                                       \
        for (int i = 0; i < 8; i++) {                                                                         \
            acc[2 * i] = i < M ? a0[i] : _mm512_setzero_ps();                                                 \
            acc[2 * i + 1] = _mm512_setzero_ps();                                                             \
        }                                                                                                     \
        _mm512_storeu_ps(sums, q8b_sum16(acc));                                                               \
        for (int i = 0; i < M; i++) y[i * ldy + r] = sums[2 * i];                                             \
    }                                                                                                         \
}
Q8B_DOTS(1) Q8B_DOTS(2) Q8B_DOTS(3) Q8B_DOTS(4) Q8B_DOTS(5) Q8B_DOTS(6) Q8B_DOTS(7) Q8B_DOTS(8)
static void (*const q8b_dots[])(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t) = {
    0, q8b_dots_1, q8b_dots_2, q8b_dots_3, q8b_dots_4, q8b_dots_5, q8b_dots_6, q8b_dots_7, q8b_dots_8};

static void q8b_section(void *arg, int64_t lo, int64_t hi) {
    const q8b_args *a = arg;
    const int64_t k = a->k, g = a->g, groups = k / g;
    int64_t tile = Q8_TILE_BYTES / k > 0 ? Q8_TILE_BYTES / k : 1;
    tile = tile < hi - lo ? tile : hi - lo;
    uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)(tile * k));
    for (int64_t t0 = lo; t0 < hi; t0 += tile) {
        int64_t t1 = t0 + tile < hi ? t0 + tile : hi;
        for (int64_t r = t0; r < t1; r++) {
            const int8_t *src = a->w + r * k;
            const float *srow = a->s + r * groups;
            uint16_t *dst = wb + (r - t0) * k;
            for (int64_t c = 0; c < k; c += 32) {
                __m512 sv = _mm512_set1_ps(srow[c / g]);
                __m512 lo16 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c))));
                __m512 hi16 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c + 16))));
                _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi16, sv), _mm512_mul_ps(lo16, sv)));
            }
        }
        for (int64_t i0 = 0; i0 < a->m; i0 += 8) {
            int64_t mm = a->m - i0 < 8 ? a->m - i0 : 8;
            q8b_dots[mm](wb, t1 - t0, a->x + i0 * k, k, a->y + i0 * a->n + t0, a->n);
        }
    }
    free(wb);
}
#endif

/* The decode stack's int8 product for more than 8 rows, on this thread: the section functions of
   tprt_gemv_q8's batched paths over all of w's n rows, so each output has the bits that the
   layer-by-layer path's call gives it (the tiles' bounds move, no element's sums). */
static void q8_matmul_rows(const int8_t *w, const float *s, const void *x, int64_t x_bf16, float *y, int64_t m,
                           int64_t n, int64_t k, int64_t g) {
#if defined(__AVX512BF16__)
    if (x_bf16 && m >= Q8B_MIN_ROWS && g % 32 == 0 && k % 32 == 0) {
        q8b_args a = {w, s, (const uint16_t *)x, y, m, n, k, g};
        q8b_section(&a, 0, n);
        return;
    }
#endif
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    for (int64_t i = 0; i < m * k; i++) xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (k % 64 == 0 && g % 32 == 0) {
        uint8_t *xu = malloc((size_t)(m * k));
        float *xs = malloc(sizeof(float) * (size_t)(m * (k / 64) * 16));
        q8v_quantize_x(xf, m, k, xu, xs);
        q8v_args a = {w, s, xu, xs, y, m, n, k, g};
        q8v_section(&a, 0, n);
        free(xu), free(xs), free(xf);
        return;
    }
#endif
    q8_args a = {w, s, xf, y, m, n, k, g};
    q8_section(&a, 0, n);
    free(xf);
}

/* x [m, k] (float32 or bf16 per `x_bf16`) times the int8 weight, into y [m, n] (float32 or bf16 per
   `y_bf16`, rounded to nearest even). `scalar`: 1 forces the scalar loop, 2 the float32 vector path
   (no VNNI), 0 the fastest this build has (tests compare the paths). */
void tprt_gemv_q8(const int8_t *w, const float *s, const void *x, void *y, int64_t m, int64_t n, int64_t k,
                  int64_t g, int64_t x_bf16, int64_t y_bf16, int64_t scalar) {
    float *yf = y_bf16 ? malloc(sizeof(float) * m * n) : (float *)y;
#if defined(__AVX512BF16__)
    if (scalar == 0 && x_bf16 && m >= Q8B_MIN_ROWS && g % 32 == 0 && k % 32 == 0) {
        q8b_args a = {w, s, (const uint16_t *)x, yf, m, n, k, g};
        section sec = {q8b_section, &a, n, chunk_units(n, k, 16)};
        run_job(&sec, 1, n * k >= PARALLEL_MIN_ELEMENTS);
        if (y_bf16) {
            for (int64_t i = 0; i < m * n; i++) ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
            free(yf);
        }
        return;
    }
#endif
    float *xf = x_bf16 ? malloc(sizeof(float) * m * k) : (float *)x;
    if (x_bf16)
        for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    if (scalar == 1) {
        q8_rows_scalar(w, s, xf, yf, m, n, k, g, n);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    } else if (scalar == 0 && k % 64 == 0 && g % 32 == 0 && m >= 1) {
        uint8_t *xu = malloc((size_t)(m * k));
        float *xs = malloc(sizeof(float) * (size_t)(m * (k / 64) * 16));
        q8v_quantize_x(xf, m, k, xu, xs);
        q8v_args a = {w, s, xu, xs, yf, m, n, k, g};
        section sec = {q8v_section, &a, n, chunk_units(n, k, 16)};
        run_job(&sec, 1, n * k >= PARALLEL_MIN_ELEMENTS);
        free(xu);
        free(xs);
#endif
    } else {
        q8_args a = {w, s, xf, yf, m, n, k, g};
        section sec = {q8_section, &a, n, chunk_units(n, k, 16)};
        run_job(&sec, 1, n * k >= PARALLEL_MIN_ELEMENTS);
    }
    if (y_bf16)
        for (int64_t i = 0; i < m * n; i++) ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
    if (x_bf16) free(xf);
    if (y_bf16) free(yf);
}

/* ---- int8 quantization for the converter (tprt.quant.formats.quantize, bit for bit) ----
   Rows of x [rows, cols] (float32 or bf16) -> q int8 [rows, cols] and s float32 [rows, cols / g]:
   per row and group of g columns, s = max|x| / 127 (1 for an all-zero group) and q = x / s
   rounded half to even, clamped to +-127. Rows are shared by the thread pool. */
typedef struct {
    const void *x;
    int64_t bf16, cols, g;
    int8_t *q;
    float *s;
} quant_args;

static inline float quant_load(const quant_args *a, int64_t i) {
    return a->bf16 ? bf16_to_f32(((const uint16_t *)a->x)[i]) : ((const float *)a->x)[i];
}

#if defined(__AVX512F__)
static inline __m512 quant_load16(const quant_args *a, int64_t i) {
    if (!a->bf16) return _mm512_loadu_ps((const float *)a->x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)a->x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static void quant_section(void *arg, int64_t lo, int64_t hi) {
    const quant_args *a = arg;
    const int64_t g = a->g, groups = a->cols / g;
    for (int64_t r = lo; r < hi; r++)
        for (int64_t b = 0; b < groups; b++) {
            const int64_t start = r * a->cols + b * g;
            float amax = 0;
            int64_t c = 0;
#if defined(__AVX512F__)
            if (g % 16 == 0) {
                __m512 m = _mm512_setzero_ps();
                for (; c < g; c += 16) m = _mm512_max_ps(m, _mm512_abs_ps(quant_load16(a, start + c)));
                amax = _mm512_reduce_max_ps(m);
            }
#endif
            for (; c < g; c++) amax = fmaxf(amax, fabsf(quant_load(a, start + c)));
            const float scale = amax > 0 ? amax / 127.0f : 1.0f;
            a->s[r * groups + b] = scale;
            c = 0;
#if defined(__AVX512F__)
            if (g % 16 == 0) {
                const __m512 sv = _mm512_set1_ps(scale), lo127 = _mm512_set1_ps(-127.0f), hi127 = _mm512_set1_ps(127.0f);
                for (; c < g; c += 16) {
                    __m512 v = _mm512_div_ps(quant_load16(a, start + c), sv);
                    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    v = _mm512_min_ps(_mm512_max_ps(v, lo127), hi127);
                    _mm_storeu_si128((__m128i *)(a->q + start + c), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
                }
            }
#endif
            for (; c < g; c++) {
                float v = nearbyintf(quant_load(a, start + c) / scale);
                a->q[start + c] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
        }
}

void tprt_quantize_q8(const void *x, int64_t bf16, int8_t *q, float *s, int64_t rows, int64_t cols, int64_t g) {
    quant_args a = {x, bf16, cols, g, q, s};
    section sec = {quant_section, &a, rows, chunk_units(rows, cols * (bf16 ? 2 : 4), 1)};
    run_job(&sec, 1, rows * cols >= PARALLEL_MIN_ELEMENTS);
}
