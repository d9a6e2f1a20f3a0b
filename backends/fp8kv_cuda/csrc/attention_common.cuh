// fp8kv_cuda: what the two attention kernels (attention.cu: any architecture, CUDA cores;
// attention_mma.cu: sm80+, tensor cores) share: query/output dtype, the numerics helpers of the
// reference's semantics (scale factors that never overflow, saturation, 2-ulp division), the
// token-to-sequence search, and the split-KV merge kernel.
//
// Macros: FP8KV_QT (query/output dtype 0 float32, 1 float16, 2 bfloat16), FP8KV_TOKEN_SCALES.
#pragma once
#include "codec.cuh"

// The tensor-core kernels: rows that see at least this many keys (over all splits) may enter p @ v
// with P as one float16 (fp8kv.testing.tolerance.FULL_P_KEYS, passed by fp8kv_cuda.variants); fewer
// keep P = hi + lo.
#ifndef FP8KV_FULL_P_KEYS
#define FP8KV_FULL_P_KEYS 1024
#endif

namespace fp8kv {

constexpr int QT = FP8KV_QT;
constexpr bool TOKEN_SCALES = FP8KV_TOKEN_SCALES != 0;
constexpr int NT = 128;                    // threads per CTA (both kernels and the merge)
constexpr int NWARPS = NT / 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float FLOAT32_MAX = 3.4028234663852886e38f;
#define NEG_INF __int_as_float(0xff800000)

#if FP8KV_QT == 0
typedef float q_t;
#else
typedef u16 q_t;
#endif

__device__ __forceinline__ float load_q(const q_t* q, i64 i) {
    if constexpr (QT == 0) {
        return q[i];
    } else if constexpr (QT == 1) {
        return u2f(f16_to_f32_bits(q[i]));
    } else {
        return u2f((u32)q[i] << 16);
    }
}

// o clamped to the output dtype's finite range (NaN stays NaN), stored.
__device__ __forceinline__ void store_out(q_t* out, i64 i, float o) {
    constexpr float HI = QT == 0 ? FLOAT32_MAX : (QT == 1 ? 65504.0f : 3.3895313892515355e38f);
    o = o > HI ? HI : (o < -HI ? -HI : o);
    if constexpr (QT == 0) {
        out[i] = o;
    } else if constexpr (QT == 1) {
        out[i] = f32_to_f16_bits(o);
    } else {
        out[i] = f32_to_bf16_bits(o);
    }
}

// out[i..i + 3] = o[0..3], each as store_out stores it: one 4-element store where `vec` (out + i aligned to 4
// elements), else four.
__device__ __forceinline__ void store_out4(q_t* out, i64 i, const float (&o)[4], bool vec) {
    if (!vec) {
#pragma unroll
        for (int j = 0; j < 4; ++j) store_out(out, i + j, o[j]);
        return;
    }
    constexpr float HI = QT == 0 ? FLOAT32_MAX : (QT == 1 ? 65504.0f : 3.3895313892515355e38f);
    float c[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = o[j] > HI ? HI : (o[j] < -HI ? -HI : o[j]);
    if constexpr (QT == 0) {
        *reinterpret_cast<float4*>(out + i) = make_float4(c[0], c[1], c[2], c[3]);
    } else {
        u32 b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = QT == 1 ? f32_to_f16_bits(c[j]) : f32_to_bf16_bits(c[j]);
        *reinterpret_cast<uint2*>(out + i) = make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
    }
}

// x / y to 2 ulp over the full range (PTX div.full.f32: no slow-path call, so no spill around one;
// the attention tolerance allows it, the write's bit-exact divisions stay IEEE).
__device__ __forceinline__ float fdiv(float x, float y) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
    return r;
}

__device__ __forceinline__ float saturate(float x) {  // +-FLOAT32_MAX, NaN kept
    return x > FLOAT32_MAX ? FLOAT32_MAX : (x < -FLOAT32_MAX ? -FLOAT32_MAX : x);
}

// 0x80 in each byte of w that is a NaN or inf code of the format.
__device__ __forceinline__ u32 nonfinite_bytes(u32 w) {
    if constexpr (FNUZ) {  // 0x80
        const u32 v = w ^ 0x80808080u;
        return (v - 0x01010101u) & ~v & 0x80808080u;
    } else if constexpr (HASINF) {  // e5m2: exponent all ones
        return ((w & 0x7C7C7C7Cu) + 0x04040404u) & 0x80808080u;
    } else {  // e4m3: 0x7F/0xFF
        return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
    }
}

__device__ __forceinline__ float pow2i(i32 e) {  // 2^e for e in [-126, 127]
    return u2f((u32)(e + 127) << 23);
}

// Two float32 factors (f1, f2) with f1 * f2 = x * g_mant * 2^g_exp, on the same side of 1, each a
// normal float32 (x: any float32 scale, subnormal included; g_mant in [1, 2)): (s * f1) * f2
// overflows or underflows only if the logit itself does. Zero, inf and NaN keep their value in f1.
__device__ __forceinline__ void scale_factors(float x, float g_mant, i32 g_exp, float& f1, float& f2) {
    const u32 bits = f2u(x);
    const u32 eb = (bits >> 23) & 0xFFu;
    const bool sub = eb == 0u;
    const float m_int = (float)(bits & 0x7FFFFFu);  // a subnormal is (these bits) * 2^-149, exactly
    const float xn = sub ? ((bits >> 31) ? -m_int : m_int) : x;
    const u32 nbits = f2u(xn);
    const float mant = u2f((nbits & 0x807FFFFFu) | 0x3F800000u) * g_mant;  // sign kept, [1, 4)
    i32 e = (i32)((nbits >> 23) & 0xFFu) - 127 + (sub ? -149 : 0) + g_exp;
    e = i32_min(i32_max(e, -250), 250);
    const i32 e1 = i32_min(i32_max(e, -125), 125);
    f1 = mant * pow2i(e1);
    f2 = pow2i(e - e1);
    if (eb == 255u || x == 0.0f) {
        f1 = x * g_mant;
        f2 = 1.0f;
    }
}

// The decode CTA's query token t, KV head h and head chunk: grid (T * H * head_chunks, 1, num_splits)
// (fp8kv_cuda.attention.decode_grid), x = (t * H + h) * head_chunks + chunk, so that the CTAs of one
// token's KV heads are launched side by side (they read the same blocks' rows: on the H100 a read-only
// gather of the decode shapes ran up to 4% faster so: benchmarks/profiles/decode_gather_ceiling.py).
// The CTAs a token has (H * head_chunks) come from the grid itself, so h < H whatever HQ and group are.
__device__ __forceinline__ void decode_cta(int T, int head_chunks, int& t, int& h, int& chunk) {
    const int units = (int)gridDim.x / T;  // (T >= 1: the launcher launches nothing for T == 0)
    t = (int)blockIdx.x / units;
    const int u = (int)blockIdx.x - t * units;
    h = u / head_chunks;
    chunk = u - h * head_chunks;
}

// The sequence a decode step would give query token t (qsl[s] = s): t, or the last sequence.
__device__ __forceinline__ int decode_guess(int num_seqs, int t) { return t < num_seqs ? t : num_seqs - 1; }

// The sequence of query token t: s with qsl[s] <= t < qsl[s + 1] (entries clamped to [0, T]),
// or -1 when t belongs to none. decode_guess first (one round of loads: a decode step's answer),
// else a binary search (log2(num_seqs) dependent rounds); with garbage offsets it stays in bounds.
__device__ __forceinline__ int find_seq(const int* qsl, int num_seqs, int T, int t, int& q_lo, int& q_hi) {
    if (num_seqs <= 0) return -1;
    const int guess = decode_guess(num_seqs, t);
    q_lo = i32_min(i32_max(qsl[guess], 0), T);
    q_hi = i32_min(i32_max(qsl[guess + 1], 0), T);
    if (q_lo <= t && t < q_hi) return guess;
    int lo = 0, hi = num_seqs;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        const int end = i32_min(i32_max(qsl[mid + 1], 0), T);
        if (end <= t) lo = mid + 1; else hi = mid;
    }
    if (lo >= num_seqs) return -1;
    q_lo = i32_min(i32_max(qsl[lo], 0), T);
    q_hi = i32_min(i32_max(qsl[lo + 1], 0), T);
    return (q_lo <= t && t < q_hi) ? lo : -1;
}

// The keys [kbeg, kend) query token t of sequence s (queries [q_lo, q_hi)) sees in split z:
// seq_lens clamped to the block table's row, the causal end, the window's start, the split.
// (len_s: seq_lens[s] as stored.)
__device__ __forceinline__ void key_span(int len_s, int q_lo, int q_hi, int t, int causal,
                                         int window, int z, int keys_per_split, int max_blocks, int block_size,
                                         i64& kbeg, i64& kend) {
    const i64 max_keys = (i64)max_blocks * block_size;
    const i64 seq_len = (i64)i32_max(len_s, 0) < max_keys ? (i64)i32_max(len_s, 0) : max_keys;
    const i64 pos = seq_len - (q_hi - q_lo) + (t - q_lo);
    const i64 k_hi_vis = causal ? (pos + 1 < seq_len ? pos + 1 : seq_len) : seq_len;
    const i64 k_lo_vis = pos - window + 1 > 0 ? pos - window + 1 : 0;
    const i64 z_lo = (i64)z * keys_per_split, z_hi = z_lo + keys_per_split;
    kbeg = k_lo_vis > z_lo ? k_lo_vis : z_lo;
    kend = k_hi_vis < z_hi ? k_hi_vis : z_hi;
}

}  // namespace fp8kv

using namespace fp8kv;

// Warp-wide max / sum (every lane gets the result).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
    return x;
}

constexpr int MERGE_SPLITS = 128;   // splits the merge takes (fp8kv_cuda.attention.MAX_SPLITS)
constexpr int MERGE_LANE_SPLITS = MERGE_SPLITS / 32;  // (m, l, r) triples a lane holds
constexpr int MERGE_PREFETCH = 16;  // splits whose partial outputs are loaded before the weights are known
constexpr int MERGE_DIMS = 2;       // dimensions a thread sums (head sizes up to 2 NT = 256)
static_assert(MERGE_SPLITS % 32 == 0 && MERGE_PREFETCH <= 32, "attention_common.cuh: merge tiling");

// Split-KV merge. Grid (T, HQ), NT threads. With w_s = 2^(m_s - max m): static scales out = sum_s
// w_s acc_s / sum_s w_s l_s * v_scale; per-token-head (acc_s in units of r_s) out = A * sum_s (w_s
// r_s / A) acc_s / sum_s w_s l_s with A = max_s w_s r_s (no overflow). Latency-bound (a decode step
// waits for it), so every load is issued at once, none waiting for another: thread d's dimensions
// of the first MERGE_PREFETCH splits, the splits' (m, l, r) (each warp reads them all, lane s split
// s + 32 i, and reduces them with shuffles: no barrier) and the token's sequence (find_seq; a row
// of a token outside every sequence was never written: its loads stay inside part_* and go unused).
// Splits past MERGE_PREFETCH are loaded once the weights are known. On sm90+ it is a programmatic
// dependent launch of the attention kernel (griddepcontrol.wait first, nothing read before it).
extern "C" __global__ void __launch_bounds__(NT) fp8kv_merge(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const float* __restrict__ v_scale,
    const int* __restrict__ qsl, q_t* __restrict__ out, float* __restrict__ lse, int write_lse,
    i64 vs_sh, int T, int HQ, int D, int group, int num_seqs, int num_splits) {
    if (num_splits > MERGE_SPLITS || D > MERGE_DIMS * NT) __trap();  // a launcher bug, never silent corruption
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // launched as a programmatic dependent launch on sm90+ (fp8kv_cuda.runtime.launch): the attention
    // kernel's partial results are complete and visible only past this point
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const int t = blockIdx.x;
    const int qh = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)t * HQ + qh;
    const i64 stride = (i64)T * HQ;
    float acc[MERGE_DIMS][MERGE_PREFETCH];
#pragma unroll
    for (int j = 0; j < MERGE_DIMS; ++j) {
        const int d = threadIdx.x + j * NT;
#pragma unroll
        for (int s = 0; s < MERGE_PREFETCH; ++s)
            acc[j][s] = d < D && s < num_splits ? part_acc[(s * stride + row) * D + d] : 0.0f;
    }
    float m[MERGE_LANE_SPLITS], l[MERGE_LANE_SPLITS], r[MERGE_LANE_SPLITS];
#pragma unroll
    for (int i = 0; i < MERGE_LANE_SPLITS; ++i) {
        const int z = lane + 32 * i;
        const float* ml = part_ml + (z * stride + row) * 3;
        const bool live = z < num_splits;
        m[i] = live ? ml[0] : NEG_INF;
        l[i] = live ? ml[1] : 0.0f;
        r[i] = live ? ml[2] : 0.0f;
    }
    const float vs = TOKEN_SCALES ? 1.0f : v_scale[(qh / group) * vs_sh];
    int q_lo = 0, q_hi = 0;
    if (find_seq(qsl, num_seqs, T, t, q_lo, q_hi) < 0) return;  // uniform over the CTA

    float m_max = NEG_INF;
#pragma unroll
    for (int i = 0; i < MERGE_LANE_SPLITS; ++i) m_max = fmaxf(m_max, m[i]);
    m_max = warp_max(m_max);
    const float m_safe = m_max == NEG_INF ? 0.0f : m_max;
    float w[MERGE_LANE_SPLITS], den = 0.0f, a_max = 0.0f;
#pragma unroll
    for (int i = 0; i < MERGE_LANE_SPLITS; ++i) {
        w[i] = exp2f(m[i] - m_safe);  // (0 past num_splits: m = -inf)
        den += w[i] * l[i];
        a_max = fmaxf(a_max, w[i] * r[i]);
    }
    den = warp_sum(den);
    if constexpr (TOKEN_SCALES) {
        a_max = warp_max(a_max);
        const float a_div = a_max > 0.0f ? a_max : 1.0f;
#pragma unroll
        for (int i = 0; i < MERGE_LANE_SPLITS; ++i) w[i] = fdiv(w[i] * r[i], a_div);
    }
    if (write_lse && threadIdx.x == 0) lse[row] = den > 0.0f ? (m_safe + log2f(den)) * LN2 : NEG_INF;
    const float den_safe = den > 0.0f ? den : 1.0f;
    const float mul = TOKEN_SCALES ? a_max : vs;
    float num[MERGE_DIMS] = {};
#pragma unroll
    for (int s = 0; s < MERGE_PREFETCH; ++s) {  // (w[0] of lane s: the weight of split s)
        const float ws = __shfl_sync(0xFFFFFFFFu, w[0], s);
#pragma unroll
        for (int j = 0; j < MERGE_DIMS; ++j) num[j] = fmaf(ws, acc[j][s], num[j]);
    }
#pragma unroll
    for (int i = 0; i < MERGE_LANE_SPLITS; ++i) {  // the other splits, split s = 32 i + k (uniform over the warp)
        for (int k = i == 0 ? MERGE_PREFETCH : 0; k < 32 && 32 * i + k < num_splits; ++k) {
            const float ws = __shfl_sync(0xFFFFFFFFu, w[i], k);
            const i64 base = ((32 * i + k) * stride + row) * D;
#pragma unroll
            for (int j = 0; j < MERGE_DIMS; ++j) {
                const int d = threadIdx.x + j * NT;
                if (d < D) num[j] = fmaf(ws, part_acc[base + d], num[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MERGE_DIMS; ++j) {
        const int d = threadIdx.x + j * NT;
        if (d < D) store_out(out, row * D + d, fdiv(num[j], den_safe) * mul);
    }
}

// The attention kernels' parameters (one launcher argument list, fp8kv_cuda.attention): DIM names the
// head-size argument (the tensor-core kernel's head size is a compile-time constant instead).
#define FP8KV_ATTENTION_PARAMS(DIM)                                                                         \
    const q_t* __restrict__ query, const u8* __restrict__ key_cache, const u8* __restrict__ value_cache,    \
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,                                   \
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int* __restrict__ qsl,    \
    q_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_acc, float* __restrict__ part_ml, \
    float g_mant, int g_exp, float soft_cap, int use_cap, int window, int causal, int split, int write_lse,  \
    i64 bt_stride, i64 k_sb, i64 k_st, i64 k_sh, i64 v_sb, i64 v_st, i64 v_sh,                             \
    i64 ks_sb, i64 ks_st, i64 ks_sh, i64 vs_sb, i64 vs_st, i64 vs_sh,                                     \
    int T, int HQ, int DIM, int group, int head_chunks, int num_seqs, int max_blocks, int block_size,        \
    int num_blocks, int keys_per_split

// The same parameters as arguments (a kernel passing them on to its body).
#define FP8KV_ATTENTION_ARGS(DIM)                                                                             \
    query, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, qsl, out, lse, part_acc, part_ml, \
    g_mant, g_exp, soft_cap, use_cap, window, causal, split, write_lse, bt_stride, k_sb, k_st, k_sh, v_sb,     \
    v_st, v_sh, ks_sb, ks_st, ks_sh, vs_sb, vs_st, vs_sh, T, HQ, DIM, group, head_chunks, num_seqs,            \
    max_blocks, block_size, num_blocks, keys_per_split
