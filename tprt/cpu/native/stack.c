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
    /* per layer, 4 pointers in the model dtype, each NULL where absent (Qwen's deltas from Llama's
       block): the q/k/v bias [(nh + 2 nkv) d], the q norm and k norm [d] (each head RMS-normalised
       before RoPE), the o bias [hidden] (added once, after the all-reduce); NULL: none at all */
    const void *const *extras;
    const int64_t *windows;  /* per layer, its sliding window (0: none); NULL: no layer has one */
    float softcap;           /* attention scores through cap * tanh(s / cap) where > 0 (Gemma 2) */
    int64_t gemma;           /* Gemma's block: norms scale by 1 + w in float32, GeGLU, and `sandwich` */
    /* per layer, 2 pointers: the norms of the attention's and the MLP's outputs, each applied after
       its all-reduce and before its residual add (Gemma's post_attention_layernorm and
       post_feedforward_layernorm; its MLP's input norm is weights[3]); NULL: none */
    const void *const *sandwich;
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
    const void *local_cos, *local_sin;  /* [rows, d]: windowed layers' own angles (Gemma 3); NULL: cos, sin */
    void *h, *normed, *partial, *qkv, *attn, *gate_up, *act;
    float *q, *work;
    int64_t status;  /* the first all-reduce failure's code; later all-reduces are skipped */
} stack_step;

typedef struct {  /* a section's layer */
    stack_step *t;
    int64_t layer;
    const void *norm;  /* add_norm: the norm to apply after the residual add (NULL: none) */
    int first;         /* add_norm: nothing to add yet (layer 0's input) */
    const void *bias;  /* add_norm: a bias the partial product gets first (the o bias; NULL: none) */
    const void *partial_norm;  /* add_norm: a norm of the partial product before the add (Gemma); NULL: none */
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
/* The model's RMSNorm of rows of n values: Llama's, or Gemma's (1 + w, in float32). y may be x. */          \
static void stack_norm_##SUFFIX(const decode_stack *m, const T *x, const T *w, T *y, int64_t rows, int64_t n) { \
    if (m->gemma)                                                                                             \
        tprt_rms_norm_unit_##SUFFIX(x, w, y, rows, n, m->eps);                                                \
    else                                                                                                      \
        tprt_rms_norm_##SUFFIX(x, w, y, rows, n, m->eps);                                                     \
}                                                                                                             \
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
    float *yf = scratch(SCRATCH_STACK_Y, (size_t)(rows * n) * sizeof(float));                                \
    if (rows > 8) {  /* as tprt_gemv_q8 computes 9-32 rows: the same bits as the module path's products */   \
        q8_matmul_rows((const int8_t *)m->weights[slot] + row0 * k, s + row0 * (k / g), x, sizeof(T) == 2, yf, \
                       rows, n, k, g);                                                                        \
    } else {                                                                                                  \
        float *xf = scratch(SCRATCH_STACK_X, (size_t)(rows * k) * sizeof(float));                            \
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
    T *partial = t->partial;                                                                                  \
    const T *bias = a->bias;                                                                                  \
    (void)lo, (void)hi;                                                                                       \
    if (!a->first && a->partial_norm) {  /* Gemma: h + norm(partial (+ bias)), each rounded */               \
        for (int64_t i = 0; bias && i < t->rows * n; i++) partial[i] = STORE(LOAD(partial[i]) + LOAD(bias[i % n])); \
        stack_norm_##SUFFIX(t->m, partial, a->partial_norm, partial, t->rows, n);                             \
        for (int64_t i = 0; i < t->rows * n; i++) h[i] = STORE(LOAD(h[i]) + LOAD(partial[i]));               \
    } else if (!a->first && bias)  /* the module path's rounding: (partial + bias), then h + that */          \
        for (int64_t i = 0; i < t->rows * n; i++)                                                             \
            h[i] = STORE(LOAD(h[i]) + LOAD(STORE(LOAD(partial[i]) + LOAD(bias[i % n]))));                    \
    else if (!a->first)                                                                                       \
        for (int64_t i = 0; i < t->rows * n; i++) h[i] = STORE(LOAD(h[i]) + LOAD(partial[i]));               \
    if (a->norm) stack_norm_##SUFFIX(t->m, h, a->norm, t->normed, t->rows, n);                                \
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
    const void *const *x4 = m->extras ? m->extras + 4 * a->layer : NULL;                                      \
    for (int64_t r = 0; x4 && r < t->rows; r++) {  /* bias, then q/k norms: as the module path rounds */     \
        T *row = (T *)t->qkv + r * heads * d;                                                                 \
        const T *bias = x4[0];                                                                                \
        if (bias)                                                                                             \
            for (int64_t i = lo * d; i < hi * d; i++) row[i] = STORE(LOAD(row[i]) + LOAD(bias[i]));           \
        for (int64_t h = lo; h < hi; h++) {                                                                   \
            const T *norm = h < m->nh ? x4[1] : h < m->nh + m->nkv ? x4[2] : NULL;                            \
            if (norm) stack_norm_##SUFFIX(m, row + h * d, norm, row + h * d, 1, d);                            \
        }                                                                                                     \
    }                                                                                                         \
    int64_t local = m->windows && m->windows[a->layer] > 0 && t->local_cos;  /* the windowed layers' rope */  \
    const T *cos = local ? t->local_cos : t->cos, *sin = local ? t->local_sin : t->sin;                       \
    for (int64_t r = 0; r < t->rows; r++) {                                                                   \
        int64_t e = a->layer * c->s_layer + t->blocks[r] * c->s_block + t->offsets[r] * c->s_pos;             \
        float *at = q8 ? stage : (float *)c->cache + e;                                                       \
        for (int64_t h = lo; h < hi; h++)                                                                     \
            rope_head_##SUFFIX((const T *)t->qkv + r * heads * d, cos + r * d, sin + r * d,                   \
                               t->q + r * m->nh * d, at, h, m->nh, m->nkv, d,                                 \
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
    int64_t window = m->windows ? m->windows[a->layer] : 0;                                                   \
    for (int64_t u = lo; u < hi;) {                                                                           \
        int64_t r = u / nh, h = u % nh, kv = h / group;                                                       \
        int64_t end = (kv + 1) * group < nh ? (kv + 1) * group : nh;                                          \
        end = end < h + (hi - u) ? end : h + (hi - u);                                                        \
        paged_attend_any(t->q + (r * nh + h) * d, cache, scales, fixed, kv, m->nkv, t->tables + r * t->s_table, \
                         t->positions[r] + 1, window_start(t->positions[r], window), m->softcap, end - h, d,  \
                         c->block_size, c->s_block, c->s_kv, c->s_head, c->s_pos, m->scale, scores, acc);     \
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
        if (m->gemma)                                                                                         \
            gelu_tanh_inplace(work + lo, hi - lo);                                                            \
        else                                                                                                  \
            silu_inplace(work + lo, hi - lo);                                                                 \
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
                                   const int64_t *tables, int64_t s_table, const int64_t *positions,          \
                                   const T *local_cos, const T *local_sin) {                                  \
    int64_t L = m->layers, hidden = m->hidden, inter = m->inter, nh = m->nh, nkv = m->nkv, d = m->d;         \
    int64_t row = (int64_t)sizeof(T) * hidden, reduce = m->all_reduce != NULL;                               \
    if (rows < 1 || rows > m->max_rows) return -2;                                                            \
    T normed[rows * hidden], partial[rows * hidden], qkv[rows * (nh + 2 * nkv) * d], attn[rows * nh * d];     \
    T gate_up[rows * 2 * inter], act[rows * inter];                                                           \
    float q[rows * nh * d], work[rows * inter];                                                               \
    stack_step t = {m, c, rows, s_table, blocks, offsets, tables, positions, cos, sin, local_cos, local_sin,  \
                    h, normed, partial, qkv, attn, gate_up, act, q, work, 0};                                 \
    stack_layer at[L], add[2 * L + 1];                                                                        \
    section s[L * (8 + 2 * reduce) + 1];                                                                      \
    const void *const *sw = m->sandwich;  /* layer l's attention-output norm at 2 l, MLP-output norm at 2 l + 1 */ \
    int64_t n = 0;                                                                                            \
    for (int64_t l = 0; l < L; l++) {                                                                         \
        const void *const *w = m->weights + 6 * l;                                                            \
        at[l] = (stack_layer){&t, l, NULL, 0, NULL, NULL};                                                    \
        add[2 * l] = (stack_layer){&t, l, w[0], l == 0, NULL, sw && l > 0 ? sw[2 * l - 1] : NULL};            \
        add[2 * l + 1] = (stack_layer){&t, l, w[3], 0, m->extras ? m->extras[4 * l + 3] : NULL,              \
                                       sw ? sw[2 * l] : NULL};                                                \
        section layer[] = {{stack_add_norm_##SUFFIX, &add[2 * l], 1, 1},                                      \
                           ATTENTION_SECTIONS(SUFFIX, &at[l], rows, hidden, nh, nkv, d, row),                 \
                           {stack_reduce_##SUFFIX, &at[l], 1, 1},                                             \
                           {stack_add_norm_##SUFFIX, &add[2 * l + 1], 1, 1},                                  \
                           MLP_SECTIONS(SUFFIX, &at[l], hidden, inter, row),                                  \
                           {stack_reduce_##SUFFIX, &at[l], 1, 1}};                                            \
        for (int i = 0; i < 9; i++)  /* the all-reduces (layer[4], layer[8]) only where TP > 1 */              \
            if (reduce || (i != 4 && i != 8)) s[n++] = layer[i];                                              \
    }                                                                                                         \
    add[2 * L] = (stack_layer){&t, L, NULL, L == 0, NULL, sw && L > 0 ? sw[2 * L - 1] : NULL};                \
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
   ids; scratch: qkv [(nh + 2 nkv) d] and attn [nh d] in the model dtype, q [nh d] float32; extras:
   the layer's 4 decode_stack extras (the o bias is the caller's, after its all-reduce) or NULL. MLP:
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
                                          float eps, float scale, const void *const *extras, int64_t window,   \
                                          float softcap, int64_t gemma) {                                     \
    const void *weights[6] = {norm_w, w_qkv, w_o, NULL, NULL, NULL};                                          \
    decode_stack m = {1, hidden, 0, nh, nkv, d, eps, scale, weights, NULL, NULL, NULL, NULL, 0, extras, &window, \
                      softcap, gemma, NULL};                                                                  \
    decode_cache c = {cache, 0, bs, s_block, s_kv, s_head, s_pos, scales, fixed};                             \
    T normed[hidden];                                                                                         \
    stack_step t = {&m, &c, 1, 0, block, offset, table, position, cos, sin, NULL, NULL, (void *)x, normed, out, \
                    qkv, attn, NULL, NULL, q, NULL, 0};                                                       \
    stack_layer norm = {&t, 0, norm_w, 1, NULL, NULL}, layer = {&t, 0, NULL, 0, NULL, NULL};                  \
    int64_t row = (int64_t)sizeof(T) * hidden;                                                                \
    section s[] = {{stack_add_norm_##SUFFIX, &norm, 1, 1}, ATTENTION_SECTIONS(SUFFIX, &layer, 1, hidden, nh, nkv, d, row)}; \
    run_job(s, 4, (nh + 2 * nkv + nh) * d * hidden >= PARALLEL_MIN_ELEMENTS);                                 \
}                                                                                                             \
void tprt_mlp_decode_##SUFFIX(const T *x, const T *norm_w, const T *w_gate_up, const T *w_down, T *out,      \
                              T *gate_up, float *work, int64_t hidden, int64_t inter, float eps, int64_t gemma) { \
    const void *weights[6] = {NULL, NULL, NULL, norm_w, w_gate_up, w_down};                                   \
    decode_stack m = {1, hidden, inter, 0, 0, 0, eps, 0, weights, NULL, NULL, NULL, NULL, 0, NULL, NULL, 0, gemma, \
                      NULL};                                                                                  \
    T normed[hidden], act[inter];                                                                             \
    stack_step t = {&m, NULL, 1, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, (void *)x, normed, out,   \
                    NULL, NULL, gate_up, act, NULL, work, 0};                                                 \
    stack_layer norm = {&t, 0, norm_w, 1, NULL, NULL}, layer = {&t, 0, NULL, 0, NULL, NULL};                  \
    int64_t row = (int64_t)sizeof(T) * hidden;                                                                \
    section s[] = {{stack_add_norm_##SUFFIX, &norm, 1, 1}, MLP_SECTIONS(SUFFIX, &layer, hidden, inter, row)}; \
    run_job(s, 3, 3 * inter * hidden >= PARALLEL_MIN_ELEMENTS);                                               \
}

DECODE_HALVES(f32, float)
DECODE_HALVES(bf16, uint16_t)

/* GeGLU over rows of the fused gate/up product, gate_up [rows, 2 inter] (gate, then up) -> out
   [rows, inter]: tanh-gelu(gate) * up, rounded as torch's two ops round in the model dtype (the
   stack's MLP section's math), for the module path of steps the stack does not take. */
#define GELU_GLU(SUFFIX, T, LOAD, STORE)                                                                      \
void tprt_gelu_glu_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter) {                         \
    float *work = scratch(SCRATCH_GLU, (size_t)inter * sizeof(float));                                        \
    for (int64_t r = 0; r < rows; r++) {                                                                      \
        const T *g = gate_up + r * 2 * inter;                                                                 \
        for (int64_t i = 0; i < inter; i++) work[i] = LOAD(g[i]);                                             \
        gelu_tanh_inplace(work, inter);                                                                       \
        for (int64_t i = 0; i < inter; i++) out[r * inter + i] = STORE(LOAD(STORE(work[i])) * LOAD(g[inter + i])); \
    }                                                                                                         \
}
GELU_GLU(f32, float, f32_load, f32_store)
GELU_GLU(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
