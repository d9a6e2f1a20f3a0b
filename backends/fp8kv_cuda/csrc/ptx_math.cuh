// fp8kv_cuda: small PTX helpers shared by the tensor-core kernels (through mma_common.cuh and
// wgmma_common.cuh): the halves of a float16 pair, 2^x, the dynamic shared memory check.
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

__device__ __forceinline__ float exp2_approx(float x) {  // 2^x (ex2.approx: <= 2 ulp; below 2^-126: 0)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// A kernel whose launch gave it less dynamic shared memory than its layout needs stops (a launcher
// bug, never silent corruption).
__device__ __forceinline__ void trap_unless_smem(u32 needed) {
    u32 bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes < needed) __trap();
}

}  // namespace fp8kv
