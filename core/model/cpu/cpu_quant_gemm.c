/* Weight-only int8 and int4 GEMMs on the CPU with integer dot products (AVX2/FMA, OpenMP), the way
 * llama.cpp multiplies its quantized blocks: the activations are quantized to int8 in blocks of 32
 * (one fp32 scale a block), unsigned weight bytes times signed activation bytes are summed exactly
 * in int32 lanes, and each block's integer sum is scaled into an fp32 accumulator.
 *
 * The byte dot product is `vpmaddubsw` + `vpmaddwd` (AVX2), or one `vpdpbusd` where this file is
 * built with AVX512-VNNI (`__AVX512VNNI__`; still 256-bit vectors). No pair sum can saturate the
 * int16 of `vpmaddubsw` (|w| <= 127 or w <= 15, |x| <= 127), so both give the same integers and
 * every float operation is the same: the two builds agree bit for bit.
 *
 * y[m, n] is computed by the same instructions in the same order whatever M is and however the
 * rows are tiled or the columns split between threads: a row's result does not depend on its batch. */
#include <immintrin.h>
#include "simd_math.h"
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

/* u8 x s8 byte products, summed in fours into the int32 lanes of acc */
static inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVX512VNNI__
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* One row of K activations into int8 blocks: qx and the block scales xd (max |x| / 127); with xs,
 * also each block's scale times the sum of its int8 values (the int4 weights' zero term). */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *xd, float *xs) {
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
        if (xs) {
            const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
            xs[b] = d * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* 8 int32 lanes of a u8 x s8 block product, as float */
static inline __m256 block_dot(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(dot_add(_mm256_setzero_si256(), u, s));
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
            quantize_row(x + m * K, K, qx + m * K, xd + m * nb, NULL);
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

/* ---- int4: llama.cpp's Q4 x Q8 scheme on groups of `group` (32-256) input columns ----
 * A weight is (q - 8) * scale + zero with q in 0..15 and a bf16 (scale, zero) per group, so a
 * block of 32 inputs contributes  d * (scale * sum(q * xq) + (zero - 8 * scale) * sum(xq)).
 * Layout (q4_pack in cpu_quant.py): output columns in tiles of 32, four vectors of 8; a tile is
 * [K / 32 blocks][4 vectors][4 octets][8 columns][4] bytes, byte i of column j of vector v in
 * octet o of block b holding q[32t + 8v + j][32b + 8o + i] (low nibble) and ...[32b + 8o + 4 + i]
 * (high), so one 32-byte load feeds `vpdpbusd` twice (8 columns x 4 inputs each) and a tile is one
 * front-to-back stream; its (scale, zero) pairs are [K / group][4 vectors][8] x 2 bf16 (or, for a
 * symmetric weight, the fp16 scales alone: [K / group][4 vectors][8]). */

/* rows [m0, m0 + MT) x column vectors [0, NT) of tile `w`; MT, NT and SPLIT are constants at
 * every call. SPLIT: the high nibbles' dots go to a second integer chain (at one row there are
 * too few chains otherwise to hide the dot's latency); integer sums are exact, so every shape gives
 * the same numbers. */
static inline __attribute__((always_inline)) void q4_tile(const int8_t *qx, const float *xd, const float *xs,
                                                          int64_t K, const uint8_t *w, const uint8_t *sz,
                                                          int group, int64_t m0, const int MT, const int NT,
                                                          const int SPLIT, const int SYM, float *y, int64_t ldy,
                                                          int64_t ncols) {
    const int64_t nb = K / QK;
    const uint8_t *pf = w + PF_BYTES; /* the tile is one stream (tiles follow each other): fetch ahead of the reads */
    const __m256i nib = _mm256_set1_epi8(0x0F), hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[4][4], scale[4], zero[4];
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < 8; i++) /* the tile's pace, 512 bytes a block, whichever vectors run here */
            _mm_prefetch((const char *)(pf + b * 512 + i * 64), _MM_HINT_T0);
        if ((b * QK) % group == 0)
            for (int c = 0; c < NT; c++) {
                const int64_t at = ((b * QK / group) * 4 + c) * 8; /* the vector's 8 columns of this group */
                if (SYM) { /* fp16 scales, no zero: (q - 8) * scale */
                    scale[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sz + at * 2)));
                    zero[c] = _mm256_mul_ps(scale[c], _mm256_set1_ps(-8.0f));
                } else {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(sz + at * 4));
                    scale[c] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
                    zero[c] = _mm256_fmadd_ps(scale[c], _mm256_set1_ps(-8.0f), _mm256_castsi256_ps(_mm256_and_si256(p, hi16)));
                }
            }
        __m256i lo[4][4], hi[4][4]; /* [row][column vector] */
        for (int r = 0; r < MT; r++)
            for (int c = 0; c < NT; c++)
                lo[r][c] = hi[r][c] = _mm256_setzero_si256();
        for (int o = 0; o < 4; o++) {
            __m256i wl[4], wh[4];
            for (int c = 0; c < NT; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + ((b * 4 + c) * 4 + o) * 32));
                wl[c] = _mm256_and_si256(v, nib);
                wh[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            }
            for (int r = 0; r < MT; r++) {
                const int32_t *xr = (const int32_t *)(qx + (m0 + r) * K + b * QK + o * 8);
                const __m256i xl = _mm256_set1_epi32(xr[0]), xh = _mm256_set1_epi32(xr[1]);
                for (int c = 0; c < NT; c++) {
#ifdef __AVX512VNNI__
                    lo[r][c] = dot_add(lo[r][c], wl[c], xl);
                    if (SPLIT)
                        hi[r][c] = dot_add(hi[r][c], wh[c], xh);
                    else
                        lo[r][c] = dot_add(lo[r][c], wh[c], xh);
#else
                    /* int16 sums across the block, widened once below: a nibble pair times int8s
                     * sums to at most 2 * 15 * 127 = 3810, so a block's 8 of them (4 octets, 2
                     * halves) stay under 2^15 and the integers are the same as widening each
                     * (a third fewer instructions in the loop that bounds a few-row step) */
                    lo[r][c] = _mm256_add_epi16(lo[r][c], _mm256_maddubs_epi16(wl[c], xl));
                    if (SPLIT)
                        hi[r][c] = _mm256_add_epi16(hi[r][c], _mm256_maddubs_epi16(wh[c], xh));
                    else
                        lo[r][c] = _mm256_add_epi16(lo[r][c], _mm256_maddubs_epi16(wh[c], xh));
#endif
                }
            }
        }
#ifndef __AVX512VNNI__
        for (int r = 0; r < MT; r++)
            for (int c = 0; c < NT; c++) {
                lo[r][c] = _mm256_madd_epi16(lo[r][c], _mm256_set1_epi16(1));
                if (SPLIT)
                    hi[r][c] = _mm256_madd_epi16(hi[r][c], _mm256_set1_epi16(1));
            }
#endif
        for (int r = 0; r < MT; r++) {
            const int64_t row = (m0 + r) * nb + b;
            const __m256 d = _mm256_broadcast_ss(xd + row), ds = _mm256_broadcast_ss(xs + row);
            for (int c = 0; c < NT; c++) {
                const __m256 f = _mm256_cvtepi32_ps(SPLIT ? _mm256_add_epi32(lo[r][c], hi[r][c]) : lo[r][c]);
                acc[r][c] = _mm256_fmadd_ps(f, _mm256_mul_ps(scale[c], d), acc[r][c]);
                acc[r][c] = _mm256_fmadd_ps(zero[c], ds, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < MT; r++)
        for (int c = 0; c < NT; c++) {
            const int64_t left = ncols - 8 * c;
            float *yr = y + (m0 + r) * ldy + 8 * c;
            if (left >= 8)
                _mm256_storeu_ps(yr, acc[r][c]);
            else if (left > 0)
                _mm256_maskstore_ps(yr, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                    acc[r][c]);
        }
}

#define Q4_FEW_ROWS 8 /* up to this many rows a call reads each tile once, 2 rows at a time */
#define Q4_TILE_COLS 32 /* output columns a task tile covers: 4 vectors at one row, 2 x 2 at more */

static inline __attribute__((always_inline)) void q4_run(const float *x, int64_t M, int64_t K, const uint8_t *w,
                                                         const uint8_t *sz, int64_t N, int group, float *y,
                                                         int64_t n_out, int64_t ldy, const int SYM) {
    const int64_t nb = K / QK, ntiles = N / Q4_TILE_COLS, nchunks = (M + MC - 1) / MC;
    int8_t *qx = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb)), *xs = malloc(sizeof(float) * (size_t)(M * nb));
    const int64_t tile_w = K * 16, tile_s = (K / group) * 32 * (SYM ? 2 : 4); /* bytes per 32-column tile */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, K, qx + m * K, xd + m * nb, xs + m * nb);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nchunks * ntiles; t++) {
            const int64_t n0 = (t % ntiles) * Q4_TILE_COLS, mc = (t / ntiles) * MC;
            const int64_t me = mc + MC < M ? mc + MC : M;
            if (n0 >= n_out)
                continue;
            const uint8_t *wt = w + (n0 / Q4_TILE_COLS) * tile_w;
            const uint8_t *st = sz + (n0 / Q4_TILE_COLS) * tile_s;
            if (M == 1) { /* one row: the whole tile, two chains a vector */
                q4_tile(qx, xd, xs, K, wt, st, group, 0, 1, 4, 1, SYM, y + n0, ldy, n_out - n0);
            } else if (M <= Q4_FEW_ROWS) { /* the whole tile, 2 rows at a time: the tile read once */
                for (int64_t m0 = mc; m0 < me; m0 += 2) {
                    if (me - m0 >= 2)
                        q4_tile(qx, xd, xs, K, wt, st, group, m0, 2, 4, 0, SYM, y + n0, ldy, n_out - n0);
                    else
                        q4_tile(qx, xd, xs, K, wt, st, group, m0, 1, 4, 0, SYM, y + n0, ldy, n_out - n0);
                }
            } else { /* compute bound: 16-column halves, 4 rows at a time (half the unpacking a dot) */
                for (int64_t half = 0; half < 2; half++) {
                    const int64_t n = n0 + 16 * half;
                    if (n >= n_out)
                        break;
                    const uint8_t *wh = wt + 2 * half * 128;
                    const uint8_t *sh = st + 2 * half * 8 * (SYM ? 2 : 4);
                    for (int64_t m0 = mc; m0 < me; m0 += 4) {
                        const int64_t left = n_out - n;
                        switch (me - m0 < 4 ? me - m0 : 4) {
                        case 1: q4_tile(qx, xd, xs, K, wh, sh, group, m0, 1, 2, 0, SYM, y + n, ldy, left); break;
                        case 2: q4_tile(qx, xd, xs, K, wh, sh, group, m0, 2, 2, 0, SYM, y + n, ldy, left); break;
                        case 3: q4_tile(qx, xd, xs, K, wh, sh, group, m0, 3, 2, 0, SYM, y + n, ldy, left); break;
                        default: q4_tile(qx, xd, xs, K, wh, sh, group, m0, 4, 2, 0, SYM, y + n, ldy, left); break;
                        }
                    }
                }
            }
        }
    }
    free(qx);
    free(xd);
    free(xs);
}

/* y [M, n_out] (row stride ldy) = x [M, K] @ W^T for an int4 weight of N (a multiple of 32) rows
 * in the layout above, n_out <= N of them kept. sym: the scales are fp16 alone, [K / group][4][8]
 * a tile (symmetric types, GGUF's Q4_0: its fp16 scale kept exactly, 10 % fewer bytes a weight) */
void q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *sz, int64_t N, int group,
               float *y, int64_t n_out, int64_t ldy, int sym) {
    if (sym)
        q4_run(x, M, K, w, sz, N, group, y, n_out, ldy, 1);
    else
        q4_run(x, M, K, w, sz, N, group, y, n_out, ldy, 0);
}
