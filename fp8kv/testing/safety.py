"""``check_memory_safety``: a backend stays inside its tensors when the host checks are off.

Engines skip fp8kv's value checks (``validate=False``, ``FP8KV_CHECK=shapes``) or replay CUDA
graphs over refilled metadata, so a backend may receive any slot, block id, length or query
offset. The hook contract (:mod:`fp8kv.hookspecs`) says what must happen then: out-of-range slots
are not written, out-of-range block ids are masked, lengths and query offsets are clamped, and
finite input gives finite output. This check builds a cache whose K, V (and per-token-head
scales) are the middle blocks of larger tensors filled with NaN bytes, then:

* writes with hostile slots (``num_slots``, ``num_slots + 5``, ``2^40``, ``-2^40``, padding):
  every byte of the parent tensors must equal what the reference writes (only the in-range
  slots change; the guard blocks around the cache never);
* attends with hostile metadata (block ids ``num_blocks``, ``2^31 - 1``, ``-5``; lengths past the
  table and negative; query offsets past the step; ``max_query_len`` 10^9): the guard blocks
  stay unchanged, nothing but an :class:`fp8kv.Fp8KVError` is raised, and the output is finite.

:func:`fp8kv.testing.check_backend` runs it once per backend that claims the request.
"""

from __future__ import annotations

import math

import torch

from .. import reference
from ..cache import KVCache
from ..formats import FORMATS
from ..planning import plan_attention

__all__ = ["as_bits", "check_memory_safety"]

H, D, BS, NB, GUARD = 2, 16, 4, 6, 2


def _guarded(device: torch.device, layout: str, granularity: str) -> tuple[KVCache, list[torch.Tensor]]:
    nan = FORMATS["fp8_e4m3"].nan_encodings[0]
    shape = (NB + 2 * GUARD, BS, H, D) if layout == "NHD" else (NB + 2 * GUARD, H, BS, D)
    parents = [torch.full(shape, nan, dtype=torch.uint8, device=device) for _ in range(2)]
    inner = slice(GUARD, GUARD + NB)
    if granularity == "token_head":
        parents += [torch.full((NB + 2 * GUARD, BS, H), math.nan, device=device) for _ in range(2)]
        scales = dict(k_scale=parents[2][inner], v_scale=parents[3][inner])
    else:
        scales = dict(k_scale=0.05, v_scale=0.07) if granularity == "tensor" else \
            dict(k_scale=torch.tensor([0.05, 0.02], device=device), v_scale=torch.tensor([0.07, 0.03], device=device))
    cache = KVCache.from_tensors(parents[0][inner], parents[1][inner], kv_dtype="fp8_e4m3", layout=layout,
                                 scale_granularity=granularity, **scales)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(NB * BS, H, D, generator=g).to(device)
    reference.write_kv(cache, k, -k, torch.arange(NB * BS, device=device))
    return cache, parents


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers (uint8 or int32), so that NaN payloads and -0 compare exactly."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def check_memory_safety(backend: str, device: torch.device | str, *, layout: str = "NHD",
                        granularity: str = "tensor", io_dtype: torch.dtype = torch.float32) -> None:
    """Raise AssertionError if ``backend`` touches memory outside a cache (or writes an
    out-of-range slot) when the host checks are off. See the module docstring."""
    dev = torch.device(device)
    where = f"backend {backend!r} with host checks off ({layout}, {granularity}, {io_dtype}): "
    # -- writes
    slots = torch.tensor([0, NB * BS, 5, NB * BS + 5, 2**40, -(2**40), -1, NB * BS - 1], device=dev)
    g = torch.Generator().manual_seed(1)
    key = (torch.randn(slots.numel(), H, D, generator=g) * 3).to(io_dtype).to(dev)
    value = (torch.randn(slots.numel(), H, D, generator=g) * 3).to(io_dtype).to(dev)
    tables = torch.arange(NB, dtype=torch.int32, device=dev).view(2, NB // 2)
    lens = torch.tensor([5, 7], dtype=torch.int32, device=dev)
    got, got_parents = _guarded(dev, layout, granularity)
    want, want_parents = _guarded(dev, layout, granularity)
    meta = plan_attention(got, num_q_heads=2 * H, query_dtype=io_dtype, block_tables=tables, seq_lens=lens,
                          slot_mapping=slots, validate=False, backend=backend)
    from ..api import write_kv

    write_kv(got, key, value, meta)
    reference.write_kv(want, key, value, slots)
    for a, b in zip(got_parents, want_parents, strict=True):
        if not torch.equal(as_bits(a), as_bits(b)):
            raise AssertionError(where + "write_kv with out-of-range slots changed bytes the reference leaves "
                                         "alone (an out-of-range slot must not be written)")
    # -- attention over hostile metadata
    from ..api import paged_attention

    snapshot = [p.clone() for p in got_parents]
    bad_tables = torch.tensor([[0, NB, 2**31 - 1], [-5, 1, 2]], dtype=torch.int32, device=dev)
    for lens2, qsl, T in ((torch.tensor([100, -3], dtype=torch.int32), None, 2),
                          (torch.tensor([9, 12], dtype=torch.int32), torch.tensor([0, 7, 3], dtype=torch.int32), 4)):
        query = torch.randn(T, 2 * H, D, generator=g).to(io_dtype).to(dev)
        meta = plan_attention(got, num_q_heads=2 * H, query_dtype=io_dtype, block_tables=bad_tables,
                              seq_lens=lens2.to(dev), query_start_loc=None if qsl is None else qsl.to(dev),
                              num_tokens=T, max_query_len=10**9, validate=False, backend=backend)
        out = paged_attention(query, got, meta)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if not bool(torch.isfinite(out).all()):
            raise AssertionError(where + "paged_attention over hostile metadata gave a non-finite output")
    for a, b in zip(got_parents, snapshot, strict=True):
        if not torch.equal(as_bits(a), as_bits(b)):
            raise AssertionError(where + "paged_attention over hostile metadata changed the cache or its guards")
