"""TMA descriptors of a paged FP8 cache for the sm90 kernels' tile loads (one box per page).

Public for other in-tree backends (the Hopper backend's FP8 prefill loads its tiles through it).
A cache tensor ``[blocks, page, H, D]`` (NHD) or ``[blocks, H, page, D]`` (HND) of 1-byte codes is
described as a 4-d uint8 tensor map ``(D, X, Y, blocks)``, ``X, Y`` the KV head and the key in the
page ordered by stride (``head_inner``: the head's stride is the smaller), in the 128-byte swizzle;
a box is ``D`` codes of ``box_rows = min(page, block_n)`` keys of one head: a kernel copies a tile
of ``block_n`` keys as one box per page (per ``block_n`` keys of a longer page). A block coordinate
outside the map (the kernel's choice for a block id outside the cache) reads as zeros.
"""

from __future__ import annotations

import functools

from fp8kv.cache import KVCache
from fp8kv.errors import InvalidArgument

from .write import cache_strides


def paged_cache_maps(cache: KVCache, block_n: int) -> tuple[bytes, bytes, int, int] | None:
    """``(tmap_k, tmap_v, head_inner, box_rows)`` for tiles of ``block_n`` keys of ``cache`` (head size
    at most 128 bytes a row), or None where TMA cannot describe it and the kernel must copy with
    cp.async: a page that neither divides ``block_n`` keys nor is a multiple of them, K and V with
    their head and key strides in different orders, addresses and strides that are not multiples of
    16 bytes (TMA's alignment), or a tensor the driver's ``cuTensorMapEncodeTiled`` refuses (a
    dimension or stride beyond its limits)."""
    page, D = cache.block_size, cache.head_size
    if not (block_n % page == 0 or page % block_n == 0) or D * cache.key_cache.element_size() > 128:
        return None
    rows = min(page, block_n)
    strides = {which: cache_strides(cache, which) for which in ("key", "value")}
    head_inner = {which: kh <= kt for which, (_, kt, kh) in strides.items()}
    if head_inner["key"] != head_inner["value"]:
        return None
    inner = head_inner["key"]
    H, nblk = cache.num_kv_heads, cache.key_cache.shape[0]
    maps = []
    for which, t in (("key", cache.key_cache), ("value", cache.value_cache)):
        kb, kt, kh = strides[which]
        if t.data_ptr() % 16 or any(x % 16 or x <= 0 for x in (kb, kt, kh)):
            return None
        dims, st, box = ((D, H, page, nblk), (kh, kt, kb), (D, 1, rows, 1)) if inner else \
            ((D, page, H, nblk), (kt, kh, kb), (D, rows, 1, 1))
        try:
            maps.append(_tensor_map(t.data_ptr(), dims, st, box))
        except InvalidArgument:  # (the driver's limits: the cp.async loads serve the cache)
            return None
    return maps[0], maps[1], int(inner), rows


@functools.lru_cache(maxsize=512)
def _tensor_map(address: int, dims, strides, box) -> bytes:
    from . import runtime

    return runtime.tensor_map_uint8(address, dims, strides, box)
