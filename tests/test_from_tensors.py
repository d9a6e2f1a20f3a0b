"""``KVCache.from_tensors``: zero-copy wrapping of engine layouts, validation at construction
(every refusal an ``fp8kv.InvalidArgument`` whose message starts with the field that
disagrees), the frozen result; and the ``window_left`` convention of ``plan_attention``."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp8kv
from fp8kv import InvalidArgument, KVCache
from fp8kv.cache import may_share_bytes

NB, BS, H, D = 3, 4, 2, 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
_TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not _INTERPRETED, reason="needs the Triton CPU interpreter"))


def f8(*shape, dtype=E4M3, device="cpu") -> torch.Tensor:
    return torch.zeros(shape or (NB, BS, H, D), dtype=dtype, device=device)


def refused(field: str, fn) -> str:
    """``fn()`` raises InvalidArgument whose message starts with ``field:``; returns the message."""
    with pytest.raises(InvalidArgument) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{field}:"), f"expected an error naming {field!r}, got: {msg}"
    return msg


# ------------------------------------------------------------------- zero-copy, per engine
@pytest.mark.parametrize("storage", [torch.uint8, E4M3], ids=["uint8", "float8"])
@pytest.mark.parametrize("cache_layout", ["NHD", "HND"])
def test_vllm_flash_cache_zero_copy(cache_layout, storage):
    """``[2, num_blocks, block_size, H, D]``; HND is the physical ``[2, num_blocks, H, block_size, D]``
    permuted to that logical shape, wrapped as ``layout="NHD"`` (a stride permutation)."""
    phys = torch.zeros((2, NB, BS, H, D) if cache_layout == "NHD" else (2, NB, H, BS, D), dtype=storage)
    kv_cache = phys if cache_layout == "NHD" else phys.permute(0, 1, 3, 2, 4)
    cache = KVCache.from_tensors(kv_cache, kv_dtype="fp8_e4m3", kv_dim=0, layout="NHD")
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_size) == (NB, BS, H, D)
    assert cache.key_cache.dtype == E4M3 and cache.layout == "NHD"
    assert cache.key_cache.data_ptr() == phys.data_ptr() and cache.value_cache.data_ptr() == phys[1].data_ptr()
    assert cache.key_cache.stride() == kv_cache[0].stride()
    phys.view(torch.uint8)[(1, 2, 0, 1, 3) if cache_layout == "NHD" else (1, 2, 1, 0, 3)] = 0x38  # 1.0
    assert cache.value_cache[2, 0, 1, 3].item() == 1.0  # the engine's byte, seen through the cache


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_flashinfer_single_tensor_and_pair_zero_copy(kv_layout):
    shape = (NB, 2, BS, H, D) if kv_layout == "NHD" else (NB, 2, H, BS, D)
    paged = f8(*shape, dtype=E5M2)
    cache = KVCache.from_tensors(paged, layout=kv_layout)  # kv_dim=1; kv_dtype from the dtype
    assert cache.kv_dtype == "fp8_e5m2" and cache.layout == kv_layout
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads) == (NB, BS, H)
    assert cache.key_cache.data_ptr() == paged.data_ptr() and cache.value_cache.data_ptr() == paged[:, 1].data_ptr()

    a, b = shape[2:4]  # (page_size, H) or (H, page_size)
    k_alloc, v_alloc = f8(NB, a + 1, b, D + 8), f8(NB + 2, a, b, D)  # each padded its own way
    k, v = k_alloc[:, :a, :, :D], v_alloc[2:]
    pair = KVCache.from_tensors(k, v, layout=kv_layout)  # FlashInfer's (k_cache, v_cache) tuple
    assert pair.key_cache.data_ptr() == k_alloc.data_ptr() and pair.value_cache.data_ptr() == v.data_ptr()
    assert pair.key_cache.stride() == k.stride() and pair.value_cache.stride() == v.stride()


def test_sglang_token_pool_zero_copy():
    k_buffer, v_buffer = torch.zeros(41, H, D, dtype=torch.uint8), torch.zeros(41, H, D, dtype=torch.uint8)
    cache = KVCache.from_tensors(k_buffer[:, None], v_buffer[:, None], kv_dtype="fp8_e4m3")
    assert (cache.num_blocks, cache.block_size) == (41, 1)
    assert cache.key_cache.data_ptr() == k_buffer.data_ptr() and cache.value_cache.data_ptr() == v_buffer.data_ptr()


def test_lmdeploy_layer_view_and_tp_slice_zero_copy():
    key_caches, value_caches = f8(2, NB, BS, 4, D), f8(2, NB, BS, 4, D)  # [num_layers, num_blocks, bs, H, D]
    k_scale, v_scale = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 0.6, 0.7, 0.8])
    cache = KVCache.from_tensors(key_caches[1], value_caches[1], scale_granularity="head", k_scale=k_scale,
                                 v_scale=v_scale)
    assert cache.key_cache.data_ptr() == key_caches[1].data_ptr() and cache.k_scale.data_ptr() == k_scale.data_ptr()
    rank = KVCache.from_tensors(key_caches[1, :, :, 2:], value_caches[1, :, :, 2:], scale_granularity="head",
                                k_scale=k_scale[2:], v_scale=v_scale[2:])
    sliced = cache.slice_heads(2, 4)
    assert rank.spec == sliced.spec and rank.num_kv_heads == 2
    assert rank.key_cache.data_ptr() == sliced.key_cache.data_ptr() == key_caches[1, 0, 0, 2].data_ptr()
    assert rank.k_scale.data_ptr() == sliced.k_scale.data_ptr() == k_scale[2:].data_ptr()
    assert sliced.v_scale.tolist() == pytest.approx([0.7, 0.8])


def test_static_scales_zero_copy_when_float32_on_the_device():
    k_scale, v_scale = torch.tensor(0.5), torch.tensor([0.25])
    cache = KVCache.from_tensors(f8(), f8(), k_scale=k_scale, v_scale=v_scale)
    assert cache.k_scale.data_ptr() == k_scale.data_ptr() and cache.v_scale.data_ptr() == v_scale.data_ptr()
    assert cache.k_scale.shape == () and cache.v_scale.shape == ()
    converted = KVCache.from_tensors(f8(), f8(), k_scale=torch.tensor(0.5, dtype=torch.float64))
    assert converted.k_scale.dtype == torch.float32 and converted.k_scale.item() == 0.5


def test_interleaved_views_of_one_buffer_are_not_aliasing():
    t = f8(NB, 2, BS, H, D)
    KVCache.from_tensors(t[:, 0], t[:, 1])  # FlashInfer's views: interleaved, disjoint
    a = np.zeros((NB, 3, BS, H, D), dtype=np.uint8)
    KVCache.from_tensors(torch.from_numpy(a[:, 1]), torch.from_numpy(a[:, 2]), kv_dtype="fp8_e4m3")


def test_meta_device_cache():
    cache = KVCache.from_tensors(f8(device="meta"), f8(device="meta"))
    assert cache.device.type == "meta" and cache.k_scale.device.type == "meta"


# --------------------------------------------------------------------------- refusals
def test_uint8_storage_needs_kv_dtype():
    refused("kv_dtype", lambda: KVCache.from_tensors(torch.zeros(NB, 2, BS, H, D, dtype=torch.uint8)))
    refused("kv_dtype", lambda: KVCache.from_tensors(f8(), f8(), kv_dtype="int8"))


def test_dtype_against_format():
    e5m2 = f8(dtype=E5M2)
    msg = refused("key_cache", lambda: KVCache.from_tensors(e5m2, f8(dtype=E5M2), kv_dtype="fp8_e4m3"))
    assert "float8_e5m2" in msg and "fp8_e4m3" in msg
    refused("value_cache", lambda: KVCache.from_tensors(f8(), e5m2))  # the format is K's
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(dtype=torch.float16)))
    refused("key_cache", lambda: KVCache.from_tensors(f8(dtype=torch.float16), f8()))
    refused("key_cache", lambda: KVCache.from_tensors(f8(dtype=torch.int8), f8(dtype=torch.int8), kv_dtype="fp8_e4m3"))


def test_shapes_and_types():
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(NB + 1, BS, H, D)))
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(NB, BS, H + 1, D)))
    refused("key_cache", lambda: KVCache.from_tensors(f8(NB, BS, H * D), f8(NB, BS, H * D)))
    refused("key_cache", lambda: KVCache.from_tensors(f8(0, BS, H, D), f8(0, BS, H, D)))
    refused("key_cache", lambda: KVCache.from_tensors([[0]], f8()))
    refused("value_cache", lambda: KVCache.from_tensors(f8(), "v"))
    refused("key_cache", lambda: KVCache.from_tensors(f8(NB, 3, BS, H, D)))  # no size-2 K/V dimension
    refused("key_cache", lambda: KVCache.from_tensors(f8(NB, 2, BS, H, D), kv_dim=0))
    refused("kv_dim", lambda: KVCache.from_tensors(f8(NB, 2, BS, H, D), kv_dim=5))
    refused("kv_dim", lambda: KVCache.from_tensors(f8(NB, 2, BS, H, D), kv_dim=True))
    refused("layout", lambda: KVCache.from_tensors(f8(), f8(), layout="NDH"))
    refused("scale_granularity", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="channel"))


def test_devices():
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(device="meta")))
    refused("value_cache", lambda: KVCache.from_tensors(f8(device="meta"), f8()))
    refused("k_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="token_head",
                                                    k_scale=torch.ones(NB, BS, H, device="meta")))


def test_strides_the_backends_serve():
    refused("key_cache", lambda: KVCache.from_tensors(f8(NB, BS, D, H).transpose(2, 3), f8()))  # head_size stride 2
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(NB, D, BS, H).permute(0, 2, 3, 1)))
    msg = refused("key_cache", lambda: KVCache.from_tensors(f8(NB, BS, 1, D).expand(NB, BS, H, D), f8()))
    assert "non-overlapping" in msg
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(1, BS, H, D).expand(NB, BS, H, D)))
    refused("value_cache", lambda: KVCache.from_tensors(f8(), f8(NB * BS * H * D).as_strided((NB, BS, H, D),
                                                                                              (BS * H * D, 8, 4, 1))))


def test_no_aliasing_between_k_and_v():
    t = f8()
    msg = refused("value_cache", lambda: KVCache.from_tensors(t, t))
    assert "sharing memory with key_cache" in msg
    w = f8(NB, BS + 2, H, D)
    refused("value_cache", lambda: KVCache.from_tensors(w[:, :BS], w[:, 1:BS + 1]))  # overlapping views
    refused("value_cache", lambda: KVCache.from_tensors(w[:, :BS], w[:, :BS]))  # the same view twice
    paged = f8(NB, 2, BS, H, D)
    refused("value_cache", lambda: KVCache.from_tensors(paged[:, 0], paged.view(NB, 2 * BS, H, D)[:, 2:BS + 2]))
    # two imports of one buffer are two storages over the same bytes
    a = np.zeros((NB, 3, BS, H, D), dtype=np.uint8)
    refused("value_cache", lambda: KVCache.from_tensors(torch.from_numpy(a[:, 1:])[:, 0],
                                                        torch.from_numpy(a[:, :2])[:, 1], kv_dtype="fp8_e4m3"))


def test_no_aliasing_between_caches_and_scales():
    raw = torch.zeros(NB * BS * H * D, dtype=torch.uint8)
    raw.view(torch.float32).fill_(0.5)  # valid scale values wherever a scale is read
    k = raw.view(NB, BS, H, D)
    refused("k_scale", lambda: KVCache.from_tensors(k, f8(), kv_dtype="fp8_e4m3", k_scale=raw[:4].view(torch.float32)))
    refused("v_scale", lambda: KVCache.from_tensors(f8(), k, kv_dtype="fp8_e4m3",
                                                    v_scale=raw[-4:].view(torch.float32).reshape(())))
    token = raw[:NB * BS * H * 4].view(torch.float32).view(NB, BS, H)
    refused("k_scale", lambda: KVCache.from_tensors(f8(), k, kv_dtype="fp8_e4m3", scale_granularity="token_head",
                                                    k_scale=token))
    s = torch.ones(NB, BS, H)
    refused("v_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="token_head", k_scale=s, v_scale=s))
    both = torch.ones(NB, BS, H, 2)
    KVCache.from_tensors(f8(), f8(), scale_granularity="token_head", k_scale=both[..., 0], v_scale=both[..., 1])
    one = torch.tensor([0.5, 0.25])  # static scales are read only: K and V may share them
    KVCache.from_tensors(f8(), f8(), scale_granularity="head", k_scale=one, v_scale=one)


def test_scale_shapes_against_granularity():
    refused("k_scale", lambda: KVCache.from_tensors(f8(), f8(), k_scale=torch.ones(H)))
    refused("v_scale", lambda: KVCache.from_tensors(f8(), f8(), v_scale=torch.ones(2, 2)))
    refused("k_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="head", k_scale=torch.ones(H + 1)))
    refused("v_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="head", v_scale=torch.ones(1, H)))
    refused("k_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="token_head",
                                                    k_scale=torch.ones(NB, BS, H + 1)))
    refused("v_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="token_head",
                                                    v_scale=torch.ones(NB, BS, H, dtype=torch.float16)))
    refused("k_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="token_head", k_scale=0.5))
    refused("v_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="token_head", v_scale=0.5))
    refused("k_scale", lambda: KVCache.from_tensors(f8(), f8(), k_scale=0.0))
    refused("v_scale", lambda: KVCache.from_tensors(f8(), f8(), scale_granularity="head",
                                                    v_scale=torch.tensor([1.0, float("nan")])))
    # the per-head scales of a head slice have the slice's length
    refused("k_scale", lambda: KVCache.from_tensors(f8(NB, BS, 4, D)[:, :, 2:], f8(NB, BS, 2, D),
                                                    scale_granularity="head", k_scale=torch.ones(4)))


def test_the_constructor_validates_too_and_the_cache_is_frozen():
    cache = KVCache.from_tensors(f8(), f8())
    refused("value_cache", lambda: KVCache(cache.key_cache, cache.key_cache, cache.k_scale, cache.v_scale,
                                           cache.fmt, "NHD", "tensor"))
    refused("k_scale", lambda: KVCache(f8(), f8(), torch.ones(H), cache.v_scale, cache.fmt, "NHD", "tensor"))
    for field, value in (("key_cache", f8()), ("k_scale", torch.tensor(2.0)), ("layout", "HND"),
                         ("spec", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cache, field, value)


# ------------------------------------------------------------------- the aliasing check
def _byte_set(t: torch.Tensor) -> set[int]:
    idx = torch.zeros(t.shape, dtype=torch.int64)
    for k, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)):
        idx = idx + (torch.arange(n) * s).view([n if i == k else 1 for i in range(t.dim())])
    starts = t.data_ptr() + idx.flatten() * t.element_size()
    return {int(b) + i for b in starts for i in range(t.element_size())}


@st.composite
def _view_pairs(draw):
    """Two strided views (from two separate imports) of one small NumPy buffer."""
    itemsize = draw(st.sampled_from([1, 4]))
    buf = np.zeros(256, dtype=np.uint8 if itemsize == 1 else np.float32)

    def view(same_as=None):
        if same_as is None:
            dims = draw(st.integers(1, 3))
            shape = tuple(draw(st.integers(1, 4)) for _ in range(dims))
            strides = tuple(draw(st.integers(0, 12)) for _ in range(dims))
        else:
            shape, strides = same_as
        span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        offset = draw(st.integers(0, len(buf) - 1 - span))
        arr = np.lib.stride_tricks.as_strided(buf[offset:], shape, tuple(s * itemsize for s in strides))
        return torch.from_numpy(arr), (shape, strides)

    a, geometry = view()
    b, _ = view(geometry if draw(st.booleans()) else None)
    return a, b


@given(_view_pairs())
def test_may_share_bytes_never_misses_and_is_exact_for_one_geometry(pair):
    a, b = pair
    shared = bool(_byte_set(a) & _byte_set(b))
    answer = may_share_bytes(a, b)
    if shared:
        assert answer, "aliasing missed"
    if a.shape == b.shape and a.stride() == b.stride():
        assert answer == shared
    assert may_share_bytes(b, a) == answer or a.shape != b.shape or a.stride() != b.stride()


# ------------------------------------------------------------------- window_left, indices
def _cache_and_step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(6, 4, 2, 16)
    for t in (cache.key_cache, cache.value_cache):
        t.view(torch.uint8).copy_((torch.randn(t.shape, generator=g) * 3).to(E4M3).view(torch.uint8))
    q = torch.randn(6, 4, 16, generator=g)
    step = dict(block_tables=torch.tensor([[0, 1, 2], [3, 4, 0]]), seq_lens=torch.tensor([11, 7]),
                query_start_loc=torch.tensor([0, 4, 6]))
    return cache, q, step


@pytest.mark.parametrize("backend", ["reference", _TRITON])
def test_window_left_is_sliding_window_minus_one(backend):
    cache, q, step = _cache_and_step()
    run = lambda **w: fp8kv.paged_attention_one_shot(q, cache, step["block_tables"], step["seq_lens"],
                                            query_start_loc=step["query_start_loc"], backend=backend, **w)
    full = run()
    for W in (1, 3, 7):
        windowed = run(window_left=W - 1)
        assert torch.equal(windowed, run(sliding_window=W))
        assert not torch.equal(windowed, full)
    assert torch.equal(run(window_left=-1), full)  # FlashInfer's and SGLang's "no window"
    assert torch.equal(run(window_left=20), full)  # wider than every sequence


def test_window_left_in_the_metadata():
    cache, _, step = _cache_and_step()
    plan = lambda **w: fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, **step, **w)
    assert plan(window_left=4).options == plan(sliding_window=5).options
    assert plan(window_left=4).sliding_window == 5 and "sliding_window" in plan(window_left=0).options.features
    assert plan(window_left=-1).sliding_window is None and plan(window_left=-1).options == plan().options


def test_window_left_refusals():
    cache, q, step = _cache_and_step()
    plan = lambda **w: fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, **step, **w)
    msg = refused("window_left", lambda: plan(window_left=3, sliding_window=4))
    assert "sliding_window" in msg
    refused("window_left", lambda: plan(window_left=-1, sliding_window=4))
    for bad in (-2, 2.0, True, "3", torch.tensor(3.0)):  # a 0-d integer CPU tensor is an int (the scalar rule)
        refused("window_left", lambda bad=bad: plan(window_left=bad))
    # 0 and -1 are "off" only where an engine says so; in sliding_window (W keys) they are errors
    msg = refused("sliding_window", lambda: plan(sliding_window=0))
    assert "window_left" in msg
    refused("sliding_window", lambda: plan(sliding_window=-1))
    refused("window_left", lambda: fp8kv.paged_attention_one_shot(q, cache, step["block_tables"], step["seq_lens"],
                                                         query_start_loc=step["query_start_loc"], window_left=-5))


def test_int64_indices_are_converted_once_in_the_metadata():
    cache, q, step = _cache_and_step()
    slots = torch.tensor([7, 8, 9, 10, 17, 18])
    m32 = fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, slot_mapping=slots.int(),
                               **{k: v.int() for k, v in step.items()})
    step64 = {k: v.long() for k, v in step.items()}
    m64 = fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, slot_mapping=slots, **step64)
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        mine, given_ = getattr(m64, name), step64[name]
        assert mine.dtype == torch.int32 and torch.equal(mine, getattr(m32, name)) and mine.data_ptr() != \
            given_.data_ptr()
    assert torch.equal(fp8kv.paged_attention(q, cache, m64), fp8kv.paged_attention(q, cache, m32))
    big = step64 | {"block_tables": torch.tensor([[0, 1, 2], [3, 4, 2**31]])}
    refused("index tensors", lambda: fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, **big))
