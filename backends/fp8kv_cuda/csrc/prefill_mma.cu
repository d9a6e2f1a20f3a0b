// fp8kv_cuda: chunked prefill on tensor cores (sm80+: mma.sync m16n8k16), for float16 and bfloat16
// queries, per-tensor or per-head scales, head size 128.
//
// Grid (query tiles, H, S * num_splits), PNT = 32 * PWARPS threads. A CTA owns BLOCK_M rows of one
// sequence and one KV head (row = (token - first token) * group + query head: the GQA group packed
// into the rows) and the keys of split z; warp w owns rows 32 w .. 32 w + 31 (two m-tiles). The
// CTA walks steps of BLOCK_N keys: K and V tiles go through a shared-memory ring (cp.async,
// STAGES - 1 steps in flight, one barrier per step) that every warp reads.
//
// Per step, in the usual orientation (rows are query rows):
//   S[32 rows x BLOCK_N keys] = Q . K^T:  A = Q (float16/bfloat16 fragments staged in shared memory
//                                           once), B = K (FP8 widened in registers);
//   O[32 rows x D]          += P . V:     A = P (the S accumulators repacked, float16),
//                                           B = V (FP8 widened, key pairs formed with one PRMT).
// The k index of QK is permuted (both operands agree): lane (r = lane / 4, c = lane % 4) takes the
// 16-byte chunks at dims 64 i + 16 c of its key rows, word ks & 3 being k step ks (k_dim). The
// output dims are permuted too: n-tile j, column n of O is dim 16 n + j, so a lane's V operands are
// the chunk at dims 16 r of its keys 2c, 2c + 1, 2c + 8, 2c + 9. Both tiles are XOR-swizzled by
// 16-byte chunk, so these reads are free of bank conflicts.
//
// Exactness: as attention_mma.cu (K in the query's 16-bit type, exact products, float32
// accumulation; bfloat16 queries whose range is within 2^31 take float16 K; special codes detected
// per step and decoded by software). P enters p @ v in float16 when every row of the CTA sees at
// least FP8KV_FULL_P_KEYS keys (its 2^-12 relative error is then within tolerance.py's float32
// accumulation term), else as hi + lo (22 bits). The running maximum is raised only when a logit
// exceeds it by more than 2^TAU (so that O is rescaled rarely): the weights stay <= 2^TAU, exact
// in float16, and the normalisation uses the same maximum (an exact rewrite).
//
// Memory safety without host checks: query_start_loc and seq_lens clamped as in attention.cu,
// block ids outside [0, num_blocks) never loaded (the keys masked), rows past a sequence's
// queries neither read nor written.
//
// Macros: FP8KV_QT (1 float16, 2 bfloat16), FP8KV_D (128), FP8KV_PREFILL_WARPS, FP8KV_STAGES,
// FP8KV_FULL_P_KEYS, and the format's.
#include "prefill_common.cuh"

namespace fp8kv {

constexpr int D = FP8KV_D;
#ifndef FP8KV_PREFILL_WARPS
#define FP8KV_PREFILL_WARPS 4
#endif
#ifndef FP8KV_STAGES
#define FP8KV_STAGES 3
#endif
constexpr int PWARPS = FP8KV_PREFILL_WARPS;
constexpr int PNT = 32 * PWARPS;        // threads per CTA
constexpr int MT = 2;                   // m-tiles (16 rows) per warp
constexpr int BLOCK_M = 16 * MT * PWARPS;
constexpr int BLOCK_N = 32;             // keys per step
constexpr int NK = BLOCK_N / 8;         // n-tiles of S per step
constexpr int KC = BLOCK_N / 16;        // k chunks (16 keys) of p @ v per step
constexpr int KS = D / 16;              // k steps of QK
constexpr int ND = D / 8;               // n-tiles of O
constexpr int CPR = D / 16;             // 16-byte chunks per K/V row
constexpr int STAGES = FP8KV_STAGES;
constexpr float TAU = 8.0f;             // log2 of the largest weight before the maximum is raised
constexpr int ROW_F = D + 4;            // floats per row of the epilogue's staging

static_assert(QT == 1 || QT == 2, "prefill_mma.cu: float16 or bfloat16 queries");
static_assert(D == 128, "prefill_mma.cu: head size 128");
static_assert(NK == 4, "prefill_mma.cu: the row sums add four n-tiles");
static_assert(PNT * 2 == BLOCK_N * CPR, "prefill_mma.cu: each thread copies two chunks of K and of V");
static_assert(CPR == 8, "prefill_mma.cu: the key bits of a warp's copies are ballot bits 0, 8, 16, 24");

__device__ __forceinline__ int k_dim(int c, int ks) { return 64 * (ks >> 2) + 16 * c + 4 * (ks & 3); }
// Swizzled 16-byte chunk of a tile row (reads: K by lanes (key 8j + r, chunk 4i + c), V by lanes
// (keys 16 kk + 2c + {0, 1, 8, 9}, chunk r)).
__device__ __forceinline__ int k_chunk(int key, int ch) { return ch ^ ((key & 1) << 2); }
__device__ __forceinline__ int v_chunk(int key, int ch) { return ch ^ (((key >> 1) & 3) << 1); }

struct PrefillShared {
    uint4 q[PWARPS][MT][KS][32];           // A fragments of Q, per warp, m-tile, k step, lane
    uint4 k[STAGES][BLOCK_N][CPR];         // K tiles (swizzled chunks)
    uint4 v[STAGES][BLOCK_N][CPR];         // V tiles
    uint4 valid[STAGES];                   // per warp: bits of the keys it copied whose block is valid
    Keys keys;
    u32 qmax[PWARPS], qmin[PWARPS];
};
static_assert((int)sizeof(float) * 16 * ROW_F * PWARPS <= (int)sizeof(PrefillShared),
              "prefill_mma.cu: the epilogue stages one m-tile of output per warp");
constexpr int SMEM_BYTES = (int)sizeof(PrefillShared);

__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
    return r;
}

// The rows a thread holds: (m-tile mt, half hf) -> warp row 16 mt + r + 8 hf.
struct RowSpans {
    int lo[MT][2], hi[MT][2];  // visible keys [lo, hi) of each row (empty for rows past the queries)
};


// O += p v for the NaN/inf V codes of the step (zeroed in p @ v), for the rows that see their key:
// thread (r, c) holds O's dims 32 c + [0, 32) (n-tile j, columns 2c, 2c + 1) of rows r, r + 8; p of
// (row, key 8 j + 2 c' + e) comes from lane (r, c').
__device__ void v_fixup(const PrefillShared& sh, int stage, int n0, u32 valid, const RowSpans& rs,
                        const float (&p)[MT][NK][4], float (&o)[MT][ND][4]) {
    const int lane = threadIdx.x & 31, c = lane & 3;
#pragma unroll 1
    for (int key = 0; key < BLOCK_N; ++key) {
        u32 any = 0u;
        uint4 x[2];
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
            x[e1] = sh.v[stage][key][v_chunk(key, 2 * c + e1)];
            any |= nonfinite_bytes(x[e1].x) | nonfinite_bytes(x[e1].y) | nonfinite_bytes(x[e1].z) | nonfinite_bytes(x[e1].w);
        }
        if (!__any_sync(0xFFFFFFFFu, any != 0u)) continue;
        float pr[MT][2];
        bool vis[MT][2];
        const int n = n0 + key;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float t = 0.0f;
#pragma unroll
                for (int j = 0; j < NK; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) t = (j == key >> 3 && e == (key & 1)) ? p[mt][j][e + 2 * hf] : t;
                pr[mt][hf] = __shfl_sync(0xFFFFFFFFu, t, (lane & ~3) | ((key & 7) >> 1));
                vis[mt][hf] = ((valid >> key) & 1u) && n >= rs.lo[mt][hf] && n < rs.hi[mt][hf];
            }
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1)
#pragma unroll
            for (int b = 0; b < 16; ++b) {  // dim 16 (2c + e1) + b: n-tile b, column 2c + e1
                const u32 code = (word(x[e1], b >> 2) >> (8 * (b & 3))) & 0xFFu;
                if (!nonfinite_bytes(code)) continue;
                const float v = decode(code);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
                        if (vis[mt][hf]) o[mt][b][e1 + 2 * hf] += pr[mt][hf] * v;
            }
    }
}

// f(mt, j, e) for each S element a thread holds: row r + 8 (e >> 1) of m-tile mt, key 8 j + 2c + (e & 1).
template <typename F>
__device__ __forceinline__ void for_each_s(F&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NK; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) f(mt, j, e);
}

// One step: S = Q K^T for the thread's rows, the online softmax, O += P V. Keys n0 + [0, BLOCK_N).
// fixup (EXACT only): the step is not interior and holds NaN/inf V codes, which enter p @ v as 0 and
// are added back by v_fixup for the rows that see their key (0 * NaN must not reach the others).
template <int KE, bool EXACT, bool SPLIT_P>
__device__ __forceinline__ void attend(const PrefillShared& sh, int stage, int n0, bool interior, u32 valid,
                                       const RowSpans& rs, const Logit& lg, bool fixup, float (&m_run)[MT][2],
                                       float (&l_run)[MT][2], float (&o)[MT][ND][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, c = lane & 3;
    float s[MT][NK][4];
    for_each_s([&](int mt, int j, int e) { s[mt][j][e] = 0.0f; });
    // shared addresses: a lane constant plus immediates (k_chunk(r, 4 i + c) = c + 4 (i ^ (r & 1)))
    const u32 q_addr = shared_address(&sh.q[warp][0][0][lane]);
    const u32 k_addr = shared_address(&sh.k[stage][r][c]);
    const u32 k_flip = (u32)(r & 1) * 64u;
#pragma unroll
    for (int i = 0; i < KS / 4; ++i) {
        uint4 kx[NK];  // key 8j + r, dims 64 i + 16 c + [0, 16)
#pragma unroll
        for (int j = 0; j < NK; ++j) kx[j] = lds128(k_addr + (u32)(j * 8 * CPR * 16) + (i == 0 ? k_flip : 64u - k_flip));
#pragma unroll
        for (int kq = 0; kq < 4; ++kq) {
            const int ks = 4 * i + kq;
            uint4 qa[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) qa[mt] = lds128(q_addr + (u32)((mt * KS + ks) * 32 * 16));
#pragma unroll
            for (int j = 0; j < NK; ++j) {
                u32 b0, b1;
                widen4<KE, EXACT>(word(kx[j], kq), b0, b1);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma<KE>(s[mt][j], qa[mt].x, qa[mt].y, qa[mt].z, qa[mt].w, b0, b1);
            }
        }
    }
    // logits (base 2) as v * fs: simple (lg.fs = the logit factor, > 0, and no logit can overflow:
    // see the kernel) keeps v = q . k, else v is the saturated (soft-capped) logit and fs = 1;
    // masked where a key is not visible to a row
    if (!lg.simple) {
        for_each_s([&](int mt, int j, int e) {
            float x = (s[mt][j][e] * lg.f1) * lg.f2;
            if (lg.use_cap) x = lg.soft_cap * tanhf(fdiv(x, lg.soft_cap)) * LOG2E;
            s[mt][j][e] = saturate(x);
        });
    }
    if (!interior) {
        for_each_s([&](int mt, int j, int e) {
            const int key = 8 * j + 2 * c + (e & 1), n = n0 + key, hf = e >> 1;
            const bool vis = ((valid >> key) & 1u) && n >= rs.lo[mt][hf] && n < rs.hi[mt][hf];
            s[mt][j][e] = vis ? s[mt][j][e] : NEG_INF;
        });
    }
    const float fs = lg.simple ? lg.fs : 1.0f;
    // online softmax per row: the maximum is raised only past m_run + TAU
    bool rescale = false;
    float alpha[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float mx[NK];  // (a tree: the chain of dependent maxima stays short)
#pragma unroll
            for (int j = 0; j < NK; ++j) mx[j] = fmaxf(s[mt][j][2 * hf], s[mt][j][2 * hf + 1]);
#pragma unroll
            for (int w = NK / 2; w > 0; w >>= 1)
#pragma unroll
                for (int j = 0; j < w; ++j) mx[j] = fmaxf(mx[j], mx[j + w]);
            float tmax = mx[0];
            tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xFFFFFFFFu, tmax, 2));
            tmax *= fs;  // (fs > 0: the maximum of the products)
            alpha[mt][hf] = 1.0f;
            if (tmax > m_run[mt][hf] + TAU || (m_run[mt][hf] == NEG_INF && tmax != NEG_INF)) {
                alpha[mt][hf] = exp2_approx(m_run[mt][hf] - tmax);  // (0 when m_run is -inf)
                m_run[mt][hf] = tmax;
                rescale = true;
            }
        }
    if (__any_sync(0xFFFFFFFFu, rescale)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            l_run[mt][0] *= alpha[mt][0];
            l_run[mt][1] *= alpha[mt][1];
#pragma unroll
            for (int nd = 0; nd < ND; ++nd) {
                o[mt][nd][0] *= alpha[mt][0]; o[mt][nd][1] *= alpha[mt][0];
                o[mt][nd][2] *= alpha[mt][1]; o[mt][nd][3] *= alpha[mt][1];
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float neg_m = m_run[mt][hf] == NEG_INF ? 0.0f : -m_run[mt][hf];
            float sum[NK];
#pragma unroll
            for (int j = 0; j < NK; ++j) {  // masked: exp2(-inf) = 0
                s[mt][j][2 * hf] = exp2_approx(fmaf(s[mt][j][2 * hf], fs, neg_m));
                s[mt][j][2 * hf + 1] = exp2_approx(fmaf(s[mt][j][2 * hf + 1], fs, neg_m));
                sum[j] = s[mt][j][2 * hf] + s[mt][j][2 * hf + 1];
            }
            l_run[mt][hf] += (sum[0] + sum[1]) + (sum[2] + sum[3]);
        }
    if constexpr (EXACT) {
        if (fixup) v_fixup(sh, stage, n0, valid, rs, s, o);
    }
    // P as A fragments (S dies here), k chunk kk = keys 16 kk + [0, 16): P's k index 2c, 2c + 1 |
    // 2c + 8, 2c + 9 are S's n-tiles 2 kk | 2 kk + 1, columns 2c, 2c + 1
    u32 pa[KC][MT][4], pl[KC][MT][4];
#pragma unroll
    for (int kk = 0; kk < KC; ++kk)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float* sv = s[mt][2 * kk + (a >> 1)] + 2 * (a & 1);
                pa[kk][mt][a] = pack_f16(sv[0], sv[1]);
                if constexpr (SPLIT_P) pl[kk][mt][a] = pack_f16(sv[0] - f16_lo(pa[kk][mt][a]), sv[1] - f16_hi(pa[kk][mt][a]));
            }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < KC; ++kk) {
        // keys 16 kk + 2c + {0, 1, 8, 9}, chunk v_chunk(key, r) = r ^ 2c for all four
        const u32 v_addr = shared_address(&sh.v[stage][2 * c][r ^ (2 * c)]) + (u32)(kk * 16 * CPR * 16);
        const uint4 va = lds128(v_addr), vb = lds128(v_addr + CPR * 16);
        const uint4 vc = lds128(v_addr + 8 * CPR * 16), vd = lds128(v_addr + 9 * CPR * 16);
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // dims 16 r + 4 w + [0, 4): n-tiles 4 w .. 4 w + 3
            u32 A = word(va, w), B = word(vb, w), C = word(vc, w), E = word(vd, w);
            if (EXACT && fixup) {
                A = zero_nonfinite(A); B = zero_nonfinite(B); C = zero_nonfinite(C); E = zero_nonfinite(E);
            }
            u32 b0[4], b1[4];
            widen4<5, EXACT>(prmt(A, B, 0x5140u), b0[0], b0[1]);
            widen4<5, EXACT>(prmt(A, B, 0x7362u), b0[2], b0[3]);
            widen4<5, EXACT>(prmt(C, E, 0x5140u), b1[0], b1[1]);
            widen4<5, EXACT>(prmt(C, E, 0x7362u), b1[2], b1[3]);
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const u32* a = pa[kk][mt];
                    mma<5>(o[mt][4 * w + q], a[0], a[1], a[2], a[3], b0[q], b1[q]);
                    if constexpr (SPLIT_P) {
                        const u32* al = pl[kk][mt];
                        mma<5>(o[mt][4 * w + q], al[0], al[1], al[2], al[3], b0[q], b1[q]);
                    }
                }
        }
    }
}

// The OR of f over the K words (K) or the V words (!K) this thread reads in the step.
template <bool K, typename F>
__device__ __forceinline__ u32 or_words(const PrefillShared& sh, int stage, F f) {
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    u32 acc = 0u;
    if constexpr (K) {
#pragma unroll
        for (int i = 0; i < KS / 4; ++i)
#pragma unroll
            for (int j = 0; j < NK; ++j) {
                const uint4 x = sh.k[stage][8 * j + r][k_chunk(r, 4 * i + c)];
                acc |= f(x.x) | f(x.y) | f(x.z) | f(x.w);
            }
    } else {
#pragma unroll
        for (int kk = 0; kk < KC; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = 16 * kk + 2 * c + (e & 1) + 8 * (e >> 1);
                const uint4 x = sh.v[stage][key][v_chunk(key, r)];
                acc |= f(x.x) | f(x.y) | f(x.z) | f(x.w);
            }
    }
    return acc;
}

// Nonzero when the fast kernel cannot do the step: a K code the widening to KE gets wrong or an
// inf/NaN K code of a format with inf (a logit the simple path would not saturate), a V code the
// widening to float16 gets wrong, or (not interior) a NaN/inf V code (see v_fixup).
template <int KE>
__device__ __forceinline__ u32 step_special(const PrefillShared& sh, int stage, bool interior) {
    u32 sp = or_words<true>(sh, stage, [](u32 w) { return has_special<KE>(w) | (HASINF ? nonfinite_bytes(w) : 0u); });
    sp |= or_words<false>(sh, stage, [](u32 w) { return has_special<5>(w); });  // (0 where the widening is native)
    if (!interior) sp |= or_words<false>(sh, stage, nonfinite_bytes);
    return sp;
}

// The block ids of the two keys thread tid copies in the step at n0 (keys tid / CPR and tid / CPR +
// BLOCK_N / 2), -1 outside [kb, ke). Loaded a step before issue() needs them, so that the copies
// never wait for the block table.
struct StepBlocks {
    int blk[2];
};

// What a thread's copies of every step share when Keys::fast (32-bit offsets, the block size a power
// of two dividing BLOCK_N, so steps start at block boundaries): its keys' offsets within a block.
struct CopyPlan {
    u32 k_off[2], v_off[2];  // (key % block_size) * stride + 16 (tid % CPR), keys tid / CPR + 16 hf
};

__device__ __forceinline__ CopyPlan copy_plan(const PrefillShared& sh) {
    const Keys& ks = sh.keys;
    CopyPlan cp;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const u32 tib = ((u32)threadIdx.x / CPR + hf * (BLOCK_N / 2)) & (u32)(ks.block_size - 1);
        const u32 ch16 = 16u * ((u32)threadIdx.x % CPR);
        cp.k_off[hf] = ks.fast ? tib * (u32)ks.k_st + ch16 : 0u;
        cp.v_off[hf] = ks.fast ? tib * (u32)ks.v_st + ch16 : 0u;
    }
    return cp;
}

__device__ __forceinline__ StepBlocks lookup(const PrefillShared& sh, int n0) {
    const Keys& ks = sh.keys;
    StepBlocks b;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        b.blk[hf] = key_block(ks, n0 + (int)threadIdx.x / CPR + hf * (BLOCK_N / 2));
    }
    return b;
}

// Start the copies of the step at n0 into `stage` (one commit group): thread tid copies chunk
// tid % CPR of keys tid / CPR and tid / CPR + BLOCK_N / 2, of K and of V; keys outside [kb, ke) or
// in an invalid block are zero-filled, never read, and their bits left clear in valid[stage].
__device__ __forceinline__ void issue(PrefillShared& sh, int stage, int n0, const StepBlocks& sb, const CopyPlan& cp) {
    const Keys& ks = sh.keys;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ch = tid % CPR;
    const bool fast = ks.fast;
    u32 bits = 0u;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int key = tid / CPR + hf * (BLOCK_N / 2), n = n0 + key;
        const int blk = sb.blk[hf];
        const bool live = blk >= 0 && blk < ks.num_blocks;  // (-1 outside [kb, ke))
        i64 ok = 0, ov = 0;
        if (fast) {
            ok = live ? (u32)blk * (u32)ks.k_sb + cp.k_off[hf] : 0u;
            ov = live ? (u32)blk * (u32)ks.v_sb + cp.v_off[hf] : 0u;
        } else if (live) {
            key_offsets(ks, n, blk, ch, ok, ov);
        }
        copy_async<16>(shared_address(&sh.k[stage][key][k_chunk(key, ch)]), ks.kbase + ok, live);
        copy_async<16>(shared_address(&sh.v[stage][key][v_chunk(key, ch)]), ks.vbase + ov, live);
        // lanes 0, CPR, 2 CPR, 3 CPR of the warp hold keys 4 warp + [0, 4) (+ BLOCK_N / 2)
        bits |= key_bits(__ballot_sync(0xFFFFFFFFu, live && ch == 0), warp, hf * (BLOCK_N / 2));
    }
    if (lane == 0) reinterpret_cast<u32*>(&sh.valid[stage])[warp] = bits;
    copy_commit();
}

// The CTA's key loop with K in the 16-bit type KE; queries already staged as KE fragments. EXACT:
// every code through the software decoder (the exact kernel); else a step with a code the bit-level
// widening gets wrong stops the CTA (returns false: the exact kernel redoes it).
template <int KE, bool EXACT, bool SPLIT_P>
__device__ __forceinline__ bool key_loop(PrefillShared& sh, int kb, int ke, const RowSpans& rs, int lo_max, int hi_min,
                                         const Logit& lg, float (&m_run)[MT][2], float (&l_run)[MT][2],
                                         float (&o)[MT][ND][4]) {
    const int first = kb & ~(BLOCK_N - 1);
    const int steps = ke > first ? (ke - first + BLOCK_N - 1) / BLOCK_N : 0;
    const CopyPlan cp = copy_plan(sh);
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < steps) issue(sh, i, first + i * BLOCK_N, lookup(sh, first + i * BLOCK_N), cp);
        else copy_commit();
    }
    StepBlocks next = lookup(sh, first + (STAGES - 1) * BLOCK_N);  // (the loads complete during a step)
    bool special = false;
    for (int i = 0; i < steps; ++i) {
        copy_wait<STAGES - 2>();
        // step i is in; every warp is done with step i - 1 (its stage is refilled next)
        if (__syncthreads_or(special)) break;
        const int j = i + STAGES - 1;
        if (j < steps) issue(sh, j % STAGES, first + j * BLOCK_N, next, cp);
        else copy_commit();
        next = lookup(sh, first + (j + 1) * BLOCK_N);
        const int stage = i % STAGES, n0 = first + i * BLOCK_N;
        const uint4 vw = sh.valid[stage];
        const u32 valid = vw.x | vw.y | vw.z | vw.w;
        const bool interior = valid == 0xFFFFFFFFu && n0 >= lo_max && n0 + BLOCK_N <= hi_min;
        bool fixup = false;
        if constexpr (!EXACT) {
            special = __any_sync(0xFFFFFFFFu, step_special<KE>(sh, stage, interior) != 0u);
            if (special) continue;
        } else {
            fixup = !interior && __any_sync(0xFFFFFFFFu, or_words<false>(sh, stage, nonfinite_bytes) != 0u);
        }
        attend<KE, EXACT, SPLIT_P>(sh, stage, n0, interior, valid, rs, lg, fixup, m_run, l_run, o);
    }
    copy_wait_all();
    return !__syncthreads_or(special);
}

template <int KE, bool EXACT>
__device__ __forceinline__ bool run_keys(bool split_p, PrefillShared& sh, int kb, int ke, const RowSpans& rs, int lo_max,
                                         int hi_min, const Logit& lg, float (&m_run)[MT][2], float (&l_run)[MT][2],
                                         float (&o)[MT][ND][4]) {
    if (split_p) return key_loop<KE, EXACT, true>(sh, kb, ke, rs, lo_max, hi_min, lg, m_run, l_run, o);
    return key_loop<KE, EXACT, false>(sh, kb, ke, rs, lo_max, hi_min, lg, m_run, l_run, o);
}

}  // namespace fp8kv

// The kernel body. EXACT = false (fp8kv_prefill_mma): float16 K only, the bit-level (or native)
// widening; a CTA that needs more (a bfloat16 query range beyond 2^31, a special code on the bit
// path) sets redo[cta] = 1 and stops without writing. EXACT (fp8kv_prefill_mma_exact, launched
// after it over the same grid): only those CTAs, every code through the software decoder.
template <bool EXACT>
__device__ __forceinline__ void prefill(FP8KV_ATTENTION_PARAMS(D_arg), int* __restrict__ redo) {
    extern __shared__ uint4 smem[];
    const PrefillCta pc = prefill_cta(num_seqs);
    const i64 cta = pc.id;
    const int h = pc.h, s = pc.s, z = pc.z;
    if (EXACT && redo[cta] == 0) return;
    PrefillShared& sh = *reinterpret_cast<PrefillShared*>(smem);
    trap_unless_smem((u32)SMEM_BYTES);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, r = lane >> 2, c = lane & 3;
    const RowKeys rk = row_keys(qsl, seq_lens, s, z, T, group, window, causal, max_blocks, block_size, keys_per_split);
    const int q_lo = rk.q_lo, rows = rk.rows;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;  // the longest rows (causal) start first
    if (row0 >= rows) {  // uniform over the CTA
        if (!EXACT && threadIdx.x == 0) redo[cta] = 0;
        return;
    }

    // ---- key spans: row -> token q_lo + row / group; its visible keys, within split z
    RowSpans rs;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) rk.span(row0 + 32 * warp + 16 * mt + r + 8 * hf, rs.lo[mt][hf], rs.hi[mt][hf]);
    const CtaKeys ck = cta_keys(rk, row0, BLOCK_M);
    const int kb = ck.kb, ke = ck.ke, lo_max = ck.lo_max, hi_min = ck.hi_min;
    const bool split_p = ck.split_p;

    // ---- stage Q fragments: raw bits, then (bfloat16) the CTA's range decides K's type and scale
    auto frag_row = [&](int mt, int hf) { return row0 + 32 * warp + 16 * mt + r + 8 * hf; };
    auto q_index = [&](int row, int dim) {
        return ((i64)(q_lo + row / group) * HQ + (i64)h * group + row % group) * D + dim;
    };
    u32 qmax = 0u, qmin = 0xFFFFFFFFu;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll 2
        for (int ks = 0; ks < KS; ++ks) {
            u32 w[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {  // a0 (row r, d, d + 1), a1 (row r + 8), a2 (row r, d + 2, d + 3), a3
                const int row = frag_row(mt, a & 1), d = k_dim(c, ks) + 2 * (a >> 1);
                u32 lohi[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 bits = row < rows ? (u32)query[q_index(row, d + e)] : 0u;
                    lohi[e] = bits;
                    const q_t qv = (q_t)bits;
                    const u32 mag = f2u(load_q(&qv, 0)) & 0x7FFFFFFFu;
                    qmax = u32_max(qmax, mag);
                    if (mag != 0u && mag < qmin) qmin = mag;
                }
                w[a] = lohi[0] | (lohi[1] << 16);
            }
            sh.q[warp][mt][ks][lane] = make_uint4(w[0], w[1], w[2], w[3]);
        }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        qmax = u32_max(qmax, __shfl_xor_sync(0xFFFFFFFFu, qmax, off));
        const u32 m = __shfl_xor_sync(0xFFFFFFFFu, qmin, off);
        qmin = m < qmin ? m : qmin;
    }
    if (lane == 0) { sh.qmax[warp] = qmax; sh.qmin[warp] = qmin; }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < PWARPS; ++w) {
        qmax = u32_max(qmax, sh.qmax[w]);
        qmin = sh.qmin[w] < qmin ? sh.qmin[w] : qmin;
    }
    bool k16;  // float16 K where exact (key_type), queries as q * 2^-qshift
    i32 qshift;
    key_type(qmax, qmin, k16, qshift);
    if (!(k16 == (QT == 1) && qshift == 0)) {  // convert the warp's own fragments in place
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll 2
            for (int ks = 0; ks < KS; ++ks) {
                uint4 x = sh.q[warp][mt][ks][lane];
                u32* w = reinterpret_cast<u32*>(&x);
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    const q_t lo = (q_t)(w[a] & 0xFFFFu), hi = (q_t)(w[a] >> 16);
                    const u32 e0 = k16 ? query_bits<5>(&lo, 0, true, qshift) : query_bits<8>(&lo, 0, true, qshift);
                    const u32 e1 = k16 ? query_bits<5>(&hi, 0, true, qshift) : query_bits<8>(&hi, 0, true, qshift);
                    w[a] = e0 | (e1 << 16);
                }
                sh.q[warp][mt][ks][lane] = x;
            }
    }
    __syncwarp();

    // the logit factor; simple when q . k * f1 * f2 cannot overflow: |q . k| <= D max|q| max|code|
    const Logit lg = make_logit(k_scale[(i64)h * ks_sh], g_mant, g_exp, qshift, qmax, D, soft_cap, use_cap);
    if (threadIdx.x == 0) {
        set_keys(sh.keys, block_tables + (i64)s * bt_stride, key_cache + (i64)h * k_sh, value_cache + (i64)h * v_sh,
                 k_sb, k_st, v_sb, v_st, kb, ke, block_size, num_blocks, D, BLOCK_N);
    }
    __syncthreads();

    float m_run[MT][2], l_run[MT][2], o[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_run[mt][0] = m_run[mt][1] = NEG_INF;
        l_run[mt][0] = l_run[mt][1] = 0.0f;
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
    }
    bool done = false;
    if constexpr (!EXACT) {
        if (k16) done = run_keys<5, false>(split_p, sh, kb, ke, rs, lo_max, hi_min, lg, m_run, l_run, o);
        if (threadIdx.x == 0) redo[cta] = done ? 0 : 1;
        if (!done) return;  // uniform over the CTA
    } else if (k16) {
        run_keys<5, true>(split_p, sh, kb, ke, rs, lo_max, hi_min, lg, m_run, l_run, o);
    } else {
        if constexpr (QT == 2) run_keys<8, true>(split_p, sh, kb, ke, rs, lo_max, hi_min, lg, m_run, l_run, o);
    }

    // ---- epilogue, one m-tile at a time through shared memory (free once every warp is done):
    // out = O / l * v_scale, or the split's partial (O, m, l)
    const float vs = v_scale[(i64)h * vs_sh];
    __syncthreads();
    float* stage_f = reinterpret_cast<float*>(smem) + warp * 16 * ROW_F;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float mul[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            l_run[mt][hf] += __shfl_xor_sync(0xFFFFFFFFu, l_run[mt][hf], 1);
            l_run[mt][hf] += __shfl_xor_sync(0xFFFFFFFFu, l_run[mt][hf], 2);
            mul[hf] = split ? 1.0f : fdiv(1.0f, l_run[mt][hf] > 0.0f ? l_run[mt][hf] : 1.0f);
        }
        __syncwarp();
#pragma unroll
        for (int nd = 0; nd < ND; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e)  // column 2c + (e & 1) of n-tile nd: dim 16 (2c + (e & 1)) + nd
                stage_f[(r + 8 * (e >> 1)) * ROW_F + 16 * (2 * c + (e & 1)) + nd] = o[mt][nd][e] * mul[e >> 1];
        __syncwarp();
        for (int i = 0; i < 16; ++i) {
            const int row = row0 + 32 * warp + 16 * mt + i;
            if (row >= rows) break;
            const i64 orow = (i64)(q_lo + row / group) * HQ + (i64)h * group + row % group;
            const float4 x = *reinterpret_cast<const float4*>(&stage_f[i * ROW_F + 4 * lane]);
            if (split) {
                *reinterpret_cast<float4*>(&part_acc[((i64)z * T * HQ + orow) * D + 4 * lane]) = x;
            } else {
                store_out(out, orow * D + 4 * lane, x.x * vs);
                store_out(out, orow * D + 4 * lane + 1, x.y * vs);
                store_out(out, orow * D + 4 * lane + 2, x.z * vs);
                store_out(out, orow * D + 4 * lane + 3, x.w * vs);
            }
        }
        // (m, l) of the thread's rows r, r + 8 (lanes c == 0)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = row0 + 32 * warp + 16 * mt + r + 8 * hf;
            if (c != 0 || row >= rows) continue;
            const i64 orow = (i64)(q_lo + row / group) * HQ + (i64)h * group + row % group;
            const float m = m_run[mt][hf], l = l_run[mt][hf];
            if (split) {
                const i64 prow = (i64)z * T * HQ + orow;
                part_ml[prow * 3] = m; part_ml[prow * 3 + 1] = l; part_ml[prow * 3 + 2] = 0.0f;
            } else if (write_lse) {
                lse[orow] = l > 0.0f ? (m + log2f(l)) * LN2 : NEG_INF;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(PNT, 2) fp8kv_prefill_mma(FP8KV_ATTENTION_PARAMS(D_arg), int* __restrict__ redo) {
    prefill<false>(FP8KV_ATTENTION_ARGS(D_arg), redo);
}

extern "C" __global__ void __launch_bounds__(PNT, 1) fp8kv_prefill_mma_exact(FP8KV_ATTENTION_PARAMS(D_arg),
                                                                            int* __restrict__ redo) {
    prefill<true>(FP8KV_ATTENTION_ARGS(D_arg), redo);
}
