// fp8kv_cuda: float16 pair helpers shared by the tensor-core kernels (mma_common.cuh, wgmma_common.cuh).
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

}  // namespace fp8kv
