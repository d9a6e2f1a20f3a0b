// fp8kv_cuda: chunked prefill on Volta's tensor cores, for float16 queries, per-tensor or per-head
// scales, head size 128.
//
// Volta (sm70) has mma.sync m8n8k4 only: each quad pair of a warp computes its own 8x8x4 product,
// with fragment layouts unlike the m16n8k16 ones prefill_mma.cu is built on (sm75+). This kernel
// goes through PTX's wmma m16n16k16 instructions instead, which ptxas lowers to each architecture's
// own tensor-core shape (sm70's m8n8k4: documented, not inspected here, no disassembler at hand reads
// sm70; sm90's build shows HMMA.16816), and keeps the operands in shared memory, where their
// layout is plain row-major: the kernel never needs the register layout of an operand, and the one
// of the accumulator only as a table (row, column) per element, read back once from a wmma.load.c
// of the matrix 16 r + c. `auto` runs it on sm70/sm72; it compiles for every architecture (the same
// source runs on the H100 in the GPU tests).
//
// Grid (query tiles, H, S * num_splits), PNT = 256 threads. A CTA owns BLOCK_M = 128 rows of one
// sequence and KV head (prefill_rows.cuh) and the keys of split z; warp w owns rows 16 w .. 16 w +
// 15 (one m-tile: O takes 64 registers a thread), and lanes i and i + 16 of warp w keep the softmax
// of row 16 w + i, each for half of a step's keys. Per step of BLOCK_N = 32 keys:
//   1. every thread widens its share of the step's K and V codes (loaded into registers during the
//      previous step) into float16 tiles in shared memory (one barrier before, one after);
//   2. S[16 rows x 32 keys] = Q K^T per warp (wmma, float32 accumulation), stored to the warp's S
//      tile;
//   3. lanes i, i + 16 read row i of S: logits, mask, the online softmax (the running maximum raised only
//      past m_run + TAU, as prefill_mma.cu), and writes P in float16 over the S tile (hi, and lo =
//      p - hi when a row sees fewer than FP8KV_FULL_P_KEYS keys);
//   4. O[16 rows x 128 dims] += P V (wmma; O stays in the accumulator fragments, rescaled through the
//      element table when the maximum is raised).
//
// Exactness: as prefill_mma.cu. Float16 K and V are exact widenings of the codes (the bit-level one;
// a step with a code it gets wrong, or with a NaN/inf code, stops the CTA: fp8kv_prefill_wmma_exact
// redoes it through the software decoder, with NaN/inf V codes entering p @ v as 0 and added back as
// p * v for the rows that see their key); products are exact in float32 and accumulated in float32.
//
// Memory safety without host checks: as prefill_mma.cu (prefill_rows.cuh, prefill_common.cuh).
//
// Macros: FP8KV_QT (1: float16), FP8KV_D (128), FP8KV_FULL_P_KEYS, FP8KV_SMEM_BYTES (the launcher's
// dynamic shared memory, at least sizeof(WmmaShared)), and the format's.
#include "prefill_common.cuh"

namespace fp8kv {

constexpr int D = FP8KV_D;
constexpr int PWARPS = 8;
constexpr int PNT = 32 * PWARPS;  // threads per CTA
constexpr int BLOCK_M = 16 * PWARPS;
constexpr int BLOCK_N = 32;       // keys per step
constexpr int CPR = D / 16;       // 16-byte chunks of codes per K/V row
constexpr int DT = D / 16;        // 16-wide tiles along the head dimension
constexpr int LDH = D + 8;        // halves per row of the float16 Q, K and V tiles (16 bytes of padding)
constexpr int LDS = BLOCK_N + 12; // floats per row of a warp's S tile (44: the float4 reads of a row's
                                  // half are free of bank conflicts, and P hi + lo fit over it)
constexpr int LDP = BLOCK_N + 8;  // halves per row of P (40: conflict-free 16-byte writes by row)
constexpr float TAU = 8.0f;       // log2 of the largest weight before the maximum is raised

static_assert(QT == 1, "prefill_wmma.cu: float16 queries (Volta's tensor cores take float16 only)");
static_assert(D == 128, "prefill_wmma.cu: head size 128");
static_assert(PNT == BLOCK_N * CPR, "prefill_wmma.cu: each thread copies one chunk of K and one of V");
static_assert(2 * 16 * LDP * 2 <= 16 * LDS * 4, "prefill_wmma.cu: P (hi, lo) fits over the S tile");

struct __align__(128) WmmaShared {
    u16 q[BLOCK_M][LDH];           // Q (float16 bits; zero past the sequence's rows)
    u16 k[BLOCK_N][LDH];           // the step's K, widened to float16
    u16 v[BLOCK_N][LDH];           // the step's V, widened (the exact kernel: NaN/inf codes as 0)
    float s[PWARPS][16][LDS];      // per warp: S, the weights, then P in float16 (hi, lo) over it
    uint4 vraw[BLOCK_N][CPR];      // the step's V codes (the exact kernel's fix-up)
    u32 valid[PWARPS];             // per warp: bits of the step's keys it copied whose block is valid
    u32 vnan[PWARPS];              // per warp: bits of those keys with a NaN/inf V code
    u32 qmax[PWARPS];
    Keys keys;
};
static_assert(sizeof(WmmaShared) <= FP8KV_SMEM_BYTES, "prefill_wmma.cu: the launcher's shared memory is too small");

// ------------------------------------------------------------------ PTX wmma m16n16k16 (float16 in, float32 out)

struct FragAB {
    u32 x[8];  // 16 float16 (the layout is the architecture's)
};
struct FragC {
    float x[8];
};

template <int LD>
__device__ __forceinline__ void load_a(FragAB& a, u32 addr) {  // row-major A, LD halves per row
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                 : "=r"(a.x[0]), "=r"(a.x[1]), "=r"(a.x[2]), "=r"(a.x[3]), "=r"(a.x[4]), "=r"(a.x[5]), "=r"(a.x[6]),
                   "=r"(a.x[7])
                 : "r"(addr), "n"(LD) : "memory");
}

template <int LD, bool ROW>
__device__ __forceinline__ void load_b(FragAB& b, u32 addr) {  // B (k x n) stored row-major (ROW) or column-major
    if constexpr (ROW) {
        asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                     : "=r"(b.x[0]), "=r"(b.x[1]), "=r"(b.x[2]), "=r"(b.x[3]), "=r"(b.x[4]), "=r"(b.x[5]),
                       "=r"(b.x[6]), "=r"(b.x[7])
                     : "r"(addr), "n"(LD) : "memory");
    } else {
        asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                     : "=r"(b.x[0]), "=r"(b.x[1]), "=r"(b.x[2]), "=r"(b.x[3]), "=r"(b.x[4]), "=r"(b.x[5]),
                       "=r"(b.x[6]), "=r"(b.x[7])
                     : "r"(addr), "n"(LD) : "memory");
    }
}

// d += a . b (B row-major or column-major, as loaded)
template <bool ROW>
__device__ __forceinline__ void mma16(FragC& d, const FragAB& a, const FragAB& b) {
#define FP8KV_WMMA_OPERANDS                                                                                   \
    : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3]), "+f"(d.x[4]), "+f"(d.x[5]), "+f"(d.x[6]),       \
      "+f"(d.x[7])                                                                                            \
    : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(a.x[4]), "r"(a.x[5]), "r"(a.x[6]), "r"(a.x[7]), \
      "r"(b.x[0]), "r"(b.x[1]), "r"(b.x[2]), "r"(b.x[3]), "r"(b.x[4]), "r"(b.x[5]), "r"(b.x[6]), "r"(b.x[7])
    if constexpr (ROW) {
        asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                     "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, "
                     "{%0,%1,%2,%3,%4,%5,%6,%7};" FP8KV_WMMA_OPERANDS);
    } else {
        asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                     "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, "
                     "{%0,%1,%2,%3,%4,%5,%6,%7};" FP8KV_WMMA_OPERANDS);
    }
#undef FP8KV_WMMA_OPERANDS
}

template <int LD>
__device__ __forceinline__ void store_c(u32 addr, const FragC& c) {  // row-major, LD floats per row
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                 ::"r"(addr), "f"(c.x[0]), "f"(c.x[1]), "f"(c.x[2]), "f"(c.x[3]), "f"(c.x[4]), "f"(c.x[5]),
                   "f"(c.x[6]), "f"(c.x[7]), "n"(LD) : "memory");
}

template <int LD>
__device__ __forceinline__ void load_c(FragC& c, u32 addr) {
    asm volatile("wmma.load.c.sync.aligned.row.m16n16k16.shared.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                 : "=f"(c.x[0]), "=f"(c.x[1]), "=f"(c.x[2]), "=f"(c.x[3]), "=f"(c.x[4]), "=f"(c.x[5]), "=f"(c.x[6]),
                   "=f"(c.x[7])
                 : "r"(addr), "n"(LD) : "memory");
}

// Where each accumulator element lies in its 16 x 16 tile: row (bits 4e..4e+3 of rows) and column
// (of cols) of element e, read back from a wmma.load.c of the matrix 16 r + c (scratch: 1 KiB of the
// warp's shared memory, 32-byte aligned).
struct Elements {
    u32 rows, cols;
    __device__ __forceinline__ int row(int e) const { return (rows >> (4 * e)) & 15; }
    __device__ __forceinline__ int col(int e) const { return (cols >> (4 * e)) & 15; }
};

__device__ __forceinline__ Elements element_table(float* scratch) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < 256; i += 32) scratch[i] = (float)i;
    __syncwarp();
    FragC t;
    load_c<16>(t, shared_address(scratch));
    __syncwarp();
    Elements el{0u, 0u};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const u32 rc = (u32)t.x[e];
        el.rows |= (rc >> 4) << (4 * e);
        el.cols |= (rc & 15u) << (4 * e);
    }
    return el;
}

// ------------------------------------------------------------------ the step's K and V

// A thread's share of a step: chunk tid % CPR of key tid / CPR, of K and of V, loaded into registers
// a step ahead (Volta has no cp.async); a key outside [kb, ke) or in a block outside [0, num_blocks)
// is zeros, never read.
struct Fetch {
    uint4 k, v;
    bool live;
};

__device__ __forceinline__ void fetch(const Keys& ks, int n0, Fetch& f) {
    const int ch = threadIdx.x % CPR, n = n0 + (int)threadIdx.x / CPR;
    const int blk = key_block(ks, n);
    f.live = blk >= 0 && blk < ks.num_blocks;
    i64 ok = 0, ov = 0;
    if (f.live) key_offsets(ks, n, blk, ch, ok, ov);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    f.k = f.live ? *reinterpret_cast<const uint4*>(ks.kbase + ok) : zero;
    f.v = f.live ? *reinterpret_cast<const uint4*>(ks.vbase + ov) : zero;
}

// 16 codes as 16 float16 at dst (32 bytes).
template <bool EXACT>
__device__ __forceinline__ void widen16(const uint4& x, u16* dst) {
    u32 h[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) widen4<5, EXACT>(word(x, w), h[2 * w], h[2 * w + 1]);
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(h[0], h[1], h[2], h[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

// The step's tiles from f; the per-warp key bits. Returns (the fast kernel) nonzero where a code of
// the thread's share needs the exact kernel: one the bit-level widening gets wrong, an inf/NaN K code
// of a format with inf, or a NaN/inf V code.
template <bool EXACT>
__device__ __forceinline__ u32 store_step(WmmaShared& sh, const Fetch& f) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, ch = tid % CPR, key = tid / CPR;
    u32 special = 0u, nf = 0u;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const u32 kw = word(f.k, w), vw = word(f.v, w);
        nf |= nonfinite_bytes(vw);
        if constexpr (!EXACT) special |= has_special<5>(kw) | (HASINF ? nonfinite_bytes(kw) : 0u) | has_special<5>(vw) | nf;
    }
    widen16<EXACT>(f.k, &sh.k[key][16 * ch]);
    uint4 v = f.v;
    if constexpr (EXACT) v = make_uint4(zero_nonfinite(v.x), zero_nonfinite(v.y), zero_nonfinite(v.z), zero_nonfinite(v.w));
    widen16<EXACT>(v, &sh.v[key][16 * ch]);
    sh.vraw[key][ch] = f.v;
    // lanes 0, CPR, 2 CPR, 3 CPR of the warp hold keys 4 warp + [0, 4); a key's NaN flag is the OR
    // over its CPR lanes
    const u32 valid = key_bits(__ballot_sync(0xFFFFFFFFu, f.live && ch == 0), warp, 0);
    const u32 b = __ballot_sync(0xFFFFFFFFu, nf != 0u);
    const u32 vnan = key_bits(b | (b >> 1) | (b >> 2) | (b >> 3) | (b >> 4) | (b >> 5) | (b >> 6) | (b >> 7), warp, 0);
    if (lane == 0) {
        sh.valid[warp] = valid;
        sh.vnan[warp] = vnan;
    }
    return special;
}

// ------------------------------------------------------------------ one step

// The softmax state of lanes i and i + 16 of a warp: row 16 warp + i.
struct RowState {
    float m_run, l_run;
    int lo, hi;  // the row's visible keys [lo, hi) in this split
};

// O += p v for the step's NaN/inf V codes (0 in the V tile), for the rows that see their key; the S
// tile holds the weights, -1 where the row does not see the key.
__device__ void v_fixup(const WmmaShared& sh, const float* sw, u32 keys, const Elements& el, FragC (&o)[DT]) {
#pragma unroll 1
    for (; keys != 0u; keys &= keys - 1u) {
        const int key = __ffs(keys) - 1;
        const u8* codes = reinterpret_cast<const u8*>(&sh.vraw[key][0]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float p = sw[el.row(e) * LDS + key];
            if (p < 0.0f) continue;
#pragma unroll
            for (int n = 0; n < DT; ++n) {
                const u32 code = codes[16 * n + el.col(e)];
                if (nonfinite_bytes(code)) o[n].x[e] += p * decode(code);
            }
        }
    }
}

template <bool EXACT, bool SPLIT_P>
__device__ __forceinline__ void attend(WmmaShared& sh, int n0, bool interior, u32 valid, u32 vnan, const Logit& lg,
                                       const Elements& el, RowState& st, FragC (&o)[DT]) {
    constexpr int HALF = BLOCK_N / 2;  // keys of a row a lane takes
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane & 15, k0 = HALF * (lane >> 4);
    float* sw = &sh.s[warp][0][0];
    // S = Q K^T (K row-major by key is K^T column-major)
    {
        FragC acc[2];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[n].x[e] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < DT; ++kt) {
            FragAB a, b[2];
            load_a<LDH>(a, shared_address(&sh.q[16 * warp][16 * kt]));
#pragma unroll
            for (int n = 0; n < 2; ++n) load_b<LDH, false>(b[n], shared_address(&sh.k[16 * n][16 * kt]));
#pragma unroll
            for (int n = 0; n < 2; ++n) mma16<false>(acc[n], a, b[n]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) store_c<LDS>(shared_address(sw + 16 * n), acc[n]);
    }
    __syncwarp();
    // lane (r, half): keys k0 + [0, 16) of row r as logits (base 2) x * fs (see prefill_mma.cu),
    // masked where the row does not see a key
    float x[HALF];
#pragma unroll
    for (int j = 0; j < HALF / 4; ++j) {
        const float4 t = reinterpret_cast<const float4*>(sw + r * LDS + k0)[j];
        x[4 * j] = t.x; x[4 * j + 1] = t.y; x[4 * j + 2] = t.z; x[4 * j + 3] = t.w;
    }
    if (!lg.simple) {
#pragma unroll
        for (int j = 0; j < HALF; ++j) {
            float y = (x[j] * lg.f1) * lg.f2;
            if (lg.use_cap) y = lg.soft_cap * tanhf(fdiv(y, lg.soft_cap)) * LOG2E;
            x[j] = saturate(y);
        }
    }
    auto sees = [&](int j) {  // row r sees key k0 + j of the step
        const int key = k0 + j, n = n0 + key;
        return ((valid >> key) & 1u) && n >= st.lo && n < st.hi;
    };
    if (!interior) {
#pragma unroll
        for (int j = 0; j < HALF; ++j) x[j] = sees(j) ? x[j] : NEG_INF;
    }
    const float fs = lg.simple ? lg.fs : 1.0f;
    float mx[4];  // (a tree: the chain of dependent maxima stays short)
#pragma unroll
    for (int j = 0; j < 4; ++j) mx[j] = fmaxf(fmaxf(x[j], x[j + 4]), fmaxf(x[j + 8], x[j + 12]));
    float tmax = fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3]));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 16)) * fs;  // (fs > 0: the maximum of the products)
    float alpha = 1.0f;
    bool rescale = false;
    if (tmax > st.m_run + TAU || (st.m_run == NEG_INF && tmax != NEG_INF)) {
        alpha = exp2_approx(st.m_run - tmax);  // (0 when m_run is -inf)
        st.m_run = tmax;
        rescale = true;
    }
    const float neg_m = st.m_run == NEG_INF ? 0.0f : -st.m_run;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < HALF; ++j) {  // masked: exp2(-inf) = 0
        x[j] = exp2_approx(fmaf(x[j], fs, neg_m));
        sum[j & 3] += x[j];
    }
    float tsum = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    tsum += __shfl_xor_sync(0xFFFFFFFFu, tsum, 16);
    st.l_run = st.l_run * alpha + tsum;
    if (__any_sync(0xFFFFFFFFu, rescale)) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = __shfl_sync(0xFFFFFFFFu, alpha, el.row(e));
#pragma unroll
            for (int n = 0; n < DT; ++n) o[n].x[e] *= a;
        }
    }
    if constexpr (EXACT) {
        if (vnan & valid) {  // (uniform over the warp) the weights, -1 where the row does not see the key
            __syncwarp();
#pragma unroll
            for (int j = 0; j < HALF; ++j) sw[r * LDS + k0 + j] = sees(j) ? x[j] : -1.0f;
            __syncwarp();
            v_fixup(sh, sw, vnan & valid, el, o);
        }
    }
    // P over the S tile (every lane has read its share): hi, and lo = p - hi (SPLIT_P)
    __syncwarp();
    u16* ph = reinterpret_cast<u16*>(sw);
    u16* pl = ph + 16 * LDP;
#pragma unroll
    for (int j = 0; j < HALF / 8; ++j) {
        u32 hi[4], lo[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            hi[t] = pack_f16(x[8 * j + 2 * t], x[8 * j + 2 * t + 1]);
            if constexpr (SPLIT_P) lo[t] = pack_f16(x[8 * j + 2 * t] - f16_lo(hi[t]), x[8 * j + 2 * t + 1] - f16_hi(hi[t]));
        }
        reinterpret_cast<uint4*>(ph + r * LDP + k0)[j] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (SPLIT_P) reinterpret_cast<uint4*>(pl + r * LDP + k0)[j] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
    __syncwarp();
    // O += P V (V row-major by key)
    FragAB pa[2], pb[2];
#pragma unroll
    for (int kt = 0; kt < 2; ++kt) {
        load_a<LDP>(pa[kt], shared_address(ph + 16 * kt));
        if constexpr (SPLIT_P) load_a<LDP>(pb[kt], shared_address(pl + 16 * kt));
    }
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            FragAB b;
            load_b<LDH, true>(b, shared_address(&sh.v[16 * kt][16 * n]));
            mma16<true>(o[n], pa[kt], b);
            if constexpr (SPLIT_P) mma16<true>(o[n], pb[kt], b);
        }
}

// The OR of a per-warp word over the CTA's warps.
__device__ __forceinline__ u32 or_warps(const u32 (&w)[PWARPS]) {
    u32 acc = 0u;
#pragma unroll
    for (int i = 0; i < PWARPS; ++i) acc |= w[i];
    return acc;
}

// The CTA's key loop. The fast kernel (!EXACT) stops at the first step with a code that needs the
// exact kernel and returns false (the exact kernel redoes the CTA).
template <bool EXACT, bool SPLIT_P>
__device__ __forceinline__ bool key_loop(WmmaShared& sh, const CtaKeys& ck, const Logit& lg, const Elements& el,
                                         RowState& st, FragC (&o)[DT]) {
    const int first = ck.kb & ~(BLOCK_N - 1);
    const int steps = ck.ke > first ? (ck.ke - first + BLOCK_N - 1) / BLOCK_N : 0;
    Fetch f;
    if (steps > 0) fetch(sh.keys, first, f);
    for (int i = 0; i < steps; ++i) {
        __syncthreads();  // every warp is done with the previous step's tiles
        const u32 special = store_step<EXACT>(sh, f);
        if (i + 1 < steps) fetch(sh.keys, first + (i + 1) * BLOCK_N, f);  // (in flight during the step)
        if (__syncthreads_or(special != 0u)) return false;  // (never in the exact kernel)
        const int n0 = first + i * BLOCK_N;
        const u32 valid = or_warps(sh.valid), vnan = or_warps(sh.vnan);
        const bool interior = valid == 0xFFFFFFFFu && n0 >= ck.lo_max && n0 + BLOCK_N <= ck.hi_min;
        attend<EXACT, SPLIT_P>(sh, n0, interior, valid, vnan, lg, el, st, o);
    }
    return true;
}

}  // namespace fp8kv

// The kernel body. EXACT = false (fp8kv_prefill_wmma): the bit-level widening; a CTA with a code it
// cannot take sets redo[cta] = 1 and stops without writing. EXACT (fp8kv_prefill_wmma_exact, launched
// after it over the same grid): only those CTAs, every code through the software decoder.
template <bool EXACT>
__device__ __forceinline__ void prefill(FP8KV_ATTENTION_PARAMS(D_arg), int* __restrict__ redo) {
    extern __shared__ uint4 smem[];
    trap_unless_smem((u32)sizeof(WmmaShared));
    WmmaShared& sh = *reinterpret_cast<WmmaShared*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const PrefillCta cta = prefill_cta(num_seqs);
    if (EXACT && redo[cta.id] == 0) return;
    const RowKeys rk = row_keys(qsl, seq_lens, cta.s, cta.z, T, group, window, causal, max_blocks, block_size, keys_per_split);
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;  // the longest rows (causal) start first
    if (row0 >= rk.rows) {  // uniform over the CTA
        if (!EXACT && threadIdx.x == 0) redo[cta.id] = 0;
        return;
    }
    const int my_row = row0 + 16 * warp + (lane & 15);  // the row whose softmax this lane keeps
    RowState st{NEG_INF, 0.0f, 0, 0};
    rk.span(my_row, st.lo, st.hi);
    const CtaKeys ck = cta_keys(rk, row0, BLOCK_M);
    auto out_row = [&](int row) { return (i64)(rk.q_lo + row / group) * HQ + (i64)cta.h * group + row % group; };

    // ---- Q as float16 bits (zero past the rows), its largest magnitude; the element table
    u32 qmax = 0u;
    for (int i = tid; i < BLOCK_M * D / 2; i += PNT) {
        const int r = i / (D / 2), d = 2 * (i % (D / 2)), row = row0 + r;
        u32 pair = 0u;
        if (row < rk.rows) {
            const i64 at = out_row(row) * D + d;
            pair = (u32)query[at] | ((u32)query[at + 1] << 16);
        }
        qmax = u32_max(qmax, u32_max(f2u(f16_lo(pair)) & 0x7FFFFFFFu, f2u(f16_hi(pair)) & 0x7FFFFFFFu));
        *reinterpret_cast<u32*>(&sh.q[r][d]) = pair;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) qmax = u32_max(qmax, __shfl_xor_sync(0xFFFFFFFFu, qmax, off));
    if (lane == 0) sh.qmax[warp] = qmax;
    const Elements el = element_table(&sh.s[warp][0][0]);  // (1 KiB of the warp's 2.75)
    if (threadIdx.x == 0) {
        set_keys(sh.keys, block_tables + (i64)cta.s * bt_stride, key_cache + (i64)cta.h * k_sh, value_cache + (i64)cta.h * v_sh,
                 k_sb, k_st, v_sb, v_st, ck.kb, ck.ke, block_size, num_blocks, D, BLOCK_N);
    }
    __syncthreads();
    qmax = 0u;
#pragma unroll
    for (int w = 0; w < PWARPS; ++w) qmax = u32_max(qmax, sh.qmax[w]);
    const Logit lg = make_logit(k_scale[(i64)cta.h * ks_sh], g_mant, g_exp, 0, qmax, D, soft_cap, use_cap);

    FragC o[DT];
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[n].x[e] = 0.0f;
    const bool done = ck.split_p ? key_loop<EXACT, true>(sh, ck, lg, el, st, o)
                                 : key_loop<EXACT, false>(sh, ck, lg, el, st, o);
    if constexpr (!EXACT) {
        if (threadIdx.x == 0) redo[cta.id] = done ? 0 : 1;
        if (!done) return;  // uniform over the CTA
    }

    // ---- epilogue: out = O / l * v_scale, or the split's partial (O, m, l)
    const float vs = v_scale[(i64)cta.h * vs_sh];
    const float mul = split ? 1.0f : fdiv(1.0f, st.l_run > 0.0f ? st.l_run : 1.0f);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int row = row0 + 16 * warp + el.row(e);
        const float me = __shfl_sync(0xFFFFFFFFu, mul, el.row(e));
        if (row >= rk.rows) continue;
        const i64 orow = out_row(row);
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            const int d = 16 * n + el.col(e);
            if (split) part_acc[((i64)cta.z * T * HQ + orow) * D + d] = o[n].x[e];
            else store_out(out, orow * D + d, o[n].x[e] * me * vs);
        }
    }
    if (lane < 16 && my_row < rk.rows) {
        const i64 orow = out_row(my_row);
        if (split) {
            const i64 prow = (i64)cta.z * T * HQ + orow;
            part_ml[prow * 3] = st.m_run; part_ml[prow * 3 + 1] = st.l_run; part_ml[prow * 3 + 2] = 0.0f;
        } else if (write_lse) {
            lse[orow] = st.l_run > 0.0f ? (st.m_run + log2f(st.l_run)) * LN2 : NEG_INF;
        }
    }
}

extern "C" __global__ void __launch_bounds__(PNT, 1) fp8kv_prefill_wmma(FP8KV_ATTENTION_PARAMS(D_arg), int* __restrict__ redo) {
    prefill<false>(FP8KV_ATTENTION_ARGS(D_arg), redo);
}

extern "C" __global__ void __launch_bounds__(PNT, 1) fp8kv_prefill_wmma_exact(FP8KV_ATTENTION_PARAMS(D_arg),
                                                                             int* __restrict__ redo) {
    prefill<true>(FP8KV_ATTENTION_ARGS(D_arg), redo);
}
