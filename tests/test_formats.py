"""Tests for the one definition of quantization: ``fp8kv.formats``.

quantize / dequantize round trips within half an ulp of the format, saturation,
NaN, fnuz's missing -0, format resolution (names, aliases, torch dtypes) and the
errors bad arguments raise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fp8kv
from fp8kv import Fp8KVError
from fp8kv.formats import (
    FORMATS,
    FP8_E4M3,
    FP8_E4M3FNUZ,
    Fp8Format,
    dequantize,
    get_format,
    platform_e4m3,
    quantize,
)

ALL_FORMATS = list(FORMATS.values())
FMT_IDS = [f.name for f in ALL_FORMATS]
fmt_param = pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)

F32_MAX = float(np.finfo(np.float32).max)
F32_EPS_HALF = 2.0**-24  # unit roundoff of float32
F32_TINY = 2.0**-149  # smallest float32 subnormal: absolute rounding slack below 2**-126


def half_ulp(y: float, fmt: Fp8Format) -> float:
    """Half the spacing of ``fmt`` at magnitude ``|y|`` (``|y| <= max``), from the exponent."""
    a = abs(y)
    if a < fmt.min_normal:
        return fmt.min_subnormal / 2
    exponent = math.frexp(a)[1] - 1  # floor(log2 a), exact
    return 2.0 ** (exponent - fmt.mantissa_bits) / 2


# ----------------------------------------------------------------------------- round trip


@given(
    fmt=st.sampled_from(ALL_FORMATS),
    u=st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=1, max_size=32),
    log_mag=st.integers(-24, 0),
)
@example(fmt=FP8_E4M3, u=[127.8 / 448, -127.8 / 448], log_mag=0)
def test_round_trip_within_half_ulp_unscaled(fmt: Fp8Format, u: list[float], log_mag: int) -> None:
    """Scale 1: no division or multiplication rounding, so the bound is exact."""
    x = torch.tensor([v * fmt.max * 2.0**log_mag for v in u], dtype=torch.float32)
    x = x.clamp(-fmt.max, fmt.max)
    back = dequantize(quantize(x, fmt))
    for xi, bi in zip(x.tolist(), back.tolist(), strict=True):
        assert math.isfinite(bi)
        assert abs(bi - xi) <= half_ulp(xi, fmt), (fmt.name, xi, bi)


@given(
    fmt=st.sampled_from(ALL_FORMATS),
    u=st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=1, max_size=32),
    log_mag=st.integers(-24, 0),
    scale=st.floats(min_value=2.0**-16, max_value=2.0**16, width=32),
)
@example(fmt=FP8_E4M3, u=[1.0, -1.0, 0.0], log_mag=0, scale=0.1)
def test_round_trip_within_half_ulp_scaled(
    fmt: Fp8Format, u: list[float], log_mag: int, scale: float
) -> None:
    """|dequantize(quantize(x, s), s) - x| <= s * ulp(x / s) / 2, plus float32 rounding of x/s and q*s."""
    x = torch.tensor([v * fmt.max * scale * 2.0**log_mag for v in u], dtype=torch.float32)
    keep = x.double().abs() <= fmt.max * scale  # exact product in float64
    x = x[keep]
    if x.numel() == 0:
        return
    back = dequantize(quantize(x, fmt, scale), scale)
    y = (x / torch.tensor(scale, dtype=torch.float32)).tolist()  # the value that is quantized
    for xi, yi, bi in zip(x.tolist(), y, back.tolist(), strict=True):
        assert math.isfinite(bi)
        assert abs(yi) <= fmt.max
        slack = F32_EPS_HALF * (abs(xi) + abs(bi)) + F32_TINY * (1 + scale)
        assert abs(bi - xi) <= scale * half_ulp(yi, fmt) + slack, (fmt.name, xi, scale, bi)


@fmt_param
def test_representable_values_round_trip_exactly(fmt: Fp8Format) -> None:
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype)
    v = q.float()
    finite = torch.isfinite(v)
    assert torch.equal(quantize(v[finite], fmt).view(torch.uint8), q[finite].view(torch.uint8))


# ----------------------------------------------------------------------------- saturation, NaN, -0


@given(
    fmt=st.sampled_from(ALL_FORMATS),
    mags=st.lists(
        st.one_of(st.floats(min_value=1.0, max_value=F32_MAX, exclude_min=True), st.just(math.inf)),
        min_size=1,
        max_size=32,
    ),
    signs=st.lists(st.booleans(), min_size=32, max_size=32),
    scale=st.floats(min_value=2.0**-8, max_value=2.0**8, width=32),
)
@example(fmt=FP8_E4M3, mags=[464 / 448, 480 / 448, math.inf], signs=[False, True] * 16, scale=1.0)
def test_saturation(fmt: Fp8Format, mags: list[float], signs: list[bool], scale: float) -> None:
    """|x / scale| > max gives exactly +-max, never inf or NaN."""
    vals = [(-m if s else m) * fmt.max * scale for m, s in zip(mags, signs, strict=False)]
    x = torch.tensor(vals, dtype=torch.float32)
    s32 = torch.tensor(scale, dtype=torch.float32)
    over = (x / s32).abs() > fmt.max
    q = quantize(x, fmt, scale).float()
    assert torch.isfinite(q).all()
    assert torch.equal(q[over], torch.sign(x[over]) * fmt.max)
    assert (q.abs() <= fmt.max).all()


@fmt_param
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_stays_nan(fmt: Fp8Format, dtype: torch.dtype) -> None:
    x = torch.tensor([math.nan, -math.nan, 1.0], dtype=dtype)
    q = quantize(x, fmt, 0.5)
    assert torch.isnan(q.float()[:2]).all()
    assert set(q.view(torch.uint8)[:2].tolist()) <= set(fmt.nan_encodings)
    assert torch.isnan(dequantize(q, 0.5)[:2]).all()
    assert dequantize(q, 0.5)[2].item() == 1.0


@given(
    fmt=st.sampled_from([f for f in ALL_FORMATS if f.fnuz]),
    x=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64),
)
@example(fmt=FP8_E4M3FNUZ, x=[-0.0, -1e-30, -2.0**-12, -(2.0**-11) * 0.5])
def test_fnuz_has_no_negative_zero(fmt: Fp8Format, x: list[float]) -> None:
    q = quantize(torch.tensor(x, dtype=torch.float32), fmt).view(torch.uint8)
    assert (q != 0x80).all()  # 0x80 is NaN in fnuz: a non-NaN input never lands there
    tiny = quantize(torch.tensor([-0.0, -fmt.min_subnormal / 4]), fmt).view(torch.uint8)
    assert tiny.tolist() == [0, 0]


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if not f.fnuz], ids=lambda f: f.name)
def test_ocp_keeps_negative_zero(fmt: Fp8Format) -> None:
    q = quantize(torch.tensor([-0.0, 0.0]), fmt)
    assert q.view(torch.uint8).tolist() == [0x80, 0x00]
    assert torch.signbit(dequantize(q)).tolist() == [True, False]


# ----------------------------------------------------------------------------- shapes and dtypes


def test_broadcast_scale_and_output_dtype() -> None:
    x = torch.randn(3, 4, 5)
    scale = torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, 4, 1)
    q = quantize(x, "fp8_e4m3", scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    back = dequantize(q, scale, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    assert torch.equal(q.view(torch.uint8), quantize(x / scale, "fp8_e4m3").view(torch.uint8))


@fmt_param
def test_min_normal_and_subnormal(fmt: Fp8Format) -> None:
    q = quantize(torch.tensor([fmt.min_normal, fmt.min_subnormal, fmt.min_subnormal / 2]), fmt)
    assert q.view(torch.uint8).tolist() == [1 << fmt.mantissa_bits, 1, 0]  # the last is a tie -> even 0


# ----------------------------------------------------------------------------- resolution and errors


@pytest.mark.parametrize("arch", [None, "sm80", "sm90", "gfx90a", "gfx942"])
def test_fp8_alias_resolves_through_platform_e4m3(arch: str | None) -> None:
    fmt = get_format("fp8", arch=arch)
    assert fmt is platform_e4m3(arch)
    assert fmt is (FP8_E4M3FNUZ if arch == "gfx942" else FP8_E4M3)


def test_fp8_alias_in_quantize_uses_default_platform() -> None:
    assert quantize(torch.ones(2), "fp8").dtype == torch.float8_e4m3fn


@fmt_param
def test_get_format_by_name_dtype_and_instance(fmt: Fp8Format) -> None:
    assert get_format(fmt.name) is fmt
    assert get_format(fmt.torch_dtype) is fmt
    assert get_format(fmt) is fmt
    assert fp8kv.get_format is get_format


@pytest.mark.parametrize("bad", ["fp8_e3m4", "FP8_E4M3", "", "auto", "int8", None, 8, torch.float16])
def test_unknown_kv_dtype_raises(bad: object) -> None:
    with pytest.raises(Fp8KVError, match=r"^kv_dtype: got"):
        get_format(bad)  # type: ignore[arg-type]
    with pytest.raises(Fp8KVError, match=r"^kv_dtype: got"):
        quantize(torch.ones(2), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "scale",
    [0.0, -1.0, math.nan, math.inf, -math.inf, torch.tensor([1.0, 0.0]), torch.tensor([[2.0], [math.nan]])],
    ids=["zero", "negative", "nan", "inf", "-inf", "tensor-zero", "tensor-nan"],
)
def test_bad_scale_raises(scale: object) -> None:
    assert issubclass(Fp8KVError, ValueError)
    with pytest.raises(Fp8KVError, match=r"^scale: got"):
        quantize(torch.ones(2, 2), "fp8_e4m3", scale)  # type: ignore[arg-type]
    q = quantize(torch.ones(2, 2), "fp8_e4m3")
    with pytest.raises(Fp8KVError, match=r"^scale: got"):
        dequantize(q, scale)  # type: ignore[arg-type]


def test_non_float_inputs_raise() -> None:
    with pytest.raises(Fp8KVError, match=r"^x: got"):
        quantize(torch.ones(2, dtype=torch.int32), "fp8_e4m3")
    with pytest.raises(Fp8KVError, match=r"^scale: got"):
        quantize(torch.ones(2), "fp8_e4m3", torch.tensor([1], dtype=torch.int64))
    with pytest.raises(Fp8KVError, match=r"^q: got dtype torch.float32"):
        dequantize(torch.ones(2))  # float32 is not an FP8 dtype
