"""Every class of bad input raises Fp8KVError naming the argument and leaves the cache unchanged."""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv import Fp8KVError

H, D, BS, NB = 2, 16, 4, 6


@pytest.fixture
def cache():
    c = fp8kv.KVCache.allocate(NB, BS, H, D, scale_granularity="token_head")
    g = torch.Generator().manual_seed(0)
    fp8kv.write_kv_one_shot(c, torch.randn(8, H, D, generator=g), torch.randn(8, H, D, generator=g),
                   torch.arange(8), backend="reference")
    return c


def kv(n=3, dtype=torch.float32):
    return torch.randn(n, H, D, dtype=dtype), torch.randn(n, H, D, dtype=dtype)


def meta(t):
    return torch.empty_like(t, device="meta")


WRITE_CASES = {
    "key dtype": (lambda: (*[x.to(torch.int32) for x in kv()], torch.arange(3)), "key", "dtype"),
    "key rank": (lambda: (torch.randn(3, H * D), torch.randn(3, H * D), torch.arange(3)), "key", "dimensions"),
    "key device": (lambda: (meta(kv()[0]), kv()[1], torch.arange(3)), "key", "device"),
    "heads": (lambda: (torch.randn(3, H + 1, D), torch.randn(3, H + 1, D), torch.arange(3)), "key", "num_kv_heads"),
    "head size": (lambda: (torch.randn(3, H, D * 2), torch.randn(3, H, D * 2), torch.arange(3)), "key", "head_size"),
    "value mismatch": (lambda: (kv()[0], kv(dtype=torch.float16)[1], torch.arange(3)), "value", "key"),
    "slot dtype": (lambda: (*kv(), torch.arange(3).float()), "slot_mapping", "dtype"),
    "slot count": (lambda: (*kv(), torch.arange(4)), "slot_mapping", "one per token"),
    "slot range": (lambda: (*kv(), torch.tensor([0, 1, NB * BS])), "slot_mapping", "< num_blocks * block_size"),
    "slot twice": (lambda: (*kv(), torch.tensor([5, -1, 5])), "slot_mapping", "at most once"),
    "non-contiguous": (lambda: (torch.randn(3, D, H).transpose(1, 2), kv()[1], torch.arange(3)), "key",
                       "contiguous"),
    "value shape, same dtype": (lambda: (kv(3)[0], kv(2)[1], torch.arange(3)), "value", "shape and dtype of key"),
}


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_bad_write_raises_and_leaves_cache_unchanged(cache, case):
    make, argname, expected = WRITE_CASES[case]
    before = cache.clone()
    with pytest.raises(Fp8KVError) as err:
        fp8kv.write_kv_one_shot(cache, *make())
    assert str(err.value).startswith(argname + ":"), str(err.value)
    assert expected in str(err.value)
    assert cache.same_bytes(before)


def decode_args():
    return dict(query=torch.randn(2, 2 * H, D), block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 3], dtype=torch.int32))


def bad(**changes):
    def make():
        a = decode_args()
        a.update({k: (v() if callable(v) else v) for k, v in changes.items()})
        return a
    return make


ATTN_CASES = {
    "query dtype": (bad(query=lambda: torch.randn(2, 2 * H, D).to(torch.float64)), "query", "dtype"),
    "query heads": (bad(query=lambda: torch.randn(2, H + 1, D)), "query", "multiple of num_kv_heads"),
    "query head size": (bad(query=lambda: torch.randn(2, 2 * H, D + 1)), "query", "head_size"),
    "query device": (bad(query=lambda: torch.empty(2, 2 * H, D, device="meta")), "query", "device"),
    "query tokens (decode)": (bad(query=lambda: torch.randn(3, 2 * H, D)), "query", "one per sequence"),
    "table dtype": (bad(block_tables=lambda: torch.tensor([[0, 1], [2, 3]], dtype=torch.int16)), "block_tables",
                    "dtype"),
    "table rows": (bad(block_tables=lambda: torch.tensor([[0, 1]], dtype=torch.int32)), "block_tables",
                   "one per sequence"),
    "table range": (bad(block_tables=lambda: torch.tensor([[0, NB], [2, 3]], dtype=torch.int32)),
                    "block_tables", f"[0, {NB})"),
    "negative block": (bad(block_tables=lambda: torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)),
                       "block_tables", f"[0, {NB})"),
    "seq_lens dtype": (bad(seq_lens=lambda: torch.tensor([5.0, 3.0])), "seq_lens", "dtype"),
    "int64 table beyond int32": (bad(block_tables=lambda: torch.tensor([[0, 2**32], [2, 3]])), "index tensors",
                                 "within int32"),
    "seq_lens beyond table": (bad(seq_lens=lambda: torch.tensor([9, 3], dtype=torch.int32)), "seq_lens",
                              "at most 8 tokens"),
    "seq_lens negative": (bad(seq_lens=lambda: torch.tensor([5, -1], dtype=torch.int32)), "seq_lens", ">= 0"),
    "qsl not monotone": (bad(query=lambda: torch.randn(4, 2 * H, D),
                             query_start_loc=lambda: torch.tensor([0, 3, 2], dtype=torch.int32)),
                         "query_start_loc", "non-decreasing"),
    "qsl total": (bad(query=lambda: torch.randn(4, 2 * H, D),
                      query_start_loc=lambda: torch.tensor([0, 1, 3], dtype=torch.int32)),
                  "query_start_loc", "num_tokens=4"),
    "qsl length": (bad(query=lambda: torch.randn(4, 2 * H, D),
                       query_start_loc=lambda: torch.tensor([0, 4], dtype=torch.int32)),
                   "query_start_loc", "num_seqs + 1"),
    "more queries than keys": (bad(query=lambda: torch.randn(5, 2 * H, D),
                                   query_start_loc=lambda: torch.tensor([0, 1, 5], dtype=torch.int32)),
                               "seq_lens", "query tokens"),
    "softmax_scale": (bad(softmax_scale=float("nan")), "softmax_scale", "finite number > 0"),
    "window": (bad(sliding_window=0), "sliding_window", "positive int"),
    "soft cap": (bad(logits_soft_cap=-1.0), "logits_soft_cap", "finite number > 0"),
    "out shape": (bad(out=lambda: torch.empty(2, 2 * H, D + 1)), "out", "shape"),
    "out dtype": (bad(out=lambda: torch.empty(2, 2 * H, D, dtype=torch.float16)), "out", "dtype"),
    "non-contiguous query": (bad(query=lambda: torch.randn(2, D, 2 * H).transpose(1, 2)), "query", "contiguous"),
    # planted bugs the first suite missed (hardening issue): each of these was once accepted
    "qsl not from 0": (bad(query=lambda: torch.randn(4, 2 * H, D),
                           query_start_loc=lambda: torch.tensor([1, 3, 4], dtype=torch.int32)),
                       "query_start_loc", "from 0"),
    "zero query heads": (bad(query=lambda: torch.randn(2, 0, D)), "query", "positive multiple"),
    "causal not a bool": (bad(causal=1), "causal", "True or False"),
    "non-contiguous out": (bad(out=lambda: torch.empty(2, D, 2 * H).transpose(1, 2)), "out", "contiguous"),
    "max_query_len not an int": (bad(query=lambda: torch.randn(4, 2 * H, D),
                                     query_start_loc=lambda: torch.tensor([0, 2, 4], dtype=torch.int32),
                                     max_query_len=2.5), "max_query_len", "int"),
    "backend None": (bad(backend=None), "backend", "'auto' or a backend name"),
}


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_bad_attention_raises_and_leaves_cache_unchanged(cache, case):
    make, argname, expected = ATTN_CASES[case]
    before = cache.clone()
    args = make()
    with pytest.raises(Fp8KVError) as err:
        fp8kv.paged_attention_one_shot(args.pop("query"), cache, args.pop("block_tables"), args.pop("seq_lens"), **args)
    assert str(err.value).startswith(argname + ":"), str(err.value)
    assert expected in str(err.value)
    assert cache.same_bytes(before)


def test_int64_index_tensors_are_accepted_and_converted_once(cache):
    """vLLM and SGLang hand over int64 block tables and lengths: same result as int32."""
    a = decode_args()
    want = fp8kv.paged_attention_one_shot(a["query"], cache, a["block_tables"], a["seq_lens"], backend="reference")
    got = fp8kv.paged_attention_one_shot(a["query"], cache, a["block_tables"].long(), a["seq_lens"].long(),
                                backend="reference")
    meta = fp8kv.plan_attention(cache, num_q_heads=2 * H, query_dtype=torch.float32,
                                block_tables=a["block_tables"].long(), seq_lens=a["seq_lens"].long())
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert torch.equal(got, want)


def test_good_attention_call_passes(cache):
    """The fixture's good arguments work, so the cases above fail for their one change."""
    a = decode_args()
    out = fp8kv.paged_attention_one_shot(a["query"], cache, a["block_tables"], a["seq_lens"], backend="reference")
    assert out.shape == (2, 2 * H, D) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scales_are_refused(scale):
    with pytest.raises(Fp8KVError, match="^k_scale:"):
        fp8kv.KVCache.allocate(2, 4, H, D, k_scale=scale)
    with pytest.raises(Fp8KVError, match="^scale:"):
        fp8kv.quantize(torch.ones(2), "fp8_e4m3", scale)


@pytest.mark.parametrize("kwargs,argname", [
    (dict(kv_dtype="fp8_e3m4"), "kv_dtype"), (dict(kv_dtype="auto"), "kv_dtype"),
    (dict(layout="NDH"), "layout"), (dict(scale_granularity="channel"), "scale_granularity"),
    (dict(k_scale=torch.ones(3), scale_granularity="head"), "k_scale"),
    (dict(k_scale=1.0, scale_granularity="token_head"), "k_scale"),
])
def test_bad_allocation_is_refused(kwargs, argname):
    with pytest.raises(Fp8KVError) as err:
        fp8kv.KVCache.allocate(2, 4, H, D, **kwargs)
    assert str(err.value).startswith(argname), str(err.value)


def test_not_a_cache():
    with pytest.raises(Fp8KVError, match="^cache:"):
        fp8kv.write_kv_one_shot(object(), *kv(), torch.arange(3))


ALLOCATE_CASES = [
    (dict(num_blocks=0), "num_blocks"), (dict(num_blocks=-1), "num_blocks"), (dict(num_blocks=True), "num_blocks"),
    (dict(num_blocks=2.0), "num_blocks"), (dict(block_size="4"), "block_size"), (dict(head_size=None), "head_size"),
    (dict(num_blocks=2**40), "num_blocks"),  # 2 x 2^40 x 128 bytes: the allocation fails, named
    (dict(num_blocks=2**62), "num_blocks"),  # the element count itself overflows
    (dict(device="garbage"), "device"), (dict(device=3), "device"), (dict(device="mps"), "device"),
    (dict(kv_dtype=None, layout="XYZ"), "layout"), (dict(kv_dtype=torch.float16), "kv_dtype"),
    (dict(scale_granularity="channel"), "scale_granularity"),
    (dict(k_scale="0.5"), "k_scale"), (dict(k_scale=torch.ones((), device="meta")), "k_scale"),
    (dict(k_scale=[1.0, 2.0]), "k_scale"), (dict(k_scale=torch.ones(2, 2), scale_granularity="head"), "k_scale"),
    (dict(v_scale=float("inf")), "v_scale"), (dict(v_scale=torch.ones(3), scale_granularity="head"), "v_scale"),
]


@pytest.mark.parametrize("kwargs,argname", ALLOCATE_CASES, ids=[f"{list(k)[0]}={k[list(k)[0]]!r}"[:40]
                                                                for k, _ in ALLOCATE_CASES])
def test_bad_allocation_arguments_are_named(kwargs, argname):
    args = dict(num_blocks=2, block_size=4, num_kv_heads=H, head_size=D)
    pos = {k: kwargs.pop(k) for k in list(kwargs) if k in args}
    args.update(pos)
    with pytest.raises(Fp8KVError) as err:
        fp8kv.KVCache.allocate(args.pop("num_blocks"), args.pop("block_size"), args.pop("num_kv_heads"),
                               args.pop("head_size"), **kwargs)
    assert str(err.value).startswith(argname + ":"), str(err.value)


@pytest.mark.parametrize("layout", ["XYZ", None, 3])
def test_resolve_refuses_an_unknown_layout(layout):
    with pytest.raises(fp8kv.InvalidArgument, match="^layout:"):
        fp8kv.resolve_kv_cache("fp8_e4m3", None, "cpu", layout=layout)
