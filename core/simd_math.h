/* Small AVX2 helpers shared by the native kernels (core/native.py puts this directory on the
 * include path and hashes this file into every kernel's build key). */
#ifndef LLMKIT_SIMD_MATH_H
#define LLMKIT_SIMD_MATH_H
#include <immintrin.h>
#include <stdint.h>

/* the sum of the 8 lanes, in a fixed order */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp), 0 below -87 */
static inline __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

/* rotate-half rotary embedding of one head row: out[j] = x[j] * c[j] + x[(j + D/2) % D] * s[j], product
 * by product and sum by sum as torch computes `x * cos2 + x.roll(D/2) * sin2` (the kernels build
 * with -ffp-contract=off, so no FMA merges them) */
static inline void rope_row(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    int64_t j = 0;
    if (half % 8 == 0)
        for (; j < D; j += 8) {
            const int64_t r = j < half ? j + half : j - half;
            const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(c + j));
            const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + r), _mm256_loadu_ps(s + j));
            _mm256_storeu_ps(out + j, _mm256_add_ps(a, b));
        }
    for (; j < D; j++) {
        const float a = x[j] * c[j], b = x[j < half ? j + half : j - half] * s[j];
        out[j] = a + b;
    }
}

#endif
