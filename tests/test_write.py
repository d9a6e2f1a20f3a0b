"""Reference cache writes: round trip, poisoned-cache isolation, padding, layouts, accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8kv
from fp8kv.formats import FORMATS, quantize_scaled
from fp8kv.scales import MIN_DYNAMIC_SCALE, token_head_scale

IO_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def write_cases(draw):
    """A cache geometry, inputs with a spread of magnitudes, and a slot mapping with padding."""
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    gran = draw(st.sampled_from(["tensor", "head", "token_head"]))
    layout = draw(st.sampled_from(["NHD", "HND"]))
    H = draw(st.integers(1, 4))
    D = draw(st.sampled_from([8, 16, 64, 80]))
    bs = draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(1, 6))
    n_slots = num_blocks * bs
    n_written = draw(st.integers(0, min(n_slots, 24)))
    n_pad = draw(st.integers(0, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_slots, generator=g)[:n_written]
    slot_mapping = torch.cat([slots, -torch.ones(n_pad, dtype=torch.long)])
    slot_mapping = slot_mapping[torch.randperm(len(slot_mapping), generator=g)]
    dtype = draw(st.sampled_from(IO_DTYPES))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 300.0, 1e5]))
    key = (torch.randn(len(slot_mapping), H, D, generator=g) * magnitude).to(dtype)
    value = (torch.randn(len(slot_mapping), H, D, generator=g) * magnitude).to(dtype)
    static = {}
    if gran != "token_head":
        shape = () if gran == "tensor" else (H,)
        static = dict(k_scale=torch.rand(shape, generator=g) * 4 + 0.01,
                      v_scale=torch.rand(shape, generator=g) * 4 + 0.01)
    dtype_idx = draw(st.sampled_from(["int32", "int64"]))
    slot_mapping = slot_mapping.to(getattr(torch, dtype_idx))
    return dict(fmt=fmt, gran=gran, layout=layout, H=H, D=D, bs=bs, num_blocks=num_blocks, key=key,
                value=value, slot_mapping=slot_mapping, static=static, seed=seed)


def make_cache(c, poison: bool = True) -> fp8kv.KVCache:
    cache = fp8kv.KVCache.allocate(c["num_blocks"], c["bs"], c["H"], c["D"], kv_dtype=c["fmt"],
                                   layout=c["layout"], scale_granularity=c["gran"], **c["static"])
    if poison:  # random bytes everywhere, so an accidental write anywhere shows
        g = torch.Generator().manual_seed(c["seed"] + 1)
        for t in (cache.key_cache, cache.value_cache):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        if c["gran"] == "token_head":
            cache.k_scale.copy_(torch.rand(cache.k_scale.shape, generator=g) + 0.5)
            cache.v_scale.copy_(torch.rand(cache.v_scale.shape, generator=g) + 0.5)
    return cache


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@given(write_cases())
def test_write_stores_quantized_values_and_touches_nothing_else(c):
    cache = make_cache(c)
    before = cache.clone()
    fp8kv.write_kv_one_shot(cache, c["key"], c["value"], c["slot_mapping"], backend="reference")
    valid = c["slot_mapping"] >= 0
    slots = c["slot_mapping"][valid].long()
    for which, x in (("key", c["key"][valid]), ("value", c["value"][valid])):
        if c["gran"] == "token_head":
            scale = token_head_scale(x, cache.fmt)
            stored = cache.scale_per_slot(which)[slots]
            assert torch.equal(stored, scale)
            assert bool((stored >= MIN_DYNAMIC_SCALE).all()) and bool(torch.isfinite(stored).all())
        else:
            scale = cache.scale_per_slot(which)[:1]
        expected = quantize_scaled(x.float() / scale[..., None], cache.fmt).view(torch.uint8)
        assert torch.equal(cache.token_view(which)[slots].view(torch.uint8), expected)
        # finite input never becomes inf or NaN in the cache
        codes = cache.token_view(which)[slots].float()
        assert bool(torch.isfinite(codes).all())
    # every slot not mapped keeps its old bytes (codes and dynamic scales alike)
    untouched = torch.ones(cache.num_slots, dtype=torch.bool)
    untouched[slots] = False
    for which in ("key", "value"):
        assert torch.equal(bytes_of(cache.token_view(which)[untouched]),
                           bytes_of(before.token_view(which)[untouched]))
        assert torch.equal(bytes_of(cache.scale_per_slot(which)[untouched].contiguous()),
                           bytes_of(before.scale_per_slot(which)[untouched].contiguous()))
    if c["gran"] != "token_head":
        assert torch.equal(cache.k_scale, before.k_scale) and torch.equal(cache.v_scale, before.v_scale)


@given(write_cases())
def test_round_trip_error_is_half_an_fp8_ulp(c):
    """dequantize(cache) is within half an ulp of the format of x/scale (saturation aside)."""
    cache = make_cache(c, poison=False)
    fp8kv.write_kv_one_shot(cache, c["key"], c["value"], c["slot_mapping"], backend="reference")
    valid = c["slot_mapping"] >= 0
    slots = c["slot_mapping"][valid].long()
    fmt = cache.fmt
    for which, x in (("key", c["key"][valid]), ("value", c["value"][valid])):
        scale = cache.scale_per_slot(which)[slots][..., None]
        y = (x.double() / scale.double())
        back = cache.token_view(which)[slots].double()
        inside = y.abs() <= fmt.max
        exponent = torch.floor(torch.log2(y.abs().clamp_min(fmt.min_normal)))
        half_ulp = 2.0 ** (exponent - fmt.mantissa_bits) / 2
        # x/scale is computed in float32: allow that one float32 rounding too
        err = (back - y).abs()
        assert bool((err[inside] <= half_ulp[inside] + y.abs()[inside] * 2**-24).all())
        assert bool((back[~inside].abs() == fmt.max).all())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_nhd_and_hnd_hold_the_same_tokens(fmt):
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(10, 2, 16, generator=g), torch.randn(10, 2, 16, generator=g)
    slots = torch.randperm(24, generator=g)[:10]
    caches = []
    for layout in ("NHD", "HND"):
        cache = fp8kv.KVCache.allocate(6, 4, 2, 16, kv_dtype=fmt, layout=layout, scale_granularity="token_head")
        fp8kv.write_kv_one_shot(cache, key, value, slots, backend="reference")
        caches.append(cache)
    nhd, hnd = caches
    assert hnd.key_cache.shape == (6, 2, 4, 16) and nhd.key_cache.shape == (6, 4, 2, 16)
    for which in ("key", "value"):
        assert torch.equal(nhd.token_view(which).view(torch.uint8), hnd.token_view(which).view(torch.uint8))
    assert torch.equal(nhd.k_scale, hnd.k_scale)


def test_nan_stays_nan_and_inf_saturates():
    cache = fp8kv.KVCache.allocate(1, 4, 1, 4, kv_dtype="fp8_e5m2")
    key = torch.tensor([[[float("nan"), float("inf"), -float("inf"), 1e30]]]).expand(1, 1, 4).contiguous()
    fp8kv.write_kv_one_shot(cache, key, key.clone(), torch.tensor([2]), backend="reference")
    back = cache.token_view("key")[2, 0].float()
    assert torch.isnan(back[0]) and back[1:].tolist() == [57344.0, -57344.0, 57344.0]


def test_token_head_scale_of_zero_vector_is_defined():
    cache = fp8kv.KVCache.allocate(1, 2, 2, 8, scale_granularity="token_head")
    fp8kv.write_kv_one_shot(cache, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.tensor([1]), backend="reference")
    assert cache.k_scale[0, 1].tolist() == [MIN_DYNAMIC_SCALE] * 2
    assert bool((cache.dequantized("key")[1] == 0).all())


@pytest.mark.parametrize("gran,D,expected", [("tensor", 64, 0.5), ("head", 128, 0.5),
                                              ("token_head", 64, 0.53125), ("token_head", 128, 0.515625)])
def test_memory_accounting(gran, D, expected):
    cache = fp8kv.KVCache.allocate(16, 16, 8, D, scale_granularity=gran)
    per_bf16 = 2 * 8 * D * 2
    assert cache.bytes_per_token / per_bf16 == expected
    assert cache.nbytes == cache.bytes_per_token * cache.num_slots + cache.constant_bytes
    assert cache.bf16_nbytes == per_bf16 * cache.num_slots
    assert abs(cache.bf16_ratio - expected) < 1e-3
