// fp8kv_cuda: elementwise entry points of the software codec, for the GPU codec proofs
// (tests/test_cuda_gpu.py) and the compile cells. Not used by the ops.
#include "codec.cuh"

using namespace fp8kv;

// bits[i] (float32 patterns, already divided by the scale) -> FP8 bytes.
extern "C" __global__ void fp8kv_encode(const u32* __restrict__ bits, u8* __restrict__ out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (u8)encode_bits(bits[i]);
}

// FP8 bytes -> float32 values.
extern "C" __global__ void fp8kv_decode(const u8* __restrict__ codes, float* __restrict__ out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = decode(codes[i]);
}

// float16 patterns -> float32 bits (the write's widening of float16 inputs).
extern "C" __global__ void fp8kv_widen_f16(const u16* __restrict__ h, u32* __restrict__ out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f16_to_f32_bits(h[i]);
}

// FP8 byte pairs (u16) -> float16 pairs (u32) by the native widening of sm89+ (OCP formats; traps
// where NATIVE_WIDEN is false, which the launcher never asks for).
extern "C" __global__ void fp8kv_widen_native(const u16* __restrict__ pairs, u32* __restrict__ out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if constexpr (NATIVE_WIDEN) {
        u32 lo, hi;
        widen_native(pairs[i], lo, hi);
        out[i] = lo;
    } else {
        __trap();
    }
}
