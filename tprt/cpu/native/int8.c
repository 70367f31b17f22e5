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
        uint8_t *xu = scratch(SCRATCH_Q8_X, (size_t)(m * k));
        float *xs = scratch(SCRATCH_Q8_SCALES, (size_t)(m * (k / 64) * 16) * sizeof(float));
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
