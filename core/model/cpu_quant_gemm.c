/* Weight-only int8 GEMM on the CPU with integer dot products (AVX2/FMA, OpenMP), the way llama.cpp
 * multiplies its Q8 blocks: the activations are quantized to int8 in blocks of 32 (one fp32 scale
 * a block), `vpmaddubsw` multiplies 32 weight bytes by 32 activation bytes at once (|w| against
 * x carrying w's sign, as it wants one unsigned side), and each block's integer sum is scaled into
 * an fp32 accumulator; the weight's per-row scale multiplies the total.
 *
 * y[m, n] is computed by the same instructions in the same order whatever M is and however the
 * rows are tiled or the columns split between threads: a row's result does not depend on its batch. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32 /* activation block */
#define MC 64 /* rows whose int8 activations stay in L2 while the columns go by */
#define PF_BYTES 4096 /* how far ahead of the weight tile being read to prefetch */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &w, 4);
    return f;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row of K activations into int8 blocks: qx and the block scales xd (max |x| / 127). */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *xd) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* int32 x 32 -> int8 x 32 in element order (packs interleave the lanes; the permute undoes it) */
        __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qx + b * QK), p);
        xd[b] = d;
    }
}

/* 8 int32 lanes of a u8 x s8 block product, as float */
static inline __m256 block_dot(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* output columns [n, n + NT) for rows [m0, m0 + MT): MT and NT are constants at every call site,
 * so the accumulators stay in registers (with a runtime count they lived on the stack and each FMA
 * waited on the last one's store). Each (row, column) sees the same operations in the same order
 * whatever MT and NT are. */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *qx, const float *xd, int64_t K, const int8_t *w,
                                                          const uint16_t *scale, int64_t m0, const int MT, const int NT,
                                                          float *y, int64_t ldy) {
    const int64_t nb = K / QK;
    /* The tile's NT weight rows are NT * K contiguous bytes, read at NT * 32 bytes a block: fetch
     * the tile at least PF_BYTES ahead at that pace, a line a block. This VM's hardware prefetcher
     * left a one-row GEMV at 12 GB/s; this triples it (a prefetch past the array's end is harmless). */
    const int8_t *pf = w + ((PF_BYTES + NT * K - 1) / (NT * K)) * NT * K;
    __m256 acc[4][2];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wq[2], wa[2];
        _mm_prefetch((const char *)(pf + b * QK * NT), _MM_HINT_T0);
        for (int c = 0; c < NT; c++) {
            wq[c] = _mm256_loadu_si256((const __m256i *)(w + c * K + b * QK));
            wa[c] = _mm256_sign_epi8(wq[c], wq[c]); /* |w| */
        }
        for (int r = 0; r < MT; r++) {
            const int64_t row = (m0 + r) * nb + b;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + row * QK));
            const __m256 xs = _mm256_broadcast_ss(xd + row);
            for (int c = 0; c < NT; c++)
                acc[r][c] = _mm256_fmadd_ps(block_dot(wa[c], _mm256_sign_epi8(xq, wq[c])), xs, acc[r][c]);
        }
    }
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++)
            y[r * ldy + c] = hsum(acc[r][c]) * bf16_to_f32(scale[c]);
}

/* columns [n, n + nt) (nt 1 or 2) for rows [m0, me), in tiles of 4 rows */
static void q8_columns(const int8_t *qx, const float *xd, int64_t K, const int8_t *w, const uint16_t *scale, int64_t m0,
                       int64_t me, int nt, float *y, int64_t ldy) {
    for (; m0 < me; m0 += 4) {
        const int mt = me - m0 < 4 ? (int)(me - m0) : 4;
        float *yt = y + m0 * ldy;
#define Q8_CASE(MT)                                                                                                    \
    case MT:                                                                                                           \
        if (nt == 2)                                                                                                   \
            q8_tile(qx, xd, K, w, scale, m0, MT, 2, yt, ldy);                                                          \
        else                                                                                                           \
            q8_tile(qx, xd, K, w, scale, m0, MT, 1, yt, ldy);                                                          \
        break;
        switch (mt) {
            Q8_CASE(1)
            Q8_CASE(2)
            Q8_CASE(3)
            Q8_CASE(4)
        }
#undef Q8_CASE
    }
}

#define NCHUNK 16 /* output columns a thread takes at a time (64 bytes of a y row) */

/* y [M, N] = x [M, K] @ W^T for an int8 weight: w [N, K], one bf16 scale per output row */
void q8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *scale, int64_t N, float *y) {
    const int64_t nb = K / QK;
    int8_t *qx = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb));
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, K, qx + m * K, xd + m * nb);
        for (int64_t mc = 0; mc < M; mc += MC) {
            const int64_t me = mc + MC < M ? mc + MC : M;
#pragma omp for schedule(static) nowait
            for (int64_t n0 = 0; n0 < N; n0 += NCHUNK)
                for (int64_t n = n0; n < n0 + NCHUNK && n < N; n += 2)
                    q8_columns(qx, xd, K, w + n * K, scale + n, mc, me, n + 1 < N && n + 1 < n0 + NCHUNK ? 2 : 1,
                               y + n, N);
        }
    }
    free(qx);
    free(xd);
}
