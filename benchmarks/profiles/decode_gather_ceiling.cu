// The decode's memory ceiling: kernels that only read a paged FP8 cache through the block table, the
// way a decode CTA does, and fold the bytes into one word (no attention). decode_gather_ceiling.py
// times them against fp8kv's decode on the same cache bytes.
//
// Grid (B, H, S): CTA (b, h, z) reads keys [z kps, min(L, (z + 1) kps)) of sequence b, KV head h: its
// 128-byte K and V rows, one 16-key page at a time through bt[b]. NW warps (FP8KV_NW), by one of:
//   gather_ldg:   each warp its own 32-key steps (w, w + NW, ...), 16-byte loads (16 a lane a step);
//   gather_cp:    the same copies as cp.async.cg ... L2::128B into a ring of FP8KV_STAGES steps a thread
//                 (as attention_mma.cu copies), each thread reading back its own slots;
//   gather_tma:   one thread issues TMA boxes (a page of one head: 16 rows x 128 bytes, K and V) for
//                 FP8KV_PAGES pages a stage into FP8KV_STAGES stages; every thread reads its share of
//                 a stage, then the CTA synchronizes and the stage is refilled;
//   gather_heads: gather_ldg with FP8KV_HPC KV heads a CTA (grid (B, H / HPC, S), or (H / HPC, B, S) with
//                 FP8KV_HEADS_FAST): a step is 32 / HPC keys of HPC adjacent heads, so each load
//                 instruction reads whole HPC * 128-byte runs of a token's row (NHD);
//   read_stream:  a grid-stride 16-byte read of a contiguous buffer (the device's read bandwidth).
#include "wgmma_common.cuh"

using namespace fp8kv;

#ifndef FP8KV_NW
#define FP8KV_NW 4
#endif
#ifndef FP8KV_STAGES
#define FP8KV_STAGES 3
#endif
#ifndef FP8KV_HPC
#define FP8KV_HPC 1
#endif
#ifndef FP8KV_HEADS_FAST
#define FP8KV_HEADS_FAST 0
#endif
#ifndef FP8KV_PAGES
#define FP8KV_PAGES 2
#endif
constexpr int NW = FP8KV_NW, NT = 32 * NW, STAGES = FP8KV_STAGES, PAGES = FP8KV_PAGES;
constexpr int PAGE = 16, ROW = 128;          // keys a page, bytes of one head's K (V) row
constexpr int STEP = 32;                     // keys of a warp step (ldg, cp)
constexpr int CHUNKS = 2 * STEP * ROW / 16 / 32;  // 16-byte copies a lane and step, K and V (16)

struct Params {
    TensorMap tk, tv;                        // TMA maps of K and V (fp8kv_cuda.tma.paged_cache_maps, box a page)
    const unsigned char* k;
    const unsigned char* v;
    const int* bt;                           // [B, bt_stride]
    unsigned* out;                           // one word: the XOR of everything read
    long long blk_stride, tok_stride;        // bytes
    int bt_stride, seq_len, kps, num_blocks, head_inner;
    long long stream_bytes;                  // read_stream: bytes of k
};

__device__ __forceinline__ void fold(unsigned& acc, uint4 x) { acc ^= x.x ^ x.y ^ x.z ^ x.w; }

__device__ __forceinline__ void publish(unsigned acc, unsigned* out) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xFFFFFFFFu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicXor(out, acc);
}

// Byte offset of copy j (0..CHUNKS-1) of a lane in a warp step at key n0 (K rows first, then V) of HPC
// adjacent KV heads from head hgrp * HPC (a step: 32 / HPC keys, 8 HPC 16-byte pieces a key), or -1.
template <int HPC = 1>
__device__ __forceinline__ long long step_offset(const Params& p, const int* bt, int n0, int kend, int lane,
                                                 int j, bool& is_v, int hgrp) {
    constexpr int PIECES = 8 * HPC;
    const int c = lane + 32 * (j % (CHUNKS / 2));  // (0..255: key c / PIECES, piece c % PIECES)
    is_v = j >= CHUNKS / 2;
    const int n = n0 + c / PIECES;
    if (n >= kend) return -1;
    const int blk = bt[n / PAGE];
    return (long long)blk * p.blk_stride + (long long)(n % PAGE) * p.tok_stride + (long long)hgrp * HPC * ROW +
           16 * (c % PIECES);
}

// Sequence seq's keys of split blockIdx.z, HPC adjacent heads from hgrp * HPC: each warp its own steps,
// 16-byte loads (16 a lane a step).
template <int HPC>
__device__ __forceinline__ void gather_loads(const Params& p, int seq, int hgrp) {
    constexpr int HSTEP = STEP / HPC;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int* bt = p.bt + (long long)seq * p.bt_stride;
    const int kbeg = blockIdx.z * p.kps, kend = min(p.seq_len, kbeg + p.kps);
    unsigned acc = 0u;
    for (int n0 = kbeg + warp * HSTEP; n0 < kend; n0 += NW * HSTEP) {
        uint4 x[CHUNKS];
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) {
            bool is_v;
            const long long off = step_offset<HPC>(p, bt, n0, kend, lane, j, is_v, hgrp);
            x[j] = off < 0 ? make_uint4(0, 0, 0, 0)
                           : __ldg(reinterpret_cast<const uint4*>((is_v ? p.v : p.k) + off));
        }
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) fold(acc, x[j]);
    }
    publish(acc, p.out);
}

extern "C" __global__ void __launch_bounds__(NT) gather_ldg(const __grid_constant__ Params p) {
    gather_loads<1>(p, blockIdx.x, blockIdx.y);
}

extern "C" __global__ void __launch_bounds__(NT) gather_cp(const __grid_constant__ Params p) {
    extern __shared__ uint4 ring[];          // [STAGES][CHUNKS][NT]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int* bt = p.bt + (long long)blockIdx.x * p.bt_stride;
    const int kbeg = blockIdx.z * p.kps, kend = min(p.seq_len, kbeg + p.kps);
    const int steps = kend > kbeg + warp * STEP ? (kend - kbeg - warp * STEP + NW * STEP - 1) / (NW * STEP) : 0;
    auto issue = [&](int i) {
        const int stage = i % STAGES, n0 = kbeg + (warp + i * NW) * STEP;
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) {
            bool is_v;
            const long long off = i < steps ? step_offset(p, bt, n0, kend, lane, j, is_v, blockIdx.y) : -1;
            const unsigned char* src = off < 0 ? p.k : (is_v ? p.v : p.k) + off;
            const u32 dst = smem_addr(ring + (stage * CHUNKS + j) * NT + tid);
            asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                         "r"(off < 0 ? 0 : 16) : "memory");
        }
        cp_async_commit();
    };
    for (int i = 0; i < STAGES - 1; ++i) issue(i);
    unsigned acc = 0u;
    for (int i = 0; i < steps; ++i) {
        issue(i + STAGES - 1);
        cp_async_wait<STAGES - 1>();
        const int stage = i % STAGES;
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) fold(acc, ring[(stage * CHUNKS + j) * NT + tid]);
    }
    cp_async_wait<0>();
    publish(acc, p.out);
}

extern "C" __global__ void __launch_bounds__(NT) gather_tma(const __grid_constant__ Params p) {
    extern __shared__ __align__(1024) unsigned char tiles[];  // [STAGES][PAGES][K, V][PAGE * ROW], then the barriers
    const int tid = threadIdx.x;
    const int* bt = p.bt + (long long)blockIdx.x * p.bt_stride;
    const int kbeg = blockIdx.z * p.kps, kend = min(p.seq_len, kbeg + p.kps);
    const int pbeg = kbeg / PAGE, pend = (kend + PAGE - 1) / PAGE;
    const int steps = pend > pbeg ? (pend - pbeg + PAGES - 1) / PAGES : 0;
    constexpr int STAGE_BYTES = PAGES * 2 * PAGE * ROW;
    u64* full = reinterpret_cast<u64*>(tiles + STAGES * STAGE_BYTES);  // [STAGES]
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    auto issue = [&](int i) {  // (thread 0)
        if (i >= steps) return;
        const int stage = i % STAGES;
        mbar_arrive_expect_tx(&full[stage], STAGE_BYTES);
        for (int q = 0; q < PAGES; ++q) {
            const int page = pbeg + i * PAGES + q;
            const int blk = page < pend ? bt[page] : p.num_blocks;  // (outside the map: zeros)
            const u32 dst = smem_addr(tiles + stage * STAGE_BYTES + q * 2 * PAGE * ROW);
            const int c1 = p.head_inner ? (int)blockIdx.y : 0, c2 = p.head_inner ? 0 : (int)blockIdx.y;
            tma_load_4d(dst, &p.tk, 0, c1, c2, blk, &full[stage]);
            tma_load_4d(dst + PAGE * ROW, &p.tv, 0, c1, c2, blk, &full[stage]);
        }
    };
    if (tid == 0)
        for (int i = 0; i < STAGES; ++i) issue(i);
    unsigned acc = 0u;
    for (int i = 0; i < steps; ++i) {
        const int stage = i % STAGES;
        mbar_wait(&full[stage], (i / STAGES) & 1);
        const uint4* t = reinterpret_cast<const uint4*>(tiles + stage * STAGE_BYTES);
        for (int j = tid; j < STAGE_BYTES / 16; j += NT) fold(acc, t[j]);
        __syncthreads();  // the stage is read: refill it
        if (tid == 0) issue(i + STAGES);
    }
    publish(acc, p.out);
}

extern "C" __global__ void __launch_bounds__(NT) gather_heads(const __grid_constant__ Params p) {
    gather_loads<FP8KV_HPC>(p, FP8KV_HEADS_FAST ? blockIdx.y : blockIdx.x, FP8KV_HEADS_FAST ? blockIdx.x : blockIdx.y);
}

extern "C" __global__ void __launch_bounds__(NT) read_stream(const __grid_constant__ Params p) {
    const uint4* src = reinterpret_cast<const uint4*>(p.k);
    const long long n = p.stream_bytes / 16, stride = (long long)gridDim.x * NT;
    unsigned acc = 0u;
    long long i = (long long)blockIdx.x * NT + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
                    d = __ldg(src + i + 3 * stride);
        fold(acc, a); fold(acc, b); fold(acc, c); fold(acc, d);
    }
    for (; i < n; i += stride) fold(acc, __ldg(src + i));
    publish(acc, p.out);
}
