"""Inference only, no aliasing: writes never join an autograd graph, outputs never require grad,
and no argument may share memory with the cache it writes or reads (hardening issue)."""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.errors import InvalidArgument

H, GROUP, D, BS, NB = 2, 2, 16, 4, 32
BACKENDS = ("reference", "triton")


def cache_and_step():
    cache = fp8kv.KVCache.allocate(NB, BS, H, D, scale_granularity="token_head")
    tables = torch.arange(4, dtype=torch.int32).view(2, 2)
    lens = torch.tensor([5, 7], dtype=torch.int32)
    return cache, tables, lens


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_never_join_the_callers_graph(backend):
    cache, _, _ = cache_and_step()
    key = torch.randn(3, H, D, requires_grad=True)
    value = torch.randn(3, H, D, requires_grad=True)
    fp8kv.write_kv_one_shot(cache, key * 2, value * 2, torch.tensor([0, 5, 9]), backend=backend)
    for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale):
        assert not t.requires_grad and t.grad_fn is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_output_never_requires_grad(backend):
    cache, tables, lens = cache_and_step()
    g = torch.Generator().manual_seed(0)
    fp8kv.write_kv_one_shot(cache, torch.randn(32, H, D, generator=g), torch.randn(32, H, D, generator=g),
                            torch.arange(32),
                   backend="reference")
    query = torch.randn(2, H * GROUP, D, requires_grad=True)
    out, lse = fp8kv.paged_attention_one_shot(query * 1.0, cache, tables, lens, return_lse=True, backend=backend)
    assert not out.requires_grad and out.grad_fn is None and not lse.requires_grad
    with pytest.raises(InvalidArgument, match="^out: got a tensor that requires grad"):
        fp8kv.paged_attention_one_shot(query, cache, tables, lens, out=torch.zeros(2, H * GROUP, D, requires_grad=True),
                              backend=backend)


def test_a_requires_grad_static_scale_is_detached_zero_copy():
    scale = torch.full((H,), 0.5, requires_grad=True)
    cache = fp8kv.KVCache.allocate(NB, BS, H, D, scale_granularity="head", k_scale=scale, v_scale=scale)
    assert not cache.k_scale.requires_grad


def test_arguments_sharing_memory_with_the_cache_are_refused():
    cache, tables, lens = cache_and_step()
    before = cache.clone()
    flat = cache.k_scale.view(-1)  # [NB * BS * H] float32, written by token_head writes
    key_in_scales = flat[: 2 * H * D].view(2, H, D)
    with pytest.raises(InvalidArgument, match="^key: got a tensor sharing memory with cache.k_scale"):
        fp8kv.write_kv_one_shot(cache, key_in_scales, torch.randn(2, H, D), torch.tensor([0, 1]))
    meta = fp8kv.plan_attention(cache, num_q_heads=H * GROUP, query_dtype=torch.float32, block_tables=tables,
                                seq_lens=lens)
    query = torch.randn(2, H * GROUP, D)
    out_in_scales = cache.v_scale.view(-1)[: 2 * H * GROUP * D].view(2, H * GROUP, D)
    with pytest.raises(InvalidArgument, match="^out: got a tensor sharing memory with cache.v_scale"):
        fp8kv.paged_attention(query, cache, meta, out=out_in_scales)
    with pytest.raises(InvalidArgument, match="^out: got a tensor sharing memory with query"):
        fp8kv.paged_attention(query, cache, meta, out=query)
    assert cache.same_bytes(before)
