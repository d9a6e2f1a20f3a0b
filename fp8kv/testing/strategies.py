"""Hypothesis strategies for paged-KV workloads, and the :class:`Workload` they draw.

A :class:`Workload` is a frozen, hashable description (plain ints, floats, strings and
tuples, so a failing one can be pasted into ``@example(...)``); its tensors are built
from its ``seed``, deterministically, on any device. One workload serves both ops:

* the **write**: every token of every sequence, in shuffled order with padding entries
  (negative slots) mixed in, written by one ``write_kv`` call into a cache whose bytes
  were poisoned beforehand (``poison``);
* the **attention**: queries for the last ``q_lens[i]`` positions of each sequence
  (decode when ``chunked`` is False: one per sequence) over that cache.

Block tables are shuffled over more physical blocks than needed (holes), and their
unused entries hold ``table_fill`` (0 or -1). ``specials`` adds inf/-inf/NaN/-0 and huge
values to the written K/V (write checks only; attention is checked on finite data).

Example::

    from hypothesis import given
    from fp8kv.testing import workloads

    @given(wl=workloads(max_seqs=2, max_seq_len=32, head_sizes=(16, 32)))
    def test_something(wl):
        cache = wl.fill_cache("reference")
        t = wl.tensors()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from hypothesis import strategies as st

from ..cache import CacheSpec, KVCache
from ..formats import FORMATS
from ..metadata import AttentionOptions
from ..request import Request

__all__ = ["POISONS", "Workload", "WorkloadTensors", "workloads"]

POISONS = ("zero", "finite", "nan")
"""What the cache holds before the write: zeros, random finite codes, or NaN-rich bytes."""

ALL_FORMATS = tuple(FORMATS)
ALL_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class WorkloadTensors:
    """The tensors of a :class:`Workload` on one device.

    Attributes:
        key, value: ``[num_write, H, D]`` in ``io_dtype`` (padding rows included).
        slot_mapping: ``[num_write]`` int64 or int32, negative = padding.
        query: ``[num_tokens, Hq, D]`` in ``io_dtype``.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32.
        query_start_loc: ``[num_seqs + 1]`` int32, or None for decode.
    """

    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    query: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None


@dataclass(frozen=True)
class Workload:
    """One drawn paged-KV workload (see the module docstring for what each op does with it).

    Attributes:
        seed: seeds every random tensor (K, V, query, poison).
        kv_dtype, layout, scale_granularity: the cache configuration.
        num_kv_heads, num_q_heads, head_size: H, Hq (a multiple of H), D.
        block_size, num_blocks: cache geometry (``num_blocks`` >= what the tables use).
        seq_lens: tokens per sequence (>= 1).
        q_lens: query tokens per sequence (``0 <= q_lens[i] <= seq_lens[i]``; all 1 for decode).
        chunked: pass ``query_start_loc`` (chunked prefill); False = decode.
        block_tables: one row per sequence, all rows ``max_blocks`` long.
        write_slots: the write's slot mapping: every sequence token once, shuffled, with
            negative padding entries.
        slot_dtype: ``"int64"`` or ``"int32"``.
        io_dtype: dtype of key, value and query.
        k_scale, v_scale: static dequant scales (1 value for tensor, H for head; None for token_head).
        amplitude: K/V are ``amplitude * N(0, 1)`` with a few 8x outliers.
        specials: add inf/-inf/NaN/-0/huge values to the written K/V (write only).
        causal, sliding_window, soft_cap, softmax_scale: attention options (None = default/off).
        poison: what the cache bytes (and token_head scales) hold before the write.
        fp8_attention, q_scale, prob_scale: the FP8 attention mode (:mod:`fp8kv.fp8_attention`):
            ``q_scale`` 1 value (per tensor), H (per KV head) or Hq (per query head), None = dynamic.
    """

    seed: int
    kv_dtype: str
    layout: str
    scale_granularity: str
    num_kv_heads: int
    num_q_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    chunked: bool
    block_tables: tuple[tuple[int, ...], ...]
    write_slots: tuple[int, ...]
    slot_dtype: str
    io_dtype: torch.dtype
    k_scale: tuple[float, ...] | None
    v_scale: tuple[float, ...] | None
    amplitude: float = 1.0
    specials: bool = False
    causal: bool = True
    sliding_window: int | None = None
    soft_cap: float | None = None
    softmax_scale: float | None = None
    poison: str = "zero"
    fp8_attention: bool = False
    q_scale: tuple[float, ...] | None = None
    prob_scale: float = 1.0

    # -- derived -------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the attention call."""
        return sum(self.q_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)

    def features(self) -> frozenset[str]:
        """The attention features this workload asks for (derived as :func:`fp8kv.plan_attention` does)."""
        f = set(AttentionOptions.build(self.head_size, **self.attention_kwargs()).features)
        if self.chunked and self.max_query_len > 1:
            f.add("chunked_prefill")
        if self.fp8_attention:
            f.add("fp8_attention")
        return frozenset(f)

    def spec(self, device_type: str = "cpu") -> CacheSpec:
        """The :class:`~fp8kv.cache.CacheSpec` of this workload's cache."""
        return CacheSpec(self.kv_dtype, self.layout, self.scale_granularity, self.num_blocks, self.block_size,
                         self.num_kv_heads, self.head_size, torch.device(device_type))

    def request(self, op: str, device_type: str = "cpu") -> Request:
        """The :class:`~fp8kv.hookspecs.Request` the API builds for ``op`` on this workload."""
        if op == "write_kv":
            return Request.for_write(self.spec(device_type), self.io_dtype)
        return Request.for_attention(self.spec(device_type), self.io_dtype, self.features())

    def without_specials(self) -> Workload:
        return replace(self, specials=False)

    # -- tensors -------------------------------------------------------------------
    def _generator(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt) % (2**63))

    def key_value(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``key, value [num_write, H, D]`` in ``io_dtype`` (padding rows are random too)."""
        n, H, D = len(self.write_slots), self.num_kv_heads, self.head_size
        out = []
        for salt in (1, 2):
            g = self._generator(salt)
            x = torch.randn(n, H, D, generator=g) * self.amplitude
            outlier = torch.rand(n, H, D, generator=g) < 0.02
            x = torch.where(outlier, x * 8, x)
            if self.specials and x.numel():
                pick = torch.randint(0, 8, (n, H, D), generator=g)
                big = torch.finfo(self.io_dtype).max
                for code, val in ((1, math.inf), (2, -math.inf), (3, math.nan), (4, -0.0), (5, big / 2)):
                    x = torch.where((pick == code) & (torch.rand(n, H, D, generator=g) < 0.05),
                                    torch.tensor(val), x)
            out.append(x.to(self.io_dtype).to(device))
        return out[0], out[1]

    def tensors(self, device: torch.device | str = "cpu") -> WorkloadTensors:
        """Every input tensor, built from ``seed`` (identical on every call and device)."""
        key, value = self.key_value(device)
        g = self._generator(3)
        query = torch.randn(self.num_tokens, self.num_q_heads, self.head_size, generator=g)
        i32 = dict(dtype=torch.int32, device=device)
        qsl = None
        if self.chunked:
            qsl = torch.tensor([0, *np.cumsum(self.q_lens).tolist()], **i32)
        return WorkloadTensors(
            key=key, value=value,
            slot_mapping=torch.tensor(self.write_slots, dtype=getattr(torch, self.slot_dtype), device=device),
            query=query.to(self.io_dtype).to(device),
            block_tables=torch.tensor(self.block_tables, **i32).reshape(self.num_seqs, -1),
            seq_lens=torch.tensor(self.seq_lens, **i32), query_start_loc=qsl,
        )

    def attention_kwargs(self) -> dict:
        """Keyword arguments of :func:`fp8kv.paged_attention` besides the tensors."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal,
                    sliding_window=self.sliding_window, logits_soft_cap=self.soft_cap)

    def fp8_kwargs(self, device: torch.device | str = "cpu") -> dict:
        """The FP8-mode keywords of :func:`fp8kv.plan_attention` (empty in the default mode)."""
        if not self.fp8_attention:
            return {}
        qs = None
        if self.q_scale is not None:
            qs = torch.tensor(self.q_scale, dtype=torch.float32, device=device)
            qs = qs.reshape(()) if len(self.q_scale) == 1 else qs
        return dict(fp8_attention=True, q_scale=qs, prob_scale=self.prob_scale)

    def mapped_slots(self) -> list[int]:
        """Every slot the write touches."""
        return sorted(s for s in self.write_slots if s >= 0)

    def allocate_cache(self, device: torch.device | str = "cpu") -> KVCache:
        """A cache of this configuration whose bytes are poisoned (deterministically)."""
        static = self.scale_granularity != "token_head"
        cache = KVCache.allocate(
            self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, kv_dtype=self.kv_dtype,
            layout=self.layout, scale_granularity=self.scale_granularity,
            k_scale=torch.tensor(self.k_scale) if static else None,
            v_scale=torch.tensor(self.v_scale) if static else None, device=device,
        )
        if self.poison == "zero":
            return cache
        g = self._generator(4)
        fmt = cache.fmt
        bad = torch.tensor(fmt.nan_encodings + fmt.inf_encodings, dtype=torch.uint8)
        for c in (cache.key_cache, cache.value_cache):
            b = torch.randint(0, 256, c.shape, generator=g, dtype=torch.uint8)
            if self.poison == "finite":
                b = torch.where(torch.isin(b, bad), b & 0x0F, b)  # low codes are finite in every format
            else:  # nan: a third of the bytes are NaN
                nan = torch.tensor(fmt.nan_encodings[0], dtype=torch.uint8)
                b = torch.where(torch.rand(c.shape, generator=g) < 0.33, nan, b)
            c.view(torch.uint8).copy_(b.to(c.device))
        if not static:
            for s in (cache.k_scale, cache.v_scale):
                p = torch.rand(s.shape, generator=g) * 100 if self.poison == "finite" \
                    else torch.full(s.shape, math.nan)
                s.copy_(p.to(s.device))
        return cache

    def fill_cache(self, backend: str = "reference", device: torch.device | str = "cpu") -> KVCache:
        """Allocate (poisoned) and write every sequence token through ``backend`` via the API.

        Uses finite K/V (``specials`` off): this is the cache attention is checked on.
        """
        from ..api import write_kv_one_shot

        cache = self.allocate_cache(device)
        key, value = self.without_specials().key_value(device)
        slots = torch.tensor(self.write_slots, dtype=getattr(torch, self.slot_dtype), device=device)
        write_kv_one_shot(cache, key, value, slots, backend=backend)
        return cache


def _f32(x: float) -> float:
    return float(np.float32(x))


@st.composite
def _scales(draw, n: int, fmt_max: float, amplitude: float) -> tuple[float, ...]:
    """``n`` float32 scales: calibrated, non-power-of-two, powers of two, tiny (saturating), huge."""
    calibrated = amplitude * 4.0 / fmt_max

    def one():
        kind = draw(st.sampled_from(("calibrated", "odd", "pow2", "one", "tiny", "huge", "extreme")))
        if kind == "calibrated":
            return calibrated
        if kind == "odd":  # non-power-of-two, around calibrated
            return calibrated * draw(st.floats(0.3, 3.0, allow_nan=False))
        if kind == "pow2":
            return 2.0 ** draw(st.integers(-12, 4))
        if kind == "one":
            return 1.0
        if kind == "tiny":  # most values saturate to +-max
            return calibrated * draw(st.sampled_from((1e-3, 1e-5, 0.037)))
        if kind == "huge":  # most values round to zero or subnormals
            return calibrated * draw(st.sampled_from((1e3, 1e6, 77.7)))
        return draw(st.sampled_from((2.0**-126, 1e-30, 1e30, 3.0e38)))

    return tuple(_f32(one()) for _ in range(n))


@st.composite
def workloads(
    draw,
    *,
    max_seqs: int = 3,
    max_seq_len: int = 48,
    head_sizes: tuple[int, ...] = (16, 32, 64, 128),
    kv_dtypes: tuple[str, ...] = ALL_FORMATS,
    layouts: tuple[str, ...] = ("NHD", "HND"),
    granularities: tuple[str, ...] = ("tensor", "head", "token_head"),
    io_dtypes: tuple[torch.dtype, ...] = ALL_IO_DTYPES,
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
    max_kv_heads: int = 3,
    gqa_ratios: tuple[int, ...] = (1, 2, 4),
    decode: bool = True,
    chunked_prefill: bool = True,
    sliding_window: bool = True,
    soft_cap: bool = True,
    non_causal: bool = True,
    specials: bool = True,
    poisons: tuple[str, ...] = POISONS,
    max_pads: int = 3,
    max_holes: int = 3,
    fp8_attention: bool | str = False,
) -> Workload:
    """Draw a :class:`Workload`; every argument narrows what is drawn.

    For the Triton CPU interpreter keep it tiny, e.g. ``max_seqs=2, max_seq_len=32,
    head_sizes=(16, 32)``. ``decode``/``chunked_prefill`` choose which attention shapes
    appear (at least one must be True); ``sliding_window``, ``soft_cap``, ``non_causal``
    and ``specials`` allow those options (each is still off in many examples); ``fp8_attention``
    allows the FP8 attention mode where it is defined (fp8_e4m3, tensor or head scales); ``"only"``
    draws it whenever the cache allows it (a few examples then always exercise the mode).
    """
    if not (decode or chunked_prefill):
        raise ValueError("workloads: at least one of decode / chunked_prefill must be allowed")
    kv_dtype = draw(st.sampled_from(kv_dtypes))
    layout = draw(st.sampled_from(layouts))
    gran = draw(st.sampled_from(granularities))
    D = draw(st.sampled_from(head_sizes))
    H = draw(st.integers(1, max_kv_heads))
    Hq = H * draw(st.sampled_from(gqa_ratios))
    bs = draw(st.sampled_from(block_sizes))
    io_dtype = draw(st.sampled_from(io_dtypes))
    S = draw(st.integers(1, max_seqs))
    seq_lens = tuple(draw(st.lists(st.integers(1, max_seq_len), min_size=S, max_size=S)))
    chunked = draw(st.booleans()) if (decode and chunked_prefill) else chunked_prefill
    if chunked:
        q_lens = tuple(draw(st.integers(0, n)) for n in seq_lens)
    else:
        q_lens = (1,) * S
    # block tables: shuffled physical blocks with unused ones in between (holes)
    need = [-(-n // bs) for n in seq_lens]
    holes = draw(st.integers(0, max_holes))
    num_blocks = sum(need) + holes
    perm = draw(st.permutations(range(num_blocks)))
    width = max(need) + draw(st.integers(0, 2))
    fill = draw(st.sampled_from((0, -1)))
    tables, at = [], 0
    for k in need:
        row = list(perm[at:at + k])
        at += k
        tables.append(tuple(row + [fill] * (width - k)))
    slots = [tables[i][p // bs] * bs + p % bs for i, n in enumerate(seq_lens) for p in range(n)]
    pads = draw(st.lists(st.sampled_from((-1, -2, -1000)), max_size=max_pads))
    order = draw(st.permutations(slots + pads))
    amplitude = draw(st.sampled_from((1.0, 0.01, 37.0, 1000.0)))
    fmt_max = FORMATS[kv_dtype].max
    if gran == "token_head":
        k_scale = v_scale = None
    else:
        n = 1 if gran == "tensor" else H
        k_scale = draw(_scales(n, fmt_max, amplitude))
        v_scale = draw(_scales(n, fmt_max, amplitude))
    causal = not (non_causal and draw(st.integers(0, 4)) == 0)
    window = draw(st.one_of(st.none(), st.integers(1, max_seq_len + 2))) if sliding_window else None
    cap = draw(st.one_of(st.none(), st.sampled_from((1.0, 5.0, 30.0)),
                         st.floats(0.5, 50.0).map(_f32))) if soft_cap else None
    sm_scale = draw(st.one_of(st.none(), st.floats(0.01, 2.0).map(_f32)))
    fp8 = bool(fp8_attention) and kv_dtype == "fp8_e4m3" and gran in ("tensor", "head") \
        and (fp8_attention == "only" or draw(st.booleans()))
    q_scale, prob_scale = None, 1.0
    if fp8:  # dynamic, or static ones that fit the query, saturate it, or waste its range
        q_scale = draw(st.sampled_from((None, "tensor", "head", "q_head")))
        if q_scale is not None:
            n = {"tensor": 1, "head": H, "q_head": Hq}[q_scale]
            q_scale = tuple(draw(st.sampled_from((0.01, 2.0**-6, 1.0, 3e-5))) for _ in range(n))
        # 1/448: a calibrated checkpoint's (p <= 1 fills e4m3's range); 2^-12 saturates the largest p
        prob_scale = draw(st.sampled_from((1.0, 1.0, 0.25, 4.0, 1 / 448, 2.0**-12)))
    return Workload(
        seed=draw(st.integers(0, 2**32 - 1)), kv_dtype=kv_dtype, layout=layout, scale_granularity=gran,
        num_kv_heads=H, num_q_heads=Hq, head_size=D, block_size=bs, num_blocks=num_blocks,
        seq_lens=seq_lens, q_lens=q_lens, chunked=chunked, block_tables=tuple(tables),
        write_slots=tuple(order), slot_dtype=draw(st.sampled_from(("int64", "int32"))), io_dtype=io_dtype,
        k_scale=k_scale, v_scale=v_scale, amplitude=amplitude, specials=specials and draw(st.booleans()),
        causal=causal, sliding_window=window, soft_cap=cap, softmax_scale=sm_scale,
        poison=draw(st.sampled_from(poisons)), fp8_attention=fp8, q_scale=q_scale, prob_scale=prob_scale,
    )
