"""Host launcher of the fused cache write (``csrc/write.cu``).

One warp per (token, head) row, 4 rows per CTA. The layout and any views reach the kernel as
(block, token-in-block, head) strides of K, V and their scales, in elements (one byte for the
codes), exactly as the Triton backend reads them; only head_size must be contiguous.
"""

from __future__ import annotations

import torch

from fp8kv.cache import KVCache

from . import runtime
from .variants import WRITE_THREADS, write_d_pad, write_variant

_IO = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cache_strides(cache: KVCache, which: str) -> tuple[int, int, int]:
    """(block, token-in-block, head) strides of the K (``which="key"``) or V cache tensor."""
    t = cache.key_cache if which == "key" else cache.value_cache
    s = t.stride()
    if t.dim() != 4 or (t.shape[3] > 1 and s[3] != 1):
        raise ValueError(f"{which} cache: got shape {tuple(t.shape)} strides {s}, expected a unit head_size stride")
    return (s[0], s[1], s[2]) if cache.layout == "NHD" else (s[0], s[2], s[1])


def scale_strides(cache: KVCache, which: str) -> tuple[int, int, int]:
    """(block, token, head) strides of ``k_scale``/``v_scale``: token_head ``[num_blocks, block_size,
    H]``'s own; per-head ``(0, 0, stride)``; per-tensor ``(0, 0, 0)``."""
    s = cache.k_scale if which == "key" else cache.v_scale
    if cache.scale_granularity == "token_head":
        return s.stride(0), s.stride(1), s.stride(2)
    if s.dim() == 0 or s.numel() == 1:
        return 0, 0, 0
    return 0, 0, s.stride(-1)


def _aligned(n: int, *values: int) -> bool:
    return all(v % n == 0 for v in values)


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``key``/``value [T, H, D]`` (contiguous) into ``cache`` at ``slot_mapping [T]``.

    Bit-exact with :func:`fp8kv.reference.write_kv`; slots outside ``[0, num_slots)`` are skipped
    by the kernel.
    """
    T, H, D = key.shape
    rows = T * H
    if rows == 0:
        return
    d_pad = write_d_pad(D)
    ept = d_pad // 32
    k_str, v_str = cache_strides(cache, "key"), cache_strides(cache, "value")
    ks_str, vs_str = scale_strides(cache, "key"), scale_strides(cache, "value")
    esize = key.element_size()
    vec = (D % ept == 0 and _aligned(ept * esize, key.data_ptr(), value.data_ptr())
           and _aligned(ept, cache.key_cache.data_ptr(), cache.value_cache.data_ptr(), *k_str, *v_str))
    variant = write_variant(cache.fmt.name, _IO[key.dtype], cache.scale_granularity == "token_head", d_pad,
                            vec=vec, slot64=slot_mapping.dtype == torch.int64)
    warps = WRITE_THREADS // 32
    r = runtime
    args = [r.ptr(key), r.ptr(value), r.ptr(slot_mapping), r.ptr(cache.key_cache), r.ptr(cache.value_cache),
            r.ptr(cache.k_scale), r.ptr(cache.v_scale), r.i64(rows), r.i32(H), r.i32(D), r.i64(cache.num_slots),
            r.i32(cache.block_size), *map(r.i64, (*k_str, *v_str, *ks_str, *vs_str))]
    runtime.launch(variant, "fp8kv_write_kv", key.device, (-(-rows // warps), 1, 1), WRITE_THREADS, args)
