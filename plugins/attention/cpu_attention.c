/* Attention on the CPU, reading the paged KV pool in place (AVX2/FMA, OpenMP).
 *
 * One task per (query row, KV head, chunk of KV_CHUNK key positions): the head's query group scores
 * the chunk's keys, takes the softmax (sink first), and sums the values; a row over several chunks
 * then combines them in chunk order (flash-decoding's split). A task runs on one thread in a fixed
 * order that depends only on its own query, keys and positions, so a row's result is the same bit for bit
 * whatever else is in the batch, however many threads run, and whether it is a prompt row or the
 * decode row at that position; that is what the torch backend's padded GEMMs buy at the price of
 * gathering every key (see torch_backend.py).
 *
 * Pool dtypes: fp32, bf16, fp16, and one-byte formats (fp8) through a 256-entry table; all are
 * widened to fp32 exactly. Values may share the keys' rows (a latent cache: values are the keys'
 * first Dv channels). */
#include <immintrin.h>
#include "simd_math.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_BYTE = 3 };

/* the cache lines of one head's row PF_AHEAD keys ahead: the rows are scattered over pages, so
 * the hardware prefetcher does not see the stream, and a miss per line would bound the loop */
#define PF_AHEAD 8
static inline void prefetch_row(const char *p, int bytes) {
    for (int i = 0; i < bytes; i += 64)
        _mm_prefetch(p + i, _MM_HINT_T0);
}

/* Row pointers of one task's n keys (or values): into the pool for fp32, else into `scratch`, where
 * the rows are widened to fp32 first (once per task, not once per query head). */
static void rows_as_f32(const float **ptrs, float *scratch, const char *buf, const int64_t *slots, int64_t n,
                        int64_t slot_stride, int64_t head_off, int width, int dtype, const float *lut) {
    const int es = dtype == KV_F32 ? 4 : dtype == KV_BYTE ? 1 : 2;
    for (int64_t t = 0; t < n; t++) {
        if (t + PF_AHEAD < n)
            prefetch_row(buf + (slots[t + PF_AHEAD] * slot_stride + head_off) * es, width * es);
        const char *src = buf + (slots[t] * slot_stride + head_off) * es;
        if (dtype == KV_F32) {
            ptrs[t] = (const float *)src;
            continue;
        }
        float *dst = scratch + t * width;
        int i = 0;
        if (dtype == KV_BF16) {
            const uint16_t *h = (const uint16_t *)src;
            for (; i + 8 <= width; i += 8) {
                __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
                _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
            for (; i < width; i++) {
                uint32_t w = (uint32_t)h[i] << 16;
                __builtin_memcpy(dst + i, &w, 4);
            }
        } else if (dtype == KV_F16) {
            const uint16_t *h = (const uint16_t *)src;
            for (; i + 8 <= width; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
            for (; i < width; i++)
                dst[i] = _cvtsh_ss(h[i]);
        } else {
            const uint8_t *u = (const uint8_t *)src;
            for (; i < width; i++)
                dst[i] = lut[u[i]];
        }
        ptrs[t] = dst;
    }
}

/* q . k over D channels: 8-lane FMAs in channel order, one fixed reduction, a scalar tail */
static inline float finish_dot(__m256 a, const float *q, const float *k, int c, int D) {
    float s = hsum(a);
    for (; c < D; c++)
        s += q[c] * k[c];
    return s;
}

/* fp32 -> the pool's dtype, rounded as torch's .to() rounds (nearest even; NaN stays NaN) */
static void store_row(const float *x, void *dst, int n, int dtype) {
    int i = 0;
    if (dtype == KV_F32) {
        __builtin_memcpy(dst, x, sizeof(float) * (size_t)n);
    } else if (dtype == KV_F16) {
        uint16_t *h = dst;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++)
            h[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    } else { /* bf16 */
        uint16_t *h = dst;
        for (; i < n; i++) {
            uint32_t w;
            __builtin_memcpy(&w, x + i, 4);
            h[i] = x[i] != x[i] ? (uint16_t)0x7FC0 : (uint16_t)((w + 0x7FFF + ((w >> 16) & 1)) >> 16);
        }
    }
}

/* Keys a task takes at most, in chunks at positions aligned to KV_CHUNK: a long row's keys are
 * shared out among the threads (one decode row over 3 KV heads is otherwise 3 tasks for 2
 * threads). Chunks depend on positions alone, so a row's numbers still depend on nothing else;
 * a row within one chunk is computed exactly as without chunking. */
#define KV_CHUNK 256
#define PART_TASKS 4096 /* multi-chunk tasks whose partial results are held at once */

static inline int64_t row_start(int64_t len, int window) { return window > 0 && len > window ? len - window : 0; }
static inline int64_t row_chunks(int64_t len, int window) {
    const int64_t start = row_start(len, window);
    return len > start ? (len - 1) / KV_CHUNK - start / KV_CHUNK + 1 : 0;
}

/* One task: query group `hk` of row b over chunk `chunk` of its keys. One chunk: the output, normalised.
 * Several: to `part` [G][Dv + 2] per task, the unnormalised output then the max and the sum. */
static void attend_chunk(const float *qg, const void *kbuf, const void *vbuf, int kv_dtype, const float *lut,
                         int64_t k_slot, int64_t k_head, int64_t v_slot, int64_t v_head, const int64_t *row_slots,
                         int64_t len, int window, int64_t chunk, int64_t nch, int hk, int G, int D, int Dv, float scale,
                         const float *sinks, float *dst, float *part) {
    const int64_t start = row_start(len, window), k0 = (start / KV_CHUNK + chunk) * KV_CHUNK;
    const int64_t p0 = k0 > start ? k0 : start, p1 = k0 + KV_CHUNK < len ? k0 + KV_CHUNK : len, n = p1 - p0;
    const int64_t *slots = row_slots + p0;
    const int64_t n4 = (n + 3) & ~(int64_t)3;
    const float **kp = malloc(sizeof(float *) * (size_t)(2 * n4));
    const float **vp = kp + n4;
    float *scores = malloc(sizeof(float) * (size_t)(G * n + 8));
    float *scratch = kv_dtype == KV_F32 ? NULL : malloc(sizeof(float) * (size_t)(n * (D + Dv)));
    rows_as_f32(kp, scratch, kbuf, slots, n, k_slot, hk * k_head, D, kv_dtype, lut);
    rows_as_f32(vp, scratch ? scratch + n * D : NULL, vbuf, slots, n, v_slot, hk * v_head, Dv, kv_dtype, lut);
    for (int64_t t = n; t < n4; t++) /* a last partial block of 4 repeats key 0; those scores are dropped */
        kp[t] = kp[0];
    /* scores: four keys at a time per query head, each key's dot in the same order wherever it sits */
    for (int j = 0; j < G; j++) {
        const float *qj = qg + (int64_t)j * D;
        float *s = scores + (int64_t)j * n;
        for (int64_t t = 0; t < n; t += 4) {
            const float *k0 = kp[t], *k1 = kp[t + 1], *k2 = kp[t + 2], *k3 = kp[t + 3];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int ch = 0;
            for (; ch + 8 <= D; ch += 8) {
                const __m256 qc = _mm256_loadu_ps(qj + ch);
                a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + ch), a0);
                a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k1 + ch), a1);
                a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k2 + ch), a2);
                a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k3 + ch), a3);
            }
            float d[4] = {finish_dot(a0, qj, k0, ch, D), finish_dot(a1, qj, k1, ch, D), finish_dot(a2, qj, k2, ch, D),
                          finish_dot(a3, qj, k3, ch, D)};
            for (int i = 0; i < 4 && t + i < n; i++)
                s[t + i] = d[i] * scale;
        }
    }
    /* softmax per query head, the sink (if any) in the first chunk's max; probabilities overwrite
     * the scores */
    float denom[G];
    for (int j = 0; j < G; j++) {
        float *s = scores + (int64_t)j * n;
        const float sink = sinks && chunk == 0 ? sinks[hk * G + j] : -INFINITY;
        float mx = sink;
        for (int64_t t = 0; t < n; t++)
            mx = s[t] > mx ? s[t] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
            _mm256_storeu_ps(s + t, p);
            sum8 = _mm256_add_ps(sum8, p);
        }
        if (t < n) { /* the tail through the same exp, padded with -inf (exp -> 0) */
            float pad[8];
            for (int i = 0; i < 8; i++)
                pad[i] = t + i < n ? s[t + i] - mx : -INFINITY;
            __m256 p = exp_ps(_mm256_loadu_ps(pad));
            _mm256_storeu_ps(pad, p);
            for (int i = 0; t + i < n; i++)
                s[t + i] = pad[i];
            sum8 = _mm256_add_ps(sum8, p);
        }
        float total = hsum(sum8);
        if (sinks && nch == 1) { /* (several chunks: the combining step adds it) */
            float e[8] = {sink - mx, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
            _mm256_storeu_ps(e, exp_ps(_mm256_loadu_ps(e)));
            total += e[0];
        }
        denom[j] = nch == 1 ? total : 1.0f;
        if (nch > 1) {
            part[(int64_t)j * (Dv + 2) + Dv] = mx;
            part[(int64_t)j * (Dv + 2) + Dv + 1] = total;
        }
    }
    /* probability-weighted values, key by key in order; 64 channels of accumulators in registers */
    for (int j = 0; j < G; j++) {
        const float *p = scores + (int64_t)j * n;
        float *o_dst = nch == 1 ? dst + (int64_t)j * Dv : part + (int64_t)j * (Dv + 2);
        int c0 = 0;
        for (; c0 + 64 <= Dv; c0 += 64) {
            __m256 o[8];
            for (int i = 0; i < 8; i++)
                o[i] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const __m256 pt = _mm256_set1_ps(p[t]);
                const float *v = vp[t] + c0;
                for (int i = 0; i < 8; i++)
                    o[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), o[i]);
            }
            const __m256 dn = _mm256_set1_ps(denom[j]);
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps(o_dst + c0 + 8 * i, nch == 1 ? _mm256_div_ps(o[i], dn) : o[i]);
        }
        for (; c0 < Dv; c0++) { /* channels past the last whole 64 */
            float o = 0.0f;
            for (int64_t t = 0; t < n; t++)
                o += p[t] * vp[t][c0];
            o_dst[c0] = nch == 1 ? o / denom[j] : o;
        }
    }
    free(scratch);
    free(scores);
    free(kp);
}

/* q [B, H, D] fp32 (B query rows, row b at q + b * q_row) -> out [B, H, Dv] fp32. Key row of (slot,
 * head): kbuf + (slot * k_slot + head * k_head) elements; values likewise. table [*, table_stride]
 * int64 holds each sequence's slots, query row b's sequence at row rows[b]; lens[b] keys are
 * visible (the last `window` of them, if window > 0). sinks [H] or NULL.
 * knew (non-NULL): first write the T new tokens' keys [T, Hkv, D] (rows kn_row apart) and values
 * (vnew, or NULL for a latent cache) to the pool at out_slots, in its dtype (not one-byte ones).
 * cos2 / sin2 (non-NULL, [T, D]): the queries and new keys are not rotated yet; rotate them here
 * (rope_row: the numbers of RotaryEmbedding.rotate) into qrot [B, H, D], and before storing. */
void paged_attention(const float *q, int64_t q_row, const void *kbuf, const void *vbuf, int kv_dtype, const float *lut,
                     int64_t k_slot, int64_t k_head, int64_t v_slot, int64_t v_head, const int64_t *table,
                     int64_t table_stride, const int64_t *rows, const int64_t *lens, int B, int H, int Hkv, int D,
                     int Dv, float scale, int window, const float *sinks, float *out, const float *knew,
                     int64_t kn_row, const float *vnew, int64_t vn_row, const int64_t *out_slots, int64_t T,
                     const float *cos2, const float *sin2, float *qrot) {
    const int G = H / Hkv;
    const int es = kv_dtype == KV_F32 ? 4 : 2;
    /* tasks: (row, KV head, chunk), rows in waves whose multi-chunk tasks' partials fit PART_TASKS
     * (one row may exceed it alone); pbase[b]: row b's first partial within its wave */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(3 * B + 2)), *pbase = first + B + 1, *wave_end = pbase + B;
    int64_t nwaves = 0, in_wave = 0, most = 0;
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        const int64_t nch = row_chunks(lens[b], window), mine = nch > 1 ? nch * Hkv : 0;
        if (b > 0 && mine && in_wave + mine > PART_TASKS) {
            wave_end[nwaves++] = b;
            in_wave = 0;
        }
        pbase[b] = in_wave;
        in_wave += mine;
        most = in_wave > most ? in_wave : most;
        first[b + 1] = first[b] + nch * Hkv;
    }
    wave_end[nwaves++] = B;
    const int64_t part_row = (int64_t)G * (Dv + 2);
    float *part = most ? malloc(sizeof(float) * (size_t)(most * part_row)) : NULL;
#pragma omp parallel
    {
        if (cos2) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < (int64_t)B * H; i++) {
                const int64_t b = i / H, h = i % H;
                rope_row(q + b * q_row + h * D, cos2 + b * D, sin2 + b * D, D, qrot + i * D);
            }
        }
        if (knew) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < T * Hkv; i++) { /* (the loop's end is a barrier: all stored before any read) */
                const int64_t t = i / Hkv, h = i % Hkv;
                const float *k = knew + t * kn_row + h * D;
                float kr[D];
                if (cos2) {
                    rope_row(k, cos2 + t * D, sin2 + t * D, D, kr);
                    k = kr;
                }
                store_row(k, (char *)kbuf + (out_slots[t] * k_slot + h * k_head) * es, D, kv_dtype);
                if (vnew)
                    store_row(vnew + t * vn_row + h * Dv, (char *)vbuf + (out_slots[t] * v_slot + h * v_head) * es, Dv,
                              kv_dtype);
            }
        }
        int64_t b_lo = 0;
        for (int64_t w = 0; w < nwaves; w++) {
            const int64_t b_hi = wave_end[w], t_lo = first[b_lo], t_hi = first[b_hi];
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = t_lo; task < t_hi; task++) {
                int64_t lo = b_lo, hi = b_hi - 1; /* the row b: first[b] <= task < first[b + 1] */
                while (lo < hi) {
                    const int64_t mid = (lo + hi + 1) / 2;
                    if (first[mid] <= task)
                        lo = mid;
                    else
                        hi = mid - 1;
                }
                const int64_t b = lo;
                const int64_t nch = (first[b + 1] - first[b]) / Hkv, k = task - first[b];
                const int hk = (int)(k / nch);
                const int64_t c = k % nch;
                const float *qg = cos2 ? qrot + (b * H + (int64_t)hk * G) * D : q + b * q_row + (int64_t)hk * G * D;
                float *dst = out + (b * H + (int64_t)hk * G) * Dv;
                float *pt = nch > 1 ? part + (pbase[b] + k) * part_row : NULL;
                attend_chunk(qg, kbuf, vbuf, kv_dtype, lut, k_slot, k_head, v_slot, v_head,
                             table + rows[b] * table_stride, lens[b], window, c, nch, hk, G, D, Dv, scale, sinks, dst, pt);
            }
            /* combine the chunks of each multi-chunk row, in chunk order */
#pragma omp for schedule(static)
            for (int64_t i = b_lo * H; i < b_hi * H; i++) {
                const int64_t b = i / H, h = i % H, nch = (first[b + 1] - first[b]) / Hkv;
                if (nch <= 1)
                    continue;
                const int64_t hk = h / G, j = h % G;
                const float *p0 = part + (pbase[b] + hk * nch) * part_row + j * (Dv + 2);
                float mx = -INFINITY;
                for (int64_t c = 0; c < nch; c++)
                    mx = p0[c * part_row + Dv] > mx ? p0[c * part_row + Dv] : mx;
                float f[nch], total = 0.0f;
                for (int64_t c = 0; c < nch; c++) {
                    const float m = p0[c * part_row + Dv];
                    f[c] = m == mx ? 1.0f : expf(m - mx);
                    total += p0[c * part_row + Dv + 1] * f[c];
                }
                if (sinks)
                    total += expf(sinks[h] - mx);
                float *dst = out + i * Dv;
                for (int ch = 0; ch < Dv; ch++) {
                    float o = 0.0f;
                    for (int64_t c = 0; c < nch; c++)
                        o += p0[c * part_row + ch] * f[c];
                    dst[ch] = o / total;
                }
            }
            b_lo = b_hi;
        }
    }
    free(part);
    free(first);
}

/* ---- the per-forward callback of the attention contract's native_attend (core/model/attention.py):
 * one layer's attention straight from its fused projection, for a C caller (cpu_decoder.c). ---- */
typedef struct {
    const void *const *k, *const *v; /* per layer: the pool's K and V buffers */
    int kv_dtype, H, Hkv, D;
    int64_t k_slot, k_head, v_slot, v_head;
    const int64_t *table, *rows, *lens, *out_slots;
    int64_t table_stride, B, T; /* B query rows attend (B <= T); T new tokens are stored */
    const float *cos2, *sin2;   /* [T, D] rotary tables */
    float scale;
    float *qrot; /* [B, H, D] scratch */
} AttendStep;

/* qkv [T, (H + 2 Hkv) D] (rows qkv_row apart; Q and K not rotated yet) -> out [T, H, D]: rotate,
 * store the new K/V at out_slots, attend (rows past B zeroed), as forward_qkv does */
void attend_step(const AttendStep *s, int64_t layer, const float *qkv, int64_t qkv_row, float *out) {
    const int64_t hd = (int64_t)s->H * s->D;
    paged_attention(qkv, qkv_row, s->k[layer], s->v[layer], s->kv_dtype, NULL, s->k_slot, s->k_head, s->v_slot,
                    s->v_head, s->table, s->table_stride, s->rows, s->lens, (int)s->B, s->H, s->Hkv, s->D, s->D,
                    s->scale, 0, NULL, out, qkv + hd, qkv_row, qkv + hd + (int64_t)s->Hkv * s->D, qkv_row,
                    s->out_slots, s->T, s->cos2, s->sin2, s->qrot);
    for (int64_t i = s->B * hd; i < s->T * hd; i++)
        out[i] = 0.0f;
}
