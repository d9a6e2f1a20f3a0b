// fp8kv_cuda: Hopper (sm_90a) building blocks shared by the warp-specialized wgmma kernels
// (prefill_wgmma.cu here, fp8_prefill.cu of fp8kv_hopper through fp8kv_cuda.variants.inline_headers):
// mbarriers and named barriers, cp.async, fences, wgmma shared-memory descriptors for the no-swizzle
// K-major layout, and the wgmma forms the kernels issue (64 rows per warpgroup, float32 accumulators).
//
// Layout: a K-major tile is made of 8-row x 16-byte "core matrices" (128 contiguous bytes); LBO = 128
// bytes between core matrices along K, SBO bytes between 8-row groups (kmajor, desc). A k step of 32
// bytes (k32 for 8-bit, k16 for 16-bit operands) is two core matrices: the descriptor + 16.
// Accumulators (CLayout_64xN): thread t of the warpgroup holds d[4 j + 2 h + e] = (row 16 (t / 32) +
// (t % 32) / 4 + 8 h, column 8 j + 2 (t % 4) + e).
#pragma once
#include "ptx_math.cuh"

namespace fp8kv {

typedef unsigned int u32;  // (as codec.cuh's, where both are included)
typedef unsigned long long u64;

// The float32 accumulator registers of an m64n64 / m64n128 wgmma, as asm operands (the m64n128 lists
// extend the m64n64 ones).
#define FP8KV_REGS_0_31 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FP8KV_ACC32_REGS "{" FP8KV_REGS_0_31 "}"
#define FP8KV_ACC64_REGS \
    "{" FP8KV_REGS_0_31 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FP8KV_ACC32_OPS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FP8KV_ACC64_OPS(d) \
    FP8KV_ACC32_OPS(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Byte (row, kb) of a K-major no-swizzle tile with SBO bytes between 8-row groups.
__device__ __forceinline__ u32 kmajor(int row, int kb, int sbo) {
    return (u32)((row >> 3) * sbo + (kb >> 4) * 128 + (row & 7) * 16 + (kb & 15));
}

// wgmma shared-memory matrix descriptor: no swizzle, LBO 128 bytes (along K), SBO (along M/N).
__device__ __forceinline__ u64 desc(u32 addr, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(128u >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// Byte (row, kb) of a tile of 128-byte rows in the 128-byte swizzle (TMA's CU_TENSOR_MAP_SWIZZLE_128B and
// wgmma's layout type 1): 16-byte chunk kb / 16 of row `row` is stored at chunk (kb / 16) ^ (row % 8). The
// tile's base must be 1024-byte aligned (the swizzle reads address bits 4..9).
__device__ __forceinline__ u32 sw128(int row, int kb) {
    return (u32)(row * 128 + ((((kb >> 4) ^ row) & 7) << 4) + (kb & 15));
}

// wgmma descriptor of a K-major tile of 128-byte rows in the 128-byte swizzle: SBO 1024 bytes between
// 8-row groups (LBO unused); a k step of 32 bytes is the start address + 32 (the swizzle applies to the
// address the hardware forms).
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024u >> 4) << 32) | ((u64)1 << 62);
}

// ---- synchronization ----
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred P1;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
// mbarrier initializations visible to the async proxy (TMA's complete_tx)
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// arrive once and expect `bytes` more from asynchronous copies (TMA) in the current phase
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// the barrier's pending count + 1, and - 1 once every earlier cp.async of this thread has landed
__device__ __forceinline__ void cp_async_mbar_arrive(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// bar.sync of `count` threads that also returns whether `pred` holds in all of them
__device__ __forceinline__ bool named_sync_and(int id, int count, bool pred) {
    u32 r;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.and.pred p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(r) : "r"((u32)pred), "r"(id), "r"(count) : "memory");
    return r != 0u;
}
// ordinary and cp.async stores to shared memory, read next by wgmma (the async proxy)
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool ok) {  // zero-filled unless ok
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
// A CUtensorMap (opaque, 128 bytes, 64-byte aligned), encoded on the host (fp8kv_cuda.runtime.tensor_map_uint8)
// and passed as a __grid_constant__ kernel parameter (or a field of one)
struct alignas(64) TensorMap {
    u64 words[16];
};
// TMA: the box at coordinates (c0, c1, c2, c3) of the 4-d tensor map `tmap` (a __grid_constant__ kernel
// parameter) into shared memory at dst; its bytes complete on `bar` (coordinates outside the tensor are
// zero-filled)
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* tmap, int c0, int c1, int c2, int c3, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar)) : "memory");
}
// A tile's K and V codes as TMA boxes, by one warp (lane 0..31): box b holds keys n0 + b box_rows ..
// + box_rows - 1 (a page, or box_rows keys of a longer one) of KV head `head`, 128 codes a key, at byte
// b box_rows 128 of kdst / vdst; `keys` keys in all. block_of(n): the block id of key n's page (-1:
// none; an id outside [0, num_blocks) gets the block coordinate num_blocks, outside the map: zero-filled),
// in_page(n): n's key in its page. The maps (fp8kv_cuda.tma.paged_cache_maps) are 4-d: 128 codes, X, Y,
// blocks, with X, Y = head, key in the page when head_inner, else the other way round.
template <class BlockOf, class InPage>
__device__ __forceinline__ void tma_load_boxes(u32 kdst, u32 vdst, const void* tmap_k, const void* tmap_v, u64* bar,
                                               int n0, int keys, int box_rows, int head_inner, int head,
                                               int num_blocks, int lane, BlockOf&& block_of, InPage&& in_page) {
    for (int box = lane; box * box_rows < keys; box += 32) {
        const int n = n0 + box * box_rows, blk = block_of(n);
        const int c3 = blk >= 0 && blk < num_blocks ? blk : num_blocks, r = in_page(n);
        const int c1 = head_inner ? head : r, c2 = head_inner ? r : head;
        const u32 off = (u32)(box * box_rows * 128);
        tma_load_4d(kdst + off, tmap_k, 0, c1, c2, c3, bar);
        tma_load_4d(vdst + off, tmap_v, 0, c1, c2, c3, bar);
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// A 4 x 4 byte transpose: y[j] holds byte j of x[0], x[1], x[2], x[3] (in that order).
__device__ __forceinline__ void transpose4x4(const u32 (&x)[4], u32 (&y)[4]) {
    const u32 t0 = prmt(x[0], x[1], 0x5140u), t1 = prmt(x[0], x[1], 0x7362u);
    const u32 t2 = prmt(x[2], x[3], 0x5140u), t3 = prmt(x[2], x[3], 0x7362u);
    y[0] = prmt(t0, t2, 0x5410u);
    y[1] = prmt(t0, t2, 0x7632u);
    y[2] = prmt(t1, t3, 0x5410u);
    y[3] = prmt(t1, t3, 0x7632u);
}

// float16 pair (a low, b high), rounded to nearest (ptx_math.cuh: the halves back as float32)
__device__ __forceinline__ u32 pack_f16x2(float a, float b) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// ---- wgmma ----
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// (all but the last committed group done: groups complete in order)
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// keeps the compiler from touching accumulators across an asynchronous wgmma
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A B^T, A [64 x 32] and B [128 x 32] e4m3 from shared memory (descriptors); accumulate unless first
__device__ __forceinline__ void wgmma_e4m3_ss(float (&d)[64], u64 da, u64 db, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FP8KV_ACC64_REGS ", %64, %65, p, 1, 1;\n}\n"
        : FP8KV_ACC64_OPS(d)
        : "l"(da), "l"(db), "r"((int)accumulate));
}
// d += A B^T with A [64 x k] from registers (4 words per thread) and B [128 x k] from shared memory:
// the wgmma form INSTR ("m64n128k32.f32.e4m3.e4m3") with its immediates IMMS (scale-a, scale-b and,
// for 16-bit types, transpose-b)
#define FP8KV_WGMMA_RS_N128(INSTR, IMMS)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                \
                 "wgmma.mma_async.sync.aligned." INSTR " " FP8KV_ACC64_REGS ", {%64, %65, %66, %67}, %68, p, " IMMS ";\n}\n" \
                 : FP8KV_ACC64_OPS(d)                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db))
// A [64 x 32] e4m3 (e4m3 A fragments), B [128 x 32] e4m3
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[64], const u32 (&a)[4], u64 db) {
    FP8KV_WGMMA_RS_N128("m64n128k32.f32.e4m3.e4m3", "1, 1");
}
// d (+)= A B^T, A [64 x 16] and B [64 x 16] 16-bit (BF16: bfloat16, else float16), both K-major in
// shared memory; accumulate unless first
#define FP8KV_WGMMA_16_SS_N64(TYPES)                                                                        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                               \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " " FP8KV_ACC32_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : FP8KV_ACC32_OPS(d)                                                                         \
                 : "l"(da), "l"(db), "r"((int)accumulate))
template <bool BF16>
__device__ __forceinline__ void wgmma_16_ss_n64(float (&d)[32], u64 da, u64 db, bool accumulate) {
    if constexpr (BF16) FP8KV_WGMMA_16_SS_N64("bf16.bf16");
    else FP8KV_WGMMA_16_SS_N64("f16.f16");
}
// A [64 x 16] float16 (4 words: CLayout's pairs), B [128 x 16] float16 K-major
__device__ __forceinline__ void wgmma_f16_rs_n128(float (&d)[64], const u32 (&a)[4], u64 db) {
    FP8KV_WGMMA_RS_N128("m64n128k16.f32.f16.f16", "1, 1, 0");
}

// ---- the online softmax over accumulator rows (thread t holds rows r and r + 8: h = (i >> 1) & 1) ----

// The maxima of the thread's two rows over an m64nN accumulator (the quad's four threads hold a row).
template <int N>
__device__ __forceinline__ void row_max(const float (&s)[N], float (&mx)[2]) {
    float part[2][4];  // four independent chains a row (latency, not a 32-long dependency chain)
#pragma unroll
    for (int k = 0; k < 4; ++k) part[0][k] = part[1][k] = __int_as_float(0xff800000);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float& m = part[(i >> 1) & 1][(i & 1) + 2 * ((i >> 2) & 1)];
        m = fmaxf(m, s[i]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(fmaxf(part[h][0], part[h][1]), fmaxf(part[h][2], part[h][3]));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 2));
    }
}

// o's rows times alpha[h], each half (h = 0: rows r, h = 1: rows r + 8) skipped when none of the warp's
// 8 rows there moved its maximum (alpha == 1).
__device__ __forceinline__ void rescale_rows(float (&o)[64], const float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (__any_sync(0xFFFFFFFFu, alpha[h] != 1.0f)) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                o[4 * j + 2 * h] *= alpha[h];
                o[4 * j + 2 * h + 1] *= alpha[h];
            }
        }
    }
}

// An m64nN accumulator of warpgroup thread t (0..127) into a row-major float32 matrix (leading dim ld).
template <int N>
__device__ __forceinline__ void store_acc(float* out, int ld, const float (&d)[N], int t) {
    const int warp = t >> 5, r = (t & 31) >> 2, c = t & 3;
#pragma unroll
    for (int i = 0; i < N; ++i) out[(16 * warp + r + 8 * ((i >> 1) & 1)) * ld + 8 * (i >> 2) + 2 * c + (i & 1)] = d[i];
}

// ---- the warp-specialized pipeline (one producer warpgroup, threads 0..127; two consumer warpgroups) ----
constexpr int WS_THREADS = 384;
constexpr int PRODUCER_REGS = 56;   // setmaxnreg: 128 x 56 + 256 x 224 = 384 x 168 (a 384-thread launch's pool)
constexpr int CONSUMER_REGS = 224;
// The producer warpgroup's and the consumers' register counts (multiples of 8); a split that asks for more
// than the launch's pool would leave the consumers' setmaxnreg.inc waiting forever.
template <int PRODUCER = PRODUCER_REGS, int CONSUMER = CONSUMER_REGS>
__device__ __forceinline__ void producer_registers() {
    static_assert(128 * PRODUCER + 256 * CONSUMER <= WS_THREADS * 168 && PRODUCER % 8 == 0, "setmaxnreg split");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER) : "memory");
}
template <int PRODUCER = PRODUCER_REGS, int CONSUMER = CONSUMER_REGS>
__device__ __forceinline__ void consumer_registers() {
    static_assert(128 * PRODUCER + 256 * CONSUMER <= WS_THREADS * 168 && CONSUMER % 8 == 0, "setmaxnreg split");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER) : "memory");
}

// Tiles t = 0..ntiles-1 go through STAGES shared-memory stages; full[s] (128 arrivals) says stage s holds
// a tile, empty[s] (256 arrivals) that its consumers are done with it. Named barriers: 1 (the producer),
// 4 and 5 (the consumers' turns).

// The producer: issue(t) starts tile t's copies into stage t % STAGES (one cp.async group) once the
// stage is free; a tile later, when its copies have landed, finish(t) prepares it in shared memory
// (ordinary stores) and the tile is handed over.
template <int STAGES, class Issue, class Finish>
__device__ __forceinline__ void producer_pipeline(u64* full, u64* empty, int ntiles, Issue&& issue, Finish&& finish) {
    for (int t = 0; t <= ntiles; ++t) {
        if (t < ntiles) {
            mbar_wait(&empty[t % STAGES], ((t / STAGES) & 1) ^ 1);
            issue(t);
        }
        if (t >= 1) {
            if (t < ntiles) cp_async_wait<1>();
            else cp_async_wait<0>();
            named_sync(1, 128);  // every producer thread's copies of tile t - 1 have landed
            finish(t - 1);
            fence_async_shared();
            mbar_arrive(&full[(t - 1) % STAGES]);
        }
    }
}

// A consumer warpgroup (cw = 0, 1): phase t = 0..ntiles runs wait(t) (returns once phase t's operands are
// in shared memory), has issue(t) issue its wgmma (the previous tile's second product and tile t's
// first), waits for them, releases tile t - 1's stage and runs done(t) (which starts with fence_acc on
// the accumulators it reads). With PINGPONG the two warpgroups issue their phases in turn (FA3's
// schedule: one's softmax overlaps the other's products). base: the tiles that went through the stages
// before (a persistent CTA's earlier work): tile t is the ring's tile base + t.
template <int STAGES, bool PINGPONG, class Wait, class Issue, class Done>
__device__ __forceinline__ void consumer_pipeline_waits(Wait&& wait, u64* empty, int ntiles, int cw, Issue&& issue,
                                                        Done&& done, int base = 0) {
    if (PINGPONG && cw == 1) named_arrive(4, 256);  // warpgroup 0 issues first
    for (int t = 0; t <= ntiles; ++t) {
        wait(t);
        if (PINGPONG) named_sync(4 + cw, 256);
        wgmma_fence();
        issue(t);
        wgmma_commit();
        if (PINGPONG) named_arrive(4 + (1 - cw), 256);
        wgmma_wait0();
        if (t >= 1) mbar_arrive(&empty[(base + t - 1) % STAGES]);  // tile t-1's operands are read
        done(t);
    }
    if (PINGPONG && cw == 0) named_sync(4, 256);  // warpgroup 1's last arrive
}
// FA3's intra-warpgroup overlap, the same phases otherwise: phase t issues tile t's first product (first(t),
// S = Q K^T) and then tile t - 1's second (second(t - 1), O += P V) as a group of its own, waits for the first
// alone and runs early(t) (tile t's softmax, while the second product runs: it must touch neither O nor the
// second product's A registers), then waits for the second, releases tile t - 1's stage and runs late(t)
// (what needs O += P(t-1) V(t-1) done: O's rescaling, the A registers of P(t); t = ntiles too). early and
// late start with fence_acc on the accumulators they read.
template <int STAGES, bool PINGPONG, class Wait, class First, class Second, class Early, class Late>
__device__ __forceinline__ void consumer_pipeline_overlap(Wait&& wait, u64* empty, int ntiles, int cw, First&& first,
                                                          Second&& second, Early&& early, Late&& late, int base = 0) {
    // (the first and last phases peeled: ptxas serializes the wgmma where the groups' count is conditional)
    if (PINGPONG && cw == 1) named_arrive(4, 256);  // warpgroup 0 issues first
    auto turn = [&] { if (PINGPONG) named_sync(4 + cw, 256); };
    auto pass = [&] { if (PINGPONG) named_arrive(4 + (1 - cw), 256); };
    if (ntiles > 0) {
        wait(0);
        turn();
        wgmma_fence();
        first(0);
        wgmma_commit();
        pass();
        wgmma_wait0();
        early(0);
        late(0);
    }
    for (int t = 1; t < ntiles; ++t) {
        wait(t);
        turn();
        wgmma_fence();
        first(t);
        wgmma_commit();
        second(t - 1);
        wgmma_commit();
        pass();
        wgmma_wait1();
        early(t);
        wgmma_wait0();
        mbar_arrive(&empty[(base + t - 1) % STAGES]);  // tile t-1's operands are read
        late(t);
    }
    if (ntiles > 0) {
        wait(ntiles);
        turn();
        wgmma_fence();
        second(ntiles - 1);
        wgmma_commit();
        pass();
        wgmma_wait0();
        mbar_arrive(&empty[(base + ntiles - 1) % STAGES]);
    }
    late(ntiles);
    if (PINGPONG && cw == 0) named_sync(4, 256);  // warpgroup 1's last arrive
}
// The same, phase t waiting for tile t on full[t % STAGES] (t < ntiles).
template <int STAGES, bool PINGPONG, class Issue, class Done>
__device__ __forceinline__ void consumer_pipeline(u64* full, u64* empty, int ntiles, int cw, Issue&& issue,
                                                  Done&& done) {
    consumer_pipeline_waits<STAGES, PINGPONG>(
        [&](int t) { if (t < ntiles) mbar_wait(&full[t % STAGES], (t / STAGES) & 1); }, empty, ntiles, cw, issue,
        done);
}

}  // namespace fp8kv
