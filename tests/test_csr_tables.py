"""FlashInfer's CSR page table (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``), read by fp8kv/step.py.

* Only ``kv_indices[:kv_indptr[-1]]`` is read or checked: engines allocate it longer and leave the
  tail uninitialized (SGLang's FlashInfer backend: ``sum(seq pages) + 256`` entries), so whatever
  sits there (negative, past the cache, beyond int32) plans and attends as the exact-length table.
* Every refusal of the CSR form names its argument, and each test below fails without its check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fp8kv
from fp8kv import InvalidArgument
from fp8kv.probe import triton_interpreter

H, GROUP, D, BS, NB = 2, 2, 16, 4, 8
HQ = H * GROUP
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# three sequences of 2, 1 and 3 pages: 7, 4 and 9 tokens
INDPTR = [0, 2, 3, 6]
INDICES = [4, 0, 6, 2, 5, 1]
LAST = [3, 4, 1]
LENS = [7, 4, 9]
QSL = [0, 2, 3, 5]  # prefill: 2, 1 and 2 new tokens


def _t(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _csr(indices=INDICES, indptr=INDPTR, last=LAST, dtype=torch.int32) -> dict:
    return dict(kv_indptr=_t(indptr, dtype), kv_indices=_t(indices, dtype), kv_last_page_len=_t(last, dtype))


@pytest.fixture(scope="module")
def cache() -> fp8kv.KVCache:
    g = torch.Generator().manual_seed(11)
    c = fp8kv.KVCache.allocate(NB, BS, H, D, scale_granularity="token_head")
    k, v = torch.randn(NB * BS, H, D, generator=g), torch.randn(NB * BS, H, D, generator=g)
    fp8kv.write_kv_one_shot(c, k, v, torch.arange(NB * BS), backend="reference")
    return c


def _plan(cache, backend: str = "reference", **kw) -> fp8kv.AttentionMetadata:
    return fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.float32, backend=backend, **kw)


def _query(n: int = 3) -> torch.Tensor:
    return torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(n))


def _with_tail(tail: list[int], dtype=torch.int32, **kw) -> dict:
    return _csr(indices=INDICES + tail, dtype=dtype, **kw)


def _same_step(a: fp8kv.AttentionMetadata, b: fp8kv.AttentionMetadata) -> None:
    assert torch.equal(a.block_tables, b.block_tables) and torch.equal(a.seq_lens, b.seq_lens)
    assert (a.max_seq_len, a.max_query_len, a.num_tokens) == (b.max_seq_len, b.max_query_len, b.num_tokens)


def test_the_csr_table_becomes_the_padded_one(cache):
    meta = _plan(cache, **_csr())
    assert meta.block_tables.tolist() == [[4, 0, 0], [6, 0, 0], [2, 5, 1]]
    assert meta.seq_lens.tolist() == LENS


# ------------------------------------------------------------------------------- the unused tail

TAILS = {
    "negative": [-7] * 5,
    "int32-extremes": [INT32_MIN, INT32_MAX, -1, NB, NB + 1],
    "sglang-256": list(range(-128, 128)),
}
WIDE_TAILS = {"beyond-int32": [2**40, -(2**40), 2**62, -(2**63), 2**63 - 1]}


@pytest.mark.parametrize("validate", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize(("dtype", "tail"), [(torch.int32, t) for t in TAILS.values()]
                         + [(torch.int64, t) for t in (*TAILS.values(), *WIDE_TAILS.values())],
                         ids=[f"int32-{n}" for n in TAILS] + [f"int64-{n}" for n in (*TAILS, *WIDE_TAILS)])
def test_entries_past_the_last_offset_are_never_read(cache, dtype, tail, validate):
    """Decode and prefill plans with a garbage tail equal the exact-length table's (tables, lengths,
    sizes); attention over them gives the same outputs."""
    for extra, n in ((dict(), 3), (dict(query_start_loc=_t(QSL)), 5)):
        clean = _plan(cache, **_csr(dtype=dtype), **extra)
        got = _plan(cache, **_with_tail(tail, dtype), validate=validate, max_seq_len=9 if not validate else None,
                    max_query_len=2 if extra and not validate else None, **extra)
        _same_step(got, clean)
        q = _query(n)
        assert torch.equal(fp8kv.paged_attention(q, cache, got), fp8kv.paged_attention(q, cache, clean))


@pytest.mark.parametrize("backend", ["reference", "torch"]
                         + (["triton"] if not torch.cuda.is_available() and triton_interpreter() else []))
def test_a_garbage_tail_attends_as_the_clean_table_on_every_backend(cache, backend):
    tail = TAILS["sglang-256"]
    qsl = _t(QSL)
    clean = _plan(cache, **_csr(), query_start_loc=qsl, backend=backend)
    got = _plan(cache, **_with_tail(tail), query_start_loc=qsl, backend=backend)
    q = _query(5)
    out, lse = fp8kv.paged_attention(q, cache, got, return_lse=True)
    want_out, want_lse = fp8kv.paged_attention(q, cache, clean, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_update_with_a_garbage_tail(cache):
    """``AttentionMetadata.update`` reads the CSR table the same way (its own tail length)."""
    meta = _plan(cache, **_csr(), max_blocks=4)
    swapped = [1, 5, 2, 6, 0, 4]
    meta.update(**_csr(indices=swapped + [-9] * 300))
    want = _plan(cache, **_csr(indices=swapped), max_blocks=4)
    _same_step(meta, want)


def test_an_empty_step_with_only_a_tail(cache):
    """No sequence: ``kv_indptr = [0]``, every entry of ``kv_indices`` unused."""
    meta = _plan(cache, kv_indptr=_t([0]), kv_indices=_t([-7, NB, INT32_MIN]), kv_last_page_len=_t([]))
    assert meta.block_tables.shape[0] == 0 and meta.num_tokens == 0


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), st.sampled_from([torch.int32, torch.int64]))
@example([-7], torch.int32)
@example([2**31], torch.int64)
def test_any_tail_plans_as_the_clean_table(cache, tail, dtype):
    if dtype == torch.int32:
        tail = [x & 0xFFFFFFFF for x in tail]
        tail = [x - 2**32 if x >= 2**31 else x for x in tail]
    _same_step(_plan(cache, **_with_tail(tail, dtype)), _plan(cache, **_csr(dtype=dtype)))


# ------------------------------------------------------------------------------- refusals


def _refused(cache, pattern: str, **kw) -> None:
    with pytest.raises(InvalidArgument, match=pattern):
        _plan(cache, **kw)


def test_offsets_past_the_end_of_kv_indices_are_refused_by_name(cache):
    """``kv_indptr[-1] > len(kv_indices)``: the table is shorter than its offsets say."""
    _refused(cache, r"^kv_indptr: got offsets from 0 to 7, expected .*at most len\(kv_indices\)=6",
             **_csr(indptr=[0, 2, 3, 7]))
    _refused(cache, r"^kv_indptr: got offsets from 0 to 6, expected .*at most len\(kv_indices\)=5",
             **_csr(indices=INDICES[:5]))


def test_offsets_not_starting_at_zero_are_refused(cache):
    _refused(cache, r"^kv_indptr: got offsets from 1 to 6, expected non-decreasing offsets from 0",
             **_csr(indptr=[1, 2, 3, 6]))


def test_decreasing_offsets_are_refused(cache):
    _refused(cache, r"^kv_indptr: got offsets from 0 to 6, expected non-decreasing", **_csr(indptr=[0, 4, 3, 6]))


def test_kv_indptr_of_another_length_than_the_sequences_is_refused(cache):
    _refused(cache, r"^kv_indptr: got 3 entries, expected num_seqs \+ 1 = 4", **_csr(indptr=[0, 2, 6]))
    _refused(cache, r"^kv_indptr: got 5 entries, expected num_seqs \+ 1 = 4", **_csr(indptr=[0, 2, 3, 6, 6]))


@pytest.mark.parametrize("last", [[3, 0, 1], [3, 4, -2], [3, BS + 1, 1]], ids=["zero", "negative", "past-the-page"])
def test_last_page_lengths_outside_the_page_are_refused(cache, last):
    _refused(cache, rf"^kv_last_page_len: got values in .*, expected 1\.\.block_size={BS}", **_csr(last=last))


def test_a_sequence_without_pages_takes_any_last_page_length(cache):
    """``kv_last_page_len`` is not read for a sequence with no page (its length is 0)."""
    meta = _plan(cache, **_csr(indptr=[0, 2, 2, 5], indices=[4, 0, 2, 5, 1], last=[3, 0, 1]),
                 query_start_loc=_t([0, 1, 1, 2]))
    assert meta.seq_lens.tolist() == [7, 0, 9]


@pytest.mark.parametrize(("at", "block"), [(0, -1), (5, NB), (2, INT32_MAX)], ids=["negative", "past", "int32-max"])
def test_block_ids_outside_the_cache_in_the_used_part_are_refused(cache, at, block):
    indices = list(INDICES)
    indices[at] = block
    _refused(cache, rf"^kv_indices: got block {block}, expected ids in \[0, {NB}\)", **_csr(indices=indices))
    _refused(cache, rf"^kv_indices: got block {block}, expected ids in \[0, {NB}\)",
             **_csr(indices=indices + [0] * 4))


def test_int64_block_ids_beyond_int32_in_the_used_part_are_refused(cache):
    indices = list(INDICES)
    indices[3] = 2**32 + 2  # (as int32: 2, a valid block)
    _refused(cache, r"^index tensors: got a value 4294967298", **_csr(indices=indices, dtype=torch.int64))


def test_max_blocks_below_the_longest_page_list_is_refused(cache):
    _refused(cache, r"^max_blocks: got 2, expected >= the most pages of a sequence \(3\)", **_csr(), max_blocks=2)


def test_queries_longer_than_the_csr_lengths_are_refused(cache):
    _refused(cache, r"^kv_indptr/kv_last_page_len: got 4 tokens for sequence 1, expected >= its 5 query tokens",
             **_csr(), query_start_loc=_t([0, 1, 6, 7]))


def test_host_lengths_other_than_the_csr_ones_are_refused(cache):
    _plan(cache, **_csr(), host_seq_lens=LENS)
    _refused(cache, r"^host_seq_lens: got other values than the tensor's", **_csr(), host_seq_lens=[7, 4, 8])


def test_max_seq_len_below_the_longest_csr_sequence_is_refused(cache):
    _refused(cache, r"^max_seq_len: got 8, expected >= the longest sequence \(9\)", **_csr(), max_seq_len=8)


def test_update_past_the_planned_columns_is_refused(cache):
    meta = _plan(cache, **_csr())
    with pytest.raises(InvalidArgument, match=r"^kv_indptr: got a sequence of 4 pages, expected at most 3 pages per "
                                              r"sequence \(the planned block table\)"):
        meta.update(**_csr(indptr=[0, 1, 2, 6], last=[3, 4, 1]))


def test_both_page_table_forms_at_once_are_refused(cache):
    _refused(cache, r"^block_tables/seq_lens: got given with kv_indptr", **_csr(), block_tables=_t([[0], [1], [2]]))
    _refused(cache, r"^block_tables/seq_lens: got given with kv_indptr", **_csr(), seq_lens=_t(LENS))


NAMES = ("kv_indptr", "kv_indices", "kv_last_page_len")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("bad", "message"), [
    ("missing", "got NoneType, expected a torch.Tensor"),
    ("list", "got list, expected a torch.Tensor"),
    ("float32", "got dtype torch.float32, expected one of"),
    ("int16", "got dtype torch.int16, expected one of"),
    ("bool", "got dtype torch.bool, expected one of"),
    ("2-d", r"got shape \(1, \d\), expected 1 dimensions"),
    ("0-d", r"got shape \(\), expected 1 dimensions"),
    ("meta-device", "got device meta, expected the cache's device cpu"),
])
def test_csr_tensors_of_the_wrong_kind_are_refused_by_name(cache, name, bad, message):
    kw = _csr()
    t = kw[name]
    kw[name] = {
        "missing": None,
        "list": t.tolist(),
        "float32": t.float(),
        "int16": t.to(torch.int16),
        "bool": t.bool(),
        "2-d": t[None],
        "0-d": t[0],
        "meta-device": t.to("meta"),
    }[bad]
    _refused(cache, rf"^{name}: {message}", **kw)
