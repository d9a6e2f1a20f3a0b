// fp8kv_cuda: paged attention on tensor cores (sm80+: mma.sync m16n8k16, movmatrix), for float16
// and bfloat16 queries, any scale granularity, head sizes 64, 128 and 256.
//
// Grid (T * H * head_chunks, 1, num_splits) (decode_cta), KNT = 32 * KWARPS threads (FP8KV_MMA_WARPS warps). A CTA
// owns one query token, one KV head, up to 8 of its query heads (GQA packing) and the keys of
// split z. Each warp walks its own steps of 16 * NSUB keys (warp w takes steps w, w + KWARPS, ...)
// with its own online softmax.
// Each warp copies its steps into its own part of a shared-memory ring with cp.async (STAGES - 1
// steps in flight): 8 lanes a whole 128-byte line of K or V rows, so that every copy instruction
// reads whole lines (a copy of the fragments' own chunks read half lines of K and ran 7-13% below
// this at every decode shape on the H100, with the products and softmax left out);
// the lanes then read their fragments back (swz: conflict-free both ways) after a __syncwarp, the
// loop's only synchronization. The warps' states are merged once at the end.
//
// Per 16-key sub-tile, in the transposed orientation (keys and dims are rows, heads columns):
//   S^T[16 keys x 8 heads] = K[16 x D] . Q^T[D x 8]:  A = K (converted FP8), B = Q (registers);
//   O^T[D x 8 heads]     += V^T[D x 16 keys] . P^T:   A = V^T (converted FP8), B = P^T (movmatrix).
// The k index of an mma may be permuted freely when both operands agree, so each thread reads
// whole 16-byte chunks: for K, lane (g = lane / 4, c = lane % 4) those at 64 i + 16 c of keys g
// and g + 8; for V, those at 128 i + 16 g of keys 2c, 2c + 1, 2c + 8, 2c + 9 of the sub-tile,
// paired byte by byte with one PRMT (k_dim, v_dim).
//
// Exactness (the same numbers as attention.cu, within tolerance.py's bound):
//   * FP8 -> 16-bit by bit operations: the code's sign and magnitude bits placed under the 16-bit
//     format's exponent (exact: every FP8 value of every format is a float16 and a bfloat16), then
//     one multiplication by the power of two 2^(bias16 - bias8), so that no subnormal operand
//     reaches a tensor core; on sm89+ the OCP formats go through cvt.rn.f16x2.{e4m3x2,e5m2x2}
//     (exact for every code) where the operand is float16. Codes the bit path mishandles (NaN in
//     every format but e5m2 -> float16, e5m2's inf -> bfloat16, e5m2fnuz's top binade -> float16)
//     are detected per word; a step that holds one takes the software decoder of codec.cuh
//     instead (for the OCP formats never with a cache written by fp8kv from finite values).
//   * K is converted to the query's dtype (products exact, float32 accumulation); V to float16;
//     the weights P (float32, <= 1) enter p @ v as one float16 where the row sees at least
//     FP8KV_FULL_P_KEYS keys (tolerance.FULL_P_KEYS: its 2^-12 error is then within the float32
//     accumulation term of the bound), otherwise as two float16 halves, hi + lo (22 bits).
//   * Queries above 2^100 are scaled down by a power of two first; the logit factor
//     k_scale * softmax_scale * log2(e) stays two float32 factors (scale_factors); base-2 logits
//     saturate at +-FLOAT32_MAX; rows that see no key get 0 and lse -inf.
//
// The FP8 attention mode (FP8KV_FP8_MODE, docs/fp8_attention.md; fp8kv_hopper's decode): an e4m3fn
// cache with static scales, sm89+. Each query head is quantized as the cache is, q8 = e4m3(q /
// q_scale) (IEEE division, cvt.rn.satfinite; q_scale per tensor, KV head, query head, or dynamic
// max(amax|q| / 448, 2^-126)), and enters the products as float16 (exact), so q8 . k8 is exact
// products with float32 accumulation; the logit factor q_scale k_scale softmax_scale log2(e) per
// head as two float32 factors; the running maxima are integers (ceil), so every rescaling is an
// exact power of two (pow2_int); l sums the unrounded p; P enters p @ v as e4m3(p / prob_scale)
// (multiplied by 1 / prob_scale, as the other FP8-mode kernels), exact in float16; the output is
// acc / l * v_scale * prob_scale (splits: acc * prob_scale to the merge).
//
// Memory safety without host checks: as attention.cu (query_start_loc clamped, seq_lens clamped
// to the block table's row, block ids outside [0, num_blocks) never loaded, tokens outside every
// sequence left alone). The launcher requires 16-byte aligned K/V rows (VEC 16).
//
// Macros: FP8KV_QT (1 float16, 2 bfloat16), FP8KV_D (64, 128 or 256), FP8KV_TOKEN_SCALES, FP8KV_STAGES, FP8KV_NSUB,
// FP8KV_FULL_P_KEYS, FP8KV_FP8_MODE,
// FP8KV_MMA_WARPS, FP8KV_SM_WARPS_NATIVE/BITS (fp8kv_cuda.variants), and the format's.
#include "mma_common.cuh"

namespace fp8kv {

constexpr int D = FP8KV_D;
#ifndef FP8KV_NSUB
#define FP8KV_NSUB (FP8KV_D > 128 ? 1 : 2)
#endif
constexpr int NSUB = FP8KV_NSUB;            // 16-key sub-tiles per warp step (1 or 2)
constexpr int STEP = 16 * NSUB;             // keys per warp step
constexpr int KW = D / 16;                  // K words (4 bytes) per thread and key row = k steps of QK
constexpr int VW = D / 32;                  // V words per thread and key (two m-tiles of p @ v each)
constexpr int MT = D / 16;                  // m-tiles of p @ v (16 dims each)
constexpr int HEADS = 8;                    // query heads per CTA (the mma's n)
#ifndef FP8KV_MMA_WARPS
#define FP8KV_MMA_WARPS 4
#endif
constexpr int KWARPS = FP8KV_MMA_WARPS;     // warps per CTA, each on its own steps of keys
constexpr int KNT = 32 * KWARPS;            // threads per CTA (the merge kernel keeps NT)
#ifndef FP8KV_STAGES
#define FP8KV_STAGES 3                      // cp.async ring depth per thread (steps in flight + 1)
#endif
constexpr int STAGES = FP8KV_STAGES;
constexpr int KCH = D / 64;                 // 16-byte K chunks per thread and key row
constexpr int VBYTES = D / 8;               // V bytes per thread and key
constexpr int VCH = VBYTES >= 16 ? VBYTES / 16 : 1;  // V chunks per thread and key (8 bytes at D = 64)
constexpr int VBYTES_PER_CHUNK = VBYTES >= 16 ? 16 : VBYTES;
constexpr int TSC = TOKEN_SCALES ? 1 : 0;   // token_head: one slot per lane and sub-tile for its keys' scales
constexpr int CPR = D / 16;                 // 16-byte chunks of a key's K (V) row
constexpr int TILE = 16 * CPR;              // ring slots (16 bytes) of a sub-tile's K (V) rows
constexpr int CPS = TILE / 32;              // a lane's copies per sub-tile and tensor
constexpr int WARP_STAGE = NSUB * (2 * TILE + 32 * TSC);  // ring slots of a warp and stage
constexpr int LIVE_BITS = 2 * NSUB;         // visible-key bits per step
#ifndef FP8KV_FP8_MODE
#define FP8KV_FP8_MODE 0
#endif
constexpr bool FP8_MODE = FP8KV_FP8_MODE != 0;  // the FP8 attention mode (see the top of this file)

// The dims a thread's words hold. K: lane c holds, per key row, the 16-byte chunks at 64 i + 16 c
// (4 lanes cover whole 32-byte sectors per copy); its word ks (= k step ks of QK) is dims
// k_dim(c, ks) + {0..3}. V: lane g holds the chunks at 128 i + 16 g (8 bytes at 8 g when D = 64);
// its word w is dims v_dim(g, w) + {0..3}.
__device__ __forceinline__ int k_dim(int c, int ks) { return 64 * (ks >> 2) + 16 * c + 4 * (ks & 3); }
__device__ __forceinline__ int v_dim(int g, int w) { return 128 * (w >> 2) + VBYTES_PER_CHUNK * g + 4 * (w & 3); }
#ifndef FP8KV_SM_WARPS_NATIVE  // warps per SM the registers are budgeted for (fp8kv_cuda.variants.MMA_TILES)
#define FP8KV_SM_WARPS_NATIVE 8
#define FP8KV_SM_WARPS_BITS 8
#endif
#define FP8KV_MIN_CTAS ((NATIVE ? FP8KV_SM_WARPS_NATIVE : FP8KV_SM_WARPS_BITS) / FP8KV_MMA_WARPS > 0 \
                        ? (NATIVE ? FP8KV_SM_WARPS_NATIVE : FP8KV_SM_WARPS_BITS) / FP8KV_MMA_WARPS : 1)

static_assert(QT == 1 || QT == 2, "attention_mma.cu: float16 or bfloat16 queries");
static_assert(D == 64 || D == 128 || D == 256, "attention_mma.cu: D is 64, 128 or 256");
static_assert(NSUB == 1 || (NSUB == 2 && D <= 128), "attention_mma.cu: 1 or 2 sub-tiles a step (1 at D = 256)");
static_assert(!FP8_MODE || (NATIVE && MANT == 3 && !FNUZ && !TOKEN_SCALES),
              "attention_mma.cu: the FP8 mode is for e4m3fn caches with static scales on sm89+");
#if FP8KV_FP8_MODE  // the mode's arguments (fp8kv_cuda.attention.Fp8Mode)
#define FP8KV_FP8_PARAMS , const float* __restrict__ q_scale, int qs_kv, int qs_q, int q_dynamic, float prob_scale, \
                           float inv_prob_scale
#else
#define FP8KV_FP8_PARAMS
#endif

struct MmaShared {  // the epilogue's view of the ring (the loop is over by then)
    float o[KWARPS][HEADS][D];  // each warp's unnormalised output
    float m[KWARPS][HEADS], l[KWARPS][HEADS], r[KWARPS][HEADS];
    float coef[KWARPS][HEADS];  // each warp's weight in a head's output (the row's own maximum)
    float head_m[HEADS], head_l[HEADS], head_a[HEADS];  // per head: maximum, normaliser, A (token_head)
    float head_inv[HEADS];      // per head: 1 / normaliser (unsplit rows)
};
// Where dim d of head hd sits in its row of MmaShared::o: 4-dim groups XOR-swizzled by the head's pair
// (hd / 2), so that the warps' 16-byte stores of their fragments (lane (g, c): dims v_dim(g, w) + 0..3 of
// heads 2c, 2c + 1) hit distinct banks, and the epilogue's reads of consecutive dims stay conflict-free.
__device__ __forceinline__ int o_col(int hd, int d) { return ((((d >> 2) ^ (hd >> 1)) & 3) | ((d >> 2) & ~3)) << 2 | (d & 3); }
constexpr int SMEM_BYTES = (int)sizeof(uint4) * STAGES * KWARPS * WARP_STAGE > (int)sizeof(MmaShared)
                               ? (int)sizeof(uint4) * STAGES * KWARPS * WARP_STAGE : (int)sizeof(MmaShared);

// Where keys' K and V rows start (byte offsets, this thread's part included), or -1 when masked.
// Key positions are int32 (< seq_len <= INT32_MAX).
struct KeyRows {
    const int* bt_row;
    int kbeg, kend, block_size, num_blocks, bs_shift;  // bs_shift: log2(block_size), or -1
    i64 k_sb, k_st, v_sb, v_st, k0, v0;                 // k0/v0: head offset + this lane's chunk (copy_key)
    i64 ks_sb, ks_st, ks0, vs_sb, vs_st, vs0;           // token_head scales: strides, head offset
    const float* k_scale;
    const float* v_scale;
    bool fast;  // block_size % 16 == 0 (a 16-aligned sub-tile lies in one block), at least one block,
                // and every offset inside a block (head and chunk included) below 2^31: CopyPlan

    __device__ __forceinline__ int page_of(int n) const { return bs_shift >= 0 ? n >> bs_shift : n / block_size; }

    // Key n's row offsets, and its block and slot in the block (blk -1 when masked).
    __device__ __forceinline__ void locate(int n, i64& rk, i64& rv, int& blk, i64& tib) const {
        rk = rv = -1;
        blk = -1;
        tib = 0;
        if (n < kbeg || n >= kend) return;
        const int page = page_of(n);
        const int b = bt_row[page];
        if (b < 0 || b >= num_blocks) return;
        blk = b;
        tib = n - page * block_size;
        rk = (i64)blk * k_sb + tib * k_st + k0;
        rv = (i64)blk * v_sb + tib * v_st + v0;
    }
};

// The ring: a warp's part of a stage is WARP_STAGE 16-byte slots: per sub-tile u, its keys' K rows
// (TILE slots), their V rows (TILE), then (token_head) a slot per lane for its keys' scales. Chunk q
// (bytes 16q..16q+15) of key n's row sits at slot (n CPR + q) ^ swz(n) of the tile: the XOR stays in
// the slot's 128-byte line and spreads the chunks that one quarter-warp reads over distinct banks, for
// the copies (copy_key, copy_slot: 8 lanes a line) and for the fragment reads (StepView) alike. Stage s
// starts stage_slots(s) slots into the ring (every warp's part of stage 0 comes first).
__device__ __forceinline__ int stage_slots(int stage) { return stage * KWARPS * WARP_STAGE; }
__device__ __forceinline__ int swz(int n) { return (n & 6) ^ (CPR >= 8 ? (n & 1) << 2 : 0); }

// Copy m (0..CPS-1) of lane `lane` of a tile: chunk lane % CPR of key lane / CPR + m (32 / CPR) (ring
// slot (lane + 32 m) ^ swz(key)).
__device__ __forceinline__ int copy_key(int lane, int m) { return lane / CPR + m * (32 / CPR); }
__device__ __forceinline__ int copy_slot(int lane, int m) { return (lane + 32 * m) ^ swz(copy_key(lane, m)); }

// One warp step in the ring, read a 16-byte chunk at a time where it is used (the words of a
// whole step never live in registers at once).
struct StepView {
    const uint4* base;  // the warp's part of the stage
    int kx, vx;         // this lane's first K / V slot in a tile (frag_slots)
    u32 bits;           // bit 2u + r: key g + 8r of sub-tile u visible

    // K of key g + 8r, chunk 4i + c: words 4i..4i+3 (= k steps 4i..4i+3)
    __device__ __forceinline__ uint4 k(int u, int r, int i) const {
        return base[u * 2 * TILE + 8 * r * CPR + 8 * (i >> 1) + (kx ^ (4 * (i & 1)))];
    }
    // V of key 2c + e + 8h (r = e + 2h), chunk 8i + g: words 4i..4i+3 (D = 64: 2 words, bytes 8g..8g+7)
    __device__ __forceinline__ uint4 v(int u, int r, int i) const {
        const int e = r & 1, h = r >> 1;
        const int slot = u * 2 * TILE + TILE + (vx ^ (4 * e)) + (CPR >= 8 ? e * CPR : 0) + 8 * h * CPR + 8 * i;
        if constexpr (CPR >= 8) {
            return base[slot];
        } else {
            const uint2 x = reinterpret_cast<const uint2*>(base + slot)[(threadIdx.x >> 2) & 1];
            return make_uint4(x.x, x.y, 0u, 0u);
        }
    }
    __device__ __forceinline__ bool live(int u, int r) const { return (bits >> (2 * u + r)) & 1u; }
    // token_head: [k_scale, k_scale, v_scale, v_scale] of keys g and g + 8 (as float bits)
    __device__ __forceinline__ uint4 scales(int u) const { return base[NSUB * 2 * TILE + 32 * u + (threadIdx.x & 31)]; }
};

// StepView's kx and vx of lane (g, c): the slots of (key g, chunk c) and (key 2c, chunk g; D = 64:
// the chunk holding bytes 8g..), from which its other chunks are constant offsets and XORs.
__device__ __forceinline__ void frag_slots(int g, int c, int& kx, int& vx) {
    kx = (g * CPR + c) ^ swz(g);
    vx = 2 * c * CPR + ((CPR >= 8 ? g : g >> 1) ^ (2 * c & 6));
}

// cp.async of a 16-byte K/V chunk; rows of at least 128 bytes ask L2 to fetch whole 128-byte lines at once
// (2-4% faster on the H100 when the two halves of a K row came from different copy instructions;
// with whole-line copies it is neutral, 0.998-1.002x; 256-byte prefetch, which also takes the
// neighbouring head's row, was slower).
__device__ __forceinline__ void copy_kv(u32 dst, const u8* src, bool live) {
    if constexpr (D >= 128 && SM80) {
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(live ? 16 : 0));
    } else {
        copy_async<16>(dst, src, live);
    }
}

// What a lane's copies of every step share when KeyRows::fast: the byte offsets inside a block of
// its copy 0 (KeyRows k0 / v0 included) and from one copy to the next (32 / CPR rows).
struct CopyPlan {
    u32 k_off, v_off, k_step, v_step;
};

__device__ __forceinline__ CopyPlan copy_plan(const KeyRows& rows, int lane) {
    CopyPlan cp{0u, 0u, 0u, 0u};
    if (rows.fast) {
        const i64 n = copy_key(lane, 0);
        cp.k_off = (u32)(n * rows.k_st + rows.k0);
        cp.v_off = (u32)(n * rows.v_st + rows.v0);
        cp.k_step = (u32)((32 / CPR) * rows.k_st);
        cp.v_step = (u32)((32 / CPR) * rows.v_st);
    }
    return cp;
}

// The block ids of the step at n0's sub-tiles (KeyRows::fast; -1 past kend). Loaded a step before
// issue_step needs them, so that the copies never wait for the block table.
struct StepBlocks {
    int blk[NSUB];
};

__device__ __forceinline__ StepBlocks lookup(const KeyRows& rows, int n0) {
    StepBlocks sb;
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
        const int base = n0 + 16 * u;
        sb.blk[u] = rows.fast && base < rows.kend ? rows.bt_row[rows.page_of(base)] : -1;
    }
    return sb;
}

// Start the copies of the warp step at n0 into `stage` (ring_addr: the warp's part of stage 0); one
// commit group. Returns the step's visible-key bits of this lane's fragments (bit 2u + r: key g + 8r
// of sub-tile u). KeyRows::fast: one 64-bit block offset per sub-tile (block ids from `sb`) plus the
// lane's CopyPlan offsets; otherwise every key located on its own.
__device__ __forceinline__ u32 issue_step(u32 ring_addr, int stage, int n0, const KeyRows& rows, const StepBlocks& sb,
                                          const CopyPlan& cp, const u8* key_cache, const u8* value_cache, int g,
                                          int lane) {
    u32 bits = 0u;
    const u32 stage_addr = ring_addr + (u32)(stage_slots(stage) * 16);
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
        const int base = n0 + 16 * u;
        const u32 k_addr = stage_addr + (u32)(u * 2 * TILE * 16), v_addr = k_addr + (u32)(TILE * 16);
        int kblk[2];
        i64 ktib[2];
        if (rows.fast) {  // (uniform) the sub-tile [base, base + 16) lies in one block
            const int blk = sb.blk[u];
            const bool blk_ok = blk >= 0 && blk < rows.num_blocks;
            const int tib0 = base - rows.page_of(base) * rows.block_size;
            // an invalid block reads nothing; its address stays inside block 0
            const i64 kb = blk_ok ? (i64)blk * rows.k_sb + (i64)tib0 * rows.k_st : 0;
            const i64 vb = blk_ok ? (i64)blk * rows.v_sb + (i64)tib0 * rows.v_st : 0;
            const int lo = rows.kbeg - base, hi = rows.kend - base;
#pragma unroll
            for (int m = 0; m < CPS; ++m) {
                const int j = copy_key(lane, m);
                const bool live = blk_ok && j >= lo && j < hi;
                const u32 dst = (u32)(copy_slot(lane, m) * 16);
                copy_kv(k_addr + dst, key_cache + kb + (cp.k_off + m * cp.k_step), live);
                copy_kv(v_addr + dst, value_cache + vb + (cp.v_off + m * cp.v_step), live);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int j = g + 8 * r;
                const bool live = blk_ok && j >= lo && j < hi;
                kblk[r] = live ? blk : -1;
                ktib[r] = tib0 + j;
                bits |= (u32)live << (2 * u + r);
            }
        } else {
#pragma unroll
            for (int m = 0; m < CPS; ++m) {
                i64 rk, rv, tib;
                int b;
                rows.locate(base + copy_key(lane, m), rk, rv, b, tib);
                const bool live = rk >= 0;
                const u32 dst = (u32)(copy_slot(lane, m) * 16);
                copy_kv(k_addr + dst, key_cache + (live ? rk : 0), live);
                copy_kv(v_addr + dst, value_cache + (live ? rv : 0), live);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                i64 rk, rv;
                rows.locate(base + g + 8 * r, rk, rv, kblk[r], ktib[r]);
                bits |= (u32)(rk >= 0) << (2 * u + r);
            }
        }
        if constexpr (TOKEN_SCALES) {  // [k_scale(g), k_scale(g + 8), v_scale(g), v_scale(g + 8)]
            const u32 dst = stage_addr + (u32)((NSUB * 2 * TILE + 32 * u + lane) * 16);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const bool live = kblk[r] >= 0;
                const i64 sk = (i64)kblk[r] * rows.ks_sb + ktib[r] * rows.ks_st + rows.ks0;
                const i64 sv = (i64)kblk[r] * rows.vs_sb + ktib[r] * rows.vs_st + rows.vs0;
                copy_async<4>(dst + 4 * r, reinterpret_cast<const u8*>(rows.k_scale + (live ? sk : 0)), live);
                copy_async<4>(dst + 8 + 4 * r, reinterpret_cast<const u8*>(rows.v_scale + (live ? sv : 0)), live);
            }
        }
    }
    copy_commit();
    return bits;
}


// One warp step: logits of its 16 * NSUB keys for heads 2c, 2c + 1, the online softmax update, and
// O^T += V^T P^T. EXACT: every FP8 code through the software decoder. SPLIT_P: P enters as two
// float16 halves (hi + lo); otherwise as one float16 (rows that see >= FP8KV_FULL_P_KEYS keys).
// f1, f2: the logit factors of heads 2c, 2c + 1 (static scales: the same for both unless FP8_MODE);
// inv_ps: FP8_MODE's 1 / prob_scale.
template <bool EXACT, int KE, bool SPLIT_P>
__device__ __forceinline__ void attend_step(const StepView& wds, const u32 (&qb)[KW][2], const float (&f1)[2],
                                            const float (&f2)[2], float inv_ps, float g_mant, int gexp, float soft_cap,
                                            int use_cap, float (&m_run)[2], float (&l_run)[2], float (&r_run)[2],
                                            float (&o)[MT][4]) {
    // S^T fragments: x[u][0], x[u][1]: key g, heads 2c, 2c + 1; x[u][2], x[u][3]: key g + 8
    float x[NSUB][4];
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
        float acc[2][4] = {};  // two chains (even, odd k steps): half the dependent mma latency
#pragma unroll
        for (int ks = 0; ks < KW; ++ks) {
            const uint4 x0 = wds.k(u, 0, ks >> 2), x1 = wds.k(u, 1, ks >> 2);  // (read once per 4 k steps)
            const u32 w0 = word(x0, ks & 3), w1 = word(x1, ks & 3);
            if constexpr (NATIVE && KE == 5) {  // k index 2c, 2c + 1 <-> bytes 0, 1; 2c + 8, 2c + 9 <-> bytes 2, 3
                u32 a0, a1, a2, a3;
                widen_native(w0, a0, a2);
                widen_native(w1, a1, a3);
                mma<KE>(acc[ks & 1], a0, a1, a2, a3, qb[ks][0], qb[ks][1]);
            } else {  // k index 2c, 2c + 1 <-> bytes 0, 2; 2c + 8, 2c + 9 <-> bytes 1, 3
                mma<KE>(acc[ks & 1], widen<KE, EXACT>(w0 << 8), widen<KE, EXACT>(w1 << 8), widen<KE, EXACT>(w0),
                        widen<KE, EXACT>(w1), qb[ks][0], qb[ks][1]);
            }
        }
        float kf1[2] = {f1[0], f1[1]}, kf2[2] = {f2[0], f2[1]};  // by head; token_head: by key (g, g + 8)
        if constexpr (TOKEN_SCALES) {
            const uint4 sc = wds.scales(u);
            scale_factors(u2f(sc.x), g_mant, gexp, kf1[0], kf2[0]);
            scale_factors(u2f(sc.y), g_mant, gexp, kf1[1], kf2[1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int fi = TOKEN_SCALES ? e >> 1 : e & 1;  // (element e: key g + 8 (e >> 1), head 2c + (e & 1))
            float v = ((acc[0][e] + acc[1][e]) * kf1[fi]) * kf2[fi];
            if (use_cap) v = soft_cap * tanhf(fdiv(v, soft_cap)) * LOG2E;
            x[u][e] = wds.live(u, e >> 1) ? saturate(v) : NEG_INF;
        }
    }
    // online softmax (base 2) of heads 2c + j over the step's keys
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float tmax = NEG_INF;
#pragma unroll
        for (int u = 0; u < NSUB; ++u) tmax = fmaxf(tmax, fmaxf(x[u][j], x[u][2 + j]));
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, off));
        const float m_new = fmaxf(m_run[j], FP8_MODE ? ceilf(tmax) : tmax);  // (FP8_MODE: an integer or -inf)
        const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
        alpha[j] = m_new == m_run[j] ? 1.0f : (FP8_MODE ? pow2_int(m_run[j] - m_safe) : exp2f(m_run[j] - m_safe));
        float psum = 0.0f;
#pragma unroll
        for (int u = 0; u < NSUB; ++u) {
            x[u][j] = exp2f(x[u][j] - m_safe);  // masked keys: exp2(-inf) = 0
            x[u][2 + j] = exp2f(x[u][2 + j] - m_safe);
            psum += x[u][j] + x[u][2 + j];
        }
        l_run[j] = l_run[j] * alpha[j] + psum;
        m_run[j] = m_new;
        if constexpr (TOKEN_SCALES) {
            // weights p * v_scale in units of R, a power of two >= the running maximum weight (so
            // dividing by R is exact and p * v_scale / R <= 1); O^T is kept in units of R
            float wmax = 0.0f;
#pragma unroll
            for (int u = 0; u < NSUB; ++u) {
                const uint4 sc = wds.scales(u);
                x[u][j] *= u2f(sc.z);
                x[u][2 + j] *= u2f(sc.w);
                wmax = fmaxf(wmax, fmaxf(x[u][j], x[u][2 + j]));
            }
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) wmax = fmaxf(wmax, __shfl_xor_sync(0xFFFFFFFFu, wmax, off));
            const float r_target = fmaxf(r_run[j] * alpha[j], wmax);
            const float r_new = r_target > 0.0f ? pow2_ceil(r_target) : 0.0f;
            alpha[j] = r_new > 0.0f ? alpha[j] * (r_run[j] / r_new) : alpha[j];  // (a power-of-two ratio)
            const float inv = r_new > 0.0f ? 1.0f / r_new : 0.0f;
#pragma unroll
            for (int u = 0; u < NSUB; ++u) { x[u][j] *= inv; x[u][2 + j] *= inv; }
            r_run[j] = r_new;
        }
    }
    if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // (the max rarely moves: skip)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            o[mt][0] *= alpha[0]; o[mt][1] *= alpha[1]; o[mt][2] *= alpha[0]; o[mt][3] *= alpha[1];
        }
    }
    // O^T += V^T P^T with P = hi (+ lo) in float16 (FP8_MODE: e4m3(p / prob_scale), exact in float16)
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
        u32 h0, h1;
        if constexpr (FP8_MODE) {
#if FP8KV_FP8_MODE
            h0 = e4m3x2_as_f16x2(x[u][0] * inv_ps, x[u][1] * inv_ps);
            h1 = e4m3x2_as_f16x2(x[u][2] * inv_ps, x[u][3] * inv_ps);
#endif
        } else {
            h0 = pack_f16(x[u][0], x[u][1]);
            h1 = pack_f16(x[u][2], x[u][3]);
        }
        const u32 bh0 = transpose8x8(h0), bh1 = transpose8x8(h1);  // head g; keys 2c, 2c + 1 | + 8
        u32 bl0 = 0u, bl1 = 0u;
        if constexpr (SPLIT_P) {
            bl0 = transpose8x8(pack_f16(x[u][0] - f16_lo(h0), x[u][1] - f16_hi(h0)));
            bl1 = transpose8x8(pack_f16(x[u][2] - f16_lo(h1), x[u][3] - f16_hi(h1)));
        }
#pragma unroll
        for (int w = 0; w < VW; ++w) {
            const int i = w >> 2;  // the chunk (read once per 4 words)
            const u32 va = word(wds.v(u, 0, i), w & 3), vb = word(wds.v(u, 1, i), w & 3);
            const u32 vc = word(wds.v(u, 2, i), w & 3), vd = word(wds.v(u, 3, i), w & 3);
#pragma unroll
            for (int tt = 0; tt < 2; ++tt) {  // m-tile 2w + tt: rows g, g + 8 <-> dims 4w + 2tt, + 1
                u32 a0, a1, a2, a3;
                if constexpr (NATIVE) {  // [A d, B d, A d+1, B d+1]: the pairs of rows g and g + 8
                    const u32 sel = tt == 0 ? 0x5140u : 0x7362u;
                    widen_native(prmt(va, vb, sel), a0, a1);
                    widen_native(prmt(vc, vd, sel), a2, a3);
                } else {
                    constexpr u32 S[4] = {pair_selector(0), pair_selector(1), pair_selector(2), pair_selector(3)};
                    a0 = widen<5, EXACT>(prmt(va, vb, S[2 * tt]));
                    a1 = widen<5, EXACT>(prmt(va, vb, S[2 * tt + 1]));
                    a2 = widen<5, EXACT>(prmt(vc, vd, S[2 * tt]));
                    a3 = widen<5, EXACT>(prmt(vc, vd, S[2 * tt + 1]));
                }
                mma<5>(o[2 * w + tt], a0, a1, a2, a3, bh0, bh1);
                if constexpr (SPLIT_P) mma<5>(o[2 * w + tt], a0, a1, a2, a3, bl0, bl1);
            }
        }
    }
}


// A warp's copy pipeline over its steps n0 = first + (i * KWARPS + warp) * STEP: the first
// STAGES - 1 steps are issued by start_pipe (before the kernel reads its queries, so that their
// latency overlaps that work), the rest by key_loop, a step ahead.
struct Pipe {
    CopyPlan cp;
    StepBlocks blocks;  // of the next step to issue
    u32 live_q;         // visible-key bits of the steps in flight, oldest lowest
    int first, my_steps;
    __device__ __forceinline__ int step_n0(int i) const { return first + (i * KWARPS + (int)(threadIdx.x >> 5)) * STEP; }
};

__device__ __forceinline__ Pipe start_pipe(const KeyRows& rows, uint4* ring_mem, const u8* key_cache,
                                           const u8* value_cache) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    Pipe pp;
    pp.first = rows.kbeg & ~15;
    const int span = rows.kend > pp.first ? rows.kend - pp.first : 0;
    pp.my_steps = span > warp * STEP ? (span - warp * STEP + KWARPS * STEP - 1) / (KWARPS * STEP) : 0;
    pp.cp = copy_plan(rows, lane);
    const u32 ring_addr = shared_address(ring_mem + warp * WARP_STAGE);
    pp.live_q = 0u;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        u32 b = 0u;
        if (i < pp.my_steps) {
            b = issue_step(ring_addr, i, pp.step_n0(i), rows, lookup(rows, pp.step_n0(i)), pp.cp, key_cache, value_cache,
                           g, lane);
        } else {
            copy_commit();
        }
        pp.live_q |= b << (i * LIVE_BITS);
    }
    pp.blocks = lookup(rows, pp.step_n0(STAGES - 1));  // (the loads complete during a step)
    return pp;
}

// The FP8 mode's per-thread query facts: the scale of the thread's head g, and 1 / prob_scale.
struct Fp8Query {
    float qs;
    float inv_ps;
};

// The logit factors (f1, f2) of heads 2c + j, f1 f2 = q_scale(head) k_scale g_mant 2^g_exp (FP8_MODE; qs: the
// thread's head's scale, exchanged between lanes): k_scale g_mant 2^g_exp as a mantissa in [1, 2) and an
// exponent first (one rounding), then scale_factors with the query scale.
__device__ __forceinline__ void fp8_logit_factors(float qs, float k_scale, float g_mant, int g_exp, int c,
                                                  float (&f1)[2], float (&f2)[2]) {
    float kf1, kf2;
    scale_factors(k_scale, g_mant, g_exp, kf1, kf2);
    const u32 b1 = f2u(kf1);
    const int ke = (int)((b1 >> 23) & 0xFFu) - 127 + (int)((f2u(kf2) >> 23) & 0xFFu) - 127;
    const float km = u2f((b1 & 0x007FFFFFu) | 0x3F800000u);
#pragma unroll
    for (int j = 0; j < 2; ++j) scale_factors(__shfl_sync(0xFFFFFFFFu, qs, 4 * (2 * c + j)), km, ke, f1[j], f2[j]);
}

// The warp's steps with K in the 16-bit type KE (5 float16, 8 bfloat16), STAGES - 1 of them in
// flight (the first issued by start_pipe). Queries enter scaled by 2^-qshift (exact, see the
// kernel), so the logit factor carries 2^qshift; FP8_MODE: as q8 = e4m3(q / qs) (KE 5, qshift 0).
template <int KE>
__device__ __forceinline__ void key_loop(Pipe pp, bool split_p, const q_t* query, i64 qrow, bool head_live, i32 qshift,
                                         const float* k_scale, Fp8Query f8,
                                         float g_mant, int g_exp, const KeyRows& rows, uint4* ring_mem,
                                         const u8* key_cache, const u8* value_cache, float soft_cap, int use_cap,
                                         float (&m_run)[2], float (&l_run)[2], float (&r_run)[2], float (&o)[MT][4]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    // the query fragment (B of S^T): head g, dims k_dim(c, ks) + 0..3 in the K fragment's k order
    u32 qb[KW][2];
    float f1[2] = {1.0f, 1.0f}, f2[2] = {1.0f, 1.0f};  // static scales: the heads' logit factors (else per key)
#if FP8KV_FP8_MODE
    static_assert(KE == 5 && NATIVE, "FP8 mode: float16 K, the native order");
    // Every warp of the CTA holds the same fragment: warp w quantizes k steps w, w + KWARPS, ... and the
    // warps exchange them through shared memory (the IEEE divisions were most of the mode's extra time:
    // 0.6-1.6% of a decode step on the H100 when every warp divided its own).
    __shared__ uint2 q_frag[KW][32];
    for (int ks = warp; ks < KW; ks += KWARPS) {  // (k_native order: bytes 0, 1 | 2, 3)
        const i64 q0 = qrow + k_dim(c, ks);
        float x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = head_live ? __fdiv_rn(load_q(query, q0 + i), f8.qs) : 0.0f;
        q_frag[ks][lane] = make_uint2(e4m3x2_as_f16x2(x[0], x[1]), e4m3x2_as_f16x2(x[2], x[3]));
    }
    __syncthreads();  // (uniform: every thread of the CTA runs key_loop<5> in the FP8 mode)
#pragma unroll
    for (int ks = 0; ks < KW; ++ks) {
        const uint2 w = q_frag[ks][lane];
        qb[ks][0] = w.x;
        qb[ks][1] = w.y;
    }
    fp8_logit_factors(f8.qs, k_scale[0], g_mant, g_exp, c, f1, f2);
#else
#pragma unroll
    for (int ks = 0; ks < KW; ++ks) {
        const i64 q0 = qrow + k_dim(c, ks);
        const u32 e0 = query_bits<KE>(query, q0, head_live, qshift), e1 = query_bits<KE>(query, q0 + 1, head_live, qshift);
        const u32 e2 = query_bits<KE>(query, q0 + 2, head_live, qshift), e3 = query_bits<KE>(query, q0 + 3, head_live, qshift);
        constexpr bool k_native = NATIVE && KE == 5;  // k index 2c.. <-> bytes 0, 1 | 2, 3; else 0, 2 | 1, 3
        qb[ks][0] = k_native ? e0 | (e1 << 16) : e0 | (e2 << 16);
        qb[ks][1] = k_native ? e2 | (e3 << 16) : e1 | (e3 << 16);
    }
    if constexpr (!TOKEN_SCALES) {
        scale_factors(k_scale[0], g_mant, g_exp + qshift, f1[0], f2[0]);
        f1[1] = f1[0];
        f2[1] = f2[0];
    }
#endif

    const uint4* my_ring = ring_mem + warp * WARP_STAGE;  // (stage s: + stage_slots(s))
    const u32 ring_addr = shared_address(my_ring);
    int kx, vx;
    frag_slots(g, c, kx, vx);
    const int my_steps = pp.my_steps;
    u32 live_q = pp.live_q;
    int stage = 0, next = STAGES - 1;
    for (int i = 0; i < my_steps; ++i) {
        const int j = i + STAGES - 1;
        u32 b = 0u;
        __syncwarp();  // (every lane has read the stage it refills)
        if (j < my_steps) b = issue_step(ring_addr, next, pp.step_n0(j), rows, pp.blocks, pp.cp, key_cache, value_cache, g, lane);
        else copy_commit();
        pp.blocks = lookup(rows, pp.step_n0(j + 1));
        live_q |= b << ((STAGES - 1) * LIVE_BITS);
        copy_wait<STAGES - 1>();
        __syncwarp();  // (the other lanes' copies of the step are visible)
        const StepView wds{my_ring + stage_slots(stage), kx, vx, live_q};
        live_q >>= LIVE_BITS;
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        next = next + 1 == STAGES ? 0 : next + 1;
        u32 special = 0u;  // (a pass the compiler drops where has_special is 0: the native conversion)
#pragma unroll
        for (int u = 0; u < NSUB; ++u) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int i = 0; i < KCH; ++i) {
                    const uint4 x = wds.k(u, r, i);
                    special |= has_special<KE>(x.x) | has_special<KE>(x.y) | has_special<KE>(x.z) | has_special<KE>(x.w);
                }
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int i = 0; i < VCH; ++i) {
                    const uint4 x = wds.v(u, r, i);
                    special |= has_special<5>(x.x) | has_special<5>(x.y);
                    if constexpr (VBYTES >= 16) special |= has_special<5>(x.z) | has_special<5>(x.w);
                }
        }
        if (__any_sync(0xFFFFFFFFu, special != 0u)) {
            attend_step<true, KE, !FP8_MODE>(wds, qb, f1, f2, f8.inv_ps, g_mant, g_exp + qshift, soft_cap, use_cap, m_run,
                                             l_run, r_run, o);
        } else if (split_p && !FP8_MODE) {
            attend_step<false, KE, true>(wds, qb, f1, f2, f8.inv_ps, g_mant, g_exp + qshift, soft_cap, use_cap, m_run,
                                         l_run, r_run, o);
        } else {
            attend_step<false, KE, false>(wds, qb, f1, f2, f8.inv_ps, g_mant, g_exp + qshift, soft_cap, use_cap, m_run,
                                          l_run, r_run, o);
        }
    }
    copy_wait_all();
}

}  // namespace fp8kv

extern "C" __global__ void __launch_bounds__(KNT, FP8KV_MIN_CTAS) fp8kv_paged_attention_mma(FP8KV_ATTENTION_PARAMS(D_arg) FP8KV_FP8_PARAMS) {
    extern __shared__ uint4 ring_mem[];  // SMEM_BYTES (the launcher passes fp8kv_cuda.attention.mma_smem_bytes)
    MmaShared& sh = *reinterpret_cast<MmaShared*>(ring_mem);
    const int tid = threadIdx.x;
    u32 dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < (u32)SMEM_BYTES) __trap();  // a launcher bug, never silent corruption
    const int lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c = lane & 3;
    int t, h, chunk;
    decode_cta(T, head_chunks, t, h, chunk);
    const int g0 = chunk * HEADS;
    const int z = blockIdx.z;

    int q_lo = 0, q_hi = 0;
    const int len_guess = num_seqs > 0 ? seq_lens[decode_guess(num_seqs, t)] : 0;  // (loaded with find_seq's first
                                                                                    // round: a decode step's answer)
    const int s = find_seq(qsl, num_seqs, T, t, q_lo, q_hi);
    if (s < 0) return;  // uniform over the CTA
    const int len_s = s == decode_guess(num_seqs, t) ? len_guess : seq_lens[s];

    // ---- the keys this row sees, and this split's part of them
    i64 kbeg, kend;
    key_span(len_s, q_lo, q_hi, t, causal, window, z, keys_per_split, max_blocks, block_size, kbeg, kend);
    i64 vis_beg, vis_end;  // every key the row sees (all splits): P's precision rule
    key_span(len_s, q_lo, q_hi, t, causal, window, 0, 0x7FFFFFFF, max_blocks, block_size, vis_beg, vis_end);
    const bool split_p = vis_end - vis_beg < FP8KV_FULL_P_KEYS;
    KeyRows rows;
    rows.bt_row = block_tables + (i64)s * bt_stride;
    rows.kbeg = (int)kbeg;  // positions < seq_len <= INT32_MAX
    rows.kend = (int)kend;
    rows.block_size = block_size;
    rows.num_blocks = num_blocks;
    rows.bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    rows.k_sb = k_sb; rows.k_st = k_st; rows.v_sb = v_sb; rows.v_st = v_st;
    rows.k0 = (i64)h * k_sh + 16 * (lane % CPR);  // (the lane's chunk of every row it copies: copy_key)
    rows.v0 = (i64)h * v_sh + 16 * (lane % CPR);
    rows.ks_sb = ks_sb; rows.ks_st = ks_st; rows.ks0 = (i64)h * ks_sh;
    rows.vs_sb = vs_sb; rows.vs_st = vs_st; rows.vs0 = (i64)h * vs_sh;
    rows.k_scale = k_scale; rows.v_scale = v_scale;
    auto in_block = [&](i64 sb, i64 st, i64 off0, int width) {  // every row offset of a block < 2^31
        return sb >= 0 && st >= 0 && off0 >= 0 && st < (1ll << 31) && (i64)(block_size - 1) * st + off0 + width < (1ll << 31);
    };
    rows.fast = (block_size & 15) == 0 && num_blocks > 0 && in_block(k_sb, k_st, rows.k0, D) &&
                in_block(v_sb, v_st, rows.v0, D);

    const Pipe pipe = start_pipe(rows, ring_mem, key_cache, value_cache);  // (before the queries: overlaps them)

    // ---- the queries' range (max and smallest nonzero magnitude over the CTA's heads)
    const bool head_live = g0 + g < group;
    const i64 qrow = ((i64)t * HQ + (i64)h * group + g0 + g) * D;
    bool k16;  // float16 K (native conversion on sm89+) where exact, see key_type
    i32 qshift;  // queries enter as q * 2^-qshift
    Fp8Query f8{1.0f, 1.0f};
#if FP8KV_FP8_MODE
    {  // the head's q_scale: given, or max(amax|q| / 448, 2^-126) (NaN as 0, inf as the largest float)
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < D / 4; ++i) {  // (the lanes of a head hold a quarter of its dims each)
            const float v = head_live ? fabsf(load_q(query, qrow + k_dim(c, i >> 2) + (i & 3))) : 0.0f;
            a = fmaxf(a, v != v ? 0.0f : fminf(v, FLOAT32_MAX));
        }
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
        const float given = head_live ? q_scale[(i64)h * qs_kv + (i64)(h * group + g0 + g) * qs_q] : 1.0f;
        f8.qs = q_dynamic ? dynamic_scale(a, 448.0f) : given;
        f8.inv_ps = inv_prob_scale;
        k16 = true;
        qshift = 0;
    }
#else
    u32 qmax = 0u, qmin = 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < D / 4; ++i) {  // (every load issued at once)
        const u32 a = head_live ? f2u(load_q(query, qrow + k_dim(c, i >> 2) + (i & 3))) & 0x7FFFFFFFu : 0u;
        qmax = u32_max(qmax, a);
        if (a != 0u && a < qmin) qmin = a;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        qmax = u32_max(qmax, __shfl_xor_sync(0xFFFFFFFFu, qmax, o));
        const u32 m = __shfl_xor_sync(0xFFFFFFFFu, qmin, o);
        qmin = m < qmin ? m : qmin;
    }
    key_type(qmax, qmin, k16, qshift);
#endif
    const float vs_static = TOKEN_SCALES ? 1.0f : v_scale[h * vs_sh];

    // ---- per-warp state: heads 2c, 2c + 1 (same in the 8 lanes of a c), O^T fragments
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f}, r_run[2] = {0.0f, 0.0f};
    float o[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    if (k16) {  // uniform over the CTA
        key_loop<5>(pipe, split_p, query, qrow, head_live, qshift, k_scale + h * ks_sh, f8, g_mant, g_exp, rows, ring_mem, key_cache,
                    value_cache, soft_cap, use_cap, m_run, l_run, r_run, o);
    } else {
        if constexpr (QT == 2 && !FP8_MODE) {
            key_loop<8>(pipe, split_p, query, qrow, head_live, qshift, k_scale + h * ks_sh, f8, g_mant, g_exp, rows, ring_mem,
                        key_cache, value_cache, soft_cap, use_cap, m_run, l_run, r_run, o);
        }
    }
    __syncthreads();  // every warp is done with the ring: the epilogue reuses it
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // split plans: the merge (fp8kv_merge, a programmatic dependent launch on sm90) may be scheduled once
    // every CTA has passed here; its CTAs then wait on the SMs in griddepcontrol.wait, which returns when this
    // grid is done and its writes are visible. Here rather than at the kernel's start: merge CTAs resident
    // from the start slowed B=1 L=4096 by 4% on the H100
    if (split) asm volatile("griddepcontrol.launch_dependents;");
#endif

    // ---- merge the warps: (m, l, r) per head, O^T through shared memory (as the split merge does:
    // with w = 2^(m_w - max m), out = sum w r_w O_w / sum w l_w, times v_scale for static scales)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) l_run[j] += __shfl_xor_sync(0xFFFFFFFFu, l_run[j], off);
        if (g == 0) {
            sh.m[warp][2 * c + j] = m_run[j];
            sh.l[warp][2 * c + j] = l_run[j];
            sh.r[warp][2 * c + j] = r_run[j];
        }
    }
#pragma unroll
    for (int w = 0; w < MT / 2; ++w) {  // dims v_dim(g, w) + 0..3: m-tiles 2w (+0, +1) and 2w + 1 (+2, +3)
        const int d = v_dim(g, w);
        *reinterpret_cast<float4*>(&sh.o[warp][2 * c][o_col(2 * c, d)]) =
            make_float4(o[2 * w][0], o[2 * w][2], o[2 * w + 1][0], o[2 * w + 1][2]);
        *reinterpret_cast<float4*>(&sh.o[warp][2 * c + 1][o_col(2 * c + 1, d)]) =
            make_float4(o[2 * w][1], o[2 * w][3], o[2 * w + 1][1], o[2 * w + 1][3]);
    }
    __syncthreads();
    if (tid < HEADS) {  // per head, once: the warps' weights w = 2^(m_w - max m) (token_head: w r_w / A)
        const int hd = tid;
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < KWARPS; ++w) m = fmaxf(m, sh.m[w][hd]);
        const float m_safe = m == NEG_INF ? 0.0f : m;
        float a[KWARPS], l = 0.0f, a_max = 0.0f;  // token_head: A = max_w w r_w (O in units of A)
#pragma unroll
        for (int w = 0; w < KWARPS; ++w) {
            a[w] = FP8_MODE ? pow2_int(sh.m[w][hd] - m_safe) : exp2f(sh.m[w][hd] - m_safe);
            l += a[w] * sh.l[w][hd];
            if constexpr (TOKEN_SCALES) a_max = fmaxf(a_max, a[w] * sh.r[w][hd]);
        }
        const float a_div = a_max > 0.0f ? a_max : 1.0f;
#pragma unroll
        for (int w = 0; w < KWARPS; ++w) sh.coef[w][hd] = TOKEN_SCALES ? fdiv(a[w] * sh.r[w][hd], a_div) : a[w];
        sh.head_m[hd] = m;
        sh.head_l[hd] = l;
        sh.head_a[hd] = a_max;
        sh.head_inv[hd] = fdiv(1.0f, l > 0.0f ? l : 1.0f);
    }
    __syncthreads();
    float ps = 1.0f;  // FP8_MODE: the output's prob_scale (splits: in the partial accumulator)
#if FP8KV_FP8_MODE
    ps = prob_scale;
#endif
    // each thread 4 consecutive dims of a head (o_col keeps them together), all of its loads issued at once
    static_assert(D % 4 == 0, "attention_mma.cu: the output quads");
    constexpr int QUADS = HEADS * D / 4;
    const bool out_vec = (reinterpret_cast<unsigned long long>(out) & (4 * sizeof(q_t) - 1)) == 0;  // (D % 4 == 0)
#pragma unroll
    for (int it = 0; it < (QUADS + KNT - 1) / KNT; ++it) {
        const int idx = tid + it * KNT;
        const int hd = idx / (D / 4), d = 4 * (idx - hd * (D / 4));
        if (idx >= QUADS || g0 + hd >= group) continue;
        const float m = sh.head_m[hd], l = sh.head_l[hd], a_max = sh.head_a[hd];
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < KWARPS; ++w) {
            const float4 ow = *reinterpret_cast<const float4*>(&sh.o[w][hd][o_col(hd, d)]);
            const float cw = sh.coef[w][hd];
            acc[0] += cw * ow.x;
            acc[1] += cw * ow.y;
            acc[2] += cw * ow.z;
            acc[3] += cw * ow.w;
        }
        const i64 row = (i64)t * HQ + (i64)h * group + g0 + hd;
        if (split) {
            const i64 prow = (i64)z * T * HQ + row;  // (part_acc: torch's allocation, 16-byte rows)
            *reinterpret_cast<float4*>(part_acc + prow * D + d) =
                make_float4(acc[0] * ps, acc[1] * ps, acc[2] * ps, acc[3] * ps);
            if (d == 0) { part_ml[prow * 3] = m; part_ml[prow * 3 + 1] = l; part_ml[prow * 3 + 2] = a_max; }
        } else {
            const float inv = sh.head_inv[hd], mul = TOKEN_SCALES ? a_max : vs_static;
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = ((acc[j] * inv) * mul) * ps;
            store_out4(out, row * D + d, v, out_vec);
            if (d == 0 && write_lse) lse[row] = l > 0.0f ? (m + log2f(l)) * LN2 : NEG_INF;
        }
    }
}
