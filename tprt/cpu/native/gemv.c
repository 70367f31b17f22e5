/* ---- Dense products and norms: one-row GEMVs, RMSNorm, few-row products ---- */

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
    float *xf = scratch(SCRATCH_GEMV_X, (size_t)k * sizeof(float));
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
    float *xf = scratch(SCRATCH_NORM, (size_t)n * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < n; c++) xf[c] = bf16_to_f32(x[r * n + c]);
        float inv = inv_rms(xf, n, eps);
        for (int64_t c = 0; c < n; c++)
            y[r * n + c] = f32_to_bf16(bf16_to_f32(w[c]) * bf16_to_f32(f32_to_bf16(xf[c] * inv)));
    }
}

/* Gemma's RMSNorm: each row of x normalised and scaled by 1 + w, all in float32, rounded once
   (bf16) at the end, as transformers' Gemma norms compute it. y may be x. */
void tprt_rms_norm_unit_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float inv = inv_rms(xr, n, eps);
        for (int64_t c = 0; c < n; c++) y[r * n + c] = xr[c] * inv * (1.0f + w[c]);
    }
}

void tprt_rms_norm_unit_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n, float eps) {
    float *xf = scratch(SCRATCH_NORM, (size_t)n * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < n; c++) xf[c] = bf16_to_f32(x[r * n + c]);
        float inv = inv_rms(xf, n, eps);
        for (int64_t c = 0; c < n; c++) y[r * n + c] = f32_to_bf16(xf[c] * inv * (1.0f + bf16_to_f32(w[c])));
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
