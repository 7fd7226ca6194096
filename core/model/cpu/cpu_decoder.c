/* A stack of pre-norm decoder blocks (RMSNorm, fused QKV, attention, O, RMSNorm, fused gate/up,
 * SiLU x up, down) in one call from Python, for a CPU forward whose every step is a C kernel.
 *
 * Why: driven from Python, a block is eight kernel calls and their glue, ~60 us a block outside
 * the GEMMs at one row on the project's 2-core VM (~1.8 ms a 30-layer decode step). Here the same
 * kernels run in the same order on the same inputs, so the numbers are bit for bit the Python
 * path's, and what remains between them is a function call.
 *
 * The kernels come in as function pointers from their own libraries (cpu_quant_gemm.c,
 * cpu_norm.c, cpu_pointwise.c) and the attention from the backend's native_attend callback
 * (core/model/attention.py), so this file builds against none of them. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef void (*q4_fn)(const float *x, int64_t M, int64_t K, const void *w, const void *sz, int64_t N, int group,
                      float *y, int64_t n_out, int64_t ldy, int sym);
typedef void (*q8_fn)(const float *x, int64_t M, int64_t K, const void *w, const void *scale, int64_t N, float *y);
typedef void (*norm_fn)(const float *x, const float *res, float *sum_out, const float *w, float *out, int64_t rows,
                        int64_t dim, float eps);
typedef void (*silu_fn)(const float *gu, int64_t T, int64_t I, float *out);
typedef void (*attend_fn)(const void *ctx, int64_t layer, const float *qkv, int64_t qkv_row, float *out);

enum { LIN_INT4 = 1, LIN_INT8 = 2, LIN_INT4_SYM = 3 }; /* SYM: q4_linear's scale-only layout */

typedef struct {
    int64_t kind, group, n, k, n_out; /* n: the stored rows (int4: padded to 32); n_out of them kept */
    const void *w, *s;                /* weight bytes and their scales */
    const float *bias;                /* [n_out] or NULL */
} CLinear;

typedef struct {
    int64_t layer; /* the attention layer id */
    const float *in_norm, *post_norm;
    CLinear qkv, o, gate_up, down;
} CBlock;

typedef struct {
    q4_fn q4;
    q8_fn q8;
    norm_fn norm;
    silu_fn silu;
    attend_fn attend;
    const void *attend_ctx;
    float eps;
    int64_t hidden, inter, attn_width; /* attn_width: H * D, the attention output's row */
    int64_t qkv_width;                 /* the widest QKV output of the stack */
} CStack;

/* LoRA deltas (core/lora/layer.py's math, cpu_lora.py builds these): per adapter group of rows,
 * t = x A^T, then y += t B^T, where a fused layer's part p expands only its own rank columns into
 * its own output rows [dst, dst + len).
 *
 * A and B come as int8 copies in blocks of 8 lanes, each row of A and of B with its own float
 * scale: at [rb][k][8] holds A^T's rank columns 8 at a time (rb = r_total / 8 rounded up,
 * zero-padded) with as [rb * 8] their scales, and part p's B^T (scaled) sits at bt + boff[p] as
 * [len / 8 rounded up][rank][8] with its output rows' scales at bs + boff[p] / rank. A lane's sum
 * runs over one row of A or B, so its scale multiplies the sum once. Why: at one row a step is
 * bound by reading A and B (a rank-16 adapter of the 135M model is 19.6 MB in float32, 4.9 MB
 * here), and in blocks each 8-lane load feeds every row of the pass from registers. Each row's
 * sums run in one fixed order (see dot8) whatever its batch and the thread count, so a row's
 * output does not depend on the rows beside it. */

typedef struct {
    const int8_t *at, *bt; /* at NULL: the adapter leaves this layer alone */
    const float *as, *bs;  /* the rows' scales */
    int64_t r_total, rank, nparts;
    int64_t dst[3], len[3], boff[3];
} CLoRALin;

typedef struct {
    int64_t nrows;
    const int64_t *rows;  /* the group's rows of the forward; NULL: rows 0 .. nrows-1 */
    const CLoRALin *lins; /* [nblocks][4]: qkv, o, gate_up, down */
} CLoRAGroup;

typedef struct {
    int64_t ngroups;
    const CLoRAGroup *groups;
} CLoRA;

/* rows per pass over A and B (a third row's accumulators would not fit in the 16 registers), the
 * widest padded t (cpu_lora.py's MAX_RT: three parts of rank 256), accumulators per row */
enum { LORA_ROWS = 2, LORA_MAX_RT = 3 * 256 + 8, LORA_ACC = 4 };

static inline __m256 int8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* sum_{q < n} s[i][q] * w[q][0..8) for each of the nb rows, into d[i]: w is n vectors of 8 int8s,
 * s[i] the row's n scalars. Four accumulators take q in turn (one FMA chain would bound a single
 * row by its latency), summed in a fixed order at the end. Inlined with nb a constant (DOT8), so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot8(const int8_t *w, int64_t n, const float *const *s, int64_t nb,
                                                       __m256 *d) {
    __m256 acc[LORA_ROWS][LORA_ACC];
    for (int64_t i = 0; i < LORA_ROWS; i++)
        for (int u = 0; u < LORA_ACC; u++)
            acc[i][u] = _mm256_setzero_ps();
    int64_t q = 0;
    for (; q + LORA_ACC <= n; q += LORA_ACC) {
        __m256 wv[LORA_ACC];
        for (int u = 0; u < LORA_ACC; u++)
            wv[u] = int8x8(w + (q + u) * 8);
        for (int64_t i = 0; i < nb; i++)
            for (int u = 0; u < LORA_ACC; u++)
                acc[i][u] = _mm256_fmadd_ps(_mm256_set1_ps(s[i][q + u]), wv[u], acc[i][u]);
    }
    for (int u = 0; q < n; q++, u++) {
        const __m256 wv = int8x8(w + q * 8);
        for (int64_t i = 0; i < nb; i++)
            acc[i][u] = _mm256_fmadd_ps(_mm256_set1_ps(s[i][q]), wv, acc[i][u]);
    }
    for (int64_t i = 0; i < nb; i++)
        d[i] = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
}

#define DOT8(w, n, s, nb, d) ((nb) == 1 ? dot8(w, n, s, 1, d) : dot8(w, n, s, 2, d))

/* One group's rows [r0, r0 + nb) (nb <= LORA_ROWS) of one layer, called by every thread of
 * lora_add's team: the shrink's rank blocks and the expand's output blocks are shared out between
 * them (the second core adds memory bandwidth over several passes). t is the team's shared
 * [LORA_ROWS][LORA_MAX_RT]. */
static void lora_block(const CLoRALin *l, const float *x, int64_t k, float *y, int64_t n_out, const int64_t *rows,
                       int64_t r0, int64_t nb, float (*t)[LORA_MAX_RT], int last) {
    const int64_t rb = (l->r_total + 7) / 8;
    const float *xr[LORA_ROWS] = {0}, *tr[LORA_ROWS] = {0};
    float *yr[LORA_ROWS] = {0};
    __m256 d[LORA_ROWS];
    for (int64_t i = 0; i < nb; i++) {
        const int64_t row = rows ? rows[r0 + i] : r0 + i;
        xr[i] = x + row * k;
        yr[i] = y + row * n_out;
    }
#pragma omp for schedule(static)
    for (int64_t jb = 0; jb < rb; jb++) { /* shrink: t[i][8 jb ..] = x_i A^T */
        DOT8(l->at + jb * k * 8, k, xr, nb, d);
        const __m256 sv = _mm256_loadu_ps(l->as + jb * 8);
        for (int64_t i = 0; i < nb; i++)
            _mm256_storeu_ps(t[i] + jb * 8, _mm256_mul_ps(d[i], sv));
    } /* (the loop's barrier: all of t is written before any expand reads it) */
    for (int64_t p = 0; p < l->nparts; p++) { /* expand: y_i[dst ..] += t_i[p rank ..] B_p^T */
        const int64_t rank = l->rank, len = l->len[p];
        for (int64_t i = 0; i < nb; i++)
            tr[i] = t[i] + p * rank;
#pragma omp for schedule(static) nowait
        for (int64_t cb = 0; cb < len; cb += 8) {
            DOT8(l->bt + l->boff[p] + cb * rank, rank, tr, nb, d);
            const int64_t c0 = l->dst[p] + cb, w = len - cb < 8 ? len - cb : 8;
            const __m256 sv = _mm256_loadu_ps(l->bs + l->boff[p] / rank + cb);
            for (int64_t i = 0; i < nb; i++) {
                d[i] = _mm256_mul_ps(d[i], sv);
                if (w == 8) {
                    _mm256_storeu_ps(yr[i] + c0, _mm256_add_ps(_mm256_loadu_ps(yr[i] + c0), d[i]));
                } else {
                    float tail[8];
                    _mm256_storeu_ps(tail, d[i]);
                    for (int64_t c = 0; c < w; c++)
                        yr[i][c0 + c] += tail[c];
                }
            }
        }
    }
    if (!last) {
#pragma omp barrier /* t is read to the end before the next rows' shrink overwrites it */
    } /* (the last rows: the region's own end waits) */
}

/* Linear `lin` (0 qkv, 1 o, 2 gate_up, 3 down) of block `blk`: each group's rows get their delta;
 * rows of no group (base rows) are left as the base layer wrote them. One OpenMP region for all
 * of the layer's groups and rows, on one thread where they are one pass over A and B (a single
 * stream): the team's fork and two barriers, 120 times a step, cost more than the second core's
 * bandwidth gains on one pass (measured with the steps interleaved: 0.72 against 0.85 ms a step
 * for a rank-16 adapter of the embedded model, and the base layers' time dropped too). */
static void lora_add(const CLoRA *lora, int64_t blk, int lin, const float *x, int64_t k, float *y, int64_t n_out) {
    int64_t last_g = -1, passes = 0; /* the last group with rows this layer adapts; none: nothing to do */
    for (int64_t g = 0; g < lora->ngroups; g++)
        if (lora->groups[g].lins[blk * 4 + lin].at && lora->groups[g].nrows > 0) {
            last_g = g;
            passes += (lora->groups[g].nrows + LORA_ROWS - 1) / LORA_ROWS;
        }
    if (last_g < 0)
        return;
    float t[LORA_ROWS][LORA_MAX_RT];
#pragma omp parallel if (passes > 1)
    for (int64_t g = 0; g < lora->ngroups; g++) {
        const CLoRAGroup *grp = lora->groups + g;
        const CLoRALin *l = grp->lins + blk * 4 + lin;
        if (!l->at)
            continue;
        for (int64_t r0 = 0; r0 < grp->nrows; r0 += LORA_ROWS) {
            const int64_t nb = grp->nrows - r0 < LORA_ROWS ? grp->nrows - r0 : LORA_ROWS;
            lora_block(l, x, k, y, n_out, grp->rows, r0, nb, t, g == last_g && r0 + nb == grp->nrows);
        }
    }
}

/* y [M, n_out] = x [M, k] W^T (+ bias), as Linear.forward on that format */
static void linear(const CStack *s, const CLinear *l, const float *x, int64_t M, float *y) {
    if (l->kind != LIN_INT8)
        s->q4(x, M, l->k, l->w, l->s, l->n, (int)l->group, y, l->n_out, l->n_out, l->kind == LIN_INT4_SYM);
    else
        s->q8(x, M, l->k, l->w, l->s, l->n, y);
    if (l->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < l->n_out; i++)
                y[m * l->n_out + i] += l->bias[i];
}

/* Blocks [0, nblocks) over the embedding output x_in [M, hidden] (only read; the residual starts
 * as it). Each block's MLP output goes to x_out, the next block's input; on return res is the
 * residual (the final norm adds the two). scratch: M * (2 hidden + qkv_width + attn_width + 3 inter)
 * floats. lora: the forward's adapter rows, or NULL. */
void decoder_stack(const CStack *s, const CBlock *blocks, int64_t nblocks, const float *x_in, float *x_out, float *res,
                   int64_t M, float *scratch, const CLoRA *lora) {
    const int64_t hid = s->hidden;
    float *h = scratch, *qkv = h + M * hid, *att = qkv + M * s->qkv_width, *y = att + M * s->attn_width;
    float *gu = y + M * hid, *act = gu + 2 * M * s->inter;
    for (int64_t b = 0; b < nblocks; b++) {
        const CBlock *blk = blocks + b;
        if (b == 0) {
            memcpy(res, x_in, sizeof(float) * (size_t)(M * hid));
            s->norm(x_in, NULL, NULL, blk->in_norm, h, M, hid, s->eps);
        } else {
            s->norm(x_out, res, res, blk->in_norm, h, M, hid, s->eps); /* res += x, h = norm(res) */
        }
        linear(s, &blk->qkv, h, M, qkv);
        if (lora)
            lora_add(lora, b, 0, h, blk->qkv.k, qkv, blk->qkv.n_out);
        s->attend(s->attend_ctx, blk->layer, qkv, blk->qkv.n_out, att);
        linear(s, &blk->o, att, M, y);
        if (lora)
            lora_add(lora, b, 1, att, blk->o.k, y, blk->o.n_out);
        s->norm(y, res, res, blk->post_norm, h, M, hid, s->eps);
        linear(s, &blk->gate_up, h, M, gu);
        if (lora)
            lora_add(lora, b, 2, h, blk->gate_up.k, gu, blk->gate_up.n_out);
        s->silu(gu, M, s->inter, act);
        linear(s, &blk->down, act, M, x_out);
        if (lora)
            lora_add(lora, b, 3, act, blk->down.k, x_out, blk->down.n_out);
    }
}
