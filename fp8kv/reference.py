"""The pure-PyTorch reference backend: the oracle every backend is checked against.

Runs on any torch device with float32 math. Writes define the bytes every backend
must reproduce; attention defines the values every backend must match within the
documented tolerance (:mod:`fp8kv.testing.tolerance`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._version import __version__
from .cache import KVCache
from .formats import divide_by_scale, quantize_scaled
from .hookspecs import BackendInfo, Request, hookimpl
from .probe import DeviceInfo
from .scales import token_head_scale

if TYPE_CHECKING:
    from .metadata import AttentionMetadata


def _scatter(cache_tensor: torch.Tensor, layout: str, block_size: int, slots: torch.Tensor,
             codes: torch.Tensor) -> None:
    """Store ``codes [n, H, D]`` (float8) at ``slots [n]`` of a cache tensor, in place."""
    dst = cache_tensor.view(torch.uint8)
    src = codes.view(torch.uint8)
    block, offset = slots // block_size, slots % block_size
    if layout == "NHD":
        dst[block, offset] = src
    else:
        dst[block, :, offset] = src


def _quantize_rows(cache: KVCache, which: str, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Quantize ``x [n, H, D]`` for ``slots``; for token_head also store the new scales."""
    if cache.scale_granularity == "token_head":
        scale = token_head_scale(x, cache.fmt)  # [n, H]
        store = cache.k_scale if which == "key" else cache.v_scale  # [num_blocks, block_size, H], any strides
        store[slots // cache.block_size, slots % cache.block_size] = scale
    else:
        scale = cache.scale_per_slot(which)[:1]  # [1, H]
    return quantize_scaled(divide_by_scale(x, scale[..., None]), cache.fmt)


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``key``/``value [num_tokens, H, D]`` into their slots; negative slots are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.long)
    for which, x, dst in (("key", key, cache.key_cache), ("value", value, cache.value_cache)):
        codes = _quantize_rows(cache, which, x[valid], slots)
        _scatter(dst, cache.layout, cache.block_size, slots, codes)


def _gather_dequantized(cache: KVCache, which: str, slots: torch.Tensor) -> torch.Tensor:
    """Dequantized float32 ``[len(slots), H, D]`` for the given slots."""
    c = cache.key_cache if which == "key" else cache.value_cache
    block, offset = slots // cache.block_size, slots % cache.block_size
    codes = c[block, offset] if cache.layout == "NHD" else c[block, :, offset]
    return codes.to(torch.float32) * cache.scale_per_slot(which)[slots][..., None]


def visible_mask(seq_len: int, q_len: int, causal: bool, sliding_window: int | None,
                 device: torch.device) -> torch.Tensor:
    """``[q_len, seq_len]`` bool: which key positions each query token may attend to.

    Query ``i`` sits at position ``seq_len - q_len + i``; causal: keys ``<=`` it; a
    window ``W`` keeps only keys ``> position - W``.
    """
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = (k_pos <= q_pos) if causal else torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    return mask


def paged_attention(query: torch.Tensor, cache: KVCache, metadata: AttentionMetadata, out: torch.Tensor,
                    lse: torch.Tensor | None = None) -> None:
    """Reference paged attention (see :meth:`fp8kv.hookspecs.BackendSpec.fp8kv_paged_attention`).

    ``out [T, Hq, D]`` gets ``softmax(q·k'·scale) v'`` in float32 (then the output dtype);
    ``lse [T, Hq]``, if given, the natural-log log-sum-exp of each row's logits.
    """
    opts = metadata.options
    group = query.shape[1] // cache.num_kv_heads
    starts = metadata.host_query_start_loc or metadata.query_start_loc.tolist()
    lens = metadata.host_seq_lens or metadata.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        pos = torch.arange(seq_len, device=query.device)
        slots = metadata.block_tables[i].to(torch.long)[pos // cache.block_size] * cache.block_size \
            + pos % cache.block_size
        k = _gather_dequantized(cache, "key", slots).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = _gather_dequantized(cache, "value", slots).repeat_interleave(group, dim=1)
        q = query[q_lo:q_hi].to(torch.float32)  # [ql, Hq, D]
        logits = torch.einsum("qhd,khd->hqk", q, k) * opts.softmax_scale
        if opts.logits_soft_cap is not None:
            logits = opts.logits_soft_cap * torch.tanh(logits / opts.logits_soft_cap)
        mask = visible_mask(seq_len, q_hi - q_lo, opts.causal, opts.sliding_window, query.device)
        logits = logits.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        if lse is not None:
            lse[q_lo:q_hi] = torch.logsumexp(logits, dim=-1).transpose(0, 1)


class ReferenceBackend:
    """The reference as a plugin: serves every request on every device, slowly."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo("reference", __version__, priority=0,
                           description="pure PyTorch, float32, any device (the oracle)", fast=False)

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse) -> None:
        paged_attention(query, cache, metadata, out, lse)
