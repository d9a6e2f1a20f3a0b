"""Proofs for the integer-only FP8 codec (:mod:`fp8kv.codec`).

Three independent witnesses are compared with the codec:

* torch's own casts (``fp8kv.formats.quantize_scaled``), the reference semantics;
* an oracle written here from the definition (nearest representable value from a table
  of values computed from the format's fields in float64, ties to the even byte);
* ml_dtypes (numpy-side conversion of the clamped float32 values).

Known discrepancy, kept visible rather than hidden: for **NaN inputs to e5m2**, torch
(and so the codec) encodes ``+NaN -> 0x7F`` and ``-NaN -> 0xFF`` whatever the payload,
while ml_dtypes 0.6 encodes ``0x7E`` / ``0xFE`` (its canonical quiet NaN). Both bytes
are NaN in e5m2, so values agree; only the NaN byte differs. For every other input
class and format, ml_dtypes agrees bit for bit. On decode, ml_dtypes returns the
canonical float32 NaN 0x7FC00000 (signed) while torch returns payload-carrying NaNs
(e4m3fn 0x7F -> 0x7FF00000, e5m2 0x7D -> 0x7FE00000, fnuz 0x80 -> 0x7F800001); the
codec matches torch's bits.

Torch discrepancy found here (kept as an ``@example`` and an xfail test): on CPU, torch's
fp16 -> fp32 widening returns ``0x7FFFFFFF`` for *every* fp16 NaN in its scalar loop (tensors
shorter than a vector, and the tail elements of longer ones), dropping the sign, while its
vector loop keeps it (``0xFE00 -> 0xFFC00000``); on CUDA (torch 2.11+cu130, H100) the sign
is dropped at every length. ``fp8kv.formats.to_float32`` restores the sign from the bits, so
``fp8kv.quantize`` of an fp16 ``-NaN`` is ``0xFF`` in e4m3fn/e5m2 at every position, like
:func:`~fp8kv.codec.encode_half_bits`. Backends must widen fp16 the same way.

Beyond these tests, a one-off sweep of all 2**32 float32 bit patterns found the codec
bit-identical to torch's CPU casts and, run on an H100, to torch's CUDA casts (4 formats).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fp8kv.codec import codec_constants, decode_to_f32, encode, encode_f32_bits, encode_half_bits
from fp8kv.formats import FORMATS, FP8_E4M3, Fp8Format, quantize, quantize_scaled

ALL_FORMATS = list(FORMATS.values())
FMT_IDS = [f.name for f in ALL_FORMATS]
ML_DTYPES = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
fmt_param = pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FMT_IDS)


# ----------------------------------------------------------------------------- helpers


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def both_signs(x: np.ndarray) -> np.ndarray:
    x = f32(x).ravel()
    return np.concatenate([x, -x])


def torch_bytes(x: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    return quantize_scaled(torch.from_numpy(np.ascontiguousarray(x)), fmt).view(torch.uint8).numpy()


def codec_bytes(x: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    return encode_f32_bits(torch.from_numpy(np.ascontiguousarray(x)), fmt).numpy()


def ml_bytes(x: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    clamped = np.clip(x, np.float32(-fmt.max), np.float32(fmt.max))
    with np.errstate(invalid="ignore"):
        return clamped.astype(ML_DTYPES[fmt.name]).view(np.uint8)


def positive_values(fmt: Fp8Format) -> np.ndarray:
    """float64 value of every finite non-negative byte 0..max, from the format's fields."""
    m_bits, bias = fmt.mantissa_bits, fmt.bias
    out = []
    for b in range(0x80):
        e, m = b >> m_bits, b & ((1 << m_bits) - 1)
        v = m * 2.0 ** (1 - bias - m_bits) if e == 0 else (1 + m / 2**m_bits) * 2.0 ** (e - bias)
        if v > fmt.max:
            break
        out.append(v)
    vals = np.array(out)
    assert vals[-1] == fmt.max and np.all(np.diff(vals) > 0)
    return vals


def oracle_bytes(x: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """Spec oracle: clamp, then nearest entry of the value table, ties to the even byte.

    Differences are taken in float64, exactly: x is float32 and the table values are
    short dyadic numbers within a factor two of x (or 0).
    """
    vals = positive_values(fmt)
    with np.errstate(invalid="ignore"):  # signalling NaNs widen with a warning
        x64 = x.astype(np.float64)
    nan = np.isnan(x64)
    neg = np.signbit(x64)
    a = np.minimum(np.abs(np.where(nan, 0.0, x64)), fmt.max)
    hi = np.minimum(np.searchsorted(vals, a, side="left"), len(vals) - 1)
    lo = np.where(vals[hi] == a, hi, hi - 1)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    if fmt.fnuz:
        q = np.where(neg & (pick != 0), pick | 0x80, pick)
        q = np.where(nan, 0x80, q)
    else:
        q = np.where(neg, pick | 0x80, pick)
        q = np.where(nan, np.where(neg, 0xFF, 0x7F), q)
    return q.astype(np.uint8)


def _mismatch_report(x: np.ndarray, got: np.ndarray, want: np.ndarray, what: str) -> str:
    bad = np.nonzero(got != want)[0][:8]
    rows = [
        f"x={x[i]!r} (0x{x.view(np.uint32)[i]:08x}): got 0x{got[i]:02x}, {what} 0x{want[i]:02x}"
        for i in bad
    ]
    return f"{int((got != want).sum())} mismatches vs {what}:\n  " + "\n  ".join(rows)


def check_all_witnesses(x: np.ndarray, fmt: Fp8Format) -> None:
    """codec == torch == oracle bitwise; ml_dtypes too, except e5m2's NaN byte (see module doc)."""
    x = f32(x).ravel()
    got = codec_bytes(x, fmt)
    want = torch_bytes(x, fmt)
    assert np.array_equal(got, want), _mismatch_report(x, got, want, "torch")
    orc = oracle_bytes(x, fmt)
    assert np.array_equal(got, orc), _mismatch_report(x, got, orc, "oracle")
    ml = ml_bytes(x, fmt)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], ml[~nan]), _mismatch_report(x[~nan], got[~nan], ml[~nan], "ml_dtypes")
    assert np.isin(ml[nan], fmt.nan_encodings).all()


def decode_np(q: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    return decode_to_f32(torch.from_numpy(q.astype(np.uint8)), fmt).numpy()


# ----------------------------------------------------------------------------- constants


@fmt_param
def test_constants_derived_from_fields(fmt: Fp8Format) -> None:
    c = codec_constants(fmt)
    vals = positive_values(fmt)
    assert c.max_mag == len(vals) - 1
    assert np.float32(fmt.max).view(np.uint32) == c.max_f32_bits
    assert c.drop_bits == 23 - fmt.mantissa_bits


# ----------------------------------------------------------------------------- exhaustive 16-bit


ALL_16 = np.arange(1 << 16, dtype=np.uint16)


@fmt_param
@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_16bit_pattern(fmt: Fp8Format, src: torch.dtype) -> None:
    bits = torch.from_numpy(ALL_16.view(np.int16).copy())
    x32 = bits.view(src).float()
    want = quantize_scaled(x32, fmt).view(torch.uint8).numpy()
    got_half = encode_half_bits(bits, src, fmt).numpy()
    assert np.array_equal(got_half, want), _mismatch_report(x32.numpy(), got_half, want, "torch")
    check_all_witnesses(x32.numpy(), fmt)


# ----------------------------------------------------------------------------- float32 targeted sets


def _ulp_above_max(fmt: Fp8Format) -> float:
    vals = positive_values(fmt)
    return float(vals[-1] - vals[-2])


def targeted_sets(fmt: Fp8Format) -> dict[str, np.ndarray]:
    vals = positive_values(fmt)
    ties = (vals[:-1] + vals[1:]) / 2  # exact: needs one more mantissa bit than fp8 has
    ties = np.append(ties, fmt.max + _ulp_above_max(fmt) / 2)  # tie with the would-be next value
    ties32 = f32(ties)
    assert np.array_equal(ties32.astype(np.float64), ties)
    inf = np.float32(np.inf)

    min_normal, min_sub = fmt.min_normal, fmt.min_subnormal
    grid = f32(np.linspace(0, min_normal, 2049)[1:])
    rng = np.random.default_rng(1234)
    subnormal = np.concatenate(
        [
            f32(vals[vals < min_normal]),
            grid,
            np.nextafter(grid, 0),
            np.nextafter(grid, inf),
            f32(rng.uniform(0, min_normal, 4096)),
            f32([min_sub / 2, min_sub / 4, min_sub * 0.75, min_sub * 1.5, min_sub * 2.5]),
            np.nextafter(f32([min_sub / 2, min_sub * 1.5, min_sub * 2.5]), inf),
            np.nextafter(f32([min_sub / 2, min_sub * 1.5, min_sub * 2.5]), 0),
        ]
    )

    binade = []
    top = math.frexp(fmt.max)[1]
    for k in range(int(math.log2(min_sub)) - 2, top + 1):
        p = 2.0**k
        half_ulp_below = 2.0 ** (k - 2 - fmt.mantissa_bits)  # tie between p - ulp and p
        pts = f32([p, p - half_ulp_below, p * (1 - 2.0**-12), p * 0.999])
        binade += [pts, np.nextafter(pts, 0), np.nextafter(pts, inf)]
    binade.append(f32([127.8, 127.9, 255.9, 239.9, 15.99, 0.99]))

    big = _ulp_above_max(fmt)
    overflow = np.concatenate(
        [
            f32([fmt.max, fmt.max + big / 4, fmt.max + big / 2, fmt.max + big, 2 * fmt.max, 1e10, 1e30]),
            f32([np.finfo(np.float32).max, inf]),
            np.nextafter(f32([fmt.max]), inf),
            np.nextafter(f32([fmt.max]), 0),
        ]
    )

    f32_sub = np.concatenate(
        [
            f32_from_bits([0x00000001, 0x00000002, 0x00400000, 0x007FFFFF, 0x00800000]),
            f32_from_bits(rng.integers(1, 0x00800000, 4096)),
        ]
    )

    return {
        "ties": both_signs(ties32),
        "near_ties": both_signs(np.concatenate([np.nextafter(ties32, 0), np.nextafter(ties32, inf)])),
        "subnormal_range": both_signs(subnormal),
        "binade_boundaries": both_signs(np.concatenate(binade)),
        "overflow": both_signs(overflow),
        "f32_subnormals": both_signs(f32_sub),
        "zeros": f32([0.0, -0.0]),
        "nans": f32_from_bits(
            [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000, 0xFFE00000]
        ),
    }


SET_NAMES = list(targeted_sets(ALL_FORMATS[0]))


@fmt_param
@pytest.mark.parametrize("which", SET_NAMES)
def test_targeted_float32_sets(fmt: Fp8Format, which: str) -> None:
    check_all_witnesses(targeted_sets(fmt)[which], fmt)


@fmt_param
def test_ties_round_to_even_and_top_tie_saturates(fmt: Fp8Format) -> None:
    vals = positive_values(fmt)
    for i in range(len(vals) - 1):
        tie = np.float32((vals[i] + vals[i + 1]) / 2)
        q = int(codec_bytes(f32([tie]), fmt)[0])
        assert q == (i if i % 2 == 0 else i + 1), (fmt.name, float(tie), hex(q))
    over = f32([fmt.max + _ulp_above_max(fmt) / 2, -(fmt.max + _ulp_above_max(fmt) / 2)])
    dec = decode_np(codec_bytes(over, fmt), fmt)
    assert dec.tolist() == [fmt.max, -fmt.max]


@fmt_param
def test_carry_across_power_of_two(fmt: Fp8Format) -> None:
    """Values just below 2**k that round up must carry into the exponent (127.8 -> 128)."""
    powers = [2.0**k for k in range(math.frexp(fmt.min_normal)[1], math.frexp(fmt.max)[1])]
    x = np.nextafter(f32(powers), 0)
    dec = decode_np(codec_bytes(x, fmt), fmt)
    assert dec.tolist() == powers
    assert decode_np(codec_bytes(f32([127.8, -127.8]), fmt), fmt).tolist() == [128.0, -128.0]
    # the largest subnormal's upper neighbour tie carries into the smallest normal
    vals = positive_values(fmt)
    last_sub = vals[vals < fmt.min_normal][-1]
    tie_up = np.nextafter(np.float32((last_sub + fmt.min_normal) / 2), np.float32(1))
    assert decode_np(codec_bytes(f32([tie_up]), fmt), fmt)[0] == fmt.min_normal


@fmt_param
def test_saturation_and_specials(fmt: Fp8Format) -> None:
    x = f32([np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max])
    assert decode_np(codec_bytes(x, fmt), fmt).tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    nan = f32_from_bits([0x7FC00000, 0xFFC00000])
    zeros = f32([0.0, -0.0, -1e-30])
    if fmt.fnuz:
        assert codec_bytes(nan, fmt).tolist() == [0x80, 0x80]
        assert codec_bytes(zeros, fmt).tolist() == [0x00, 0x00, 0x00]
    else:
        assert codec_bytes(nan, fmt).tolist() == [0x7F, 0xFF]
        assert codec_bytes(zeros, fmt).tolist() == [0x00, 0x80, 0x80]


# ----------------------------------------------------------------------------- property


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=512))
@example([0x42FF999A, 0xC2FF999A])  # +-127.8f: must carry to 128 (dropped by Triton's interpreter)
@example([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800000, 0x7F800000])  # NaNs, -inf, +inf
@example([0x80000000, 0x00000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF])
def test_property_arbitrary_float32_bits(bits: list[int]) -> None:
    x = f32_from_bits(bits)
    for fmt in ALL_FORMATS:
        check_all_witnesses(x, fmt)


_floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
_scales = st.floats(min_value=2.0**-20, max_value=2.0**20, width=32)


def expected_nan_byte(negative: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """The codec's NaN byte: OCP keeps the input's sign (0x7F / 0xFF), fnuz has only 0x80."""
    if fmt.fnuz:
        return np.full(negative.shape, 0x80, dtype=np.uint8)
    return np.where(negative, 0xFF, 0x7F).astype(np.uint8)


@given(
    fmt=st.sampled_from(ALL_FORMATS),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    xs=st.lists(_floats32, min_size=1, max_size=64),
    scales=st.one_of(_scales, st.lists(_scales, min_size=1, max_size=1)),
)
# torch discrepancy, found by this test: a lone fp16 -NaN widens to +NaN (0x7FFFFFFF) in torch's
# scalar CPU loop; fp8kv.formats.to_float32 restores the sign, so quantize() gives 0xFF like the codec.
@example(fmt=FP8_E4M3, dtype=torch.float16, xs=[-math.nan], scales=1.0)
def test_encode_with_scale_matches_quantize(fmt, dtype, xs, scales) -> None:
    x = torch.tensor(xs, dtype=torch.float32).to(dtype)
    scale = torch.tensor(scales, dtype=torch.float32) if isinstance(scales, list) else scales
    want = quantize(x, fmt, scale).view(torch.uint8)
    assert torch.equal(encode(x, fmt, scale), want)
    if dtype != torch.float32:
        # encode_half_bits widens by integer ops: equal to quantize bit for bit, NaN signs included
        got = encode_half_bits(x.view(torch.int16), dtype, fmt)
        assert torch.equal(got, quantize(x, fmt).view(torch.uint8))
        nan = torch.isnan(x).numpy()
        negative = (x.view(torch.int16) < 0).numpy()
        assert np.array_equal(got.numpy()[nan], expected_nan_byte(negative[nan], fmt))


FP16_NEG_NAN = 0xFE00  # fp16 -NaN (quiet); every fp16 NaN pattern behaves the same way


def test_codec_fp16_nan_sign_does_not_depend_on_tensor_length() -> None:
    for n in (1, 7, 8, 9, 65536):
        bits = torch.full((n,), FP16_NEG_NAN - (1 << 16), dtype=torch.int16)
        for fmt in ALL_FORMATS:
            assert set(encode_half_bits(bits, torch.float16, fmt).tolist()) == {0x80 if fmt.fnuz else 0xFF}


@pytest.mark.xfail(
    strict=False,
    reason="torch CPU bug (seen on 2.13): fp16->fp32 of a NaN in the scalar (non-vector / tail) loop "
    "returns 0x7FFFFFFF, dropping the sign; the vector loop keeps it (0xFFC00000); on CUDA the "
    "sign is dropped at every length. This documents torch, not fp8kv (see the next test).",
)
@pytest.mark.parametrize("n", [1, 7, 9, 17])
def test_torch_fp16_nan_widening_keeps_sign(n: int) -> None:
    bits = torch.full((n,), FP16_NEG_NAN - (1 << 16), dtype=torch.int16)
    widened = bits.view(torch.float16).float()
    assert torch.signbit(widened).all()  # fails for the tail elements on the affected torch builds


@pytest.mark.parametrize("n", [1, 7, 8, 9, 17])
def test_quantize_keeps_fp16_nan_sign_at_every_length(n: int) -> None:
    """fp8kv.formats.to_float32 works around the torch bug above."""
    bits = torch.full((n,), FP16_NEG_NAN - (1 << 16), dtype=torch.int16)
    for fmt in ALL_FORMATS:
        q = quantize(bits.view(torch.float16), fmt).view(torch.uint8)
        assert set(q.tolist()) == {0x80 if fmt.fnuz else 0xFF}


def test_input_type_checks() -> None:
    with pytest.raises(TypeError, match="x:"):
        encode_f32_bits(torch.zeros(2, dtype=torch.float16), ALL_FORMATS[0])
    with pytest.raises(TypeError, match="src_dtype:"):
        encode_half_bits(torch.zeros(2, dtype=torch.int16), torch.float32, ALL_FORMATS[0])
    with pytest.raises(TypeError, match="q:"):
        decode_to_f32(torch.zeros(2, dtype=torch.int32), ALL_FORMATS[0])
    with pytest.raises(TypeError, match="bits:"):
        encode_half_bits(torch.zeros(2, dtype=torch.float16), torch.float16, ALL_FORMATS[0])


def test_non_contiguous_and_shapes() -> None:
    x = torch.randn(4, 6, 8).transpose(0, 2) * 100
    for fmt in ALL_FORMATS:
        got = encode_f32_bits(x, fmt)
        assert got.shape == x.shape
        assert torch.equal(got, quantize_scaled(x, fmt).view(torch.uint8))


# ----------------------------------------------------------------------------- decode


ALL_BYTES = np.arange(256, dtype=np.uint8)


@fmt_param
def test_decode_all_bytes(fmt: Fp8Format) -> None:
    got = decode_np(ALL_BYTES, fmt)
    want = torch.from_numpy(ALL_BYTES.copy()).view(fmt.torch_dtype).float().numpy()
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    assert np.array_equal(got_nan, want_nan)
    assert np.nonzero(got_nan)[0].tolist() == sorted(fmt.nan_encodings)
    assert np.array_equal(got.view(np.uint32)[~got_nan], want.view(np.uint32)[~want_nan])  # -0 included
    assert np.nonzero(np.isinf(got))[0].tolist() == sorted(fmt.inf_encodings)
    # independent witnesses: the field-derived value table and ml_dtypes
    vals = positive_values(fmt)
    assert np.array_equal(got[: len(vals)].astype(np.float64), vals)
    neg = np.arange(0x80, 0x80 + len(vals))
    if fmt.fnuz:
        assert np.array_equal(got[neg[1:]].astype(np.float64), -vals[1:])
    else:
        assert np.array_equal(got[neg].astype(np.float64), -vals)
    ml = ALL_BYTES.view(ML_DTYPES[fmt.name]).astype(np.float32)
    assert np.array_equal(got, ml, equal_nan=True)
    assert np.array_equal(np.signbit(got[~got_nan]), np.signbit(ml[~got_nan]))


@fmt_param
def test_decode_nan_bits_match_torch(fmt: Fp8Format) -> None:
    """Stronger than the spec (which only asks for NaN): the NaN bit patterns match torch's too."""
    got = decode_np(ALL_BYTES, fmt)
    want = torch.from_numpy(ALL_BYTES.copy()).view(fmt.torch_dtype).float().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@fmt_param
def test_encode_decode_round_trip(fmt: Fp8Format) -> None:
    dec = decode_to_f32(torch.from_numpy(ALL_BYTES.copy()), fmt)
    back = encode_f32_bits(dec, fmt).numpy()
    finite = np.isfinite(dec.numpy())
    assert np.array_equal(back[finite], ALL_BYTES[finite])
    # +-inf (e5m2) saturates to +-max; NaN goes to the canonical NaN byte (sign kept in OCP)
    max_mag = codec_constants(fmt).max_mag
    for b in ALL_BYTES[~finite].tolist():
        if b in fmt.inf_encodings:
            assert back[b] == (b & 0x80) | max_mag
        elif fmt.fnuz:
            assert back[b] == 0x80
        else:
            assert back[b] == (b & 0x80) | 0x7F
