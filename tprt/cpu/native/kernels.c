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

#if defined(__AVX512BF16__)
/* One row at a time, front to back: the weight is read as one sequential stream, which the
   hardware prefetcher follows at full bandwidth (interleaving several rows measured up to 2x slower). */
void tprt_gemv_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t n, int64_t k) {
    int64_t full = k / 64 * 64, rest = k - full;
    __mmask32 m0 = (__mmask32)(rest >= 32 ? 0xffffffffu : (1ull << rest) - 1);
    __mmask32 m1 = (__mmask32)(rest > 32 ? (1ull << (rest - 32)) - 1 : 0);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        int64_t c = 0;
        for (; c < full; c += 64) {
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
void tprt_gemv_bf16(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t n, int64_t k) {
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

/* fp32: one row at a time (a sequential stream). */
void tprt_gemv_f32(const float *w, const float *x, float *y, int64_t n, int64_t k) {
    for (int64_t r = 0; r < n; r++) y[r] = dot_f32(w + r * k, x, k);
}

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
#define ROPE_CACHE(SUFFIX, T, LOAD, ROUND)                                                                   \
void tprt_rope_cache_##SUFFIX(const T *qkv, const T *cos, const T *sin, float *q_out, float *cache,          \
                              const int64_t *slots, const int64_t *positions, int64_t rows, int64_t nh,       \
                              int64_t nkv, int64_t d, int64_t s_slot, int64_t s_kv, int64_t s_head,          \
                              int64_t s_pos) {                                                                \
    int64_t half = d / 2, heads = nh + 2 * nkv;                                                               \
    for (int64_t r = 0; r < rows; r++) {                                                                      \
        const T *c = cos + r * d, *s = sin + r * d;                                                           \
        float *slot = cache + slots[r] * s_slot + positions[r] * s_pos;                                       \
        for (int64_t h = 0; h < nh + nkv; h++) {                                                              \
            const T *x = qkv + (r * heads + h) * d;                                                           \
            float *o = h < nh ? q_out + (r * nh + h) * d : slot + (h - nh) * s_head;                          \
            for (int64_t i = 0; i < d; i++) {                                                                 \
                float rotated = LOAD(x[i < half ? i + half : i - half]);                                      \
                o[i] = ROUND(ROUND(LOAD(x[i]) * LOAD(c[i])) + rotated * LOAD(s[i]));                          \
            }                                                                                                 \
        }                                                                                                     \
        for (int64_t h = 0; h < nkv; h++) {                                                                   \
            const T *x = qkv + (r * heads + nh + nkv + h) * d;                                                \
            float *o = slot + s_kv + h * s_head;                                                              \
            for (int64_t i = 0; i < d; i++) o[i] = LOAD(x[i]);                                                \
        }                                                                                                     \
    }                                                                                                         \
}

static inline float f32_load(float x) { return x; }
static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline float f32_store(float x) { return x; }
ROPE_CACHE(f32, float, f32_load, f32_round)
ROPE_CACHE(bf16, uint16_t, bf16_to_f32, bf16_round)

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

/* The MLP half of a decoder layer for one row (batch-1 decode), in one call: RMSNorm(x), the fused
   gate/up GEMV, silu(gate) * up and the down GEMV, rounded as torch's ops round in the model
   dtype; out is this rank's partial product (the caller all-reduces it and adds the residual).
   w_gate_up [2 inter, hidden] (gate rows, then up rows), w_down [hidden, inter]; scratch: normed
   [hidden] and gate_up [2 inter] in the model dtype, work [inter] float32. */
#define MLP_DECODE(SUFFIX, T, LOAD, STORE)                                                                   \
void tprt_mlp_decode_##SUFFIX(const T *x, const T *norm_w, const T *w_gate_up, const T *w_down, T *out,      \
                              T *normed, T *gate_up, float *work, int64_t hidden, int64_t inter, float eps) {  \
    tprt_rms_norm_##SUFFIX(x, norm_w, normed, 1, hidden, eps);                                               \
    tprt_gemv_##SUFFIX(w_gate_up, normed, gate_up, 2 * inter, hidden);                                       \
    for (int64_t i = 0; i < inter; i++) work[i] = LOAD(gate_up[i]);                                         \
    silu_inplace(work, inter);                                                                              \
    for (int64_t i = 0; i < inter; i++) /* the activation overwrites the gate half */                       \
        gate_up[i] = STORE(LOAD(STORE(work[i])) * LOAD(gate_up[inter + i]));                                \
    tprt_gemv_##SUFFIX(w_down, gate_up, out, hidden, inter);                                                 \
}

MLP_DECODE(f32, float, f32_load, f32_store)
MLP_DECODE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Matrix products for a few rows (decode of 2-8 sequences): Y[m, :] = X[m, :] W^T. Like the
   one-row GEMV, each weight row is read once, front to back, and serves every input row:
   oneDNN's kernels for so few rows stream the weights at half the bandwidth. One function per
   row count keeps its accumulators in registers; tprt_gemv_rows_* dispatches on m (other
   counts, 1 included, go one row at a time). */
#define GEMV_ROWS_DISPATCH(SUFFIX, T)                                                                        \
void tprt_gemv_rows_##SUFFIX(const T *w, const T *x, T *y, int64_t m, int64_t n, int64_t k) {                \
    static void (*const kernel[])(const T *, const T *, T *, int64_t, int64_t) = {                          \
        0, 0, gemv_rows_##SUFFIX##_2, gemv_rows_##SUFFIX##_3, gemv_rows_##SUFFIX##_4, gemv_rows_##SUFFIX##_5,  \
        gemv_rows_##SUFFIX##_6, gemv_rows_##SUFFIX##_7, gemv_rows_##SUFFIX##_8};                              \
    if (m >= 2 && m <= 8) {                                                                                   \
        kernel[m](w, x, y, n, k);                                                                             \
        return;                                                                                               \
    }                                                                                                         \
    for (int64_t i = 0; i < m; i++) tprt_gemv_##SUFFIX(w, x + i * k, y + i * n, n, k);                       \
}

/* Without AVX-512: the same functions, one row at a time. */
#define GEMV_ROWS_ONE(SUFFIX, T, M)                                                                          \
static void gemv_rows_##SUFFIX##_##M(const T *w, const T *x, T *y, int64_t n, int64_t k) {                   \
    for (int64_t i = 0; i < M; i++) tprt_gemv_##SUFFIX(w, x + i * k, y + i * n, n, k);                       \
}
#define GEMV_ROWS_BY_ROW(SUFFIX, T)                                                                          \
    GEMV_ROWS_ONE(SUFFIX, T, 2) GEMV_ROWS_ONE(SUFFIX, T, 3) GEMV_ROWS_ONE(SUFFIX, T, 4)                     \
    GEMV_ROWS_ONE(SUFFIX, T, 5) GEMV_ROWS_ONE(SUFFIX, T, 6) GEMV_ROWS_ONE(SUFFIX, T, 7)                     \
    GEMV_ROWS_ONE(SUFFIX, T, 8)

#if defined(__AVX512BF16__)
#define GEMV_ROWS_BF16(M)                                                                                    \
static void gemv_rows_bf16_##M(const uint16_t *w, const uint16_t *x, uint16_t *y, int64_t n, int64_t k) {     \
    int64_t full = k / 32 * 32, rest = k - full;                                                              \
    __mmask32 tail = (__mmask32)((1ull << rest) - 1);                                                         \
    for (int64_t r = 0; r < n; r++) {                                                                         \
        const uint16_t *row = w + r * k;                                                                      \
        __m512 acc[M];                                                                                        \
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();                                             \
        for (int64_t c = 0; c < full; c += 32) {                                                              \
            __m512bh wv = (__m512bh)_mm512_loadu_si512(row + c);                                              \
            for (int m = 0; m < M; m++)                                                                       \
                acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * k + c));          \
        }                                                                                                     \
        if (rest) {                                                                                           \
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + full);                               \
            for (int m = 0; m < M; m++)                                                                       \
                acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * k + full)); \
        }                                                                                                     \
        for (int m = 0; m < M; m++) y[m * n + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[m]));                 \
    }                                                                                                         \
}
GEMV_ROWS_BF16(2) GEMV_ROWS_BF16(3) GEMV_ROWS_BF16(4) GEMV_ROWS_BF16(5) GEMV_ROWS_BF16(6) GEMV_ROWS_BF16(7)
GEMV_ROWS_BF16(8)
#else
GEMV_ROWS_BY_ROW(bf16, uint16_t)
#endif
GEMV_ROWS_DISPATCH(bf16, uint16_t)

#if defined(__AVX512F__)
#define GEMV_ROWS_F32(M)                                                                                     \
static void gemv_rows_f32_##M(const float *w, const float *x, float *y, int64_t n, int64_t k) {              \
    int64_t full = k / 16 * 16, rest = k - full;                                                              \
    __mmask16 tail = (__mmask16)((1u << rest) - 1);                                                           \
    for (int64_t r = 0; r < n; r++) {                                                                         \
        const float *row = w + r * k;                                                                         \
        __m512 acc[M];                                                                                        \
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();                                             \
        for (int64_t c = 0; c < full; c += 16) {                                                              \
            __m512 wv = _mm512_loadu_ps(row + c);                                                             \
            for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * k + c), acc[m]);  \
        }                                                                                                     \
        if (rest) {                                                                                           \
            __m512 wv = _mm512_maskz_loadu_ps(tail, row + full);                                              \
            for (int m = 0; m < M; m++)                                                                       \
                acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + m * k + full), acc[m]);          \
        }                                                                                                     \
        for (int m = 0; m < M; m++) y[m * n + r] = _mm512_reduce_add_ps(acc[m]);                              \
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
   dtype. Scores live in `scratch` (at least max position + 1 floats). Sums run in another order
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
/* The same for head_dim = 16 * M, with q's and the output's M vectors kept in registers. */
#define PAGED_ATTEND_512(M)                                                                                   \
static void paged_attend_##M(const float *q, const float *head, const int64_t *table, int64_t len,            \
                             int64_t group, int64_t bs, int64_t s_block, int64_t s_kv, int64_t s_pos,         \
                             float scale, float *s, float *out) {                                             \
    for (int64_t g = 0; g < group; g++) {                                                                     \
        __m512 qv[M], acc[M];                                                                                 \
        for (int c = 0; c < M; c++) qv[c] = _mm512_loadu_ps(q + g * 16 * M + 16 * c);                         \
        for (int64_t t = 0, b = 0; t < len; b++) {                                                            \
            const float *keys = head + table[b] * s_block;                                                    \
            for (int64_t u = 0; u < bs && t < len; u++, t++) {                                                \
                const float *k = keys + u * s_pos;                                                            \
                __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));                                          \
                for (int c = 1; c < M; c++) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);       \
                s[t] = _mm512_reduce_add_ps(a) * scale;                                                       \
            }                                                                                                 \
        }                                                                                                     \
        __m512 inv = _mm512_set1_ps(1.0f / softmax512(s, len));                                              \
        for (int c = 0; c < M; c++) acc[c] = _mm512_setzero_ps();                                             \
        for (int64_t t = 0, b = 0; t < len; b++) {                                                            \
            const float *values = head + table[b] * s_block + s_kv;                                           \
            for (int64_t u = 0; u < bs && t < len; u++, t++) {                                                \
                __m512 p = _mm512_set1_ps(s[t]);                                                              \
                const float *v = values + u * s_pos;                                                          \
                for (int c = 0; c < M; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), acc[c]); \
            }                                                                                                 \
        }                                                                                                     \
        for (int c = 0; c < M; c++) _mm512_storeu_ps(out + g * 16 * M + 16 * c, _mm512_mul_ps(acc[c], inv)); \
    }                                                                                                         \
}
PAGED_ATTEND_512(4)
PAGED_ATTEND_512(8)
#endif

/* One (row, kv head): each q head of the group reads the head's keys and values (kept in cache). */
static void paged_attend(const float *q, const float *head, const int64_t *table, int64_t len, int64_t group,
                         int64_t d, int64_t bs, int64_t s_block, int64_t s_kv, int64_t s_pos, float scale,
                         float *scratch, float *out) {
#if defined(__AVX512F__)
    if (d == 64) return paged_attend_4(q, head, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
    if (d == 128) return paged_attend_8(q, head, table, len, group, bs, s_block, s_kv, s_pos, scale, scratch, out);
#endif
    paged_attend_generic(q, head, table, len, group, d, bs, s_block, s_kv, s_pos, scale, scratch, out);
}

#define PAGED_DECODE_ATTENTION(SUFFIX, T, STORE)                                                             \
void tprt_paged_decode_attention_##SUFFIX(const float *q, const float *cache, const int64_t *tables,           \
                                          const int64_t *positions, T *out, float *scratch, int64_t rows,     \
                                          int64_t nh, int64_t nkv, int64_t d, int64_t bs, int64_t s_table,    \
                                          int64_t s_block, int64_t s_kv, int64_t s_head, int64_t s_pos,       \
                                          float scale) {                                                      \
    int64_t group = nh / nkv;                                                                                 \
    float acc[group * d];                                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                                        \
        for (int64_t j = 0; j < nkv; j++) {                                                                   \
            paged_attend(q + (r * nh + j * group) * d, cache + j * s_head, tables + r * s_table,              \
                         positions[r] + 1, group, d, bs, s_block, s_kv, s_pos, scale, scratch, acc);          \
            T *o = out + (r * nh + j * group) * d;                                                            \
            for (int64_t i = 0; i < group * d; i++) o[i] = STORE(acc[i]);                                     \
        }                                                                                                     \
}

PAGED_DECODE_ATTENTION(f32, float, f32_store)
PAGED_DECODE_ATTENTION(bf16, uint16_t, f32_to_bf16)

/* The attention half of a decoder layer for one row (batch-1 decode), in one call: RMSNorm(x),
   the fused q/k/v GEMV, RoPE with the k/v write into the paged float32 cache at (block, offset)
   (tprt_rope_cache), the attention over the row's blocks (tprt_paged_decode_attention) and the o
   GEMV; out is this rank's partial product. w_qkv [(nh + 2 nkv) d, hidden], w_o [hidden, nh d];
   block/offset/position point at one int64 each, table at the row's block ids; scratch: normed
   [hidden], qkv [(nh + 2 nkv) d] and attn [nh d] in the model dtype, q [nh d] and scores
   [position + 1] float32. */
#define PAGED_ATTENTION_DECODE(SUFFIX, T)                                                                    \
void tprt_paged_attention_decode_##SUFFIX(const T *x, const T *norm_w, const T *w_qkv, const T *w_o,         \
                                          const T *cos, const T *sin, float *cache, const int64_t *block,     \
                                          const int64_t *offset, const int64_t *table,                       \
                                          const int64_t *position, T *out, T *normed, T *qkv, T *attn,        \
                                          float *q, float *scores, int64_t hidden, int64_t nh, int64_t nkv,   \
                                          int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,               \
                                          int64_t s_head, int64_t s_pos, float eps, float scale) {            \
    tprt_rms_norm_##SUFFIX(x, norm_w, normed, 1, hidden, eps);                                               \
    tprt_gemv_##SUFFIX(w_qkv, normed, qkv, (nh + 2 * nkv) * d, hidden);                                      \
    tprt_rope_cache_##SUFFIX(qkv, cos, sin, q, cache, block, offset, 1, nh, nkv, d, s_block, s_kv, s_head,   \
                             s_pos);                                                                         \
    tprt_paged_decode_attention_##SUFFIX(q, cache, table, position, attn, scores, 1, nh, nkv, d, bs, 0,      \
                                         s_block, s_kv, s_head, s_pos, scale);                               \
    tprt_gemv_##SUFFIX(w_o, attn, out, hidden, nh * d);                                                      \
}

PAGED_ATTENTION_DECODE(f32, float)
PAGED_ATTENTION_DECODE(bf16, uint16_t)
