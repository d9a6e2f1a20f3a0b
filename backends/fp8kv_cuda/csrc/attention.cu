// fp8kv_cuda: paged attention over the FP8 cache, one query token per CTA row group, split-KV.
//
// Grid (T * H * head_chunks, 1, num_splits) (decode_cta), NT = 128 threads. A CTA owns one query token t, one KV
// head h and up to GPAD of the query heads sharing it (GQA packing: every K/V byte it loads
// serves all of them), and the keys of split z: [z * keys_per_split, (z + 1) * keys_per_split).
// Decode is one token per sequence; a chunked-prefill step runs the same kernel per query
// token (token t finds its sequence by a binary search of query_start_loc; no tensor cores).
//
// Per tile of BLOCK_N keys:
//   A. key metadata (block id through the block table, masked if outside [0, num_blocks);
//      token_head: the logit factor of the key's k_scale and its v_scale) into shared memory,
//      then the K and V rows (VEC-byte loads, 16 when aligned) into shared memory;
//   B. logits: D_PAD / 16 threads per key, 16 FP8 bytes each decoded by bits (codec.cuh) and
//      dotted with the GPAD float32 query rows, reduced by warp shuffles;
//   C. online softmax in base 2, one warp per query head;
//   D. p @ v: each thread owns DPT output dimensions of every head (each V byte decoded once);
//      with D_PAD < 128 the keys are split among KG thread groups, added in the epilogue.
//
// Numerics (the reference's, fp8kv/reference.py): the logit factor k_scale * softmax_scale *
// log2(e) is never formed as one float32 (two factors on the same side of 1, see
// scale_factors), queries above 2^101 are scaled down by a power of two first, base-2 logits
// saturate at +-FLOAT32_MAX, static v_scale multiplies the normalised output, per-token-head
// v_scale enters the weights in units of a running maximum R (acc * R is the true sum), and
// the output saturates to its dtype's finite range. Rows that see no key get 0 and lse -inf.
//
// Memory safety without host checks: query_start_loc entries are clamped to [0, T], seq_lens
// to [0, max_blocks * block_size] (the block table row is never read past its end), block ids
// outside [0, num_blocks) are masked (never loaded), and tokens outside every sequence are
// left alone.
//
// Macros (fp8kv_cuda.variants): the format's (codec.cuh), and
//   FP8KV_QT: query/output dtype 0 float32, 1 float16, 2 bfloat16
//   FP8KV_D_PAD: head size rounded up to a power of two in 16..256
//   FP8KV_GPAD: query heads per CTA (power of two <= 16)
//   FP8KV_BLOCK_N: keys per tile
//   FP8KV_TOKEN_SCALES: per-token-head scales
//   FP8KV_VEC: bytes per global K/V load (16, 8, 4, 2 or 1; divides D, the strides and the bases)
#include "attention_common.cuh"

namespace fp8kv {

constexpr int D_PAD = FP8KV_D_PAD;
constexpr int GPAD = FP8KV_GPAD;
constexpr int BLOCK_N = FP8KV_BLOCK_N;
constexpr int VEC = FP8KV_VEC;
constexpr int TPK = D_PAD / 16;            // threads per key in the logit phase (16 bytes each)
constexpr int KPP = NT / TPK;              // keys per pass of the logit phase
constexpr int DPT = D_PAD > NT ? D_PAD / NT : 1;  // output dimensions per thread in p @ v
constexpr int NDT = D_PAD / DPT;           // threads per key group in p @ v (one per DPT dims)
constexpr int KG = NT / NDT;               // key groups in p @ v (keys j = kg, kg + KG, ...)
constexpr bool Q_IN_REGS = GPAD <= 4;      // the logit phase keeps its 16 query values per head in registers
constexpr int HPW = (GPAD + NWARPS - 1) / NWARPS;  // heads per warp in the softmax phase

static_assert(D_PAD >= 16 && D_PAD <= 256 && (D_PAD & (D_PAD - 1)) == 0, "D_PAD: a power of two in 16..256");
static_assert(GPAD >= 1 && GPAD <= 16 && (GPAD & (GPAD - 1)) == 0, "GPAD: a power of two <= 16");
static_assert(BLOCK_N % 32 == 0 && BLOCK_N <= NT, "BLOCK_N: a multiple of 32, at most NT");
static_assert(VEC == 1 || VEC == 2 || VEC == 4 || VEC == 8 || VEC == 16, "VEC: 1, 2, 4, 8 or 16");

struct Shared {
    float q[GPAD][D_PAD];                     // scaled queries, zero-padded
    alignas(16) u8 k[BLOCK_N][D_PAD];         // K codes of the tile (zeros where masked)
    alignas(16) u8 v[BLOCK_N][D_PAD];         // V codes of the tile
    float s[GPAD][BLOCK_N];                   // logits
    alignas(16) float p[BLOCK_N][GPAD];       // weights, key-major (one vector read per key in p @ v)
    i64 row_k[BLOCK_N];                       // byte offset of each key's K row, -1: masked
    i64 row_v[BLOCK_N];
    float kf1[BLOCK_N], kf2[BLOCK_N], vsc[BLOCK_N];  // token_head: logit factors, v scale
    float alpha[GPAD];                        // rescale of acc for this tile
    float m[GPAD], l[GPAD], r[GPAD];          // final state per head
    u32 qmax[NWARPS];
};

}  // namespace fp8kv

using namespace fp8kv;

extern "C" __global__ void __launch_bounds__(NT, 2) fp8kv_paged_attention(FP8KV_ATTENTION_PARAMS(D)) {
    __shared__ Shared sh;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    int t, h, chunk;
    decode_cta(T, head_chunks, t, h, chunk);
    const int g0 = chunk * GPAD;  // first head of this CTA within the group
    const int z = blockIdx.z;

    int q_lo = 0, q_hi = 0;
    const int s = find_seq(qsl, num_seqs, T, t, q_lo, q_hi);
    if (s < 0) return;  // a token outside every sequence: left alone (uniform over the CTA)

    // ---- the keys this row sees, and this split's part of them
    i64 kbeg, kend;
    key_span(seq_lens[s], q_lo, q_hi, t, causal, window, z, keys_per_split, max_blocks, block_size, kbeg, kend);

    // ---- queries: float32 in shared memory, scaled by 2^-qshift so that |q| < 2^101
    u32 qmax = 0u;
    for (int i = tid; i < GPAD * D_PAD; i += NT) {
        const int g = i / D_PAD, d = i - g * D_PAD;
        float x = 0.0f;
        if (g0 + g < group && d < D) x = load_q(query, ((i64)t * HQ + (i64)h * group + g0 + g) * D + d);
        sh.q[g][d] = x;
        qmax = u32_max(qmax, f2u(x) & 0x7FFFFFFFu);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) qmax = u32_max(qmax, __shfl_xor_sync(0xFFFFFFFFu, qmax, o));
    if (lane == 0) sh.qmax[warp] = qmax;
    __syncthreads();
    qmax = 0u;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) qmax = u32_max(qmax, sh.qmax[w]);
    const i32 qexp = (i32)(qmax >> 23) - 127;  // inf/NaN (exponent 128): left as they are
    const i32 qshift = (qmax < 0x7F800000u && qexp > 100) ? qexp - 100 : 0;
    if (qshift) {
        const float f = pow2i(-qshift);
        for (int i = tid; i < GPAD * D_PAD; i += NT) (&sh.q[0][0])[i] *= f;
    }
    const i32 gexp = g_exp + qshift;
    float f1 = 1.0f, f2 = 1.0f, vs_static = 1.0f;
    if (!TOKEN_SCALES) {
        scale_factors(k_scale[h * ks_sh], g_mant, gexp, f1, f2);
        vs_static = v_scale[h * vs_sh];
    }

    // ---- per-warp softmax state of its heads (g = warp + i * NWARPS), same in every lane
    float m_w[HPW], l_w[HPW], r_w[HPW];
#pragma unroll
    for (int i = 0; i < HPW; ++i) { m_w[i] = NEG_INF; l_w[i] = 0.0f; r_w[i] = 0.0f; }
    // ---- p @ v accumulators: dims [dg * DPT, dg * DPT + DPT) of every head, keys kg, kg + KG, ...
    const int dg = tid % NDT, kg = tid / NDT;
    float acc[GPAD][DPT];
#pragma unroll
    for (int g = 0; g < GPAD; ++g)
#pragma unroll
        for (int e = 0; e < DPT; ++e) acc[g][e] = 0.0f;
    // ---- the logit phase's chunk of the queries (its 16 dims never change)
    const int kc = tid % TPK;
    float qr[Q_IN_REGS ? GPAD : 1][16];
    __syncthreads();  // the scaled queries are in shared memory
    if constexpr (Q_IN_REGS) {
#pragma unroll
        for (int g = 0; g < GPAD; ++g)
#pragma unroll
            for (int e = 0; e < 16; ++e) qr[g][e] = sh.q[g][kc * 16 + e];
    }

    const int* bt_row = block_tables + (i64)s * bt_stride;
    for (i64 n0 = kbeg; n0 < kend; n0 += BLOCK_N) {
        const int nk = (int)(kend - n0 < BLOCK_N ? kend - n0 : BLOCK_N);
        __syncthreads();  // the previous tile's shared memory is consumed
        // A1. key metadata
        if (tid < BLOCK_N) {
            i64 rk = -1, rv = -1;
            float a = 1.0f, b = 1.0f, c = 0.0f;
            if (tid < nk) {
                const int n = (int)(n0 + tid);  // < seq_len <= INT32_MAX: 32-bit division (no call)
                const int page = n / block_size;
                const i64 tib = n - page * block_size;
                const int blk = bt_row[page];
                if (blk >= 0 && blk < num_blocks) {
                    rk = (i64)blk * k_sb + tib * k_st + (i64)h * k_sh;
                    rv = (i64)blk * v_sb + tib * v_st + (i64)h * v_sh;
                    if (TOKEN_SCALES) {
                        scale_factors(k_scale[(i64)blk * ks_sb + tib * ks_st + (i64)h * ks_sh], g_mant, gexp, a, b);
                        c = v_scale[(i64)blk * vs_sb + tib * vs_st + (i64)h * vs_sh];
                    }
                }
            }
            sh.row_k[tid] = rk;
            sh.row_v[tid] = rv;
            if (TOKEN_SCALES) { sh.kf1[tid] = a; sh.kf2[tid] = b; sh.vsc[tid] = c; }
        }
        __syncthreads();
        // A2. K and V rows into shared memory (zeros past D and for masked keys)
        constexpr int CHUNKS = D_PAD / VEC;
        for (int i = tid; i < BLOCK_N * CHUNKS; i += NT) {
            const int j = i / CHUNKS, c = (i - j * CHUNKS) * VEC;
            const i64 rk = sh.row_k[j];
            const bool ok = rk >= 0 && c < D;
            u8* dk = &sh.k[j][c];
            u8* dv = &sh.v[j][c];
            if constexpr (VEC == 16) {
                uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
                if (ok) { a = *reinterpret_cast<const uint4*>(key_cache + rk + c);
                          b = *reinterpret_cast<const uint4*>(value_cache + sh.row_v[j] + c); }
                *reinterpret_cast<uint4*>(dk) = a; *reinterpret_cast<uint4*>(dv) = b;
            } else if constexpr (VEC == 8) {
                uint2 a = make_uint2(0u, 0u), b = a;
                if (ok) { a = *reinterpret_cast<const uint2*>(key_cache + rk + c);
                          b = *reinterpret_cast<const uint2*>(value_cache + sh.row_v[j] + c); }
                *reinterpret_cast<uint2*>(dk) = a; *reinterpret_cast<uint2*>(dv) = b;
            } else if constexpr (VEC == 4) {
                u32 a = 0u, b = 0u;
                if (ok) { a = *reinterpret_cast<const u32*>(key_cache + rk + c);
                          b = *reinterpret_cast<const u32*>(value_cache + sh.row_v[j] + c); }
                *reinterpret_cast<u32*>(dk) = a; *reinterpret_cast<u32*>(dv) = b;
            } else if constexpr (VEC == 2) {
                u16 a = 0u, b = 0u;
                if (ok) { a = *reinterpret_cast<const u16*>(key_cache + rk + c);
                          b = *reinterpret_cast<const u16*>(value_cache + sh.row_v[j] + c); }
                *reinterpret_cast<u16*>(dk) = a; *reinterpret_cast<u16*>(dv) = b;
            } else {
                *dk = ok ? key_cache[rk + c] : (u8)0;
                *dv = ok ? value_cache[sh.row_v[j] + c] : (u8)0;
            }
        }
        __syncthreads();
        // B. logits: thread (key j, chunk kc) dots 16 decoded K bytes with every head's query
        for (int j0 = 0; j0 < BLOCK_N; j0 += KPP) {
            const int j = j0 + tid / TPK;
            float part[GPAD];
#pragma unroll
            for (int g = 0; g < GPAD; ++g) part[g] = 0.0f;
            if (j < nk) {
                const uint4 w = *reinterpret_cast<const uint4*>(&sh.k[j][kc * 16]);
                const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int e4 = 0; e4 < 4; ++e4) {
                    float kf[4];
#pragma unroll
                    for (int b = 0; b < 4; ++b) kf[b] = decode((words[e4] >> (8 * b)) & 0xFFu);
#pragma unroll
                    for (int g = 0; g < GPAD; ++g) {
                        float4 qv;
                        if constexpr (Q_IN_REGS) {
                            qv = make_float4(qr[g][e4 * 4], qr[g][e4 * 4 + 1], qr[g][e4 * 4 + 2], qr[g][e4 * 4 + 3]);
                        } else {
                            qv = *reinterpret_cast<const float4*>(&sh.q[g][kc * 16 + e4 * 4]);
                        }
                        part[g] = fmaf(kf[0], qv.x, part[g]);
                        part[g] = fmaf(kf[1], qv.y, part[g]);
                        part[g] = fmaf(kf[2], qv.z, part[g]);
                        part[g] = fmaf(kf[3], qv.w, part[g]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GPAD; ++g)
#pragma unroll
                for (int o = TPK / 2; o > 0; o >>= 1) part[g] += __shfl_xor_sync(0xFFFFFFFFu, part[g], o);
            if (kc == 0 && j < BLOCK_N) {
                const bool live = j < nk && sh.row_k[j] >= 0;
                const float a = TOKEN_SCALES ? sh.kf1[j] : f1;
                const float b = TOKEN_SCALES ? sh.kf2[j] : f2;
#pragma unroll
                for (int g = 0; g < GPAD; ++g) {
                    float x = (part[g] * a) * b;
                    if (use_cap) x = soft_cap * tanhf(fdiv(x, soft_cap)) * LOG2E;
                    sh.s[g][j] = live ? saturate(x) : NEG_INF;
                }
            }
        }
        __syncthreads();
        // C. online softmax, one warp per head
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
            const int g = warp + i * NWARPS;
            if (g < GPAD) {
                float x[BLOCK_N / 32];
                float tmax = NEG_INF;
#pragma unroll
                for (int u = 0; u < BLOCK_N / 32; ++u) {
                    x[u] = sh.s[g][lane + 32 * u];
                    tmax = fmaxf(tmax, x[u]);
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, o));
                const float m_new = fmaxf(m_w[i], tmax);
                const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
                const float alpha = exp2f(m_w[i] - m_safe);
                float psum = 0.0f, wmax = 0.0f;
#pragma unroll
                for (int u = 0; u < BLOCK_N / 32; ++u) {
                    x[u] = exp2f(x[u] - m_safe);  // masked keys: exp2(-inf) = 0
                    psum += x[u];
                    if (TOKEN_SCALES) {
                        x[u] *= sh.vsc[lane + 32 * u];  // p <= 1: finite
                        wmax = fmaxf(wmax, x[u]);
                    }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xFFFFFFFFu, psum, o);
                m_w[i] = m_new;
                l_w[i] = l_w[i] * alpha + psum;
                float acc_scale = alpha;
                if (TOKEN_SCALES) {
                    // weights in units of R, the running maximum of p * v_scale (rescaled by alpha)
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) wmax = fmaxf(wmax, __shfl_xor_sync(0xFFFFFFFFu, wmax, o));
                    const float r_scaled = r_w[i] * alpha;
                    const float r_new = fmaxf(r_scaled, wmax);
                    acc_scale = r_new > 0.0f ? fdiv(r_scaled, r_new) : 1.0f;
#pragma unroll
                    for (int u = 0; u < BLOCK_N / 32; ++u) x[u] = r_new > 0.0f ? fdiv(x[u], r_new) : 0.0f;
                    r_w[i] = r_new;
                }
#pragma unroll
                for (int u = 0; u < BLOCK_N / 32; ++u) sh.p[lane + 32 * u][g] = x[u];
                if (lane == 0) sh.alpha[g] = acc_scale;
            }
        }
        __syncthreads();
        // D. acc = acc * alpha + w @ v: each V byte decoded once, by the thread owning its dimension
#pragma unroll
        for (int g = 0; g < GPAD; ++g) {
            const float al = sh.alpha[g];
#pragma unroll
            for (int e = 0; e < DPT; ++e) acc[g][e] *= al;
        }
        for (int j = kg; j < nk; j += KG) {
            float vf[DPT];
            if constexpr (DPT == 1) {
                vf[0] = decode(sh.v[j][dg]);
            } else {
                const u32 two = *reinterpret_cast<const u16*>(&sh.v[j][dg * 2]);
                vf[0] = decode(two & 0xFFu);
                vf[1] = decode(two >> 8);
            }
            if constexpr (GPAD >= 4) {
#pragma unroll
                for (int g4 = 0; g4 < GPAD / 4; ++g4) {
                    const float4 w = *reinterpret_cast<const float4*>(&sh.p[j][g4 * 4]);
#pragma unroll
                    for (int e = 0; e < DPT; ++e) {
                        acc[g4 * 4][e] = fmaf(w.x, vf[e], acc[g4 * 4][e]);
                        acc[g4 * 4 + 1][e] = fmaf(w.y, vf[e], acc[g4 * 4 + 1][e]);
                        acc[g4 * 4 + 2][e] = fmaf(w.z, vf[e], acc[g4 * 4 + 2][e]);
                        acc[g4 * 4 + 3][e] = fmaf(w.w, vf[e], acc[g4 * 4 + 3][e]);
                    }
                }
            } else {
#pragma unroll
                for (int g = 0; g < GPAD; ++g) {
                    const float w = sh.p[j][g];
#pragma unroll
                    for (int e = 0; e < DPT; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
                }
            }
        }
    }

    // ---- epilogue: the owning warps publish (m, l, r); the key groups' partial sums are added
    // (through the query buffer, no longer needed); key group 0 stores its dims of every head
    __syncthreads();
#pragma unroll
    for (int i = 0; i < HPW; ++i) {
        const int g = warp + i * NWARPS;
        if (g < GPAD && lane == 0) { sh.m[g] = m_w[i]; sh.l[g] = l_w[i]; sh.r[g] = r_w[i]; }
    }
#pragma unroll
    for (int r = 1; r < KG; ++r) {
        if (kg == r) {
#pragma unroll
            for (int g = 0; g < GPAD; ++g)
#pragma unroll
                for (int e = 0; e < DPT; ++e) sh.q[g][dg * DPT + e] = acc[g][e];
        }
        __syncthreads();
        if (kg == 0) {
#pragma unroll
            for (int g = 0; g < GPAD; ++g)
#pragma unroll
                for (int e = 0; e < DPT; ++e) acc[g][e] += sh.q[g][dg * DPT + e];
        }
        __syncthreads();
    }
    if (KG == 1) __syncthreads();  // (m, l, r) visible
    if (tid < GPAD && g0 + tid < group) {  // one thread per head: the row statistics
        const i64 row = (i64)t * HQ + (i64)h * group + g0 + tid;
        if (split) {
            const i64 prow = (i64)z * T * HQ + row;
            part_ml[prow * 3] = sh.m[tid];
            part_ml[prow * 3 + 1] = sh.l[tid];
            part_ml[prow * 3 + 2] = sh.r[tid];
        } else if (write_lse) {
            const float l = sh.l[tid];
            lse[row] = l > 0.0f ? (sh.m[tid] + log2f(l)) * LN2 : NEG_INF;
        }
    }
    if (kg != 0) return;
#pragma unroll
    for (int g = 0; g < GPAD; ++g) {
        if (g0 + g >= group) continue;
        const i64 row = (i64)t * HQ + (i64)h * group + g0 + g;
        if (split) {
            const i64 prow = (i64)z * T * HQ + row;
#pragma unroll
            for (int e = 0; e < DPT; ++e) {
                const int d = dg * DPT + e;
                if (d < D) part_acc[prow * D + d] = acc[g][e];
            }
        } else {
            const float l = sh.l[g];
            const float inv = fdiv(1.0f, l > 0.0f ? l : 1.0f);
            const float mul = TOKEN_SCALES ? sh.r[g] : vs_static;
#pragma unroll
            for (int e = 0; e < DPT; ++e) {
                const int d = dg * DPT + e;
                if (d < D) store_out(out, row * D + d, (acc[g][e] * inv) * mul);
            }
        }
    }
}
