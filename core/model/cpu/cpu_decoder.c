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
 * its own output rows [dst, dst + len). A and B come transposed (at [k, r_total], bt [r_total,
 * n_out], B scaled), so both loops are row updates the compiler vectorizes, and each row's delta
 * is summed in one fixed order whatever its batch. */
typedef struct {
    const float *at, *bt; /* at NULL: the adapter leaves this layer alone */
    int64_t r_total, rank, nparts;
    int64_t dst[3], len[3];
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

enum { LORA_ROWS = 8 }; /* rows whose deltas share one pass over A and B */

/* One group's rows [r0, r0 + nb) of one layer, A and B read once for the block. One thread: at
 * these sizes (a rank-16 adapter of a 135M model: ~5 M multiply-adds a row and step) waking the
 * OpenMP team for each layer cost more than it saved (measured with bench_lora.py). */
static void lora_block(const CLoRALin *l, const float *x, int64_t k, float *y, int64_t n_out, const int64_t *rows,
                       int64_t r0, int64_t nb) {
    const int64_t rt = l->r_total;
    float t[LORA_ROWS * rt];
    memset(t, 0, sizeof(float) * (size_t)(nb * rt));
    for (int64_t kk = 0; kk < k; kk++) {
        const float *a = l->at + kk * rt;
        for (int64_t i = 0; i < nb; i++) {
            const float xv = x[(rows ? rows[r0 + i] : r0 + i) * k + kk];
            float *ti = t + i * rt;
            for (int64_t j = 0; j < rt; j++)
                ti[j] += xv * a[j];
        }
    }
    for (int64_t p = 0; p < l->nparts; p++) {
        const int64_t len = l->len[p], dst = l->dst[p];
        for (int64_t j = p * l->rank; j < (p + 1) * l->rank; j++) {
            const float *b = l->bt + j * n_out + dst;
            for (int64_t i = 0; i < nb; i++) {
                const float tj = t[i * rt + j];
                float *yi = y + (rows ? rows[r0 + i] : r0 + i) * n_out + dst;
                for (int64_t c = 0; c < len; c++)
                    yi[c] += tj * b[c];
            }
        }
    }
}

/* Linear `lin` (0 qkv, 1 o, 2 gate_up, 3 down) of block `blk`: each group's rows get their delta;
 * rows of no group (base rows) are left as the base layer wrote them. */
static void lora_add(const CLoRA *lora, int64_t blk, int lin, const float *x, int64_t k, float *y, int64_t n_out) {
    for (int64_t g = 0; g < lora->ngroups; g++) {
        const CLoRAGroup *grp = lora->groups + g;
        const CLoRALin *l = grp->lins + blk * 4 + lin;
        if (!l->at)
            continue;
        for (int64_t r0 = 0; r0 < grp->nrows; r0 += LORA_ROWS) {
            const int64_t nb = grp->nrows - r0 < LORA_ROWS ? grp->nrows - r0 : LORA_ROWS;
            lora_block(l, x, k, y, n_out, grp->rows, r0, nb);
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
