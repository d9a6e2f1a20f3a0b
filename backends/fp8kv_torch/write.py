"""K and V quantized in one pass and scattered into the paged cache (bit-exact with the reference).

The reference quantizes K and V separately with the same primitives
(:func:`fp8kv.scales.token_head_scale`, :func:`fp8kv.formats.divide_by_scale`,
:func:`fp8kv.formats.quantize_scaled`); each element's code depends only on the element and
its own scale, so stacking K and V changes no byte and halves the number of operations.

Every layer of a step writes to the same slots: which rows are written and where
(:class:`SlotPlan`) is worked out once per slot tensor and reused while its values are unchanged
(compared with a snapshot: this backend serves CPU tensors, where reading them is no device sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8kv.cache import KVCache
from fp8kv.formats import divide_by_scale, quantize_scaled
from fp8kv.scales import token_head_scale

from . import native


@dataclass(frozen=True)
class SlotPlan:
    """Where one slot tensor's tokens go in caches of ``num_slots`` slots of ``block_size``.

    Attributes:
        rows: ``[m]`` int64 rows of the step's tokens that are written, or None for all of them.
        slots / block / offset: ``[m]`` int64 slot, block and offset of each written row.
        snapshot: a copy of the slot tensor the plan was made from.
    """

    rows: torch.Tensor | None
    slots: torch.Tensor
    block: torch.Tensor
    offset: torch.Tensor
    snapshot: torch.Tensor

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, num_slots: int, block_size: int) -> SlotPlan:
        keep = (slot_mapping >= 0) & (slot_mapping < num_slots)  # padding and out-of-range slots are skipped
        rows = None if bool(keep.all()) else keep.nonzero().view(-1)
        slots = (slot_mapping if rows is None else slot_mapping.index_select(0, rows)).to(torch.long)
        return cls(rows, slots, slots // block_size, slots % block_size, slot_mapping.clone())


_LAST: dict[tuple, SlotPlan] = {}


def slot_plan(cache: KVCache, slot_mapping: torch.Tensor) -> SlotPlan:
    """The :class:`SlotPlan` of ``slot_mapping`` for ``cache``'s geometry (the last one is kept)."""
    key = (cache.num_slots, cache.block_size)
    plan = _LAST.get(key)
    if plan is None or plan.snapshot.shape != slot_mapping.shape or plan.snapshot.dtype != slot_mapping.dtype \
            or not torch.equal(plan.snapshot, slot_mapping):
        plan = _LAST[key] = SlotPlan.build(slot_mapping, *key)
    return plan


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``key``/``value`` ``[n, H, D]`` into ``slot_mapping`` ``[n]``; slots < 0 or >= the
    cache's slots are skipped (never written)."""
    plan = slot_plan(cache, slot_mapping)
    if _write_native(cache, key, value, plan):
        return
    x = torch.stack((key, value))  # [2, n, H, D]
    if plan.rows is not None:
        x = x.index_select(1, plan.rows)
    token = cache.scale_granularity == "token_head"
    if token:
        scale = token_head_scale(x, cache.fmt)  # [2, m, H]
    else:
        scale = torch.stack((cache.k_scale.expand(cache.num_kv_heads),
                             cache.v_scale.expand(cache.num_kv_heads)))[:, None]  # [2, 1, H]
    codes = quantize_scaled(divide_by_scale(x, scale[..., None]), cache.fmt)
    _store(cache, plan, codes, scale if token else None)


def _write_native(cache: KVCache, key: torch.Tensor, value: torch.Tensor, plan: SlotPlan) -> bool:
    """The scales and the scaled, clamped float32 values of K and V from the C loop
    (:mod:`fp8kv_torch.native`: the same IEEE float32 operations as the reference's
    ``token_head_scale`` / ``divide_by_scale`` / clamp), then torch's FP8 cast and one scatter
    each for codes and scales. False (nothing written) without the C loops."""
    lib = native.library()
    if lib is None or key.shape[0] == 0:
        return False
    if plan.rows is not None:
        key, value = key.index_select(0, plan.rows), value.index_select(0, plan.rows)
    f32 = torch.float32
    key = key if key.dtype == f32 and key.is_contiguous() else key.to(f32).contiguous()  # exact
    value = value if value.dtype == f32 and value.is_contiguous() else value.to(f32).contiguous()
    n, H, D = key.shape
    token = cache.scale_granularity == "token_head"
    y = torch.empty((2, n, H, D), dtype=f32)
    scales = torch.empty((2, n, H), dtype=f32) if token else None
    ks, vs = (None, None) if token else (cache.k_scale, cache.v_scale)
    lib.fp8kv_prepare_write(key.data_ptr(), value.data_ptr(), n, H, D, int(token),
                            None if token else ks.data_ptr(), None if token else vs.data_ptr(),
                            0 if token or ks.dim() == 0 else ks.stride(0), float(cache.fmt.max),
                            None if scales is None else scales.data_ptr(), y.data_ptr())
    _store(cache, plan, y.to(cache.fmt.torch_dtype), scales)
    return True


def _store(cache: KVCache, plan: SlotPlan, codes: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Scatter the step's FP8 ``codes`` ``[2, m, H, D]`` (K, V) and, for token_head caches, their
    ``scales`` ``[2, m, H]`` to the plan's slots: one ``index_copy_`` each where the cache holds K and
    V as a pair (:func:`slot_pair`), else one per tensor."""
    codes = codes.view(torch.uint8)
    if scales is not None:
        pair = slot_pair(cache.scale_pair)
        if pair is not None:
            pair.index_copy_(1, plan.slots, scales)
        else:
            _scatter(cache.k_scale, plan, scales[0])
            _scatter(cache.v_scale, plan, scales[1])
    hnd = cache.layout == "HND"
    pair = None if hnd else slot_pair(cache.kv_pair)
    if pair is not None:
        pair.view(torch.uint8).index_copy_(1, plan.slots, codes)
    else:
        _scatter(cache.key_cache.view(torch.uint8), plan, codes[0], hnd=hnd)
        _scatter(cache.value_cache.view(torch.uint8), plan, codes[1], hnd=hnd)


def slot_pair(pair: torch.Tensor | None) -> torch.Tensor | None:
    """``[2, num_slots, ...]``: a K/V pair (:attr:`KVCache.kv_pair` / ``scale_pair``, ``[2, num_blocks,
    block_size, ...]``) with blocks and offsets merged into one slot dimension, as a view; None where
    there is no pair or they do not merge (e.g. a vLLM-style ``[num_blocks, 2, ...]`` tensor)."""
    if pair is None or pair.stride(1) != pair.stride(2) * pair.shape[2]:
        return None
    return pair.view(2, -1, *pair.shape[3:])


def _scatter(dst: torch.Tensor, plan: SlotPlan, src: torch.Tensor, *, hnd: bool = False) -> None:
    """``dst``'s rows at the plan's slots = ``src`` ``[m, ...]``: ``dst`` is ``[num_blocks, block_size,
    ...]`` (one row per slot: a single ``index_copy_`` when contiguous), or with ``hnd`` an HND cache
    ``[num_blocks, H, block_size, D]``."""
    if hnd:
        dst[plan.block, :, plan.offset] = src
    elif dst.is_contiguous():
        dst.view(-1, *dst.shape[2:]).index_copy_(0, plan.slots, src)
    else:
        dst[plan.block, plan.offset] = src
