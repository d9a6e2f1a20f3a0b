"""The reference's paged attention against an independent float64 dense oracle.

Shapes, formats, layouts, granularities, scales, block tables with holes and shuffled
blocks, GQA ratios, head sizes 64/80/128/256, windows, soft-cap and chunked prefill are
drawn by the conformance kit's strategy; the tolerance is the derived one of
:mod:`fp8kv.testing.tolerance` (the oracle is float64, so it covers the reference alone).
"""

from __future__ import annotations

import torch
from dense_oracle import dense_attention
from hypothesis import given, settings

import fp8kv
from fp8kv.testing.strategies import workloads
from fp8kv.testing.tolerance import assert_attention_close, assert_lse_close, paged_attention_bounds

SHAPES = dict(head_sizes=(64, 80, 128, 256), max_seqs=3, max_seq_len=40, specials=False)


def run_reference(wl, layout=None):
    if layout is not None:
        wl = wl.__class__(**{**wl.__dict__, "layout": layout})
    cache = wl.fill_cache("reference")
    t = wl.tensors()
    out, lse = fp8kv.paged_attention_one_shot(t.query, cache, t.block_tables, t.seq_lens, backend="reference",
                                     query_start_loc=t.query_start_loc, return_lse=True, **wl.attention_kwargs())
    return cache, t, (out, lse)


@settings(max_examples=40)
@given(wl=workloads(**SHAPES))
def test_reference_matches_float64_dense_attention(wl):
    cache, t, (out, lse) = run_reference(wl)
    kw = wl.attention_kwargs()
    qsl = t.query_start_loc if t.query_start_loc is not None else torch.arange(wl.num_seqs + 1)
    scale = kw.get("softmax_scale") or wl.head_size ** -0.5
    exact, exact_lse = dense_attention(t.query, cache, t.block_tables, t.seq_lens, qsl, scale,
                                       causal=kw.get("causal", True), sliding_window=kw.get("sliding_window"),
                                       logits_soft_cap=kw.get("logits_soft_cap"), with_lse=True)
    bounds = paged_attention_bounds(t.query, cache, t.block_tables, t.seq_lens, t.query_start_loc, **kw)
    assert_attention_close(out, exact, **bounds, context=f"{wl}: ")
    assert_lse_close(lse, exact_lse, **bounds, context=f"{wl}: ")


@settings(max_examples=20)
@given(wl=workloads(**SHAPES))
def test_nhd_and_hnd_give_identical_results(wl):
    _, _, nhd = run_reference(wl, "NHD")
    _, _, hnd = run_reference(wl, "HND")
    assert torch.equal(nhd[0], hnd[0]) and torch.equal(nhd[1], hnd[1])
