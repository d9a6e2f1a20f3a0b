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
