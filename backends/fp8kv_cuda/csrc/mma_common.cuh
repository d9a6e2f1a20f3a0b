// fp8kv_cuda: what the tensor-core attention kernels (attention_mma.cu: decode; prefill_mma.cu:
// chunked prefill) share: FP8 -> float16/bfloat16 pairs (bit-level, native on sm89+, or the software
// decoder for special codes), the mma.sync m16n8k16 and register-shuffling primitives, cp.async.
//
// Below sm80 (Turing, sm75): mma.sync m16n8k8 takes float16 operands only, and there is no cp.async
// and no cvt.rn.f16x2.f32. There an m16n8k16 product is two m16n8k8 (A's first two registers and
// B's first hold k 0..7 in the same lane layout, the others k 8..15), a copy is synchronous
// (ld.global, then st.shared: a ring slot holds its bytes as soon as the copy is issued, so commit
// and wait are empty), and a float16 pair is two cvt.rn.f16.f32. bfloat16 K (and so bfloat16
// queries) does not compile there (fp8kv_cuda.variants.mma_arch_serves).
//
// Macros: those of attention_common.cuh and the format's (codec.cuh).
#pragma once
#include "attention_common.cuh"
#include "ptx_math.cuh"

namespace fp8kv {
constexpr int FP8_EXP = 7 - MANT;
constexpr bool NATIVE = NATIVE_WIDEN;  // codec.cuh: cvt.rn.f16x2.{e4m3x2,e5m2x2} on sm89+ (OCP formats)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool SM80 = false;  // Turing: see the top of this file
#else
constexpr bool SM80 = true;   // cp.async, mma.sync m16n8k16 (float16 and bfloat16), cvt.rn.f16x2.f32
#endif

// The float16 pair (lo, hi), each rounded to nearest even.
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    if constexpr (SM80) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        u16 l, h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(lo));
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(hi));
        r = (u32)l | ((u32)h << 16);
    }
    return r;
}

// ------------------------------------------------------------------ FP8 -> 16-bit pairs

// The codes at bytes 1 and 3 of x (bytes 0 and 2 ignored) as a pair of a 16-bit float format with
// TEXP exponent bits (5: float16, 8: bfloat16), low half from byte 1: exact for every code but
// the specials (see has_special), both multiplied by 2^(bias16 - BIAS).
template <int TEXP>
__device__ __forceinline__ u32 widen_fast(u32 x) {
    constexpr int SH = TEXP - FP8_EXP;
    u32 r;
    if constexpr (SH == 0) {
        r = x & 0xFF00FF00u;
    } else {
        r = (x & 0x80008000u) | ((x & 0x7F007F00u) >> SH);
    }
    constexpr int E = (TEXP == 5 ? 15 : 127) - BIAS;  // the power of two to multiply by
    if constexpr (E != 0) {
        constexpr u32 F = TEXP == 5 ? (u32)(E + 15) << 10 : (u32)(E + 127) << 7;
        constexpr u32 F2 = F | (F << 16);
        if constexpr (TEXP == 5) {
            asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(r) : "r"(F2));
        } else {
            asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(r) : "r"(F2), "r"(0x80008000u));
        }
    }
    return r;
}

// The same pair through the software decoder (every code, NaN and inf included).
template <int TEXP>
__device__ __forceinline__ u32 widen_exact(u32 x) {
    const float lo = decode((x >> 8) & 0xFFu), hi = decode(x >> 24);
    if constexpr (TEXP == 5) return pack_f16(lo, hi);
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <int TEXP, bool EXACT>
__device__ __forceinline__ u32 widen(u32 x) {
    if constexpr (EXACT) return widen_exact<TEXP>(x);
    else return widen_fast<TEXP>(x);
}


// Nonzero when a byte of w is a code that widen_fast<TEXP> gets wrong.
template <int TEXP>
__device__ __forceinline__ u32 has_special(u32 w) {
    if constexpr (NATIVE && TEXP == 5) {  // the native conversion is exact
        return 0u;
    } else if constexpr (FNUZ) {  // 0x80 (NaN) would become -0
        if constexpr (MANT == 2 && TEXP == 5) {  // e5m2fnuz's top binade (exponent 31) is inf/NaN in float16
            return nonfinite_bytes(w) | (((w & 0x7C7C7C7Cu) + 0x04040404u) & 0x80808080u);
        }
        return nonfinite_bytes(w);
    } else if constexpr (HASINF && TEXP == 5) {  // e5m2 -> float16: the same bits, inf and NaN included
        return 0u;
    } else {  // e4m3: NaN would become +-480; e5m2 -> bfloat16: inf/NaN would become finite
        return nonfinite_bytes(w);
    }
}

// ------------------------------------------------------------------ tensor-core primitives

// d += a . b, m16n8k16, float32 accumulation; a/b in float16 (TEXP 5) or bfloat16 (TEXP 8, sm80+).
template <int TEXP>
__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    static_assert(TEXP == 5 || SM80, "mma_common.cuh: bfloat16 operands need sm80+");
    if constexpr (!SM80) {  // k 0..7, then k 8..15
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(b0));
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a2), "r"(a3), "r"(b1));
    } else if constexpr (TEXP == 5) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}


__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// The pair (byte 0, byte 1) of w as lo and (byte 2, byte 3) as hi, in the 16-bit type TEXP.
template <int TEXP, bool EXACT>
__device__ __forceinline__ void widen4(u32 w, u32& lo, u32& hi) {
    if constexpr (NATIVE && TEXP == 5) {
        widen_native(w, lo, hi);
    } else {
        lo = widen<TEXP, EXACT>(prmt(w, 0u, 0x1404u));
        hi = widen<TEXP, EXACT>(prmt(w, 0u, 0x3424u));
    }
}

// The query value i scaled by 2^-shift as the bits of K's 16-bit type KE (5: float16, 8: bfloat16);
// the caller picks shift so that this is exact (see the kernel).
template <int KE>
__device__ __forceinline__ u32 query_bits(const q_t* q, i64 i, bool live, i32 shift) {
    if (!live) return 0u;
    if ((KE == 5) == (QT == 1) && shift == 0) return q[i];
    const float x = load_q(q, i) * pow2i(-shift);
    return KE == 5 ? (u32)f32_to_f16_bits(x) : (u32)f32_to_bf16_bits(x);
}

__device__ __forceinline__ u32 word(const uint4& x, int i) { return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w; }

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Below sm80: BYTES (16, 8 or 4) from src into shared memory at dst now, or zeros without a read
// when !live.
template <int BYTES>
__device__ __forceinline__ void copy_now(u32 dst, const u8* src, bool live) {
    if constexpr (BYTES == 16) {
        const uint4 x = live ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
    } else if constexpr (BYTES == 8) {
        const uint2 x = live ? *reinterpret_cast<const uint2*>(src) : make_uint2(0u, 0u);
        asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(dst), "r"(x.x), "r"(x.y));
    } else {
        static_assert(BYTES == 4, "copy_now: 16, 8 or 4 bytes");
        const u32 x = live ? *reinterpret_cast<const u32*>(src) : 0u;
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst), "r"(x));
    }
}

// cp.async of BYTES (16, 8 or 4) from src, or zeros without a read when !live (below sm80: copy_now).
template <int BYTES>
__device__ __forceinline__ void copy_async(u32 dst, const u8* src, bool live) {
    if constexpr (!SM80) {
        copy_now<BYTES>(dst, src, live);
    } else if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(live ? 16 : 0));
    } else if constexpr (BYTES == 8) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(live ? 8 : 0));
    } else {
        static_assert(BYTES == 4, "copy_async: 16, 8 or 4 bytes");
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(live ? 4 : 0));
    }
}

// cp.async groups: close the copies issued since the last commit; wait until at most N groups are
// pending; wait for all (no-ops below sm80, where copies complete when issued).
__device__ __forceinline__ void copy_commit() {
    if constexpr (SM80) asm volatile("cp.async.commit_group;");
}
template <int N>
__device__ __forceinline__ void copy_wait() {
    if constexpr (SM80) asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
__device__ __forceinline__ void copy_wait_all() {
    if constexpr (SM80) asm volatile("cp.async.wait_all;");
}

__device__ constexpr u32 pair_selector(int d) {  // PRMT: byte d of a at byte 1, byte d of b at byte 3
    return ((u32)(4 + d) << 12) | ((u32)(4 + d) << 8) | ((u32)d << 4) | (u32)d;
}

// Power of two >= x > 0 (finite), at most 2^127.
__device__ __forceinline__ float pow2_ceil(float x) {
    const u32 b = f2u(x);
    const u32 e = (b >> 23) + ((b & 0x7FFFFFu) != 0u);  // x is normal here (a weight >= 2^-126 or 0)
    return e >= 254u ? u2f(254u << 23) : u2f(e << 23);
}

// K's 16-bit type for queries whose magnitudes (float32 bits) have maximum qmax and smallest nonzero
// qmin: float16 (k16) whenever the queries are exact float16 after a power of two: always for
// float16; for bfloat16 (8 significant bits) when, scaled by 2^(14 - qexp), the largest is below
// 2^15 and the smallest nonzero at least 2^-17 (range <= 2^31, no subnormal). Queries then enter
// as q * 2^-qshift; bfloat16 K keeps |q| < 2^101 (logits finite).
__device__ __forceinline__ void key_type(u32 qmax, u32 qmin, bool& k16, i32& qshift) {
    const i32 qexp = (i32)(qmax >> 23) - 127;
    k16 = QT == 1;
    qshift = 0;
    if constexpr (QT == 2) {
        const i32 qexp_min = (i32)(qmin >> 23) - 127;
        const bool finite = qmax < 0x7F800000u;
        if (finite && qmax == 0u) {
            k16 = true;
        } else if (finite && (qmin >> 23) != 0u && qexp - qexp_min <= 31 && qexp - 14 >= -126 && qexp - 14 <= 126) {
            k16 = true;
            qshift = qexp - 14;
        } else {
            qshift = (finite && qexp > 100) ? qexp - 100 : 0;
        }
    }
}

}  // namespace fp8kv
