// fp8kv_cuda: the fused cache write (quantize K and V, scatter them into their slots).
//
// One warp per row of the flattened [T * H, D] input (row r: token r / H, head r % H); lane l
// holds elements [l * EPT, (l + 1) * EPT) with EPT = D_PAD / 32. Per row:
//   slot = slot_mapping[token]; written only if 0 <= slot < num_slots (int64 compare), so padding
//   (negative) and out-of-range slots are skipped inside the kernel, host checks or not;
//   token_head: scale = max(amax(|x|) / fmt_max, 2^-126) (NaN counts as 0, inf as the float32
//   max; one IEEE division), stored at scale[block, offset, head] through that tensor's strides;
//   static scales: scale[head * sh] (sh = 0 per-tensor);
//   q = encode(x / scale) (IEEE division, a NaN input kept as it is, sign included).
// The cache rows are addressed through their own (block, token-in-block, head) strides (NHD,
// HND and views alike); offsets are int64.
//
// Compile-time macros (set by fp8kv_cuda.variants): the format's (see codec.cuh), and
//   FP8KV_IN: 0 float32, 1 float16, 2 bfloat16 (key/value dtype)
//   FP8KV_TOKEN_SCALES: 1 for per-token-head scales computed here
//   FP8KV_D_PAD: head size rounded up to a power of two >= 32
//   FP8KV_VEC: 1 when inputs and cache rows are aligned for EPT-wide loads and stores
//   FP8KV_SLOT64: 1 when slot_mapping is int64 (else int32)
#include "codec.cuh"
#include "ptx_math.cuh"

namespace fp8kv {

constexpr int IN = FP8KV_IN;
constexpr bool TOKEN_SCALES = FP8KV_TOKEN_SCALES != 0;
constexpr int D_PAD = FP8KV_D_PAD;
constexpr int EPT = D_PAD / 32;
constexpr bool VEC = FP8KV_VEC != 0;
constexpr int IN_BYTES = IN == 0 ? 4 : 2;
constexpr int WRITE_WARPS = 4;
static_assert(D_PAD >= 32 && D_PAD <= 256 && (D_PAD & (D_PAD - 1)) == 0, "D_PAD: a power of two in 32..256");

#if FP8KV_SLOT64
typedef i64 slot_t;
#else
typedef i32 slot_t;
#endif

// float32 bits of input element i (NaN kept with its sign: 16-bit inputs are widened by bits).
__device__ __forceinline__ u32 input_bits(const void* src, i64 i) {
    if (IN == 0) return static_cast<const u32*>(src)[i];
    const u32 h = static_cast<const u16*>(src)[i];
    return IN == 2 ? h << 16 : f16_to_f32_bits(h);
}

// EPT consecutive input elements starting at element i (16-byte aligned chunks when VEC).
__device__ __forceinline__ void load_row(const void* src, i64 i, bool ok, int n_valid, u32 (&x)[EPT]) {
    if (VEC && ok && n_valid == EPT) {
        constexpr int BYTES = EPT * IN_BYTES;
        const char* p = static_cast<const char*>(src) + i * IN_BYTES;
        u32 w[(BYTES + 3) / 4];
        if constexpr (BYTES >= 16) {
#pragma unroll
            for (int c = 0; c < BYTES / 16; ++c) {
                const uint4 v = reinterpret_cast<const uint4*>(p)[c];
                w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
            }
        } else if constexpr (BYTES == 8) {
            const uint2 v = *reinterpret_cast<const uint2*>(p);
            w[0] = v.x; w[1] = v.y;
        } else if constexpr (BYTES == 4) {
            w[0] = *reinterpret_cast<const u32*>(p);
        } else {
            w[0] = *reinterpret_cast<const u16*>(p);
        }
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
            if (IN == 0) {
                x[j] = w[j];
            } else {
                const u32 h = (w[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
                x[j] = IN == 2 ? h << 16 : f16_to_f32_bits(h);
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < EPT; ++j) x[j] = (ok && j < n_valid) ? input_bits(src, i + j) : 0u;
}

// EPT bytes (packed little-endian in w) to dst, one store when VEC, else byte by byte.
__device__ __forceinline__ void store_codes(u8* dst, const u32 (&c)[EPT], int n_valid) {
    if (VEC && n_valid == EPT) {
        if constexpr (EPT == 8) {
            uint2 v;
            v.x = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
            v.y = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
            *reinterpret_cast<uint2*>(dst) = v;
        } else if constexpr (EPT == 4) {
            *reinterpret_cast<u32*>(dst) = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
        } else if constexpr (EPT == 2) {
            *reinterpret_cast<u16*>(dst) = (u16)(c[0] | (c[1] << 8));
        } else {
            dst[0] = (u8)c[0];
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        if (j < n_valid) dst[j] = (u8)c[j];
    }
}

// Quantize one row (this warp's) of one tensor and store its codes (and token_head scale).
__device__ __forceinline__ void quantize_row(
    const void* src, u8* cache, float* scales, i64 row, bool valid, i64 blk, i64 off, i64 h, int D,
    i64 sb, i64 st, i64 sh, i64 cb, i64 ct, i64 ch, int lane) {
    const int d0 = lane * EPT;
    const int n_valid = i32_max(i32_min(D - d0, EPT), 0);
    u32 x[EPT];
    load_row(src, row * D + d0, valid && n_valid > 0, n_valid, x);
    float scale;
    if (TOKEN_SCALES) {
        u32 amax = 0u;  // |x| as bits: NaN counts as 0, inf as the float32 max
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
            u32 a = x[j] & 0x7FFFFFFFu;
            a = a > 0x7F800000u ? 0u : u32_min(a, 0x7F7FFFFFu);
            amax = u32_max(amax, a);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = u32_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        scale = dynamic_scale(u2f(amax), u2f(MAXBITS));  // (one IEEE division, floored at 2^-126)
        if (valid && lane == 0) scales[blk * cb + off * ct + h * ch] = scale;
    } else {
        scale = valid ? scales[h * ch] : 1.0f;  // ch = 0: per-tensor
    }
    u32 c[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const u32 b = x[j];
        const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;  // kept as is: -NaN -> the negative NaN byte
        c[j] = encode_bits(nan ? b : f2u(__fdiv_rn(u2f(b), scale)));
    }
    if (valid && n_valid > 0) store_codes(cache + blk * sb + off * st + h * sh + d0, c, n_valid);
}

}  // namespace fp8kv

using namespace fp8kv;

// Grid: ceil(T * H / WRITE_WARPS) blocks of 32 * WRITE_WARPS threads.
extern "C" __global__ void __launch_bounds__(32 * WRITE_WARPS) fp8kv_write_kv(
    const void* __restrict__ key, const void* __restrict__ value, const slot_t* __restrict__ slot_mapping,
    u8* key_cache, u8* value_cache, float* k_scale, float* v_scale,
    i64 num_rows, int H, int D, i64 num_slots, int block_size,
    i64 k_sb, i64 k_st, i64 k_sh, i64 v_sb, i64 v_st, i64 v_sh,
    i64 ks_sb, i64 ks_st, i64 ks_sh, i64 vs_sb, i64 vs_st, i64 vs_sh) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * WRITE_WARPS + (threadIdx.x >> 5);
    if (row >= num_rows) return;  // whole warps leave together: the shuffles stay full
    // 32-bit divisions where the values fit (a 64-bit one is a subroutine call)
    const i64 t = num_rows <= 0x7FFFFFFF ? (i64)((int)row / H) : row / H;
    const i64 h = row - t * H;
    const i64 slot = (i64)slot_mapping[t];
    const bool valid = slot >= 0 && slot < num_slots;  // padding and out-of-range: not written
    i64 blk = 0;
    if (valid) blk = num_slots <= 0x7FFFFFFF ? (i64)((int)slot / block_size) : slot / block_size;
    const i64 off = valid ? slot - blk * block_size : 0;
    quantize_row(key, key_cache, k_scale, row, valid, blk, off, h, D, k_sb, k_st, k_sh, ks_sb, ks_st, ks_sh, lane);
    quantize_row(value, value_cache, v_scale, row, valid, blk, off, h, D, v_sb, v_st, v_sh, vs_sb, vs_st, vs_sh,
                 lane);
}
