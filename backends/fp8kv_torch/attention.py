"""Paged attention over the FP8 cache in a few batched PyTorch operations per layer.

What the reference does sequence by sequence (its semantics: float64 math, saturated logits,
rows without a visible key give 0), done for every sequence at once:

* per step (:class:`StepIndex`, built at the first layer and shared by the others): which
  cache block and offset holds each key position of each sequence, which keys each query
  may see (length, causality, sliding window, absent blocks) and where each query row sits;
* per layer: one gather of the K and V codes (and token_head scales) of every sequence,
  dequantization, two batched matrix products and a masked softmax.

The index is rebuilt whenever the metadata's buffers were refilled in place with other values
(``AttentionMetadata.update``), so a replayed step never reads a stale index.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fp8kv.cache import KVCache
from fp8kv.formats import Fp8Format
from fp8kv.metadata import AttentionMetadata
from fp8kv.reference import FLOAT32_MAX, LOGIT_MAX, math_dtype


@dataclass(frozen=True)
class StepIndex:
    """One step's gather indices and masks (B sequences, Q = max_query_len, L = key positions).

    Attributes:
        block / offset: ``[B, L]`` int64: cache block (clamped into the cache) and offset of
            key position ``l`` of sequence ``b``.
        present: ``[B, L]`` bool: the position is below the sequence's length and its block id
            is inside the cache (else its K/V are not read: they may hold anything, NaN included).
        visible: ``[B, Q, L]`` bool: query ``j`` of sequence ``b`` may attend to key ``l``.
        rows: ``[B, Q]`` int64: the query row (in ``query``/``out``) of query ``j`` of sequence ``b``.
        real: ``[B, Q]`` bool: query ``j`` exists (``j`` < the sequence's query count).
        any_visible: ``[B, Q]`` bool: at least one visible key (else the output row is 0).
    """

    block: torch.Tensor
    offset: torch.Tensor
    present: torch.Tensor
    visible: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    any_visible: torch.Tensor

    @classmethod
    def build(cls, meta: AttentionMetadata) -> StepIndex:
        spec, opts = meta.spec, meta.options
        dev = meta.block_tables.device
        bs, nb = spec.block_size, spec.num_blocks
        B, width = meta.block_tables.shape
        L, T, Q = width * bs, meta.num_tokens, max(meta.max_query_len, 1)
        pos = torch.arange(L, device=dev)
        blocks = meta.block_tables.to(torch.long)[:, pos // bs]  # [B, L]
        inside = (blocks >= 0) & (blocks < nb)
        seq = meta.seq_lens.to(torch.long).clamp(0, L)  # [B]
        present = inside & (pos[None, :] < seq[:, None])
        qsl = meta.query_start_loc.to(torch.long).clamp(0, T)
        qlen = (qsl[1:] - qsl[:-1]).clamp_min(0)  # [B]
        j = torch.arange(Q, device=dev)
        real = j[None, :] < qlen[:, None]  # [B, Q]
        rows = (qsl[:-1, None] + j[None, :]).clamp(0, max(T - 1, 0))
        q_pos = seq[:, None] - qlen[:, None] + j[None, :]  # query j sits at seq_len - q_len + j
        visible = present[:, None, :] & real[:, :, None]
        if opts.causal:
            visible = visible & (pos[None, None, :] <= q_pos[:, :, None])
        if opts.sliding_window is not None:
            visible = visible & (pos[None, None, :] > q_pos[:, :, None] - opts.sliding_window)
        return cls(blocks.clamp(0, nb - 1), (pos % bs).expand(B, L), present, visible, rows, real,
                   visible.any(dim=-1))


@dataclass
class TorchPlan:
    """The backend's per-step state: the :class:`StepIndex`, built lazily and rebuilt when the
    metadata's buffers hold other values (``AttentionMetadata.update`` refills them in place).

    The check compares small CPU tensors (block tables, lengths, offsets) with a snapshot of the
    ones the index was built from: this backend serves CPU tensors only, where reading them is
    not a device synchronisation (inference tensors carry no version counter to compare)."""

    index: StepIndex | None = None
    snapshot: tuple = field(default=())


def _buffers(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    return meta.block_tables, meta.seq_lens, meta.query_start_loc


def step_index(meta: AttentionMetadata) -> StepIndex:
    """The step's index from the metadata's plan (built once per step, or after an update)."""
    plan = meta.backend_plan
    if not isinstance(plan, TorchPlan):  # planned by another backend's hook, or none
        return StepIndex.build(meta)
    now = _buffers(meta)
    if plan.index is None or not all(a.shape == b.shape and torch.equal(a, b)
                                     for a, b in zip(now, plan.snapshot, strict=True)):
        plan.index, plan.snapshot = StepIndex.build(meta), tuple(t.clone() for t in now)
    return plan.index


@functools.cache
def _decode_table(fmt: Fp8Format, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256]``: every code's value in ``dtype`` (exact: FP8 values are float32/64 numbers).

    A table lookup of the codes is several times faster on the CPU than torch's FP8 cast."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype)
    return codes.to(dtype).to(device)


def _gather(cache: KVCache, which: str, idx: StepIndex, dt: torch.dtype) -> torch.Tensor:
    """Dequantized ``[B, H, L, D]`` (contiguous) K or V of every key position: ``codes * scale`` in ``dt``."""
    c = (cache.key_cache if which == "key" else cache.value_cache).view(torch.uint8)
    codes = c[idx.block, idx.offset] if cache.layout == "NHD" else c[idx.block, :, idx.offset]  # [B, L, H, D]
    codes = codes.transpose(1, 2)
    flat = codes.reshape(-1).to(torch.int32)  # one byte per element copied, in [B, H, L, D] order
    x = _decode_table(cache.fmt, dt, c.device).index_select(0, flat).view(codes.shape)
    s = cache.k_scale if which == "key" else cache.v_scale
    if cache.scale_granularity == "token_head":
        s = s[idx.block, idx.offset].transpose(1, 2)[..., None]  # [B, H, L, 1]
    else:
        s = s.reshape(-1, 1, 1)  # [1 or H, 1, 1]
    return x.mul_(s)


def paged_attention(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor,
                    lse: torch.Tensor | None = None) -> None:
    """``out [T, Hq, D]`` (and ``lse [T, Hq]``) as :func:`fp8kv.reference.paged_attention` computes
    them, for all sequences at once; rows outside every sequence's queries are untouched.

    Keys that are not ``present`` (past a sequence's length, or in an absent block) may hold any
    bytes, NaN included: their logits are masked to -inf and their values zeroed."""
    opts = meta.options
    idx = step_index(meta)
    dt = math_dtype(query.device)
    T, Hq, D = query.shape
    H = cache.num_kv_heads
    g = Hq // H
    B, Q = idx.rows.shape
    decode = meta.is_decode  # one query per sequence, in order: row b is sequence b's query
    k = _gather(cache, "key", idx, dt)  # [B, H, L, D]
    v = _gather(cache, "value", idx, dt).masked_fill_(~idx.present[:, None, :, None], 0.0)
    q = (query if decode else query[idx.rows]).to(dt).view(B, Q, H, g, D)
    q = q.view(B, H, g, D) if decode else q.permute(0, 2, 3, 1, 4).reshape(B, H, g * Q, D)  # rows (g, Q)
    logits = torch.matmul(q, k.transpose(-1, -2)).mul_(opts.softmax_scale)  # [B, H, g*Q, L]
    if opts.logits_soft_cap is not None:
        logits = torch.tanh(logits.div_(opts.logits_soft_cap)).mul_(opts.logits_soft_cap)
    logits.clamp_(-LOGIT_MAX, LOGIT_MAX)  # NaN stays NaN
    L = logits.shape[-1]
    logits5 = logits.view(B, H, g, Q, L)
    logits5.masked_fill_(~idx.visible[:, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs.view(B, H, g, Q, L).masked_fill_(~idx.any_visible[:, None, None, :, None], 0.0)  # no key: 0, not NaN
    o = torch.matmul(probs, v).view(B, H, g, Q, D)
    out_max = torch.finfo(out.dtype).max
    if decode:
        out.copy_(o.view(T, Hq, D).clamp_(-out_max, out_max))
    else:
        rows = idx.rows[idx.real]
        o = o.permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D)
        out[rows] = o[idx.real].clamp_(-out_max, out_max).to(out.dtype)
    if lse is not None:  # -inf for rows without a visible key
        row = torch.logsumexp(logits5, dim=-1).permute(0, 3, 1, 2).reshape(B, Q, Hq)
        if decode:
            lse.copy_(row.view(T, Hq).clamp(max=FLOAT32_MAX))
        else:
            lse[idx.rows[idx.real]] = row[idx.real].clamp(max=FLOAT32_MAX).to(lse.dtype)
