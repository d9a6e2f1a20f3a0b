"""Paged attention over the FP8 cache in a few batched PyTorch operations per layer.

What the reference does sequence by sequence (its semantics: float64 math, saturated logits,
rows without a visible key give 0), done for every sequence at once:

* per step (:class:`StepIndex`, built at the first layer and shared by the others): which
  cache block and offset holds each key position of each sequence, which keys each query
  may see (length, causality, sliding window, absent blocks) and where each query row sits;
* per layer: one gather of the K and V codes (and token_head scales) of every sequence, a
  table lookup of their values, and in float32 either one ``scaled_dot_product_attention`` or,
  when the log-sum-exp is asked for, the softmax written out; the reference's float64
  arithmetic (two batched matrix products and a masked softmax) where float32 would overflow,
  meets NaN, or the step needs soft-capping or has a row without keys. Both stay within the
  conformance kit's derived float32 tolerance (:mod:`fp8kv.testing.tolerance`).

The index is rebuilt whenever the metadata's buffers were refilled in place with other values
(``AttentionMetadata.update``), so a replayed step never reads a stale index.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from fp8kv.cache import KVCache
from fp8kv.formats import Fp8Format
from fp8kv.metadata import AttentionMetadata
from fp8kv.reference import FLOAT32_MAX, LOGIT_MAX, math_dtype

from . import native
from .write import slot_pair


@dataclass(frozen=True)
class StepIndex:
    """One step's gather indices and masks (B sequences, Q = max_query_len, L = key positions).

    ``L`` is the longest sequence of the step (at most the block tables' width times the block
    size): this backend serves CPU tensors only, so reading the lengths is no device sync.

    Attributes:
        block / offset: ``[B, L]`` int64: cache block (clamped into the cache) and offset of
            key position ``l`` of sequence ``b``.
        slot: ``[B * L]`` int64: ``block * block_size + offset`` (a row of an NHD cache viewed as
            ``[num_slots, H, D]``, or of the token_head scales viewed as ``[num_slots, H]``).
        present: ``[B, L]`` bool: the position is below the sequence's length and its block id
            is inside the cache (else its K/V are not read: they may hold anything, NaN included).
        visible: ``[B, Q, L]`` bool: query ``j`` of sequence ``b`` may attend to key ``l``.
        rows: ``[B, Q]`` int64: the query row (in ``query``/``out``) of query ``j`` of sequence ``b``.
        real: ``[B, Q]`` bool: query ``j`` exists (``j`` < the sequence's query count).
        any_visible: ``[B, Q]`` bool: at least one visible key (else the output row is 0).
        all_present / all_visible / all_any_visible: host flags: the masks hold no False, so the
            per-layer masking they would do is skipped.
        sdpa_mask: ``[B, 1, Q, L]`` bool for the float32 path (``visible``, with rows of absent
            queries all True: their results are dropped), or None when it holds no False.
        real_rows_see_keys: every real query row sees at least one key (the float32 path's
            condition: SDPA gives NaN, not the reference's 0, for a row without keys).
    """

    block: torch.Tensor
    offset: torch.Tensor
    slot: torch.Tensor
    present: torch.Tensor
    visible: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    any_visible: torch.Tensor
    all_present: bool
    all_visible: bool
    all_any_visible: bool
    sdpa_mask: torch.Tensor | None
    real_rows_see_keys: bool

    @classmethod
    def build(cls, meta: AttentionMetadata) -> StepIndex:
        spec, opts = meta.spec, meta.options
        dev = meta.block_tables.device
        bs, nb = spec.block_size, spec.num_blocks
        B, width = meta.block_tables.shape
        T, Q = meta.num_tokens, max(meta.max_query_len, 1)
        seq = meta.seq_lens.to(torch.long).clamp(0, width * bs)  # [B]
        L = int(seq.max()) if B else 0  # CPU tensors: no device sync
        pos = torch.arange(L, device=dev)
        blocks = meta.block_tables.to(torch.long)[:, pos // bs]  # [B, L]
        inside = (blocks >= 0) & (blocks < nb)
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
        block = blocks.clamp(0, nb - 1)
        offset = (pos % bs).expand(B, L)
        any_visible = visible.any(dim=-1)
        mask = visible | ~real[:, :, None]
        return cls(block, offset, (block * bs + offset).reshape(-1), present, visible, rows, real, any_visible,
                   bool(present.all()), bool(visible.all()), bool(any_visible.all()),
                   None if bool(mask.all()) else mask[:, None], bool((any_visible | ~real).all()))


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


def _codes(cache: KVCache, which: str, idx: StepIndex) -> torch.Tensor:
    """uint8 ``[B, L, H, D]`` codes of K or V at every key position of the step."""
    c = (cache.key_cache if which == "key" else cache.value_cache).view(torch.uint8)
    B, L = idx.block.shape
    if cache.layout == "NHD":
        return _slot_rows(c, idx).view(B, L, c.shape[2], c.shape[3])
    return c[idx.block, :, idx.offset]


def _code_pair(cache: KVCache, idx: StepIndex) -> torch.Tensor:
    """uint8 ``[2, B, L, H, D]``: K's and V's codes at every key position of the step (one gather
    where the cache holds them as a pair, :attr:`KVCache.kv_pair`)."""
    pair = slot_pair(cache.kv_pair) if cache.layout == "NHD" else None
    if pair is not None:
        B, L = idx.block.shape
        return pair.view(torch.uint8).index_select(1, idx.slot).view(2, B, L, *pair.shape[2:])
    return torch.stack((_codes(cache, "key", idx), _codes(cache, "value", idx)))


def _scale_pair(cache: KVCache, idx: StepIndex) -> torch.Tensor:
    """float32 ``[2, B * L, H]``: the token_head K and V scales at every key position of the step."""
    pair = slot_pair(cache.scale_pair)
    if pair is not None:
        return pair.index_select(1, idx.slot)
    return torch.stack((_slot_rows(cache.k_scale, idx), _slot_rows(cache.v_scale, idx)))


def _slot_rows(t: torch.Tensor, idx: StepIndex) -> torch.Tensor:
    """Rows of ``t`` ``[num_blocks, block_size, ...]`` at the step's key positions: ``[B * L, ...]``."""
    if t.is_contiguous():
        return t.view(-1, *t.shape[2:]).index_select(0, idx.slot)
    return t[idx.block, idx.offset].flatten(0, 1)


def _token_scales(cache: KVCache, which: str, idx: StepIndex, dt: torch.dtype) -> torch.Tensor:
    """token_head scales ``[B, H, 1, L]`` in ``dt`` of every key position of the step."""
    B, L = idx.block.shape
    scales = cache.k_scale if which == "key" else cache.v_scale
    s = _slot_rows(scales, idx).view(B, L, cache.num_kv_heads)  # [B, L, H]; L may be 0
    return s.to(dt).permute(0, 2, 1)[:, :, None, :]


def _values(cache: KVCache, codes: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The FP8 values of ``codes`` (unscaled) in ``dt``, same shape, contiguous (a table lookup)."""
    flat = codes.to(torch.int32, memory_format=torch.contiguous_format).view(-1)  # in codes' logical order
    return _decode_table(cache.fmt, dt, codes.device).index_select(0, flat).view(codes.shape)


def _head_scale(cache: KVCache, which: str, dt: torch.dtype) -> torch.Tensor:
    """A tensor or head scale broadcastable to ``[B, H, rows, *]``: ``[1 or H, 1, 1]`` in ``dt``."""
    s = cache.k_scale if which == "key" else cache.v_scale
    return s.to(dt).reshape(-1, 1, 1)


def paged_attention(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor,
                    lse: torch.Tensor | None = None) -> None:
    """``out [T, Hq, D]`` (and ``lse [T, Hq]``) as :func:`fp8kv.reference.paged_attention` computes
    them, for all sequences at once; rows outside every sequence's queries are untouched.

    Two paths, both within the conformance kit's derived float32 tolerance
    (:mod:`fp8kv.testing.tolerance`): the float32 path (:func:`_attend_float32`: the FP8 values
    scaled in float32 and one ``scaled_dot_product_attention``, or the softmax written out when the
    log-sum-exp is asked for) where it applies and its result is finite, else the float64 path
    (:func:`_attend_float64`, the reference's arithmetic), which also serves soft-capping and rows
    that see no key."""
    if _attend_native(query, cache, meta, out, lse):
        return
    idx = step_index(meta)
    if meta.options.logits_soft_cap is None and idx.real_rows_see_keys and \
            _attend_float32(query, cache, meta, idx, out, lse):
        return
    _attend_float64(query, cache, meta, idx, out, lse)


NATIVE_MAX_HEAD_SIZE = 512
NATIVE_MAX_GROUP = 64
"""Limits of the C decode loop (its per-row buffers): larger steps take the PyTorch path."""


def _attend_native(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor,
                   lse: torch.Tensor | None) -> bool:
    """Decode steps without soft-capping through the C loop (:mod:`fp8kv_torch.native`): per
    sequence and KV head, the codes of every visible key read through the format's value table,
    an online softmax in float32 and the V sum, in one call. Returns False (``out``/``lse``
    untouched, or rewritten by the caller's next path) where it does not apply or its result is
    not finite: like the float32 path's, such a step goes on to the float64 reference arithmetic."""
    opts = meta.options
    T, Hq, D = query.shape
    H = cache.num_kv_heads
    if not meta.is_decode or opts.logits_soft_cap is not None or D > NATIVE_MAX_HEAD_SIZE \
            or Hq // H > NATIVE_MAX_GROUP or T == 0:
        return False
    lib = native.library()
    if lib is None:
        return False
    f32 = torch.float32
    q = query if query.dtype == f32 and query.stride(2) == 1 else query.to(f32).contiguous()
    direct = out.dtype == f32 and out.is_contiguous()
    o = out if direct else torch.empty((T, Hq, D), dtype=f32)
    tables, lens = meta.block_tables, meta.seq_lens
    if tables.dtype != torch.int32 or tables.stride(1) != 1:
        tables = tables.to(torch.int32).contiguous()
    if lens.dtype != torch.int32 or not lens.is_contiguous():
        lens = lens.to(torch.int32).contiguous()
    kind = {"tensor": 0, "head": 1, "token_head": 2}[cache.scale_granularity]
    ks, vs = cache.k_scale, cache.v_scale
    s_strides = ks.stride() if kind == 2 else (0, 0, ks.stride(0) if kind == 1 else 0)
    if kind == 2 and vs.stride() != ks.stride():
        return False
    kc, vc = cache.key_cache, cache.value_cache
    k_str, v_str = cache_strides(kc, cache.layout), cache_strides(vc, cache.layout)
    table = _decode_table(cache.fmt, f32, query.device)
    window = opts.sliding_window or 0
    rc = lib.fp8kv_decode(
        q.data_ptr(), q.stride(0), q.stride(1), kc.data_ptr(), vc.data_ptr(), *k_str, *v_str, ks.data_ptr(),
        vs.data_ptr(), kind, *s_strides, table.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        T, H, Hq // H, D, cache.block_size, cache.num_blocks, tables.shape[1], float(opts.softmax_scale),
        int(window), o.data_ptr(), None if lse is None else lse.data_ptr())
    if rc != 0:
        return False
    total = o.sum()
    if lse is not None:  # -inf marks a row without keys; NaN or +inf anywhere is not finite
        total = total + lse.masked_fill(torch.isneginf(lse), 0.0).sum()
    if not math.isfinite(float(total)):
        return False
    if not direct:
        if out.dtype != f32:  # narrower outputs saturate
            o = o.clamp_(-torch.finfo(out.dtype).max, torch.finfo(out.dtype).max)
        out.copy_(o)
    return True


def cache_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(block, offset, head) strides in elements of an NHD or HND cache tensor."""
    if layout == "NHD":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _attend_float32(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, idx: StepIndex,
                    out: torch.Tensor, lse: torch.Tensor | None) -> bool:
    """The float32 path; returns False (``out`` and ``lse`` untouched) if any result is not finite.

    K and V are dequantized in float32 (``value * scale``: one rounding, the tolerance's
    setting), tensor/head K scales are folded into the query and the V scale into the result.
    Float32 can overflow where the reference's float64 does not (a K scale near 3e38, say):
    an overflow makes a logit or a value infinite, and that reaches the result as inf or NaN
    (an overflow to -inf only drops a key whose weight is 0 anyway), so a non-finite result
    sends the whole call to the float64 path, which also reproduces NaN inputs exactly."""
    opts = meta.options
    T, Hq, D = query.shape
    H = cache.num_kv_heads
    g = Hq // H
    B, Q = idx.rows.shape
    L = idx.block.shape[1]
    f32 = torch.float32
    token = cache.scale_granularity == "token_head"
    kv = _values(cache, _code_pair(cache, idx).transpose(2, 3), f32)  # [2, B, H, L, D]
    if token:
        kv.mul_(_scale_pair(cache, idx).view(2, B, L, H, 1).transpose(2, 3))
    if not idx.all_present:  # absent keys may hold NaN codes or scales: a NaN logit or 0 * NaN would
        kv.masked_fill_(~idx.present[None, :, None, :, None], 0.0)  # reach the output through SDPA
    q = query if meta.is_decode else query[idx.rows]
    q = q if q.dtype == f32 else q.to(f32)
    if not token:
        q = q.view(B, Q, H, g, D) * _head_scale(cache, "key", f32)  # [1 or H, 1, 1] over (H, g, D)
    q = q.view(B, Q, Hq, D).transpose(1, 2)  # [B, Hq, Q, D]
    row_lse = None
    if lse is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=idx.sdpa_mask, scale=opts.softmax_scale, enable_gqa=g > 1)  # [B, Hq, Q, D]
    else:  # SDPA keeps its log-sum-exp to itself: the softmax written out, rows (g, Q) per KV head
        logits = torch.matmul(q.reshape(B, H, g * Q, D), kv[0].transpose(-1, -2)).mul_(opts.softmax_scale)
        if idx.sdpa_mask is not None:
            logits.view(B, H, g, Q, L).masked_fill_(~idx.sdpa_mask[:, :, None], float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [B, H, g * Q]
        o = torch.matmul(torch.exp(logits.sub_(row_lse[..., None])), kv[1]).view(B, Hq, Q, D)
    if not token:
        o = o.reshape(B, H, g, Q, D).mul_(_head_scale(cache, "value", f32)[..., None]).reshape(B, Hq, Q, D)
    total = o.sum() if row_lse is None else o.sum() + row_lse.sum()
    if not math.isfinite(float(total)):  # inf or NaN anywhere (or a sum past float32: rare, and safe)
        return False
    if out.dtype != f32:  # float32 results are finite here; narrower outputs saturate
        o = o.clamp(-torch.finfo(out.dtype).max, torch.finfo(out.dtype).max)
    if meta.is_decode:
        out.copy_(o.reshape(B, Hq, D))
    else:
        out[idx.rows[idx.real]] = o.transpose(1, 2)[idx.real].to(out.dtype)
    if lse is not None:
        row_lse = row_lse.view(B, Hq, Q)
        if meta.is_decode:
            lse.copy_(row_lse.view(B, Hq))
        else:
            lse[idx.rows[idx.real]] = row_lse.transpose(1, 2)[idx.real]
    return True


def _attend_float64(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, idx: StepIndex,
                    out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """The float64 path: the reference's arithmetic (every path of :func:`paged_attention`).

    Keys that are not ``present`` (past a sequence's length, or in an absent block) may hold any
    bytes, NaN included: their logits are masked to -inf and their values zeroed."""
    opts = meta.options
    dt = math_dtype(query.device)
    T, Hq, D = query.shape
    H = cache.num_kv_heads
    g = Hq // H
    B, Q = idx.rows.shape
    decode = meta.is_decode  # one query per sequence, in order: row b is sequence b's query
    token = cache.scale_granularity == "token_head"
    # K and V as their unscaled FP8 values [B, H, L, D]; the scales multiply the (smaller) logits
    # and probabilities instead: float64 products of FP8 values and float32 scales are exact
    k = _values(cache, _codes(cache, "key", idx), dt).permute(0, 2, 1, 3)
    v = _values(cache, _codes(cache, "value", idx), dt).permute(0, 2, 1, 3)
    if not idx.all_present:  # absent keys may hold NaN codes: 0 * NaN would reach the output
        v = v.masked_fill(~idx.present[:, None, :, None], 0.0)
    q = (query if decode else query[idx.rows]).to(dt).view(B, Q, H, g, D)
    q = q.view(B, H, g, D) if decode else q.permute(0, 2, 3, 1, 4).reshape(B, H, g * Q, D)  # rows (g, Q)
    logits = torch.matmul(q, k.transpose(-1, -2))  # [B, H, g*Q, L]
    logits.mul_(_token_scales(cache, "key", idx, dt) if token else _head_scale(cache, "key", dt))
    logits.mul_(opts.softmax_scale)
    if opts.logits_soft_cap is not None:
        logits = torch.tanh(logits.div_(opts.logits_soft_cap)).mul_(opts.logits_soft_cap)
    logits.clamp_(-LOGIT_MAX, LOGIT_MAX)  # NaN stays NaN
    L = logits.shape[-1]
    logits5 = logits.view(B, H, g, Q, L)
    if not idx.all_visible:
        logits5.masked_fill_(~idx.visible[:, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not idx.all_any_visible:  # no key: 0, not NaN
        probs.view(B, H, g, Q, L).masked_fill_(~idx.any_visible[:, None, None, :, None], 0.0)
    if token:
        sv = _token_scales(cache, "value", idx, dt)
        if not idx.all_present:  # an absent key's scale may be anything (inf * 0 is NaN)
            sv = sv.masked_fill(~idx.present[:, None, None, :], 0.0)
        o = torch.matmul(probs * sv, v)
    else:
        o = torch.matmul(probs, v).mul_(_head_scale(cache, "value", dt))
    o = o.view(B, H, g, Q, D)
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
