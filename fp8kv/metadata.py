"""The per-step attention metadata: plan once per step, run per layer.

An engine step builds one :class:`AttentionMetadata` with :func:`fp8kv.plan_attention`; every
layer then calls :func:`fp8kv.write_kv` and :func:`fp8kv.paged_attention` with it. Everything
that does not depend on the layer is in it: the checked page table and lengths (int32 buffers the
metadata owns), the derived sizes, the :class:`AttentionOptions`, the backend chosen for the
attention and for the write, and the chosen backend's own plan.

CUDA graphs: capture the per-layer calls with a metadata, then before each replay refill the
metadata's own buffers in place with :meth:`AttentionMetadata.update` (same shapes, lengths
within the planned maxima).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .cache import CacheSpec, KVCache
from .checks import flag, int_at_least, positive_float32
from .errors import bad_argument
from .fp8_attention import check_fp8_options
from .request import Request, Selection
from .step import read_step


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
        softmax_scale = positive_float32("softmax_scale", softmax_scale)
        causal = flag("causal", causal)
        if sliding_window is not None and window_left is not None:
            raise bad_argument("window_left", repr(window_left),
                               f"None when sliding_window={sliding_window!r} is given (one convention at a time: "
                               "sliding_window = W keys, window_left = W - 1)")
        if window_left is not None:
            window_left = int_at_least("window_left", window_left, -1,
                                       "an int >= 0 (W - 1: keys left of the query), or -1 for no window")
            sliding_window = None if window_left == -1 else window_left + 1
        elif sliding_window is not None:
            sliding_window = int_at_least("sliding_window", sliding_window, 1,
                                          "a positive int W (keys visible, its own included) or None; "
                                          "for FlashInfer's convention pass window_left=W-1")
        if logits_soft_cap is not None:
            logits_soft_cap = positive_float32("logits_soft_cap", logits_soft_cap)
        return cls(softmax_scale, causal, sliding_window, logits_soft_cap)

    def with_fp8(self, spec: CacheSpec, num_q_heads: int, fp8_attention, q_scale, prob_scale) -> AttentionOptions:
        """These options with the FP8 mode's arguments checked (:func:`fp8kv.fp8_attention.check_fp8_options`)."""
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


def _fields(spec: CacheSpec) -> tuple:
    """A spec's fields as a plain tuple (compares under ``torch.compile(dynamic=True)``, where the
    dataclass ``__eq__`` of symbolic ints does not trace)."""
    return (spec.kv_dtype, spec.layout, spec.scale_granularity, spec.num_blocks, spec.block_size, spec.num_kv_heads,
            spec.head_size, spec.device)


def _of_options(name: str) -> property:
    """A read-only attribute of the metadata that is its options' ``name``."""
    return property(lambda self: getattr(self.options, name), doc=f"The options' ``{name}``.")


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
        request: the attention :class:`~fp8kv.request.Request`; ``attention``: its
            :class:`~fp8kv.request.Selection`; ``write``: the write's, if slots were given.
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

    softmax_scale = _of_options("softmax_scale")
    causal = _of_options("causal")
    sliding_window = _of_options("sliding_window")
    logits_soft_cap = _of_options("logits_soft_cap")

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
        """Refill the metadata's buffers in place (CUDA-graph replay), checked like :func:`fp8kv.plan_attention`.

        Shapes must equal the planned ones; lengths must stay within the planned
        ``max_query_len`` / ``max_seq_len`` (the backend's plan relies on them). The backend then
        brings its plan up to date in place (``fp8kv_update_plan``: the Hopper prefill re-deals
        its work schedule by the new host lengths, where known and where the new deal fits the
        planned buffer; otherwise the planned one stays, complete for any lengths).
        """
        new = read_step(
            self.spec, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
            slot_mapping=slot_mapping, num_tokens=self.num_tokens, max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len, max_blocks=self.block_tables.shape[1], planned_width=True, validate=validate,
            host_seq_lens=host_seq_lens, host_query_start_loc=host_query_start_loc,
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


__all__ = ["AttentionMetadata", "AttentionOptions"]
