// fp8kv_cuda: what the chunked-prefill kernels on mma.sync (prefill_mma.cu, sm75+) and on WMMA
// (prefill_wmma.cu, Volta's m8n8k4 tensor cores) share beyond prefill_rows.cuh: where the CTA's keys
// come from, and how raw q . k becomes a base-2 logit.
#pragma once
#include "mma_common.cuh"
#include "prefill_rows.cuh"

namespace fp8kv {

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
