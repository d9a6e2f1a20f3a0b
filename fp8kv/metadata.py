"""Plan once per step, run per layer: the per-step attention metadata.

An engine step builds one :class:`AttentionMetadata` with :func:`plan_attention`; every
layer then calls :func:`fp8kv.write_kv` and :func:`fp8kv.paged_attention` with it. All the
work that does not depend on the layer happens once, here:

* argument checks: types, shapes, dtypes, devices, and the *values* (sequence lengths,
  query offsets, block ids, slot ranges and duplicates) in one host transfer;
* int64 index tensors (vLLM, SGLang) become int32 copies the metadata owns; a CSR page
  table (FlashInfer's ``kv_indptr / kv_indices / kv_last_page_len``) becomes a padded
  block table and sequence lengths, on the device;
* derived quantities: the longest query and sequence, the requested features;
* backend selection for the cache's :class:`~fp8kv.cache.CacheSpec`, and the chosen
  backend's own plan (``fp8kv_plan_attention``: launch configuration, split-KV workspace).

Host syncs: one when values are checked (``validate=True``, the default unless
``FP8KV_CHECK=shapes``); none with ``validate=False`` when the caller passes
``max_query_len`` for chunked prefill (decode needs nothing). Per layer: none.

CUDA graphs: capture the per-layer calls with a metadata, then before each replay refill the
metadata's own buffers in place with :meth:`AttentionMetadata.update` (same shapes, lengths
within the planned maxima).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from . import settings
from .cache import CacheSpec, KVCache
from .errors import InvalidArgument, bad_argument
from .hookspecs import Request

if TYPE_CHECKING:
    from .registry import Selection

IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class AttentionOptions:
    """The attention options of a step (the same for every layer).

    Attributes:
        softmax_scale: multiplies ``q·k`` (default ``head_size ** -0.5``).
        causal: query ``i`` of a sequence's ``q_len`` sits at position ``seq_len - q_len + i``
            and sees keys up to it; False: every query sees all ``seq_len`` keys.
        sliding_window: ``W``: only the last ``W`` visible keys, its own included (vLLM's and
            HF's convention); None: no window. FlashInfer's ``window_left`` is ``W - 1``.
        logits_soft_cap: ``c``: scaled logits become ``c * tanh(logits / c)``; None: off.
        fp8_attention: the opt-in FP8 attention mode (:mod:`fp8kv.fp8_attention`).
        q_scale: FP8 mode: the query scale, float32 ``[]``, ``[H]`` or ``[Hq]`` on the cache's
            device; None: dynamic per (token, head).
        prob_scale: FP8 mode: probabilities are divided by it before their e4m3 rounding.
    """

    softmax_scale: float
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    fp8_attention: bool = False
    q_scale: torch.Tensor | None = field(default=None, compare=False)
    prob_scale: float = 1.0

    @classmethod
    def build(cls, head_size: int, *, softmax_scale=None, causal=True, sliding_window=None, window_left=None,
              logits_soft_cap=None) -> AttentionOptions:
        """Check and normalise user options (``window_left`` becomes ``sliding_window``)."""
        if softmax_scale is None:
            softmax_scale = head_size ** -0.5
        softmax_scale = _positive_float32("softmax_scale", softmax_scale)
        if not isinstance(causal, bool):
            raise bad_argument("causal", repr(causal), "True or False")
        if sliding_window is not None and window_left is not None:
            raise bad_argument("window_left", repr(window_left),
                               f"None when sliding_window={sliding_window!r} is given (one convention at a time: "
                               "sliding_window = W keys, window_left = W - 1)")
        if window_left is not None:
            if not isinstance(window_left, int) or isinstance(window_left, bool) or window_left < -1:
                raise bad_argument("window_left", repr(window_left),
                                   "an int >= 0 (W - 1: keys left of the query), or -1 for no window")
            sliding_window = None if window_left == -1 else window_left + 1
        elif sliding_window is not None:
            if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window <= 0:
                raise bad_argument("sliding_window", repr(sliding_window),
                                   "a positive int W (keys visible, its own included) or None; "
                                   "for FlashInfer's convention pass window_left=W-1")
        if logits_soft_cap is not None:
            logits_soft_cap = _positive_float32("logits_soft_cap", logits_soft_cap)
        return cls(softmax_scale, causal, sliding_window, logits_soft_cap)

    def with_fp8(self, spec: CacheSpec, num_q_heads: int, fp8_attention, q_scale, prob_scale) -> AttentionOptions:
        """These options with the FP8 mode's arguments checked (:func:`fp8kv.fp8_attention.check_fp8_options`)."""
        from .fp8_attention import check_fp8_options

        on, q_scale, prob_scale = check_fp8_options(spec, num_q_heads, fp8_attention, q_scale, prob_scale)
        return replace(self, fp8_attention=on, q_scale=q_scale, prob_scale=prob_scale)

    @property
    def features(self) -> frozenset[str]:
        f = set()
        if self.sliding_window is not None:
            f.add("sliding_window")
        if self.logits_soft_cap is not None:
            f.add("soft_cap")
        if not self.causal:
            f.add("non_causal")
        if self.fp8_attention:
            f.add("fp8_attention")
        return frozenset(f)


def _positive_float32(name: str, x) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.device.type == "cpu":
        x = x.item()
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise bad_argument(name, repr(x), "a finite number > 0 (a Python int or float)")
    if not (math.isfinite(x) and 0 < x <= FLOAT32_MAX):
        raise bad_argument(name, repr(x), f"a finite number > 0 and <= {FLOAT32_MAX:.4g} (float32)")
    return float(x)


def _nonneg_int(name: str, x) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise bad_argument(name, repr(x), "an int >= 0")
    return x


def check_tensor(name: str, t, *, dtypes, ndim: int, device: torch.device, contiguous: bool = True) -> torch.Tensor:
    """Type, dtype, rank, device and (optionally) contiguity of one argument."""
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


def _index(name: str, t, ndim: int, device: torch.device) -> torch.Tensor:
    """A contiguous int32 copy of an int32/int64 index tensor (owned by the metadata)."""
    check_tensor(name, t, dtypes=INDEX_DTYPES, ndim=ndim, device=device, contiguous=False)
    return t.to(torch.int32, copy=True, memory_format=torch.contiguous_format)


def values_checked(device: torch.device, validate: bool | None) -> bool:
    """Whether to read index values on the host: ``validate``, else ``FP8KV_CHECK``; never while
    a CUDA graph is being captured."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return settings.check_values() if validate is None else bool(validate)


# ----------------------------------------------------------------------------------- slots
def slot_stats(slot_mapping: torch.Tensor) -> list[torch.Tensor]:
    """Device scalars (no sync): max slot, min slot, and 1 if a valid slot repeats."""
    if slot_mapping.numel() == 0:
        z = torch.zeros((), dtype=torch.int64, device=slot_mapping.device)
        return [z - 1, z, z]
    s = slot_mapping.to(torch.int64)
    srt = torch.sort(s).values
    dup = ((srt[1:] == srt[:-1]) & (srt[1:] >= 0)).any().to(torch.int64) if s.numel() > 1 else s.new_zeros(())
    return [s.max(), s.min(), dup]


def check_slot_values(spec: CacheSpec, slot_mapping: torch.Tensor, hi: int, dup: int) -> None:
    """Raise for a slot past the cache or a slot written twice (values from :func:`slot_stats`)."""
    if hi >= spec.num_slots:
        raise bad_argument("slot_mapping", f"slot {hi}",
                           f"slots < num_blocks * block_size = {spec.num_slots} (negative = padding)")
    if dup:
        valid = slot_mapping[slot_mapping >= 0]
        vals, counts = torch.unique(valid, return_counts=True)
        raise bad_argument("slot_mapping", f"slot {int(vals[counts > 1][0])} more than once",
                           "each slot written at most once")


def check_slot_mapping(spec: CacheSpec, slot_mapping, num_tokens: int, validate: bool | None) -> torch.Tensor:
    """Check a write's ``slot_mapping [num_tokens]`` (values: one host transfer, if checked)."""
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=spec.device)
    if slot_mapping.shape[0] != num_tokens:
        raise bad_argument("slot_mapping", f"{slot_mapping.shape[0]} entries", f"one per token ({num_tokens})")
    if num_tokens and values_checked(spec.device, validate):
        hi, _, dup = torch.stack(slot_stats(slot_mapping)).tolist()
        check_slot_values(spec, slot_mapping, hi, dup)
    return slot_mapping


def _fields(spec: CacheSpec) -> tuple:
    """A spec's fields as a plain tuple (compares under ``torch.compile(dynamic=True)``, where the
    dataclass ``__eq__`` of symbolic ints does not trace)."""
    return (spec.kv_dtype, spec.layout, spec.scale_granularity, spec.num_blocks, spec.block_size, spec.num_kv_heads,
            spec.head_size, spec.device)


# ---------------------------------------------------------------------------- the metadata
@dataclass
class AttentionMetadata:
    """One step's attention metadata, shared by every layer (see the module docstring).

    Build it with :func:`plan_attention`. Attributes (read-only by convention; the tensors
    are the metadata's own buffers, refilled in place by :meth:`update`):

        spec: the :class:`~fp8kv.cache.CacheSpec` every cache used with it must have.
        num_q_heads / query_dtype: Hq and the dtype of the queries (and of written K/V).
        num_tokens: query tokens of the step (``T``).
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32: cached tokens per sequence, the step's included.
        query_start_loc: ``[num_seqs + 1]`` int32 offsets of each sequence's queries.
        is_decode: one query per sequence (no ``query_start_loc`` was given).
        slot_mapping: ``[num_written]`` int32/int64 slots of the step's K/V (or None).
        max_query_len / max_seq_len: upper bounds the kernels may rely on.
        options: the :class:`AttentionOptions`.
        request: the attention :class:`~fp8kv.hookspecs.Request`; ``attention``: its
            :class:`~fp8kv.registry.Selection`; ``write``: the write's, if slots were given.
        backend_plan: what the attention backend's ``fp8kv_plan_attention`` returned.
    """

    spec: CacheSpec
    num_q_heads: int
    query_dtype: torch.dtype
    num_tokens: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    is_decode: bool
    slot_mapping: torch.Tensor | None
    max_query_len: int
    max_seq_len: int
    options: AttentionOptions
    request: Request
    attention: Selection
    write: Selection | None
    backend_plan: Any = None
    host_seq_lens: list[int] | None = None
    host_query_start_loc: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def backend(self) -> str:
        """The name of the backend that serves this metadata's attention."""
        return self.attention.backend.name

    @property
    def softmax_scale(self) -> float:
        return self.options.softmax_scale

    @property
    def causal(self) -> bool:
        return self.options.causal

    @property
    def sliding_window(self) -> int | None:
        return self.options.sliding_window

    @property
    def logits_soft_cap(self) -> float | None:
        return self.options.logits_soft_cap

    def check_cache(self, cache) -> KVCache:
        """``cache`` has this metadata's spec (else a named error)."""
        if not isinstance(cache, KVCache):
            raise bad_argument("cache", type(cache).__name__, "an fp8kv.KVCache")
        if cache.spec is not self.spec and _fields(cache.spec) != _fields(self.spec):
            raise bad_argument("cache", cache.spec.describe(),
                               f"a cache like the one the metadata was planned for: {self.spec.describe()}")
        return cache

    def update(self, *, block_tables=None, seq_lens=None, query_start_loc=None, slot_mapping=None,
               kv_indptr=None, kv_indices=None, kv_last_page_len=None, validate: bool | None = None,
               host_seq_lens: Sequence[int] | None = None, host_query_start_loc: Sequence[int] | None = None) -> None:
        """Refill the metadata's buffers in place (CUDA-graph replay), checked like :func:`plan_attention`.

        Shapes must equal the planned ones; lengths must stay within the planned
        ``max_query_len`` / ``max_seq_len`` (the backend's plan relies on them). The backend then
        brings its plan up to date in place (``fp8kv_update_plan``: the Hopper prefill re-deals
        its work schedule by the new host lengths, where known and where the new deal fits the
        planned buffer; otherwise the planned one stays, complete for any lengths).
        """
        new = plan_attention(
            self.spec, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
            slot_mapping=slot_mapping, num_q_heads=self.num_q_heads, query_dtype=self.query_dtype,
            num_tokens=self.num_tokens, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
            max_blocks=self.block_tables.shape[1], validate=validate, host_seq_lens=host_seq_lens,
            host_query_start_loc=host_query_start_loc, _options=self.options,
            _selections=(self.attention, self.write),
        )
        if new.is_decode != self.is_decode:
            raise bad_argument("query_start_loc", "a different kind of step",
                               "the planned one (decode without query_start_loc, prefill with it)")
        for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
            mine, theirs = getattr(self, name), getattr(new, name)
            if (mine is None) != (theirs is None) or (mine is not None and mine.shape != theirs.shape):
                raise bad_argument(name, "None" if theirs is None else f"shape {tuple(theirs.shape)}",
                                   "None" if mine is None else f"the planned shape {tuple(mine.shape)}")
        self.block_tables.copy_(new.block_tables)
        self.seq_lens.copy_(new.seq_lens)
        self.query_start_loc.copy_(new.query_start_loc)
        if self.slot_mapping is not None:
            self.slot_mapping.copy_(new.slot_mapping)
        self.host_seq_lens, self.host_query_start_loc = new.host_seq_lens, new.host_query_start_loc
        self.attention.backend.update_plan(self.attention.device, self)


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
    _options: AttentionOptions | None = None,
    _selections: tuple | None = None,
) -> AttentionMetadata:
    """Build the step's :class:`AttentionMetadata` (checks, derived sizes, backend choice).

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
    """
    from .registry import select_backend

    spec = cache.spec if isinstance(cache, KVCache) else cache
    if not isinstance(spec, CacheSpec):
        raise bad_argument("cache", type(cache).__name__, "an fp8kv.KVCache (or its spec)")
    dev, H, D, bs = spec.device, spec.num_kv_heads, spec.head_size, spec.block_size
    if not isinstance(num_q_heads, int) or isinstance(num_q_heads, bool) or num_q_heads <= 0 or num_q_heads % H:
        raise bad_argument("num_q_heads", repr(num_q_heads), f"a positive multiple of num_kv_heads={H}")
    if query_dtype not in IO_DTYPES:
        raise bad_argument("query_dtype", repr(query_dtype), f"one of {[str(d) for d in IO_DTYPES]}")
    options = _options or AttentionOptions.build(
        D, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window, window_left=window_left,
        logits_soft_cap=logits_soft_cap).with_fp8(spec, num_q_heads, fp8_attention, q_scale, prob_scale)
    for name, v in (("num_tokens", num_tokens), ("max_query_len", max_query_len), ("max_seq_len", max_seq_len),
                    ("max_blocks", max_blocks)):
        if v is not None:
            _nonneg_int(name, v)
    check = values_checked(dev, validate)

    # ---- the page table: padded, or CSR (converted below, after the one transfer)
    csr = kv_indptr is not None or kv_indices is not None or kv_last_page_len is not None
    if csr:
        if block_tables is not None or seq_lens is not None:
            raise bad_argument("block_tables/seq_lens", "given with kv_indptr/kv_indices/kv_last_page_len",
                               "one page-table form: padded (block_tables, seq_lens) or CSR")
        indptr = _index("kv_indptr", kv_indptr, 1, dev)
        indices = _index("kv_indices", kv_indices, 1, dev)
        last = _index("kv_last_page_len", kv_last_page_len, 1, dev)
        S = last.shape[0]
        if indptr.shape[0] != S + 1:
            raise bad_argument("kv_indptr", f"{indptr.shape[0]} entries", f"num_seqs + 1 = {S + 1}")
        pages = indptr[1:] - indptr[:-1]
        lens = torch.where(pages > 0, (pages - 1) * bs + last, torch.zeros_like(last))
    else:
        if block_tables is None or seq_lens is None:
            raise bad_argument("block_tables/seq_lens", "None",
                               "a padded page table (block_tables and seq_lens) or a CSR one (kv_indptr, ...)")
        tables = _index("block_tables", block_tables, 2, dev)
        lens = _index("seq_lens", seq_lens, 1, dev)
        S = lens.shape[0]
        if tables.shape[0] != S:
            raise bad_argument("block_tables", f"{tables.shape[0]} rows", f"one per sequence ({S})")

    # ---- queries
    if query_start_loc is None:
        if num_tokens is not None and num_tokens != S:
            raise bad_argument("num_tokens", num_tokens,
                               f"one per sequence ({S}) for decode; pass query_start_loc for prefill")
        num_tokens, decode = S, True
        qsl = torch.arange(S + 1, dtype=torch.int32, device=dev)
        if max_query_len is not None and max_query_len < 1 and S:
            raise bad_argument("max_query_len", max_query_len, ">= 1 for decode")
        max_query_len = 1
    else:
        qsl = _index("query_start_loc", query_start_loc, 1, dev)
        if qsl.shape[0] != S + 1:
            raise bad_argument("query_start_loc", f"{qsl.shape[0]} entries", f"num_seqs + 1 = {S + 1}")
        decode = False
    if slot_mapping is not None:
        check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=dev)

    # ---- one host transfer: every value check and the derived sizes
    need = []  # (name, device scalar)
    if check or (not decode and (num_tokens is None or max_query_len is None)) or (csr and max_blocks is None
                                                                                   and max_seq_len is None):
        z = torch.zeros((), dtype=torch.int64, device=dev)
        amax = (lambda t: t.max().to(torch.int64)) if S else (lambda t: z)
        amin = (lambda t: t.min().to(torch.int64)) if S else (lambda t: z)
        q_lens = (qsl[1:] - qsl[:-1]).to(torch.int64)
        need += [("max_seq_len", amax(lens)), ("min_seq_len", amin(lens)),
                 ("max_query_len", amax(q_lens)), ("min_query_len", amin(q_lens)),
                 ("qsl_first", qsl[0].to(torch.int64)), ("qsl_last", qsl[-1].to(torch.int64)),
                 ("q_over_seq", amax(q_lens - lens.to(torch.int64)) if S else z - 1)]
        if check:
            originals = [t for t in (block_tables, seq_lens, query_start_loc, kv_indptr, kv_indices, kv_last_page_len)
                         if isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.numel()]
            need += [("int64_max", torch.stack([t.max() for t in originals]).max() if originals else z),
                     ("int64_min", torch.stack([t.min() for t in originals]).min() if originals else z)]
            if csr:
                need += [("indptr_first", indptr[0].to(torch.int64)),
                         ("indptr_last", indptr[-1].to(torch.int64)),
                         ("min_pages", amin(pages)), ("max_pages", amax(pages)),
                         ("min_last", amin(torch.where(pages > 0, last, torch.ones_like(last)))),
                         ("max_last", amax(torch.where(pages > 0, last, torch.ones_like(last))))]
                used, in_use = indices, torch.ones_like(indices, dtype=torch.bool)
            else:  # the entries each sequence reads; masked with where (boolean indexing would sync)
                cols = torch.arange(tables.shape[1], device=dev)
                used = tables
                in_use = cols[None, :] < (lens[:, None] + bs - 1).div(bs, rounding_mode="floor")
            if used.numel():  # with no entry in use: min INT32_MAX, max -1, both in range
                need += [("min_block", torch.where(in_use, used, INT32_MAX).min().to(torch.int64)),
                         ("max_block", torch.where(in_use, used, -1).max().to(torch.int64))]
            if slot_mapping is not None:
                hi, _, dup = slot_stats(slot_mapping)
                need += [("max_slot", hi), ("dup_slot", dup)]
        elif csr:
            need += [("max_pages", amax(pages))]
        values = torch.stack([v for _, v in need])
        if check:  # the lengths ride along (backends plan the step by them)
            values = torch.cat([values, lens.to(torch.int64), qsl.to(torch.int64)])
        flat = values.tolist()
        host = dict(zip([n for n, _ in need], flat[:len(need)], strict=True))
    else:
        host, flat = {}, []
    read = (flat[len(need):len(need) + S], flat[len(need) + S:]) if check else (None, None)
    host_lens, host_qsl = (_host_ints(name, given, want, got) for name, given, want, got in (
        ("host_seq_lens", host_seq_lens, S, read[0]), ("host_query_start_loc", host_query_start_loc, S + 1, read[1])))

    if check:
        _check_values(spec, host, S, decode, num_tokens, max_query_len, max_seq_len, csr, lens, qsl,
                      indices if csr else None, None if csr else tables, slot_mapping, max_blocks)
    if num_tokens is None:
        num_tokens = host["qsl_last"]
    if not decode and max_query_len is None:
        max_query_len = host["max_query_len"]
    max_query_len = min(max_query_len, num_tokens)  # no query is longer than the step (unchecked input)

    # ---- the padded page table
    if csr:
        if max_blocks is None:
            max_blocks = -(-max_seq_len // bs) if max_seq_len is not None else host["max_pages"]
        cols = torch.arange(max_blocks, device=dev, dtype=torch.int32)
        pos = indptr[:-1, None] + cols[None, :]
        inside = pos < indptr[1:, None]
        if indices.numel():
            tables = torch.where(inside, indices[pos.clamp(0, indices.numel() - 1).long()], 0).to(torch.int32)
        else:
            tables = torch.zeros((S, max_blocks), dtype=torch.int32, device=dev)
    if max_seq_len is None:
        max_seq_len = host.get("max_seq_len", tables.shape[1] * bs)
    if slot_mapping is not None:
        slot_mapping = slot_mapping.clone()

    # ---- backend selection and the backend's plan
    features = set(options.features)
    if not decode and max_query_len > 1:
        features.add("chunked_prefill")
    request = Request.for_attention(spec, query_dtype, frozenset(features))
    if _selections is not None and _selections[0].request == request:
        attention, write = _selections
    else:
        attention = select_backend(request, dev, backend)
        write = select_backend(Request.for_write(spec, query_dtype), dev, backend) \
            if slot_mapping is not None else None
    meta = AttentionMetadata(spec, num_q_heads, query_dtype, num_tokens, tables, lens, qsl, decode, slot_mapping,
                             max_query_len, max_seq_len, options, request, attention, write,
                             host_seq_lens=host_lens, host_query_start_loc=host_qsl)
    if _selections is None:
        meta.backend_plan = attention.backend.plan_attention(attention.device, meta)
    return meta


def _host_ints(name: str, given, want: int, read: list[int] | None) -> list[int] | None:
    """The caller's host copy ``given`` of a length tensor as a list of ints, checked (``want`` values,
    int64, equal to ``read``, the tensor's values where they were read); ``read`` where none was given."""
    if given is None:
        return read
    try:
        given = [operator.index(x) for x in given]
    except TypeError:
        raise bad_argument(name, type(given).__name__, "a sequence of Python ints") from None
    if any(not -(2**63) <= x < 2**63 for x in given):
        raise bad_argument(name, "a value outside int64", "int64 values, as the tensor's")
    if len(given) != want or (read is not None and given != read):
        raise bad_argument(name, f"{len(given)} values" if len(given) != want else "other values than the tensor's",
                           f"{want} host ints equal to the tensor's")
    return given


def _check_values(spec, host, S, decode, num_tokens, max_query_len, max_seq_len, csr, lens, qsl, indices, tables,
                  slot_mapping, max_blocks) -> None:
    """Raise the named error for the first bad value (values from the one host transfer)."""
    bs = spec.block_size
    if host.get("int64_max", 0) > INT32_MAX or host.get("int64_min", 0) < -INT32_MAX - 1:
        raise bad_argument("index tensors", f"a value {host['int64_max']} / {host['int64_min']}",
                           "values within int32 (block ids, lengths and offsets are stored as int32)")
    if csr:
        if host["indptr_first"] != 0 or host["min_pages"] < 0 or host["indptr_last"] > (indices.numel()):
            raise bad_argument("kv_indptr", f"offsets from {host['indptr_first']} to {host['indptr_last']}",
                               f"non-decreasing offsets from 0 to at most len(kv_indices)={indices.numel()}")
        if S and (host["min_last"] < 1 or host["max_last"] > bs):
            raise bad_argument("kv_last_page_len", f"values in [{host['min_last']}, {host['max_last']}]",
                               f"1..block_size={bs} for sequences with pages")
        if max_blocks is not None and host["max_pages"] > max_blocks:
            raise bad_argument("max_blocks", max_blocks, f">= the most pages of a sequence ({host['max_pages']})")
    if S and host["min_seq_len"] < 0:
        raise bad_argument("seq_lens", host["min_seq_len"], "lengths >= 0")
    if tables is not None and S and host["max_seq_len"] > tables.shape[1] * bs:
        i = int(lens.argmax())
        raise bad_argument("seq_lens", f"{host['max_seq_len']} for sequence {i}",
                           f"at most {tables.shape[1] * bs} tokens (block_tables has {tables.shape[1]} columns of "
                           f"block_size {bs})")
    if not decode:
        if host["qsl_first"] != 0 or (S and host["min_query_len"] < 0) or (
                num_tokens is not None and host["qsl_last"] != num_tokens):
            starts = qsl.tolist()
            raise bad_argument("query_start_loc", starts[:8] + (["..."] if len(starts) > 8 else []),
                               "non-decreasing offsets from 0 to num_tokens"
                               + (f"={num_tokens}" if num_tokens is not None else ""))
    if S and host["q_over_seq"] > 0:
        i = int(((qsl[1:] - qsl[:-1]) > lens).nonzero()[0, 0])
        raise bad_argument("seq_lens", f"{int(lens[i])} for sequence {i}",
                           f">= its {int(qsl[i + 1] - qsl[i])} query tokens (seq_lens include the new tokens)")
    if max_query_len is not None and S and max_query_len < host["max_query_len"]:
        raise bad_argument("max_query_len", max_query_len, f">= the longest query ({host['max_query_len']})")
    if max_seq_len is not None and S and max_seq_len < host["max_seq_len"]:
        raise bad_argument("max_seq_len", max_seq_len, f">= the longest sequence ({host['max_seq_len']})")
    if "min_block" in host and (host["min_block"] < 0 or host["max_block"] >= spec.num_blocks):
        bad = host["min_block"] if host["min_block"] < 0 else host["max_block"]
        raise bad_argument("kv_indices" if csr else "block_tables", f"block {bad}",
                           f"ids in [0, {spec.num_blocks})")
    if "max_slot" in host:
        check_slot_values(spec, slot_mapping, host["max_slot"], host["dup_slot"])


__all__ = ["AttentionMetadata", "AttentionOptions", "InvalidArgument", "plan_attention"]
