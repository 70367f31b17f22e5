/* Shared by every family of tprt's CPU kernels (kernels.c includes them in order, one translation
   unit): the includes, bfloat16 conversions, per-thread heap scratch and the float helpers
   (exp, softmax, SiLU). */
#pragma once
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
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

/* Per-thread scratch on the heap, one buffer per slot: grown to the largest request and then
   reused, so sized once for a model's dimensions (rather than variable-length arrays of up to a
   few MB on a thread's stack for large models), and freed when the thread exits. A kernel takes
   its own slot, so nested kernels never share one. */
enum { SCRATCH_GEMV_X, SCRATCH_NORM, SCRATCH_STACK_X, SCRATCH_STACK_Y, SCRATCH_Q8_X, SCRATCH_Q8_SCALES, SCRATCH_GLU,
       SCRATCH_SLOTS };
typedef struct { void *p[SCRATCH_SLOTS]; size_t bytes[SCRATCH_SLOTS]; } scratch_set;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *v) {
    scratch_set *set = v;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(set->p[i]);
    free(set);
}

static void scratch_key_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static void *scratch(int slot, size_t bytes) {
    pthread_once(&scratch_once, scratch_key_init);
    scratch_set *set = pthread_getspecific(scratch_key);
    if (set == NULL) {
        set = calloc(1, sizeof *set);
        if (set == NULL || pthread_setspecific(scratch_key, set)) abort();  /* a few bytes: the process is done */
    }
    if (set->bytes[slot] < bytes) {
        size_t size = (bytes + 63) / 64 * 64;
        free(set->p[slot]);
        set->p[slot] = aligned_alloc(64, size);
        if (set->p[slot] == NULL) abort();  /* as a stack overflow would: no partial result */
        set->bytes[slot] = size;
    }
    return set->p[slot];
}

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

/* gelu(g) with the tanh approximation (torch's approximate="tanh": Gemma's GeGLU) in place, float32:
   0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), tanh(y) = sign(y) (1 - e) / (1 + e) with
   e = exp(-2 |y|) <= 1, branch-free so the loop vectorises. */
static void gelu_tanh_inplace(float *g, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(x, x)), x, x));
        __m512 e = exp512_nonpositive(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(y)));
        __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), t)));
    }
#endif
    for (; i < n; i++) {
        float x = g[i], y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        float e = exp_nonpositive(-2.0f * fabsf(y));
        float t = copysignf((1.0f - e) / (1.0f + e), y);
        g[i] = 0.5f * x * (1.0f + t);
    }
}

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
