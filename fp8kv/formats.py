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
    """Return ``scale`` as a float32 tensor after checking every element is finite and > 0."""
    t = torch.as_tensor(scale, dtype=torch.float32) if not isinstance(scale, torch.Tensor) else scale
    if not t.is_floating_point():
        raise bad_argument(name, t.dtype, "a floating-point scale")
    t = t.to(torch.float32)
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise bad_argument(name, t.flatten()[bad.flatten()][:4].tolist(), "finite scales > 0")
    return t


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


def quantize(
    x: torch.Tensor, kv_dtype: str | Fp8Format | torch.dtype, scale: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Quantize ``x`` to FP8: ``fp8(clamp(float32(x) / scale, -max, +max))``.

    Args:
        x: any float tensor (fp32, fp16, bf16).
        kv_dtype: format name, alias ``"fp8"`` or torch float8 dtype.
        scale: float32 dequant multiplier, broadcastable against ``x``; finite and > 0.
    Returns:
        a tensor of ``fmt.torch_dtype`` with the broadcast shape of ``x`` and ``scale``.
    """
    fmt = get_format(kv_dtype)
    if not x.is_floating_point():
        raise bad_argument("x", x.dtype, "a floating-point tensor")
    s = check_scale(scale).to(x.device)
    return quantize_scaled(divide_by_scale(x, s), fmt)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize: ``float32(q) * scale``, then cast to ``dtype``."""
    get_format(q.dtype)
    s = check_scale(scale).to(q.device)
    return (q.to(torch.float32) * s).to(dtype)


def ensure_fp8(kv_dtype: str) -> Fp8Format:
    """Like :func:`get_format` but with the message a cache user expects for ``auto``."""
    if kv_dtype == "auto":
        raise Fp8KVError("kv_dtype: got 'auto' (no FP8), expected an FP8 format to store the cache in")
    return get_format(kv_dtype)
