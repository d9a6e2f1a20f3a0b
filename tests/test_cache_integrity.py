"""A :class:`fp8kv.KVCache` stays what it was built as.

* **Scale values**: every way of building a cache (the constructor, ``dataclasses.replace``,
  ``from_tensors``, ``allocate``, ``slice_heads``, ``to``, ``clone``) refuses a static scale (tensor
  or head granularity) that is zero, negative, NaN or inf, naming ``k_scale`` or ``v_scale``.
  ``token_head`` scale values are not read (write_kv stores them with the codes).
* **Tensors changed in place**: a cache tensor re-pointed (``set_``, ``.data =``), resized
  (``resize_``, ``untyped_storage().resize_``) or restrided (``as_strided_``) after the cache was
  built is refused by every operation, planned and one-shot, with value checks on
  (``FP8KV_CHECK=full``) and off (``shapes``), by every backend the CPU runs (the reference, the
  torch backend, Triton through its interpreter): a named :class:`fp8kv.InvalidArgument` before
  any backend is called, and not one byte changed, in the cache, in the guard blocks around it
  or in the canary bytes around the memory a tensor was re-pointed to.
* **One-shot argument names**: each argument of ``paged_attention_one_shot`` and
  ``write_kv_one_shot`` is checked on its own (type, dtype, rank, device) before the counts that
  relate them, so the error names the argument that is wrong.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import math
import os
import timeit
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fp8kv
from fp8kv import InvalidArgument, KVCache
from fp8kv.formats import FORMATS
from fp8kv.probe import probe
from fp8kv.registry import registry
from fp8kv.request import Request

NB, BS, H, HQ, D = 4, 4, 2, 4, 32  # blocks, block size, KV heads, query heads, head size (hopper's least)
G = NB  # guard blocks on each side: a write up to NB blocks past a one-block tensor lands in them
BLOCK = BS * H * D  # bytes of one block (NHD, float8)
NAN_CODE = FORMATS["fp8_e4m3"].nan_encodings[0]
CANARY = 0x5A

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
_NEEDS_INTERPRETER = pytest.mark.skipif(importlib.util.find_spec("triton") is None or not _INTERPRETED,
                                        reason="needs the Triton CPU interpreter")
BACKENDS = ["reference", "torch", pytest.param("triton", marks=_NEEDS_INTERPRETER),
            pytest.param("hopper", marks=_NEEDS_INTERPRETER)]


def named(argument: str, fn: Callable[[], object]) -> str:
    """``fn()`` raises InvalidArgument whose message names ``argument`` first; returns the message."""
    with pytest.raises(InvalidArgument) as info:
        fn()
    msg = str(info.value)
    assert msg.split(": got ")[0] == argument, f"expected an error naming {argument!r}, got: {msg}"
    return msg


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


# ---------------------------------------------------------------------------------- scale values
BAD_SCALES = [0.0, -1.0, math.nan, math.inf, -math.inf]
BAD_IDS = ["zero", "negative", "nan", "inf", "-inf"]


def _bad_static(granularity: str, bad: float) -> torch.Tensor:
    """A float32 static scale with one bad value: ``()`` (tensor) or ``(H,)`` (head, the last head bad)."""
    if granularity == "tensor":
        return torch.tensor(bad)
    return torch.tensor([0.5] * (H - 1) + [bad])


@pytest.mark.parametrize("bad", BAD_SCALES, ids=BAD_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_constructor_and_replace_refuse_bad_static_scale_values(which, granularity, bad):
    cache = KVCache.allocate(NB, BS, H, D, scale_granularity=granularity)
    scale = _bad_static(granularity, bad)
    named(which, lambda: dataclasses.replace(cache, **{which: scale}))
    scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale, which: scale}
    named(which, lambda: KVCache(cache.key_cache, cache.value_cache, scales["k_scale"], scales["v_scale"],
                                 cache.fmt, cache.layout, granularity))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=BAD_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_from_tensors_and_allocate_refuse_bad_static_scale_values(which, granularity, bad):
    codes = torch.zeros(2, NB, BS, H, D, dtype=torch.float8_e4m3fn)
    for scale in (_bad_static(granularity, bad), bad) if granularity == "tensor" else (_bad_static(granularity, bad),):
        named(which, lambda scale=scale: KVCache.from_tensors(codes[0], codes[1], scale_granularity=granularity,
                                                              **{which: scale}))
        named(which, lambda scale=scale: KVCache.allocate(NB, BS, H, D, scale_granularity=granularity,
                                                          **{which: scale}))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=BAD_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_rebuilds_refuse_a_scale_set_bad_in_place(which, granularity, bad):
    """An engine's zero-copy scale written bad in place after the build: slice_heads, to and clone,
    which build a new cache, refuse it by name."""
    cache = KVCache.from_tensors(torch.zeros(NB, BS, H, D, dtype=torch.float8_e4m3fn),
                                 torch.zeros(NB, BS, H, D, dtype=torch.float8_e4m3fn), scale_granularity=granularity,
                                 k_scale=_bad_static(granularity, 0.5), v_scale=_bad_static(granularity, 0.5))
    getattr(cache, which)[...] = _bad_static(granularity, bad)
    named(which, lambda: cache.slice_heads(H - 1, H))
    named(which, lambda: cache.to("cpu"))
    named(which, cache.clone)


def test_good_static_scales_and_garbage_token_head_scales_are_accepted():
    """Tiny and huge finite positive scales pass; token_head scale values are never read, since
    write_kv stores a slot's scales with its codes (fresh engine memory may hold anything)."""
    for scale in (2.0**-126, 1e-45, 3.4e38):
        KVCache.allocate(NB, BS, H, D, k_scale=scale, v_scale=torch.tensor([scale] * H), scale_granularity="head")
    garbage = torch.full((2, NB, BS, H), math.nan)
    garbage[1, 0, 0, 0] = -1.0
    cache = KVCache.allocate(NB, BS, H, D, scale_granularity="token_head", k_scale=garbage[0], v_scale=garbage[1])
    key = torch.randn(NB * BS, H, D)
    fp8kv.write_kv_one_shot(cache, key, -key, torch.arange(NB * BS), backend="reference")
    assert bool(torch.isfinite(garbage).all()) and bool((garbage > 0).all())  # every slot's scales written


def test_meta_caches_build_without_reading_scales():
    meta = torch.empty(2, NB, BS, H, D, dtype=torch.float8_e4m3fn, device="meta")
    cache = KVCache.from_tensors(meta[0], meta[1], scale_granularity="head")
    dataclasses.replace(cache, k_scale=torch.empty(H, device="meta"))


# ------------------------------------------------------------------------- tensors changed in place
@dataclass
class Guarded:
    """A cache whose K/V (and token_head scales) are the middle NB blocks of parents with G guard
    blocks of NaN bytes on each side; ``watched`` are all tensors whose bytes must never change."""

    cache: KVCache
    parents: dict[str, torch.Tensor]
    watched: dict[str, torch.Tensor]
    snapshot: dict[str, torch.Tensor] | None = None
    repairs: list[Callable[[], object]] = dataclasses.field(default_factory=list)

    def repair(self) -> None:
        """Give a freed storage bytes again, so that printing the cache (a failure report) reads
        only memory it owns."""
        for repair in self.repairs:
            repair()

    def freeze(self) -> None:
        self.snapshot = {name: as_bits(t).clone() for name, t in self.watched.items()}

    def watch(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Watch ``t`` too, from its bytes now."""
        self.watched[name] = t
        self.snapshot[name] = as_bits(t).clone()
        return t

    def assert_unchanged(self) -> None:
        for name, t in self.watched.items():
            changed = int((as_bits(t) != self.snapshot[name]).sum())
            assert changed == 0, f"{changed} bytes of {name} changed"


def guarded(granularity: str = "tensor", device: str = "cpu") -> Guarded:
    parents = {name: torch.full((NB + 2 * G, BS, H, D), NAN_CODE, dtype=torch.uint8, device=device)
               for name in ("key", "value")}
    if granularity == "token_head":
        parents |= {name: torch.full((NB + 2 * G, BS, H), math.nan, device=device) for name in ("k_scale", "v_scale")}
        scales = dict(k_scale=parents["k_scale"][G:G + NB], v_scale=parents["v_scale"][G:G + NB])
    else:
        scales = dict(k_scale=0.05, v_scale=0.07)
    cache = KVCache.from_tensors(parents["key"][G:G + NB], parents["value"][G:G + NB], kv_dtype="fp8_e4m3",
                                 scale_granularity=granularity, **scales)
    g = torch.Generator().manual_seed(0)
    key = torch.randn(NB * BS, H, D, generator=g).to(device)
    fp8kv.write_kv_one_shot(cache, key, -key, torch.arange(NB * BS, device=device), backend="reference")
    guarded_cache = Guarded(cache, parents, dict(parents))
    guarded_cache.freeze()
    return guarded_cache


def _arena(device: torch.device, num_blocks: int, dtype: torch.dtype = torch.uint8, block: int = BLOCK
           ) -> torch.Tensor:
    """Canary memory: ``num_blocks`` blocks between G guard blocks on each side."""
    fill = -7.0 if dtype == torch.float32 else CANARY
    return torch.full(((num_blocks + 2 * G) * block,), fill, dtype=dtype, device=device)


NHD_STRIDES = (BLOCK, H * D, D, 1)


def set_one_block(g: Guarded) -> str:
    """V re-pointed to a one-block storage inside canary memory (a write to blocks 1.. lands in it)."""
    arena = g.watch("arena", _arena(g.cache.device, 1))
    g.cache.value_cache.set_(arena.untyped_storage(), G * BLOCK, (1, BS, H, D), NHD_STRIDES)
    return "cache.value_cache"


def set_same_geometry(g: Guarded) -> str:
    """K re-pointed to other memory of the very same shape and strides (only the address differs)."""
    arena = g.watch("arena", _arena(g.cache.device, NB))
    g.cache.key_cache.set_(arena.untyped_storage(), G * BLOCK, (NB, BS, H, D), NHD_STRIDES)
    return "cache.key_cache"


def set_data(g: Guarded) -> str:
    """``.data =`` a one-block tensor inside canary memory."""
    arena = g.watch("arena", _arena(g.cache.device, 1))
    g.cache.value_cache.data = arena[G * BLOCK:(G + 1) * BLOCK].view(torch.float8_e4m3fn).view(1, BS, H, D)
    return "cache.value_cache"


def set_empty(g: Guarded) -> str:
    g.cache.key_cache.set_()
    return "cache.key_cache"


def resize_smaller(g: Guarded) -> str:
    g.cache.value_cache.resize_(1, BS, H, D)
    return "cache.value_cache"


def resize_larger(g: Guarded) -> str:
    """The tensor grows past its storage, which torch then moves (the parent follows it)."""
    g.cache.value_cache.resize_(NB + 2 * G + 3, BS, H, D)
    return "cache.value_cache"


def as_strided_blocks_apart(g: Guarded) -> str:
    """Same shape, blocks two apart: blocks 2.. would reach the guard blocks after the cache."""
    g.cache.value_cache.as_strided_((NB, BS, H, D), (2 * BLOCK, H * D, D, 1), G * BLOCK)
    return "cache.value_cache"


def _resize_storage(g: Guarded, nbytes: int) -> str:
    """V's storage itself resized (its old bytes freed: they are not watched any more)."""
    del g.watched["value"]
    storage = g.cache.value_cache.untyped_storage()
    old = storage.nbytes()
    g.repairs.append(lambda: storage.resize_(old))
    storage.resize_(nbytes)
    return "cache.value_cache"


def storage_freed(g: Guarded) -> str:
    return _resize_storage(g, 0)


def storage_shrunk(g: Guarded) -> str:
    return _resize_storage(g, BLOCK)


def scale_set_one_block(g: Guarded) -> str:
    """token_head: the K scales re-pointed to one block of canary float32 memory."""
    arena = g.watch("arena", _arena(g.cache.device, 1, torch.float32, BS * H))
    g.cache.k_scale.set_(arena.untyped_storage(), G * BS * H, (1, BS, H), (BS * H, H, 1))
    return "cache.k_scale"


MUTATIONS = [set_one_block, set_same_geometry, set_data, set_empty, resize_smaller, resize_larger,
             as_strided_blocks_apart, storage_freed, storage_shrunk, scale_set_one_block]


def _granularity(mutation) -> str:
    return "token_head" if mutation is scale_set_one_block else "tensor"


def served_operations(backend: str, cache: KVCache, io_dtype: torch.dtype) -> dict[str, dict | None]:
    """The operations ``backend`` serves for ``cache``, each with the plan keywords it needs
    (the hopper backend's attention is its FP8 mode; None: no plan, the backend serves no
    attention here); empty when it serves none."""
    device = probe(cache.device)
    answers = lambda request: registry().explain(request, device).get(backend, "not installed")  # noqa: E731
    attention = next((options for options in ({}, {"fp8_attention": True})
                      if answers(Request.for_attention(cache.spec, io_dtype, frozenset(options))) is None), None)
    served = {}
    if answers(Request.for_write(cache.spec, io_dtype)) is None:
        served["write_kv_one_shot"] = attention
        if attention is not None:
            served["write_kv"] = attention
    if attention is not None:
        served |= {"paged_attention": attention, "paged_attention_one_shot": attention}
    return served


def decode_step(cache: KVCache, backend: str, io_dtype: torch.dtype, options: dict | None) -> dict:
    """A decode step over every block: two sequences of NB/2 blocks, one new token each (planned
    with ``options`` unless they are None)."""
    g = torch.Generator().manual_seed(1)
    dev = cache.device
    tables = torch.arange(NB, dtype=torch.int32, device=dev).view(2, NB // 2)
    lens = torch.tensor([NB // 2 * BS] * 2, dtype=torch.int32, device=dev)
    slots = torch.tensor([NB // 2 * BS - 1, NB * BS - 1], device=dev)
    return dict(query=torch.randn(2, HQ, D, generator=g).to(dev, io_dtype),
                key=(torch.randn(2, H, D, generator=g) * 3).to(dev, io_dtype),
                value=(torch.randn(2, H, D, generator=g) * 3).to(dev, io_dtype),
                block_tables=tables, seq_lens=lens, slot_mapping=slots, options=options,
                meta=None if options is None else fp8kv.plan_attention(
                    cache, num_q_heads=HQ, query_dtype=io_dtype, block_tables=tables, seq_lens=lens,
                    slot_mapping=slots, backend=backend, **options))


OPERATIONS: dict[str, Callable[[KVCache, dict, str], object]] = {
    "write_kv": lambda c, s, b: fp8kv.write_kv(c, s["key"], s["value"], s["meta"]),
    "write_kv_one_shot": lambda c, s, b: fp8kv.write_kv_one_shot(c, s["key"], s["value"], s["slot_mapping"],
                                                                 backend=b),
    "paged_attention": lambda c, s, b: fp8kv.paged_attention(s["query"], c, s["meta"]),
    "paged_attention_one_shot": lambda c, s, b: fp8kv.paged_attention_one_shot(
        s["query"], c, s["block_tables"], s["seq_lens"], backend=b, **s["options"]),
}


def _operations_or_skip(backend: str, granularity: str, device: str, io_dtype: torch.dtype
                        ) -> dict[str, dict | None]:
    served = served_operations(backend, guarded(granularity, device).cache, io_dtype)
    if not served:
        reasons = registry().explain(Request.for_write(guarded(granularity, device).cache.spec, io_dtype),
                                     probe(torch.device(device)))
        pytest.skip(f"{backend} serves no operation on a {granularity} cache here: {reasons.get(backend)}")
    return served


def check_intact_cache_served(backend: str, granularity: str, device: str, io_dtype: torch.dtype) -> None:
    """The control: every operation ``backend`` serves runs on an untouched guarded cache and
    leaves its guard blocks alone."""
    for operation_name, options in _operations_or_skip(backend, granularity, device, io_dtype).items():
        g = guarded(granularity, device)
        step = decode_step(g.cache, backend, io_dtype, options)
        OPERATIONS[operation_name](g.cache, step, backend)
        if g.cache.device.type == "cuda":
            torch.cuda.synchronize()
        for name in ("key", "value"):
            guards = torch.cat([g.parents[name][:G], g.parents[name][G + NB:]])
            assert bool((guards == NAN_CODE).all()), f"{operation_name}: a guard byte of {name} changed"


def check_changed_cache_refused(backend: str, mutation, device: str, io_dtype: torch.dtype) -> None:
    """Every operation ``backend`` serves refuses the cache after ``mutation``, naming the tensor,
    and no byte changes anywhere (cache, guard blocks, canary memory)."""
    granularity = _granularity(mutation)
    for operation_name, options in _operations_or_skip(backend, granularity, device, io_dtype).items():
        g = guarded(granularity, device)
        step = decode_step(g.cache, backend, io_dtype, options)  # planned before the change, as an engine plans
        try:
            tensor = mutation(g)
            msg = named(tensor, lambda g=g, step=step, operation=OPERATIONS[operation_name]:
                        operation(g.cache, step, backend))
            assert "after the cache was built" in msg and "KVCache" in msg, f"{operation_name}: {msg}"
            if g.cache.device.type == "cuda":
                torch.cuda.synchronize()
            g.assert_unchanged()
        finally:
            g.repair()


@pytest.mark.parametrize("check", ["full", "shapes"])
@pytest.mark.parametrize("granularity", ["tensor", "token_head"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_operations_serve_an_intact_guarded_cache(backend, granularity, check, monkeypatch):
    monkeypatch.setenv("FP8KV_CHECK", check)
    check_intact_cache_served(backend, granularity, "cpu", torch.float32)


@pytest.mark.parametrize("check", ["full", "shapes"])
@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("backend", BACKENDS)
def test_operations_refuse_a_cache_tensor_changed_in_place(backend, mutation, check, monkeypatch):
    monkeypatch.setenv("FP8KV_CHECK", check)
    check_changed_cache_refused(backend, mutation, "cpu", torch.float32)


def test_restoring_the_tensor_makes_the_cache_intact_again():
    g = guarded()
    v = g.cache.value_cache
    storage, offset, shape, stride = v.untyped_storage(), v.storage_offset(), v.shape, v.stride()
    set_one_block(g)
    named("cache.value_cache", g.cache.check_intact)
    v.set_(storage, offset, shape, stride)
    g.cache.check_intact()


@pytest.mark.parametrize("method", ["slice_heads", "clone", "to", "copy_", "copy_from"])
def test_the_cache_methods_refuse_a_changed_cache_too(method):
    """Deriving from, or copying into or out of, a cache whose tensors were changed refuses by name."""
    g = guarded()
    set_one_block(g)
    other = guarded().cache
    call = {"slice_heads": lambda: g.cache.slice_heads(0, 1), "clone": g.cache.clone, "to": lambda: g.cache.to("cpu"),
            "copy_": lambda: g.cache.copy_(other), "copy_from": lambda: other.copy_(g.cache)}[method]
    named("other.value_cache" if method == "copy_from" else "cache.value_cache", call)
    g.assert_unchanged()


def test_copy_refuses_a_cache_of_another_spec():
    cache = KVCache.allocate(NB, BS, H, D)
    before = cache.clone()
    for other in (KVCache.allocate(1, BS, H, D), KVCache.allocate(NB, BS, H, D, kv_dtype="fp8_e5m2"),
                  KVCache.allocate(NB, BS, H, D, layout="HND"), KVCache.allocate(NB, BS, H, D // 2),
                  KVCache.allocate(NB, BS, H, D, scale_granularity="head"), cache.key_cache):
        named("other", lambda other=other: cache.copy_(other))
    assert cache.same_bytes(before)
    cache.copy_(KVCache.allocate(NB, BS, H, D, k_scale=0.5))  # the same spec: copied
    assert float(cache.k_scale) == 0.5


def test_to_copies_and_names_a_device_it_does_not_serve():
    cache = KVCache.allocate(NB, BS, H, D)
    moved = cache.to("cpu")
    assert not any(fp8kv.cache.may_share_bytes(a, b) for a, b in zip(
        (moved.key_cache, moved.value_cache, moved.k_scale, moved.v_scale),
        (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale), strict=True))
    assert moved.same_bytes(cache)
    for device in ("mps", 5, "xla", None if torch.cuda.is_available() else "cuda"):
        if device is not None:
            named("device", lambda device=device: cache.to(device))


def test_slice_heads_refuses_bool_bounds():
    cache = KVCache.allocate(NB, BS, H, D)
    named("start", lambda: cache.slice_heads(False, True))
    named("stop", lambda: cache.slice_heads(0, True))
    named("start/stop", lambda: cache.slice_heads(1, 1))
    named("start/stop", lambda: cache.slice_heads(0, H + 1))
    assert cache.slice_heads(np.int64(0), torch.tensor(1)).num_kv_heads == 1  # the int scalar rule


def test_unchecked_caches_record_their_tensors_too():
    c = KVCache.allocate(NB, BS, H, D)
    rebuilt = KVCache.unchecked(c.key_cache, c.value_cache, c.k_scale, c.v_scale, c.fmt, c.layout,
                                c.scale_granularity, c.spec)
    rebuilt.check_intact()
    c.key_cache.resize_(1, BS, H, D)
    named("cache.key_cache", rebuilt.check_intact)


def test_a_cache_keeps_the_memory_it_was_built_over_alive():
    """After ``set_`` elsewhere, the original bytes live as long as the cache (a CUDA graph captured
    on their addresses keeps writing into memory the cache owns), and no longer."""
    buffer = np.zeros((2, NB, BS, H, D), dtype=np.uint8)
    alive = weakref.ref(buffer)
    codes = torch.from_numpy(buffer)
    del buffer
    cache = KVCache.from_tensors(codes[0], codes[1], kv_dtype="fp8_e4m3")
    del codes
    cache.key_cache.set_(torch.zeros(1, dtype=torch.float8_e4m3fn))
    cache.value_cache.set_(torch.zeros(1, dtype=torch.float8_e4m3fn))
    gc.collect()
    assert alive() is not None, "the memory the cache was built over was freed while the cache lives"
    del cache
    gc.collect()
    assert alive() is None


def test_the_integrity_check_costs_about_a_microsecond():
    """Host integers only: a few microseconds at most even on a loaded CI machine (about 2 us measured)."""
    cache = KVCache.allocate(64, 16, 8, 128, scale_granularity="token_head")
    per_call = min(timeit.repeat(cache.check_intact, number=2000, repeat=5)) / 2000
    assert per_call < 20e-6, f"check_intact took {per_call * 1e6:.1f} us per call"


# ------------------------------------------------------------------------ one-shot argument names
def _one_shot_cache() -> KVCache:
    return KVCache.allocate(NB, BS, H, D)


def _attention_args(**changes) -> tuple[KVCache, dict]:
    """A valid decode call of two sequences (two query tokens), with ``changes`` applied."""
    args = dict(query=torch.randn(2, HQ, D), block_tables=torch.zeros(2, 2, dtype=torch.int32),
                seq_lens=torch.ones(2, dtype=torch.int32))
    args.update(changes)
    return _one_shot_cache(), args


def _attend(cache: KVCache, args: dict):
    args = dict(args)
    return fp8kv.paged_attention_one_shot(args.pop("query"), cache, args.pop("block_tables"), args.pop("seq_lens"),
                                          backend="reference", **args)


ATTENTION_REFUSALS = {
    "query": [torch.randn(2, HQ * D).tolist(), torch.randn(2, HQ * D), torch.randn(2, HQ, D).to(torch.int32),
              torch.randn(2, HQ, D, device="meta"), torch.randn(2, HQ, D + 1), torch.randn(2, H + 1, D),
              torch.randn(3, HQ, D)],
    "block_tables": [[[0, 0], [0, 0]], torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, 2, dtype=torch.int32),
                     torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.int32, device="meta"),
                     torch.zeros(3, 2, dtype=torch.int32)],
    "seq_lens": [[1, 1], torch.ones(2, 1, dtype=torch.int32), torch.tensor(1, dtype=torch.int32), torch.ones(2),
                 torch.ones(2, dtype=torch.int32, device="meta")],
    "query_start_loc": [[0, 1, 2], torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([0.0, 1.0, 2.0]),
                        torch.tensor([0, 1], dtype=torch.int32)],
    "out": [torch.empty(2, HQ * D), torch.empty(2, HQ, D, dtype=torch.float16), torch.empty(2, HQ, D).tolist(),
            torch.empty(2, HQ, D, device="meta"), torch.empty(3, HQ, D)],
}


@pytest.mark.parametrize("argument", list(ATTENTION_REFUSALS))
def test_one_shot_attention_names_the_wrong_argument(argument):
    for bad in ATTENTION_REFUSALS[argument]:
        cache, args = _attention_args(**{argument: bad})
        named(argument, lambda cache=cache, args=args: _attend(cache, args))


@pytest.mark.parametrize("argument", ["block_tables", "seq_lens", "query_start_loc", "out"])
def test_one_shot_attention_names_a_wrong_rank_before_a_count_that_disagrees(argument):
    """Three query tokens for two sequences (a count that disagrees) and one argument of the wrong
    rank or kind: the argument is named, not the query."""
    bad = {"block_tables": torch.zeros(2, dtype=torch.int32), "seq_lens": [1, 1],
           "query_start_loc": torch.zeros(1, 3, dtype=torch.int32), "out": torch.empty(3, HQ * D)}[argument]
    cache, args = _attention_args(query=torch.randn(3, HQ, D), **{argument: bad})
    named(argument, lambda: _attend(cache, args))


def test_one_shot_attention_names_seq_lens_of_two_dimensions_for_two_tokens():
    cache, args = _attention_args(seq_lens=torch.ones(2, 2, dtype=torch.int32))
    named("seq_lens", lambda: _attend(cache, args))
    cache, args = _attention_args(seq_lens=torch.ones(1, 2, dtype=torch.int32))
    named("seq_lens", lambda: _attend(cache, args))


def test_one_shot_attention_names_the_cache():
    for bad in (None, _one_shot_cache().key_cache, "cache"):
        _, args = _attention_args()
        named("cache", lambda bad=bad, args=args: _attend(bad, args))


def test_one_shot_calls_accept_what_they_name():
    """The control for the refusals above: the valid calls run."""
    cache, args = _attention_args()
    _attend(cache, args)
    _attend(cache, dict(args, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                        out=torch.empty(2, HQ, D), block_tables=args["block_tables"].long()))
    fp8kv.write_kv_one_shot(cache, *_write_args()[1:], backend="reference")


def _write_args(**changes) -> tuple:
    args = dict(key=torch.randn(3, H, D), value=torch.randn(3, H, D), slot_mapping=torch.arange(3))
    args.update(changes)
    return _one_shot_cache(), args["key"], args["value"], args["slot_mapping"]


WRITE_REFUSALS = {
    "key": [torch.randn(3, H, D).tolist(), torch.randn(3, H * D), torch.randn(3, H, D).to(torch.int32),
            torch.randn(3, H, D, device="meta"), torch.randn(3, H + 1, D), torch.randn(3, H, D + 1)],
    "value": [None, torch.randn(3, H * D), torch.randn(3, H, D).to(torch.float16), torch.randn(2, H, D),
              torch.randn(3, H, D, device="meta")],
    "slot_mapping": [[0, 1, 2], torch.arange(3).view(3, 1), torch.arange(3).view(1, 3), torch.tensor(0),
                     torch.arange(3.0), torch.arange(3, device="meta"), torch.arange(4)],
}


@pytest.mark.parametrize("argument", list(WRITE_REFUSALS))
def test_one_shot_write_names_the_wrong_argument(argument):
    for bad in WRITE_REFUSALS[argument]:
        cache, key, value, slots = _write_args(**{argument: bad})
        before = cache.clone()
        named(argument, lambda cache=cache, key=key, value=value, slots=slots:
              fp8kv.write_kv_one_shot(cache, key, value, slots, backend="reference"))
        assert cache.same_bytes(before)


def test_one_shot_write_names_the_cache():
    _, key, value, slots = _write_args()
    for bad in (None, _one_shot_cache().key_cache):
        named("cache", lambda bad=bad: fp8kv.write_kv_one_shot(bad, key, value, slots, backend="reference"))
