// fp8kv_cuda: the software FP8 codec (float32 <-> FP8 bytes by integer bit operations).
//
// A line-by-line mirror of fp8kv/codec.py (the blueprint): clamp first (saturating: a finite
// input never becomes inf or NaN), round to nearest even with the carry into the exponent,
// NaN stays NaN (OCP: 0x7F | sign << 7, fnuz: 0x80), no -0 in fnuz formats.
//
// One format per compilation: the launcher passes the format's constants as macros taken
// from fp8kv.codec.codec_constants (never typed by hand here):
//   FP8KV_MANT, FP8KV_BIAS, FP8KV_FNUZ, FP8KV_HASINF, FP8KV_MAXBITS (float32 bits of +max),
//   FP8KV_MAXMAG (the byte of +max).
// The kernels are compiled with -ftz=false (IEEE denormals: the write's x / scale must be
// correctly rounded for subnormal x too); the decoder does not depend on it.
// The header is also compiled as plain host C++ (g++) by tests/test_cuda_codec.py, which checks
// it bit for bit against the reference on every fp16/bf16 pattern and millions of float32s.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FP8KV_HD __device__ __forceinline__
#define FP8KV_DEVICE 1
#else
#define FP8KV_HD static inline
#include <cstring>
#endif

typedef unsigned int fp8kv_u32;
typedef int fp8kv_i32;
typedef long long fp8kv_i64;
typedef unsigned long long fp8kv_u64;
typedef unsigned short fp8kv_u16;
typedef unsigned char fp8kv_u8;

namespace fp8kv {

typedef fp8kv_u32 u32;
typedef fp8kv_i32 i32;
typedef fp8kv_i64 i64;
typedef fp8kv_u16 u16;
typedef fp8kv_u8 u8;

// ------------------------------------------------------------------ format constants
constexpr int MANT = FP8KV_MANT;              // mantissa bits (3 or 2)
constexpr int BIAS = FP8KV_BIAS;              // exponent bias (7, 15, 8, 16)
constexpr bool FNUZ = FP8KV_FNUZ != 0;        // no -0, no inf, 0x80 is the only NaN
constexpr bool HASINF = FP8KV_HASINF != 0;    // e5m2: the magnitude right above MAXMAG is inf
constexpr u32 MAXBITS = FP8KV_MAXBITS;        // float32 bits of +max: the clamp, as an integer min
constexpr u32 MAXMAG = FP8KV_MAXMAG;          // the byte of +max (7 magnitude bits)
constexpr int REBIAS = BIAS - 127;            // float32 biased exponent -> fp8 biased exponent
constexpr int DROP = 23 - MANT;               // float32 mantissa bits dropped for a normal result
constexpr int MAXSHIFT = 25;                  // rounding shifts >= 25 leave only sticky bits
constexpr u32 NANBYTE = FNUZ ? 0x80u : 0x7Fu;

// ------------------------------------------------------------------ bit casts
FP8KV_HD u32 f2u(float x) {
#ifdef FP8KV_DEVICE
    return __float_as_uint(x);
#else
    u32 u;
    std::memcpy(&u, &x, 4);
    return u;
#endif
}

FP8KV_HD float u2f(u32 u) {
#ifdef FP8KV_DEVICE
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, 4);
    return x;
#endif
}

FP8KV_HD u32 u32_min(u32 a, u32 b) { return a < b ? a : b; }
FP8KV_HD u32 u32_max(u32 a, u32 b) { return a > b ? a : b; }
FP8KV_HD i32 i32_min(i32 a, i32 b) { return a < b ? a : b; }
FP8KV_HD i32 i32_max(i32 a, i32 b) { return a > b ? a : b; }

// Index of the highest set bit of v (0 < v < 2^31); v == 0 gives 0 (callers mask it out).
FP8KV_HD i32 floor_log2(u32 v) {
#ifdef FP8KV_DEVICE
    return v ? 31 - __clz(v) : 0;
#else
    return v ? 31 - __builtin_clz(v) : 0;
#endif
}

// ------------------------------------------------------------------ encode
// float32 bits (already divided by the scale) -> FP8 byte. Mirror of fp8kv.codec._encode_sign_mag.
FP8KV_HD u32 encode_bits(u32 bits) {
    u32 sign = bits >> 31;
    u32 mag = bits & 0x7FFFFFFFu;
    // 1. NaN: any float32 magnitude above +inf's bit pattern.
    const bool is_nan = mag > 0x7F800000u;
    // 2. Saturate: positive floats order like their bit patterns (+inf clamps to max too).
    mag = u32_min(mag, MAXBITS);
    // 3. float32 fields; exp32 == 0 is zero or a float32 subnormal (no implicit 1).
    const i32 exp32 = (i32)(mag >> 23);
    const u32 frac = mag & 0x7FFFFFu;
    const u32 sig = exp32 != 0 ? (frac | 0x800000u) : frac;
    // 4. fp8 biased exponent if normal; e8 <= 0: an fp8 subnormal, shifted 1 - e8 bits more.
    const i32 e8 = i32_max(exp32, 1) + REBIAS;
    const i32 extra = i32_max(1 - e8, 0);
    const i32 shift = i32_min(DROP + extra, MAXSHIFT);  // 20..25: every shift below 32
    // 5. Truncate; guard = first dropped bit, sticky = OR of the rest.
    const u32 kept = sig >> shift;
    const u32 guard = (sig >> (shift - 1)) & 1u;
    const bool sticky = (sig & ((1u << (shift - 1)) - 1u)) != 0u;
    // 6. Exponent above mantissa in one integer (kept holds the implicit bit when normal).
    u32 q = e8 >= 1 ? ((u32)(e8 - 1) << MANT) + kept : kept;
    // 7. Round to nearest even; the +1 carries into the exponent (127.8 -> 128 in e4m3).
    const bool round_up = guard == 1u && (sticky || (q & 1u) == 1u);
    q += round_up ? 1u : 0u;
    // 8. Sign; fnuz has no -0.
    if (FNUZ && q == 0u) sign = 0u;
    q |= sign << 7;
    // 9. NaN: OCP keeps the sign (0x7F / 0xFF), fnuz has only 0x80.
    const u32 nan_q = FNUZ ? NANBYTE : (NANBYTE | (sign << 7));
    return is_nan ? nan_q : q;
}

// ------------------------------------------------------------------ decode
// FP8 byte -> its exact float32 value, by integer operations and exact float32 products only:
// never a subnormal float32 (so it is exact whether or not denormals are flushed). Normal bytes:
// the 7 magnitude bits shifted into a float32's exponent and mantissa fields, the exponent
// rebiased by an integer add; subnormal bytes (e == 0): m * 2^(1 - BIAS - MANT), a small integer
// times a normal power of two. Specials patched: OCP NaN/inf, the fnuz NaN 0x80.
FP8KV_HD float decode_generic(u32 v) {
    const u32 mag = v & 0x7Fu;
    const u32 sign = (v & 0x80u) << 24;
    const u32 m = mag & ((1u << MANT) - 1u);
    const float sub = (float)(i32)m * u2f((u32)(127 + 1 - BIAS - MANT) << 23);
    const u32 normal = (mag << DROP) + ((u32)(127 - BIAS) << 23);
    const u32 bits = ((mag >> MANT) == 0u ? f2u(sub) : normal) | sign;
    if (FNUZ) {
        return v == 0x80u ? u2f(0x7FC00000u) : u2f(bits);
    }
    if (mag > MAXMAG) {
        const bool inf = HASINF && mag == MAXMAG + 1u;
        return u2f(sign | (inf ? 0x7F800000u : 0x7FC00000u));
    }
    return u2f(bits);
}

#ifdef FP8KV_DEVICE
__device__ __forceinline__ float half_bits_to_float(u32 h) {  // exact (cvt.f32.f16 has no flush)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
    return f;
}
#endif

// FP8 byte -> exact float32, the kernels' decoder. On the device, the cheapest exact path per
// format: e5m2 is the top byte of the float16 of the same value (inf/NaN included); e4m3fn and
// e4m3fnuz are a float16 whose exponent is off by 15 - BIAS (subnormals included), fixed by one
// exact power-of-two product, NaN bytes patched; e5m2fnuz takes the generic decoder. On the host
// (g++ tests) the generic decoder. tests/test_cuda_gpu.py proves the device paths on all 256 bytes.
FP8KV_HD float decode(u32 v) {
#ifdef FP8KV_DEVICE
    if constexpr (MANT == 2 && !FNUZ) {
        return half_bits_to_float(v << 8);
    } else if constexpr (MANT == 3) {
        const u32 h = ((v & 0x7Fu) << 7) | ((v & 0x80u) << 8);
        const float f = half_bits_to_float(h) * u2f((u32)(127 + 15 - BIAS) << 23);
        if (FNUZ) return v == 0x80u ? u2f(0x7FC00000u) : f;
        return (v & 0x7Fu) == 0x7Fu ? u2f(((v & 0x80u) << 24) | 0x7FC00000u) : f;
    } else {
        return decode_generic(v);
    }
#else
    return decode_generic(v);
#endif
}

// ------------------------------------------------------------------ 16-bit floats
// float16 bits -> float32 bits, exactly (subnormals normalised, NaN keeps sign and payload).
FP8KV_HD u32 f16_to_f32_bits(u32 h) {
    const u32 sign = (h & 0x8000u) << 16;
    const u32 e = (h >> 10) & 0x1Fu;
    const u32 m = h & 0x3FFu;
    u32 out;
    if (e == 0x1Fu) {
        out = 0x7F800000u | (m << 13);
    } else if (e != 0u) {
        out = ((e + 112u) << 23) | (m << 13);
    } else if (m != 0u) {
        const i32 p = floor_log2(m);  // value = 2^(p - 24) * 1.(bits below p)
        out = ((u32)(p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFFu);
    } else {
        out = 0u;
    }
    return sign | out;
}

// float32 -> float16 bits, round to nearest even (the caller saturates first: |x| <= 65504 or NaN).
FP8KV_HD u16 f32_to_f16_bits(float x) {
#ifdef FP8KV_DEVICE
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    // host: reference rounding for tests (not used by the kernels)
    _Float16 h = (_Float16)x;
    u16 b;
    std::memcpy(&b, &h, 2);
    return b;
#endif
}

// float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN with its sign.
FP8KV_HD u16 f32_to_bf16_bits(float x) {
    const u32 u = f2u(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40u);
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ------------------------------------------------------------------ native widening (sm89+)
// FP8 pairs -> float16 pairs by cvt.rn.f16x2.{e4m3x2,e5m2x2}: exact for every code of the OCP
// formats (NaN and inf included; no fnuz conversions exist). The attention kernel's fast path;
// tests/test_cuda_gpu.py checks it against torch on every code pair.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool NATIVE_WIDEN = !FNUZ;
#else
constexpr bool NATIVE_WIDEN = false;
#endif

#ifdef FP8KV_DEVICE
// Bytes 0, 1 (lo) and 2, 3 (hi) of x as two float16 pairs (NATIVE_WIDEN only).
__device__ __forceinline__ void widen_native(u32 x, u32& lo, u32& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (HASINF) {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, h; }"
            : "=r"(lo), "=r"(hi) : "r"(x));
    } else {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
            : "=r"(lo), "=r"(hi) : "r"(x));
    }
#else
    lo = hi = x;
    __trap();  // unreachable: callers test NATIVE_WIDEN
#endif
}
#endif

}  // namespace fp8kv
