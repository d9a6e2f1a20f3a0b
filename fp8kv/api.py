"""The public operations: validate, select a backend, dispatch.

Every check runs before any backend is called, so bad input raises
:class:`fp8kv.Fp8KVError` and leaves the cache unchanged. Checks on tensor *values*
(slot ranges, duplicates, block-table ranges) read the tensors; on CUDA they are
skipped while a CUDA graph is being captured or when ``FP8KV_CHECK=shapes``.
"""

from __future__ import annotations

import math
import os

import torch

from .cache import KVCache
from .errors import bad_argument
from .hookspecs import Request
from .registry import select_backend

IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_values(t: torch.Tensor) -> bool:
    """Whether value checks (which read device memory) should run for tensors like ``t``."""
    if t.device.type != "cuda":
        return True
    if os.environ.get("FP8KV_CHECK", "full") == "shapes":
        return False
    return not torch.cuda.is_current_stream_capturing()


def _check_tensor(name: str, t, *, dtypes, ndim: int, device: torch.device, contiguous: bool = True):
    if not isinstance(t, torch.Tensor):
        raise bad_argument(name, type(t).__name__, "a torch.Tensor")
    if t.dtype not in dtypes:
        raise bad_argument(name, f"dtype {t.dtype}", f"one of {[str(d) for d in dtypes]}")
    if t.dim() != ndim:
        raise bad_argument(name, f"shape {tuple(t.shape)}", f"{ndim} dimensions")
    if t.device != device:
        raise bad_argument(name, f"device {t.device}", f"the cache's device {device}")
    if contiguous and not t.is_contiguous():
        raise bad_argument(name, f"a non-contiguous tensor (strides {t.stride()})",
                           "a contiguous tensor (call .contiguous())")
    return t


def _check_cache(cache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise bad_argument("cache", type(cache).__name__, "an fp8kv.KVCache")
    return cache


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *,
             backend: str = "auto") -> None:
    """Quantize ``key``/``value`` and store them in ``cache`` at ``slot_mapping``, in place.

    Args:
        cache: the layer's :class:`fp8kv.KVCache`.
        key, value: ``[num_tokens, H, D]`` fp32/fp16/bf16, contiguous, on the cache's device.
        slot_mapping: ``[num_tokens]`` int32/int64; ``slot = block * block_size + offset``;
            negative entries are padding and are skipped. Slots must be distinct.
        backend: ``"auto"`` or a backend name.
    """
    _check_cache(cache)
    dev = cache.device
    H, D = cache.num_kv_heads, cache.head_size
    for name, t in (("key", key), ("value", value)):
        _check_tensor(name, t, dtypes=IO_DTYPES, ndim=3, device=dev)
        if tuple(t.shape[1:]) != (H, D):
            raise bad_argument(name, f"shape {tuple(t.shape)}",
                               f"[num_tokens, {H}, {D}] (num_kv_heads={H}, head_size={D} of the cache)")
    if key.shape != value.shape or key.dtype != value.dtype:
        raise bad_argument("value", f"{tuple(value.shape)} {value.dtype}",
                           f"the shape and dtype of key, {tuple(key.shape)} {key.dtype}")
    _check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=dev)
    if slot_mapping.shape[0] != key.shape[0]:
        raise bad_argument("slot_mapping", f"{slot_mapping.shape[0]} entries",
                           f"one per token ({key.shape[0]})")
    if slot_mapping.numel() and _check_values(slot_mapping):
        hi = int(slot_mapping.max())
        if hi >= cache.num_slots:
            raise bad_argument("slot_mapping", f"slot {hi}",
                               f"slots < num_blocks * block_size = {cache.num_slots} (negative = padding)")
        valid = slot_mapping[slot_mapping >= 0]
        if valid.numel() != torch.unique(valid).numel():
            dup = _first_duplicate(valid)
            raise bad_argument("slot_mapping", f"slot {dup} more than once", "each slot written at most once")
    request = Request("write_kv", cache.kv_dtype, cache.layout, cache.scale_granularity, D, key.dtype,
                      dev.type)
    selection = select_backend(request, dev, backend)
    if key.shape[0]:
        selection.backend.write_kv(cache, key, value, slot_mapping)


def _first_duplicate(valid: torch.Tensor) -> int:
    vals, counts = torch.unique(valid, return_counts=True)
    return int(vals[counts > 1][0])


def _positive_finite(name: str, x, *, integer: bool = False):
    ok = isinstance(x, int) and not isinstance(x, bool) if integer else isinstance(x, (int, float))
    if not ok or not (math.isfinite(x) and x > 0):
        raise bad_argument(name, repr(x), "a positive int" if integer else "a finite number > 0")
    return x


def paged_attention(
    query: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of ``query`` over the paged FP8 cache.

    Args:
        query: ``[num_tokens, Hq, D]`` fp32/fp16/bf16; Hq a multiple of the cache's H.
        cache: the layer's :class:`fp8kv.KVCache`, already holding the new tokens' K/V.
        block_tables: ``[num_seqs, max_blocks]`` int32: block ids of each sequence.
        seq_lens: ``[num_seqs]`` int32: tokens in the cache per sequence, new ones included.
        query_start_loc: ``[num_seqs + 1]`` int32 offsets of each sequence's queries
            (chunked prefill). None: one query token per sequence (decode).
        max_query_len: largest number of query tokens of one sequence, if the caller
            knows it (saves a device sync); computed otherwise.
        softmax_scale: default ``head_size ** -0.5``.
        causal: query ``i`` of ``q_len`` sits at position ``seq_len - q_len + i`` and sees
            keys up to it. False: every query sees all ``seq_len`` keys.
        sliding_window: ``W``: only the last ``W`` visible keys.
        logits_soft_cap: ``c``: scaled logits become ``c * tanh(logits / c)``.
        out: optional ``[num_tokens, Hq, D]`` output in the query dtype.
        backend: ``"auto"`` or a backend name.
    Returns:
        ``[num_tokens, Hq, D]`` in the query dtype (``out`` if given).
    """
    _check_cache(cache)
    dev = cache.device
    H, D = cache.num_kv_heads, cache.head_size
    _check_tensor("query", query, dtypes=IO_DTYPES, ndim=3, device=dev)
    T, Hq = query.shape[0], query.shape[1]
    if query.shape[2] != D:
        raise bad_argument("query", f"head size {query.shape[2]}", f"the cache's head_size {D}")
    if Hq == 0 or Hq % H:
        raise bad_argument("query", f"{Hq} query heads", f"a positive multiple of num_kv_heads={H}")
    _check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=dev)
    _check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=dev)
    S = seq_lens.shape[0]
    if block_tables.shape[0] != S:
        raise bad_argument("block_tables", f"{block_tables.shape[0]} rows", f"one per sequence ({S})")
    if query_start_loc is None:
        if T != S:
            raise bad_argument("query", f"{T} tokens",
                               f"one per sequence ({S}) for decode; pass query_start_loc for prefill")
        query_start_loc = torch.arange(S + 1, dtype=torch.int32, device=dev)
        max_query_len = 1
        chunked = False
    else:
        _check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1, device=dev)
        if query_start_loc.shape[0] != S + 1:
            raise bad_argument("query_start_loc", f"{query_start_loc.shape[0]} entries",
                               f"num_seqs + 1 = {S + 1}")
        chunked = True
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    _positive_finite("softmax_scale", softmax_scale)
    if sliding_window is not None:
        _positive_finite("sliding_window", sliding_window, integer=True)
    if logits_soft_cap is not None:
        _positive_finite("logits_soft_cap", logits_soft_cap)
    if not isinstance(causal, bool):
        raise bad_argument("causal", repr(causal), "True or False")
    if out is None:
        out = torch.empty_like(query)
    else:
        _check_tensor("out", out, dtypes=(query.dtype,), ndim=3, device=dev)
        if out.shape != query.shape:
            raise bad_argument("out", f"shape {tuple(out.shape)}", f"the query's shape {tuple(query.shape)}")
    if _check_values(seq_lens):
        max_query_len = _check_sequence_values(cache, block_tables, seq_lens, query_start_loc, T,
                                               max_query_len, chunked)
    elif max_query_len is None:
        raise bad_argument("max_query_len", None, "an int when value checks are off (graph capture)")
    features = set()
    if chunked and max_query_len > 1:
        features.add("chunked_prefill")
    if sliding_window is not None:
        features.add("sliding_window")
    if logits_soft_cap is not None:
        features.add("soft_cap")
    if not causal:
        features.add("non_causal")
    request = Request("paged_attention", cache.kv_dtype, cache.layout, cache.scale_granularity, D,
                      query.dtype, dev.type, frozenset(features))
    selection = select_backend(request, dev, backend)
    if T:
        selection.backend.paged_attention(
            query=query, cache=cache, block_tables=block_tables, seq_lens=seq_lens,
            query_start_loc=query_start_loc, max_query_len=max_query_len,
            softmax_scale=float(softmax_scale), causal=causal, sliding_window=sliding_window,
            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), out=out,
        )
    return out


def _check_sequence_values(cache, block_tables, seq_lens, query_start_loc, T, max_query_len,
                           chunked) -> int:
    """Check seq_lens / query_start_loc / block_tables values; return the max query length."""
    lens = seq_lens.tolist()
    bs = cache.block_size
    if any(n < 0 for n in lens):
        raise bad_argument("seq_lens", min(lens), "lengths >= 0")
    need = [-(-n // bs) for n in lens]
    if lens and max(need) > block_tables.shape[1]:
        i = max(range(len(lens)), key=lambda j: need[j])
        raise bad_argument("seq_lens", f"{lens[i]} for sequence {i}",
                           f"at most {block_tables.shape[1] * bs} tokens (block_tables has "
                           f"{block_tables.shape[1]} columns of block_size {bs})")
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=False)]
    if chunked:
        if starts[0] != 0 or any(q < 0 for q in q_lens) or starts[-1] != T:
            raise bad_argument("query_start_loc", starts[:8] + (["..."] if len(starts) > 8 else []),
                               f"non-decreasing offsets from 0 to num_tokens={T}")
    for i, (q, n) in enumerate(zip(q_lens, lens, strict=False)):
        if q > n:
            raise bad_argument("seq_lens", f"{n} for sequence {i}",
                               f">= its {q} query tokens (seq_lens include the new tokens)")
    mask = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < seq_lens[:, None].add(
        bs - 1).div(bs, rounding_mode="floor")
    used = block_tables[mask]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.num_blocks):
        bad = used[(used < 0) | (used >= cache.num_blocks)][0]
        raise bad_argument("block_tables", f"block {int(bad)}", f"ids in [0, {cache.num_blocks})")
    computed = max(q_lens, default=0)
    if max_query_len is not None and max_query_len < computed:
        raise bad_argument("max_query_len", max_query_len, f">= the longest query ({computed})")
    return computed if max_query_len is None else max_query_len
