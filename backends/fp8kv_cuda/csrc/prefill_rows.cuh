// fp8kv_cuda: what every chunked-prefill kernel (prefill_mma.cu, prefill_wmma.cu, prefill_wgmma.cu)
// shares: a CTA's rows and the keys each row sees.
//
// A CTA owns the rows [row0, row0 + block_m) of one sequence s and one KV head, and the keys of
// split z; row = (token - first token) * group + query head (the GQA group packed into the rows).
// Rows that see fewer than FP8KV_FULL_P_KEYS keys (over all splits) enter p @ v as hi + lo.
#pragma once
#include "attention_common.cuh"

namespace fp8kv {

// A prefill CTA's place in the grid (row tiles, H, num_seqs * num_splits): its redo[] slot, KV head,
// sequence and split.
struct PrefillCta {
    i64 id;
    int h, s, z;
};

__device__ __forceinline__ PrefillCta prefill_cta(int num_seqs) {
    PrefillCta c;
    c.id = ((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    c.h = blockIdx.y;
    const int num_splits = (int)gridDim.z / num_seqs;  // grid z = num_seqs * num_splits
    c.s = blockIdx.z / num_splits;
    c.z = blockIdx.z - c.s * num_splits;
    return c;
}

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

}  // namespace fp8kv
