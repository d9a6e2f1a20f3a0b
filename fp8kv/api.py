"""The public operations: write the step's K/V into the cache, and attend over it.

The engine way (plan once per step, run per layer, no host sync per layer)::

    meta = fp8kv.plan_attention(caches[0], num_q_heads=Hq, query_dtype=torch.bfloat16,
                                block_tables=bt, seq_lens=lens, query_start_loc=qsl,
                                slot_mapping=slots)            # checks, selection: once
    for layer in range(num_layers):
        fp8kv.write_kv(caches[layer], k, v, meta)             # slots from the metadata
        out = fp8kv.paged_attention(q, caches[layer], meta)

The one-shot way (a metadata is built inside every call)::

    fp8kv.write_kv_one_shot(cache, k, v, slot_mapping)
    out = fp8kv.paged_attention_one_shot(q, cache, block_tables, seq_lens, query_start_loc=qsl)

Every check runs before any backend is called, so bad input raises
:class:`fp8kv.InvalidArgument` (an :class:`fp8kv.Fp8KVError`) and leaves the cache unchanged.
That includes a cache whose tensors were changed in place after it was built (``set_``,
``resize_``, ...): :meth:`fp8kv.KVCache.check_intact` runs on every call, value checks on or off.

Inference only: writes never record autograd history (the cache and its dynamic scales never
join the caller's graph) and attention outputs never require grad, on every backend alike.
"""

from __future__ import annotations

import torch

from . import ops as _ops
from .cache import KVCache, may_share_bytes
from .checks import INDEX_DTYPES, IO_DTYPES, check_slot_mapping, check_tensor, flag
from .errors import InvalidArgument, bad_argument
from .fp8_attention import PROB_SCALES, check_prob_scale
from .metadata import AttentionMetadata
from .planning import plan_attention
from .registry import select_backend
from .request import Request, Selection


def _check_kv(cache: KVCache, key, value) -> None:
    H, D = cache.num_kv_heads, cache.head_size
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, dtypes=IO_DTYPES, ndim=3, device=cache.device)
        if t.shape[1] != H or t.shape[2] != D:
            raise bad_argument(name, f"shape {tuple(t.shape)}",
                               f"[num_tokens, {H}, {D}] (num_kv_heads={H}, head_size={D} of the cache)")
    if key.shape != value.shape or key.dtype != value.dtype:
        raise bad_argument("value", f"{tuple(value.shape)} {value.dtype}",
                           f"the shape and dtype of key, {tuple(key.shape)} {key.dtype}")


def _check_separate(cache: KVCache, **tensors: torch.Tensor) -> None:
    """No argument may share bytes with a cache tensor (a write would read what it overwrites).

    Skipped while torch.compile traces (fake tensors have no addresses; the compiled graph's
    buffers are its own)."""
    if torch.compiler.is_compiling():
        return
    for name, t in tensors.items():
        shared = cache.shares_memory_with(t)
        if shared is not None:
            raise bad_argument(name, f"a tensor sharing memory with cache.{shared}",
                               "a tensor separate from the cache's tensors")


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Quantize ``key``/``value`` and store them in ``cache`` at the step's slots, in place.

    Args:
        cache: the layer's :class:`fp8kv.KVCache`.
        key, value: ``[num_tokens, H, D]`` fp32/fp16/bf16, contiguous, on the cache's device,
            one token per slot of the metadata.
        metadata: the step's :class:`fp8kv.AttentionMetadata`, planned with ``slot_mapping=``
            (checked once there: no host sync, no re-selection here).
    """
    if not isinstance(metadata, AttentionMetadata):
        raise bad_argument("metadata", type(metadata).__name__,
                           "an fp8kv.AttentionMetadata from plan_attention(..., slot_mapping=...); for a "
                           "one-off write without a plan: fp8kv.write_kv_one_shot(cache, key, value, slot_mapping)")
    meta = metadata
    meta.check_cache(cache)
    if meta.slot_mapping is None:
        raise bad_argument("metadata", "a metadata planned without slot_mapping",
                           "a metadata from plan_attention(..., slot_mapping=...)")
    _check_kv(cache, key, value)
    if key.shape[0] != meta.slot_mapping.shape[0]:
        raise bad_argument("key", f"{key.shape[0]} tokens", f"one per slot of the metadata "
                                                             f"({meta.slot_mapping.shape[0]})")
    # (under torch.compile the fp8kv::write_kv op re-selects meta.write's backend for key.dtype itself)
    selection = meta.write if key.dtype == meta.query_dtype or torch.compiler.is_compiling() else \
        select_backend(Request.for_write(cache.spec, key.dtype), cache.device, meta.write.backend.name)
    _write(cache, key, value, meta.slot_mapping, selection)


def write_kv_one_shot(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *,
                      backend: str = "auto") -> None:
    """:func:`write_kv` without a plan: checks the slots (one host sync on a GPU unless
    ``FP8KV_CHECK=shapes``) and selects the backend in this call.

    Args:
        cache, key, value: as :func:`write_kv`.
        slot_mapping: ``[num_tokens]`` int32/int64 (``slot = block * block_size + offset``,
            negative = padding, skipped; slots distinct).
        backend: ``"auto"`` or a backend name.
    """
    if not isinstance(cache, KVCache):
        raise bad_argument("cache", type(cache).__name__, "an fp8kv.KVCache")
    _check_kv(cache, key, value)
    slots = check_slot_mapping(cache.spec, slot_mapping, key.shape[0], None)
    selection = select_backend(Request.for_write(cache.spec, key.dtype), cache.device, backend)
    _write(cache, key, value, slots, selection)


def _write(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, selection: Selection) -> None:
    cache.check_intact()  # always, whatever FP8KV_CHECK says: host integers only
    _check_separate(cache, key=key, value=value)
    if key.requires_grad or value.requires_grad:  # inference only: never joins the caller's graph
        key, value = key.detach(), value.detach()
    if key.shape[0]:
        # -- torch.compile: one fp8kv::write_kv custom op instead of the backend call (fp8kv/ops.py)
        if torch.compiler.is_compiling():
            _ops.traced_write_kv(cache, key, value, slots, selection.backend.name)
        else:
            selection.backend.write_kv(cache, key, value, slots)


def paged_attention(
    query: torch.Tensor,
    cache: KVCache,
    metadata: AttentionMetadata,
    *,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    layer_scales: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` over the paged FP8 cache.

    Args:
        query: ``[num_tokens, Hq, D]`` contiguous, in the metadata's ``query_dtype``.
        cache: the layer's :class:`fp8kv.KVCache`, already holding the step's K/V.
        metadata: the step's :class:`fp8kv.AttentionMetadata` (from :func:`fp8kv.plan_attention`).
        out: optional ``[num_tokens, Hq, D]`` output in the query dtype, contiguous; it must not
            share memory with ``query`` or with any of the cache's tensors (refused, naming ``out``).
        return_lse: also return the float32 ``[num_tokens, Hq]`` log-sum-exp (natural log) of
            each row's logits, for :func:`merge_attention_states`.
        layer_scales: FP8 attention mode only: this layer's ``{"q_scale": ..., "prob_scale": ...}``
            (e.g. :meth:`fp8kv.KVCachePlan.fp8_attention_scales`), replacing the step's for this call.
            Shapes, dtype and device are checked here; the values (finite, > 0) only when the
            metadata was planned (no host sync per layer).
    Returns:
        ``out`` (``[num_tokens, Hq, D]`` in the query dtype), or ``(out, lse)``.
    """
    if not isinstance(metadata, AttentionMetadata):
        raise bad_argument("metadata", type(metadata).__name__,
                           "an fp8kv.AttentionMetadata from plan_attention(...); for a one-off call without a "
                           "plan: fp8kv.paged_attention_one_shot(query, cache, block_tables, seq_lens, ...)")
    metadata.check_cache(cache)
    if layer_scales is not None:
        metadata = _with_layer_scales(metadata, layer_scales)
    return _attend(query, cache, metadata, out, return_lse)


def paged_attention_one_shot(
    query: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    **step,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` without a plan: plans the step (checks, selection) in this call.

    Args:
        query, cache, out, return_lse: as :func:`paged_attention`.
        block_tables / seq_lens: ``[num_seqs, max_blocks]`` and ``[num_seqs]`` int32/int64.
        step: keywords of :func:`fp8kv.plan_attention` for the step and its options
            (``query_start_loc`` for chunked prefill, else decode with one query per sequence;
            ``max_query_len``, ``softmax_scale``, ``causal``, ``sliding_window``, ``window_left``,
            ``logits_soft_cap``, ``fp8_attention``, ``q_scale``, ``prob_scale``, ``validate``,
            ``backend``, ...). The query gives ``num_q_heads``, ``query_dtype`` and ``num_tokens``.
    """
    for name in _FROM_THE_CALL:
        if name in step:
            raise bad_argument(name, "given", "nothing: the one-shot call takes it from its arguments")
    _check_one_shot_arguments(query, cache, block_tables, seq_lens, step.get("query_start_loc"), out)
    meta = plan_attention(cache, block_tables=block_tables, seq_lens=seq_lens, num_q_heads=query.shape[1],
                          query_dtype=query.dtype, num_tokens=query.shape[0], **step)
    return _attend(query, cache, meta, out, return_lse)


def _check_one_shot_arguments(query, cache, block_tables, seq_lens, query_start_loc, out) -> None:
    """Each argument of a one-shot attention call on its own first (type, dtype, rank, device), in
    the order of the signature, then the counts that relate them: the first wrong argument is
    the one named (a 2-d ``seq_lens`` is named, not the query whose count it would not match)."""
    if not isinstance(query, torch.Tensor):
        raise bad_argument("query", type(query).__name__, "a torch.Tensor")
    if not isinstance(cache, KVCache):
        raise bad_argument("cache", type(cache).__name__, "an fp8kv.KVCache")
    if query.dim() != 3:
        raise bad_argument("query", f"shape {tuple(query.shape)}", "3 dimensions [num_tokens, Hq, D]")
    if not query.is_floating_point() or query.dtype not in IO_DTYPES:
        raise bad_argument("query", f"dtype {query.dtype}", f"one of {[str(d) for d in IO_DTYPES]}")
    if query.device != cache.device:
        raise bad_argument("query", f"device {query.device}", f"the cache's device {cache.device}")
    H, D = cache.num_kv_heads, cache.head_size
    if query.shape[2] != D:
        raise bad_argument("query", f"head size {query.shape[2]}", f"the cache's head_size {D}")
    if query.shape[1] == 0 or query.shape[1] % H:
        raise bad_argument("query", f"{query.shape[1]} query heads", f"a positive multiple of num_kv_heads={H}")
    if not isinstance(block_tables, torch.Tensor):
        raise bad_argument("block_tables", type(block_tables).__name__,
                           "a torch.Tensor [num_seqs, max_blocks] (a planned step goes to "
                           "fp8kv.paged_attention(query, cache, metadata))")
    check_tensor("block_tables", block_tables, dtypes=INDEX_DTYPES, ndim=2, device=cache.device, contiguous=False)
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=cache.device, contiguous=False)
    if query_start_loc is not None:
        check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1, device=cache.device,
                     contiguous=False)
    if out is not None:
        check_tensor("out", out, dtypes=(query.dtype,), ndim=3, device=cache.device)
    # -- counts, once every argument is known to be the right kind of tensor
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise bad_argument("block_tables", f"{block_tables.shape[0]} rows", f"one per sequence ({seq_lens.shape[0]})")
    if query_start_loc is None and query.shape[0] != seq_lens.shape[0]:
        raise bad_argument("query", f"{query.shape[0]} tokens", "one per sequence for decode; pass "
                                                                 "query_start_loc for prefill")


_FROM_THE_CALL = ("num_q_heads", "query_dtype", "num_tokens", "slot_mapping", "kv_indptr", "kv_indices",
                  "kv_last_page_len")
"""plan_attention keywords a one-shot attention call does not take: the query gives the first three;
the page table is the padded one; no slots (the write is its own call)."""


def _attend(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor | None,
            return_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Check the cache's tensors, ``query`` and ``out`` against the planned step, then run the chosen backend."""
    cache.check_intact()  # always, whatever FP8KV_CHECK says: host integers only
    return_lse = flag("return_lse", return_lse)
    spec = meta.spec
    want = (meta.num_tokens, meta.num_q_heads, spec.head_size)
    check_tensor("query", query, dtypes=(meta.query_dtype,), ndim=3, device=spec.device)
    if tuple(query.shape) != want:
        raise bad_argument("query", f"shape {tuple(query.shape)}", f"{list(want)} (num_tokens, num_q_heads, "
                                                                   "head_size of the metadata)")
    if query.requires_grad:  # inference only: the output never requires grad, on every backend
        query = query.detach()
    if out is None:
        out = torch.empty_like(query)
    else:
        check_tensor("out", out, dtypes=(query.dtype,), ndim=3, device=spec.device)
        if out.shape != query.shape:
            raise bad_argument("out", f"shape {tuple(out.shape)}", f"the query's shape {tuple(query.shape)}")
        if out.requires_grad:
            raise bad_argument("out", "a tensor that requires grad", "an output buffer without autograd history "
                                                                     "(fp8kv ops are inference only)")
        _check_separate(cache, out=out)
        if not torch.compiler.is_compiling() and may_share_bytes(out, query):
            raise bad_argument("out", "a tensor sharing memory with query", "a separate output buffer")
    lse = torch.empty(want[:2], dtype=torch.float32, device=spec.device) if return_lse else None
    if meta.num_tokens:
        # -- torch.compile: one fp8kv::paged_attention custom op instead of the backend call (fp8kv/ops.py)
        if torch.compiler.is_compiling():
            if meta.options.fp8_attention:
                raise bad_argument("fp8_attention", "True under torch.compile",
                                   "eager calls (the compiled fp8kv::paged_attention op carries the default mode)")
            _ops.traced_paged_attention(query, cache, meta, out, lse)
        else:
            meta.attention.backend.paged_attention(query, cache, meta, out, lse)
    return (out, lse) if return_lse else out


def _with_layer_scales(meta: AttentionMetadata, layer_scales: dict) -> AttentionMetadata:
    """``meta`` with this layer's FP8-mode q/prob scales (a shallow copy; the backend plan is kept)."""
    import dataclasses

    if not meta.options.fp8_attention:
        raise bad_argument("layer_scales", "given", "None unless the metadata was planned with fp8_attention=True")
    if not isinstance(layer_scales, dict) or not set(layer_scales) <= {"q_scale", "prob_scale"}:
        raise bad_argument("layer_scales", repr(layer_scales), "a dict with the keys q_scale and/or prob_scale")
    q_scale = layer_scales.get("q_scale", meta.options.q_scale)
    prob_scale = layer_scales.get("prob_scale", meta.options.prob_scale)
    H, Hq = meta.spec.num_kv_heads, meta.num_q_heads
    if q_scale is not None and (not isinstance(q_scale, torch.Tensor) or q_scale.dtype != torch.float32
                                or tuple(q_scale.shape) not in ((), (H,), (Hq,))
                                or q_scale.device != meta.spec.device):
        raise bad_argument("layer_scales", f"q_scale {getattr(q_scale, 'dtype', type(q_scale).__name__)} "
                           f"{tuple(getattr(q_scale, 'shape', ()))}",
                           f"q_scale float32 of shape [], [{H}] or [{Hq}] on {meta.spec.device}, or None")
    try:  # checked as plan_attention's prob_scale, named as the key of layer_scales
        prob_scale = check_prob_scale(prob_scale)
    except InvalidArgument:
        raise bad_argument("layer_scales", f"prob_scale {prob_scale!r}", f"prob_scale {PROB_SCALES}") from None
    options = dataclasses.replace(meta.options, q_scale=q_scale, prob_scale=prob_scale)
    return dataclasses.replace(meta, options=options)


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention results over disjoint key sets into the result over their union.

    Args:
        out_a, out_b: ``[num_tokens, Hq, D]`` outputs (any float dtype, the same).
        lse_a, lse_b: ``[num_tokens, Hq]`` float32 log-sum-exps (natural log) from
            ``paged_attention(..., return_lse=True)``; ``-inf`` for a row that saw no key.
    Returns:
        ``(out, lse)``: ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})``
        in the outputs' dtype, computed in float32, and ``lse = log(e^{lse_a} + e^{lse_b})``.
        A row that saw no key in either part gets ``out = 0``, ``lse = -inf``.
    """
    for name, t, nd in (("out_a", out_a, 3), ("lse_a", lse_a, 2), ("out_b", out_b, 3), ("lse_b", lse_b, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            raise bad_argument(name, type(t).__name__ if not isinstance(t, torch.Tensor) else f"shape {tuple(t.shape)}",
                               f"a {nd}-d tensor")
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise bad_argument("out_b", f"{tuple(out_b.shape)} {out_b.dtype}",
                           f"out_a's {tuple(out_a.shape)} {out_a.dtype}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(out_a.shape[:2]) or t.dtype != torch.float32:
            raise bad_argument(name, f"{tuple(t.shape)} {t.dtype}", f"float32 of shape {tuple(out_a.shape[:2])}")
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if t.device != out_a.device:
            raise bad_argument(name, f"device {t.device}", f"out_a's device {out_a.device}")
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a.float() * (wa / safe)[..., None] + out_b.float() * (wb / safe)[..., None]).to(out_a.dtype)
    lse = torch.where(total > 0, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return out, lse


__all__ = ["merge_attention_states", "paged_attention", "paged_attention_one_shot", "write_kv", "write_kv_one_shot"]
