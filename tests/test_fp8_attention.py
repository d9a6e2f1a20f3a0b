"""The opt-in FP8 attention mode (fp8kv.fp8_attention): its definition in the reference, checked
against an independent dense evaluation; the query quantization against the cache's; the derived
tolerance (it holds for an online-softmax kernel order and catches real mistakes); the arguments'
errors; which backends serve it."""

from __future__ import annotations

import math

import pytest
import torch

import fp8kv
import fp8kv.reference
import fp8kv.registry
from fp8kv.errors import Fp8KVError, InvalidArgument
from fp8kv.fp8_attention import quantize_query
from fp8kv.testing.tolerance import assert_fp8_attention_close, fp8_attention_tolerance

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
    torch.testing.assert_close(ref.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_query_quantized_bit_for_bit_as_the_cache():
    """Dynamic scales: the query's e4m3 bytes are those a token_head cache stores for the same rows."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, HQ, D, generator=g) * torch.logspace(-3, 3, 5)[:, None, None]
    q8, qs = quantize_query(q, None, H)
    cache = fp8kv.KVCache.allocate(2, 4, HQ, D, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    fp8kv.reference.write_kv(cache, q, q, torch.arange(5))
    assert torch.equal(q8.view(torch.uint8), cache.token_view("key")[:5].view(torch.uint8))
    assert torch.equal(qs, cache.k_scale.reshape(-1, HQ)[:5])


def _online_softmax_like_a_kernel(q, cache, tables, lens, qsl, tile, **kw):
    """The mode computed as a tiled kernel does (running integer maxima, float32), per tile of keys."""
    ref, _ = _reference(q, cache, tables, lens, qsl, **kw)
    out = torch.zeros_like(ref)
    e4 = torch.float8_e4m3fn
    ks = cache.k_scale.reshape(-1).expand(H).repeat_interleave(HQ // H)
    vs = cache.v_scale.reshape(-1).expand(H).repeat_interleave(HQ // H)
    q8, qs = quantize_query(q, kw.get("q_scale"), H)
    for s in range(lens.shape[0]):
        L, a, b = int(lens[s]), int(qsl[s]), int(qsl[s + 1])
        slots = tables[s].long()[torch.arange(L) // PAGE] * PAGE + torch.arange(L) % PAGE
        k8 = cache.token_view("key")[slots].float().repeat_interleave(HQ // H, 1)
        v8 = cache.token_view("value")[slots].float().repeat_interleave(HQ // H, 1)
        m = torch.full((b - a, HQ, 1), -math.inf)
        acc = torch.zeros(b - a, HQ, D)
        l_sum = torch.zeros(b - a, HQ, 1)
        for j in range(0, L, tile):
            t = torch.einsum("thd,lhd->thl", q8[a:b].float(), k8[j:j + tile])
            t = t * (qs[a:b] * ks * D**-0.5 * (1 / math.log(2)))[..., None]
            pos = torch.arange(L - (b - a), L)[:, None]
            t = t.masked_fill(~(torch.arange(j, min(j + tile, L))[None] <= pos)[:, None, :], -math.inf)
            m_new = torch.maximum(m, torch.ceil(t.amax(-1, keepdim=True)))
            safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
            p = torch.exp2(t - safe)
            alpha = torch.exp2(torch.where(torch.isfinite(m), m - safe, -math.inf))
            l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
            p8 = p.clamp(max=448).to(e4).float()
            acc = acc * alpha + torch.einsum("thl,lhd->thd", p8, v8[j:j + tile])
            m = m_new
        out[a:b] = acc / l_sum * vs[:, None]
    return out, ref


@pytest.mark.parametrize("tile", [1, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_tolerance_holds_for_a_tiled_online_softmax(tile, seed):
    cache, q, tables, lens, qsl = _setup(seed=seed, cached=29)
    out, ref = _online_softmax_like_a_kernel(q, cache, tables, lens, qsl, tile)
    _, ref_lse = _reference(q, cache, tables, lens, qsl)
    tol, _ = fp8_attention_tolerance(q, cache, tables, lens, qsl, ref, ref_lse)
    assert_fp8_attention_close(out, ref, tol)


@pytest.mark.parametrize("mistake", ["q_scale", "v_scale", "dropped_key", "p_not_rounded"])
def test_tolerance_catches_real_mistakes(mistake):
    """Small rows (4 keys) and constant-sign values, where each mistake shows."""
    cache, q, tables, lens, qsl = _setup(seed=1, new=1, cached=3, amp=1.0)
    cache.value_cache.copy_(cache.value_cache.view(torch.uint8).bitwise_and(0x7F).view(torch.float8_e4m3fn))
    qs = torch.tensor([0.01, 0.004])
    ref, ref_lse = _reference(q, cache, tables, lens, qsl, q_scale=qs)
    tol, _ = fp8_attention_tolerance(q, cache, tables, lens, qsl, ref, ref_lse, q_scale=qs)
    if mistake == "q_scale":
        bad, _ = _reference(q, cache, tables, lens, qsl, q_scale=qs * 1.5)
    elif mistake == "v_scale":
        bad = ref * 1.05
    elif mistake == "dropped_key":
        bad, _ = _reference(q, cache, tables, lens - torch.tensor([1, 0], dtype=torch.int32),
                            torch.tensor([0, 1, 2], dtype=torch.int32), q_scale=qs)
    else:  # the default mode's probabilities (no e4m3 rounding of P, exact query)
        meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                    query_start_loc=qsl, backend="reference")
        bad = fp8kv.paged_attention(q, cache, meta)
    with pytest.raises(AssertionError, match="beyond the derived tolerance"):
        assert_fp8_attention_close(bad, ref, tol)


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
