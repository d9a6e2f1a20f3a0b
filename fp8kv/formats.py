"""FP8 storage formats and the one definition of quantization.

Quantize:   ``q = fp8(clamp(x / scale, -max, +max))``, round to nearest even,
            saturating (a finite input never becomes inf or NaN), NaN stays NaN,
            and -0 becomes +0 in the fnuz formats (which have no -0: 0x80 is NaN).
Dequantize: ``x' = float(q) * scale``; the scale is the dequant multiplier.

All arithmetic is float32: ``x`` is converted to float32 (exact for fp16/bf16),
divided by the float32 scale (IEEE division, correctly rounded), clamped, cast.
Kernels in every backend reproduce exactly these steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import Fp8KVError, bad_argument


@dataclass(frozen=True)
class Fp8Format:
    """One 8-bit floating-point storage format.

    Attributes:
        name: canonical fp8kv name, e.g. ``"fp8_e4m3"``.
        torch_dtype: the torch float8 dtype that holds it.
        exponent_bits / mantissa_bits: field widths (sign bit aside).
        bias: exponent bias.
        max: largest finite value.
        fnuz: True for the "finite, no negative zero" formats (AMD gfx942):
            0x80 is the only NaN, there is no -0 and no inf.
        nan_encodings: every byte that decodes to NaN.
        inf_encodings: bytes that decode to +-inf (only e5m2 has them).
    """

    name: str
    torch_dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    fnuz: bool
    nan_encodings: tuple[int, ...]
    inf_encodings: tuple[int, ...]

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)


FP8_E4M3 = Fp8Format("fp8_e4m3", torch.float8_e4m3fn, 4, 3, 7, 448.0, False, (0x7F, 0xFF), ())
FP8_E5M2 = Fp8Format(
    "fp8_e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0, False,
    (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF), (0x7C, 0xFC),
)
FP8_E4M3FNUZ = Fp8Format("fp8_e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8, 240.0, True, (0x80,), ())
FP8_E5M2FNUZ = Fp8Format("fp8_e5m2fnuz", torch.float8_e5m2fnuz, 5, 2, 16, 57344.0, True, (0x80,), ())

FORMATS: dict[str, Fp8Format] = {f.name: f for f in (FP8_E4M3, FP8_E5M2, FP8_E4M3FNUZ, FP8_E5M2FNUZ)}
"""Every concrete format by canonical name."""

ALIASES = ("fp8", "auto")
"""``fp8``: the platform's e4m3 (fnuz on gfx942, fn elsewhere). ``auto``: no FP8."""

FNUZ_PLATFORMS = frozenset({"gfx942"})
"""gfx arches whose e4m3 is the fnuz variant."""


def platform_e4m3(arch: str | None) -> Fp8Format:
    """The format the alias ``fp8`` means on ``arch`` (``"gfx942"``, ``"sm90"``, None = CPU)."""
    return FP8_E4M3FNUZ if arch in FNUZ_PLATFORMS else FP8_E4M3


def get_format(kv_dtype: str | Fp8Format | torch.dtype, *, arch: str | None = None) -> Fp8Format:
    """Resolve a format name (or alias, or torch float8 dtype) to its :class:`Fp8Format`.

    ``"fp8"`` resolves through :func:`platform_e4m3` for ``arch``. ``"auto"`` is not a
    storage format and is refused here (it means "no FP8" to the planner).
    """
    if isinstance(kv_dtype, Fp8Format):
        return kv_dtype
    if isinstance(kv_dtype, torch.dtype):
        for fmt in FORMATS.values():
            if fmt.torch_dtype == kv_dtype:
                return fmt
        raise bad_argument("kv_dtype", kv_dtype, f"a torch float8 dtype of {sorted(FORMATS)}")
    if kv_dtype == "fp8":
        return platform_e4m3(arch)
    try:
        return FORMATS[kv_dtype]
    except (KeyError, TypeError):
        raise bad_argument(
            "kv_dtype", repr(kv_dtype), f"one of {sorted(FORMATS)} or 'fp8'"
        ) from None


def check_scale(scale: torch.Tensor | float, name: str = "scale") -> torch.Tensor:
    """Return ``scale`` as a float32 tensor after checking every element is finite and > 0.

    Accepts a Python number or a real float tensor (any float dtype, converted to float32:
    a value that overflows float32 is refused as non-finite). Anything else raises
    :class:`fp8kv.InvalidArgument` naming ``name``.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise bad_argument(name, f"{type(scale).__name__} {scale!r}"[:80], "a number or a float tensor")
    t = torch.tensor(float(scale), dtype=torch.float32) if not isinstance(scale, torch.Tensor) else scale
    if not t.is_floating_point():
        raise bad_argument(name, t.dtype, "a floating-point scale")
    if t.device.type == "meta":
        raise bad_argument(name, "a tensor on the meta device", "a tensor with values (cpu or cuda)")
    if t.numel() == 0:
        raise bad_argument(name, f"an empty tensor of shape {tuple(t.shape)}", "at least one scale")
    t = t.detach().to(torch.float32)
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise bad_argument(name, t.flatten()[bad.flatten()][:4].tolist(), "finite scales > 0 (in float32)")
    return t


def _as_float_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise bad_argument(name, type(x).__name__, "a torch.Tensor (convert lists with torch.tensor)")
    if not x.is_floating_point():
        raise bad_argument(name, f"dtype {x.dtype}", "a floating-point tensor")
    if x.device.type == "meta":
        raise bad_argument(name, "a tensor on the meta device", "a tensor with values (cpu or cuda)")
    return x


def _broadcast(x: torch.Tensor, s: torch.Tensor, name: str = "scale") -> None:
    try:
        torch.broadcast_shapes(x.shape, s.shape)
    except RuntimeError:
        raise bad_argument(name, f"shape {tuple(s.shape)}", f"a shape that broadcasts against {tuple(x.shape)}") \
            from None


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """Widen ``x`` to float32 exactly, NaN signs included.

    torch's fp16 -> fp32 conversion drops the sign of NaN in its scalar CPU loop (short
    tensors and vector tails) and always on CUDA, so the sign is restored from the bits:
    ``-NaN`` quantizes to the negative NaN byte (0xFF) in the OCP formats, as in float32.
    """
    x32 = x.to(torch.float32)
    if x.dtype == torch.float16:
        nan = torch.tensor(float("nan"), device=x.device)
        x32 = torch.where(torch.isnan(x32), torch.where(torch.signbit(x), -nan, nan), x32)
    return x32


def divide_by_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``to_float32(x) / scale`` (IEEE division), NaN elements kept as they are, sign included.

    A division on x86 keeps a NaN operand's sign, one on CUDA returns the canonical positive
    NaN; keeping ``x``'s NaN makes ``-NaN`` quantize to the negative NaN byte everywhere
    (torch's float32 -> bfloat16 conversion itself produces ``-NaN``, 0xFFFF).
    """
    x32 = to_float32(x)
    return torch.where(torch.isnan(x32), x32, x32 / scale)


def quantize_scaled(x32: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Cast already-divided float32 values to ``fmt``: clamp (NaN passes), then RNE cast."""
    return x32.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)


def _round_to_odd_float32(x64: torch.Tensor) -> torch.Tensor:
    """float64 to float32 rounding to odd: truncate, then set the last bit if anything was lost.

    Rounding that result to nearest even at FP8's few bits equals rounding ``x64`` directly
    (round-to-odd at >= p + 2 bits makes a second rounding to p bits innocuous), so a
    float64 input is rounded once, not twice. ``|x64|`` must fit float32 (callers clamp).
    """
    t = x64.to(torch.float32)
    bits = t.view(torch.int32)
    exact = t.to(torch.float64) == x64
    above = t.to(torch.float64).abs() > x64.abs()
    odd = torch.where(above, torch.where(bits & 1 == 1, bits, bits - 1), bits | 1)
    return torch.where(exact | torch.isnan(x64), bits, odd).view(torch.float32)


def quantize(
    x: torch.Tensor, kv_dtype: str | Fp8Format | torch.dtype, scale: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Quantize ``x`` to FP8: ``fp8(clamp(x / scale, -max, +max))``, rounded once.

    Args:
        x: a float tensor (fp32, fp16, bf16: divided in float32; float64: divided in
            float64 and rounded once to FP8, never through an intermediate float32 rounding).
        kv_dtype: format name, alias ``"fp8"`` or torch float8 dtype.
        scale: float32 dequant multiplier, broadcastable against ``x``; finite and > 0.
    Returns:
        a tensor of ``fmt.torch_dtype`` with the broadcast shape of ``x`` and ``scale``.
    """
    fmt = get_format(kv_dtype)
    _as_float_tensor("x", x)
    s = check_scale(scale).to(x.device)
    _broadcast(x, s)
    if x.dtype == torch.float64:
        y = torch.where(torch.isnan(x), x, x / s.to(torch.float64)).clamp(-fmt.max, fmt.max)
        return _round_to_odd_float32(y).to(fmt.torch_dtype)
    return quantize_scaled(divide_by_scale(x, s), fmt)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize: ``float32(q) * scale``, then cast to ``dtype`` (a float dtype)."""
    if not isinstance(q, torch.Tensor):
        raise bad_argument("q", type(q).__name__, "a float8 torch.Tensor")
    if q.dtype not in {f.torch_dtype for f in FORMATS.values()}:
        fp8 = [str(f.torch_dtype) for f in FORMATS.values()]
        raise bad_argument("q", f"dtype {q.dtype}", f"one of the FP8 dtypes {fp8}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise bad_argument("dtype", repr(dtype), "a floating-point torch.dtype")
    s = check_scale(scale).to(q.device)
    _broadcast(q, s)
    return (q.to(torch.float32) * s).to(dtype)


def ensure_fp8(kv_dtype: str) -> Fp8Format:
    """Like :func:`get_format` but with the message a cache user expects for ``auto``."""
    if kv_dtype == "auto":
        raise Fp8KVError("kv_dtype: got 'auto' (no FP8), expected an FP8 format to store the cache in")
    return get_format(kv_dtype)
