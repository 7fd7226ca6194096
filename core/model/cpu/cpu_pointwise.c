/* Pointwise ops of a decoder layer on the CPU (AVX2, OpenMP for many rows): one call each where
 * torch takes 3-6 dispatches (~3 us apiece at one row here).
 * - rope_rotate: x * cos2 + roll(x, D/2) * sin2 as RotaryEmbedding.rotate spells it, product by
 *   product and sum by sum (no FMA: -ffp-contract=off), so bit for bit torch's result;
 * - silu_mul: silu(gate) * up, with simd_math.h's exp (torch's differs in the last bit or so). */
#include <immintrin.h>
#include "simd_math.h"
#include <math.h>
#include <stdint.h>

#define PAR_MIN 64 /* rows (x heads) from which the threads share the work */

/* out [T, H, D] (contiguous) from x (row stride sx, head stride sh) and per-token tables [T, D] */
void rope_rotate(const float *x, int64_t sx, int64_t sh, const float *cos2, const float *sin2, int64_t T, int64_t H,
                 int64_t D, float *out) {
#pragma omp parallel for schedule(static) if (T * H >= PAR_MIN)
    for (int64_t i = 0; i < T * H; i++) {
        const int64_t t = i / H, h = i % H;
        rope_row(x + t * sx + h * sh, cos2 + t * D, sin2 + t * D, D, out + i * D);
    }
}

/* out [T, I] = silu(gu[:, :I]) * gu[:, I:], gu rows 2I apart */
void silu_mul(const float *gu, int64_t T, int64_t I, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (T >= PAR_MIN / 8)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            /* sigmoid from exp(-|g|) <= 1 (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below */
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_ps(_mm256_or_ps(x, sign));
            const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
            const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
