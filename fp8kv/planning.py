"""``plan_attention``: the one place a step is checked, sized and given its backends.

Its steps, each its own function: the query heads and dtype; the page table and lengths, read
and checked in one host transfer (:mod:`fp8kv.step`); the attention options
(:meth:`AttentionOptions.build`, the FP8 mode's through :func:`fp8kv.fp8_attention.check_fp8_options`);
the selection of the attention and write backends (:func:`fp8kv.registry.select_backend`); the chosen
backend's own plan (its ``fp8kv_plan_attention`` hook).

Host syncs: one when values are checked (``validate=True``, the default unless
``FP8KV_CHECK=shapes``); none with ``validate=False`` when the caller passes ``max_query_len`` for
chunked prefill (decode needs nothing). Per layer: none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import CacheSpec, KVCache
from .checks import IO_DTYPES, int_at_least
from .errors import bad_argument
from .metadata import AttentionMetadata, AttentionOptions
from .registry import select_backend
from .request import Request, Selection
from .step import StepTables, read_step


def check_heads(spec: CacheSpec, num_q_heads, query_dtype) -> int:
    """``num_q_heads`` (returned as a Python int) a positive multiple of the cache's KV heads;
    ``query_dtype`` one the API serves."""
    H = spec.num_kv_heads
    expected = f"a positive multiple of num_kv_heads={H}"
    num_q_heads = int_at_least("num_q_heads", num_q_heads, 1, expected)
    if num_q_heads % H:
        raise bad_argument("num_q_heads", repr(num_q_heads), expected)
    if query_dtype not in IO_DTYPES:
        raise bad_argument("query_dtype", repr(query_dtype), f"one of {[str(d) for d in IO_DTYPES]}")
    return num_q_heads


def select_backends(spec: CacheSpec, query_dtype: torch.dtype, options: AttentionOptions, step: StepTables,
                    backend: str) -> tuple[Request, Selection, Selection | None]:
    """The attention request of the step, its backend, and the write's backend (if slots were given)."""
    features = set(options.features)
    if not step.is_decode and step.max_query_len > 1:
        features.add("chunked_prefill")
    request = Request.for_attention(spec, query_dtype, frozenset(features))
    attention = select_backend(request, spec.device, backend)
    write = None if step.slot_mapping is None else \
        select_backend(Request.for_write(spec, query_dtype), spec.device, backend)
    return request, attention, write


def plan_attention(
    cache: KVCache | CacheSpec,
    *,
    num_q_heads: int,
    query_dtype: torch.dtype,
    block_tables: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    num_tokens: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    max_blocks: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    window_left: int | None = None,
    logits_soft_cap: float | None = None,
    fp8_attention: bool = False,
    q_scale: torch.Tensor | None = None,
    prob_scale: float | None = None,
    validate: bool | None = None,
    backend: str = "auto",
    host_seq_lens: Sequence[int] | None = None,
    host_query_start_loc: Sequence[int] | None = None,
) -> AttentionMetadata:
    """Build the step's :class:`~fp8kv.AttentionMetadata`: the page table and lengths
    (:func:`fp8kv.step.read_step`), the options, the backends' selection and the chosen backend's plan.

    Args:
        cache: any layer's :class:`~fp8kv.KVCache` (or its ``spec``): all layers share it.
        num_q_heads: Hq, a positive multiple of the cache's KV heads.
        query_dtype: float32, float16 or bfloat16; also the dtype of the K/V the step writes.
        block_tables / seq_lens: the padded page table ``[num_seqs, max_blocks]`` and
            ``[num_seqs]`` tokens per sequence (the step's included); int32 or int64. Entries
            past ``ceil(seq_len / block_size)`` are never read (0 or -1 both fine).
        kv_indptr / kv_indices / kv_last_page_len: FlashInfer's CSR page table instead:
            ``[num_seqs + 1]`` offsets into ``kv_indices [nnz_pages]``, and the tokens in each
            sequence's last page (``1..block_size``; a sequence with no page has length 0).
            ``kv_indices`` may be longer: entries past ``kv_indptr[-1]`` are never read nor
            checked (SGLang allocates ``nnz_pages + 256``, uninitialized); ``kv_indptr[-1]``
            past its end is refused.
        query_start_loc: ``[num_seqs + 1]`` offsets of each sequence's queries (chunked
            prefill, vLLM's ``cu_seqlens_q`` / FlashInfer's ``qo_indptr``); None: decode, one
            query per sequence.
        slot_mapping: ``[num_written]`` slots of the step's new K/V for :func:`fp8kv.write_kv`
            (``block * block_size + offset``, negative = padding, distinct); optional. Usually one
            per query token; may be longer when padding rows are written and skipped.
        num_tokens: query tokens of the step (decode: ``num_seqs``); read from
            ``query_start_loc[-1]`` when not given.
        max_query_len / max_seq_len: bounds, if the caller knows them (saves the sync when
            ``validate=False``; checked against the values otherwise).
        max_blocks: pad a CSR page table to this many columns (default: from ``max_seq_len``
            or the longest sequence).
        softmax_scale, causal, sliding_window, window_left, logits_soft_cap: see
            :class:`AttentionOptions` (``window_left`` is FlashInfer's, SGLang's and LMDeploy's
            ``W - 1``, with -1 meaning no window; give one of the two).
        fp8_attention: the opt-in FP8 attention mode (:mod:`fp8kv.fp8_attention`,
            docs/fp8_attention.md): an ``fp8_e4m3`` cache with tensor or head scales.
        q_scale: FP8 mode only: the query scale, float32 ``[]``, ``[num_kv_heads]`` or
            ``[num_q_heads]`` on the cache's device (a checkpoint's ``q_scale``); None: dynamic
            per (token, head).
        prob_scale: FP8 mode only: probabilities are divided by it before their e4m3 rounding
            (a checkpoint's ``prob_scale``; default 1).
        validate: check index values (one host sync); default: ``FP8KV_CHECK`` (``full``),
            never during CUDA-graph capture.
        backend: ``"auto"`` or a backend name (``FP8KV_BACKEND`` forces one for ``auto``).
        host_seq_lens / host_query_start_loc: the same lengths and offsets as host integers (vLLM's
            ``seq_lens_cpu`` / ``query_start_loc_cpu``, FlashInfer's host ``qo_indptr``), if the
            caller has them: backends plan the step's work by them without a host sync (the Hopper
            prefill balances its CTAs' work items). They steer only how work is dealt, never what is
            computed. Checked against the tensors when ``validate`` is on, which also reads them
            from the GPU for free (in its one transfer) when they are not given.

    Scalars follow one rule (docs/configuration.md, "Scalar and flag arguments"): float arguments
    take Python, NumPy or one-element CPU tensor numbers, int arguments the integer ones, flags
    exactly True or False.
    """
    spec = cache.spec if isinstance(cache, KVCache) else cache
    if not isinstance(spec, CacheSpec):
        raise bad_argument("cache", type(cache).__name__, "an fp8kv.KVCache (or its spec)")
    num_q_heads = check_heads(spec, num_q_heads, query_dtype)
    options = AttentionOptions.build(
        spec.head_size, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        window_left=window_left, logits_soft_cap=logits_soft_cap,
    ).with_fp8(spec, num_q_heads, fp8_attention, q_scale, prob_scale)
    step = read_step(
        spec, block_tables=block_tables, seq_lens=seq_lens, kv_indptr=kv_indptr, kv_indices=kv_indices,
        kv_last_page_len=kv_last_page_len, query_start_loc=query_start_loc, slot_mapping=slot_mapping,
        num_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len, max_blocks=max_blocks,
        validate=validate, host_seq_lens=host_seq_lens, host_query_start_loc=host_query_start_loc,
    )
    request, attention, write = select_backends(spec, query_dtype, options, step, backend)
    meta = AttentionMetadata(
        spec, num_q_heads, query_dtype, step.num_tokens, step.block_tables, step.seq_lens, step.query_start_loc,
        step.is_decode, step.slot_mapping, step.max_query_len, step.max_seq_len, options, request, attention, write,
        host_seq_lens=step.host_seq_lens, host_query_start_loc=step.host_query_start_loc,
    )
    meta.backend_plan = attention.backend.plan_attention(attention.device, meta)
    return meta


__all__ = ["check_heads", "plan_attention", "select_backends"]
