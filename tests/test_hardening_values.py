"""Hardening of the value functions: quantize/dequantize/calibrate round once, never overflow,
and refuse bad input with an error naming the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fp8kv
from fp8kv.errors import InvalidArgument


def nearest_even_e4m3(x: float) -> float:
    """Independent oracle: the e4m3fn value nearest to ``x`` (float64 math, ties to an even code),
    saturating at ±448, by enumerating the format's finite values."""
    codes = np.arange(256, dtype=np.uint8)
    vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    finite = np.isfinite(vals)
    codes, vals = codes[finite], vals[finite]
    x = min(max(x, -448.0), 448.0)
    d = np.abs(vals - x)
    best = d.min()
    tied = codes[d == best]
    pick = [c for c in tied if c % 2 == 0] or list(tied)  # even mantissa LSB = even code
    v = vals[codes == pick[0]][0]
    return math.copysign(v, x) if v == 0 else float(v)


@example(1.0625 + 2.0**-40)  # above a tie by less than float32 can see: must round up (1.125)
@example(1.0625 - 2.0**-40)
@example(-(1.0625 + 2.0**-40))
@example(2.0**-10 + 2.0**-50)  # half the smallest subnormal, plus a hair
@example(447.9999999999)
@given(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False))
def test_float64_input_is_rounded_once(x):
    got = float(fp8kv.quantize(torch.tensor([x], dtype=torch.float64), "fp8_e4m3").to(torch.float64))
    want = nearest_even_e4m3(x)
    assert got == want and math.copysign(1, got) == math.copysign(1, want), (x, got, want)


def test_float64_nan_and_saturation():
    x = torch.tensor([float("nan"), 1e300, -1e300, float("inf")], dtype=torch.float64)
    q = fp8kv.quantize(x, "fp8_e4m3").float()
    assert math.isnan(q[0]) and q[1:].tolist() == [448.0, -448.0, 448.0]


def test_calibrate_does_not_overflow_before_dividing():
    s = fp8kv.calibrate(torch.full((1, 1, 2), 3e38), "fp8_e4m3", margin=2.0)
    assert float(s) == pytest.approx(3e38 * 2 / 448, rel=1e-6) and math.isfinite(float(s))


@pytest.mark.parametrize("call,argname", [
    (lambda: fp8kv.quantize([1.0, 2.0], "fp8_e4m3"), "x"),
    (lambda: fp8kv.quantize(torch.ones(3, dtype=torch.int32), "fp8_e4m3"), "x"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp8_e4m3", torch.ones(2)), "scale"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp8_e4m3", "0.5"), "scale"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp8_e4m3", torch.ones(1, device="meta")), "scale"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp8_e4m3", torch.ones(0)), "scale"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp8_e4m3", True), "scale"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp8_e4m3", 1e39), "scale"),
    (lambda: fp8kv.quantize(torch.ones(3), "fp9"), "kv_dtype"),
    (lambda: fp8kv.dequantize([1, 2]), "q"),
    (lambda: fp8kv.dequantize(torch.ones(2)), "q"),
    (lambda: fp8kv.dequantize(torch.ones(2).to(torch.float8_e4m3fn), 1.0, torch.int32), "dtype"),
    (lambda: fp8kv.dequantize(torch.ones(2).to(torch.float8_e4m3fn), torch.ones(3)), "scale"),
    (lambda: fp8kv.calibrate([[[1.0]]]), "samples"),
    (lambda: fp8kv.calibrate(torch.empty(0, 2, 4)), "samples"),
    (lambda: fp8kv.calibrate(torch.ones(2, 2)), "samples"),
    (lambda: fp8kv.calibrate(torch.ones(1, 2, 4), margin=0.5), "margin"),
    (lambda: fp8kv.calibrate(torch.ones(1, 2, 4), margin="2"), "margin"),
    (lambda: fp8kv.calibrate(torch.ones(1, 2, 4), granularity="token_head"), "granularity"),
])
def test_bad_value_inputs_name_the_argument(call, argname):
    with pytest.raises(InvalidArgument) as err:
        call()
    assert str(err.value).startswith(argname + ":"), str(err.value)
