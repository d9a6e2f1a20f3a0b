// fp8kv_cuda: what the chunked-prefill kernels on mma.sync (prefill_mma.cu, sm75+) and on WMMA
// (prefill_wmma.cu, Volta's m8n8k4 tensor cores) share: a CTA's rows and the keys each row sees,
// where the CTA's keys come from, and how raw q . k becomes a base-2 logit.
//
// A CTA owns the rows [row0, row0 + block_m) of one sequence s and one KV head, and the keys of
// split z; row = (token - first token) * group + query head (the GQA group packed into the rows).
#pragma once
#include "mma_common.cuh"

namespace fp8kv {

// Which keys each row of the CTA's sequence sees: query_start_loc and seq_lens clamped (to [0, T]
// and to the block table's row), the causal end, the window's start, the split.
struct RowKeys {
    i64 seq_len, z_lo, z_hi;
    int q_lo, q_hi, rows, group, window, causal;

    // The keys [lo, hi) row sees in the split (whole: in every split); [0, 0) past the rows.
    __device__ __forceinline__ void span(int row, int& lo, int& hi, bool whole = false) const {
        if (row >= rows) { lo = hi = 0; return; }
        const i64 pos = seq_len - (q_hi - q_lo) + row / group;
        i64 a = pos - window + 1 > 0 ? pos - window + 1 : 0;
        i64 b = causal ? (pos + 1 < seq_len ? pos + 1 : seq_len) : seq_len;
        a = a > z_lo || whole ? a : z_lo;
        b = b < z_hi || whole ? b : z_hi;
        lo = (int)a;
        hi = (int)(b > a ? b : a);
    }
};

__device__ __forceinline__ RowKeys row_keys(const int* qsl, const int* seq_lens, int s, int z, int T, int group,
                                            int window, int causal, int max_blocks, int block_size,
                                            int keys_per_split) {
    RowKeys rk;
    rk.q_lo = i32_min(i32_max(qsl[s], 0), T);
    rk.q_hi = i32_max(i32_min(i32_max(qsl[s + 1], 0), T), rk.q_lo);
    rk.rows = (rk.q_hi - rk.q_lo) * group;
    const i64 max_keys = (i64)max_blocks * block_size;
    rk.seq_len = (i64)i32_max(seq_lens[s], 0) < max_keys ? (i64)i32_max(seq_lens[s], 0) : max_keys;
    rk.z_lo = (i64)z * keys_per_split;
    rk.z_hi = rk.z_lo + keys_per_split;
    rk.group = group;
    rk.window = window;
    rk.causal = causal;
    return rk;
}

// The CTA's keys: [kb, ke) covers every row's span; [lo_max, hi_min) is seen by every row (a step
// inside it needs no mask); split_p: some row sees fewer than FP8KV_FULL_P_KEYS keys over all splits
// (its P enters p @ v as hi + lo).
struct CtaKeys {
    int kb, ke, lo_max, hi_min;
    bool split_p;
};

__device__ __forceinline__ CtaKeys cta_keys(const RowKeys& rk, int row0, int block_m) {
    const int last = i32_min(row0 + block_m, rk.rows) - 1;
    CtaKeys ck;
    int lo_last, hi_first;
    rk.span(row0, ck.kb, hi_first);
    rk.span(last, lo_last, ck.ke);
    ck.kb = i32_min(ck.kb, lo_last);  // (spans are monotone in the row; empty ones are [0, 0))
    ck.ke = i32_max(ck.ke, hi_first);
    ck.lo_max = i32_max(ck.kb, lo_last);
    ck.hi_min = i32_min(ck.ke, hi_first);
    // the fewest keys a row sees (over all splits; monotone in the row, so at an end)
    int a0, b0, a1, b1;
    rk.span(row0, a0, b0, true);
    rk.span(last, a1, b1, true);
    ck.split_p = b0 - a0 < FP8KV_FULL_P_KEYS || b1 - a1 < FP8KV_FULL_P_KEYS;
    return ck;
}

// Where the CTA's keys come from (in shared memory: registers are the kernels' limit).
struct Keys {
    const int* bt_row;
    const u8* kbase;  // head offset included
    const u8* vbase;
    i64 k_sb, k_st, v_sb, v_st;
    int kb, ke, block_size, bs_shift, num_blocks;
    bool small;  // every K/V offset fits 31 bits: 32-bit address arithmetic
    bool fast;   // small, and the block size a power of two dividing block_n (prefill_mma.cu's CopyPlan)
};

__device__ __forceinline__ void set_keys(Keys& keys, const int* bt_row, const u8* kbase, const u8* vbase, i64 k_sb,
                                         i64 k_st, i64 v_sb, i64 v_st, int kb, int ke, int block_size,
                                         int num_blocks, int head_size, int block_n) {
    keys.bt_row = bt_row;
    keys.kbase = kbase;
    keys.vbase = vbase;
    keys.k_sb = k_sb; keys.k_st = k_st; keys.v_sb = v_sb; keys.v_st = v_st;
    keys.kb = kb; keys.ke = ke;
    keys.block_size = block_size;
    keys.bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    keys.num_blocks = num_blocks;
    auto fits = [&](i64 sb, i64 st) {  // (each product < 2^62)
        return sb >= 0 && st >= 0 && sb < (1ll << 31) && st < (1ll << 31) &&
               (i64)num_blocks * sb + (i64)block_size * st + head_size < (1ll << 31);
    };
    keys.small = fits(k_sb, k_st) && fits(v_sb, v_st);
    keys.fast = keys.small && keys.bs_shift >= 0 && block_size <= block_n;
}

// The block id of key n (-1 outside [kb, ke)).
__device__ __forceinline__ int key_block(const Keys& ks, int n) {
    const int page = ks.bs_shift >= 0 ? n >> ks.bs_shift : n / ks.block_size;
    return n >= ks.kb && n < ks.ke ? ks.bt_row[page] : -1;
}

// Byte offsets of chunk ch (16 bytes) of key n in block blk (valid) from kbase and vbase.
__device__ __forceinline__ void key_offsets(const Keys& ks, int n, int blk, int ch, i64& ok, i64& ov) {
    const int page = ks.bs_shift >= 0 ? n >> ks.bs_shift : n / ks.block_size;
    const int tib = n - page * ks.block_size;
    if (ks.small) {
        ok = (u32)blk * (u32)ks.k_sb + (u32)tib * (u32)ks.k_st + (u32)(16 * ch);
        ov = (u32)blk * (u32)ks.v_sb + (u32)tib * (u32)ks.v_st + (u32)(16 * ch);
    } else {
        ok = (i64)blk * ks.k_sb + (i64)tib * ks.k_st + 16 * ch;
        ov = (i64)blk * ks.v_sb + (i64)tib * ks.v_st + 16 * ch;
    }
}

// A warp's ballot of one flag per key, held by lanes 0, 8, 16, 24 (keys 4 warp + [0, 4) of a
// 128-thread CTA copying 8 chunks per key), as bits of the step's keys (+ base).
__device__ __forceinline__ u32 key_bits(u32 ballot, int warp, int base) {
    // bits 0, 8, 16, 24 moved to 28..31 by one product: no two terms meet
    return (((ballot & 0x01010101u) * 0x10204080u) >> 28) << (4 * warp + base);
}

// w with its NaN/inf codes (bytes) set to 0.
__device__ __forceinline__ u32 zero_nonfinite(u32 w) { return w & ~((nonfinite_bytes(w) >> 7) * 0xFFu); }

// How raw q . k becomes a base-2 logit.
struct Logit {
    float f1, f2;      // (q . k * f1) * f2, saturated (scale_factors)
    float fs;          // f1 * f2, when simple
    float soft_cap;
    int use_cap;
    bool simple;       // the logit is q . k * fs: fs normal and > 0, no soft-cap, |q . k| * fs <= 2^126
};

// The logit factors for k_scale ks, softmax scale g_mant 2^g_exp, queries entering as q 2^-qshift
// whose largest magnitude (float32 bits) is qmax: simple when q . k * f1 * f2 cannot overflow,
// |q . k| <= D max|q| max|code|.
__device__ __forceinline__ Logit make_logit(float ks, float g_mant, i32 g_exp, i32 qshift, u32 qmax, int head_size,
                                            float soft_cap, int use_cap) {
    Logit lg;
    scale_factors(ks, g_mant, g_exp + qshift, lg.f1, lg.f2);
    lg.fs = lg.f1 * lg.f2;
    lg.soft_cap = soft_cap;
    lg.use_cap = use_cap;
    const float qabs = u2f(qmax) * pow2i(i32_max(i32_min(-qshift, 127), -126));
    const float bound = (float)head_size * qabs * u2f(MAXBITS) * lg.fs;  // (inf or NaN: not simple)
    lg.simple = !use_cap && lg.fs >= 1.1754943508222875e-38f && lg.fs < FLOAT32_MAX && bound <= 0x1p126f;
    return lg;
}

}  // namespace fp8kv
