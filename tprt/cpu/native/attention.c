/* ---- Attention: RoPE and the write into the paged KV cache (float32 or int8), paged decode attention ---- */

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
/* A window's start and soft-capping on scores s[0..len): the first `skip` hidden (a sliding window
   that starts inside the row's first block read), the others through cap * tanh(s / cap) where
   cap > 0 (Gemma 2). Returns the largest score after. */
static float adjust_scores(float *s, int64_t len, int64_t skip, float cap) {
    float top = -INFINITY;
    for (int64_t t = 0; t < skip && t < len; t++) s[t] = -INFINITY;
    if (cap > 0) {  /* tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|) <= 1: vectorises as gelu_tanh's */
        for (int64_t t = skip; t < len; t++) {
            float y = s[t] / cap, e = exp_nonpositive(-2.0f * fabsf(y));
            s[t] = cap * copysignf((1.0f - e) / (1.0f + e), y);
        }
    }
    for (int64_t t = skip; t < len; t++) top = s[t] > top ? s[t] : top;
    return top;
}

static void paged_attend_generic(const float *q, const float *head, const int64_t *table, int64_t len,
                                 int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                                 int64_t s_pos, float scale, int64_t skip, float cap, float *s, float *out) {
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, sum = 0, *o = out + g * d;
        for (int64_t t = 0, b = 0; t < len; b++) {
            const float *keys = head + table[b] * s_block;
            for (int64_t u = 0; u < bs && t < len; u++, t++) {
                s[t] = dot_f32(q + g * d, keys + u * s_pos, d) * scale;
                top = s[t] > top ? s[t] : top;
            }
        }
        if (skip || cap > 0) top = adjust_scores(s, len, skip, cap);
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
                 int64_t skip, float cap, float *s, float *out) {                                             \
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
    for (int64_t g = 0; (skip || cap > 0) && g < group; g++) adjust_scores(s + g * len, len, skip, cap);      \
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
                         int64_t skip, float cap, float *scratch, float *out) {
#if defined(__AVX512F__)
    if (d == 64)
        return paged_attend_4(q, head, NULL, table, len, group, bs, s_block, s_kv, s_pos, scale, skip, cap, scratch, out);
    if (d == 128)
        return paged_attend_8(q, head, NULL, table, len, group, bs, s_block, s_kv, s_pos, scale, skip, cap, scratch, out);
#endif
    paged_attend_generic(q, head, table, len, group, d, bs, s_block, s_kv, s_pos, scale, skip, cap, scratch, out);
}

/* paged_attend over an int8 cache: `head` and `scales` at one layer's kv head (scales at head's
   element offset / d); a key's score is its scale times q . its int8 values, a value enters the
   sum times its weight and scale, so nothing is dequantized into memory. */
static void paged_attend_q8_generic(const float *q, const int8_t *head, const uint16_t *scales, const int64_t *table,
                                    int64_t len, int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                                    int64_t s_pos, float scale, int64_t skip, float cap, float *s, float *out) {
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
        if (skip || cap > 0) top = adjust_scores(s, len, skip, cap);
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
                                 int64_t s_pos, float scale, int64_t skip, float cap, float *s, float *out) {
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
        if (skip || cap > 0) top = adjust_scores(s, len, skip, cap);
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
                            int64_t s_pos, float scale, int64_t skip, float cap, float *scratch, float *out) {
#define Q8_ARGS table, len, group, bs, s_block, s_kv, s_pos, scale, skip, cap, scratch, out
#if defined(__AVX512F__)
    if (d == 64 && !scales) return paged_attend_s8_4(q, head, NULL, Q8_ARGS);
    if (d == 128 && !scales) return paged_attend_s8_8(q, head, NULL, Q8_ARGS);
    if (d == 64) return paged_attend_q8_4(q, head, scales, Q8_ARGS);
    if (d == 128) return paged_attend_q8_8(q, head, scales, Q8_ARGS);
#elif defined(__AVX2__)
    if (d % 8 == 0 && d <= 256)
        return paged_attend_q8_avx2(q, head, scales, table, len, group, d, bs, s_block, s_kv, s_pos, scale, skip, cap,
                                    scratch, out);
#endif
#undef Q8_ARGS
    paged_attend_q8_generic(q, head, scales, table, len, group, d, bs, s_block, s_kv, s_pos, scale, skip, cap, scratch,
                            out);
}

/* paged_attend over the cache of one layer's kv head j (of nkv): float32, or int8 with `scales`
   (the layer's, one per position) or `fixed` (the layer's static scales [k/v, kv_head]). A static
   key scale multiplies the group's queries before the scores, a static value scale the output,
   so the loop over positions reads int8 alone. Positions [first, len) are attended (a sliding
   window's: the blocks before first's are not read, and its block's positions before it are
   hidden); scores soft-capped where cap > 0. */
static inline void paged_attend_any(const float *q, const void *cache, const uint16_t *scales, const float *fixed,
                                    int64_t j, int64_t nkv, const int64_t *table, int64_t len, int64_t first,
                                    float cap, int64_t group, int64_t d, int64_t bs, int64_t s_block, int64_t s_kv,
                                    int64_t s_head, int64_t s_pos, float scale, float *scratch, float *out) {
    int64_t skip = first % bs;
    table += first / bs;
    len -= first - skip;
    if (fixed) {
        float scaled[group * d];
        for (int64_t i = 0; i < group * d; i++) scaled[i] = q[i] * fixed[j];
        paged_attend_q8(scaled, (const int8_t *)cache + j * s_head, NULL, table, len, group, d, bs, s_block, s_kv,
                        s_pos, scale, skip, cap, scratch, out);
        for (int64_t i = 0; i < group * d; i++) out[i] *= fixed[nkv + j];
    } else if (scales)
        paged_attend_q8(q, (const int8_t *)cache + j * s_head, scales + j * s_head / d, table, len, group, d, bs,
                        s_block, s_kv, s_pos, scale, skip, cap, scratch, out);
    else
        paged_attend(q, (const float *)cache + j * s_head, table, len, group, d, bs, s_block, s_kv, s_pos, scale,
                     skip, cap, scratch, out);
}

/* The first position a query at `position` sees through a sliding window of `window` (0: none). */
static inline int64_t window_start(int64_t position, int64_t window) {
    return window > 0 && position + 1 > window ? position + 1 - window : 0;
}

#define PAGED_DECODE_ATTENTION(SUFFIX, T, STORE)                                                             \
void tprt_paged_decode_attention_##SUFFIX(const float *q, const void *cache, const uint16_t *scales,          \
                                          const float *fixed,                                                 \
                                          const int64_t *tables, const int64_t *positions, T *out,            \
                                          float *scratch, int64_t rows,                                       \
                                          int64_t nh, int64_t nkv, int64_t d, int64_t bs, int64_t s_table,    \
                                          int64_t s_block, int64_t s_kv, int64_t s_head, int64_t s_pos,       \
                                          float scale, int64_t window, float cap) {                           \
    int64_t group = nh / nkv;                                                                                 \
    float acc[group * d];                                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                                        \
        for (int64_t j = 0; j < nkv; j++) {                                                                   \
            paged_attend_any(q + (r * nh + j * group) * d, cache, scales, fixed, j, nkv, tables + r * s_table, \
                             positions[r] + 1, window_start(positions[r], window), cap, group, d, bs, s_block, \
                             s_kv, s_head, s_pos, scale, scratch, acc);                                       \
            T *o = out + (r * nh + j * group) * d;                                                            \
            for (int64_t i = 0; i < group * d; i++) o[i] = STORE(acc[i]);                                     \
        }                                                                                                     \
}

PAGED_DECODE_ATTENTION(f32, float, f32_store)
PAGED_DECODE_ATTENTION(bf16, uint16_t, f32_to_bf16)
