"""The FP8 attention mode computed the way a tiled kernel does, in float32, for the tests.

An online softmax over tiles of keys with integer running maxima, P rounded to e4m3 against the
running maximum (multiplied by a rounded ``1 / prob_scale``, as the Hopper kernel does), the
tiles visited in a chosen order, and optionally the accumulator model of the tolerance made
real: every 32-wide step of both products truncated to ``acc_bits`` fractional bits (rounding
toward zero, the worst case of ``fp8kv.testing.fp8_tolerance.U_FP8_DOT``), and optionally FA4's
conditional rescaling (``lazy_t``: a row keeps its running maximum while a tile's stays within
``lazy_t`` of it; the Hopper kernel's is :func:`fp8kv.fp8_attention.lazy_threshold`). ``mistake`` plants a
bug. ``TiledFP8`` wraps it as a backend plugin that claims only the FP8 mode (for the kit).
"""

from __future__ import annotations

import math

import torch

import fp8kv.reference
from fp8kv.fp8_attention import quantize_query
from fp8kv.plugins import BackendInfo, hookimpl
from fp8kv.reference import LOGIT_MAX, visible_mask
from fp8kv.testing.fp8_accumulator import exponent, hopper_accumulate

E4 = torch.float8_e4m3fn


def _truncate(x: torch.Tensor, bits: int | None) -> torch.Tensor:
    """``x`` with its significand cut to ``bits`` fractional bits (toward zero): relative error < 2^-bits."""
    if bits is None:
        return x
    m, e = torch.frexp(x)
    return torch.ldexp(torch.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def _dot_steps(a: torch.Tensor, b: torch.Tensor, eq: str, dim_a: int, dim_b: int, bits: int | None) -> torch.Tensor:
    """``einsum(eq, a, b)`` in float32, reduced 32 at a time (``a``'s ``dim_a`` against ``b``'s
    ``dim_b``), the running sum truncated after each step."""
    if bits is None:
        return torch.einsum(eq, a, b)
    acc = None
    for j in range(0, a.shape[dim_a], 32):
        n = min(32, a.shape[dim_a] - j)
        part = torch.einsum(eq, a.narrow(dim_a, j, n), b.narrow(dim_b, j, n))
        acc = part if acc is None else _truncate(acc + part, bits)
    return _truncate(acc, bits)


def _hopper_dot(a: torch.Tensor, b: torch.Tensor, eq: str, c: torch.Tensor | None = None) -> torch.Tensor:
    """``einsum(eq, a, b)`` (one reduced index, e4m3 values) accumulated as Hopper's wgmma does, onto
    ``c``: the products as an einsum without the reduction, the reduced index last."""
    ins, res = eq.split("->")
    ia, ib = ins.split(",")
    k = (set(ia) & set(ib) - set(res)).pop()
    full = f"{ins}->{res}{k}"
    a, b = a.double(), b.double()
    terms = torch.einsum(full, a, b)
    # a product's exponent is its factors' sum: that of the (exact) product of their powers of two
    exps = exponent(torch.einsum(full, torch.exp2(exponent(a)), torch.exp2(exponent(b))))
    return hopper_accumulate(terms, exps, c).float()


def tiled_fp8_attention(query, cache, meta, out, lse=None, *, tile: int = 8, order: str = "forward",
                        acc_bits: int | None = None, hopper: bool = False, mistake: str | None = None,
                        seed: int = 0, lazy_t: int | None = None, lazy_rule: str = "max",
                        stats: dict | None = None) -> None:
    """Fill ``out [T, Hq, D]`` (and ``lse [T, Hq]``) with the FP8 mode of ``meta`` over ``cache``.

    ``order``: ``forward``, ``reverse`` or ``random`` tiles. ``hopper``: both products accumulated as
    Hopper's e4m3 wgmma does (fp8kv.testing.fp8_accumulator; P V onto the running output, as a
    kernel's register accumulator). ``lazy_t``: after a row's first tile, it keeps its running maximum
    ``m`` unless the tile's ``ceil(max)`` exceeds ``m + lazy_t`` (so ``p`` may reach ``2^lazy_t``; above
    ``lazy_threshold(prob_scale)`` a planted bug); None: the exact schedule. ``lazy_rule``: ``"max"`` as
    just said (the laziest the tolerance argument allows), ``"sum"`` as the Hopper kernel decides since
    2026-11-28: keep ``m`` if the tile's ``p`` against it sum to at most ``2^lazy_t`` in each row (the
    kernel's chains of 8 keys, for ``tile=8``). ``stats["kept"]`` counts
    the (row, tile) pairs that kept a maximum below the tile's. ``mistake``: None, ``p_not_rounded``,
    ``no_v_scale``, ``q_scale_ignored``, ``drop_last_key``.
    """
    o = meta.options
    T, Hq, D = query.shape
    H = cache.num_kv_heads
    group = Hq // H
    ks = cache.k_scale.float().reshape(-1).expand(H).repeat_interleave(group)
    vs = cache.v_scale.float().reshape(-1).expand(H).repeat_interleave(group)
    if mistake == "no_v_scale":
        vs = torch.ones_like(vs)
    q8, qs = quantize_query(query, None if mistake == "q_scale_ignored" else o.q_scale, H)
    q8 = q8.float()
    inv_ps = torch.tensor(1.0 / o.prob_scale, dtype=torch.float32)
    log2e = 1 / math.log(2.0)
    gen = torch.Generator().manual_seed(seed)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for s, L in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        pos = torch.arange(L)
        slots = meta.block_tables[s].long()[pos // cache.block_size] * cache.block_size + pos % cache.block_size
        k8 = cache.token_view("key")[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        v8 = cache.token_view("value")[slots].float().repeat_interleave(group, 1)
        vis = visible_mask(L, b - a, o.causal, o.sliding_window, query.device)
        if mistake == "drop_last_key":
            vis[:, L - 1:] = False
        c = (qs[a:b].float() * ks * o.softmax_scale)[..., None]  # [ql, Hq, 1]
        m = torch.full((b - a, Hq, 1), -math.inf)
        acc = torch.zeros(b - a, Hq, D)
        l_sum = torch.zeros(b - a, Hq, 1)
        tiles = list(range(0, L, tile))
        if order == "reverse":
            tiles.reverse()
        elif order == "random":
            tiles = [tiles[i] for i in torch.randperm(len(tiles), generator=gen).tolist()]
        for j in tiles:
            kt, vt = k8[j:j + tile], v8[j:j + tile]
            if hopper:
                t = _hopper_dot(q8[a:b], kt, "thd,lhd->thl") * c
            else:
                t = _dot_steps(q8[a:b], kt, "thd,lhd->thl", 2, 2, acc_bits) * c  # [ql, Hq, n]
            if o.logits_soft_cap is not None:
                t = torch.tanh(t / o.logits_soft_cap) * o.logits_soft_cap
            t = t.clamp(-LOGIT_MAX, LOGIT_MAX) * log2e
            t = t.masked_fill(~vis[:, None, j:j + tile], -math.inf)
            m_tile = torch.ceil(t.amax(-1, keepdim=True))
            m_new = torch.maximum(m, m_tile)
            if lazy_t is not None:  # a row with a finite maximum keeps it unless the tile's exceeds it by more than t
                if lazy_rule == "sum":
                    p_kept = torch.exp2(t - torch.where(torch.isfinite(m), m, 0.0))
                    keep = torch.isfinite(m) & (p_kept.sum(-1, keepdim=True) <= 2.0**lazy_t)
                else:
                    keep = torch.isfinite(m) & (m_tile <= m + lazy_t)
                m_new = torch.where(keep, m, m_new)
                if stats is not None:
                    stats["kept"] = stats.get("kept", 0) + int((keep & (m_tile > m)).sum())
            safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
            p = torch.exp2(t - safe)
            alpha = torch.exp2(torch.where(torch.isfinite(m), m - safe, -math.inf))
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            x = p * inv_ps
            p8 = x if mistake == "p_not_rounded" else x.clamp(-448, 448).to(E4).float()
            if hopper:  # onto the rescaled running output (exact: alpha is a power of two)
                acc = _hopper_dot(p8, vt, "thl,lhd->thd", acc * alpha)
            else:
                pv = _dot_steps(p8.permute(1, 0, 2), vt.transpose(0, 1), "htl,hld->htd", 2, 1, acc_bits)
                acc = acc * alpha + pv.permute(1, 0, 2)
            m = m_new
        res = acc / torch.where(l_sum > 0, l_sum, 1.0) * (vs[:, None] * o.prob_scale)
        out[a:b] = res.clamp(-torch.finfo(out.dtype).max, torch.finfo(out.dtype).max).to(out.dtype)
        if lse is not None:
            row = torch.where(l_sum > 0, (m + torch.log2(l_sum)) * math.log(2.0), -math.inf)[..., 0]
            lse[a:b] = row


class TiledFP8:
    """A backend plugin serving only the FP8 mode with :func:`tiled_fp8_attention` (CPU)."""

    def __init__(self, name: str = "tiled_fp8", **kw):
        self.name, self.kw = name, kw

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo(self.name, "0", priority=-1, description="tiled FP8 mode (tests)", fast=False)

    @hookimpl
    def fp8kv_supports(self, device, request):
        if request.op == "paged_attention" and "fp8_attention" not in request.features:
            return "tiled_fp8 serves only fp8_attention"
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        fp8kv.reference.write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse) -> None:
        tiled_fp8_attention(query, cache, metadata, out, lse, **self.kw)
