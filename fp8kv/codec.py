"""Software FP8 codec: encode/decode with integer and bit operations only.

This module is the blueprint that GPU kernels (Triton, raw CUDA) mirror line by line
on hardware without a native FP8 cast. Everything here is int32 arithmetic, shifts,
masks, comparisons and ``torch.where`` on whole tensors: branch-free and vectorised,
so each line maps onto one vector instruction (or a ``tl.where``) in a kernel.
Floats are only *reinterpreted* (``.view(torch.int32)``), never converted, except in
:func:`encode`, which does the one float32 division by the scale that
:func:`fp8kv.formats.quantize` does.

Semantics are exactly those of :func:`fp8kv.formats.quantize_scaled` (and of torch's
own casts, which the tests check bit for bit on every fp16/bf16 pattern):

* clamp to ``[-max, +max]`` first, so ``±inf`` and every finite overflow saturate;
* round to nearest, ties to even, including in the subnormal range and with the
  rounding carry propagating into the exponent (``127.8 -> 128`` in e4m3);
* NaN: OCP formats (e4m3fn, e5m2) keep the sign, ``+NaN -> 0x7F``, ``-NaN -> 0xFF``;
  fnuz formats have a single NaN, ``0x80``;
* zero: ``-0.0 -> 0x80`` in OCP formats; fnuz formats have no ``-0``, so every value
  that rounds to zero becomes ``0x00``.

One code path serves all four formats: every format-specific number is derived from
the :class:`~fp8kv.formats.Fp8Format` fields by :func:`codec_constants`, which a kernel
launcher can pass through as compile-time constants.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cache

import torch

from .formats import Fp8Format, check_scale, divide_by_scale, get_format

__all__ = [
    "CodecConstants",
    "codec_constants",
    "decode_to_f32",
    "encode",
    "encode_f32_bits",
    "encode_half_bits",
]

# float32 layout: 1 sign bit, 8 exponent bits (bias 127), 23 mantissa bits.
F32_MANT_BITS = 23
F32_BIAS = 127
F32_ABS_MASK = 0x7FFFFFFF
F32_INF_BITS = 0x7F800000  # +inf; any magnitude above it is a NaN
F32_MANT_MASK = (1 << F32_MANT_BITS) - 1
F32_IMPLICIT_BIT = 1 << F32_MANT_BITS
F32_QUIET_BIT = 1 << (F32_MANT_BITS - 1)

# float16 layout: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits.
F16_MANT_BITS = 10
F16_EXP_MASK = 0x1F
F16_BIAS = 15


@dataclass(frozen=True)
class CodecConstants:
    """Every format-specific integer the codec uses, derived from an :class:`Fp8Format`.

    Attributes:
        exp_bits / mant_bits / bias: the format's field widths and exponent bias.
        mant_mask: ``(1 << mant_bits) - 1``.
        drop_bits: float32 mantissa bits dropped for a *normal* fp8 result, ``23 - mant_bits``.
        exp_rebias: add to a float32 biased exponent to get the fp8 biased exponent,
            ``bias - 127``.
        max_f32_bits: float32 bit pattern of ``+max`` (the clamp bound, compared as int).
        max_mag: the fp8 byte of ``+max`` (7 magnitude bits).
        max_shift: cap on the rounding shift. The float32 significand has 24 bits, so
            any shift of 25 or more leaves nothing but sticky bits; capping keeps every
            shift amount below 32 (shifts by >= the width are undefined in C/CUDA).
        nan_byte: what NaN encodes to (OCP: ``0x7F``, OR-ed with the sign; fnuz: ``0x80``).
        fnuz: no ``-0``, no inf, ``0x80`` is the only NaN.
        has_inf: the format has ``±inf`` (e5m2: the magnitude right above ``max_mag``).
        nan_f32_bits_fnuz: float32 bits decode produces for the fnuz NaN (torch's choice).
    """

    exp_bits: int
    mant_bits: int
    bias: int
    mant_mask: int
    drop_bits: int
    exp_rebias: int
    max_f32_bits: int
    max_mag: int
    max_shift: int
    nan_byte: int
    fnuz: bool
    has_inf: bool
    nan_f32_bits_fnuz: int = 0x7F800001


@cache
def codec_constants(fmt: Fp8Format) -> CodecConstants:
    """Derive the codec's integer constants from ``fmt``'s fields (host-side, once per format)."""
    m_bits, bias = fmt.mantissa_bits, fmt.bias
    # max = (1 + frac) * 2**e with frac = k / 2**m_bits: split it into fp8 fields.
    frac, exp = math.frexp(fmt.max)  # max = frac * 2**exp, frac in [0.5, 1)
    unbiased = exp - 1
    max_mant = int((frac * 2 - 1) * (1 << m_bits))
    assert (1 + max_mant / (1 << m_bits)) * 2.0**unbiased == fmt.max, fmt
    max_mag = ((unbiased + bias) << m_bits) | max_mant
    assert max_mag <= 0x7F, fmt
    (max_f32_bits,) = struct.unpack("<I", struct.pack("<f", fmt.max))
    return CodecConstants(
        exp_bits=fmt.exponent_bits,
        mant_bits=m_bits,
        bias=bias,
        mant_mask=(1 << m_bits) - 1,
        drop_bits=F32_MANT_BITS - m_bits,
        exp_rebias=bias - F32_BIAS,
        max_f32_bits=max_f32_bits,
        max_mag=max_mag,
        max_shift=F32_MANT_BITS + 2,
        nan_byte=0x80 if fmt.fnuz else 0x7F,
        fnuz=fmt.fnuz,
        has_inf=bool(fmt.inf_encodings),
    )


def _floor_log2(v: torch.Tensor, width: int) -> torch.Tensor:
    """Index of the highest set bit of each ``v`` (int32, ``0 < v < 2**width``), branch-free.

    A binary search by halving shifts (16, 8, 4, 2, 1, as many as ``width`` needs): each
    step asks "is anything set above bit ``s``?" and, if so, shifts it down and adds
    ``s``. On a GPU this is one ``clz`` (CUDA ``__clz``); here it is spelled out. ``v == 0``
    gives 0 (callers mask that case out).
    """
    p = torch.zeros_like(v)
    s = 1
    while (s << 1) < width:
        s <<= 1
    while s >= 1:
        upper = (v >> s) != 0  # any bit at position >= s?
        v = torch.where(upper, v >> s, v)
        p = torch.where(upper, p + s, p)
        s >>= 1
    return p


def _encode_sign_mag(sign: torch.Tensor, mag: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The encoder proper, on a float32 split into ``sign`` (0/1) and 31-bit magnitude bits.

    Args:
        sign: int32, 0 or 1.
        mag: int32 float32 magnitude bits, ``0 <= mag <= 0x7FFFFFFF`` (> 0x7F800000 is NaN).
    Returns:
        int32 fp8 bytes (0..255), same shape.
    """
    c = codec_constants(fmt)

    # 1. NaN: any float32 magnitude above +inf's bit pattern.
    is_nan = mag > F32_INF_BITS

    # 2. Saturate: positive floats order like their bit patterns, so the clamp
    #    |x| <= max is one integer min. +inf (0x7F800000) clamps to max as well.
    mag = torch.clamp(mag, max=c.max_f32_bits)

    # 3. Split float32 fields. exp32 == 0 is zero or a float32 subnormal (no implicit 1).
    exp32 = mag >> F32_MANT_BITS
    sig = torch.where(exp32 != 0, (mag & F32_MANT_MASK) | F32_IMPLICIT_BIT, mag & F32_MANT_MASK)

    # 4. fp8 biased exponent if the value were normal in fp8. e8 <= 0 means the result is
    #    an fp8 subnormal (or zero): its significand must be shifted right by 1 - e8
    #    more bits so it lines up with the fixed subnormal exponent 2**(1 - bias).
    #    (A float32 subnormal uses exponent 1 - 127, like exp32 == 1.)
    e8 = torch.clamp(exp32, min=1) + c.exp_rebias
    extra = torch.clamp(1 - e8, min=0)
    shift = torch.clamp(c.drop_bits + extra, max=c.max_shift)

    # 5. Truncate, and keep what is dropped as guard (first dropped bit) and sticky
    #    (OR of the rest). shift >= drop_bits >= 20, so shift - 1 >= 0.
    kept = sig >> shift
    guard = (sig >> (shift - 1)) & 1
    sticky = (sig & ((1 << (shift - 1)) - 1)) != 0

    # 6. Assemble exponent and mantissa as one integer, exponent above mantissa.
    #    For a normal result kept = 1.mmm (implicit bit at position mant_bits), so
    #    adding (e8 - 1) << mant_bits yields (e8 << mant_bits) | mmm. For a subnormal
    #    result the exponent field is 0 and kept = 0.mmm already.
    q = torch.where(e8 >= 1, ((e8 - 1) << c.mant_bits) + kept, kept)

    # 7. Round to nearest, ties to even: up if above half (guard & sticky) or exactly half
    #    (guard & !sticky) with an odd last kept bit. The +1 is an integer add on the packed
    #    exponent|mantissa, so a mantissa overflow carries into the exponent (1.111b * 2^6
    #    + ulp -> 1.000b * 2^7: 127.8 -> 128 in e4m3), and the largest subnormal rounds up
    #    into the smallest normal. The clamp in step 2 keeps the result <= max_mag.
    round_up = (guard == 1) & (sticky | ((q & 1) == 1))
    q = q + round_up.to(torch.int32)

    # 8. Sign. fnuz formats have no -0: a value that rounded to zero stays +0.
    if c.fnuz:
        sign = torch.where(q == 0, 0, sign)
    q = q | (sign << 7)

    # 9. NaN last: OCP keeps the sign (0x7F / 0xFF, like torch); fnuz has only 0x80.
    nan_q = c.nan_byte if c.fnuz else c.nan_byte | (sign << 7)
    return torch.where(is_nan, nan_q, q)


def encode_f32_bits(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Encode float32 values already divided by the scale to FP8 bytes, by integer ops.

    Bit-identical to ``fp8kv.formats.quantize_scaled(x, fmt).view(torch.uint8)``.

    Args:
        x: float32 tensor, any shape (only its bits are read: ``x.view(torch.int32)``).
        fmt: the target format.
    Returns:
        uint8 tensor of the same shape holding the FP8 bytes.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x: got {x.dtype}, expected torch.float32")
    bits = x.view(torch.int32)
    sign = (bits >> 31) & 1  # arithmetic shift then mask: 0 or 1
    mag = bits & F32_ABS_MASK
    return _encode_sign_mag(sign, mag, fmt).to(torch.uint8)


def _f16_mag_to_f32_mag(h: torch.Tensor) -> torch.Tensor:
    """Widen float16 magnitude bits (int32, 15 bits) to float32 magnitude bits, exactly.

    Normal: rebias the exponent (15 -> 127) and shift the mantissa up 13 bits.
    Inf/NaN (exponent 31): exponent 255, payload shifted up (a NaN stays a NaN).
    Subnormal (exponent 0): value = m * 2**-24; normalise by the position p of m's
    leading 1: exponent 2**(p - 24), mantissa = the bits below the leading 1.
    Zero stays zero.
    """
    e = (h >> F16_MANT_BITS) & F16_EXP_MASK
    m = h & ((1 << F16_MANT_BITS) - 1)
    up = F32_MANT_BITS - F16_MANT_BITS  # 13

    normal = ((e + (F32_BIAS - F16_BIAS)) << F32_MANT_BITS) | (m << up)
    inf_nan = F32_INF_BITS | (m << up)
    p = _floor_log2(m, F16_MANT_BITS)
    sub_exp = p + (F32_BIAS - F16_BIAS + 1 - F16_MANT_BITS)  # biased exponent of 2**(p - 24)
    sub_mant = (m << (F32_MANT_BITS - p)) & F32_MANT_MASK  # drop the leading 1
    subnormal = torch.where(m != 0, (sub_exp << F32_MANT_BITS) | sub_mant, 0)

    out = torch.where(e == F16_EXP_MASK, inf_nan, normal)
    return torch.where(e == 0, subnormal, out)


def encode_half_bits(bits: torch.Tensor, src_dtype: torch.dtype, fmt: Fp8Format) -> torch.Tensor:
    """Encode 16-bit float patterns (fp16 or bf16) to FP8 bytes, by integer ops.

    The pattern is widened to float32 bits exactly (fp16 subnormals included), then
    encoded like :func:`encode_f32_bits`. Equal to
    ``quantize_scaled(bits.view(src_dtype).float(), fmt).view(torch.uint8)``, with one
    caveat on torch's side: torch's scalar CPU loop widens every fp16 NaN to +NaN
    (0x7FFFFFFF), so for short tensors / tail elements torch gives 0x7F for an fp16 -NaN in
    the OCP formats where this function (like torch's vector loop) gives 0xFF.

    Args:
        bits: int16 (or uint16) tensor of raw fp16/bf16 bit patterns, any shape.
        src_dtype: ``torch.float16`` or ``torch.bfloat16``: how to read ``bits``.
        fmt: the target format.
    Returns:
        uint8 tensor of the same shape.
    """
    if bits.dtype not in (torch.int16, torch.uint16):
        raise TypeError(f"bits: got {bits.dtype}, expected torch.int16 raw bit patterns")
    h = bits.to(torch.int32) & 0xFFFF  # zero-extend
    sign = h >> 15
    h = h & 0x7FFF
    if src_dtype == torch.bfloat16:
        mag = h << 16  # bf16 is the top half of a float32
    elif src_dtype == torch.float16:
        mag = _f16_mag_to_f32_mag(h)
    else:
        raise TypeError(f"src_dtype: got {src_dtype}, expected torch.float16 or torch.bfloat16")
    return _encode_sign_mag(sign, mag, fmt).to(torch.uint8)


def decode_to_f32(q: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Decode FP8 bytes to float32 by building float32 bit patterns with integer ops.

    Equal to ``q.view(fmt.torch_dtype).float()`` for all 256 bytes, NaN bit patterns
    included (torch's: OCP NaNs are quiet with the fp8 payload, fnuz NaN is 0x7F800001).

    Args:
        q: uint8 tensor of FP8 bytes, any shape.
        fmt: the format the bytes are in.
    Returns:
        float32 tensor of the same shape.
    """
    if q.dtype != torch.uint8:
        raise TypeError(f"q: got {q.dtype}, expected torch.uint8 FP8 bytes (use .view(torch.uint8))")
    c = codec_constants(fmt)
    v = q.to(torch.int32)  # integer widening, 0..255
    sign = (v >> 7) & 1
    mag = v & 0x7F
    e = mag >> c.mant_bits
    m = mag & c.mant_mask

    # Normal: rebias the exponent, left-align the mantissa.
    normal = ((e - c.exp_rebias) << F32_MANT_BITS) | (m << c.drop_bits)

    # Subnormal: value = m * 2**(1 - bias - mant_bits). With p the leading-1 position of
    # m, that is 2**(p + 1 - bias - mant_bits) * 1.(bits of m below p).
    p = _floor_log2(m, c.mant_bits)
    sub_exp = p + (1 - c.bias - c.mant_bits + F32_BIAS)
    sub_mant = (m << (F32_MANT_BITS - p)) & F32_MANT_MASK
    subnormal = torch.where(m != 0, (sub_exp << F32_MANT_BITS) | sub_mant, 0)  # m == 0: zero

    out = torch.where(e == 0, subnormal, normal)

    # Specials. OCP: magnitudes above max_mag are inf (e5m2: max_mag + 1) or NaN; NaN is
    # made quiet keeping the fp8 payload, as an fp16 -> fp32 conversion does.
    # sign << 31 sets bit 31 of an int32 (two's-complement wrap in torch; a kernel may
    # use uint32 instead); .view(float32) then reads the pattern as-is.
    if c.fnuz:
        out = torch.where(v == 0x80, c.nan_f32_bits_fnuz, out | (sign << 31))
    else:
        special = mag > c.max_mag
        nan_bits = F32_INF_BITS | F32_QUIET_BIT | (m << c.drop_bits)
        spec = torch.where(mag == c.max_mag + 1, F32_INF_BITS, nan_bits) if c.has_inf else nan_bits
        out = torch.where(special, spec, out) | (sign << 31)
    return out.view(torch.float32)


def encode(
    x: torch.Tensor, fmt: str | Fp8Format | torch.dtype, scale: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Quantize like :func:`fp8kv.quantize`, returning bytes: ``encode_f32_bits(float32(x) / scale)``.

    Args:
        x: float tensor (fp32, fp16, bf16), any shape.
        fmt: format, name, alias ``"fp8"`` or torch float8 dtype.
        scale: float32 dequant multiplier broadcastable against ``x``; finite and > 0.
    Returns:
        uint8 tensor with the broadcast shape of ``x`` and ``scale``.
    """
    f = get_format(fmt)
    s = check_scale(scale).to(x.device)
    return encode_f32_bits(divide_by_scale(x, s), f)
