/* The decode step of a Gated DeltaNet layer on the CPU: the short convolution with its state and
 * the gated delta rule's recurrent form, each state read from its slot and the new state written to
 * another (the pool's two working slots a request), in one pass per (sequence, value head).
 *
 * Plain loops over the value dimension (contiguous), vectorised by the compiler for the
 * instruction set this file is built for (gated_delta_cpu.py builds it for AVX2 and, where the CPU
 * has it, AVX-512, and loads the widest); OpenMP over the (sequence, head) pairs.
 *
 * The torch reference is core/model/hybrid/gated_delta_rule.py::recurrent (and causal_conv.py's
 * conv_step); the tests compare the two. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

/* silu over n floats in place: a * sigmoid(a) with sigmoid from exp(-|a|) (simd_math.h's exp_ps
 * takes x <= 0) */
static void silu_inplace(float *o, int64_t n) {
    int64_t c = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; c + 8 <= n; c += 8) {
        __m256 a = _mm256_loadu_ps(o + c);
        __m256 e = exp_ps(_mm256_or_ps(a, sign)); /* exp(-|a|) */
        __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        __m256 neg = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
        __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
        _mm256_storeu_ps(o + c, _mm256_mul_ps(a, sig));
    }
    for (; c < n; c++) o[c] = o[c] / (1.0f + expf(-o[c]));
}

/* out[b, c] = silu(sum_t w[c, t] * window[t]) over window = (state[c, 0..K-2], x[b, c]); the new
 * state is the window's last K-1 entries. States in fp32 slots [slots, C, K-1]. */
void conv_step(const float *x, int64_t x_row, const float *w, const float *state, float *state_out,
               const int64_t *read, const int64_t *write, const uint8_t *fresh, float *out, int64_t B,
               int64_t C, int64_t K) {
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t blk = 0; blk < (C + 255) / 256; blk++) {
            const float *xs = x + b * x_row;
            const float *st = state + read[b] * C * (K - 1);
            float *so = state_out + write[b] * C * (K - 1);
            float *o = out + b * C;
            const int64_t c0 = blk * 256, c1 = c0 + 256 < C ? c0 + 256 : C;
            for (int64_t c = c0; c < c1; c++) {
                float win[8];
                for (int64_t t = 0; t < K - 1; t++) win[t] = fresh[b] ? 0.0f : st[c * (K - 1) + t];
                win[K - 1] = xs[c];
                float acc = 0.0f;
                for (int64_t t = 0; t < K; t++) acc += w[c * K + t] * win[t];
                o[c] = acc;
                for (int64_t t = 0; t < K - 1; t++) so[c * (K - 1) + t] = win[t + 1];
            }
            silu_inplace(o + c0, c1 - c0);
        }
    }
}

static void l2normalize(const float *x, float *y, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * inv;
}

/* One token of each of B sequences. q, k: rows of ``qk_row`` floats holding Hk heads of Dk (keys
 * ``k_off`` floats after the queries); v: Hv heads of Dv at ``v_off``; g, beta: [B, Hv]; states
 * [slots, Hv, Dk, Dv] fp32. Value head h reads key head h / (Hv / Hk). out: [B, Hv, Dv]. */
void gated_delta_step(const float *qkv, int64_t qk_row, int64_t k_off, int64_t v_off, const float *g,
                      const float *beta, const float *state, float *state_out, const int64_t *read,
                      const int64_t *write, const uint8_t *fresh, float *out, int64_t B, int64_t Hk,
                      int64_t Hv, int64_t Dk, int64_t Dv) {
    const int64_t per_k = Hv / Hk;
    const float qscale = 1.0f / sqrtf((float)Dk);
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hv; h++) {
            const float *row = qkv + b * qk_row;
            const int64_t kh = h / per_k;
            float q[512], k[512], pred[512], u[512], o[512];
            l2normalize(row + kh * Dk, q, Dk, qscale);
            l2normalize(row + k_off + kh * Dk, k, Dk, 1.0f);
            const float *v = row + v_off + h * Dv;
            const float decay = expf(g[b * Hv + h]), bt = beta[b * Hv + h];
            const float *S = state + (read[b] * Hv + h) * Dk * Dv;
            float *So = state_out + (write[b] * Hv + h) * Dk * Dv;
            const int zero = fresh[b];
            for (int64_t j = 0; j < Dv; j++) pred[j] = 0.0f;
            if (!zero) {
                for (int64_t i = 0; i < Dk; i++) {
                    const float ki = k[i] * decay;
                    const float *Si = S + i * Dv;
#pragma omp simd
                    for (int64_t j = 0; j < Dv; j++) pred[j] += Si[j] * ki;
                }
            }
#pragma omp simd
            for (int64_t j = 0; j < Dv; j++) {
                u[j] = (v[j] - pred[j]) * bt;
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < Dk; i++) {
                const float *Si = S + i * Dv;
                float *Soi = So + i * Dv;
                const float ki = k[i], qi = q[i];
                if (zero) {
#pragma omp simd
                    for (int64_t j = 0; j < Dv; j++) {
                        const float s = ki * u[j];
                        Soi[j] = s;
                        o[j] += s * qi;
                    }
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < Dv; j++) {
                        const float s = Si[j] * decay + ki * u[j];
                        Soi[j] = s;
                        o[j] += s * qi;
                    }
                }
            }
            memcpy(out + (b * Hv + h) * Dv, o, Dv * sizeof(float));
        }
    }
}
