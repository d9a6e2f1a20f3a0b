"""Every refusal of ``plan_attention``, ``AttentionMetadata.update`` and the write path, one case each.

One good step (two sequences, a padded page table, chunked prefill, slots) is planned and
written; each case changes one thing and must raise :class:`fp8kv.InvalidArgument` whose message
starts with the argument's name (and says what was expected), with the cache unchanged. The
page-table-form conversions (CSR) and the one-shot attention call have their own tests; here
are the checks of :mod:`fp8kv.checks`, :mod:`fp8kv.step`, :mod:`fp8kv.metadata`,
:mod:`fp8kv.planning`, :mod:`fp8kv.fp8_attention` and the write half of :mod:`fp8kv.api`.
"""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.errors import InvalidArgument

H, GROUP, D, BS, NB = 2, 2, 16, 4, 8
HQ = H * GROUP


def make_cache(kv_dtype="fp8_e4m3", granularity="head", num_blocks=NB) -> fp8kv.KVCache:
    g = torch.Generator().manual_seed(0)
    scales = {} if granularity == "token_head" else dict(k_scale=torch.full((H,), 0.05),
                                                         v_scale=torch.full((H,), 0.05))
    if granularity == "tensor":
        scales = dict(k_scale=0.05, v_scale=0.05)
    c = fp8kv.KVCache.allocate(num_blocks, BS, H, D, kv_dtype=kv_dtype, scale_granularity=granularity, **scales)
    n = num_blocks * BS
    fp8kv.write_kv_one_shot(c, torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g),
                            torch.arange(n), backend="reference")
    return c


@pytest.fixture
def cache() -> fp8kv.KVCache:
    return make_cache()


def assert_refused(call, argname: str, expected: str) -> None:
    """``call()`` raises the InvalidArgument naming ``argname`` first, with ``expected`` in its message."""
    with pytest.raises(InvalidArgument) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(argname + ":"), msg
    assert expected in msg, msg


def i32(*rows) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.int32)


def good() -> dict:
    """A good prefill step: sequences of 9 and 6 tokens, 3 and 2 of them new, 5 slots."""
    return dict(num_q_heads=HQ, query_dtype=torch.float32, block_tables=i32([0, 1, 2], [3, 4, 5]),
                seq_lens=i32(9, 6), query_start_loc=i32(0, 3, 5), slot_mapping=torch.tensor([6, 7, 8, 20, 21]),
                backend="reference")


def good_decode() -> dict:
    kw = good()
    del kw["query_start_loc"]
    kw["slot_mapping"] = torch.tensor([8, 21])
    return kw


CSR = dict(block_tables=None, seq_lens=None, kv_indptr=torch.tensor([0, 3, 5]),
           kv_indices=torch.tensor([0, 1, 2, 3, 4]), kv_last_page_len=torch.tensor([1, 2]))

# ----------------------------------------------------------------------------- plan_attention
# name -> (changes to the good step (decode=True: the good decode step), argument, words of the expectation)
PLAN_CASES: dict[str, tuple[dict, str, str]] = {
    # planning.check_heads
    "num_q_heads not a multiple": (dict(num_q_heads=3), "num_q_heads", "multiple of num_kv_heads=2"),
    "num_q_heads zero": (dict(num_q_heads=0), "num_q_heads", "positive multiple"),
    "num_q_heads negative": (dict(num_q_heads=-2), "num_q_heads", "positive multiple"),
    "num_q_heads a float": (dict(num_q_heads=4.0), "num_q_heads", "positive multiple"),
    "num_q_heads a bool": (dict(num_q_heads=True), "num_q_heads", "positive multiple"),
    "query_dtype float64": (dict(query_dtype=torch.float64), "query_dtype", "torch.bfloat16"),
    "query_dtype a string": (dict(query_dtype="float32"), "query_dtype", "torch.float32"),
    # AttentionOptions.build
    "softmax_scale NaN": (dict(softmax_scale=float("nan")), "softmax_scale", "finite number > 0"),
    "softmax_scale zero": (dict(softmax_scale=0.0), "softmax_scale", "finite number > 0"),
    "softmax_scale negative": (dict(softmax_scale=-0.5), "softmax_scale", "finite number > 0"),
    "softmax_scale inf": (dict(softmax_scale=float("inf")), "softmax_scale", "finite number > 0"),
    "softmax_scale past float32": (dict(softmax_scale=1e39), "softmax_scale", "(float32)"),
    "softmax_scale a string": (dict(softmax_scale="0.5"), "softmax_scale", "a one-element CPU tensor"),
    "softmax_scale a bool": (dict(softmax_scale=True), "softmax_scale", "a NumPy scalar"),
    "softmax_scale two elements": (dict(softmax_scale=torch.tensor([0.5, 0.5])), "softmax_scale",
                                   "one-element CPU tensor"),
    "softmax_scale on another device": (dict(softmax_scale=torch.tensor(0.5, device="meta")), "softmax_scale",
                                        "wait for the device"),
    "softmax_scale past the float range": (dict(softmax_scale=10**400), "softmax_scale", "float32 range"),
    "causal not a bool": (dict(causal=1), "causal", "True or False"),
    "both window conventions": (dict(sliding_window=4, window_left=3), "window_left", "one convention at a time"),
    "window_left below -1": (dict(window_left=-2), "window_left", "-1 for no window"),
    "window_left a float": (dict(window_left=2.5), "window_left", "-1 for no window"),
    "sliding_window zero": (dict(sliding_window=0), "sliding_window", "a positive int W"),
    "sliding_window negative": (dict(sliding_window=-1), "sliding_window", "a positive int W"),
    "sliding_window a float": (dict(sliding_window=2.5), "sliding_window", "a positive int W"),
    "sliding_window an integral float": (dict(sliding_window=4.0), "sliding_window", "a positive int W"),
    "sliding_window a bool": (dict(sliding_window=True), "sliding_window", "a positive int W"),
    "sliding_window a float tensor": (dict(sliding_window=torch.tensor(4.0)), "sliding_window", "integer CPU tensor"),
    "logits_soft_cap zero": (dict(logits_soft_cap=0.0), "logits_soft_cap", "finite number > 0"),
    "logits_soft_cap NaN": (dict(logits_soft_cap=float("nan")), "logits_soft_cap", "finite number > 0"),
    "logits_soft_cap a string": (dict(logits_soft_cap="30"), "logits_soft_cap", "finite number > 0"),
    # fp8_attention.check_fp8_options
    "fp8_attention not a bool": (dict(fp8_attention=1), "fp8_attention", "True or False"),
    "q_scale without the FP8 mode": (dict(q_scale=torch.ones(())), "q_scale", "None unless fp8_attention=True"),
    "prob_scale without the FP8 mode": (dict(prob_scale=0.5), "prob_scale", "unless fp8_attention=True"),
    "prob_scale a string": (dict(prob_scale="1"), "prob_scale", "finite number in [2^-126"),
    "prob_scale a CPU tensor of two": (dict(fp8_attention=True, prob_scale=torch.ones(2)), "prob_scale",
                                       "one-element CPU tensor"),
    "prob_scale on another device": (dict(fp8_attention=True, prob_scale=torch.ones((), device="meta")),
                                     "prob_scale", "wait for the device"),
    "prob_scale below 2^-126": (dict(fp8_attention=True, prob_scale=2.0**-127), "prob_scale", "[2^-126"),
    "prob_scale inf": (dict(fp8_attention=True, prob_scale=float("inf")), "prob_scale", "[2^-126"),
    "q_scale a float": (dict(fp8_attention=True, q_scale=0.5), "q_scale", "a float32 tensor"),
    "q_scale float16": (dict(fp8_attention=True, q_scale=torch.ones((), dtype=torch.float16)), "q_scale",
                        "float32 of shape []"),
    "q_scale of 3 heads": (dict(fp8_attention=True, q_scale=torch.ones(3)), "q_scale", "[2] (per KV head)"),
    "q_scale on another device": (dict(fp8_attention=True, q_scale=torch.ones((), device="meta")), "q_scale",
                                  "on the cache's device"),
    "q_scale requiring grad": (dict(fp8_attention=True, q_scale=torch.ones((), requires_grad=True)), "q_scale",
                               "plain scale tensor"),
    "q_scale zero": (dict(fp8_attention=True, q_scale=torch.tensor([1.0, 0.0])), "q_scale", "finite values > 0"),
    "q_scale NaN": (dict(fp8_attention=True, q_scale=torch.tensor(float("nan"))), "q_scale", "finite values > 0"),
    # step.read_step: sizes
    "num_tokens negative": (dict(num_tokens=-1), "num_tokens", "an int >= 0"),
    "num_tokens a float": (dict(num_tokens=5.0), "num_tokens", "an int >= 0"),
    "max_query_len a float": (dict(max_query_len=2.5), "max_query_len", "an int >= 0"),
    "max_query_len a bool": (dict(max_query_len=True), "max_query_len", "an int >= 0"),
    "max_seq_len negative": (dict(max_seq_len=-1), "max_seq_len", "an int >= 0"),
    "max_blocks a float tensor": (dict(max_blocks=torch.tensor(3.0)), "max_blocks", "an int >= 0"),
    "validate not a bool": (dict(validate=1), "validate", "True or False or None"),
    # step.read_page_table
    "both page-table forms": (dict(kv_indptr=torch.tensor([0, 3, 5])), "block_tables/seq_lens", "one page-table form"),
    "no page table": (dict(block_tables=None, seq_lens=None), "block_tables/seq_lens", "a padded page table"),
    "no seq_lens": (dict(seq_lens=None), "block_tables/seq_lens", "a padded page table"),
    "block_tables a list": (dict(block_tables=[[0, 1, 2], [3, 4, 5]]), "block_tables", "a torch.Tensor"),
    "block_tables float": (dict(block_tables=torch.zeros(2, 3)), "block_tables", "dtype"),
    "block_tables one-dimensional": (dict(block_tables=i32(0, 1, 2)), "block_tables", "2 dimensions"),
    "block_tables on another device": (dict(block_tables=torch.zeros(2, 3, dtype=torch.int32, device="meta")),
                                       "block_tables", "the cache's device"),
    "seq_lens int16": (dict(seq_lens=torch.tensor([9, 6], dtype=torch.int16)), "seq_lens", "dtype"),
    "seq_lens two-dimensional": (dict(seq_lens=i32([9, 6])), "seq_lens", "1 dimensions"),
    "block_tables rows": (dict(block_tables=i32([0, 1, 2])), "block_tables", "one per sequence (2)"),
    "kv_indptr entries": (dict(CSR, kv_indptr=torch.tensor([0, 3])), "kv_indptr", "num_seqs + 1 = 3"),
    # step.read_queries
    "decode num_tokens": (dict(decode=True, num_tokens=3), "num_tokens", "one per sequence (2) for decode"),
    "decode max_query_len 0": (dict(decode=True, max_query_len=0), "max_query_len", ">= 1 for decode"),
    "query_start_loc float": (dict(query_start_loc=torch.tensor([0.0, 3.0, 5.0])), "query_start_loc", "dtype"),
    "query_start_loc entries": (dict(query_start_loc=i32(0, 5)), "query_start_loc", "num_seqs + 1 = 3"),
    # step.read_step: slots
    "slot_mapping two-dimensional": (dict(slot_mapping=torch.tensor([[6, 7, 8, 20, 21]])), "slot_mapping",
                                     "1 dimensions"),
    "slot_mapping float": (dict(slot_mapping=torch.tensor([6.0, 7.0, 8.0, 20.0, 21.0])), "slot_mapping", "dtype"),
    "slot_mapping on another device": (dict(slot_mapping=torch.zeros(5, dtype=torch.int64, device="meta")),
                                       "slot_mapping", "the cache's device"),
    "slot_mapping not contiguous": (dict(slot_mapping=torch.tensor([6, 0, 7, 0, 8, 0, 20, 0, 21, 0])[::2]),
                                    "slot_mapping", "a contiguous tensor"),
    "slot_mapping past the cache": (dict(slot_mapping=torch.tensor([6, 7, 8, 20, NB * BS])), "slot_mapping",
                                    f"slots < num_blocks * block_size = {NB * BS}"),
    "slot_mapping twice": (dict(slot_mapping=torch.tensor([6, 7, 6, -1, -1])), "slot_mapping",
                           "each slot written at most once"),
    # step.read_step: host copies
    "host_seq_lens not ints": (dict(host_seq_lens=[9.0, 6.0]), "host_seq_lens", "a sequence of Python ints"),
    "host_seq_lens not a sequence": (dict(host_seq_lens=9), "host_seq_lens", "a sequence of Python ints"),
    "host_seq_lens past int64": (dict(host_seq_lens=[2**63, 6]), "host_seq_lens", "int64 values"),
    "host_seq_lens count": (dict(host_seq_lens=[9]), "host_seq_lens", "2 host ints"),
    "host_seq_lens values": (dict(host_seq_lens=[9, 5]), "host_seq_lens", "equal to the tensor's"),
    "host_query_start_loc values": (dict(host_query_start_loc=[0, 2, 5]), "host_query_start_loc",
                                    "3 host ints equal to the tensor's"),
    # step._check_values
    "int64 beyond int32": (dict(block_tables=torch.tensor([[0, 1, 2**32], [3, 4, 5]])), "index tensors",
                           "values within int32"),
    "int64 below int32": (dict(seq_lens=torch.tensor([9, -2**31 - 1])), "index tensors", "values within int32"),
    "kv_indptr past kv_indices": (dict(CSR, kv_indptr=torch.tensor([0, 3, 6])), "kv_indptr",
                                  "at most len(kv_indices)=5"),
    "kv_indptr not from 0": (dict(CSR, kv_indptr=torch.tensor([1, 3, 5])), "kv_indptr", "from 0"),
    "kv_indptr decreasing": (dict(CSR, kv_indptr=torch.tensor([0, 3, 2])), "kv_indptr", "non-decreasing"),
    "kv_last_page_len zero": (dict(CSR, kv_last_page_len=torch.tensor([0, 2])), "kv_last_page_len",
                              f"1..block_size={BS}"),
    "kv_last_page_len past the block": (dict(CSR, kv_last_page_len=torch.tensor([1, BS + 1])), "kv_last_page_len",
                                        f"1..block_size={BS}"),
    "max_blocks below the pages": (dict(CSR, max_blocks=2), "max_blocks", "the most pages of a sequence (3)"),
    "kv_indices past the cache": (dict(CSR, kv_indices=torch.tensor([0, 1, NB, 3, 4])), "kv_indices",
                                  f"ids in [0, {NB})"),
    "seq_lens negative": (dict(decode=True, seq_lens=i32(9, -1)), "seq_lens", "lengths >= 0"),
    "seq_lens past the table": (dict(seq_lens=i32(13, 6)), "seq_lens", "at most 12 tokens"),
    "query_start_loc not from 0": (dict(query_start_loc=i32(1, 3, 5)), "query_start_loc", "from 0"),
    "query_start_loc decreasing": (dict(query_start_loc=i32(0, 3, 2), num_tokens=2), "query_start_loc",
                                   "non-decreasing"),
    "query_start_loc total": (dict(num_tokens=6), "query_start_loc", "to num_tokens=6"),
    "seq_lens below the queries": (dict(seq_lens=i32(2, 6)), "seq_lens", ">= its 3 query tokens"),
    "max_query_len below the longest": (dict(max_query_len=2), "max_query_len", ">= the longest query (3)"),
    "max_seq_len below the longest": (dict(max_seq_len=8), "max_seq_len", ">= the longest sequence (9)"),
    "block id past the cache": (dict(block_tables=i32([0, 1, NB], [3, 4, 5])), "block_tables", f"ids in [0, {NB})"),
    "block id negative": (dict(block_tables=i32([0, 1, 2], [3, -1, 5])), "block_tables", f"ids in [0, {NB})"),
    # the backend
    "backend None": (dict(backend=None), "backend", "'auto' or a backend name"),
    "backend unknown": (dict(backend="nope"), "backend", "one of"),
}


def planned(cache, changes: dict) -> fp8kv.AttentionMetadata:
    changes = dict(changes)
    kw = good_decode() if changes.pop("decode", False) else good()
    kw.update(changes)
    return fp8kv.plan_attention(cache, **{k: v for k, v in kw.items() if v is not None or k in changes})


def test_the_good_steps_plan_and_write(cache):
    """The baselines are accepted, so each case below fails for its one change."""
    for kw in (good(), good_decode(), dict(good(), **CSR)):
        meta = fp8kv.plan_attention(cache, **{k: v for k, v in kw.items() if v is not None})
        n = meta.slot_mapping.shape[0]
        fp8kv.write_kv(cache, torch.randn(n, H, D), torch.randn(n, H, D), meta)
        assert fp8kv.paged_attention(torch.randn(meta.num_tokens, HQ, D), cache, meta).isfinite().all()
    planned(cache, dict(fp8_attention=True, q_scale=torch.ones(H), prob_scale=0.5))
    planned(cache, dict(sliding_window=4, logits_soft_cap=30.0, causal=False, max_blocks=3, host_seq_lens=[9, 6],
                        host_query_start_loc=[0, 3, 5], num_tokens=5, max_query_len=3, max_seq_len=12))


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan_attention_refuses_and_names_the_argument(cache, case):
    changes, argname, expected = PLAN_CASES[case]
    before = cache.clone()
    assert_refused(lambda: planned(cache, changes), argname, expected)
    assert cache.same_bytes(before)


@pytest.mark.parametrize("kv_dtype,granularity", [("fp8_e5m2", "head"), ("fp8_e4m3", "token_head")])
def test_the_fp8_mode_refuses_a_cache_it_does_not_serve(kv_dtype, granularity):
    other = make_cache(kv_dtype, granularity)
    with pytest.raises(InvalidArgument, match="^fp8_attention: got True with") as err:
        planned(other, dict(fp8_attention=True))
    assert ("fp8_e4m3" if kv_dtype != "fp8_e4m3" else "tensor or head scales") in str(err.value)


def test_plan_attention_refuses_what_is_not_a_cache():
    with pytest.raises(InvalidArgument, match="^cache: got object, expected an fp8kv.KVCache"):
        planned(object(), {})


# ---------------------------------------------------------------------- AttentionMetadata.update
UPDATE_CASES: dict[str, tuple[dict, str, str]] = {
    "other table width": (dict(block_tables=i32([0, 1, 2, 6], [3, 4, 5, 7])), "block_tables",
                          "the planned shape (2, 3)"),
    "slots dropped": (dict(slot_mapping=None), "slot_mapping", "the planned shape (5,)"),
    "other slot count": (dict(slot_mapping=torch.tensor([6, 7, 8, 20])), "slot_mapping", "the planned shape (5,)"),
    "slots twice": (dict(slot_mapping=torch.tensor([6, 6, 8, 20, 21])), "slot_mapping", "at most once"),
    "longer than planned": (dict(seq_lens=i32(10, 6)), "max_seq_len", ">= the longest sequence (10)"),
    "longer query than planned": (dict(query_start_loc=i32(0, 4, 5), seq_lens=i32(9, 6)), "max_query_len",
                                  ">= the longest query (4)"),
    "other token count": (dict(query_start_loc=i32(0, 2, 4)), "query_start_loc", "to num_tokens=5"),
    "validate not a bool": (dict(validate="yes"), "validate", "True or False or None"),
    "host lengths disagree": (dict(host_seq_lens=[9, 5]), "host_seq_lens", "equal to the tensor's"),
}


@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
def test_update_refuses_and_leaves_the_metadata_unchanged(cache, case):
    changes, argname, expected = UPDATE_CASES[case]
    meta = planned(cache, dict(max_query_len=3, max_seq_len=9))
    kw = dict(block_tables=good()["block_tables"], seq_lens=good()["seq_lens"],
              query_start_loc=good()["query_start_loc"], slot_mapping=torch.tensor([9, 10, 11, 22, 23]))
    meta.update(**kw)  # the good refill is accepted
    kept = {n: getattr(meta, n).clone() for n in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping")}
    hosts = (list(meta.host_seq_lens), list(meta.host_query_start_loc))
    kw.update(changes)
    assert_refused(lambda: meta.update(**kw), argname, expected)
    for name, t in kept.items():
        assert torch.equal(getattr(meta, name), t), name
    assert (meta.host_seq_lens, meta.host_query_start_loc) == hosts


def test_update_refuses_another_kind_of_step(cache):
    """A prefill step of one query per sequence refilled as decode (or back): same sizes, other kind."""
    prefill = planned(cache, dict(query_start_loc=i32(0, 1, 2), slot_mapping=torch.tensor([8, 21])))
    decode = planned(cache, dict(decode=True))
    for meta, qsl in ((prefill, None), (decode, i32(0, 1, 2))):
        kept = meta.query_start_loc.clone()
        with pytest.raises(InvalidArgument, match="^query_start_loc: got a different kind of step"):
            meta.update(block_tables=good()["block_tables"], seq_lens=good()["seq_lens"], query_start_loc=qsl,
                        slot_mapping=torch.tensor([8, 21]))
        assert torch.equal(meta.query_start_loc, kept)


# ------------------------------------------------------------------------------ write_kv
def kv(n=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, H, D, generator=g, dtype=dtype), torch.randn(n, H, D, generator=g, dtype=dtype)


def _shared_key(cache):
    """A float16 ``[2, H, D]`` key that is a view of the cache's own K bytes."""
    return cache.key_cache.view(-1).view(torch.uint8).view(torch.float16)[:2 * H * D].view(2, H, D)


# name -> (call(cache, meta) -> None, argument, words of the expectation); meta: the good step's
WRITE_CASES: dict[str, tuple] = {
    "metadata not a metadata": (lambda c, m: fp8kv.write_kv(c, *kv(), {"slot_mapping": m.slot_mapping}), "metadata",
                                "fp8kv.write_kv_one_shot"),
    "metadata without slots": (lambda c, m: fp8kv.write_kv(c, *kv(), planned(c, dict(slot_mapping=None))),
                               "metadata", "planned without slot_mapping"),
    "cache not a cache": (lambda c, m: fp8kv.write_kv(object(), *kv(), m), "cache", "an fp8kv.KVCache"),
    "cache of another spec": (lambda c, m: fp8kv.write_kv(make_cache(granularity="tensor"), *kv(), m), "cache",
                              "the one the metadata was planned for"),
    "key a list": (lambda c, m: fp8kv.write_kv(c, kv()[0].tolist(), kv()[1], m), "key", "a torch.Tensor"),
    "key int32": (lambda c, m: fp8kv.write_kv(c, kv()[0].to(torch.int32), kv()[1], m), "key", "dtype"),
    "key float64": (lambda c, m: fp8kv.write_kv(c, *kv(dtype=torch.float64), m), "key", "dtype"),
    "key two-dimensional": (lambda c, m: fp8kv.write_kv(c, kv()[0].view(5, H * D), kv()[1].view(5, H * D), m),
                            "key", "3 dimensions"),
    "key on another device": (lambda c, m: fp8kv.write_kv(c, kv()[0].to("meta"), kv()[1], m), "key",
                              "the cache's device"),
    "key not contiguous": (lambda c, m: fp8kv.write_kv(c, torch.randn(5, D, H).transpose(1, 2), kv()[1], m), "key",
                           "a contiguous tensor"),
    "key heads": (lambda c, m: fp8kv.write_kv(c, torch.randn(5, H + 1, D), torch.randn(5, H + 1, D), m), "key",
                  "num_kv_heads=2"),
    "key head size": (lambda c, m: fp8kv.write_kv(c, torch.randn(5, H, D + 1), torch.randn(5, H, D + 1), m), "key",
                      "head_size=16"),
    "value a list": (lambda c, m: fp8kv.write_kv(c, kv()[0], kv()[1].tolist(), m), "value", "a torch.Tensor"),
    "value shape": (lambda c, m: fp8kv.write_kv(c, kv()[0], kv(4)[1], m), "value", "the shape and dtype of key"),
    "value dtype": (lambda c, m: fp8kv.write_kv(c, kv()[0], kv(dtype=torch.float16)[1], m), "value",
                    "the shape and dtype of key"),
    "key tokens": (lambda c, m: fp8kv.write_kv(c, *kv(4), m), "key", "one per slot of the metadata (5)"),
    "key sharing the cache's memory": (
        lambda c, m: fp8kv.write_kv(c, _shared_key(c), torch.zeros(2, H, D, dtype=torch.float16),
                                    planned(c, dict(slot_mapping=torch.tensor([30, 31])))),
        "key", "separate from the cache's tensors"),
    # write_kv_one_shot
    "one-shot cache not a cache": (lambda c, m: fp8kv.write_kv_one_shot(object(), *kv(), torch.arange(5)), "cache",
                                   "an fp8kv.KVCache"),
    "one-shot key dtype": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(dtype=torch.float64), torch.arange(5)), "key",
                           "dtype"),
    "one-shot slot_mapping two-dimensional": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.arange(5)[None]),
                                              "slot_mapping", "1 dimensions"),
    "one-shot slot_mapping a list": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), [0, 1, 2, 3, 4]), "slot_mapping",
                                     "a torch.Tensor"),
    "one-shot slot_mapping float": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.arange(5.0)),
                                    "slot_mapping", "dtype"),
    "one-shot slot_mapping on another device": (
        lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.arange(5, device="meta")), "slot_mapping",
        "the cache's device"),
    "one-shot slot_mapping not contiguous": (
        lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.arange(10)[::2]), "slot_mapping", "a contiguous tensor"),
    "one-shot slot count": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.arange(4)), "slot_mapping",
                            "one per token (5)"),
    "one-shot slot past the cache": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.tensor([0, 1, 2, 3, 32])),
                                     "slot_mapping", "slots < num_blocks * block_size = 32"),
    "one-shot slot twice": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.tensor([0, 1, -1, 1, 2])),
                            "slot_mapping", "each slot written at most once"),
    "one-shot key sharing the cache's memory": (
        lambda c, m: fp8kv.write_kv_one_shot(c, _shared_key(c), torch.zeros(2, H, D, dtype=torch.float16),
                                             torch.tensor([30, 31]), backend="reference"),
        "key", "separate from the cache's tensors"),
    "one-shot backend None": (lambda c, m: fp8kv.write_kv_one_shot(c, *kv(), torch.arange(5), backend=None),
                              "backend", "'auto' or a backend name"),
}


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_write_refuses_and_leaves_the_cache_unchanged(cache, case):
    call, argname, expected = WRITE_CASES[case]
    meta = planned(cache, {})
    before = cache.clone()
    assert_refused(lambda: call(cache, meta), argname, expected)
    assert cache.same_bytes(before)
