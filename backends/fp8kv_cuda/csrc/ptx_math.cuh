// fp8kv_cuda: small PTX helpers shared by the tensor-core kernels (through mma_common.cuh and
// wgmma_common.cuh; the Hopper backend's FP8 kernel too): the halves of a float16 pair, 2^x, exact
// powers of two, e4m3 rounding (sm89+), the dynamic shared memory check.
#pragma once

namespace fp8kv {

typedef unsigned int u32;  // (as codec.cuh's, where both are included)

__device__ __forceinline__ float f16_lo(u32 x) {  // the low half of a float16 pair, as float32
    float r;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }" : "=f"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ float f16_hi(u32 x) {  // the high half
    float r;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }" : "=f"(r) : "r"(x));
    return r;
}

// The dynamic scale of a row, as the cache's token_head scales and the FP8 mode's query scale are defined:
// max(amax / fmt_max, 2^-126), one IEEE division; amax_term(x) is what x adds to amax (|x|, NaN as 0, inf as
// the largest float).
__device__ __forceinline__ float amax_term(float x) {
    const float v = fabsf(x);
    return v != v ? 0.0f : fminf(v, 3.4028234663852886e38f);
}
__device__ __forceinline__ float dynamic_scale(float amax, float fmt_max) {
    return fmaxf(__fdiv_rn(amax, fmt_max), 1.1754943508222875e-38f);
}

__device__ __forceinline__ float exp2_approx(float x) {  // 2^x (ex2.approx: <= 2 ulp; below 2^-126: 0)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// 2^k for an integer (or -inf) k <= 0, exactly, from the bits (subnormals included; below 2^-149: 0):
// the FP8 attention mode's rescalings between integer running maxima (docs/fp8_attention.md).
__device__ __forceinline__ float pow2_int(float k) {
    const int e = (int)fmaxf(k, -150.0f);
    const u32 normal = (u32)max(e + 127, 0) << 23, subnormal = 1u << min(max(e + 149, 0), 31);
    return __uint_as_float(e >= -126 ? normal : (e >= -149 ? subnormal : 0u));  // (selects, no branches)
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// e4m3 bytes (lo, hi) of two floats: round to nearest even after saturation to +-448 (satfinite;
// NaN stays NaN), bit for bit the cache's quantization of a value already divided by its scale.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (u32)r;
}

// The same two values rounded to e4m3, as a float16 pair (exact: every e4m3 value is a float16).
__device__ __forceinline__ u32 e4m3x2_as_f16x2(float lo, float hi) {
    u32 r;
    asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %1, %2; cvt.rn.f16x2.e4m3x2 %0, t; }"
        : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

// A kernel whose launch gave it less dynamic shared memory than its layout needs stops (a launcher
// bug, never silent corruption).
__device__ __forceinline__ void trap_unless_smem(u32 needed) {
    u32 bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes < needed) __trap();
}

}  // namespace fp8kv
