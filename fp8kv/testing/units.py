"""Rounding units the tolerances of :mod:`fp8kv.testing.tolerance` and
:mod:`fp8kv.testing.fp8_tolerance` are built from."""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24
"""Unit roundoff of float32 (round to nearest)."""

_ULP = {
    # dtype: (mantissa bits, log2 of the smallest subnormal)
    torch.float32: (23, -149),
    torch.float16: (10, -24),
    torch.bfloat16: (7, -133),
}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of ``dtype`` at magnitude ``|x|``, as float64 (same shape as ``x``).

    ``2^(floor(log2|x|) - mantissa_bits)``, floored at the dtype's smallest subnormal
    (so 0 and subnormal magnitudes get that); ``inf`` for infinite ``x``, NaN for NaN.
    """
    if dtype not in _ULP:
        raise ValueError(f"out_dtype: got {dtype}, expected one of {list(_ULP)}")
    mant, emin = _ULP[dtype]
    a = x.detach().to(torch.float64).abs()
    _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1): floor(log2 a) = e - 1
    exp = torch.where(a > 0, e.to(torch.int64) - 1 - mant, torch.full_like(e, emin, dtype=torch.int64))
    out = torch.ldexp(torch.ones_like(a), exp.clamp_min(emin))
    out = torch.where(torch.isinf(a), torch.full_like(a, math.inf), out)
    return torch.where(torch.isnan(a), a, out)


def worst_violation(ok: torch.Tensor, diff: torch.Tensor, tol: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """The largest ``diff / tol`` among the elements that are not ``ok`` and its index (``ok``'s shape)."""
    ratio = torch.where(ok, torch.zeros_like(diff), torch.nan_to_num(diff / tol, nan=math.inf, posinf=math.inf))
    worst = int(torch.argmax(ratio.flatten()))
    return float(ratio.flatten()[worst]), tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ok.shape))


__all__ = ["U32", "ulp", "worst_violation"]
