/* The decode step of a Mamba2 layer on the CPU: the causal convolution (with bias, then SiLU) with
 * its state, and the selective scan's recurrent form, each state read from its slot and the new
 * state written to another (the pool's two working slots a request), in one pass over each
 * (sequence, head)'s [head_dim, state_size] matrix: decay, rank-one update, output, written once.
 *
 * Plain loops over the state dimension (contiguous), vectorised by the compiler for the
 * instruction set this file is built for (mamba2_cpu.py builds it for AVX2 and, where the CPU has
 * it, AVX-512, and loads the widest); OpenMP over the (sequence, head) pairs.
 *
 * The torch reference is core/model/hybrid/ssd.py::recurrent (and causal_conv.py's conv_step);
 * the tests compare the two. */
#include <math.h>
#include <stdint.h>

/* out[b, c] = silu(bias[c] + sum_t w[c, t] * window[t]) over window = (state[c, 0..K-2], x[b, c]);
 * the new state is the window's last K-1 entries. States in fp32 slots [slots, C, K-1]. */
void conv_step(const float *x, const float *w, const float *bias, const float *state, float *state_out,
               const int64_t *read, const int64_t *write, const uint8_t *fresh, float *out, int64_t B,
               int64_t C, int64_t K) {
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t blk = 0; blk < (C + 255) / 256; blk++) {
            const float *xs = x + b * C;
            const float *st = state + read[b] * C * (K - 1);
            float *so = state_out + write[b] * C * (K - 1);
            const int64_t c0 = blk * 256, c1 = c0 + 256 < C ? c0 + 256 : C;
            for (int64_t c = c0; c < c1; c++) {
                float win[8];
                for (int64_t t = 0; t < K - 1; t++) win[t] = fresh[b] ? 0.0f : st[c * (K - 1) + t];
                win[K - 1] = xs[c];
                float acc = bias[c];
                for (int64_t t = 0; t < K; t++) acc += w[c * K + t] * win[t];
                out[b * C + c] = acc / (1.0f + expf(-acc));
                for (int64_t t = 0; t < K - 1; t++) so[c * (K - 1) + t] = win[t + 1];
            }
        }
    }
}

/* One token of each of B sequences. xbc: rows of ``row`` floats, x (H heads of P) first, then B at
 * ``b_off`` and C at ``c_off`` (G groups of N each; head h reads group h / (H / G)); dt: [B, H]
 * (after softplus and clamp); A, D: [H]; states [slots, H, P, N] fp32. out: [B, H, P]. */
void ssd_step(const float *xbc, int64_t row, int64_t b_off, int64_t c_off, const float *dt, const float *A,
              const float *D, const float *state, float *state_out, const int64_t *read, const int64_t *write,
              const uint8_t *fresh, float *out, int64_t B, int64_t H, int64_t P, int64_t N, int64_t G) {
    const int64_t per = H / G;
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const float *r = xbc + b * row;
            const float *x = r + h * P, *bv = r + b_off + (h / per) * N, *cv = r + c_off + (h / per) * N;
            const float d = dt[b * H + h], decay = expf(d * A[h]), skip = D[h];
            const float *S = state + (read[b] * H + h) * P * N;
            float *So = state_out + (write[b] * H + h) * P * N;
            float *o = out + (b * H + h) * P;
            for (int64_t p = 0; p < P; p++) {
                const float xd = x[p] * d;
                const float *Sp = S + p * N;
                float *Sop = So + p * N;
                float acc = 0.0f;
                if (fresh[b]) {
#pragma omp simd reduction(+ : acc)
                    for (int64_t n = 0; n < N; n++) {
                        const float s = xd * bv[n];
                        Sop[n] = s;
                        acc += s * cv[n];
                    }
                } else {
#pragma omp simd reduction(+ : acc)
                    for (int64_t n = 0; n < N; n++) {
                        const float s = Sp[n] * decay + xd * bv[n];
                        Sop[n] = s;
                        acc += s * cv[n];
                    }
                }
                o[p] = acc + skip * x[p];
            }
        }
    }
}
