"""The fast CPU backend (``backends/fp8kv_torch``): the conformance kit, selection, per-step index reuse."""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.registry import available_backends, select_backend
from fp8kv.testing import check_backend

pytestmark = pytest.mark.skipif("torch" not in available_backends(), reason="the torch backend is not installed")


def test_conforms_to_the_reference():
    report = check_backend("torch", device="cpu", examples=60)
    print(report.summary())
    assert report.served["write_kv"] and report.served["paged_attention"]


def test_conforms_on_larger_shapes_and_chunked_prefill():
    report = check_backend("torch", device="cpu", examples=15, max_seqs=4, max_seq_len=96, head_sizes=(64, 128))
    assert report.served["paged_attention"]


def test_auto_prefers_it_to_the_reference_on_the_cpu(monkeypatch):
    monkeypatch.delenv("FP8KV_BACKEND", raising=False)
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "torch,reference")
    cache = fp8kv.KVCache.allocate(4, 16, 2, 64, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    sel = select_backend(fp8kv.Request.for_attention(cache.spec, torch.float32), "cpu")
    assert sel.backend.name == "torch"
    assert sel.reasons["reference"].startswith("can serve, lower priority")


def test_refuses_gpu_tensors_by_name():
    cache = fp8kv.KVCache.allocate(4, 16, 2, 64, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    req = fp8kv.Request.for_attention(cache.spec, torch.float32)
    req = type(req)(req.op, req.kv_dtype, req.layout, req.scale_granularity, req.head_size, req.io_dtype, "cuda")
    reason = available_backends()["torch"].check_supports(fp8kv.probe("cpu"), req)
    assert reason and "CPU tensors only" in reason


def test_one_index_per_step_rebuilt_after_an_update(monkeypatch):
    """Layers of a step share the step's gather index; refilling the metadata in place
    (``AttentionMetadata.update``) rebuilds it, and the result follows the new lengths."""
    from fp8kv_torch import attention

    built = []
    real = attention.StepIndex.build
    monkeypatch.setattr(attention.StepIndex, "build", classmethod(lambda cls, m: built.append(1) or real(m)))
    caches = [fp8kv.KVCache.allocate(8, 4, 2, 16, kv_dtype="fp8_e4m3", scale_granularity="token_head")
              for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(16, 2, 16, generator=g) for _ in range(2))
    for c in caches:
        fp8kv.write_kv(c, k, v, torch.arange(16), backend="reference")
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    meta = fp8kv.plan_attention(caches[0], num_q_heads=4, query_dtype=torch.float32, block_tables=tables,
                                seq_lens=torch.tensor([9, 5], dtype=torch.int32), max_seq_len=12, backend="torch")
    q = torch.randn(2, 4, 16, generator=g)
    outs = [fp8kv.paged_attention(q, c, meta) for c in caches]
    assert len(built) == 1
    meta.update(block_tables=tables, seq_lens=torch.tensor([12, 7], dtype=torch.int32))
    after = fp8kv.paged_attention(q, caches[0], meta)
    assert len(built) == 2
    want = fp8kv.paged_attention(q, caches[0], tables, torch.tensor([12, 7], dtype=torch.int32), backend="reference")
    torch.testing.assert_close(after, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(after, outs[0])


@torch.inference_mode()
def test_inference_mode_metadata_is_supported():
    """transformers' generate runs under inference_mode: its tensors have no version counter."""
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16, kv_dtype="fp8_e5m2", scale_granularity="token_head")
    k = torch.randn(6, 2, 16)
    meta = fp8kv.plan_attention(cache, num_q_heads=2, query_dtype=torch.float32,
                                block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                                seq_lens=torch.tensor([6], dtype=torch.int32), slot_mapping=torch.arange(6),
                                query_start_loc=torch.tensor([0, 6], dtype=torch.int32), backend="torch")
    fp8kv.write_kv(cache, k, k, meta)
    got = fp8kv.paged_attention(k, cache, meta)
    want = fp8kv.paged_attention(k, cache, meta.block_tables, meta.seq_lens, query_start_loc=meta.query_start_loc,
                                 backend="reference")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _decode_case(scale_granularity="tensor", k_scale=None, seq_lens=(9, 5), g=2):
    """A decode step over two sequences of a small NHD e4m3 cache (written by the reference)."""
    gen = torch.Generator().manual_seed(3)
    kw = {} if k_scale is None else {"k_scale": k_scale, "v_scale": 1.0}
    cache = fp8kv.KVCache.allocate(8, 4, 2, 16, kv_dtype="fp8_e4m3", scale_granularity=scale_granularity, **kw)
    k, v = (torch.randn(24, 2, 16, generator=gen) * 100 for _ in range(2))
    fp8kv.write_kv(cache, k, v, torch.arange(24), backend="reference")
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(2, 2 * g, 16, generator=gen)
    return cache, q, tables, lens


def _both(cache, q, tables, lens, **kw):
    got = fp8kv.paged_attention(q, cache, tables, lens, backend="torch", **kw)
    want = fp8kv.paged_attention(q, cache, tables, lens, backend="reference", **kw)
    return got, want


def _assert_within_tolerance(got, want, cache, q, tables, lens, qsl=None):
    """The conformance kit's derived tolerance (fp8kv.testing.tolerance), not a picked one."""
    from fp8kv.testing import assert_attention_close, paged_attention_bounds

    assert_attention_close(got, want, **paged_attention_bounds(q, cache, tables, lens, qsl))


@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head"])
def test_float32_path_serves_plain_steps(monkeypatch, granularity):
    """Decode and chunked prefill without soft-cap, with and without the log-sum-exp, take the
    float32 path: the float64 path is never entered, and output and lse are the reference's
    within the kit's derived tolerances."""
    from fp8kv_torch import attention

    from fp8kv.testing import paged_attention_bounds

    monkeypatch.setattr(attention, "_attend_float64", lambda *a: pytest.fail("took the float64 path"))
    cache, q, tables, lens = _decode_case(granularity if granularity != "head" else "tensor")
    if granularity == "head":
        cache = fp8kv.KVCache.allocate(8, 4, 2, 16, kv_dtype="fp8_e4m3", scale_granularity="head",
                                       k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor([3.0, 0.25]))
        gen = torch.Generator().manual_seed(5)
        fp8kv.write_kv(cache, *(torch.randn(24, 2, 16, generator=gen) for _ in range(2)), torch.arange(24),
                       backend="reference")
    got, want = _both(cache, q, tables, lens)
    _assert_within_tolerance(got, want, cache, q, tables, lens)
    qp = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(4))  # prefill: 4 + 3 new tokens
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    got, want = _both(cache, qp, tables, lens, query_start_loc=qsl, max_query_len=4)
    _assert_within_tolerance(got, want, cache, qp, tables, lens, qsl)
    from fp8kv.testing.tolerance import assert_lse_close

    for qq, kw in ((q, {}), (qp, {"query_start_loc": qsl, "max_query_len": 4})):  # with the log-sum-exp
        (got, lse), (want, ref_lse) = _both(cache, qq, tables, lens, return_lse=True, **kw)
        _assert_within_tolerance(got, want, cache, qq, tables, lens, kw.get("query_start_loc"))
        assert_lse_close(lse, ref_lse, **paged_attention_bounds(qq, cache, tables, lens, kw.get("query_start_loc")))


def test_float32_overflow_falls_back_to_float64():
    """A K scale near the float32 limit overflows float32 logits; the result is still the
    reference's (finite, from float64), not inf or NaN."""
    cache, q, tables, lens = _decode_case(k_scale=1e36)
    got, want = _both(cache, q, tables, lens)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    _assert_within_tolerance(got, want, cache, q, tables, lens)


def test_float32_path_nan_and_keyless_rows_match_the_reference():
    """A NaN code at a visible key gives that sequence NaN as the reference does; a sequence
    with no visible key (a length of 0 with host checks off) gives 0 (both through the float64 path)."""
    cache, q, tables, lens = _decode_case()
    cache.key_cache.view(torch.uint8)[0, 2, 0, 3] = 0x7F  # NaN in sequence 0's key 2, head 0
    got, want = _both(cache, q, tables, lens)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0, :2]).all()
    _assert_within_tolerance(got, want, cache, q, tables, lens)  # NaN where the reference is NaN passes
    lens = torch.tensor([6, 0], dtype=torch.int32)
    got, want = _both(cache, q, tables, lens, validate=False)  # host checks off
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    _assert_within_tolerance(got, want, cache, q, tables, lens)


def test_float32_path_ignores_nan_bytes_past_a_sequence_end(monkeypatch):
    """Bytes past a shorter sequence's end (in its own last block) are never read as keys: NaN
    codes and an infinite scale there neither reach the output nor push the step to float64."""
    from fp8kv_torch import attention

    monkeypatch.setattr(attention, "_attend_float64", lambda *a: pytest.fail("took the float64 path"))
    cache, q, tables, lens = _decode_case(scale_granularity="token_head", seq_lens=(9, 5))
    # sequence 1 owns blocks 3, 4, 5 (block size 4): its length 5 ends at block 4, offset 0
    cache.key_cache.view(torch.uint8)[4, 1:] = 0x7F
    cache.value_cache.view(torch.uint8)[4, 1:] = 0xFF
    cache.k_scale[4, 2:] = float("inf")
    got, want = _both(cache, q, tables, lens)
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    _assert_within_tolerance(got, want, cache, q, tables, lens)
