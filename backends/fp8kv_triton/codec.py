"""FP8 encode/decode inside Triton kernels: the integer-bit codec and the native casts.

The integer encoder :func:`encode_f32_bits` is a line-by-line ``@triton.jit`` mirror of
:func:`fp8kv.codec.encode_f32_bits` (int32 shifts, masks, compares and ``tl.where`` only),
so it gives the reference's bytes on every GPU and in the CPU interpreter, whatever
Triton's own casts do there. The native paths (``x.to(tl.float8e4nv)``...) are used only
where :mod:`fp8kv_triton.capabilities` says a GPU test proved them bit-exact.

Every format-specific number reaches the kernels as a compile-time constant taken from
:func:`fp8kv.codec.codec_constants` (see :class:`CodecArgs`), so one kernel body serves
``fp8_e4m3``, ``fp8_e5m2``, ``fp8_e4m3fnuz`` and ``fp8_e5m2fnuz``.

Decoders (FP8 byte -> an exact float16/bfloat16/float32 value), selected by ``DEC_MODE``:

* ``DEC_NATIVE`` (0): bitcast to Triton's fp8 type and ``.to()`` (hardware ``cvt``).
* ``DEC_E5M2`` (1): an e5m2 byte is the top byte of the float16 with the same value
  (infinities and NaNs included): shift left by 8, bitcast.
* ``DEC_E4M3`` (2): e4m3fn/e4m3fnuz to float16 by bits: the 7 magnitude bits shifted into
  place give a float16 whose exponent is off by ``15 - bias`` (fp8 subnormals land exactly
  on float16 subnormals), so one exact power-of-two product fixes it; NaN bytes are
  patched. Three integer ops, one select and one multiply per element.
* ``DEC_GENERIC`` (3): the general integer decoder, a mirror of
  :func:`fp8kv.codec.decode_to_f32` (any format, exact, torch's NaN bit patterns).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from fp8kv.codec import codec_constants
from fp8kv.formats import Fp8Format

from .modes import (
    DEC_E4M3,
    DEC_E5M2,
    DEC_GENERIC,
    DEC_NATIVE,
    ENC_INTEGER,
    ENC_NATIVE,
    integer_decoder,
)
from .serial import launching

__all__ = [
    "DEC_E4M3", "DEC_E5M2", "DEC_GENERIC", "DEC_NATIVE", "ENC_INTEGER", "ENC_NATIVE", "CodecArgs",
    "codec_args", "decode", "decode_tensor", "default_decode_mode", "encode_f32_bits", "encode_native",
    "encode_tensor", "in_registers",
]


@dataclass(frozen=True)
class CodecArgs:
    """Compile-time constants a kernel needs for one format (pass as ``**args.kwargs()``).

    Attributes mirror :class:`fp8kv.codec.CodecConstants`; ``fp8_kind`` names the Triton
    fp8 type for the native paths (0: e4m3fn, 1: e5m2, 2: e4m3fnuz, 3: e5m2fnuz);
    ``fmt_max`` is the format's largest finite value (the dynamic-scale divisor).
    """

    mant_bits: int
    exp_rebias: int
    drop_bits: int
    max_f32_bits: int
    max_shift: int
    nan_byte: int
    fnuz: bool
    has_inf: bool
    max_mag: int
    fp8_kind: int
    fmt_max: float
    bias: int

    def kwargs(self, prefix: str = "F_") -> dict:
        return {
            f"{prefix}MANT": self.mant_bits, f"{prefix}REBIAS": self.exp_rebias,
            f"{prefix}DROP": self.drop_bits, f"{prefix}MAXBITS": self.max_f32_bits,
            f"{prefix}MAXSHIFT": self.max_shift, f"{prefix}NANBYTE": self.nan_byte,
            f"{prefix}FNUZ": self.fnuz, f"{prefix}HASINF": self.has_inf,
            f"{prefix}MAXMAG": self.max_mag, f"{prefix}KIND": self.fp8_kind,
            f"{prefix}MAX": self.fmt_max, f"{prefix}BIAS": self.bias,
        }


_KIND = {"fp8_e4m3": 0, "fp8_e5m2": 1, "fp8_e4m3fnuz": 2, "fp8_e5m2fnuz": 3}


def codec_args(fmt: Fp8Format) -> CodecArgs:
    """The compile-time constants of ``fmt`` (host side)."""
    c = codec_constants(fmt)
    return CodecArgs(
        mant_bits=c.mant_bits, exp_rebias=c.exp_rebias, drop_bits=c.drop_bits,
        max_f32_bits=c.max_f32_bits, max_shift=c.max_shift, nan_byte=c.nan_byte, fnuz=c.fnuz,
        has_inf=c.has_inf, max_mag=c.max_mag, fp8_kind=_KIND[fmt.name], fmt_max=fmt.max, bias=c.bias,
    )


def default_decode_mode(fmt: Fp8Format) -> int:
    """The cheapest exact integer decoder for ``fmt`` (used where native casts are not)."""
    return integer_decoder(fmt.name)


# ------------------------------------------------------------------------------------ encode


@triton.jit
def encode_f32_bits(x, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
                    F_MAXBITS: tl.constexpr, F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr,
                    F_FNUZ: tl.constexpr):
    """float32 values (already divided by the scale) -> FP8 bytes as int32 (0..255).

    Mirror of ``fp8kv.codec._encode_sign_mag``: saturate, round to nearest even with
    the carry into the exponent, NaN stays NaN, no -0 in fnuz formats.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # 1. NaN: any magnitude above +inf's pattern.
    is_nan = mag > 0x7F800000
    # 2. Saturate: positive floats order like their bit patterns (+inf clamps too).
    mag = tl.minimum(mag, F_MAXBITS)
    # 3. float32 fields; exp32 == 0 is zero or a float32 subnormal (no implicit 1).
    exp32 = mag >> 23
    frac = mag & 0x7FFFFF
    sig = tl.where(exp32 != 0, frac | 0x800000, frac)
    # 4. fp8 biased exponent if normal; e8 <= 0: fp8 subnormal, shift 1 - e8 bits more.
    e8 = tl.maximum(exp32, 1) + F_REBIAS
    extra = tl.maximum(1 - e8, 0)
    shift = tl.minimum(F_DROP + extra, F_MAXSHIFT)
    # 5. Truncate; guard = first dropped bit, sticky = OR of the rest.
    kept = sig >> shift
    guard = (sig >> (shift - 1)) & 1
    sticky = (sig & ((1 << (shift - 1)) - 1)) != 0
    # 6. Exponent above mantissa in one integer (kept holds the implicit bit when normal).
    q = tl.where(e8 >= 1, ((e8 - 1) << F_MANT) + kept, kept)
    # 7. Round to nearest even; the +1 carries into the exponent (127.8 -> 128 in e4m3).
    round_up = (guard == 1) & (sticky | ((q & 1) == 1))
    q = q + round_up.to(tl.int32)
    # 8. Sign; fnuz has no -0.
    if F_FNUZ:
        sign = tl.where(q == 0, 0, sign)
    q = q | (sign << 7)
    # 9. NaN: OCP keeps the sign (0x7F / 0xFF), fnuz has only 0x80.
    if F_FNUZ:
        nan_q = tl.zeros_like(q) + F_NANBYTE
    else:
        nan_q = (sign << 7) | F_NANBYTE
    return tl.where(is_nan, nan_q, q)


@triton.jit
def encode_native(x, F_KIND: tl.constexpr, F_MAX: tl.constexpr, F_NANBYTE: tl.constexpr):
    """float32 -> FP8 bytes (int32) through Triton's cast: clamp (NaN kept), cast, and
    torch's NaN bytes (0x7F / 0xFF) patched in. Only where a GPU test proved it exact."""
    q = _native_cast(tl.clamp(x, -F_MAX, F_MAX, propagate_nan=tl.PropagateNan.ALL), F_KIND)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(x != x, (sign << 7) | F_NANBYTE, q)


@triton.jit
def encode_native_finite(x, F_KIND: tl.constexpr, F_MAX: tl.constexpr):
    """:func:`encode_native` for values known to be free of NaN: clamp and cast."""
    return _native_cast(tl.clamp(x, -F_MAX, F_MAX), F_KIND)


@triton.jit
def _native_cast(y, F_KIND: tl.constexpr):
    """Triton's float32 -> OCP FP8 cast of clamped values, as bytes (int32)."""
    if F_KIND == 0:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        tl.static_assert(F_KIND == 1, "native encode: OCP formats only")
        q = y.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    return q


# ------------------------------------------------------------------------------------ decode


@triton.jit
def _decode_generic_f32(v, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
                        F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr):
    """int32 bytes -> float32 (mirror of ``fp8kv.codec.decode_to_f32``; same values, and
    the same bits except the fnuz NaN, which is quiet here)."""
    sign = (v >> 7) & 1
    mag = v & 0x7F
    e = mag >> F_MANT
    m = mag & ((1 << F_MANT) - 1)
    normal = ((e - F_REBIAS) << 23) | (m << F_DROP)
    # Subnormal: leading-1 position p of m (at most 3 bits wide: a 2-step search).
    p = tl.zeros_like(m)
    mm = m
    up = (mm >> 2) != 0
    mm = tl.where(up, mm >> 2, mm)
    p = tl.where(up, p + 2, p)
    up = (mm >> 1) != 0
    p = tl.where(up, p + 1, p)
    sub_exp = p + (1 - F_REBIAS - 127 - F_MANT + 127)
    sub_mant = (m << (23 - p)) & 0x7FFFFF
    subnormal = tl.where(m != 0, (sub_exp << 23) | sub_mant, 0)
    out = tl.where(e == 0, subnormal, normal)
    if F_FNUZ:
        # a quiet NaN (torch's 0x7F800001 is signalling; a float32 -> bfloat16 rounding
        # may turn that pattern into inf, a quiet one stays NaN)
        out = tl.where(v == 0x80, 0x7FC00000, out | (sign << 31))
    else:
        nan_bits = 0x7F800000 | 0x400000 | (m << F_DROP)
        if F_HASINF:
            spec = tl.where(mag == F_MAXMAG + 1, 0x7F800000, nan_bits)
        else:
            spec = nan_bits
        out = tl.where(mag > F_MAXMAG, spec, out) | (sign << 31)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def decode(codes, OUT: tl.constexpr, DEC_MODE: tl.constexpr, F_KIND: tl.constexpr,
           F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr, F_FNUZ: tl.constexpr,
           F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr):
    """uint8 FP8 bytes -> exact values in dtype ``OUT`` (float16, bfloat16 or float32).

    Every FP8 value of the four formats is exact in float16 and bfloat16.
    """
    if DEC_MODE == 0:
        if F_KIND == 0:
            x = codes.to(tl.float8e4nv, bitcast=True).to(OUT)
        else:
            tl.static_assert(F_KIND == 1, "native decode: OCP formats only")
            x = codes.to(tl.float8e5, bitcast=True).to(OUT)
    elif DEC_MODE == 1:
        h = (codes.to(tl.int32) << 8).to(tl.int16)
        x = h.to(tl.float16, bitcast=True).to(OUT)
    elif DEC_MODE == 2:
        v = codes.to(tl.int32)
        h = (((v & 0x7F) << 7) | ((v & 0x80) << 8)).to(tl.int16)
        # value = fp16 * 2^(15 - bias): exact (fp8 subnormals are fp16 subnormals here)
        f = h.to(tl.float16, bitcast=True).to(tl.float32) * (2.0 ** (15 - F_BIAS))
        if F_FNUZ:
            f = tl.where(v == 0x80, float("nan"), f)
        else:
            f = tl.where((v & 0x7F) == 0x7F, float("nan"), f)
        x = f.to(OUT)
    else:
        x = _decode_generic_f32(codes.to(tl.int32), F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF,
                                F_MAXMAG).to(OUT)
    return x


@triton.jit
def in_registers(x):
    """``x`` (16-bit floats) unchanged, through an opaque PTX move (NVIDIA only, not the interpreter).

    Triton moves the layout conversion of a ``tl.dot`` operand above the element-wise ops that
    produce it, so an FP8 tile that is decoded and then transposed for ``p @ v`` is transposed
    as bytes: read back from shared memory one byte at a time (``LDS.U8``). An op Triton cannot
    see through keeps the decode in registers, and the 16-bit tile is transposed by ``ldmatrix``.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


# ------------------------------------------------------------------ elementwise entry points


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ENC: tl.constexpr, F_MANT: tl.constexpr,
                   F_REBIAS: tl.constexpr, F_DROP: tl.constexpr, F_MAXBITS: tl.constexpr,
                   F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr, F_FNUZ: tl.constexpr,
                   F_KIND: tl.constexpr, F_MAX: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ENC == 1:
        q = encode_native(x, F_KIND, F_MAX, F_NANBYTE)
    else:
        q = encode_f32_bits(x, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ)
    tl.store(out_ptr + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(q_ptr, out_ptr, n, BLOCK: tl.constexpr, OUT: tl.constexpr, DEC_MODE: tl.constexpr,
                   F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
                   F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr,
                   F_BIAS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    x = decode(q, OUT, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    tl.store(out_ptr + offs, x, mask=mask)


def _tl_dtype(dtype):
    import torch

    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def encode_tensor(x, fmt: Fp8Format, encoder: int = ENC_INTEGER):
    """FP8 bytes of ``x`` (already divided by the scale) through a kernel's encoder.

    Args:
        x: contiguous float32/float16/bfloat16 tensor (widened to float32 in the kernel).
        fmt: the target format.
        encoder: :data:`ENC_INTEGER` or :data:`ENC_NATIVE`.
    Returns:
        uint8 tensor of ``x``'s shape: equal to ``fp8kv.codec.encode_f32_bits(x.float(), fmt)``
        wherever the encoder is exact (that is what the tests check).
    """
    import torch

    a = codec_args(fmt)
    flat = x.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    n = flat.numel()
    block = 1024
    if n:
        with launching(_encode_kernel):
            _encode_kernel[(triton.cdiv(n, block),)](
                flat, out, n, BLOCK=block, ENC=encoder, F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias,
                F_DROP=a.drop_bits, F_MAXBITS=a.max_f32_bits, F_MAXSHIFT=a.max_shift, F_NANBYTE=a.nan_byte,
                F_FNUZ=a.fnuz, F_KIND=a.fp8_kind, F_MAX=a.fmt_max)
    return out.reshape(x.shape)


def decode_tensor(codes, fmt: Fp8Format, out_dtype, mode: int):
    """Values of FP8 bytes ``codes`` (uint8) in ``out_dtype`` through a kernel's decoder ``mode``."""
    import torch

    a = codec_args(fmt)
    flat = codes.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=out_dtype, device=codes.device)
    n = flat.numel()
    block = 1024
    if n:
        with launching(_decode_kernel):
            _decode_kernel[(triton.cdiv(n, block),)](
                flat, out, n, BLOCK=block, OUT=_tl_dtype(out_dtype), DEC_MODE=mode, F_KIND=a.fp8_kind,
                F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias, F_DROP=a.drop_bits, F_FNUZ=a.fnuz,
                F_HASINF=a.has_inf, F_MAXMAG=a.max_mag, F_BIAS=a.bias)
    return out.reshape(codes.shape)
