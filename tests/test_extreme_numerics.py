"""No NaN or inf from finite input and finite positive scales, anywhere in the float32 range.

Every backend, every scale granularity: ``k_scale``/``v_scale`` from the smallest subnormal to
``FLOAT32_MAX``, ``softmax_scale`` from 1e-38 to ``FLOAT32_MAX``, soft-caps from 1e-6 to
``FLOAT32_MAX``, queries up to ``1e38``, all-zero keys with huge scales. The defined behaviour
(see :mod:`fp8kv.reference` and :mod:`fp8kv_triton.attention`): logits saturate at
``+-FLOAT32_MAX ln 2``, the output at its dtype's largest finite value; nothing else is lost.

Checked (CPU: the reference and Triton through its interpreter; GPU: the same on CUDA):

* outputs and ``lse`` are finite for finite input (every row sees a key);
* every backend matches the reference within the derived tolerance of
  :mod:`fp8kv.testing.tolerance`, with bounds computed in float64 (the float32 dequantized
  values of ``paged_attention_bounds`` overflow at these scales; where the bounds are not finite
  the tolerance is infinite and only finiteness is checked);
* the reference matches an independent float64 oracle (``tests/dense_oracle.py``), saturated
  to the output dtype, within the same tolerance;
* writes at extreme static scales saturate codes (never NaN/inf from finite input) and stay
  bit-exact with the reference.

Hypothesis draws the combinations (profile ``ci``: derandomized); ``@example`` pins the extremes.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
import torch
from dense_oracle import dense_attention
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fp8kv
from fp8kv.errors import InvalidArgument
from fp8kv.formats import FORMATS
from fp8kv.reference import LOGIT_MAX, visible_mask
from fp8kv.testing.strategies import Workload, workloads
from fp8kv.testing.tolerance import assert_attention_close, assert_lse_close, logit_bound

HAS_SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_SM80, reason="needs an NVIDIA GPU sm80+")
FMAX = 3.4028234663852886e38
TINY = 1e-38  # a float32 subnormal
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_gpu])]

SCALES = (2.0**-149, TINY, 2.0**-126, 1e-20, 1.0, 1e20, 3e38, FMAX)
SOFTMAX_SCALES = (None, TINY, 1e-20, 0.25, 1e20, 3e38, FMAX)
CAPS = (None, 1e-6, 1.0, 30.0, 1e30, 3e38, FMAX)
Q_AMPS = (1.0, 1e-30, 1e30, 1e38)


def _attention_backends(device: str) -> list[str]:
    return ["reference", "triton"] if device == "cuda" or INTERPRET else ["reference"]


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


# ------------------------------------------------------------------------------------- caches


def _extreme_cache(wl: Workload, device: str, k_scales, v_scales, zero_keys: bool, code_seed: int):
    """A cache of ``wl``'s geometry holding random finite codes (keys zero if ``zero_keys``) and the
    given scales: static (one value or one per head) or token_head (values cycled over the slots)."""
    static = wl.scale_granularity != "token_head"
    n = 1 if wl.scale_granularity == "tensor" else wl.num_kv_heads
    cache = fp8kv.KVCache.allocate(
        wl.num_blocks, wl.block_size, wl.num_kv_heads, wl.head_size, kv_dtype=wl.kv_dtype, layout=wl.layout,
        scale_granularity=wl.scale_granularity, device=device,
        k_scale=torch.tensor([_f32(k_scales[i % len(k_scales)]) for i in range(n)]) if static else None,
        v_scale=torch.tensor([_f32(v_scales[i % len(v_scales)]) for i in range(n)]) if static else None)
    fmt = FORMATS[wl.kv_dtype]
    bad = torch.tensor(fmt.nan_encodings + fmt.inf_encodings, dtype=torch.uint8)
    g = torch.Generator().manual_seed(code_seed)
    for c, zero in ((cache.key_cache, zero_keys), (cache.value_cache, False)):
        b = torch.randint(0, 256, c.shape, generator=g, dtype=torch.uint8)
        b = torch.where(torch.isin(b, bad), b & 0x0F, b)  # finite codes only
        c.view(torch.uint8).copy_((b * 0 if zero else b).to(device))
    if not static:
        for s, vals in ((cache.k_scale, k_scales), (cache.v_scale, v_scales)):
            vals = torch.tensor([_f32(x) for x in vals], dtype=torch.float32)
            s.copy_(vals[torch.arange(s.numel()) % len(vals)].view(s.shape).to(device))
    return cache


def _bounds64(query, cache, tables, lens, qsl, *, softmax_scale, causal, sliding_window, logits_soft_cap):
    """:func:`fp8kv.testing.tolerance.paged_attention_bounds` from float64 dequantized K/V."""
    T, Hq, D = query.shape
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    starts = qsl.tolist() if qsl is not None else list(range(lens.shape[0] + 1))
    num_keys = torch.zeros(T, 1, 1, dtype=torch.float64)
    lb = torch.zeros(T, Hq, 1, dtype=torch.float64)
    vmax = torch.zeros(T, Hq, 1, dtype=torch.float64)
    group = Hq // cache.num_kv_heads
    kd, vd = _dequantized64(cache, "key"), _dequantized64(cache, "value")
    for i, L in enumerate(lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        pos = torch.arange(L)
        slots = tables[i].cpu().long()[pos // cache.block_size] * cache.block_size + pos % cache.block_size
        vis = visible_mask(L, hi - lo, causal, sliding_window, torch.device("cpu"))
        num_keys[lo:hi, 0, 0] = vis.sum(-1).double()
        lb[lo:hi] = logit_bound(query[lo:hi].cpu(), kd[slots], scale, vis)
        va = vd[slots].abs().amax(-1).repeat_interleave(group, dim=1)
        vmax[lo:hi, :, 0] = va.T[None].expand(hi - lo, Hq, L).masked_fill(~vis[:, None, :], 0.0).amax(-1)
    return {"out_dtype": query.dtype, "head_size": D, "num_keys": num_keys, "logit_bound": lb, "v_absmax": vmax,
            "soft_cap": logits_soft_cap}


def _dequantized64(cache, which):
    c = cache.token_view(which).cpu().to(torch.float64)
    return c * cache.scale_per_slot(which).cpu().to(torch.float64)[..., None]


def _oracle(query, cache, tables, lens, qsl, *, softmax_scale, causal, sliding_window, logits_soft_cap):
    """tests/dense_oracle.py in float64 on the CPU, saturated like the output (and the logits) are."""
    cpu = cache.to("cpu")
    D = query.shape[2]
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    if qsl is None:
        qsl = torch.arange(lens.shape[0] + 1)
    out, lse = dense_attention(query.cpu(), cpu, tables.cpu(), lens.cpu(), qsl.cpu(), scale, causal=causal,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, with_lse=True)
    hi = torch.finfo(query.dtype).max
    return out.clamp(-hi, hi), lse


# ------------------------------------------------------------------------------ the checks


def _check(wl: Workload, device: str, k_scales, v_scales, zero_keys: bool, q_amp: float):
    cache = _extreme_cache(wl, device, k_scales, v_scales, zero_keys, wl.seed % 1000)
    t = wl.tensors(device)
    amp = q_amp if wl.io_dtype != torch.float16 else min(max(q_amp, 1e-4), 1e3)
    hi = torch.finfo(wl.io_dtype).max
    query = (t.query.double() * amp).clamp(-hi, hi).to(wl.io_dtype)
    opts = wl.attention_kwargs()
    if wl.num_tokens == 0:
        return
    bounds = _bounds64(query, cache, t.block_tables, t.seq_lens, t.query_start_loc,
                       softmax_scale=opts["softmax_scale"], causal=opts["causal"],
                       sliding_window=opts["sliding_window"], logits_soft_cap=opts["logits_soft_cap"])
    results = {}
    for b in _attention_backends(device):
        out, lse = fp8kv.paged_attention_one_shot(query, cache, t.block_tables, t.seq_lens, backend=b, return_lse=True,
                                         query_start_loc=t.query_start_loc, **opts)
        ctx = f"{b} on {device}: "
        assert torch.isfinite(out.float()).all(), ctx + "non-finite output from finite input"
        assert torch.isfinite(lse).all(), ctx + "non-finite lse (every row sees a key)"
        assert lse.abs().max() <= LOGIT_MAX * 1.0001 + 100, ctx + "lse beyond the saturated logits"
        results[b] = (out.cpu(), lse.cpu())
    ref, ref_lse = results["reference"]
    want, want_lse = _oracle(query, cache, t.block_tables, t.seq_lens, t.query_start_loc, **{
        k: opts[k] for k in ("softmax_scale", "causal", "sliding_window")}, logits_soft_cap=opts["logits_soft_cap"])
    finite = torch.isfinite(want_lse).all() and float(bounds["logit_bound"].max()) < LOGIT_MAX
    if finite:  # the oracle's logits do not saturate: the reference is that function, rounded
        assert_attention_close(ref, want.to(ref.dtype), context="reference vs float64 oracle: ", **bounds)
        assert_lse_close(ref_lse, want_lse.float(), context="reference vs float64 oracle: ", **bounds)
    for b, (out, lse) in results.items():
        if b != "reference":
            assert_attention_close(out, ref, context=f"{b} vs reference: ", **bounds)
            assert_lse_close(lse, ref_lse, context=f"{b} vs reference: ", **bounds)


def _base(**kw) -> Workload:
    """A tiny fixed workload for the pinned examples (2 sequences, chunked prefill, GQA 2)."""
    w = Workload(seed=7, kv_dtype="fp8_e4m3", layout="NHD", scale_granularity="tensor", num_kv_heads=2,
                 num_q_heads=4, head_size=16, block_size=4, num_blocks=5, seq_lens=(9, 5), q_lens=(3, 1),
                 chunked=True, block_tables=((4, 0, 2), (1, 3, 0)), write_slots=(0,), slot_dtype="int64",
                 io_dtype=torch.float32, k_scale=(1.0,), v_scale=(1.0,))
    return replace(w, **kw)


HEAD = dict(scale_granularity="head", k_scale=(1.0, 1.0), v_scale=(1.0, 1.0))
TOKEN = dict(scale_granularity="token_head", k_scale=None, v_scale=None)


def _given():
    return given(
        wl=workloads(max_seqs=2, max_seq_len=10, head_sizes=(16,), block_sizes=(2, 4, 8), max_kv_heads=2,
                     gqa_ratios=(1, 2), specials=False, poisons=("zero",), max_holes=1),
        k_scales=st.lists(st.sampled_from(SCALES), min_size=1, max_size=3),
        v_scales=st.lists(st.sampled_from(SCALES), min_size=1, max_size=3),
        softmax_scale=st.sampled_from(SOFTMAX_SCALES), cap=st.sampled_from(CAPS),
        q_amp=st.sampled_from(Q_AMPS), zero_keys=st.booleans())


def _examples(f):
    """The pinned extremes (issue: per-head k_scale 3e38, softmax_scale / soft-cap near the float32 max)."""
    pins = [
        (_base(), [3e38], [1.0], 1.0, None, 1.0, False),  # k_scale * softmax_scale * log2(e) > FLOAT32_MAX
        (_base(**HEAD), [3e38, TINY], [TINY, 3e38], None, None, 1.0, False),
        (_base(**HEAD), [3e38], [3e38], 3e38, None, 1.0, True),  # all-zero keys, huge scales
        (_base(), [TINY], [TINY], TINY, None, 1.0, False),
        (_base(), [TINY], [3e38], 3e38, None, 1e-30, False),  # tiny * huge: moderate logits
        (_base(), [1.0], [1.0], FMAX, None, 1.0, False),
        (_base(), [1.0], [1.0], 0.25, FMAX, 1e38, False),  # soft-cap at the float32 max, huge logits
        (_base(), [1.0], [1.0], 0.25, 1e-6, 1.0, False),
        (_base(io_dtype=torch.bfloat16), [3e38], [FMAX], FMAX, 3e38, 1e38, False),
        (_base(io_dtype=torch.float16), [3e38], [3e38], None, None, 1.0, False),
        (_base(**TOKEN), [2.0**-126, FMAX], [FMAX, 2.0**-126], 3e38, None, 1.0, False),
        (_base(**TOKEN, io_dtype=torch.bfloat16), [FMAX], [FMAX], 1.0, 3e38, 1e30, True),
        (_base(kv_dtype="fp8_e5m2", causal=False), [3e38], [1e20], TINY, None, 1e38, False),
    ]
    for wl, ks, vs, sm, cap, q, z in reversed(pins):
        f = example(wl=replace(wl, softmax_scale=sm, soft_cap=cap), k_scales=ks, v_scales=vs, softmax_scale=sm,
                    cap=cap, q_amp=q, zero_keys=z)(f)
    return f


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=max(10, settings.default.max_examples // 2))
@_examples
@_given()
def test_attention_is_finite_and_matches_at_extreme_scales(device, wl, k_scales, v_scales, softmax_scale, cap,
                                                            q_amp, zero_keys):
    wl = replace(wl, softmax_scale=softmax_scale, soft_cap=cap)
    if wl.scale_granularity == "token_head":
        # write_kv never stores a subnormal token_head scale (it floors them at 2^-126): keep them normal
        k_scales = [max(x, 2.0**-126) for x in k_scales]
        v_scales = [max(x, 2.0**-126) for x in v_scales]
    _check(wl, device, k_scales, v_scales, zero_keys, q_amp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_subnormal_token_scales_stay_finite(device, gran):
    """Scales down to the smallest subnormal (token_head: beyond what write_kv stores) and up to the
    float32 max in one cache: finite outputs on every backend."""
    wl = _base(**(TOKEN if gran == "token_head" else {}))
    cache = _extreme_cache(wl, device, [2.0**-149, TINY, FMAX], [FMAX, 2.0**-149, 1e-40], False, 3)
    t = wl.tensors(device)
    for b in _attention_backends(device):
        for sm in (TINY, 1.0, FMAX):
            out, lse = fp8kv.paged_attention_one_shot(t.query, cache, t.block_tables, t.seq_lens, backend=b,
                                                      return_lse=True,
                                             query_start_loc=t.query_start_loc, softmax_scale=sm)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (b, sm)


@pytest.mark.parametrize("device", DEVICES)
def test_output_saturates_to_its_dtype(device):
    """Huge v_scale (v' = 448 * FLOAT32_MAX): the output is its dtype's largest finite value."""
    for io_dtype in (torch.float32, torch.bfloat16, torch.float16):
        wl = _base(io_dtype=io_dtype, q_lens=(1, 1), chunked=False)
        for gran in ("tensor", "token_head"):
            wl = replace(wl, **(TOKEN if gran == "token_head" else {}))
            cache = _extreme_cache(wl, device, [1.0], [FMAX], False, 5)
            cache.value_cache.view(torch.uint8).fill_(0x7E)  # e4m3 448
            t = wl.tensors(device)
            for b in _attention_backends(device):
                out = fp8kv.paged_attention_one_shot(t.query, cache, t.block_tables, t.seq_lens, backend=b)
                assert (out == torch.finfo(io_dtype).max).all(), (b, io_dtype, gran)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_saturated_logits_tie(device, gran):
    """softmax_scale = FLOAT32_MAX: every logit saturates to +-LOGIT_MAX, so the keys with a positive
    q.k share the weight equally and the others get none (a defined result, the same on every backend)."""
    wl = _base(q_lens=(1, 1), chunked=False, **(TOKEN if gran == "token_head" else {}))
    cache = _extreme_cache(wl, device, [0.5], [0.25], False, 6)
    cache.key_cache.view(torch.uint8).fill_(0xB8)  # e4m3 -1.0
    for pos in (0, 3):  # sequence 0 (blocks 4, 0, 2): keys 0 and 3 get +1.0
        cache.key_cache.view(torch.uint8)[4, pos].fill_(0x38)
    t = wl.tensors(device)
    query = torch.ones_like(t.query)
    v = cache.dequantized("value").cpu().double()  # [slots, H, D]
    group = wl.num_q_heads // wl.num_kv_heads
    want = torch.empty(2, wl.num_q_heads, wl.head_size, dtype=torch.float64)
    want[0] = ((v[4 * 4 + 0] + v[4 * 4 + 3]) / 2).repeat_interleave(group, 0)
    slots1 = [b * 4 + o for b in (1, 3) for o in range(4)][:5]
    want[1] = v[slots1].mean(0).repeat_interleave(group, 0)
    for b in _attention_backends(device):
        out, lse = fp8kv.paged_attention_one_shot(query, cache, t.block_tables, t.seq_lens, backend=b,
                                                  softmax_scale=FMAX,
                                         return_lse=True)
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-6, atol=1e-6, msg=b)
        torch.testing.assert_close(lse.cpu().double()[0], torch.full((wl.num_q_heads,), LOGIT_MAX + math.log(2),
                                                                     dtype=torch.float64), rtol=1e-6, atol=0)
        torch.testing.assert_close(lse.cpu().double()[1], torch.full((wl.num_q_heads,), -LOGIT_MAX + math.log(5),
                                                                     dtype=torch.float64), rtol=1e-6, atol=0)


def test_scales_beyond_float32_are_refused_by_name():
    """A softmax_scale or soft-cap that is finite in Python but inf in float32: a named error (API) and
    a ValueError at the kernel launcher."""
    wl = _base()
    cache = _extreme_cache(wl, "cpu", [1.0], [1.0], False, 1)
    t = wl.tensors()
    for kw, name in ((dict(softmax_scale=1e300), "softmax_scale"), (dict(logits_soft_cap=1e300), "logits_soft_cap"),
                     (dict(softmax_scale=0.0), "softmax_scale"), (dict(logits_soft_cap=-1.0), "logits_soft_cap")):
        with pytest.raises(InvalidArgument, match=name):
            fp8kv.paged_attention_one_shot(t.query, cache, t.block_tables, t.seq_lens,
                                           query_start_loc=t.query_start_loc,
                                  **kw)
    pytest.importorskip("triton")
    from fp8kv_triton.attention import paged_attention

    for sm, cap in ((1e300, None), (1.0, 1e300), (math.inf, None), (-1.0, None)):
        with pytest.raises(ValueError, match="softmax_scale|logits_soft_cap"):
            paged_attention(t.query, cache, t.block_tables, t.seq_lens, t.query_start_loc, 3, sm, True, None, cap,
                            torch.empty_like(t.query), decode_mode=0, interpret=True)


# ------------------------------------------------------------------------------------- writes


def _extreme_inputs(n, H, D, dtype, seed):
    """Finite values spanning the dtype's range: subnormals, zeros, moderate, huge, the max."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    mag = torch.exp2(torch.empty(n, H, D).uniform_(math.log2(fi.smallest_normal) - 8, math.log2(fi.max), generator=g))
    x = mag * torch.where(torch.rand(n, H, D, generator=g) < 0.5, -1.0, 1.0)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, fi.max, -fi.max])
    return x.clamp(-fi.max, fi.max).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", sorted(FORMATS))
@pytest.mark.parametrize("gran,scales", [("tensor", (TINY,)), ("tensor", (3e38,)), ("tensor", (FMAX,)),
                                         ("tensor", (2.0**-149,)), ("head", (TINY, 3e38)), ("token_head", None)])
def test_writes_at_extreme_scales_saturate_and_stay_bit_exact(device, kv_dtype, gran, scales):
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    H, D, nb, bs = 2, 16, 3, 4
    fmt = FORMATS[kv_dtype]
    caches = []
    for backend in ("reference", "triton"):
        static = dict(k_scale=torch.tensor(scales), v_scale=torch.tensor(scales[::-1])) if scales else {}
        cache = fp8kv.KVCache.allocate(nb, bs, H, D, kv_dtype=kv_dtype, scale_granularity=gran, device=device,
                                       **static)
        for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
            x = _extreme_inputs(4, H, D, dtype, seed=i)
            slots = torch.arange(4 * i, 4 * i + 4, device=device)
            fp8kv.write_kv_one_shot(cache, x.to(device), (-x).to(device), slots, backend=backend)
        caches.append(cache)
    ref, tri = caches
    assert tri.same_bytes(ref)
    bad = set(fmt.nan_encodings + fmt.inf_encodings)
    for c in (ref.key_cache, ref.value_cache):
        codes = set(c.view(torch.uint8).flatten().tolist())
        assert not codes & bad, "a NaN/inf code from finite input"
    for s in (ref.k_scale, ref.v_scale):
        assert torch.isfinite(s).all() and (s > 0).all()
