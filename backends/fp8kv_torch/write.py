"""K and V quantized in one pass and scattered into the paged cache (bit-exact with the reference).

The reference quantizes K and V separately with the same primitives
(:func:`fp8kv.scales.token_head_scale`, :func:`fp8kv.formats.divide_by_scale`,
:func:`fp8kv.formats.quantize_scaled`); each element's code depends only on the element and
its own scale, so stacking K and V changes no byte and halves the number of operations.
"""

from __future__ import annotations

import torch

from fp8kv.cache import KVCache
from fp8kv.formats import divide_by_scale, quantize_scaled
from fp8kv.scales import token_head_scale


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``key``/``value`` ``[n, H, D]`` into ``slot_mapping`` ``[n]``; slots < 0 or >= the
    cache's slots are skipped (never written)."""
    rows = ((slot_mapping >= 0) & (slot_mapping < cache.num_slots)).nonzero().view(-1)
    slots = slot_mapping.index_select(0, rows).to(torch.long)
    x = torch.stack((key, value)).index_select(1, rows)  # [2, n, H, D]
    block, offset = slots // cache.block_size, slots % cache.block_size
    if cache.scale_granularity == "token_head":
        scale = token_head_scale(x, cache.fmt)  # [2, n, H]
        cache.k_scale[block, offset] = scale[0]
        cache.v_scale[block, offset] = scale[1]
    else:
        scale = torch.stack((cache.k_scale.expand(cache.num_kv_heads),
                             cache.v_scale.expand(cache.num_kv_heads)))[:, None]  # [2, 1, H]
    codes = quantize_scaled(divide_by_scale(x, scale[..., None]), cache.fmt).view(torch.uint8)
    for dst, src in ((cache.key_cache, codes[0]), (cache.value_cache, codes[1])):
        raw = dst.view(torch.uint8)
        if cache.layout == "NHD":
            raw[block, offset] = src
        else:
            raw[block, :, offset] = src
