// fp8kv_hopper: the FP8 attention mode's chunked prefill on Hopper's FP8 tensor cores (sm_90a).
//
// Definition: docs/fp8_attention.md (fp8kv.fp8_attention is the reference). An e4m3fn cache with
// per-tensor or per-head scales, head size 128, no soft-cap, one split; the Triton kernel of
// fp8kv_hopper/attention.py serves the rest.
//
// CTA = 3 warpgroups (384 threads), rows and keys as the Triton kernel: 128 query rows of one sequence
// and KV head (row = token * group + head in the group), tiles of 128 keys.
//   warpgroup 0, the producer: warp w takes tiles w, w + 4, ... (stage w). Once the stage is free it loads
//     the tile's K and V codes through the block table, with TMA (one box per page, or per 128 keys of a
//     longer page; FP8KV_TMA) or else cp.async (16 bytes a copy), landing on the stage's `loaded`
//     mbarrier; keys whose block id is outside the cache are zero-filled, and they and the keys past the
//     CTA's range are marked invalid. Then it waits for the tile, transposes V in shared memory (4 x 4
//     byte blocks, PRMT; V rows past the range zeroed) so that p8 @ v8 is an e4m3 wgmma too, and hands
//     V^T over on `vready`.
//   warpgroups 1 and 2, the consumers, 64 rows each: q8 = e4m3(q / q_scale) once (bit for bit as the
//     cache's own quantization), then per tile S = q8 k8^T (4 wgmma m64n128k32 e4m3, A and B from
//     shared memory), the online softmax against an integer running maximum (every rescaling an
//     exact power of two), l += p (float32, before rounding), p8 = e4m3(p / prob_scale) packed from
//     the S accumulators straight into wgmma A registers, O += p8 v8 (4 wgmma, A from registers).
//     The key order of a 32-key slice of p8's A fragment differs from S's accumulator order; the
//     producer writes V^T's key columns in that order (vt_key), so nothing moves between lanes.
//     Tile t's softmax runs while O += p8(t-1) v8(t-1) does (FP8KV_OVERLAP; consumer_pipeline_overlap).
// Work items: (query block, KV head) pairs, a CTA each, or (Params::persistent) a grid of one CTA per SM
// taking them in turn (cta_item), the ring running on from one item into the next.
//
// Shared-memory layouts: K and the raw V tiles as TMA's 128-byte swizzle writes them (sw128: rows of 128
// bytes, 16-byte chunk c of row r at chunk c ^ (r % 8); wgmma reads K so, layout type 1), which keeps the
// transpose's loads free of bank conflicts; q8 and V^T in wgmma's no-swizzle K-major layout: 8 rows x 16
// bytes "core matrices", LBO = 128 bytes between core matrices along K, SBO between 8-row groups (1024;
// 1040 for V^T, whose padding makes the transpose's stores free of bank conflicts).
//
// Memory safety without host checks: query_start_loc and seq_lens clamped as the Triton kernel,
// block ids outside [0, num_blocks) never loaded, rows past a sequence's queries never written.
//
// Macros: FP8KV_QT (query and output type: 0 float32, 1 float16, 2 bfloat16), FP8KV_STAGES,
// FP8KV_LAZY (1: the conditional rescaling of lazy_softmax), FP8KV_PINGPONG (1: the two consumer warpgroups
// issue their wgmma phases in turn), FP8KV_TMA (1: TMA
// loads through Params' tensor maps; 0: cp.async, for caches TMA cannot describe).

#include "wgmma_common.cuh"

namespace fp8kv {

typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

constexpr int D = 128;
constexpr int BLOCK_M = 128;      // rows per CTA (two consumer warpgroups of 64)
constexpr int BLOCK_N = 128;      // keys per tile
constexpr int STAGES = FP8KV_STAGES;
constexpr int THREADS = WS_THREADS;
constexpr int QT = FP8KV_QT;
constexpr bool PINGPONG = FP8KV_PINGPONG != 0;  // the consumer warpgroups issue their products in turn
constexpr bool TMA = FP8KV_TMA != 0;            // K and V tiles loaded by TMA (else cp.async)
#ifndef FP8KV_LAZY
#define FP8KV_LAZY 1
#endif
constexpr bool LAZY = FP8KV_LAZY != 0;          // lazy_softmax on the interior tiles (FMA logits)
#ifndef FP8KV_OVERLAP
#define FP8KV_OVERLAP 1
#endif
constexpr bool OVERLAP = FP8KV_OVERLAP != 0;    // a tile's softmax overlaps the previous tile's O += p8 v8
constexpr int TILE_BYTES = BLOCK_N * D;         // a K (or V) tile: 128 keys x 128 e4m3 codes
constexpr int VT_SBO = 1040;      // bytes between 8-dim groups of V^T (1024 + 16: conflict-free stores)
constexpr float E4M3_MAX = 448.0f;
constexpr float FLOAT32_MAX = 3.4028234663852886e38f;
constexpr float LN2 = 0.6931471805599453f;
#define NEG_INF __int_as_float(0xff800000)

struct __align__(1024) Smem {          // (1024: the swizzled tiles' alignment)
    u8 q[BLOCK_M * D];                 // q8, K-major (a consumer's 64 rows: 8192 bytes)
    u8 k[STAGES][TILE_BYTES];          // K tiles, sw128
    u8 vr[STAGES][TILE_BYTES];         // raw V tiles as loaded, sw128
    u8 vt[STAGES][(D / 8) * VT_SBO];   // V^T tiles: rows = dims, K = keys in vt_key order
    u8 valid[STAGES][BLOCK_N];         // 1 where the key is in the CTA's range and its block id in the cache
    double row_f[BLOCK_M];             // per row: q_scale * k_scale * softmax_scale * log2(e)
    u64 loaded[STAGES];                // mbarriers: the tile's K, raw V and valid flags landed (producer)
    u64 vready[STAGES];                //   its V^T written (producer)
    u64 empty[STAGES];                 //   the stage consumed (consumers)
};
constexpr int SMEM_BYTES = (int)sizeof(Smem);

// S = q8 k8^T: 4 k32 steps over D = 128 (q8: +256 bytes a step, descriptor + 16; K (sw128): +32 bytes)
__device__ __forceinline__ void issue_qk(float (&s)[64], u64 dq, u64 dk) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma_e4m3_ss(s, dq + 16 * ks, dk + 2 * ks, ks > 0);
}
// O += p8 v8: 4 k32 steps over the tile's 128 keys
__device__ __forceinline__ void issue_pv(float (&o)[64], const u32 (&pa)[4][4], u64 dv) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_e4m3_rs(o, pa[kk], dv + 16 * kk);
}

// ---- conversions ----
// four e4m3 bytes (e4m3x2 of ptx_math.cuh)
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) { return e4m3x2(a, b) | (e4m3x2(c, d) << 16); }

// p (an m64n128 accumulator) as e4m3 wgmma A fragments of 4 k32 slices: word 0 / 1 = rows r / r + 8,
// positions 4c..4c+3 = keys 2c, 2c + 1, 2c + 8, 2c + 9 (n-tiles 4 kk, 4 kk + 1); words 2 / 3 the same
// 16 keys on (V^T's columns are in this key order: vt_key)
__device__ __forceinline__ void pack_p8(const float (&p)[64], u32 (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const int j = 4 * kk + 2 * (w >> 1), e = 2 * (w & 1);
            pa[kk][w] = e4m3x4(p[4 * j + e], p[4 * j + e + 1], p[4 * j + 4 + e], p[4 * j + 4 + e + 1]);
        }
}

// x / qs rounded to float32 exactly as the IEEE division (__fdiv_rn) rounds it, from rq = 1 / qs in float64:
// the float64 product's relative error is at most 2^-52, while a quotient of two float32 values is never a
// float32 rounding midpoint and stays at least 2^-49 (relative) away from every one, so both round alike
// (tests/test_hopper_wgmma.py checks it against float32 division on every bfloat16 and float16 value).
// Results below 2^-126 may differ in their last subnormal bit, which no e4m3 rounding sees (below 2^-10:
// 0). Three float64-pipe instructions where __fdiv_rn takes a dozen and a range check.
__device__ __forceinline__ float div_by_scale(float x, double rq) { return (float)((double)x * rq); }

// The same quotient where e4m3 can tell (Markstein's division in float32, all on the FMA pipe; the float64
// conversions above run at a sixteenth of its rate), for qs in [2^-80, 2^80] and rs = 1 / qs rounded to nearest:
// y0 = x rs is within 2 ulp of x / qs; one correction by the residual x - y0 qs (an FMA: rounded at most once
// at 2^-24 of itself, which leaves y1 within 2^-46 of x / qs relative) makes it faithful, a second one
// correctly rounded (Markstein: rs within half an ulp of 1 / qs, the residual of a faithful y1 exact). The
// range keeps that residual a multiple of 2^-149 of at most 24 bits where the result is used,
// 2^-12 <= |y0| < 1024. Outside it y0 stands: e4m3 saturates from 464, rounds below 2^-10 to a zero of the
// sign y0 keeps, and NaN and infinities pass (tests/test_hopper_wgmma.py checks it against float32 division).
__device__ __forceinline__ float div_by_scale(float x, float qs, float rs) {
    const float y0 = __fmul_rn(x, rs);
    const float y1 = __fmaf_rn(__fmaf_rn(-y0, qs, x), rs, y0);
    const float y2 = __fmaf_rn(__fmaf_rn(-y1, qs, x), rs, y1);
    const float a = fabsf(y0);
    return a >= 0x1p-12f && a < 1024.0f ? y2 : y0;
}

// 64 query values as loaded: 16-byte words (16 for float32 queries, 8 for 16-bit ones)
struct QWords {
    uint4 w[QT == 0 ? 16 : 8];
};
// the 64 query values from element `base` (a multiple of 64: 16-byte aligned for a 16-byte aligned query),
// zeros unless valid; 16-byte loads, left in flight (nothing reads them here)
__device__ __forceinline__ void fetch_q64(const void* Q, i64 base, bool valid, QWords& q) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const u8*>(Q) + base * (QT == 0 ? 4 : 2));
#pragma unroll
    for (int i = 0; i < (QT == 0 ? 16 : 8); ++i) q.w[i] = valid ? __ldg(p + i) : make_uint4(0u, 0u, 0u, 0u);
}
// the fetched values as float32 (exact)
__device__ __forceinline__ void q64_floats(const QWords& q, float (&x)[64]) {
#pragma unroll
    for (int i = 0; i < (QT == 0 ? 16 : 8); ++i) {
        const u32 w[4] = {q.w[i].x, q.w[i].y, q.w[i].z, q.w[i].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if constexpr (QT == 0) {
                x[4 * i + k] = __uint_as_float(w[k]);
            } else {
                x[8 * i + 2 * k] = QT == 1 ? f16_lo(w[k]) : __uint_as_float(w[k] << 16);
                x[8 * i + 2 * k + 1] = QT == 1 ? f16_hi(w[k]) : __uint_as_float(w[k] & 0xFFFF0000u);
            }
        }
    }
}
// two outputs as the output type (float32 as two floats), saturated to its finite range
__device__ __forceinline__ void store_out2(void* O, i64 i, float a, float b) {
    if constexpr (QT == 0) {
        *reinterpret_cast<float2*>(static_cast<float*>(O) + i) = make_float2(fminf(fmaxf(a, -FLOAT32_MAX), FLOAT32_MAX),
                                                                            fminf(fmaxf(b, -FLOAT32_MAX), FLOAT32_MAX));
    } else {
        const float hi = QT == 1 ? 65504.0f : 3.3895313892515355e38f;
        a = fminf(fmaxf(a, -hi), hi);
        b = fminf(fmaxf(b, -hi), hi);
        u32 r;
        if constexpr (QT == 1) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
        else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
        *reinterpret_cast<u32*>(static_cast<u16*>(O) + i) = r;
    }
}

// ---- the producer's pieces ----

// Key (within the tile) whose V row the p8 A fragment's k position `kpos` multiplies: the S
// accumulator holds keys 8j + 2c + {0, 1} in lane c of a quad, the e4m3 A fragment positions
// 4c + {0..3} and 16 + 4c + {0..3} of each 32-key slice.
__device__ __forceinline__ int vt_key(int kpos) {
    const int i = kpos & 3, c = (kpos >> 2) & 3;
    return (kpos & ~15) + 8 * (i >> 1) + 2 * c + (i & 1);
}

// V^T[dim][kpos] = V[vt_key(kpos)][dim] for a 128 x 128 tile (vr: sw128), by WARPS warps (thread wt of
// 32 WARPS): 32 units (chunk, dg) = (u / 4, u % 4), unit u taken by warp u % WARPS; in a unit, lane
// (a, w) = (lane % 8, lane / 8) moves the 4 x 4 byte block of key positions 16 chunk + 4 w + i and dims
// 32 dg + 4 a + j. TAIL: keys >= tail are written as zeros (past the CTA's range: masked in S, but p = 0
// times a NaN code would still be NaN).
template <bool TAIL, int WARPS>
__device__ __forceinline__ void transpose_v(const u8* vr, u8* vt, int wt, int tail) {
    const int warp = wt >> 5, lane = wt & 31, a = lane & 7, w = lane >> 3;
    // vt_key(16 chunk + 4 w + i) = 16 chunk + 2 w + 8 (i / 2) + i % 2 =: key, key % 8 = 2 w + i % 2; the
    // load of dims 32 dg + 4 a .. + 3 (16-byte chunk 2 dg + a / 4) is at key * 128 + 16 ((2 dg + a / 4) ^
    // (key % 8)) + 4 (a % 4) = key * 128 + 32 (dg ^ w) + 16 ((a / 4) ^ (i % 2)) + 4 (a % 4)
    const u32 src = smem_addr(vr) + (u32)(2 * w * 128 + 4 * (a & 3));
    // kmajor(32 dg + 4 a + j, 16 chunk + 4 w) = kmajor(4 a, 4 w) + 128 chunk + 4 dg SBO + 16 j
    const u32 dst = smem_addr(vt) + kmajor(4 * a, 4 * w, VT_SBO);
#pragma unroll 4
    for (int u = warp; u < 32; u += WARPS) {
        const int chunk = u >> 2, dg = u & 3;
        u32 x[4], y[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key_off = 8 * (i >> 1) + (i & 1);  // key - (16 chunk + 2 w)
            const u32 swz = (u32)(32 * (dg ^ w) + 16 * ((a >> 2) ^ (i & 1)));
            asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x[i]) : "r"(src + (u32)(chunk * 2048 + key_off * 128) + swz));
            if (TAIL && 16 * chunk + 2 * w + key_off >= tail) x[i] = 0u;
        }
        transpose4x4(x, y);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(dst + (u32)(128 * chunk + 4 * dg * VT_SBO + 16 * j)), "r"(y[j]));
    }
}

}  // namespace fp8kv

namespace fp8kv {

// Per-CTA geometry, as fp8kv_triton's _program_rows / _key_range (one split).
struct Cta {
    int seq, qb, kvh, q_start, q_len, seq_len;
    int lo, hi;          // the keys the CTA visits: [lo, hi), lo tile-aligned
    int all_lo, all_hi;  // keys visible to every row (tiles inside need no mask)
    int ntiles;
};

struct Params {
    // FP8KV_TMA: the K and V caches as 4-d uint8 tensors (128 codes, X, Y, blocks), 128-byte swizzle, box
    // (128, 1 or box_rows, box_rows or 1, 1); X, Y = KV head, key in the page when head_inner (the
    // smaller stride first), else the other way round
    TensorMap tmap_k, tmap_v;
    const void* q;
    const float *qs, *ks, *vs;
    const u8 *kc, *vc;
    const int *bt, *seq_lens, *qsl;
    void* out;
    float* lse;
    const int* sched;  // persistent only, or null: the plan's item lists, [sched_rows, gridDim.x] (cta_item)
    float sm_mant, prob_scale, inv_prob_scale;
    float lazy_t;  // lazy_softmax's threshold: an integer in [0, 8] with 2^lazy_t <= 448 prob_scale (else 0)
    int sm_exp, window, causal;
    i64 stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh;
    int stride_qs_kv, stride_qs_q, stride_ksh, stride_vsh;
    int T, HQ, group, block_q, q_blocks, page, page_shift, num_blocks, max_keys;
    int q_dynamic, write_lse, scale_p;
    int head_inner, box_rows;  // (FP8KV_TMA) box_rows = min(page, 128); 128 % page == 0 or page % 128 == 0
    int num_seqs, num_items;   // work items: num_seqs * q_blocks * (HQ / group) (query block, KV head) pairs
    int persistent;            // 1: a grid of fewer CTAs than items, each taking items in turn (cta_item)
    int sched_rows;
};

// The k-th work item of this CTA, as cta_of reads it (num_items: none left). One CTA per item (persistent
// = 0, gridDim.x = num_items): the item is the CTA's index, KV-head major and the longest rows of a sequence
// first, the order of the grid of separate CTAs this kernel had before. Persistent: items are ordered by
// query block from the longest rows down (then sequence, then KV head). With a schedule (fp8kv_hopper.
// schedule, from the step's host lengths), CTA b takes items sched[k * G + b] (every item once, in lists of
// about equal cost; an entry >= num_items ends a list). Without, CTA b takes item b of every round of gridDim.x items,
// in a snake: rounds 1, 3, ... from the other end, so that a CTA's long items of one round meet short ones
// of the next (causal items shrink with the query block; every round runs on all SMs).
__device__ __forceinline__ int cta_item(const Params& P, int k) {
    const int G = gridDim.x, b = blockIdx.x;
    if (P.sched != nullptr) return k < P.sched_rows ? __ldg(P.sched + k * G + b) : P.num_items;
    return G * k + (P.persistent && (k & 1) ? G - 1 - b : b);
}

// Item `item`'s geometry (false: it has no rows, or it is past the last item).
__device__ __forceinline__ bool cta_of(const Params& P, int item, Cta& cta) {
    if (static_cast<unsigned>(item) >= static_cast<unsigned>(P.num_items)) return false;
    const int H = P.HQ / P.group, pairs = P.num_seqs * P.q_blocks;
    int qb_rev;
    if (P.persistent) {
        cta.kvh = item % H;
        cta.seq = item / H % P.num_seqs;
        qb_rev = item / H / P.num_seqs;
    } else {
        cta.kvh = item / pairs;
        cta.seq = item % pairs / P.q_blocks;
        qb_rev = item % pairs % P.q_blocks;
    }
    cta.qb = P.q_blocks - 1 - qb_rev;  // the longest rows first
    const int qs0 = min(max(P.qsl[cta.seq], 0), P.T), qs1 = min(max(P.qsl[cta.seq + 1], 0), P.T);
    cta.q_start = qs0;
    cta.q_len = max(qs1 - qs0, 0);
    if (cta.qb * P.block_q >= cta.q_len) return false;
    cta.seq_len = min(max(P.seq_lens[cta.seq], 0), P.max_keys);
    const int first_pos = cta.seq_len - cta.q_len + cta.qb * P.block_q;
    const int last_pos = cta.seq_len - cta.q_len + min(cta.qb * P.block_q + P.block_q, cta.q_len) - 1;
    cta.hi = P.causal ? last_pos + 1 : cta.seq_len;
    cta.lo = max(first_pos - P.window + 1, 0) / BLOCK_N * BLOCK_N;
    cta.all_lo = last_pos - P.window + 1;
    cta.all_hi = P.causal ? first_pos + 1 : cta.seq_len;
    cta.ntiles = cta.hi > cta.lo ? (cta.hi - cta.lo + BLOCK_N - 1) / BLOCK_N : 0;
    return true;
}

// A CTA's walk over its items: k, the item's geometry, and whether there is one (the items without rows
// skipped). Producer and consumers walk alike. `then` is the CTA's item k + 1, read when item k is found: a
// schedule's load then runs during item k rather than ahead of the next item's geometry.
struct Work {
    int k;
    Cta cta;
    bool ok;
    int then;
};
__device__ __forceinline__ Work walk_from(const Params& P, int k, int item) {
    Work w;
    for (w.k = k;; item = cta_item(P, ++w.k)) {
        w.ok = cta_of(P, item, w.cta);
        if (w.ok || item >= P.num_items) break;
    }
    w.then = cta_item(P, w.k + 1);
    return w;
}
__device__ __forceinline__ Work first_work(const Params& P) { return walk_from(P, 0, cta_item(P, 0)); }
__device__ __forceinline__ Work next_work(const Params& P, const Work& w) { return walk_from(P, w.k + 1, w.then); }

// The block id of key n of the CTA's sequence, or -1 past the CTA's keys (the table is not read there).
__device__ __forceinline__ int block_id(const Params& P, const int* bt_row, const Cta& cta, int n) {
    return n < cta.hi ? __ldg(bt_row + (P.page_shift >= 0 ? n >> P.page_shift : n / P.page)) : -1;
}
__device__ __forceinline__ int in_page(const Params& P, int n) {
    return P.page_shift >= 0 ? n & (P.page - 1) : n % P.page;
}

// Tile t of the item (the ring's tile g: stage g % STAGES): its K and V codes by one warp (lane 0..31),
// landing on sh.loaded[stage] (its phase needs one arrival under TMA, 32 under cp.async), with the valid
// flags of its keys.
//   TMA: lane l flags keys 4 l .. 4 l + 3, then lanes issue one K and one V box per page (per 128 keys
//     of a longer page); a box whose block id is outside the cache (or past the CTA's keys) gets the
//     block coordinate num_blocks, outside the tensor map: TMA zero-fills it.
//   cp.async: lane (ch, krow0) copies chunk ch of keys krow0 + 4 i (zero-filled when invalid).
// TMA: what a lane reads of the block table for tile t, before its stage is free (so that those reads are not
// between the stage's release and the loads): the valid flags of keys 4 lane .. 4 lane + 3 and the block id of
// the lane's first box.
struct TileIds {
    u32 flags;
    int box_blk;
};
__device__ __forceinline__ TileIds tile_ids(const Params& P, const Cta& cta, const int* bt_row, int t, int lane) {
    const int n0 = cta.lo + t * BLOCK_N;
    TileIds ids{0u, lane * P.box_rows < BLOCK_N ? block_id(P, bt_row, cta, n0 + lane * P.box_rows) : -1};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int blk = block_id(P, bt_row, cta, n0 + 4 * lane + j);
        ids.flags |= (u32)(blk >= 0 && blk < P.num_blocks) << (8 * j);
    }
    return ids;
}

__device__ __forceinline__ void load_tile(Smem& sh, const Params& P, const Cta& cta, const int* bt_row, int t,
                                          int g, int lane, const TileIds& ids) {
    const int s = g % STAGES, n0 = cta.lo + t * BLOCK_N;
    if constexpr (TMA) {
        reinterpret_cast<u32*>(sh.valid[s])[lane] = ids.flags;
        __syncwarp();
        if (lane == 0) mbar_arrive_expect_tx(&sh.loaded[s], 2 * TILE_BYTES);  // (releases the warp's flags)
        tma_load_boxes(smem_addr(sh.k[s]), smem_addr(sh.vr[s]), &P.tmap_k, &P.tmap_v, &sh.loaded[s], n0, BLOCK_N,
                       P.box_rows, P.head_inner, cta.kvh, P.num_blocks, lane,
                       [&](int n) { return n == n0 + lane * P.box_rows ? ids.box_blk : block_id(P, bt_row, cta, n); },
                       [&](int n) { return in_page(P, n); });
    } else {
        const int ch = lane & 7, krow0 = lane >> 3;  // lane: chunk ch of keys krow0 + 4 i
        const u8* kbase = P.kc + cta.kvh * P.stride_kh + 16 * ch;
        const u8* vbase = P.vc + cta.kvh * P.stride_vh + 16 * ch;
#pragma unroll 1
        for (int i = 0; i < BLOCK_N / 4; ++i) {
            const int krow = krow0 + 4 * i, n = n0 + krow, blk = block_id(P, bt_row, cta, n), r = in_page(P, n);
            const bool ok = blk >= 0 && blk < P.num_blocks;
            const i64 b = ok ? blk : 0;
            cp_async16(smem_addr(sh.k[s]) + sw128(krow, 16 * ch), kbase + b * P.stride_kb + r * P.stride_kt, ok);
            cp_async16(smem_addr(sh.vr[s]) + sw128(krow, 16 * ch), vbase + b * P.stride_vb + r * P.stride_vt, ok);
            if (ch == 0) sh.valid[s][krow] = ok ? 1 : 0;
        }
        cp_async_mbar_arrive(&sh.loaded[s]);
        mbar_arrive(&sh.loaded[s]);  // (releases the thread's flags)
    }
}

// The producer warpgroup (threads 0..127): the CTA's items' tiles, one after the other, go through the ring
// as its tiles g = 0, 1, ...; warp w takes g = w, w + 4, ... (stage g % STAGES = w): once the stage is free it
// loads the tile, waits for it to land, transposes its V and hands V^T over on vready. Four warps in
// parallel: one warp's TMA issue (a box per page: address work, uniform registers) and transpose take
// about as long as four consumer phases. A persistent CTA's producer runs into its next item while the
// consumers finish the last one.
__device__ void produce(Smem& sh, const Params& P) {
    static_assert(STAGES == 4, "a producer warp per stage");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g0 = 0;  // the ring's tiles before the item
    for (Work w = first_work(P); w.ok; w = next_work(P, w)) {
        const Cta& cta = w.cta;
        const int* bt_row = P.bt + (i64)cta.seq * P.stride_bt;
        for (int t = (warp - g0) & 3; t < cta.ntiles; t += 4) {
            const int g = g0 + t, s = g % STAGES, tail = cta.hi - (cta.lo + t * BLOCK_N);
            const TileIds ids = TMA ? tile_ids(P, cta, bt_row, t, lane) : TileIds{};
            mbar_wait(&sh.empty[s], ((g / STAGES) & 1) ^ 1);
            load_tile(sh, P, cta, bt_row, t, g, lane, ids);
            mbar_wait(&sh.loaded[s], (g / STAGES) & 1);
            const u8* vr = sh.vr[s];
            u8* vt = sh.vt[s];
            tail >= BLOCK_N ? transpose_v<false, 1>(vr, vt, lane, tail) : transpose_v<true, 1>(vr, vt, lane, tail);
            fence_async_shared();
            mbar_arrive(&sh.vready[s]);
        }
        g0 += cta.ntiles;
    }
}

// A consumer thread's online-softmax state for its two rows (h = 0, 1: rows r and r + 8 of its warp).
struct Softmax {
    float m[2], l[2];  // running maximum (an integer or -inf) and the partial row sum of this thread's keys
    float f[2];        // the rows' logit factors (float32 paths)
    int row[2];        // the rows (their float64 factors in Smem::row_f: the saturating path reads them there)
    int pos[2];
    bool rv[2];
    bool started;      // a tile has been through the softmax (uniform over the warpgroup)
};

// How a consumer warpgroup forms logits (the same for all its rows, from their factors f):
constexpr int LOGIT_SATURATED = 0;  // some f outside (2^-96, 2^96): q8 . k8 times the float64 factor, saturated
constexpr int LOGIT_PRODUCT = 1;    // every f in (2^-96, 2^96): the float32 product, rounded, minus the maximum
constexpr int LOGIT_FMA = 2;        // every f in (2^-96, 2^-5]: one FMA, q8 . k8 f - m
// Why LOGIT_FMA is the definition's logit within the same error: |q8 . k8| < 2^24.62 (128 products of at
// most 448^2), so |q8 . k8 f| < 2^19.62. The FMA rounds q8 . k8 f - m once, the product path twice (the
// product, then the difference), so the FMA's logit is at least as close to the exact one; the running
// maximum is the same rounded product as on the product path, so a p may exceed 1 by at most 2^(ulp/2)
// of a logit below 2^20 (2^(2^-4): p8 still rounds to at most 1, or saturates as p = 1 would). Above
// 2^24 half an ulp is at least 1 and p could leave [2^-1, 1] for the row's largest logit (at k_scale 1e31
// it made every p 0): hence the bound on f.

// FA4's conditional rescaling with the definition's integer maxima (an interior tile, FMA logits, after the
// warpgroup's first tile; docs/fp8_attention.md says why the mode's tolerance still holds). p = 2^(logit -
// m) against each row's running maximum m as it stands, rounded to e4m3 and packed into pa; S stays in sa.
// The test needs no row maxima: a thread sums each row's p in four chains of 8 keys, and a chain's sum
// (float32, of values >= 0) is at least each of its p. If every chain of every valid row of the warp is at
// most 2^P.lazy_t (and the row's m is finite), so is every p: p / prob_scale never saturates (2^lazy_t <= 448
// prob_scale), m stays and l adds the tile's p. Else (NaN too) the warp returns false and takes the exact
// path, which recomputes everything from sa. So m stays where a tile's maximum is up to about m + lazy_t - 3
// (8 keys of p <= 2^(lazy_t - 3)), never beyond m + lazy_t (the rule of fp8kv's tolerance argument); the
// row maxima this no longer finds were 64 FMNMX a tile and thread. SCALE_P: P.scale_p.
template <bool SCALE_P>
__device__ __forceinline__ bool lazy_softmax(const Params& P, Softmax& sm, const float (&sa)[64], u32 (&pa)[4][4]) {
    float lsum[2][4] = {}, msafe[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) msafe[h] = sm.m[h] == NEG_INF ? 0.0f : sm.m[h];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // (pack_p8's order: each A word from its four accumulator values)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const int j = 4 * kk + 2 * (w >> 1), e = 2 * (w & 1);
            const int idx[4] = {4 * j + e, 4 * j + e + 1, 4 * j + 4 + e, 4 * j + 4 + e + 1};
            float x[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = idx[q], h = (i >> 1) & 1, k = (i & 1) + 2 * ((i >> 2) & 1);
                const float p = exp2_approx(__fmaf_rn(sa[i], sm.f[h], -msafe[h]));
                lsum[h][k] += p;
                x[q] = SCALE_P ? p * P.inv_prob_scale : p;
            }
            pa[kk][w] = e4m3x4(x[0], x[1], x[2], x[3]);
        }
    const float bound = __int_as_float((127 + (int)P.lazy_t) << 23);  // 2^lazy_t (lazy_t in [0, 8])
    bool jump = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool within = lsum[h][0] <= bound && lsum[h][1] <= bound && lsum[h][2] <= bound && lsum[h][3] <= bound;
        jump |= sm.rv[h] && (!within || sm.m[h] == NEG_INF);
    }
    if (__any_sync(0xFFFFFFFFu, jump)) return false;  // (rare after the first tiles)
#pragma unroll
    for (int h = 0; h < 2; ++h) sm.l[h] += (lsum[h][0] + lsum[h][1]) + (lsum[h][2] + lsum[h][3]);
    return true;
}

// Tile at n0 in stage s (all_valid: every key's flag set): mask edge tiles, logits, the integer running
// maximum, p = 2^(logit - m) (l += p), O's factor alpha = 2^(m_old - m_new) (1 where the maximum stayed; the
// caller rescales O once the previous tile's O += p8 v8 is done), and p8 = e4m3(p / prob_scale) as wgmma A
// fragments (pack_p8) into pb. MODE: the warpgroup's logit path (LOGIT_*). Returns whether O
// may need rescaling (false: the conditional rescaling kept every maximum; uniform over the warp).
template <int MODE>
__device__ __forceinline__ bool softmax_tile(const Smem& sh, const Params& P, Softmax& sm, int s, int n0,
                                             bool all_valid, const Cta& cta, int c, float (&sa)[64],
                                             u32 (&pb)[4][4], float (&alpha)[2]) {
    const bool interior = all_valid && n0 >= cta.all_lo && n0 + BLOCK_N <= cta.all_hi;  // (uniform)
    const bool started = sm.started;
    sm.started = true;
    if constexpr (LAZY && MODE == LOGIT_FMA) {
        if (interior && started && (P.scale_p ? lazy_softmax<true>(P, sm, sa, pb) : lazy_softmax<false>(P, sm, sa, pb)))
            return false;
    }
    if (!interior) {  // an edge tile: mask
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = 8 * j + 2 * c + (e & 1), n = n0 + key, h = e >> 1;
                const bool vis = sh.valid[s][key] && sm.rv[h] && n > sm.pos[h] - P.window &&
                                 (!P.causal || n <= sm.pos[h]);
                sa[4 * j + e] = vis ? sa[4 * j + e] : NEG_INF;
            }
    }
    constexpr bool FAST = MODE != LOGIT_SATURATED;
    if constexpr (!FAST) {  // logits = q8 . k8 * F, saturated (F of any magnitude), in place
        const double F[2] = {sh.row_f[sm.row[0]], sh.row_f[sm.row[1]]};
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            const float v = sa[i];
            sa[i] = v == NEG_INF ? v : (float)fmin(fmax((double)v * F[(i >> 1) & 1], -3.4028234663852886e38),
                                                     3.4028234663852886e38);
        }
    }
    float mx[2], msafe[2];
    row_max(sa, mx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float mnew = fmaxf(sm.m[h], ceilf(FAST ? __fmul_rn(mx[h], sm.f[h]) : mx[h]));  // an integer (or -inf)
        msafe[h] = mnew == NEG_INF ? 0.0f : mnew;
        alpha[h] = pow2_int(sm.m[h] - msafe[h]);  // exact (0 from -inf)
        sm.m[h] = mnew;
        sm.l[h] *= alpha[h];
    }
    float lsum[2][4] = {};  // (four chains a row)
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int h = (i >> 1) & 1;
        // (LOGIT_PRODUCT: the rounded product minus the maximum, where an FMA could keep the product's
        // rounding error of up to half an ulp of a logit: 2^87 near 1e34, which made p 0 or inf)
        const float x = exp2_approx(MODE == LOGIT_FMA       ? __fmaf_rn(sa[i], sm.f[h], -msafe[h])
                                    : MODE == LOGIT_PRODUCT ? __fsub_rn(__fmul_rn(sa[i], sm.f[h]), msafe[h])
                                                            : sa[i] - msafe[h]);
        lsum[h][(i & 1) + 2 * ((i >> 2) & 1)] += x;
        sa[i] = x;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) sm.l[h] += (lsum[h][0] + lsum[h][1]) + (lsum[h][2] + lsum[h][3]);
    if (P.scale_p) {
#pragma unroll
        for (int i = 0; i < 64; ++i) sa[i] *= P.inv_prob_scale;
    }
    pack_p8(sa, pb);
    return true;
}

// Query half-row `row` (of the item's 128), half `half` (64 dims): where it starts in the query, whether it
// is a row of the item, its query head
struct QRow {
    i64 base;
    bool valid;
    int qh;
};
__device__ __forceinline__ QRow q_row(const Params& P, const Cta& cta, int row, int half) {
    const int qi = row / P.group, tin = cta.qb * P.block_q + qi;
    QRow q;
    q.valid = qi < P.block_q && tin < cta.q_len;
    q.qh = cta.kvh * P.group + row % P.group;
    q.base = ((i64)(cta.q_start + (q.valid ? tin : 0)) * P.HQ + q.qh) * D + 64 * half;
    return q;
}

// e4m3(div(x)) of a thread's 64 query values into its half-row `half` of K-major row `ql` of q8
template <class Div>
__device__ __forceinline__ void store_q8(u8* qdst, const float (&x)[64], int ql, int half, Div&& div) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float* v = x + 16 * j + 4 * k;
            w[k] = e4m3x4(div(v[0]), div(v[1]), div(v[2]), div(v[3]));
        }
        *reinterpret_cast<uint4*>(qdst + kmajor(ql, 64 * half + 16 * j, 1024)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// q8 = e4m3(q / q_scale) of the item's rows 64 cw .. 64 cw + 63 into shared memory with their float64 logit
// factors (row_f): thread ct quantizes half (64 dims) of row ct / 2 from its fetched words `qw`. Returns
// the warpgroup's logit path (LOGIT_*, from every row's factor; a named barrier of the warpgroup).
__device__ __forceinline__ int quantize_q(Smem& sh, const Params& P, const Cta& cta, int cw, int ct,
                                          const QWords& qw, float k_scale) {
    const int ql = ct >> 1, half = ct & 1, row = 64 * cw + ql;
    const QRow qr = q_row(P, cta, row, half);
    const bool valid = qr.valid;
    const int qh = qr.qh;
    float x[64];
    q64_floats(qw, x);
    float qs;
    if (P.q_dynamic) {  // max(amax|q| / 448, 2^-126), NaN as 0 and inf as the largest float
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < 64; ++i) a = fmaxf(a, amax_term(x[i]));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        qs = dynamic_scale(a, E4M3_MAX);
    } else {
        qs = P.qs[cta.kvh * P.stride_qs_kv + qh * P.stride_qs_q];
    }
    u8* qdst = sh.q + 8192 * cw;
    if (qs >= 0x1p-80f && qs <= 0x1p80f) {
        const float rs = __frcp_rn(qs);
        store_q8(qdst, x, ql, half, [&](float v) { return div_by_scale(v, qs, rs); });
    } else {
        const double rq = 1.0 / (double)qs;
        store_q8(qdst, x, ql, half, [&](float v) { return div_by_scale(v, rq); });
    }
    const double F = (double)qs * (double)k_scale * (double)P.sm_mant * ldexp(1.0, P.sm_exp);
    if (half == 0) sh.row_f[row] = F;
    const bool fast_row = !valid || (F > 0x1p-96 && F < 0x1p96);
    const bool fma_row = !valid || (F > 0x1p-96 && F <= 0x1p-5);
    fence_async_shared();
    const bool fast = named_sync_and(2 + cw, 128, fast_row);  // q8 and row_f written (the warpgroup's rows)
    const bool fma_ok = named_sync_and(2 + cw, 128, fma_row);
    return fma_ok ? LOGIT_FMA : fast ? LOGIT_PRODUCT : LOGIT_SATURATED;
}

// A thread's fetch of its query half-row of item `work` (quantize_q's words; zeros where there is no item:
// qw is written on every path, so it is not live through the tiles)
__device__ __forceinline__ void fetch_q(const Params& P, const Work& work, int cw, int ct, QWords& qw) {
    const QRow qr = q_row(P, work.cta, 64 * cw + (ct >> 1), ct & 1);
    fetch_q64(P.q, qr.base, work.ok && qr.valid, qw);
}

// One item of a consumer warpgroup: its query (fetched into qw), the ring's tiles g0 .. g0 + ntiles - 1, the
// output. Returns the CTA's next item, whose query it fetches into qw (16-bit queries: before the epilogue).
__device__ __forceinline__ Work consume_item(Smem& sh, const Params& P, const Work& work, int cw, int ct, int g0,
                                             QWords& qw) {
    const Cta& cta = work.cta;
    const int warp = ct >> 5, lane = ct & 31, r = lane >> 2, c = lane & 3;
    const float k_scale = P.ks[cta.kvh * P.stride_ksh];
    const float v_scale = __ldg(P.vs + cta.kvh * P.stride_vsh);  // (in flight through the tiles: read in the
    // epilogue, its latency stalled the stores there, 1.4% of the profile's samples)
    const int mode = quantize_q(sh, P, cta, cw, ct, qw, k_scale);

    // the rows this thread holds in the accumulators: 64 cw + 16 warp + r + 8 h
    int pos[2];
    bool rv[2];
    float f[2];
    double F[2];
    i64 orow[2];
    int lse_idx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 64 * cw + 16 * warp + r + 8 * h, tin = cta.qb * P.block_q + row / P.group;
        const QRow qr = q_row(P, cta, row, 0);
        rv[h] = qr.valid;
        pos[h] = cta.seq_len - cta.q_len + tin;
        F[h] = sh.row_f[row];
        f[h] = (float)F[h];
        lse_idx[h] = (cta.q_start + (rv[h] ? tin : 0)) * P.HQ + qr.qh;
        orow[h] = (i64)lse_idx[h] * D;
    }

    Softmax sm{};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sm.m[h] = NEG_INF;
        sm.l[h] = 0.0f;
        sm.f[h] = f[h];
        sm.row[h] = 64 * cw + 16 * warp + r + 8 * h;
        sm.pos[h] = pos[h];
        sm.rv[h] = rv[h];
    }
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float sa[64], alpha[2];
    u32 pa[4][4], pb[4][4];  // p8 of the tile in O += p8 v8, and of the next (the softmax's, while pa is read)
    const u64 dq = desc(smem_addr(sh.q + 8192 * cw), 1024);
    bool all_valid = false;  // tile t's keys all flagged valid (read in wait(t), used by early(t))
    auto stage = [&](int t) { return (int)((unsigned)(g0 + t) % STAGES); };  // (g0 + t >= 0)
    auto issue_s = [&](int t) { issue_qk(sa, dq, desc_sw128(smem_addr(sh.k[stage(t)]))); };
    auto issue_o = [&](int t) { issue_pv(o, pa, desc(smem_addr(sh.vt[stage(t)]), VT_SBO)); };
    const int path = __shfl_sync(0xFFFFFFFFu, mode, 0);  // (uniform: ptxas then branches without votes)
    bool rescale = false;  // the tile's softmax moved some row maximum (early(t) to late(t))
    auto early = [&](int t) {  // tile t's softmax: p8 into pb, O's factor
        fence_acc(sa);
        const int s = stage(t), n0 = cta.lo + t * BLOCK_N;
        if (path == LOGIT_FMA) rescale = softmax_tile<LOGIT_FMA>(sh, P, sm, s, n0, all_valid, cta, c, sa, pb, alpha);
        else if (path == LOGIT_PRODUCT)
            rescale = softmax_tile<LOGIT_PRODUCT>(sh, P, sm, s, n0, all_valid, cta, c, sa, pb, alpha);
        else rescale = softmax_tile<LOGIT_SATURATED>(sh, P, sm, s, n0, all_valid, cta, c, sa, pb, alpha);
    };
    auto late = [&](int t) {  // O += p8(t-1) v(t-1) is done: O's rescaling, p8 of tile t into pa
        fence_acc(o);
        if (t == cta.ntiles) return;
        if (rescale) rescale_rows(o, alpha);  // (the maximum moved: rarely)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int w = 0; w < 4; ++w) pa[kk][w] = pb[kk][w];
    };
    // phase t reads K of tile t and V^T of tile t - 1
    auto wait = [&](int t) {
        const unsigned g = g0 + t;
        if (t < cta.ntiles) {
            mbar_wait(&sh.loaded[g % STAGES], (g / STAGES) & 1);
            all_valid = __all_sync(0xFFFFFFFFu, reinterpret_cast<const u32*>(sh.valid[g % STAGES])[lane] == 0x01010101u);
        }
        if (t >= 1) mbar_wait(&sh.vready[(g - 1) % STAGES], ((g - 1) / STAGES) & 1);
        if constexpr (!TMA) fence_async_shared();  // (K written by cp.async, read by wgmma)
    };
    if constexpr (OVERLAP) {  // tile t's softmax while O += p8(t-1) v(t-1) runs
        consumer_pipeline_overlap<STAGES, PINGPONG>(wait, sh.empty, cta.ntiles, cw, issue_s, issue_o, early, late, g0);
    } else {  // both products, then the softmax
        auto issue = [&](int t) {
            if (t >= 1) issue_o(t - 1);
            if (t < cta.ntiles) issue_s(t);
        };
        auto done = [&](int t) {  // (each starts with its fence_acc)
            if (t < cta.ntiles) early(t);
            late(t);
        };
        consumer_pipeline_waits<STAGES, PINGPONG>(wait, sh.empty, cta.ntiles, cw, issue, done, g0);
    }
    const Work next = next_work(P, work);
    // the next item's query, in flight during the epilogue; float32 queries (64 registers of words) after it:
    // fetched here, with O live, they spilled
    if constexpr (QT != 0) fetch_q(P, next, cw, ct, qw);
    float m[2] = {sm.m[0], sm.m[1]}, l[2] = {sm.l[0], sm.l[1]};

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 1);
        l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 2);
        if (!rv[h]) continue;
        // 1 / l once (correctly rounded), then products: one rounding more than a division per output, inside
        // the tolerance's float32 allowance for the normalisation (the per-element IEEE divisions were 64 a
        // thread at the end of every CTA)
        const float inv_l = __frcp_rn(l[h] > 0.0f ? l[h] : 1.0f);
#pragma unroll
        for (int j = 0; j < 16; ++j)
            store_out2(P.out, orow[h] + 8 * j + 2 * c, ((o[4 * j + 2 * h] * inv_l) * v_scale) * P.prob_scale,
                       ((o[4 * j + 2 * h + 1] * inv_l) * v_scale) * P.prob_scale);
        if (P.write_lse && c == 0)
            P.lse[lse_idx[h]] = l[h] > 0.0f ? (m[h] + log2f(l[h])) * LN2 : NEG_INF;
    }
    if constexpr (QT == 0) fetch_q(P, next, cw, ct, qw);
    return next;
}

// A consumer warpgroup (cw = 0, 1: rows 64 cw .. 64 cw + 63 of each item). A persistent CTA's consumers
// fetch the next item's query before the epilogue of the last, so that its load latency passes during the
// epilogue's stores, while the producer already loads the next item's tiles.
__device__ void consume(Smem& sh, const Params& P, int cw) {
    const int ct = threadIdx.x - 128 * (cw + 1);
    Work work = first_work(P);
    QWords qw;
    fetch_q(P, work, cw, ct, qw);
    for (int g0 = 0; work.ok;) {  // (g0: the ring's tiles before the item)
        const int ntiles = work.cta.ntiles;
        work = consume_item(sh, P, work, cw, ct, g0, qw);
        g0 += ntiles;
    }
}
}  // namespace fp8kv

using namespace fp8kv;

// Work items are (query block, KV head) pairs: grid (num_items) CTAs, one an item, or fewer (persistent:
// each takes items in turn, cta_item); THREADS threads, SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(THREADS, 1) fp8kv_fp8_prefill(const __grid_constant__ Params P) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    trap_unless_smem(SMEM_BYTES);  // (fp8kv_hopper.wgmma.smem_bytes mirrors sizeof(Smem))
    if (smem_addr(smem_raw) & 1023u) __trap();  // (the swizzled tiles need 1024-byte alignment)
    Smem& sh = *reinterpret_cast<Smem*>(smem_raw);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sh.loaded[s], TMA ? 1 : 32);
            mbar_init(&sh.vready[s], 32);
            mbar_init(&sh.empty[s], 256);
        }
        fence_mbarrier_init();  // (visible to the TMA unit)
    }
    __syncthreads();
    // Registers: 168 per thread at launch (384 threads); the producer gives most of its share to the
    // consumers, whose phases keep S, O and p8 live at once (else ptxas serializes the wgmma).
    if (threadIdx.x < 128) {
        producer_registers();
        produce(sh, P);
    } else {
        consumer_registers();
        consume(sh, P, __shfl_sync(0xFFFFFFFFu, threadIdx.x >= 256 ? 1 : 0, 0));  // (warp-uniform, as ptxas then sees)
    }
}

// The layout test (tests/test_hopper_gpu.py): one warpgroup runs the kernel's shared-memory layouts,
// V transpose and both wgmma forms on A [64 x 128], B [128 x 128], V [128 x 128] (e4m3 bytes):
// S = A B^T (float32), P8 = e4m3(S * p_scale) through the A-register packing, O = P8 V.
struct LayoutTestArgs {
    const u8 *a, *b, *v;
    float* s;
    u8* p8;
    float* o;
    float p_scale;
};

extern "C" __global__ void __launch_bounds__(128, 1) fp8kv_wgmma_layout_test(const LayoutTestArgs args) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    trap_unless_smem(SMEM_BYTES);  // (fp8kv_hopper.wgmma.smem_bytes mirrors sizeof(Smem))
    if (smem_addr(smem_raw) & 1023u) __trap();
    Smem& sh = *reinterpret_cast<Smem*>(smem_raw);
    const u8 *A = args.a, *B = args.b, *V = args.v;
    float *S_out = args.s, *O_out = args.o;
    u8* P_out = args.p8;
    const float p_scale = args.p_scale;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, c = lane & 3;
    for (int i = tid; i < 64 * 8; i += 128)
        *reinterpret_cast<uint4*>(sh.q + kmajor(i >> 3, 16 * (i & 7), 1024)) = reinterpret_cast<const uint4*>(A)[i];
    for (int i = tid; i < 128 * 8; i += 128) {
        *reinterpret_cast<uint4*>(sh.k[0] + sw128(i >> 3, 16 * (i & 7))) = reinterpret_cast<const uint4*>(B)[i];
        *reinterpret_cast<uint4*>(sh.vr[0] + sw128(i >> 3, 16 * (i & 7))) = reinterpret_cast<const uint4*>(V)[i];
    }
    __syncthreads();
    transpose_v<false, 4>(sh.vr[0], sh.vt[0], tid, BLOCK_N);
    fence_async_shared();
    __syncthreads();
    float sa[64], o[64];
    wgmma_fence();
    issue_qk(sa, desc(smem_addr(sh.q), 1024), desc_sw128(smem_addr(sh.k[0])));
    wgmma_commit();
    wgmma_wait0();
    fence_acc(sa);
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int row = 16 * warp + r + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * c + (i & 1);
        S_out[row * 128 + col] = sa[i];
        sa[i] *= p_scale;
        P_out[row * 128 + col] = (u8)(e4m3x2(sa[i], 0.0f) & 0xFFu);
        o[i] = 0.0f;
    }
    u32 pa[4][4];
    pack_p8(sa, pa);
    wgmma_fence();
    issue_pv(o, pa, desc(smem_addr(sh.vt[0]), VT_SBO));
    wgmma_commit();
    wgmma_wait0();
    fence_acc(o);
    store_acc(O_out, 128, o, tid);
}
