"""The opt-in FP8 attention mode (fp8kv.fp8_attention): its definition in the reference, checked
against an independent dense evaluation; the query quantization against the cache's; the derived
tolerance (it holds for an online-softmax kernel order and catches real mistakes); the arguments'
errors; which backends serve it."""

from __future__ import annotations

import math

import pytest
import torch
from fp8_tiled import tiled_fp8_attention

import fp8kv
import fp8kv.reference
import fp8kv.registry
from fp8kv.errors import Fp8KVError, InvalidArgument
from fp8kv.fp8_attention import lazy_threshold, quantize_query
from fp8kv.testing.fp8_tolerance import (
    assert_fp8_attention_close,
    fp8_attention_tolerance,
    fp8_probability_envelope,
)

H, HQ, D, PAGE = 2, 8, 32, 4


def _setup(seed=0, granularity="head", seqs=2, new=3, cached=13, layout="NHD", amp=1.0):
    g = torch.Generator().manual_seed(seed)
    L = new + cached
    nblk = -(-L // PAGE)
    tables = torch.randperm(seqs * nblk, generator=g).to(torch.int32).view(seqs, nblk)
    scales = (0.02 + 0.05 * torch.rand(H, generator=g)) if granularity == "head" else 0.04
    cache = fp8kv.KVCache.allocate(seqs * nblk, PAGE, H, D, kv_dtype="fp8_e4m3", layout=layout,
                                   scale_granularity=granularity, k_scale=scales, v_scale=scales)
    n = seqs * nblk * PAGE
    fp8kv.reference.write_kv(cache, torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g) * amp,
                             torch.arange(n))
    T = seqs * new
    q = torch.randn(T, HQ, D, generator=g) * 2
    lens = torch.full((seqs,), L, dtype=torch.int32)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32)
    return cache, q, tables, lens, qsl


def _dense(q, cache, tables, lens, qsl, q_scale=None, prob_scale=1.0, scale=None, window=None):
    """The mode's definition, written out densely in float64 (independent of fp8kv.reference)."""
    e4 = torch.float8_e4m3fn
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    ks = cache.k_scale.double().reshape(-1).expand(H).repeat_interleave(HQ // H)
    vs = cache.v_scale.double().reshape(-1).expand(H).repeat_interleave(HQ // H)
    for s in range(lens.shape[0]):
        L, a, b = int(lens[s]), int(qsl[s]), int(qsl[s + 1])
        slots = tables[s].long()[torch.arange(L) // PAGE] * PAGE + torch.arange(L) % PAGE
        k8 = cache.token_view("key")[slots].double().repeat_interleave(HQ // H, 1)  # [L, HQ, D]
        v8 = cache.token_view("value")[slots].double().repeat_interleave(HQ // H, 1)
        qf = q[a:b].float()
        if q_scale is None:
            qs = torch.maximum(qf.abs().amax(-1) / torch.full_like(qf[..., 0], 448.0), torch.tensor(2.0**-126))
        else:
            qs = q_scale.reshape(-1).expand(H).repeat_interleave(HQ // H)[None].expand(b - a, HQ)
        q8 = (qf / qs[..., None]).clamp(-448, 448).to(e4).double()
        t = torch.einsum("thd,lhd->thl", q8, k8) * (qs.double() * ks * scale)[..., None] / math.log(2)
        pos = torch.arange(L - (b - a), L)[:, None]
        vis = torch.arange(L)[None, :] <= pos
        if window is not None:
            vis = vis & (torch.arange(L)[None, :] > pos - window)
        t = t.masked_fill(~vis[:, None, :], -math.inf)
        M = torch.ceil(t.amax(-1, keepdim=True))
        p = torch.exp2(t - M)
        p8 = (p / prob_scale).float().clamp(max=448).to(e4).double()
        out[a:b] = torch.einsum("thl,lhd->thd", p8, v8) * (prob_scale * vs)[:, None] / p.sum(-1, keepdim=True)
    return out


def _reference(q, cache, tables, lens, qsl, **kw):
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                query_start_loc=qsl, fp8_attention=True, backend="reference", **kw)
    return fp8kv.paged_attention(q, cache, meta, return_lse=True)


@pytest.mark.parametrize("granularity", ["head", "tensor"])
@pytest.mark.parametrize("q_scale", [None, "tensor", "kv_head", "q_head"])
@pytest.mark.parametrize("prob_scale", [1.0, 0.25])
def test_reference_is_the_definition(granularity, q_scale, prob_scale):
    cache, q, tables, lens, qsl = _setup(granularity=granularity)
    qs = {None: None, "tensor": torch.tensor(0.01), "kv_head": torch.tensor([0.01, 0.004]),
          "q_head": torch.linspace(0.003, 0.02, HQ)}[q_scale]
    ref, _ = _reference(q, cache, tables, lens, qsl, q_scale=qs, prob_scale=prob_scale)
    if qs is not None and qs.numel() == HQ:  # the dense oracle takes per-KV-head scales: compare per q head
        want = torch.stack([_dense(q[:, h:h + 1].expand(-1, HQ, -1).contiguous(), cache, tables, lens, qsl,
                                   q_scale=qs[h].expand(H), prob_scale=prob_scale)[:, h] for h in range(HQ)], 1)
    else:
        want = _dense(q, cache, tables, lens, qsl, q_scale=qs, prob_scale=prob_scale)
    # Both compute in float64, exact FP8 dot products (e4m3 products summed in float64 lose nothing),
    # one pass against the row's final maximum: the derived bound with u = 2^-53, no accumulator
    # truncation and no online softmax is float32's output rounding plus float64 noise.
    tol, _ = fp8_attention_tolerance(q, cache, tables, lens, qsl, ref, q_scale=qs, prob_scale=prob_scale,
                                     unit_roundoff=2.0**-53, fp8_dot_roundoff=0.0, pv_dot_roundoff=0.0,
                                     online_softmax=False)
    assert_fp8_attention_close(ref, want, tol)
    assert float((tol - torch.finfo(torch.float32).eps * want.abs()).max()) < 1e-12


def test_query_quantized_bit_for_bit_as_the_cache():
    """Dynamic scales: the query's e4m3 bytes are those a token_head cache stores for the same rows."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, HQ, D, generator=g) * torch.logspace(-3, 3, 5)[:, None, None]
    q8, qs = quantize_query(q, None, H)
    cache = fp8kv.KVCache.allocate(2, 4, HQ, D, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    fp8kv.reference.write_kv(cache, q, q, torch.arange(5))
    assert torch.equal(q8.view(torch.uint8), cache.token_view("key")[:5].view(torch.uint8))
    assert torch.equal(qs, cache.k_scale.reshape(-1, HQ)[:5])


def _tiled(q, cache, tables, lens, qsl, tol_kw=None, accumulator="hopper", **kw):
    """``(out, ref, tol)``: the mode as a tiled kernel computes it (tests/fp8_tiled.py), the
    reference and the derived tolerance, for one step planned with ``tol_kw`` (q/prob scales...)."""
    tol_kw = tol_kw or {}
    meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl, fp8_attention=True, backend="reference",
                                **tol_kw)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    tiled_fp8_attention(q, cache, meta, out, lse, **kw)
    ref, ref_lse = fp8kv.paged_attention(q, cache, meta, return_lse=True)
    o = meta.options
    tol, lse_tol = fp8_attention_tolerance(q, cache, tables, lens, qsl, ref, ref_lse, softmax_scale=o.softmax_scale,
                                           sliding_window=o.sliding_window, logits_soft_cap=o.logits_soft_cap,
                                           q_scale=o.q_scale, prob_scale=o.prob_scale, accumulator=accumulator)
    return (out, lse), (ref, ref_lse), (tol, lse_tol)


@pytest.mark.parametrize("tile", [1, 3, 8])
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
@pytest.mark.parametrize("seed", range(2))
def test_tolerance_holds_for_a_tiled_online_softmax(tile, order, seed):
    cache, q, tables, lens, qsl = _setup(seed=seed, cached=29)
    (out, lse), (ref, ref_lse), (tol, lse_tol) = _tiled(q, cache, tables, lens, qsl, tile=tile, order=order,
                                                        seed=seed)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)


@pytest.mark.parametrize(("options", "amp"), [
    (dict(prob_scale=1 / 448), 1.0),                       # a calibrated checkpoint's prob_scale
    (dict(prob_scale=2.0**-12), 1.0),                      # below 1/448: the largest p saturate
    (dict(prob_scale=4.0), 1.0),                           # most p below e4m3's normal range
    (dict(q_scale=torch.tensor([0.01, 0.004]), logits_soft_cap=5.0), 1.0),
    (dict(sliding_window=7, softmax_scale=0.9), 30.0),    # large logits: long accumulations matter
])
def test_tolerance_holds_with_the_accumulator_model_made_real(options, amp):
    """Both products truncated to 13 fractional bits every 32 terms (the "steps" model's worst case),
    tiles visited backwards and at random; and both accumulated as Hopper's e4m3 wgmma does (the
    default "hopper" model, measured on an H100), tiles of 32 keys in order as its kernels visit them."""
    cache, q, tables, lens, qsl = _setup(seed=5, cached=77, new=5, amp=1.0)
    q = q * amp
    for order in ("reverse", "random"):
        (out, lse), (ref, ref_lse), (tol, lse_tol) = _tiled(q, cache, tables, lens, qsl, tol_kw=options, tile=16,
                                                            order=order, acc_bits=13, accumulator="steps")
        assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)
    (out, lse), (ref, ref_lse), (tol, lse_tol) = _tiled(q, cache, tables, lens, qsl, tol_kw=options, tile=32,
                                                        hopper=True)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)


def test_the_hopper_bound_holds_where_small_products_meet_large_ones():
    """Keys whose codes span e4m3's range (a query channel of 300, the others tiny): Hopper's
    accumulation drops products below 2^-13 of a step's largest; its bound (the default) holds."""
    g = torch.Generator().manual_seed(9)
    cache, q, tables, lens, qsl = _setup(seed=9, cached=61, new=4)
    q = torch.randn(q.shape, generator=g) * 2.0**-6
    q[..., 0] = 300.0
    kc = cache.key_cache.view(torch.uint8)
    kc.copy_(torch.randint(0, 256, kc.shape, generator=g, dtype=torch.uint8))
    kc[(kc & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    (out, lse), (ref, ref_lse), (tol, lse_tol) = _tiled(q, cache, tables, lens, qsl, tile=32, hopper=True,
                                                        tol_kw=dict(q_scale=torch.tensor(1.0)))
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)


def _subnormal_trap(n_small=120, f=10.737 / 11):
    """One decode row whose first tile holds keys of ``x = 2^(-11 f) ~ 0.3 * 2^-9`` (e4m3 rounds them
    to 0) and one of ``b = -1.5 f`` (running maximum -1), its last tile the row's maximum (b = 0): a
    forward kernel rounds the small ones at ``2 x`` (to ``2^-9``, then scaled back to ``2^-10``)."""
    L = n_small + 2
    k = torch.zeros(L, 1, 32)
    v = torch.zeros(L, 1, 32)
    k[0, 0, 0], k[1:-1, 0, 0], k[-1, 0, 0] = -1.5, -11.0, 0.0
    v[1:-1, 0, 0] = 1.0
    nblk = -(-L // 16)
    cache = fp8kv.KVCache.allocate(nblk, 16, 1, 32, kv_dtype="fp8_e4m3", scale_granularity="tensor",
                                   k_scale=1.0, v_scale=1.0)
    fp8kv.reference.write_kv(cache, k, v, torch.arange(L))
    q = torch.zeros(1, 1, 32)
    q[0, 0, 0] = 1.0
    args = (q, cache, torch.arange(nblk, dtype=torch.int32)[None], torch.tensor([L], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))
    return args, dict(q_scale=torch.tensor(1.0), softmax_scale=f * math.log(2.0))


def test_tolerance_covers_subnormal_probabilities_rounded_at_a_lower_running_max():
    """The kernel's ``2^-k e4m3(2^k x)`` leaves ``[e4m3(x), x (1 + 2^-4)]`` for subnormal ``x`` (here
    ``2^-10`` against 0 and ``0.32 * 2^-9``): the envelope's ``min(y, 2^(shift - 10))`` term covers it."""
    args, kw = _subnormal_trap()
    (out, _), (ref, _), (tol, _) = _tiled(*args, tol_kw=kw, tile=121)  # the small keys and b = -1.5 f first
    assert float(ref[0, 0, 0]) == 0.0 and float(out[0, 0, 0]) > 0.03  # the kernel kept what the reference drops
    assert_fp8_attention_close(out, ref, tol)
    assert float(out[0, 0, 0]) > 0.25 * float(tol[0, 0, 0])  # and the bound is not loose there


@pytest.mark.parametrize("shift", [1, 2])
@pytest.mark.parametrize("prob_scale", [1.0, 0.25, 4.0, 1 / 448, 2.0**-12])
def test_probability_envelope_contains_every_kernel_rounding(shift, prob_scale):
    """Step 3 of the derivation, exhaustively: every ``2^-k e4m3(2^k y)`` (``k >= -shift``,
    ``2^k y <= 2^t / prob_scale``, ``t = lazy_threshold(prob_scale)``: up to 1 / prob_scale against a
    running maximum that includes the key, up to 2^t with FA4's conditional rescaling) for ``y`` in
    ``[lo, hi]`` lies in the envelope of ``[lo, hi]``."""
    y = torch.logspace(-24, math.log2(2.0**shift / prob_scale), 4000, base=2.0, dtype=torch.float64)
    y = torch.cat([y, torch.arange(1, 2**10, dtype=torch.float64) * 2.0**-19])  # subnormal midpoints and ties
    y = y.to(torch.float32).to(torch.float64)
    g = 1.002
    for lo, hi in ((y, y), (y / g, y), (y, y * g)):
        lower, upper = fp8_probability_envelope(lo, hi, prob_scale, shift)
        for point in (lo, hi):
            for k in range(-shift, 40):
                z = point * 2.0**k
                ok = z <= 2.0 ** lazy_threshold(prob_scale) / prob_scale
                got = (z.to(torch.float32).clamp(max=448.0).to(torch.float8_e4m3fn).to(torch.float64)) * 2.0**-k
                bad = ok & ((got < lower) | (got > upper))
                assert not bool(bad.any()), (k, point[bad][:3].tolist(), got[bad][:3].tolist(),
                                             lower[bad][:3].tolist(), upper[bad][:3].tolist())
    # and it is tight where a power of two commutes with the rounding (normal, no saturation)
    normal = (y >= 2.0 ** (shift - 6)) & (y * max(1.0, 2.0**shift) <= 448) & (y <= 1 / prob_scale)
    lower, upper = fp8_probability_envelope(y, y, prob_scale, shift)
    if prob_scale * 448 >= 1:
        assert torch.equal(lower[normal], upper[normal])


@pytest.mark.parametrize("prob_scale", [1.0, 0.25, 4.0, 1 / 448, 2.0**-12])
@pytest.mark.parametrize("order", ["forward", "random"])
@pytest.mark.parametrize("rule", ["max", "sum"])
def test_tolerance_holds_with_conditional_rescaling(prob_scale, order, rule):
    """FA4's conditional rescaling (the Hopper kernel's lazy_softmax): rows keep a running maximum up to
    lazy_threshold(prob_scale) below a tile's (rule "max"; "sum": while the tile's p against it sum to at
    most 2^t, the kernel's test), so p reaches 2^t; with both products as Hopper accumulates them, the
    bound holds, and the rows that kept a lower maximum are many (the check is not vacuous)."""
    cache, q, tables, lens, qsl = _setup(seed=7, cached=90, new=6)
    q = q * 3  # (logits spread over tens of units: running maxima move)
    stats: dict = {}
    (out, lse), (ref, ref_lse), (tol, lse_tol) = _tiled(q, cache, tables, lens, qsl, tol_kw=dict(prob_scale=prob_scale),
                                                        tile=4 if rule == "max" else 8, order=order, hopper=True,
                                                        lazy_t=lazy_threshold(prob_scale), lazy_rule=rule,
                                                        stats=stats)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)
    if lazy_threshold(prob_scale) == 0:  # (below prob_scale 1/224 it is the exact schedule)
        assert stats["kept"] == 0
    else:
        assert stats["kept"] > 50, stats


def test_conditional_rescaling_beyond_the_threshold_is_caught():
    """The same kernel with a threshold 4 above lazy_threshold(1/448) = 0 lets p / prob_scale saturate at 448:
    the bound catches it."""
    cache, q, tables, lens, qsl = _setup(seed=7, cached=90, new=6)
    q = q * 3
    (out, _), (ref, _), (tol, _) = _tiled(q, cache, tables, lens, qsl, tol_kw=dict(prob_scale=1 / 448), tile=4,
                                          hopper=True, lazy_t=4)
    with pytest.raises(AssertionError):
        assert_fp8_attention_close(out, ref, tol)


@pytest.mark.parametrize("mistake", ["q_scale_ignored", "no_v_scale", "drop_last_key", "p_not_rounded"])
def test_tolerance_catches_a_kernels_mistakes(mistake):
    """The tiled kernel with one bug planted, on an ordinary prefill step: the bound catches it."""
    cache, q, tables, lens, qsl = _setup(seed=2, cached=29, amp=1.0)
    kw = dict(q_scale=torch.tensor([0.02, 0.01])) if mistake == "q_scale_ignored" else {}
    (out, _), (ref, _), (tol, _) = _tiled(q, cache, tables, lens, qsl, tol_kw=kw, tile=8, mistake=mistake)
    with pytest.raises(AssertionError, match="beyond the derived tolerance"):
        assert_fp8_attention_close(out, ref, tol)


def _mode_cost_bound(q, cache, tables, lens, qsl, o_fp8, q_scale=None):
    """Per element, a bound on ``|o_fp8 - o_default|`` (both the reference's): the e4m3 query moves
    each logit by at most ``eps_j = softmax_scale k_scale sum_i |q_i - qs dec(q8_i)| |k8_ji|``, so the
    softmax weights by at most ``e^(2 max eps) - 1`` in L1; rounding P moves the output by
    ``v_scale sum_j |R_j - p_j| |v8_jd| / l`` exactly; both outputs round to float32 once."""
    from fp8kv.fp8_attention import fp8_probabilities, round_probabilities
    from fp8kv.reference import visible_mask

    q8, qs = quantize_query(q, q_scale, H)
    dq = (q.double() - q8.double() * qs.double()[..., None]).abs()
    ks = cache.k_scale.double().repeat_interleave(HQ // H)
    vs = cache.v_scale.double().repeat_interleave(HQ // H)
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(lens.shape[0]):
        L, a, b = int(lens[s]), int(qsl[s]), int(qsl[s + 1])
        slots = tables[s].long()[torch.arange(L) // PAGE] * PAGE + torch.arange(L) % PAGE
        k8 = cache.token_view("key")[slots].double().repeat_interleave(HQ // H, 1)  # [L, HQ, D]
        v8 = cache.token_view("value")[slots].double().repeat_interleave(HQ // H, 1)
        vis = visible_mask(L, b - a, True, None, q.device)[:, None, :]  # [ql, 1, L]
        c = (qs[a:b].double() * ks * D**-0.5)[..., None]
        logits = (torch.einsum("thd,lhd->thl", q8[a:b].double(), k8) * c).masked_fill(~vis, -math.inf)
        eps = (torch.einsum("thd,lhd->thl", dq[a:b], k8.abs()) * (ks * D**-0.5)[:, None]).masked_fill(~vis, 0)
        p, l_sum, _ = fp8_probabilities(logits, vis)
        dp = (round_probabilities(p, 1.0) - p).abs()
        V = (v8.abs() * vs[:, None]).amax(0)  # [HQ, D]: over all keys, >= over the visible ones
        bound[a:b] = (torch.einsum("thl,lhd->thd", dp, v8.abs()) * vs[:, None] / l_sum
                      + V * torch.expm1(2 * eps.amax(-1, keepdim=True)))
    return bound + 2 * 2.0**-24 * (o_fp8.double().abs() + bound)


@pytest.mark.parametrize("query", ["e4m3_exact", "dynamic"])
def test_default_and_fp8_modes_differ_by_what_the_roundings_explain(query):
    """FP8 mode minus default mode is the e4m3 query's logit change plus the P rounding, no more;
    with a query that e4m3 represents exactly only the P rounding remains, and the bound is tight."""
    cache, q, tables, lens, qsl = _setup(seed=4, cached=29)
    qs = None
    if query == "e4m3_exact":
        qs = torch.tensor(2.0**-6)
        q = (q / qs).to(torch.float8_e4m3fn).float() * qs
    fp8, _ = _reference(q, cache, tables, lens, qsl, q_scale=qs)
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                query_start_loc=qsl, backend="reference")
    default = fp8kv.paged_attention(q, cache, meta)
    diff = (fp8.double() - default.double()).abs()
    bound = _mode_cost_bound(q, cache, tables, lens, qsl, fp8, q_scale=qs)
    assert bool((diff <= bound).all()), float((diff / bound).max())
    assert float(diff.max()) > 1e-3  # the modes do differ
    if query == "e4m3_exact":
        assert float((diff / bound).max()) > 0.3  # and the P rounding explains it, not a loose bound


def test_lse_is_the_natural_log_sum_exp_of_the_logits():
    cache, q, tables, lens, qsl = _setup()
    _, lse = _reference(q, cache, tables, lens, qsl)
    # the logits of the mode: e4m3 query against the codes times the scales
    q8, qs = quantize_query(q, None, H)
    s = 0
    L, a, b = int(lens[s]), int(qsl[s]), int(qsl[s + 1])
    slots = tables[s].long()[torch.arange(L) // PAGE] * PAGE + torch.arange(L) % PAGE
    k = cache.token_view("key")[slots].double().repeat_interleave(HQ // H, 1)
    ks = cache.k_scale.double().repeat_interleave(HQ // H)
    logits = torch.einsum("thd,lhd->thl", q8[a:b].double(), k) * (qs[a:b].double() * ks * D**-0.5)[..., None]
    pos = torch.arange(L - (b - a), L)[:, None]
    logits = logits.masked_fill(~(torch.arange(L)[None] <= pos)[:, None, :], -math.inf)
    torch.testing.assert_close(lse[a:b].double(), torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(q_scale=torch.tensor(1.0)), "q_scale"),
    (dict(prob_scale=2.0), "prob_scale"),
    (dict(fp8_attention=True, q_scale=torch.tensor([1.0, 2.0, 3.0])), "q_scale"),
    (dict(fp8_attention=True, q_scale=torch.tensor(1.0, dtype=torch.float64)), "q_scale"),
    (dict(fp8_attention=True, q_scale=torch.tensor([1.0, -1.0])), "q_scale"),
    (dict(fp8_attention=True, q_scale=torch.tensor([1.0, math.inf])), "q_scale"),
    (dict(fp8_attention=True, prob_scale=0.0), "prob_scale"),
    (dict(fp8_attention=True, prob_scale=math.nan), "prob_scale"),
    (dict(fp8_attention="yes"), "fp8_attention"),
    (dict(fp8_attention=True, q_scale=0.01), "q_scale"),
    (dict(fp8_attention=True, q_scale=torch.tensor(0.01, device="meta")), "q_scale"),
    (dict(fp8_attention=True, q_scale=torch.tensor(0.01, requires_grad=True)), "q_scale"),
    (dict(fp8_attention=True, q_scale=torch.zeros(())), "q_scale"),
    (dict(fp8_attention=True, prob_scale=-1.0), "prob_scale"),
    (dict(fp8_attention=True, prob_scale=math.inf), "prob_scale"),
    (dict(fp8_attention=True, prob_scale=True), "prob_scale"),
    (dict(fp8_attention=True, prob_scale=torch.tensor([0.5, 0.5])), "prob_scale"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    cache, q, tables, lens, qsl = _setup()
    with pytest.raises(InvalidArgument, match=f"^{name}: got"):
        fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                             query_start_loc=qsl, **kwargs)


@pytest.mark.parametrize(("kv_dtype", "granularity"), [("fp8_e5m2", "head"), ("fp8_e4m3fnuz", "tensor"),
                                                       ("fp8_e4m3", "token_head")])
def test_outside_its_domain_the_mode_is_refused_by_name(kv_dtype, granularity):
    cache = fp8kv.KVCache.allocate(4, PAGE, H, D, kv_dtype=kv_dtype, scale_granularity=granularity)
    with pytest.raises(InvalidArgument, match="^fp8_attention: got True with"):
        fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.float32,
                             block_tables=torch.zeros(1, 4, dtype=torch.int32),
                             seq_lens=torch.tensor([3], dtype=torch.int32), fp8_attention=True)


def test_default_mode_backends_decline_with_a_reason():
    cache, q, tables, lens, qsl = _setup()
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                query_start_loc=qsl, fp8_attention=True)
    assert "fp8_attention" in meta.request.features
    why = fp8kv.registry.registry().explain(meta.request, fp8kv.probe("cpu"))
    for name in ("torch", "triton", "cuda"):
        if name in why:
            assert why[name] is not None and "fp8_attention" in why[name], (name, why[name])
    assert why["reference"] is None
    with pytest.raises(Fp8KVError, match="fp8_attention"):
        fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                             query_start_loc=qsl, fp8_attention=True, backend="torch")


def test_per_layer_scales_replace_the_steps_for_one_call():
    cache, q, tables, lens, qsl = _setup()
    step = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                query_start_loc=qsl, fp8_attention=True, backend="reference")
    qs = torch.tensor([0.01, 0.004])
    got = fp8kv.paged_attention(q, cache, step, layer_scales={"q_scale": qs, "prob_scale": 0.5})
    want, _ = _reference(q, cache, tables, lens, qsl, q_scale=qs, prob_scale=0.5)
    assert torch.equal(got, want)
    assert step.options.q_scale is None and step.options.prob_scale == 1.0  # the step's own are untouched
    with pytest.raises(InvalidArgument, match="^layer_scales: got q_scale"):
        fp8kv.paged_attention(q, cache, step, layer_scales={"q_scale": torch.ones(3)})
    default = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                   query_start_loc=qsl, backend="reference")
    with pytest.raises(InvalidArgument, match="^layer_scales: got given"):
        fp8kv.paged_attention(q, cache, default, layer_scales={"prob_scale": 2.0})


def test_checkpoint_q_and_prob_scales_flow_into_the_mode():
    from fp8kv.checkpoint.plan import KVCachePlan

    plan = KVCachePlan("fp8", "fp8_e4m3", "tensor", "checkpoint", q_scales={0: torch.tensor(0.02)},
                       prob_scales={0: torch.tensor(0.5)})
    assert plan.fp8_attention_scales(1) == {"q_scale": None, "prob_scale": 1.0}
    got = plan.fp8_attention_scales(0)
    assert float(got["q_scale"]) == pytest.approx(0.02) and got["prob_scale"] == 0.5
    cache, q, tables, lens, qsl = _setup(granularity="tensor")
    step = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                query_start_loc=qsl, fp8_attention=True, backend="reference")
    out = fp8kv.paged_attention(q, cache, step, layer_scales=got)
    assert torch.equal(out, _reference(q, cache, tables, lens, qsl, **got)[0])
    fnuz = KVCachePlan("fp8", "fp8_e4m3fnuz", "tensor", "checkpoint")
    with pytest.raises(Fp8KVError, match="fp8_e4m3 plan"):
        fnuz.fp8_attention_scales(0)


def test_the_hopper_accumulator_model_reproduces_an_h100():
    """fp8kv.testing.fp8_accumulator against outputs recorded on an H100 (the Hopper kernel's layout
    test, tests/data/h100_e4m3_wgmma.safetensors): S = A B^T and O = P8 V bit for bit; plain float64
    products differ (the model is not vacuous)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from fp8kv.testing.fp8_accumulator import hopper_e4m3_dot

    d = load_file(Path(__file__).parent / "data" / "h100_e4m3_wgmma.safetensors")
    e4 = torch.float8_e4m3fn
    a, b, v, p8 = (d[k].view(e4) for k in ("a", "b", "v", "p8"))
    assert torch.equal(hopper_e4m3_dot(a, b), d["s"].double())
    assert torch.equal(hopper_e4m3_dot(p8, v.T), d["o"].double())
    assert not torch.equal(a.double() @ b.double().T, d["s"].double())


def test_the_hopper_dot_bound_holds_on_an_h100_where_the_steps_model_does_not():
    """The tolerance's dot-product bound (fp8_tolerance.hopper_dot_error) against S = A B^T as an H100
    computed it on random e4m3 codes (tests/data/h100_e4m3_wgmma.safetensors): it holds everywhere;
    the older model, 13 bits of each 32-term step's partial sum (``(ceil(D / 32) + 1) 2^-13 sum |a b|``),
    does not."""
    from pathlib import Path

    from safetensors.torch import load_file

    from fp8kv.testing.fp8_tolerance import U_FP8_DOT, _qk_dot_error

    d = load_file(Path(__file__).parent / "data" / "h100_e4m3_wgmma.safetensors")
    a, b = (d[k].view(torch.float8_e4m3fn).double() for k in ("a", "b"))
    err = (d["s"].double() - a @ b.T).abs()
    bound = _qk_dot_error(a[:, None], b[:, None], U_FP8_DOT)[0]
    assert (err <= bound).all()
    assert (err > 5 * U_FP8_DOT * (a.abs() @ b.abs().T)).any()
