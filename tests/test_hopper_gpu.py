"""The Hopper backend on an sm90 GPU: the FP8 attention mode against the reference within the mode's
derived tolerance (conformance kit and real sizes), CUDA-graph capture, and FP8 wgmma in the code.

Run on the H100 with ``python -m pytest -m gpu tests/test_hopper_gpu.py`` (``FP8KV_GPU_EXAMPLES``
sets the kit's example count)."""

from __future__ import annotations

import os

import pytest
import torch

import fp8kv
from fp8kv.testing.graphs import capture, capture_and_replay
from fp8kv.testing.tolerance import assert_fp8_attention_close, fp8_attention_tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm90 GPU (FP8 wgmma)"),
]
pytest.importorskip("triton")

DEV = torch.device("cuda")


def _case(seqs, new, cached, H=8, HQ=32, D=128, page=16, granularity="head", seed=0, layout="NHD"):
    """An e4m3 cache with random K/V and ``seqs`` sequences of ``new`` queries over ``cached`` keys."""
    g = torch.Generator().manual_seed(seed)
    L = new + cached
    nblk = -(-L // page)
    tables = torch.randperm(seqs * nblk, generator=g).to(torch.int32).view(seqs, nblk).to(DEV)
    scales = (0.02 + 0.05 * torch.rand(H, generator=g)).to(DEV) if granularity == "head" else 0.04
    cache = fp8kv.KVCache.allocate(seqs * nblk, page, H, D, kv_dtype="fp8_e4m3", scale_granularity=granularity,
                                   k_scale=scales, v_scale=scales, device=DEV, layout=layout)
    n = seqs * nblk * page
    fp8kv.write_kv_one_shot(cache, torch.randn(n, H, D, generator=g).to(DEV, torch.bfloat16),
                   torch.randn(n, H, D, generator=g).to(DEV, torch.bfloat16), torch.arange(n, device=DEV))
    T = seqs * new
    q = (torch.randn(T, HQ, D, generator=g) * 2).to(DEV, torch.bfloat16)
    lens = torch.full((seqs,), L, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32, device=DEV)
    return cache, q, tables, lens, qsl, new


def _check(case, **kw):
    cache, q, tables, lens, qsl, new = case
    args = dict(block_tables=tables, seq_lens=lens, query_start_loc=qsl, max_query_len=new, fp8_attention=True, **kw)
    meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, backend="hopper", **args)
    out, lse = fp8kv.paged_attention(q, cache, meta, return_lse=True)
    ref_meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, backend="reference", **args)
    ref, ref_lse = fp8kv.paged_attention(q, cache, ref_meta, return_lse=True)
    o = ref_meta.options
    tol, lse_tol = fp8_attention_tolerance(q, cache, tables, lens, qsl, ref, ref_lse, softmax_scale=o.softmax_scale,
                                           causal=o.causal, sliding_window=o.sliding_window,
                                           logits_soft_cap=o.logits_soft_cap, q_scale=o.q_scale,
                                           prob_scale=o.prob_scale)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)
    return meta, out


def test_conformance_kit_fp8_mode():
    from fp8kv.testing import check_backend

    report = check_backend("hopper", device="cuda", head_sizes=(64, 128), kv_dtypes=("fp8_e4m3",),
                           granularities=("tensor", "head"), fp8_attention="only", max_seq_len=300,
                           examples=int(os.environ.get("FP8KV_GPU_EXAMPLES", "25")))
    assert report.served["paged_attention"] and report.served["write_kv"]


@pytest.mark.parametrize("q_scale", [None, "kv_head"])
def test_chunked_prefill_at_size(q_scale):
    qs = None if q_scale is None else torch.full((8,), 0.01, device=DEV)
    _check(_case(2, 512, 512), q_scale=qs)


def test_decode_split_kv_at_size():
    meta, _ = _check(_case(4, 1, 4095, granularity="tensor"))
    assert meta.backend_plan.config.num_splits > 1


def test_window_soft_cap_and_prob_scale():
    _check(_case(2, 256, 300, seed=1), sliding_window=200, logits_soft_cap=20.0, prob_scale=0.5)


def test_cuda_graph_replay_is_bit_identical():
    cache, q, tables, lens, qsl, new = _case(2, 128, 256)
    meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl, max_query_len=new, fp8_attention=True,
                                backend="hopper", validate=False)
    eager = fp8kv.paged_attention(q, cache, meta)
    out = torch.empty_like(q)
    capture_and_replay(lambda: fp8kv.paged_attention(q, cache, meta, out=out), out)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


def test_the_kernel_uses_fp8_wgmma():
    """The compiled Triton kernel's PTX has e4m3 x e4m3 wgmma (SASS: QGMMA)."""
    import dataclasses

    from fp8kv_hopper import attention

    cache, q, tables, lens, qsl, new = _case(1, 256, 0)
    out = torch.empty_like(q)
    cfg = attention.choose_config(group=4, num_seqs=1, num_kv_heads=8, max_query_len=new, max_keys=256, num_sms=132)
    attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, 128**-0.5, True, None, None, out,
                                  q_scale=None, prob_scale=1.0, config=dataclasses.replace(cfg, kernel="triton"))
    kernels = [k for cache_ in attention.fp8_attention_kernel.device_caches.values() for k in cache_[0].values()]
    assert any("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in k.asm["ptx"] for k in kernels)


# ---- the warp-specialized CUDA prefill kernel (fp8kv_hopper.wgmma; the prefill default where it serves) ----

def _wgmma_check(case, dtype=torch.bfloat16, pingpong=True, kernel="wgmma", **kw):
    """The CUDA kernel (``Fp8AttnConfig(kernel="wgmma")``, or ``kernel``) against the reference within
    the mode's tolerance; returns the output."""
    import dataclasses

    from fp8kv_hopper import attention

    cache, q, tables, lens, qsl, new = case
    q = q.to(dtype)
    args = dict(block_tables=tables, seq_lens=lens, query_start_loc=qsl, max_query_len=new, fp8_attention=True, **kw)
    ref_meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, backend="reference", **args)
    ref, ref_lse = fp8kv.paged_attention(q, cache, ref_meta, return_lse=True)
    o = ref_meta.options
    cfg = attention.choose_config(group=q.shape[1] // cache.num_kv_heads, num_seqs=lens.shape[0],
                                  num_kv_heads=cache.num_kv_heads, max_query_len=new,
                                  max_keys=tables.shape[1] * cache.block_size, num_sms=132)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
    attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, o.softmax_scale, o.causal, o.sliding_window,
                                  o.logits_soft_cap, out, q_scale=o.q_scale, prob_scale=o.prob_scale, lse=lse,
                                  config=dataclasses.replace(cfg, kernel=kernel, wgmma_pingpong=pingpong))
    tol, lse_tol = fp8_attention_tolerance(q, cache, tables, lens, qsl, ref, ref_lse, softmax_scale=o.softmax_scale,
                                           causal=o.causal, sliding_window=o.sliding_window,
                                           logits_soft_cap=o.logits_soft_cap, q_scale=o.q_scale,
                                           prob_scale=o.prob_scale)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)
    return out


def test_wgmma_layouts():
    """The kernel's shared-memory layouts, V transpose and both wgmma forms on raw e4m3 codes: both
    products bit for bit as fp8kv.testing.fp8_accumulator emulates Hopper's e4m3 accumulation, p8 as
    torch rounds it."""
    from fp8kv_hopper import wgmma

    from fp8kv.testing.fp8_accumulator import hopper_e4m3_dot

    g = torch.Generator().manual_seed(0)
    a, b, v = (torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in ((64, 128), (128, 128), (128, 128)))
    for x in (a, b, v):
        x[(x & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    a, b, v = a.to(DEV), b.to(DEV), v.to(DEV)
    s, p8, o = wgmma.layout_test(a, b, v, 2.0**-14)
    e4 = torch.float8_e4m3fn
    assert torch.equal(s.double(), hopper_e4m3_dot(a.view(e4), b.view(e4)))
    assert torch.equal(p8, (s * 2.0**-14).clamp(-448, 448).to(e4).view(torch.uint8))
    assert torch.equal(o.double(), hopper_e4m3_dot(p8.view(e4), v.view(e4).T))


@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 100, 60), (3, 300, 1000), (2, 129, 0)])
def test_wgmma_prefill(dtype, shape, pingpong):
    _wgmma_check(_case(*shape), dtype, pingpong)


@pytest.mark.parametrize("shape", [(2, 100, 60), (3, 300, 1000)])
def test_triton_kernel_prefill(shape):
    """The Triton kernel, which "auto" no longer picks for these prefill steps, still conforms."""
    _wgmma_check(_case(*shape), kernel="triton")


@pytest.mark.parametrize("kw", [
    dict(sliding_window=200), dict(causal=False), dict(prob_scale=1 / 448), dict(prob_scale=4.0),
    dict(q_scale="tensor"), dict(q_scale="kv_head"), dict(q_scale="q_head"),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_wgmma_prefill_options(kw):
    qs = {"tensor": torch.tensor(0.02, device=DEV), "kv_head": torch.full((8,), 0.01, device=DEV),
          "q_head": torch.linspace(0.005, 0.02, 32, device=DEV)}
    if "q_scale" in kw:
        kw = dict(kw, q_scale=qs[kw["q_scale"]])
    _wgmma_check(_case(2, 300, 700, seed=2), **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wgmma_prefill_writes_its_output_rows_only(dtype):
    """The epilogue writes the output's rows and nothing around them: the output is the middle of a
    NaN-filled buffer, whose guard elements keep their bits; partial query blocks (100 tokens a sequence in
    blocks of 32) included. The result has the bits of an output of its own."""
    import dataclasses

    from fp8kv_hopper import attention

    cache, q, tables, lens, qsl, new = _case(2, 100, 60, seed=11)
    q = q.to(dtype)
    cfg = dataclasses.replace(attention.choose_config(group=4, num_seqs=2, num_kv_heads=8, max_query_len=new,
                                                      max_keys=tables.shape[1] * 16, num_sms=132), kernel="wgmma")
    guard = 64
    buf = torch.full((q.numel() + 2 * guard,), float("nan"), dtype=dtype, device=DEV)
    before = buf.clone()
    outs = [buf[guard:guard + q.numel()].view(q.shape), torch.empty_like(q)]
    for out in outs:
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, 128**-0.5, True, None, None, out,
                                      q_scale=None, prob_scale=1.0, config=cfg)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert torch.equal(buf[:guard].view(bits), before[:guard].view(bits))
    assert torch.equal(buf[-guard:].view(bits), before[-guard:].view(bits))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0].view(bits), outs[1].view(bits))


def test_wgmma_prefill_query_scales_at_both_division_paths():
    """Per-query-head scales from 2^-100 to 2^100 (bfloat16 queries of each head scaled with them, so that
    q / q_scale spans e4m3's range): the kernel divides in float32 for scales in [2^-80, 2^80] (the range's
    ends and their neighbours included) and through a float64 reciprocal outside it."""
    cache, q, *rest = _case(2, 130, 70, seed=4)
    ends = torch.tensor([2.0**-80, 2.0**80])
    edge = torch.cat([ends, torch.nextafter(ends, torch.tensor([0.0, float("inf")])),
                      torch.nextafter(ends, torch.tensor([1.0, 1.0]))])
    inner = 1.37 * 2.0 ** torch.linspace(-100, 100, 26).round()
    qs = torch.cat([edge, inner]).to(DEV)
    assert qs.numel() == q.shape[1] and ((qs < 2.0**-80) | (qs > 2.0**80)).sum() >= 6
    q = (q.float() * qs[:, None] * 40).to(torch.bfloat16)
    _wgmma_check((cache, q, *rest), q_scale=qs)


LAYOUTS = dict(tensor=dict(granularity="tensor"), mha=dict(HQ=8), group6=dict(HQ=48), page32=dict(page=32),
               page12=dict(page=12), page1=dict(page=1), page256=dict(page=256), page384=dict(page=384),
               hnd=dict(layout="HND"), hnd_page64=dict(layout="HND", page=64))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_wgmma_prefill_layouts(layout):
    """Pages of 1..384 keys and both cache layouts; TMA loads except where a page neither divides nor
    is a multiple of 128 keys (page12: the cp.async loads)."""
    from fp8kv_hopper import wgmma

    case = _case(2, 200, 333, seed=3, **LAYOUTS[layout])
    assert (wgmma.tma_maps(case[0]) is None) == (layout == "page12")
    _wgmma_check(case)


@pytest.mark.parametrize("layout", ["page16", "page256", "page12"])
def test_wgmma_prefill_ignores_nan_codes_past_the_sequence(layout):
    """Every cache slot past a sequence's length holds NaN codes (0x7F) in K and V: TMA loads whole pages
    (boxes of up to 128 keys), so those keys reach shared memory; they must not reach the output."""
    page = {"page16": 16, "page256": 256, "page12": 12}[layout]
    cache, q, tables, lens, qsl, new = case = _case(2, 150, 77, seed=5, page=page)
    L = int(lens[0])
    for seq in range(tables.shape[0]):
        for pos in range(L, tables.shape[1] * page):
            blk = int(tables[seq, pos // page])
            for t in (cache.key_cache, cache.value_cache):
                t.view(torch.uint8)[blk, pos % page] = 0x7F  # (NHD: [block, key, head, dim])
    out = _wgmma_check(case)
    assert torch.isfinite(out).all()


def _scaled_case(scale, seqs, new, cached, seed, H=8, HQ=32, D=128, page=16):
    """``_case``'s layout with head k_scale ``scale`` and keys of magnitude ``100 scale`` (v_scale 0.05)."""
    g = torch.Generator().manual_seed(seed)
    L = new + cached
    nblk = -(-L // page)
    cache = fp8kv.KVCache.allocate(seqs * nblk, page, H, D, kv_dtype="fp8_e4m3", scale_granularity="head",
                                   k_scale=torch.full((H,), scale, device=DEV),
                                   v_scale=torch.full((H,), 0.05, device=DEV), device=DEV)
    n = seqs * nblk * page
    fp8kv.write_kv_one_shot(cache, (torch.randn(n, H, D, generator=g) * 100 * scale).to(DEV, torch.bfloat16),
                   torch.randn(n, H, D, generator=g).to(DEV, torch.bfloat16), torch.arange(n, device=DEV))
    tables = torch.randperm(seqs * nblk, generator=g).to(torch.int32).view(seqs, nblk).to(DEV)
    q = (torch.randn(seqs * new, HQ, D, generator=g) * 2).to(DEV, torch.bfloat16)
    lens = torch.full((seqs,), L, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=DEV)
    return cache, q, tables, lens, qsl, new


@pytest.mark.parametrize("scale", [1e31, 100.0, 1e-30])
def test_wgmma_prefill_extreme_scales(scale):
    """The kernel's three logit paths by the rows' factors f: 1e-30 puts them below 2^-96 (the saturating
    float64 path), 100 and 1e31 in (2^-5, 2^96) (the rounded float32 product; at 1e31 the logits near
    1e34), the other tests' scales at or below 2^-5 (one FMA)."""
    out = _wgmma_check(_scaled_case(scale, seqs=2, new=150, cached=100, seed=4))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("prob_scale", [1.0, 0.25, 1 / 448])
def test_wgmma_prefill_running_maxima_that_climb_and_jump(prob_scale):
    """The conditional rescaling (lazy_softmax) where the row maxima move through the interior tiles: every
    query has a large channel 0, and the cached keys' channel 0 climbs over the sequence (a row's maximum
    grows by a few units a tile: kept while within lazy_threshold, else the warp's exact path), jumps by
    about 2500 (base-2 logits) in one tile and falls back; the logits stay on the FMA path (factor <= 2^-5)."""
    g = torch.Generator().manual_seed(11)
    H, HQ, D, page, seqs, new, cached = 8, 32, 128, 16, 2, 64, 1200
    L = new + cached
    nblk = -(-L // page)
    cache = fp8kv.KVCache.allocate(seqs * nblk, page, H, D, kv_dtype="fp8_e4m3", scale_granularity="head",
                                   k_scale=torch.full((H,), 2200.0 / 448, device=DEV),
                                   v_scale=torch.full((H,), 0.05, device=DEV), device=DEV)
    n = seqs * nblk * page
    k = torch.randn(n, H, D, generator=g)
    pos = torch.arange(n) % (nblk * page)
    k[:, :, 0] = 50.0 * pos[:, None] / L  # (about 6 base-2 units a 128-key tile)
    k[(pos >= 600) & (pos < 612), :, 0] = 2000.0
    fp8kv.write_kv_one_shot(cache, k.to(DEV, torch.bfloat16), torch.randn(n, H, D, generator=g).to(DEV, torch.bfloat16),
                   torch.arange(n, device=DEV))
    tables = torch.arange(seqs * nblk, dtype=torch.int32).view(seqs, nblk).to(DEV)
    q = torch.randn(seqs * new, HQ, D, generator=g)
    q[..., 0] = 10.0
    lens = torch.full((seqs,), L, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=DEV)
    out = _wgmma_check((cache, q.to(DEV, torch.bfloat16), tables, lens, qsl, new), prob_scale=prob_scale)
    assert torch.isfinite(out).all()


def test_wgmma_prefill_at_size_and_under_graph_capture():
    import dataclasses

    from fp8kv_hopper import attention

    case = _case(4, 2048, 2048)
    eager = _wgmma_check(case)
    cache, q, tables, lens, qsl, new = case
    cfg = dataclasses.replace(attention.choose_config(group=4, num_seqs=4, num_kv_heads=8, max_query_len=new,
                                                      max_keys=tables.shape[1] * 16, num_sms=132), kernel="wgmma")
    out = torch.empty_like(q)

    def run():
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, 128**-0.5, True, None, None, out,
                                      q_scale=None, prob_scale=1.0, config=cfg)

    capture_and_replay(run, out)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("pingpong", [False, True])
def test_wgmma_prefill_persistent_grids_give_the_same_bits(pingpong):
    """The persistent grid (``Fp8AttnConfig.wgmma_ctas``: 1, 5 and 132 CTAs, each taking work items in
    turn, the ring's stages and phases running on from one item into the next) gives the bits of a CTA per
    item, on uneven sequences (one without queries) whose items differ in tiles, and lse alike."""
    import dataclasses

    from fp8kv_hopper import attention

    cache, q, tables, lens, _, _ = _case(4, 225, 775, seed=5)
    qsl = torch.tensor([0, 300, 300, 310, 900], dtype=torch.int32, device=DEV)
    new = 590
    first = _wgmma_check((cache, q, tables, lens, qsl, new), pingpong=pingpong)  # the default: persistent
    cfg = attention.choose_config(group=4, num_seqs=4, num_kv_heads=8, max_query_len=new,
                                  max_keys=tables.shape[1] * 16, num_sms=132)
    assert cfg.wgmma_ctas == 132
    outs = {}
    for ctas in (0, 1, 5, 132):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, 128**-0.5, True, None, None, out,
                                      q_scale=None, prob_scale=1.0, lse=lse,
                                      config=dataclasses.replace(cfg, kernel="wgmma", wgmma_pingpong=pingpong,
                                                                 wgmma_ctas=ctas))
        outs[ctas] = (out, lse)
    for ctas, (out, lse) in outs.items():
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), ctas
        assert torch.equal(lse, outs[0][1]), ctas


def test_wgmma_prefill_schedules_give_the_same_bits():
    """The plan's balanced schedule (``HopperPlan.schedule``, from host lengths) gives the bits of a CTA per
    item, and so does any complete schedule: one made from other lengths than the step's (a stale plan),
    and schedules over grids of 1 and 5 CTAs; lse alike."""
    import dataclasses

    from fp8kv_hopper import attention, schedule

    cache, q, tables, lens, _, _ = _case(4, 225, 775, seed=5)
    qsl = torch.tensor([0, 300, 300, 310, 900], dtype=torch.int32, device=DEV)
    new = 590
    meta = fp8kv.plan_attention(cache, num_q_heads=32, query_dtype=q.dtype, block_tables=tables, seq_lens=lens,
                                query_start_loc=qsl, fp8_attention=True, backend="hopper",
                                host_seq_lens=lens.tolist(), host_query_start_loc=qsl.tolist())
    assert meta.backend_plan.schedule is not None and meta.backend_plan.schedule.shape[1] == 132
    planned_out, planned_lse = fp8kv.paged_attention(q, cache, meta, return_lse=True)
    cfg = dataclasses.replace(meta.backend_plan.config, kernel="wgmma")

    def run(ctas, sched):
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, 128**-0.5, True, None, None, out,
                                      q_scale=None, prob_scale=1.0, lse=lse,
                                      config=dataclasses.replace(cfg, wgmma_ctas=ctas), schedule=sched)
        return out, lse

    def make(ctas, host_lens, host_qsl):
        return schedule.for_step(host_lens, host_qsl, ctas=ctas, num_kv_heads=8, group=4, num_tokens=q.shape[0],
                                 max_query_len=new, max_keys=tables.shape[1] * 16, causal=True, sliding_window=None,
                                 device=DEV)

    want, want_lse = run(0, None)
    outs = [(planned_out, planned_lse), run(132, make(132, [1000, 1, 5000, 0], [0, 1, 2, 800, 900])),
            run(1, make(1, lens.tolist(), qsl.tolist())), run(5, make(5, lens.tolist(), qsl.tolist()))]
    for i, (out, lse) in enumerate(outs):
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), i
        assert torch.equal(lse, want_lse), i


def test_wgmma_prefill_schedule_follows_update_under_graph_replay():
    """A graph captured with the plan's schedule, replayed after metadata.update() with other lengths,
    gives the bits of a fresh plan for those lengths: the schedule was re-dealt in place (the same tensor,
    new contents) by the Hopper backend's fp8kv_update_plan."""
    cache, q, tables, lens, _, _ = _case(4, 225, 775, seed=5)
    qsl_a = torch.tensor([0, 300, 300, 310, 900], dtype=torch.int32, device=DEV)
    qsl_b = torch.tensor([0, 10, 600, 700, 900], dtype=torch.int32, device=DEV)
    kw = dict(num_q_heads=32, query_dtype=q.dtype, block_tables=tables, seq_lens=lens, max_query_len=600,
              fp8_attention=True, backend="hopper")
    meta = fp8kv.plan_attention(cache, query_start_loc=qsl_a, **kw)  # (validating: host lengths read)
    sched = meta.backend_plan.schedule
    ptr, planned = sched.data_ptr(), sched.clone()
    out = torch.empty_like(q)
    graph = capture(lambda: fp8kv.paged_attention(q, cache, meta, out=out))
    meta.update(block_tables=tables, seq_lens=lens, query_start_loc=qsl_b)
    assert meta.backend_plan.schedule.data_ptr() == ptr and not torch.equal(meta.backend_plan.schedule, planned)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    fresh = fp8kv.paged_attention(q, cache, fp8kv.plan_attention(cache, query_start_loc=qsl_b, **kw))
    assert torch.equal(out.view(torch.int16), fresh.view(torch.int16))


def test_wgmma_prefill_device_schedule_without_host_lengths():
    """Planned without host lengths (validate=False, none given), the plan's schedule is the sorted snake
    made on the GPU from the length tensors (schedule.device_schedule) and gives the bits of a plan with
    host lengths; a graph captured with it, replayed after metadata.update() without host lengths, gives
    the bits of a fresh plan for the new lengths: the update re-dealt it in place on the GPU."""
    from fp8kv_hopper import schedule

    cache, q, tables, lens, _, _ = _case(4, 225, 775, seed=5)
    qsl_a = torch.tensor([0, 300, 300, 310, 900], dtype=torch.int32, device=DEV)
    qsl_b = torch.tensor([0, 10, 600, 700, 900], dtype=torch.int32, device=DEV)
    kw = dict(num_q_heads=32, query_dtype=q.dtype, block_tables=tables, seq_lens=lens, max_query_len=600,
              fp8_attention=True, backend="hopper")
    meta = fp8kv.plan_attention(cache, query_start_loc=qsl_a, validate=False, num_tokens=q.shape[0], **kw)
    assert meta.host_seq_lens is None
    sizes = dict(ctas=meta.backend_plan.config.wgmma_ctas, num_kv_heads=8, group=4, num_tokens=q.shape[0],
                 max_query_len=600, max_keys=tables.shape[1] * 16, causal=True, sliding_window=None)
    sched = meta.backend_plan.schedule
    assert torch.equal(sched, schedule.device_schedule(lens, qsl_a, **sizes))
    ptr = sched.data_ptr()
    out = torch.empty_like(q)
    graph = capture(lambda: fp8kv.paged_attention(q, cache, meta, out=out))  # (its warm-up run fills out)
    hosted = fp8kv.paged_attention(q, cache, fp8kv.plan_attention(cache, query_start_loc=qsl_a, **kw))
    assert torch.equal(out.view(torch.int16), hosted.view(torch.int16))
    meta.update(block_tables=tables, seq_lens=lens, query_start_loc=qsl_b, validate=False)
    assert meta.backend_plan.schedule.data_ptr() == ptr
    assert torch.equal(meta.backend_plan.schedule, schedule.device_schedule(lens, qsl_b, **sizes))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    fresh = fp8kv.paged_attention(q, cache, fp8kv.plan_attention(cache, query_start_loc=qsl_b, **kw))
    assert torch.equal(out.view(torch.int16), fresh.view(torch.int16))


@pytest.mark.parametrize("layout", ["NHD", "HND", "NHD-page12"])
def test_wgmma_prefill_with_hostile_metadata_stays_in_its_cache(layout):
    """fp8kv.testing.safety's hostile metadata at head size 128 (its own check runs at 16, which this kernel
    does not serve): block ids num_blocks, 2^31 - 1 and -5, lengths past the table and negative, query
    offsets past the step, with the host checks off. The cache is the middle of larger tensors filled with
    NaN codes: the TMA boxes (a block coordinate outside the tensor map) and the cp.async loads (page 12)
    must read none of them, and the output stays finite."""
    import dataclasses

    from fp8kv_hopper import attention, wgmma

    page = 12 if layout.endswith("page12") else 16
    lay = layout.split("-")[0]
    H, HQ, D, NB, G = 2, 8, 128, 6, 2
    shape = (NB + 2 * G, page, H, D) if lay == "NHD" else (NB + 2 * G, H, page, D)
    parents = [torch.full(shape, 0x7F, dtype=torch.uint8, device=DEV) for _ in range(2)]
    cache = fp8kv.KVCache.from_tensors(parents[0][G:G + NB], parents[1][G:G + NB], kv_dtype="fp8_e4m3",
                                       layout=lay, scale_granularity="head",
                                       k_scale=torch.tensor([0.05, 0.02], device=DEV),
                                       v_scale=torch.tensor([0.07, 0.03], device=DEV))
    assert (wgmma.tma_maps(cache) is None) == (page == 12)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(NB * page, H, D, generator=g).to(DEV)
    fp8kv.write_kv_one_shot(cache, k, -k, torch.arange(NB * page, device=DEV))
    snapshot = [p.clone() for p in parents]
    tables = torch.tensor([[0, NB, 2**31 - 1], [-5, 1, 2]], dtype=torch.int32, device=DEV)
    for lens, qsl, T in (([100, -3], [0, 1, 2], 2), ([30, 36], [0, 7, 3], 4), ([36, 36], [0, 150, 300], 300)):
        q = torch.randn(T, HQ, D, generator=g).to(DEV, torch.bfloat16)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=DEV)
        cfg = dataclasses.replace(attention.choose_config(group=HQ // H, num_seqs=2, num_kv_heads=H,
                                                          max_query_len=T, max_keys=3 * page, num_sms=132),
                                  kernel="wgmma")
        out = torch.full_like(q, float("nan"))
        attention.paged_attention_fp8(q, cache, tables, lens_t, qsl_t, 10**9, 128**-0.5, True, None, None, out,
                                      q_scale=None, prob_scale=1.0, config=cfg)
        torch.cuda.synchronize()
        rows = torch.zeros(T, dtype=torch.bool, device=DEV)  # the rows some sequence's query range covers
        for a, b in zip(qsl[:-1], qsl[1:], strict=True):
            rows[max(a, 0):min(max(b, a), T)] = True
        assert torch.isfinite(out[rows]).all(), (lens, qsl)
    for a, b in zip(parents, snapshot, strict=True):
        assert torch.equal(a, b)


# ---- FP8-mode decode on the CUDA backend's tensor-core decode (fp8kv_cuda.attention.Fp8Attention; "auto"'s
# pick for decode steps) ----

_QS = {None: None, "tensor": lambda H, HQ: torch.tensor(0.02, device=DEV),
       "kv_head": lambda H, HQ: torch.linspace(0.005, 0.03, H, device=DEV),
       "q_head": lambda H, HQ: torch.linspace(0.004, 0.04, HQ, device=DEV)}


@pytest.mark.parametrize("prob_scale", [1.0, 0.25, 1 / 448, 4.0])
@pytest.mark.parametrize("q_scale", list(_QS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_decode(dtype, q_scale, prob_scale):
    case = _case(6, 1, 700, granularity="head", seed=5)
    qs = None if q_scale is None else _QS[q_scale](8, 32)
    _wgmma_check(case, dtype=dtype, kernel="cuda", q_scale=qs, prob_scale=prob_scale)


def test_cuda_decode_is_planned_once_per_step(monkeypatch):
    """fp8kv.plan_attention makes the tensor-core decode's plan (plan_mma) once; every layer's
    paged_attention runs it without planning again, and gives the bits of a call that plans for itself."""
    from fp8kv_cuda import attention as cuda_attention
    from fp8kv_hopper import attention

    cache, q, tables, lens, qsl, new = _case(8, 1, 3000, seed=9)
    meta = fp8kv.plan_attention(cache, num_q_heads=q.shape[1], query_dtype=q.dtype, backend="hopper",
                                block_tables=tables, seq_lens=lens, query_start_loc=qsl, max_query_len=1,
                                fp8_attention=True)
    plan = meta.backend_plan.decode
    assert plan is not None and plan.mma and not plan.prefill
    o = meta.options
    want = torch.empty_like(q)
    attention.paged_attention_fp8(q, cache, tables, lens, qsl, 1, o.softmax_scale, o.causal, None, None, want,
                                  q_scale=None, prob_scale=1.0, config=meta.backend_plan.config)

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again at a layer's call")

    monkeypatch.setattr(cuda_attention, "plan_mma", no_planning)
    for _ in range(3):  # layers
        out = fp8kv.paged_attention(q, cache, meta)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("shape", [
    dict(seqs=1, cached=20000),                 # KV splits (the merge gets acc * prob_scale)
    dict(seqs=3, cached=50, D=64, HQ=8),        # group 1, head size 64
    dict(seqs=2, cached=300, D=256, HQ=128),    # group 16: two head chunks, head size 256
    dict(seqs=5, cached=0),                     # one key (the query's own)
])
def test_cuda_decode_shapes(shape):
    seqs, cached = shape["seqs"], shape["cached"]
    case = _case(seqs, 1, cached, D=shape.get("D", 128), HQ=shape.get("HQ", 32), granularity="tensor", seed=6)
    _wgmma_check(case, kernel="cuda", prob_scale=0.5)


@pytest.mark.parametrize("seqs", [20, 40, 64, 150])
def test_cuda_decode_wave_tiles(seqs):
    """Grids of more CTAs than SMs take mma_wave_config's tiles on sm90 (160 CTAs: 4 warps x 2 stages x
    1 sub-tile; 320: 3 x 2 x 1; 512: 2 x 3 x 1, four CTAs an SM beside the mode's static query fragment
    (a 2 x 3 x 2 tile once failed to launch so, for want of the shared-memory opt-in); 1200: the default
    6 x 2 x 2),
    against the reference."""
    from fp8kv_cuda import attention as cuda_attention

    ctas, sms = seqs * 8, torch.cuda.get_device_properties(DEV).multi_processor_count
    assert (cuda_attention.mma_wave_config(DEV, 128, ctas, fp8_attention=True) is not None) == (sms < ctas <= 4 * sms)
    _wgmma_check(_case(seqs, 1, 100, granularity="tensor", seed=11), kernel="cuda", prob_scale=0.5)


def test_cuda_decode_window_soft_cap_and_lengths():
    """A sliding window, a soft-cap, and sequences of different lengths (one of them a single key)."""
    cache, q, tables, lens, qsl, new = _case(4, 1, 900, seed=7)
    lens = torch.tensor([901, 1, 2, 517], dtype=torch.int32, device=DEV)
    _wgmma_check((cache, q, tables, lens, qsl, new), kernel="cuda", sliding_window=300, logits_soft_cap=15.0)


@pytest.mark.parametrize("scale", [1e31, 100.0, 1e-30])
def test_cuda_decode_extreme_scales(scale):
    """Logit factors far from 1: the two-factor logits neither overflow nor flush (as the prefill's test)."""
    out = _wgmma_check(_scaled_case(scale, seqs=3, new=1, cached=399, seed=8), kernel="cuda")
    assert torch.isfinite(out).all()


def test_cuda_decode_is_autos_pick_and_replays_under_graph_capture():
    import dataclasses

    from fp8kv_hopper import attention

    cache, q, tables, lens, qsl, new = _case(8, 1, 3000, seed=9)
    cfg = attention.choose_config(group=4, num_seqs=8, num_kv_heads=8, max_query_len=1,
                                  max_keys=tables.shape[1] * 16, num_sms=132)
    outs = {}
    for kernel in ("auto", "cuda", "triton"):
        outs[kernel] = torch.empty_like(q)
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, 1, 128**-0.5, True, None, None, outs[kernel],
                                      q_scale=None, prob_scale=1.0, config=dataclasses.replace(cfg, kernel=kernel))
    assert torch.equal(outs["auto"].view(torch.int16), outs["cuda"].view(torch.int16))
    assert not torch.equal(outs["cuda"].view(torch.int16), outs["triton"].view(torch.int16))  # (two kernels)
    out = torch.empty_like(q)

    def run():
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, 1, 128**-0.5, True, None, None, out,
                                      q_scale=None, prob_scale=1.0, config=cfg)

    capture_and_replay(run, out)
    assert torch.equal(out.view(torch.int16), outs["auto"].view(torch.int16))


def test_cuda_decode_with_hostile_metadata_stays_in_its_cache():
    """Block ids num_blocks, 2^31 - 1 and -5, lengths past the table and negative, query offsets past the
    step and out of order, host checks off; the cache is the middle of larger NaN-filled tensors, none of
    which may be read (a NaN code read would make its row NaN). Which rows are written with offsets out of
    order is not defined (a token's sequence is found by binary search over offsets taken as sorted:
    fp8kv_cuda's find_seq), so the output starts at zeros and must stay finite, some of it written."""
    import dataclasses

    from fp8kv_hopper import attention

    H, HQ, D, NB, G, page = 2, 8, 128, 6, 2, 16
    parents = [torch.full((NB + 2 * G, page, H, D), 0x7F, dtype=torch.uint8, device=DEV) for _ in range(2)]
    cache = fp8kv.KVCache.from_tensors(parents[0][G:G + NB], parents[1][G:G + NB], kv_dtype="fp8_e4m3",
                                       scale_granularity="head", k_scale=torch.tensor([0.05, 0.02], device=DEV),
                                       v_scale=torch.tensor([0.07, 0.03], device=DEV))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(NB * page, H, D, generator=g).to(DEV)
    fp8kv.write_kv_one_shot(cache, k, -k, torch.arange(NB * page, device=DEV))
    snapshot = [p.clone() for p in parents]
    tables = torch.tensor([[0, NB, 2**31 - 1], [-5, 1, 2]], dtype=torch.int32, device=DEV)
    cfg = dataclasses.replace(attention.choose_config(group=HQ // H, num_seqs=2, num_kv_heads=H, max_query_len=1,
                                                      max_keys=3 * page, num_sms=132), kernel="cuda")
    for lens, qsl, T in (([100, -3], [0, 1, 2], 2), ([30, 36], [0, 7, 3], 4), ([40, 2**31 - 1], [-4, 1, 9], 3)):
        q = torch.randn(T, HQ, D, generator=g).to(DEV, torch.bfloat16)
        out = torch.zeros_like(q)
        attention.paged_attention_fp8(q, cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV),
                                      torch.tensor(qsl, dtype=torch.int32, device=DEV), 1, 128**-0.5, True, None,
                                      None, out, q_scale=None, prob_scale=1.0, config=cfg)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and out.abs().sum() > 0, (lens, qsl)
    for a, b in zip(parents, snapshot, strict=True):
        assert torch.equal(a, b)
