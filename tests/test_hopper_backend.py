"""The Hopper backend's kernel through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
conftest), against the reference's FP8 attention mode within the mode's derived tolerance; its
capability rule on simulated devices. The H100 runs are in tests/test_hopper_gpu.py."""

from __future__ import annotations

import pytest
import torch

import fp8kv
import fp8kv.reference
from fp8kv.plugins import Request
from fp8kv.probe import simulated, triton_interpreter
from fp8kv.testing.tolerance import assert_fp8_attention_close, fp8_attention_tolerance

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreter(),
                                 reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")


def _case(seed=0, granularity="head", layout="NHD", H=2, HQ=8, D=32, page=4, seqs=2, new=3, cached=21,
          dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    L = new + cached
    nblk = -(-L // page) + 1  # one spare block per sequence
    tables = torch.randperm(seqs * nblk, generator=g).to(torch.int32).view(seqs, nblk)
    scales = (0.02 + 0.05 * torch.rand(H, generator=g)) if granularity == "head" else 0.04
    cache = fp8kv.KVCache.allocate(seqs * nblk, page, H, D, kv_dtype="fp8_e4m3", layout=layout,
                                   scale_granularity=granularity, k_scale=scales, v_scale=scales)
    n = seqs * nblk * page
    fp8kv.reference.write_kv(cache, torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g),
                             torch.arange(n))
    T = seqs * new
    q = (torch.randn(T, HQ, D, generator=g) * 2).to(dtype)
    lens = torch.tensor([L - 2 * i for i in range(seqs)], dtype=torch.int32)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32) if new > 1 else None
    return cache, q, tables, lens, qsl


def _check(case, backend="hopper", **kw):
    cache, q, tables, lens, qsl = case
    HQ = q.shape[1]
    args = dict(block_tables=tables, seq_lens=lens, query_start_loc=qsl, fp8_attention=True, **kw)
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, backend=backend, **args)
    assert meta.backend == backend
    out, lse = fp8kv.paged_attention(q, cache, meta, return_lse=True)
    ref_meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=q.dtype, backend="reference", **args)
    ref, ref_lse = fp8kv.paged_attention(q, cache, ref_meta, return_lse=True)
    opts = ref_meta.options
    tol, lse_tol = fp8_attention_tolerance(
        q, cache, tables, lens, qsl, ref, ref_lse, softmax_scale=opts.softmax_scale, causal=opts.causal,
        sliding_window=opts.sliding_window,
        logits_soft_cap=opts.logits_soft_cap, q_scale=opts.q_scale, prob_scale=opts.prob_scale)
    assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol)
    return meta


@interpreted
@pytest.mark.parametrize("granularity", ["head", "tensor"])
@pytest.mark.parametrize("q_scale", [None, "kv_head", "q_head", "tensor"])
def test_chunked_prefill_matches_the_reference(granularity, q_scale):
    qs = {None: None, "tensor": torch.tensor(0.01), "kv_head": torch.tensor([0.01, 0.004]),
          "q_head": torch.linspace(0.003, 0.02, 8)}[q_scale]
    _check(_case(granularity=granularity), q_scale=qs)


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_split_kv_matches_the_reference(monkeypatch, splits):
    import dataclasses

    from fp8kv_hopper import attention

    choose = attention.choose_config

    def split_config(**kw):  # the interpreter's own plan has one split (one "SM")
        cfg = choose(**kw)
        return dataclasses.replace(cfg, num_splits=splits, keys_per_split=-(-kw["max_keys"] // splits // 32) * 32)

    monkeypatch.setattr(attention, "choose_config", split_config)
    meta = _check(_case(new=1, cached=90, seqs=2))
    assert meta.backend_plan.config.num_splits == splits


@interpreted
@pytest.mark.parametrize("kw", [dict(sliding_window=5), dict(logits_soft_cap=3.0), dict(causal=False),
                                dict(prob_scale=0.25), dict(softmax_scale=2.0**20)])
def test_options_match_the_reference(kw):
    _check(_case(seed=2), **kw)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries_and_hnd_layout(dtype):
    _check(_case(seed=3, layout="HND", dtype=dtype))


@interpreted
def test_conformance_kit_fp8_mode():
    from fp8kv.testing import check_backend

    report = check_backend("hopper", max_seqs=2, max_seq_len=24, head_sizes=(32,), kv_dtypes=("fp8_e4m3",),
                           granularities=("tensor", "head"), fp8_attention="only", examples=12)
    assert report.served["paged_attention"] and report.served["write_kv"]


def _req(features=frozenset({"fp8_attention"}), fmt="fp8_e4m3", gran="head", D=128, device_type="cuda"):
    return Request("paged_attention", fmt, "NHD", gran, D, torch.bfloat16, device_type, frozenset(features))


def test_supports_says_why_on_simulated_devices(monkeypatch):
    from fp8kv_hopper import plugin

    monkeypatch.setattr(plugin, "triton_interpreter", lambda: False)
    h100 = simulated("sm90")
    assert plugin.supports(h100, _req()) is None
    assert "needs sm90" in plugin.supports(simulated("sm80"), _req())
    assert "NVIDIA sm90" in plugin.supports(simulated("gfx942"), _req())
    assert "default-mode attention" in plugin.supports(h100, _req(features=frozenset()))
    assert "fp8_e4m3 cache" in plugin.supports(h100, _req(fmt="fp8_e5m2"))
    assert "tensor or head" in plugin.supports(h100, _req(gran="token_head"))
    assert "head_size 80" in plugin.supports(h100, _req(D=80))


@interpreted
@pytest.mark.parametrize("kernel, match", [("wgmma", "'wgmma' does not serve this call"),
                                           ("cuda", "'cuda' does not serve this call"),
                                           ("cutlass", "expected 'auto', 'triton', 'wgmma' or 'cuda'")])
def test_a_kernel_that_cannot_serve_is_refused_by_name(kernel, match):
    """``Fp8AttnConfig.kernel``: the CUDA kernel says why it cannot take a call (here: the CPU
    interpreter, head size 32), an unknown name is refused; neither writes ``out``."""
    import dataclasses

    from fp8kv_hopper import attention

    from fp8kv.errors import InvalidArgument

    cache, q, tables, lens, qsl = _case()
    cfg = attention.choose_config(group=4, num_seqs=2, num_kv_heads=2, max_query_len=3, max_keys=28, num_sms=1,
                                  interpret=True)
    out = torch.full_like(q, 7.0)
    with pytest.raises(InvalidArgument, match=match):
        attention.paged_attention_fp8(q, cache, tables, lens, qsl, 3, 32**-0.5, True, None, None, out, q_scale=None,
                                      prob_scale=1.0, config=dataclasses.replace(cfg, kernel=kernel), interpret=True)
    assert (out == 7.0).all()


@pytest.mark.parametrize("group", [1, 4, 6, 64, 128, 200, 256])
@pytest.mark.parametrize("max_query_len", [1, 7, 2048])
def test_every_query_head_of_a_group_has_a_row(group, max_query_len):
    """A program's rows are ``block_q`` tokens times the GQA group (row = token * group + head): a
    block smaller than the group would leave heads without a program (prefill used 128 rows for any
    group, so heads 128.. of a 256-head group were never written)."""
    from fp8kv_hopper.attention import choose_config

    cfg = choose_config(group=group, num_seqs=2, num_kv_heads=1, max_query_len=max_query_len, max_keys=4096,
                        num_sms=132)
    assert cfg.block_m >= group


def test_only_a_cuda_decode_step_gets_a_decode_plan():
    """HopperPlan.decode (the tensor-core decode's plan, made once per step) is None where no decode kernel
    of fp8kv_cuda would run: a CPU tensor, a prefill step, the Triton kernel asked for, the interpreter."""
    import dataclasses
    from types import SimpleNamespace

    from fp8kv_hopper.attention import choose_config
    from fp8kv_hopper.plugin import _decode_plan

    def meta(device: str, max_query_len: int = 1) -> SimpleNamespace:
        spec = SimpleNamespace(device=torch.device(device), num_kv_heads=8, head_size=128, block_size=16)
        return SimpleNamespace(spec=spec, max_query_len=max_query_len, num_tokens=4, num_q_heads=32,
                               block_tables=torch.zeros(4, 8, dtype=torch.int32))

    cfg = choose_config(group=4, num_seqs=4, num_kv_heads=8, max_query_len=1, max_keys=128, num_sms=132)
    assert cfg.kernel == "auto"
    assert _decode_plan(meta("cpu"), cfg, interpret=False) is None
    assert _decode_plan(meta("cuda", max_query_len=2), cfg, interpret=False) is None
    assert _decode_plan(meta("cuda"), dataclasses.replace(cfg, kernel="triton"), interpret=False) is None
    assert _decode_plan(meta("cuda"), cfg, interpret=True) is None
