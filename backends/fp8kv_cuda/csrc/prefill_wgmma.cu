// fp8kv_cuda: chunked prefill on Hopper's tensor cores (sm_90a wgmma), warp-specialized, for an
// e4m3 (OCP) cache with static (tensor or head) scales, head size 128, float16/bfloat16 queries.
//
// The fast kernel of prefill_mma.cu's two-kernel scheme, taking its place on sm90: the same
// parameters, grid (row tiles of 128 rows, H, S * num_splits) and redo[] contract. A CTA whose rows it
// cannot do exactly (a logit that could overflow float32, a NaN V code in a tile some row does not
// fully see) sets redo[cta] = 1 and writes nothing; fp8kv_prefill_mma_exact, launched after it over
// the same grid, redoes those CTAs.
//
// CTA = 3 warpgroups, rows as prefill_mma.cu (row = (token - first token) * group + query head, 128
// rows from the end of the sequence's rows first), tiles of 64 keys, STAGES in flight:
//   warpgroup 0, the producer: loads each tile's K and V codes through the block table, widens K to
//     the query's 16-bit type (exact: every e4m3 value is a float16 and a bfloat16) and V to float16
//     transposed (V^T, K-major, as wgmma's B wants it), flags tiles with a NaN V code, and hands the
//     tile over on an mbarrier. Loads (FP8KV_TMA):
//       1: TMA, one box per page (per 64 keys of a longer page) into a ring of RAW_STAGES raw tiles in
//          the 128-byte swizzle, RAW_STAGES tiles ahead (tile t + RAW_STAGES by warp t % 4, once every
//          producer thread has read tile t's raw codes); a box whose block id is
//          outside the cache gets a block coordinate outside the tensor map (zero-filled); the keys
//          past the CTA's range or in such a box are marked invalid, and their V rows widened as zeros
//          (a whole page lands: p = 0 times a NaN code would still be NaN);
//       0: cp.async, 16 bytes a copy (caches TMA cannot describe: fp8kv_cuda.tma), invalid keys
//          zero-filled, one raw tile per stage;
//   warpgroups 1 and 2, the consumers, 64 rows each: Q staged once as it is (16-bit), then per tile
//     S = Q K^T (8 wgmma m64n64k16, exact products, float32 accumulation), the online softmax
//     (p = 2^(s f - m), l += p in float32), P as float16 (hi + lo where a row sees fewer than
//     FP8KV_FULL_P_KEYS keys, as prefill_mma.cu) straight from the accumulators into wgmma A
//     registers, O += P V (4 or 8 wgmma m64n128k16). Phase t issues O += P(t-1) V(t-1) with S(t); with
//     FP8KV_PINGPONG the two warpgroups issue their phases in turn (named barriers 4 + cw).
//
// Memory safety without host checks: query_start_loc and seq_lens clamped as in prefill_mma.cu, block
// ids outside [0, num_blocks) never loaded (the keys masked), rows past a sequence's queries neither
// read nor written.
//
// Macros: FP8KV_QT (1 float16, 2 bfloat16), FP8KV_FULL_P_KEYS, FP8KV_STAGES, FP8KV_PINGPONG, FP8KV_TMA,
// and the format's (e4m3 only).
#include "prefill_rows.cuh"
#include "wgmma_common.cuh"


namespace fp8kv {

constexpr int D = 128;
constexpr int BLOCK_M = 128;        // rows per CTA (two consumer warpgroups of 64)
constexpr int BLOCK_N = 64;         // keys per tile
constexpr int STAGES = FP8KV_STAGES;
constexpr int THREADS = WS_THREADS;
constexpr bool PINGPONG = FP8KV_PINGPONG != 0;
constexpr bool BF16 = QT == 2;
constexpr int ROW16 = 2 * D;        // bytes of a 16-bit Q or K row
constexpr int SBO16 = 8 * ROW16;    // 8-row groups of the 16-bit Q and K tiles
constexpr int VT_SBO = 8 * 2 * BLOCK_N + 16;  // 8-dim groups of V^T (64 keys x 2 bytes a dim, + 16)
constexpr bool TMA = FP8KV_TMA != 0;
constexpr int RAW_STAGES = TMA ? 4 : STAGES;  // raw tiles in flight (TMA: loaded RAW_STAGES tiles ahead)
constexpr int RAW_PITCH = TMA ? 128 : 144;    // bytes a raw key row (TMA: sw128; cp.async: + 16, conflict-free)
// setmaxnreg: the widening producer gets 96 registers (its loads all in flight before the conversions; at
// 56 it was latency-bound: 1387 against 1233 us on the H100), the consumers 200 (no spills)
constexpr int PRODUCER_REGS_WIDEN = 96;
constexpr int CONSUMER_REGS_WIDEN = 200;

static_assert(QT == 1 || QT == 2, "prefill_wgmma.cu: float16 or bfloat16 queries");
static_assert(FP8KV_MANT == 3 && FP8KV_BIAS == 7 && !FP8KV_FNUZ, "prefill_wgmma.cu: the OCP e4m3 format");

struct __align__(1024) WgmmaShared {          // (1024: the swizzled raw tiles' alignment)
    u8 kr[RAW_STAGES][BLOCK_N * RAW_PITCH];  // raw K and V codes as loaded (TMA: sw128)
    u8 vr[RAW_STAGES][BLOCK_N * RAW_PITCH];
    u8 q[BLOCK_M * ROW16];                   // Q, K-major (consumer cw's 64 rows at 16384 cw)
    u8 k[STAGES][BLOCK_N * ROW16];           // K in the query's type, K-major
    u8 vt[STAGES][(D / 8) * VT_SBO];         // V^T in float16, K-major (rows = dims)
    u8 valid[STAGES][BLOCK_N];               // 1: the key is in the CTA's range and its block id in the cache
    u8 raw_valid[RAW_STAGES][BLOCK_N];       // (TMA) the same for a raw tile, as its loader flagged it
    u8 vnan[STAGES][4];                      // per producer warp, nonzero: its part of the tile has a NaN V code
    u32 abort;                               // nonzero: the CTA hands back (redo[cta] = 1)
    u64 full[STAGES], empty[STAGES];         // mbarriers: tile ready (producer), tile consumed (consumers)
    u64 loaded[RAW_STAGES];                  //   (TMA) a raw tile landed,
    u64 raw_free[RAW_STAGES];                //   (TMA) and was read by every producer thread
};
constexpr int WGMMA_SMEM_BYTES = (int)sizeof(WgmmaShared);

// What producer and consumers agree on about the CTA.
struct Cta {
    int row0, rows, q_lo, h;
    int kb, ke;          // keys visited: [kb, ke); tiles from kb rounded down to BLOCK_N
    int lo_max, hi_min;  // keys every row sees (tiles inside need no mask)
    int n_start, ntiles;
};

// bfloat16 pair of a float16 pair (exact for the e4m3 values widen_native gives).
__device__ __forceinline__ u32 f16x2_to_bf16x2(u32 h) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f16_hi(h)), "f"(f16_lo(h)));
    return r;
}


// ---- the producer ----

// Tile t's copies into its stage: thread (key row krow, chunk ch) copies chunk ch of keys krow + 16 i.
__device__ __forceinline__ void issue_tile(WgmmaShared& sh, const Cta& cta, int t, const int* bt_row, const u8* kbase,
                                           const u8* vbase, i64 k_sb, i64 k_st, i64 v_sb, i64 v_st, int block_size,
                                           int bs_shift, int num_blocks) {
    const int pt = threadIdx.x, ch = pt & 7, krow = pt >> 3, s = t % STAGES;
    const int n0 = cta.n_start + t * BLOCK_N;
    const u32 kdst = smem_addr(sh.kr[s]), vdst = smem_addr(sh.vr[s]);
    // the block ids of the thread's keys first (independent loads: one latency, not one a key)
    int ids[BLOCK_N / 16];
#pragma unroll
    for (int i = 0; i < BLOCK_N / 16; ++i) {
        const int n = n0 + krow + 16 * i;
        ids[i] = n >= cta.kb && n < cta.ke ? __ldg(bt_row + (bs_shift >= 0 ? n >> bs_shift : n / block_size)) : -1;
    }
#pragma unroll
    for (int i = 0; i < BLOCK_N / 16; ++i) {
        const int key = krow + 16 * i, n = n0 + key;
        const int page = bs_shift >= 0 ? n >> bs_shift : n / block_size;
        const bool ok = ids[i] >= 0 && ids[i] < num_blocks;
        const i64 blk = ok ? ids[i] : 0;
        const i64 in_block = n - page * block_size;
        cp_async16(kdst + key * RAW_PITCH + 16 * ch, kbase + blk * k_sb + in_block * k_st + 16 * ch, ok);
        cp_async16(vdst + key * RAW_PITCH + 16 * ch, vbase + blk * v_sb + in_block * v_st + 16 * ch, ok);
        if (ch == 0) sh.valid[s][key] = ok ? 1 : 0;
    }
    cp_async_commit();
}

// Byte b of raw key row `key` in a raw tile
__device__ __forceinline__ u32 raw_off(int key, int b) { return TMA ? sw128(key, b) : (u32)(key * RAW_PITCH + b); }

// Raw tile rs (landed) to K in the query's type and V^T in float16 in stage s; returns this thread's
// NaN-V-byte bits. ZERO_INVALID: V rows of keys not flagged in raw_valid[rs] are taken as zeros (TMA
// loads whole pages).
template <bool ZERO_INVALID>
__device__ __forceinline__ int widen_tile(WgmmaShared& sh, int rs, int s) {
    const int pt = threadIdx.x, warp = pt >> 5, lane = pt & 31;
    // K: thread (kq, ch, kg) widens chunk ch (16 codes) of keys 8 (2 i + kg) + kq into 32 bytes (the 8
    // lanes of a quarter warp take 8 keys of one chunk: conflict-free reads, in either raw layout, and stores)
    {
        const int kq = pt & 7, ch = (pt >> 3) & 7, kg = pt >> 6;
        uint4 xs[BLOCK_N / 16];  // (every load first: one shared-memory latency, not one a row)
#pragma unroll
        for (int i = 0; i < BLOCK_N / 16; ++i)
            xs[i] = *reinterpret_cast<const uint4*>(sh.kr[rs] + raw_off(8 * (2 * i + kg) + kq, 16 * ch));
#pragma unroll
        for (int i = 0; i < BLOCK_N / 16; ++i) {
            const int key = 8 * (2 * i + kg) + kq;
            const uint4 x = xs[i];
            const u32 w[4] = {x.x, x.y, x.z, x.w};
            u32 o[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // codes 4 j .. 4 j + 3: exact in float16 (codec.cuh), then bfloat16
                widen_native(w[j], o[2 * j], o[2 * j + 1]);
                if constexpr (BF16) {
                    o[2 * j] = f16x2_to_bf16x2(o[2 * j]);
                    o[2 * j + 1] = f16x2_to_bf16x2(o[2 * j + 1]);
                }
            }
            *reinterpret_cast<uint4*>(sh.k[s] + kmajor(key, 32 * ch, SBO16)) = make_uint4(o[0], o[1], o[2], o[3]);
            *reinterpret_cast<uint4*>(sh.k[s] + kmajor(key, 32 * ch + 16, SBO16)) = make_uint4(o[4], o[5], o[6], o[7]);
        }
    }
    // V^T: warp `warp` takes keys 16 warp .. 16 warp + 15; per step (kh, dh) lane (a, w) = (lane % 16,
    // lane / 16) moves the 4 x 4 byte block of keys key0 .. key0 + 3 (key0 = 16 warp + 8 kh + 4 w) and
    // dims 64 dh + 4 a .. + 3, widened: V^T[dim][key] at kmajor(dim, 2 key, VT_SBO). The loads are
    // conflict-free in both raw layouts (sw128: key % 8 = 4 w + i, so the 32 lanes' 16-byte chunks
    // (4 dh + a / 4) ^ (4 w + i) are 8 different ones), the 8-byte stores take the minimum two wavefronts.
    int nan = 0;
    const int a = lane & 15, w = lane >> 4;
    // (32-bit shared addresses, each the thread's base plus a constant, or an XOR with one, for sw128:
    // raw byte (key0 + i, 64 dh + 4 a) = row * 128 + 16 ((4 dh + a / 4) ^ (4 w + i)) + 4 (a % 4))
    const u32 src = smem_addr(sh.vr[rs]) + (u32)(16 * warp + 4 * w) * RAW_PITCH + (TMA ? 4 * (a & 3) : 4 * a);
    const u32 swz = (u32)(64 * w + 16 * (a >> 2));
    const u32 dst = smem_addr(sh.vt[s]) + kmajor(4 * a, 32 * warp + 8 * w, VT_SBO);  // dims 4 a + j: + 16 j
    u32 xs[2][2][4];  // (every load first)
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
        for (int dh = 0; dh < 2; ++dh)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 row = src + (u32)((8 * kh + i) * RAW_PITCH);
                const u32 at = TMA ? row + (swz ^ (u32)(64 * dh + 16 * i)) : row + (u32)(64 * dh);
                asm volatile("ld.shared.b32 %0, [%1];" : "=r"(xs[kh][dh][i]) : "r"(at));
            }
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
#pragma unroll
        for (int dh = 0; dh < 2; ++dh) {
            u32 x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[i] = xs[kh][dh][i];
                if (ZERO_INVALID && !sh.raw_valid[rs][16 * warp + 8 * kh + 4 * w + i]) x[i] = 0u;
                nan |= (int)nonfinite_bytes(x[i]);
            }
            u32 y[4];
            transpose4x4(x, y);
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // dim 64 dh + 4 a + j, keys key0 .. key0 + 3, in float16
                u32 lo, hi;
                widen_native(y[j], lo, hi);
                asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(dst + (u32)(8 * dh * VT_SBO + 128 * kh + 16 * j)),
                             "r"(lo), "r"(hi));
            }
        }
    }
    return nan;
}

__device__ void produce(WgmmaShared& sh, const Cta& cta, const int* bt_row, const u8* kbase, const u8* vbase,
                        i64 k_sb, i64 k_st, i64 v_sb, i64 v_st, int block_size, int num_blocks) {
    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    auto issue = [&](int t) {
        issue_tile(sh, cta, t, bt_row, kbase, vbase, k_sb, k_st, v_sb, v_st, block_size, bs_shift, num_blocks);
    };
    auto finish = [&](int t) {  // (its stage's readers, tile t - STAGES's consumers, are done)
        const int nan = widen_tile<false>(sh, t % STAGES, t % STAGES);
        const bool any = __any_sync(0xFFFFFFFFu, nan != 0);
        if ((threadIdx.x & 31) == 0) sh.vnan[t % STAGES][threadIdx.x >> 5] = any ? 1 : 0;
    };
    producer_pipeline<STAGES>(sh.full, sh.empty, cta.ntiles, issue, finish);
}

// The TMA loads' tensor maps (fp8kv_cuda.tma.paged_cache_maps): each cache as a 4-d uint8 tensor (128
// codes, X, Y, blocks), 128-byte swizzle, box (128, 1 or box_rows, box_rows or 1, 1); X, Y = KV head, key
// in the page when head_inner (the smaller stride first), else the other way round.
struct TmaMaps {
    const TensorMap *k, *v;
    int head_inner, box_rows;  // box_rows = min(page, BLOCK_N); BLOCK_N % page == 0 or page % BLOCK_N == 0
};

// Tile t's raw K and V codes into raw tile t % RAW_STAGES by one warp (lane 0..31), landing on
// sh.loaded[rs] (one arrival: the expect_tx), with the flags of its keys in raw_valid[rs] (lane l: keys
// 2 l, 2 l + 1). A box's block id is read only for a box starting before the CTA's last key (n < ke <=
// the clamped length <= the table's keys: inside the table row).
__device__ __forceinline__ void load_tile_tma(WgmmaShared& sh, const Cta& cta, const TmaMaps& tm, const int* bt_row,
                                              int t, int lane, int block_size, int bs_shift, int num_blocks) {
    const int rs = t % RAW_STAGES, n0 = cta.n_start + t * BLOCK_N;
    auto page_of = [&](int n) { return bs_shift >= 0 ? n >> bs_shift : n / block_size; };
    u32 flags = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int n = n0 + 2 * lane + j;
        const int id = n >= cta.kb && n < cta.ke ? __ldg(bt_row + page_of(n)) : -1;
        flags |= (u32)(id >= 0 && id < num_blocks) << (8 * j);
    }
    reinterpret_cast<unsigned short*>(sh.raw_valid[rs])[lane] = (unsigned short)flags;
    __syncwarp();
    if (lane == 0) mbar_arrive_expect_tx(&sh.loaded[rs], 2 * BLOCK_N * 128);  // (releases the warp's flags)
    tma_load_boxes(
        smem_addr(sh.kr[rs]), smem_addr(sh.vr[rs]), tm.k, tm.v, &sh.loaded[rs], n0, BLOCK_N, tm.box_rows, tm.head_inner,
        cta.h, num_blocks, lane, [&](int n) { return n < cta.ke ? __ldg(bt_row + page_of(n)) : -1; },
        [&](int n) { return n - page_of(n) * block_size; });
}

// The producer with TMA loads, RAW_STAGES tiles in flight: all four warps widen tile t (raw tile
// rs = t % RAW_STAGES) into stage t % STAGES once its consumers are done with that stage, copy its key
// flags there, hand it over on full[s] and release the raw tile on raw_free[rs]; warp t % 4 then waits
// for that release and loads tile t + RAW_STAGES into it (no barrier across the producer's warps).
__device__ void produce_tma(WgmmaShared& sh, const Cta& cta, const TmaMaps& tm, const int* bt_row, int block_size,
                            int num_blocks) {
    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp == 0) {
        for (int t = 0; t < RAW_STAGES && t < cta.ntiles; ++t)
            load_tile_tma(sh, cta, tm, bt_row, t, lane, block_size, bs_shift, num_blocks);
    }
    for (int t = 0; t < cta.ntiles; ++t) {
        const int s = t % STAGES, rs = t % RAW_STAGES;
        mbar_wait(&sh.empty[s], ((t / STAGES) & 1) ^ 1);
        mbar_wait(&sh.loaded[rs], (t / RAW_STAGES) & 1);
        const bool all_valid = __all_sync(
            0xFFFFFFFFu, lane >= BLOCK_N / 4 || reinterpret_cast<const u32*>(sh.raw_valid[rs])[lane] == 0x01010101u);
        const int nan = all_valid ? widen_tile<false>(sh, rs, s) : widen_tile<true>(sh, rs, s);
        if (threadIdx.x < BLOCK_N / 4)
            reinterpret_cast<u32*>(sh.valid[s])[threadIdx.x] = reinterpret_cast<const u32*>(sh.raw_valid[rs])[threadIdx.x];
        const bool any = __any_sync(0xFFFFFFFFu, nan != 0);
        if (lane == 0) sh.vnan[s][warp] = any ? 1 : 0;  // (its readers, tile t - STAGES's consumers, are done)
        fence_async_shared();
        mbar_arrive(&sh.full[s]);
        mbar_arrive(&sh.raw_free[rs]);
        if (warp == (t & 3) && t + RAW_STAGES < cta.ntiles) {
            mbar_wait(&sh.raw_free[rs], (t / RAW_STAGES) & 1);
            load_tile_tma(sh, cta, tm, bt_row, t + RAW_STAGES, lane, block_size, bs_shift, num_blocks);
        }
    }
}

// ---- the consumers ----

struct RowState {
    float m[2], l[2];  // running maximum (base-2 logits) and this thread's partial row sums
    int lo[2], hi[2];  // the keys each of the thread's two rows sees
};

// Tile at n0 in stage s: mask an edge tile, logits s * fs, the running maximum, p = 2^(logit - m)
// (l += p), O *= 2^(m_old - m_new) where the maximum moved, P as float16 A fragments: word 0 / 1 =
// rows r / r + 8, keys 16 kk + 2c, + 1; words 2 / 3 the same 8 keys on (CLayout_64x16 = ALayout_64x16).
template <bool SPLIT_P>
__device__ __forceinline__ void softmax_tile(const WgmmaShared& sh, int s, int n0, const Cta& cta, float fs,
                                             RowState& rs, float (&sa)[32], float (&o)[64], u32 (&pa)[4][4],
                                             u32 (&pl)[4][4]) {
    const int lane = threadIdx.x & 31, c = lane & 3;
    const bool all_valid =
        __all_sync(0xFFFFFFFFu, lane >= BLOCK_N / 4 || reinterpret_cast<const u32*>(sh.valid[s])[lane] == 0x01010101u);
    const bool interior = all_valid && n0 >= cta.lo_max && n0 + BLOCK_N <= cta.hi_min;
    if (!interior) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = 8 * j + 2 * c + (e & 1), n = n0 + key, h = e >> 1;
                const bool vis = sh.valid[s][key] && n >= rs.lo[h] && n < rs.hi[h];
                sa[4 * j + e] = vis ? sa[4 * j + e] : NEG_INF;
            }
    }
    float mx[2], msafe[2], alpha[2];
    row_max(sa, mx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float mnew = fmaxf(rs.m[h], __fmul_rn(mx[h], fs));  // (fs > 0: the maximum of the logits)
        msafe[h] = mnew == NEG_INF ? 0.0f : mnew;
        alpha[h] = exp2_approx(rs.m[h] - msafe[h]);  // (0 from -inf)
        rs.m[h] = mnew;
        rs.l[h] *= alpha[h];
    }
    rescale_rows(o, alpha);
    float lsum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int h = (i >> 1) & 1;
        // rounded product, then the difference: the row's maximum gives 2^0 (a fused multiply-add
        // would keep the product's rounding error, up to half an ulp of a logit near 2^126)
        sa[i] = exp2_approx(__fsub_rn(__fmul_rn(sa[i], fs), msafe[h]));  // (masked: 2^-inf = 0)
        lsum[h][i & 1] += sa[i];
    }
    rs.l[0] += lsum[0][0] + lsum[0][1];
    rs.l[1] += lsum[1][0] + lsum[1][1];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // n-tile 2 kk + (w >> 1), rows r + 8 (w & 1)
            const float* p = sa + 4 * (2 * kk + (w >> 1)) + 2 * (w & 1);
            pa[kk][w] = pack_f16x2(p[0], p[1]);
            if constexpr (SPLIT_P) pl[kk][w] = pack_f16x2(p[0] - f16_lo(pa[kk][w]), p[1] - f16_hi(pa[kk][w]));
        }
}

template <bool SPLIT_P>
__device__ void consume(WgmmaShared& sh, const Cta& cta, int cw, float fs, float (&o)[64], RowState& rs) {
    const int ct = threadIdx.x - 128 * (cw + 1);
    float sa[32];
    u32 pa[4][4], pl[4][4];
    const u64 dq = desc(smem_addr(sh.q + 16384 * cw), SBO16);
    auto issue = [&](int t) {  // O += P(t-1) V(t-1), S = Q K(t)^T (16 keys / 16 dims a k step: +256 bytes)
        if (t >= 1) {
            const u64 dv = desc(smem_addr(sh.vt[(t - 1) % STAGES]), VT_SBO);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                wgmma_f16_rs_n128(o, pa[kk], dv + 16 * kk);
                if constexpr (SPLIT_P) wgmma_f16_rs_n128(o, pl[kk], dv + 16 * kk);
            }
        }
        if (t < cta.ntiles) {
            const u64 dk = desc(smem_addr(sh.k[t % STAGES]), SBO16);
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) wgmma_16_ss_n64<BF16>(sa, dq + 16 * ks, dk + 16 * ks, ks > 0);
        }
    };
    auto done = [&](int t) {
        fence_acc(o);
        fence_acc(sa);
        if (t == cta.ntiles) return;
        const int s = t % STAGES, n0 = cta.n_start + t * BLOCK_N;
        if ((n0 < cta.lo_max || n0 + BLOCK_N > cta.hi_min) && *reinterpret_cast<const u32*>(sh.vnan[s]) != 0u &&
            (ct & 127) == 0)
            atomicOr(&sh.abort, 1u);  // a NaN V code where some row does not see the whole tile
        softmax_tile<SPLIT_P>(sh, s, n0, cta, fs, rs, sa, o, pa, pl);
    };
    consumer_pipeline<STAGES, PINGPONG>(sh.full, sh.empty, cta.ntiles, cw, issue, done);
}

}  // namespace fp8kv

// Parameters and grid as fp8kv_prefill_mma (use_cap == 0: the launcher's choice).
// FP8KV_TMA: tmap_k, tmap_v, tma_head_inner and tma_box_rows as TmaMaps describes (unused without).
extern "C" __global__ void __launch_bounds__(THREADS, 1) fp8kv_prefill_wgmma(FP8KV_ATTENTION_PARAMS(D_arg),
                                                                              int* __restrict__ redo,
                                                                              const __grid_constant__ TensorMap tmap_k,
                                                                              const __grid_constant__ TensorMap tmap_v,
                                                                              int tma_head_inner, int tma_box_rows) {
    extern __shared__ __align__(1024) u8 wgmma_smem[];
    trap_unless_smem(WGMMA_SMEM_BYTES);
    if (smem_addr(wgmma_smem) & 1023u) __trap();  // (the swizzled raw tiles need 1024-byte alignment)
    WgmmaShared& sh = *reinterpret_cast<WgmmaShared*>(wgmma_smem);
    const PrefillCta pc = prefill_cta(num_seqs);
    const i64 cta_id = pc.id;
    const int s = pc.s, z = pc.z;
    const RowKeys rk = row_keys(qsl, seq_lens, s, z, T, group, window, causal, max_blocks, block_size, keys_per_split);
    Cta cta;
    cta.h = pc.h;
    cta.q_lo = rk.q_lo;
    cta.rows = rk.rows;
    cta.row0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;  // the longest rows (causal) start first
    if (cta.row0 >= cta.rows) {  // uniform over the CTA
        if (threadIdx.x == 0) redo[cta_id] = 0;
        return;
    }
    const CtaKeys ck = cta_keys(rk, cta.row0, BLOCK_M);
    cta.kb = ck.kb;
    cta.ke = ck.ke;
    cta.lo_max = ck.lo_max;
    cta.hi_min = ck.hi_min;
    cta.n_start = cta.kb / BLOCK_N * BLOCK_N;
    cta.ntiles = cta.ke > cta.n_start ? (cta.ke - cta.n_start + BLOCK_N - 1) / BLOCK_N : 0;
    const bool split_p = ck.split_p;

    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(&sh.full[st], 128);
            mbar_init(&sh.empty[st], 256);
        }
        for (int st = 0; st < RAW_STAGES; ++st) {
            mbar_init(&sh.loaded[st], 1);
            mbar_init(&sh.raw_free[st], 128);
        }
        fence_mbarrier_init();  // (visible to the TMA unit)
        sh.abort = 0u;
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        producer_registers<PRODUCER_REGS_WIDEN, CONSUMER_REGS_WIDEN>();
        if constexpr (TMA) {
            const TmaMaps tm{&tmap_k, &tmap_v, tma_head_inner, tma_box_rows};
            produce_tma(sh, cta, tm, block_tables + (i64)s * bt_stride, block_size, num_blocks);
        } else {
            produce(sh, cta, block_tables + (i64)s * bt_stride, key_cache + (i64)cta.h * k_sh,
                    value_cache + (i64)cta.h * v_sh, k_sb, k_st, v_sb, v_st, block_size, num_blocks);
        }
        return;
    }
    consumer_registers<PRODUCER_REGS_WIDEN, CONSUMER_REGS_WIDEN>();
    const int cw = threadIdx.x >= 256 ? 1 : 0, ct = threadIdx.x - 128 * (cw + 1);
    const int warp = ct >> 5, lane = ct & 31, r = lane >> 2, c = lane & 3;

    // Q as it is (16-bit) into shared memory: thread ct stages half (64 dims) of row ct / 2; the row's
    // max |q| decides whether every logit is s * fs without overflow (else the CTA hands back)
    float f1, f2;
    scale_factors(k_scale[(i64)cta.h * ks_sh], g_mant, g_exp, f1, f2);
    const float fs = f1 * f2;
    bool simple;
    {
        const int ql = ct >> 1, half = ct & 1, row = cta.row0 + 64 * cw + ql;
        const bool valid = row < cta.rows;
        const i64 base = ((i64)(cta.q_lo + (valid ? row / group : 0)) * HQ + (i64)cta.h * group + row % group) * D + 64 * half;
        const uint4* src = reinterpret_cast<const uint4*>(query + base);
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint4 x = valid ? src[j] : make_uint4(0u, 0u, 0u, 0u);
            const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const q_t lo = (q_t)(w[k] & 0xFFFFu), hi = (q_t)(w[k] >> 16);
                amax = fmaxf(amax, fmaxf(fabsf(load_q(&lo, 0)), fabsf(load_q(&hi, 0))));  // (NaN: ignored)
            }
            *reinterpret_cast<uint4*>(sh.q + 16384 * cw + kmajor(ql, 128 * half + 16 * j, SBO16)) = x;
        }
        // |q . k| <= D max|q| max|code|: the logit s * fs cannot overflow, and fs is a normal float
        simple = !use_cap && fs >= 1.1754943508222875e-38f && fs < FLOAT32_MAX &&
                 (float)D * amax * u2f(FP8KV_MAXBITS) * fs <= 0x1p126f;
    }
    fence_async_shared();
    if (!named_sync_and(2 + cw, 128, simple) && ct == 0) atomicOr(&sh.abort, 1u);

    RowState rs;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rs.m[h] = NEG_INF;
        rs.l[h] = 0.0f;
        rk.span(cta.row0 + 64 * cw + 16 * warp + r + 8 * h, rs.lo[h], rs.hi[h]);
    }
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    if (split_p) consume<true>(sh, cta, cw, fs, o, rs);
    else consume<false>(sh, cta, cw, fs, o, rs);

    named_sync(6, 256);  // every consumer's abort flags are set
    const bool abort = sh.abort != 0u;
    if (threadIdx.x == 128) redo[cta_id] = abort ? 1 : 0;
    if (abort) return;
    const float vs = v_scale[(i64)cta.h * vs_sh];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = rs.l[h];
        l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
        l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
        const int row = cta.row0 + 64 * cw + 16 * warp + r + 8 * h;
        if (row >= cta.rows) continue;
        const i64 orow = (i64)(cta.q_lo + row / group) * HQ + (i64)cta.h * group + row % group;
        if (split) {  // the split's partial (O, m, l) for the merge
            const i64 prow = (i64)z * T * HQ + orow;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *reinterpret_cast<float2*>(&part_acc[prow * D + 8 * j + 2 * c]) =
                    make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
            if (c == 0) { part_ml[prow * 3] = rs.m[h]; part_ml[prow * 3 + 1] = l; part_ml[prow * 3 + 2] = 0.0f; }
            continue;
        }
        const float mul = fdiv(1.0f, l > 0.0f ? l : 1.0f);
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) store_out(out, orow * D + 8 * j + 2 * c + e, o[4 * j + 2 * h + e] * mul * vs);
        if (write_lse && c == 0) lse[orow] = l > 0.0f ? (rs.m[h] + log2f(l)) * LN2 : NEG_INF;
    }
}

// The layout test (tests/test_cuda_gpu.py): one warpgroup runs the kernel's operand layouts, the
// producer's K widening and V transpose, and both wgmma forms on Q [64 x 128] (query type), K and V
// [64 x 128] (e4m3 codes): S = Q K^T (float32), P = float16(S * p_scale) through the A-register
// packing, O = P V.
extern "C" __global__ void __launch_bounds__(128, 1) fp8kv_wgmma16_layout_test(const q_t* __restrict__ Q,
                                                                                const u8* __restrict__ K,
                                                                                const u8* __restrict__ V,
                                                                                float* __restrict__ S_out,
                                                                                u16* __restrict__ P_out,
                                                                                float* __restrict__ O_out,
                                                                                float p_scale) {
    extern __shared__ __align__(1024) u8 wgmma_smem[];
    trap_unless_smem(WGMMA_SMEM_BYTES);
    if (smem_addr(wgmma_smem) & 1023u) __trap();
    WgmmaShared& sh = *reinterpret_cast<WgmmaShared*>(wgmma_smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, c = lane & 3;
    for (int i = tid; i < 64 * 16; i += 128)  // Q rows: 16 chunks of 16 bytes
        *reinterpret_cast<uint4*>(sh.q + kmajor(i >> 4, 16 * (i & 15), SBO16)) = reinterpret_cast<const uint4*>(Q)[i];
    for (int i = tid; i < 64 * 8; i += 128) {
        *reinterpret_cast<uint4*>(sh.kr[0] + raw_off(i >> 3, 16 * (i & 7))) = reinterpret_cast<const uint4*>(K)[i];
        *reinterpret_cast<uint4*>(sh.vr[0] + raw_off(i >> 3, 16 * (i & 7))) = reinterpret_cast<const uint4*>(V)[i];
    }
    __syncthreads();
    widen_tile<false>(sh, 0, 0);
    fence_async_shared();
    __syncthreads();
    float sa[32], o[64];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
        wgmma_16_ss_n64<BF16>(sa, desc(smem_addr(sh.q), SBO16) + 16 * ks, desc(smem_addr(sh.k[0]), SBO16) + 16 * ks, ks > 0);
    wgmma_commit();
    wgmma_wait0();
    fence_acc(sa);
    u32 pa[4][4];
    store_acc(S_out, 64, sa, tid);
#pragma unroll
    for (int i = 0; i < 32; ++i) sa[i] *= p_scale;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float* p = sa + 4 * (2 * kk + (w >> 1)) + 2 * (w & 1);
            pa[kk][w] = pack_f16x2(p[0], p[1]);
            const int row = 16 * warp + r + 8 * (w & 1), col = 16 * kk + 8 * (w >> 1) + 2 * c;
            P_out[row * 64 + col] = (u16)(pa[kk][w] & 0xFFFFu);
            P_out[row * 64 + col + 1] = (u16)(pa[kk][w] >> 16);
        }
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_f16_rs_n128(o, pa[kk], desc(smem_addr(sh.vt[0]), VT_SBO) + 16 * kk);
    wgmma_commit();
    wgmma_wait0();
    fence_acc(o);
    store_acc(O_out, 128, o, tid);
}
