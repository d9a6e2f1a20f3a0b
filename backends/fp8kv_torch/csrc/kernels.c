/* fp8kv's torch backend, native part: fused CPU loops where a chain of PyTorch operations costs
 * more in per-operation overhead than in arithmetic (one decode token per sequence and layer).
 *
 * Built at first use by fp8kv_torch/native.py with the system C compiler (-O3, no FMA
 * contraction, no fast-math: every float32 operation is the IEEE one written here) and called
 * through ctypes with raw pointers and strides in elements. Every index is checked here: block
 * ids outside [0, num_blocks) are absent keys (skipped), lengths are clamped to the block
 * table's width, slots outside the cache are never written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_D 512 /* head sizes up to this (the Python side checks) */
#define MAX_G 64  /* query heads per KV head */
#define CHUNK 64  /* keys per softmax update */

static inline float scale_at(const float *s, int kind, int64_t blk, int64_t off, int64_t h, int64_t sb, int64_t st,
                             int64_t sh) {
    /* kind 0: one scale (tensor), 1: per head, 2: per token and head */
    if (kind == 0) return s[0];
    if (kind == 1) return s[h * sh];
    return s[blk * sb + off * st + h * sh];
}

static inline float dot8(const float *a, const float *b, int64_t D) {
    /* eight partial sums in a fixed order (vectorizable without reassociating: no fast-math) */
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int i = 0; i < 8; i++) part[i] += a[d + i] * b[d + i];
    for (; d < D; d++) part[d % 8] += a[d] * b[d];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* Decode attention: one query per sequence (query b is sequence b's last position).
 *
 * q:   [B, H * g, D] float32, strides (q_sb, q_sh), D contiguous.
 * kc/vc: uint8 codes, NHD [num_blocks, block_size, H, D], strides (c_sb, c_st, c_sh) each, D contiguous.
 * ks/vs: float32 scales (kind 0/1/2 as in scale_at), strides (s_sb, s_st, s_sh).
 * table: [256] float32 value of each code (unscaled).
 * bt: [B, max_blocks] int32 block tables, row stride bt_sb; seq_lens: [B] int32.
 * window > 0: only the last `window` positions are visible (sliding window); <= 0: all.
 * out: [B, H * g, D] float32 contiguous; lse (or NULL): [B, H * g] float32, natural log, -inf
 * for a row that sees no key (its output is 0).
 *
 * Returns 0, or -1 if D or g exceed the limits above (nothing written).
 */
int fp8kv_decode(const float *q, int64_t q_sb, int64_t q_sh, const uint8_t *kc, const uint8_t *vc, int64_t kc_sb,
                 int64_t kc_st, int64_t kc_sh, int64_t vc_sb, int64_t vc_st, int64_t vc_sh, const float *ks,
                 const float *vs, int scale_kind, int64_t s_sb, int64_t s_st, int64_t s_sh, const float *table,
                 const int32_t *bt, int64_t bt_sb, const int32_t *seq_lens, int64_t B, int64_t H, int64_t g,
                 int64_t D, int64_t block_size, int64_t num_blocks, int64_t max_blocks, float sm_scale,
                 int64_t window, float *out, float *lse) {
    if (D > MAX_D || g > MAX_G || D <= 0 || g <= 0) return -1;
#pragma omp parallel for schedule(static) if (B * H >= 8)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        /* keys go in chunks: their logits first (K rows read once), then one running-max update
         * per chunk and query row, then the V rows (read once) weighted for every query row */
        float kf[MAX_D], vf[MAX_D], acc[MAX_G][MAX_D], m[MAX_G], s[MAX_G], lg[MAX_G][CHUNK], vscale[CHUNK];
        int64_t vrow[CHUNK];
        for (int64_t j = 0; j < g; j++) {
            m[j] = -INFINITY;
            s[j] = 0.0f;
            memset(acc[j], 0, sizeof(float) * D);
        }
        int64_t L = seq_lens[b];
        if (L > max_blocks * block_size) L = max_blocks * block_size;
        int64_t start = 0;
        if (window > 0 && L - window > 0) start = L - window;
        const float *qh = q + b * q_sb + h * g * q_sh;
        for (int64_t c = start; c < L; c += CHUNK) {
            const int64_t end = c + CHUNK < L ? c + CHUNK : L;
            int64_t n = 0; /* present keys of the chunk */
            for (int64_t l = c; l < end; l++) {
                const int64_t blk = bt[b * bt_sb + l / block_size], off = l % block_size;
                if (blk < 0 || blk >= num_blocks) continue; /* an absent block: its keys are not there */
                const uint8_t *kp = kc + blk * kc_sb + off * kc_st + h * kc_sh;
                const float kscale = scale_at(ks, scale_kind, blk, off, h, s_sb, s_st, s_sh) * sm_scale;
                for (int64_t d = 0; d < D; d++) kf[d] = table[kp[d]];
                for (int64_t j = 0; j < g; j++) lg[j][n] = dot8(qh + j * q_sh, kf, D) * kscale;
                vrow[n] = blk * vc_sb + off * vc_st + h * vc_sh;
                vscale[n] = scale_at(vs, scale_kind, blk, off, h, s_sb, s_st, s_sh);
                n++;
            }
            if (n == 0) continue;
            for (int64_t j = 0; j < g; j++) {
                float cm = m[j];
                for (int64_t i = 0; i < n; i++)
                    if (lg[j][i] > cm) cm = lg[j][i];
                if (cm > m[j]) { /* a new maximum: rescale what was summed so far */
                    const float r = expf(m[j] - cm);
                    s[j] *= r;
                    for (int64_t d = 0; d < D; d++) acc[j][d] *= r;
                    m[j] = cm;
                }
                for (int64_t i = 0; i < n; i++) { /* NaN logits stay NaN (the caller falls back) */
                    lg[j][i] = expf(lg[j][i] - m[j]);
                    s[j] += lg[j][i];
                }
            }
            for (int64_t i = 0; i < n; i++) {
                const uint8_t *vp = vc + vrow[i];
                for (int64_t d = 0; d < D; d++) vf[d] = table[vp[d]] * vscale[i];
                for (int64_t j = 0; j < g; j++) {
                    const float p = lg[j][i];
                    for (int64_t d = 0; d < D; d++) acc[j][d] += p * vf[d];
                }
            }
        }
        for (int64_t j = 0; j < g; j++) {
            float *o = out + (b * H * g + h * g + j) * D;
            const int seen = s[j] > 0.0f || s[j] != s[j];
            for (int64_t d = 0; d < D; d++) o[d] = seen ? acc[j][d] / s[j] : 0.0f;
            if (lse) lse[b * H * g + h * g + j] = seen ? m[j] + logf(s[j]) : -INFINITY;
        }
    }
    return 0;
}

/* The write's arithmetic before the FP8 cast, for K and V of n tokens: per-token-head scales
 * (token_kind 1) or static ones, then x / scale (IEEE division; NaN elements kept as they are),
 * clamped to [-fmt_max, fmt_max] (NaN passes), as fp8kv.scales.token_head_scale and
 * fp8kv.formats.divide_by_scale / quantize_scaled do.
 *
 * k/v: [n, H, D] float32 contiguous. y: [2, n, H, D] float32 out (K then V).
 * token_kind 1: scales out [2, n, H] (K then V): max(amax|x| / fmt_max, 2^-126), NaN counted as 0
 *   and infinities as the float32 max. token_kind 0: static scales in, ks/vs each [1] (tensor) or
 *   [H] (head, scale_stride 1; tensor: 0).
 */
void fp8kv_prepare_write(const float *k, const float *v, int64_t n, int64_t H, int64_t D, int token_kind,
                         const float *ks, const float *vs, int64_t scale_stride, float fmt_max, float *scales,
                         float *y) {
    const float fmax32 = 3.4028234663852886e38f, min_scale = 1.1754943508222875e-38f; /* 2^-126 */
    for (int64_t which = 0; which < 2; which++) {
        const float *x = which ? v : k;
        for (int64_t t = 0; t < n * H; t++) {
            const float *xr = x + t * D;
            float *yr = y + (which * n * H + t) * D;
            float sc;
            if (token_kind) {
                float amax = 0.0f;
                for (int64_t d = 0; d < D; d++) {
                    float a = fabsf(xr[d]);
                    if (a != a) a = 0.0f;
                    else if (a > fmax32) a = fmax32;
                    if (a > amax) amax = a;
                }
                sc = amax / fmt_max;
                if (sc < min_scale) sc = min_scale;
                scales[which * n * H + t] = sc;
            } else {
                sc = (which ? vs : ks)[(t % H) * scale_stride];
            }
            for (int64_t d = 0; d < D; d++) {
                const float xv = xr[d];
                if (xv != xv) {
                    yr[d] = xv;
                    continue;
                }
                float r = xv / sc;
                if (r > fmt_max) r = fmt_max;
                else if (r < -fmt_max) r = -fmt_max;
                yr[d] = r;
            }
        }
    }
}
