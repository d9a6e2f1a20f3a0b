"""The pure-PyTorch reference backend: the oracle every backend is checked against.

Runs on any torch device. Writes define the bytes every backend must reproduce; attention
defines the values every backend must match within the documented tolerance
(:mod:`fp8kv.testing.tolerance`).

Attention is computed in float64 (float32 on devices without float64, e.g. MPS), from the
dequantized ``k' = code * k_scale`` and ``v'``: no intermediate can overflow for finite
input and finite positive scales anywhere in the float32 range, so the result is the exact
function up to float64 rounding, with two saturations that every backend shares:

* a logit (after ``softmax_scale`` and the soft-cap) is clamped to ``+-LOGIT_MAX`` =
  ``FLOAT32_MAX * ln 2`` (the largest natural-log logit whose base-2 form is a finite
  float32: kernels fold ``log2(e)`` into their logits);
* the output is clamped to the output dtype's finite range before the cast (it cannot be
  represented otherwise), and ``lse`` to the float32 range.

The opt-in FP8 attention mode (``metadata.options.fp8_attention``) is defined here too, by
:mod:`fp8kv.fp8_attention`: the e4m3 query, the codes times per-row scales, probabilities
relative to an integer base-2 maximum rounded to e4m3, their unrounded sum as the normaliser.

Finite input therefore never gives NaN or inf (NaN/inf *codes or scales* of visible keys still
propagate). Rows that see no key get ``out = 0`` and ``lse = -inf``.

Memory safety without the host checks (``validate=False``, ``FP8KV_CHECK=shapes``): the same
rules as the kernels, so that both agree on garbage metadata instead of raising:

* a write's slot is stored only if ``0 <= slot < num_slots``; others are skipped like padding;
* ``query_start_loc`` entries are clamped to ``[0, num_tokens]`` (a decreasing pair is an
  empty query); sequence lengths to ``[0, max_blocks * block_size]``;
* a key whose block id is outside ``[0, num_blocks)`` is masked out (not visible).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ._version import __version__
from .cache import KVCache
from .formats import divide_by_scale, quantize_scaled
from .fp8_attention import fp8_probabilities, quantize_query, round_probabilities
from .hookspecs import hookimpl
from .probe import DeviceInfo
from .request import BackendInfo, Request
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
    """Quantize ``key``/``value [num_tokens, H, D]`` into their slots; negative slots (padding) and
    slots ``>= cache.num_slots`` are skipped: an out-of-range slot is not written."""
    valid = (slot_mapping >= 0) & (slot_mapping < cache.num_slots)
    slots = slot_mapping[valid].to(torch.long)
    for which, x, dst in (("key", key, cache.key_cache), ("value", value, cache.value_cache)):
        codes = _quantize_rows(cache, which, x[valid], slots)
        _scatter(dst, cache.layout, cache.block_size, slots, codes)


def _gather_dequantized(cache: KVCache, which: str, slots: torch.Tensor, dtype: torch.dtype,
                        codes_only: bool = False) -> torch.Tensor:
    """Dequantized ``[len(slots), H, D]`` for the given (in-range) slots, computed in ``dtype``
    (``codes_only``: the FP8 values without their scales)."""
    c = cache.key_cache if which == "key" else cache.value_cache
    block, offset = slots // cache.block_size, slots % cache.block_size
    codes = c[block, offset] if cache.layout == "NHD" else c[block, :, offset]
    if codes_only:
        return codes.to(dtype)
    return codes.to(dtype) * cache.scale_per_slot(which)[slots].to(dtype)[..., None]


FLOAT32_MAX = 3.4028234663852886e38
LOGIT_MAX = FLOAT32_MAX * 0.6931471805599453
"""Logits saturate here (``FLOAT32_MAX / log2(e)``): their base-2 form stays a finite float32."""


def math_dtype(device: torch.device) -> torch.dtype:
    """The dtype the reference attention computes in on ``device``: float64 where supported."""
    return torch.float32 if device.type == "mps" else torch.float64


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

    ``out [T, Hq, D]`` gets ``softmax(cap(q.k' * scale)) v'`` computed in float64 (see the
    module docstring for the saturations), then the output dtype; ``lse [T, Hq]``, if given,
    the natural-log log-sum-exp of each row's logits. Garbage metadata (host checks off) is
    clamped and masked like the kernels do; rows outside every sequence's queries are untouched.
    """
    opts = metadata.options
    dev, dt = query.device, math_dtype(query.device)
    T, Hq, D = query.shape
    H = cache.num_kv_heads
    group = Hq // H
    bs, nb = cache.block_size, cache.num_blocks
    tables = metadata.block_tables
    max_keys = tables.shape[1] * bs
    # the tensors' values, as the kernels read them (the metadata's host copies may be the caller's, which
    # only steer how backends deal work and are not checked when validation is off)
    starts = metadata.query_start_loc.tolist()
    lens = metadata.seq_lens.tolist()
    out_max = torch.finfo(out.dtype).max
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = min(max(starts[i], 0), T), min(max(starts[i + 1], 0), T)
        if q_hi <= q_lo:
            continue
        seq_len = min(max(seq_len, 0), max_keys)
        pos = torch.arange(seq_len, device=dev)
        blocks = tables[i].to(torch.long)[pos // bs]
        present = (blocks >= 0) & (blocks < nb)  # an out-of-range block id: its keys are not visible
        slots = blocks.clamp(0, nb - 1) * bs + pos % bs
        if opts.fp8_attention:  # the FP8 mode (fp8kv.fp8_attention): codes, the e4m3 query, scales per row
            k = _gather_dequantized(cache, "key", slots, dt, codes_only=True)
            v = _gather_dequantized(cache, "value", slots, dt, codes_only=True).masked_fill(
                ~present[:, None, None], 0.0)
            q8, qs = quantize_query(query[q_lo:q_hi], opts.q_scale, H)
            q = q8.to(dt).view(q_hi - q_lo, H, group, D)
            row_scale = qs.to(dt).view(q_hi - q_lo, H, group).permute(1, 2, 0)[..., None]  # [H, group, ql, 1]
            row_scale = row_scale * cache.k_scale.to(dt).reshape(-1, 1, 1, 1) * opts.softmax_scale
            logits = torch.einsum("qhgd,khd->hgqk", q, k).mul_(row_scale)
        else:
            k = _gather_dequantized(cache, "key", slots, dt)  # [L, H, D]
            v = _gather_dequantized(cache, "value", slots, dt).masked_fill(~present[:, None, None], 0.0)
            q = query[q_lo:q_hi].to(dt).view(q_hi - q_lo, H, group, D)
            logits = torch.einsum("qhgd,khd->hgqk", q, k).mul_(opts.softmax_scale)  # [H, group, ql, L]
        if opts.logits_soft_cap is not None:
            logits = torch.tanh(logits.div_(opts.logits_soft_cap)).mul_(opts.logits_soft_cap)
        logits.clamp_(-LOGIT_MAX, LOGIT_MAX)  # NaN stays NaN
        mask = visible_mask(seq_len, q_hi - q_lo, opts.causal, opts.sliding_window, dev) & present[None, :]
        logits.masked_fill_(~mask, float("-inf"))
        if opts.fp8_attention:
            p, l_sum, m = fp8_probabilities(logits, mask)
            p8 = round_probabilities(p, opts.prob_scale)
            vs = cache.v_scale.to(dt).reshape(-1, 1, 1, 1) * opts.prob_scale
            o = torch.einsum("hgqk,khd->hgqd", p8, v) * (vs / torch.where(l_sum > 0, l_sum, 1.0))
            o = o.permute(2, 0, 1, 3).reshape(q_hi - q_lo, Hq, D)
            row_lse = torch.where(l_sum > 0, (m + torch.log2(l_sum)) * math.log(2.0), float("-inf"))[..., 0]
        else:
            probs = torch.softmax(logits, dim=-1).masked_fill_(~mask.any(-1)[:, None], 0.0)  # no key: 0, not NaN
            o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_hi - q_lo, Hq, D)
            row_lse = torch.logsumexp(logits, dim=-1) if lse is not None else None
        out[q_lo:q_hi] = o.clamp(-out_max, out_max).to(out.dtype)
        if lse is not None:  # -inf for rows without a visible key
            row = row_lse.reshape(Hq, q_hi - q_lo)
            lse[q_lo:q_hi] = row.clamp(max=FLOAT32_MAX).transpose(0, 1).to(lse.dtype)


class ReferenceBackend:
    """The reference as a plugin: serves every request on every device, slowly."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo("reference", __version__, priority=0,
                           description="pure PyTorch, float64 attention, any device (the oracle)", fast=False)

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse) -> None:
        paged_attention(query, cache, metadata, out, lse)
