"""The step's page table and lengths, read and checked once: the first two steps of
:func:`fp8kv.plan_attention` (and of :meth:`fp8kv.AttentionMetadata.update`).

* the page table, padded (``block_tables [S, max_blocks]`` and ``seq_lens [S]``) or FlashInfer's
  CSR form (``kv_indptr [S + 1]``, ``kv_indices``, ``kv_last_page_len [S]``), becomes int32 copies
  the metadata owns, on the device; of ``kv_indices`` only the entries before ``kv_indptr[-1]`` are
  read or checked (engines allocate it longer and leave the tail uninitialized: SGLang's FlashInfer
  backend, ``sum(seq pages) + 256`` entries);
* the queries: one per sequence (decode) or ``query_start_loc [S + 1]`` offsets (chunked prefill);
* the *values* (lengths, offsets, block ids, slot ranges and duplicates) are checked in one host
  transfer, which also yields the derived sizes (longest query and sequence) the caller did not
  give; with checks off and the sizes given, nothing is read back.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import CacheSpec
from .checks import (
    INDEX_DTYPES,
    INT32_MAX,
    check_slot_values,
    check_tensor,
    nonneg_int,
    owned_index,
    slot_stats,
    values_checked,
)
from .errors import bad_argument


@dataclass(frozen=True)
class StepTables:
    """A step's page table and lengths, as the metadata keeps them.

    Attributes:
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32, the step's tokens included.
        query_start_loc: ``[num_seqs + 1]`` int32 offsets of each sequence's queries.
        is_decode: one query per sequence (no ``query_start_loc`` was given).
        slot_mapping: ``[num_written]`` slots of the step's K/V (a copy), or None.
        num_tokens, max_query_len, max_seq_len: the step's query tokens and the bounds the
            kernels may rely on.
        host_seq_lens / host_query_start_loc: the lengths as host ints, where given or read.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    is_decode: bool
    slot_mapping: torch.Tensor | None
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    host_seq_lens: list[int] | None
    host_query_start_loc: list[int] | None


@dataclass(frozen=True)
class _PageTable:
    """The page table as given: padded (``tables``) or CSR (``indptr``, ``indices``, ``last``, ``pages``;
    ``indices`` is all of ``kv_indices``, of which only ``[:indptr[-1]]`` is in use: :meth:`indices_in_use`)."""

    lens: torch.Tensor
    tables: torch.Tensor | None = None
    indptr: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    last: torch.Tensor | None = None
    pages: torch.Tensor | None = None

    @property
    def csr(self) -> bool:
        return self.indptr is not None

    @property
    def num_seqs(self) -> int:
        return self.lens.shape[0]

    def indices_in_use(self) -> torch.Tensor:
        """CSR: ``[len(kv_indices)]`` bool, True for the entries before ``kv_indptr[-1]`` (a device
        tensor: no sync). The entries past it are never read: they may hold anything."""
        return torch.arange(self.indices.shape[0], device=self.indices.device) < self.indptr[-1]


def read_page_table(spec: CacheSpec, block_tables, seq_lens, kv_indptr, kv_indices, kv_last_page_len) -> _PageTable:
    """Shapes and dtypes of the page table in either form; int32 copies on the device."""
    dev, bs = spec.device, spec.block_size
    if kv_indptr is not None or kv_indices is not None or kv_last_page_len is not None:
        if block_tables is not None or seq_lens is not None:
            raise bad_argument("block_tables/seq_lens", "given with kv_indptr/kv_indices/kv_last_page_len",
                               "one page-table form: padded (block_tables, seq_lens) or CSR")
        indptr = owned_index("kv_indptr", kv_indptr, 1, dev)
        indices = owned_index("kv_indices", kv_indices, 1, dev)
        last = owned_index("kv_last_page_len", kv_last_page_len, 1, dev)
        S = last.shape[0]
        if indptr.shape[0] != S + 1:
            raise bad_argument("kv_indptr", f"{indptr.shape[0]} entries", f"num_seqs + 1 = {S + 1}")
        pages = indptr[1:] - indptr[:-1]
        lens = torch.where(pages > 0, (pages - 1) * bs + last, torch.zeros_like(last))
        return _PageTable(lens, indptr=indptr, indices=indices, last=last, pages=pages)
    if block_tables is None or seq_lens is None:
        raise bad_argument("block_tables/seq_lens", "None",
                           "a padded page table (block_tables and seq_lens) or a CSR one (kv_indptr, ...)")
    tables = owned_index("block_tables", block_tables, 2, dev)
    lens = owned_index("seq_lens", seq_lens, 1, dev)
    if tables.shape[0] != lens.shape[0]:
        raise bad_argument("block_tables", f"{tables.shape[0]} rows", f"one per sequence ({lens.shape[0]})")
    return _PageTable(lens, tables=tables)


def read_queries(spec: CacheSpec, num_seqs: int, query_start_loc, num_tokens: int | None,
                 max_query_len: int | None) -> tuple[torch.Tensor, bool, int | None, int | None]:
    """``(query_start_loc, is_decode, num_tokens, max_query_len)``: decode without offsets (one
    query per sequence), chunked prefill with them (sizes left None when not given)."""
    S = num_seqs
    if query_start_loc is None:
        if num_tokens is not None and num_tokens != S:
            raise bad_argument("num_tokens", num_tokens,
                               f"one per sequence ({S}) for decode; pass query_start_loc for prefill")
        if max_query_len is not None and max_query_len < 1 and S:
            raise bad_argument("max_query_len", max_query_len, ">= 1 for decode")
        return torch.arange(S + 1, dtype=torch.int32, device=spec.device), True, S, 1
    qsl = owned_index("query_start_loc", query_start_loc, 1, spec.device)
    if qsl.shape[0] != S + 1:
        raise bad_argument("query_start_loc", f"{qsl.shape[0]} entries", f"num_seqs + 1 = {S + 1}")
    return qsl, False, num_tokens, max_query_len


def _used_part(kv_indices: torch.Tensor, in_use: torch.Tensor) -> torch.Tensor:
    """``kv_indices`` with the entries not in use (past ``kv_indptr[-1]``) replaced by 0 (no sync)."""
    return torch.where(in_use, kv_indices, torch.zeros((), dtype=kv_indices.dtype, device=kv_indices.device))


def _device_values(spec: CacheSpec, pt: _PageTable, qsl: torch.Tensor, slot_mapping, originals, kv_indices,
                   check: bool) -> list[tuple[str, torch.Tensor]]:
    """The device scalars the one host transfer reads: sizes always, value checks when ``check``
    (``originals``: the index tensors as given, whose int64 values must fit int32; of ``kv_indices``,
    one of them, only the entries in use)."""
    dev, bs, S, lens = spec.device, spec.block_size, pt.num_seqs, pt.lens
    z = torch.zeros((), dtype=torch.int64, device=dev)
    amax = (lambda t: t.max().to(torch.int64)) if S else (lambda t: z)
    amin = (lambda t: t.min().to(torch.int64)) if S else (lambda t: z)
    q_lens = (qsl[1:] - qsl[:-1]).to(torch.int64)
    need = [("max_seq_len", amax(lens)), ("min_seq_len", amin(lens)),
            ("max_query_len", amax(q_lens)), ("min_query_len", amin(q_lens)),
            ("qsl_first", qsl[0].to(torch.int64)), ("qsl_last", qsl[-1].to(torch.int64)),
            ("q_over_seq", amax(q_lens - lens.to(torch.int64)) if S else z - 1)]
    if not check:
        return need + ([("max_pages", amax(pt.pages))] if pt.csr else [])
    in_use = pt.indices_in_use() if pt.csr else None
    wide = [_used_part(t, in_use) if t is kv_indices else t for t in originals
            if isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.numel()]
    need += [("int64_max", torch.stack([t.max() for t in wide]).max() if wide else z),
             ("int64_min", torch.stack([t.min() for t in wide]).min() if wide else z)]
    if pt.csr:
        ones = torch.ones_like(pt.last)
        need += [("indptr_first", pt.indptr[0].to(torch.int64)), ("indptr_last", pt.indptr[-1].to(torch.int64)),
                 ("min_pages", amin(pt.pages)), ("max_pages", amax(pt.pages)),
                 ("min_last", amin(torch.where(pt.pages > 0, pt.last, ones))),
                 ("max_last", amax(torch.where(pt.pages > 0, pt.last, ones)))]
        used = pt.indices
    else:  # the entries each sequence reads; masked with where (boolean indexing would sync)
        cols = torch.arange(pt.tables.shape[1], device=dev)
        used = pt.tables
        in_use = cols[None, :] < (lens[:, None] + bs - 1).div(bs, rounding_mode="floor")
    if used.numel():  # with no entry in use: min INT32_MAX, max -1, both in range
        need += [("min_block", torch.where(in_use, used, INT32_MAX).min().to(torch.int64)),
                 ("max_block", torch.where(in_use, used, -1).max().to(torch.int64))]
    if slot_mapping is not None:
        hi, _, dup = slot_stats(slot_mapping)
        need += [("max_slot", hi), ("dup_slot", dup)]
    return need


def read_step(spec: CacheSpec, *, block_tables=None, seq_lens=None, kv_indptr=None, kv_indices=None,
              kv_last_page_len=None, query_start_loc=None, slot_mapping=None, num_tokens: int | None = None,
              max_query_len: int | None = None, max_seq_len: int | None = None, max_blocks: int | None = None,
              validate: bool | None = None, host_seq_lens: Sequence[int] | None = None,
              host_query_start_loc: Sequence[int] | None = None, planned_width: bool = False) -> StepTables:
    """Read and check one step's page table and lengths (arguments as :func:`fp8kv.plan_attention`).

    ``planned_width``: ``max_blocks`` is the width of a table already planned
    (:meth:`fp8kv.AttentionMetadata.update`), so a wider CSR row is refused naming ``kv_indptr``."""
    num_tokens, max_query_len, max_seq_len, max_blocks = (
        None if v is None else nonneg_int(name, v)  # plain Python ints from here on
        for name, v in (("num_tokens", num_tokens), ("max_query_len", max_query_len), ("max_seq_len", max_seq_len),
                        ("max_blocks", max_blocks)))
    check = values_checked(spec.device, validate)
    pt = read_page_table(spec, block_tables, seq_lens, kv_indptr, kv_indices, kv_last_page_len)
    S = pt.num_seqs
    qsl, decode, num_tokens, max_query_len = read_queries(spec, S, query_start_loc, num_tokens, max_query_len)
    if slot_mapping is not None:
        check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=spec.device)

    # one host transfer: every value check and the derived sizes
    host: dict[str, int] = {}
    read: tuple[list[int] | None, list[int] | None] = (None, None)
    if check or num_tokens is None or max_query_len is None or (pt.csr and max_blocks is None
                                                                and max_seq_len is None):
        originals = (block_tables, seq_lens, query_start_loc, kv_indptr, kv_indices, kv_last_page_len)
        need = _device_values(spec, pt, qsl, slot_mapping, originals, kv_indices, check)
        values = torch.stack([v for _, v in need])
        if check:  # the lengths ride along (backends plan the step by them)
            values = torch.cat([values, pt.lens.to(torch.int64), qsl.to(torch.int64)])
        flat = values.tolist()
        host = dict(zip([n for n, _ in need], flat[:len(need)], strict=True))
        if check:
            read = (flat[len(need):len(need) + S], flat[len(need) + S:])
    host_lens = _host_ints("host_seq_lens", host_seq_lens, S, read[0])
    host_qsl = _host_ints("host_query_start_loc", host_query_start_loc, S + 1, read[1])

    if check:
        _check_values(spec, host, pt, decode, num_tokens, max_query_len, max_seq_len, qsl, slot_mapping, max_blocks,
                      planned_width)
    if num_tokens is None:
        num_tokens = host["qsl_last"]
    if max_query_len is None:
        max_query_len = host["max_query_len"]
    max_query_len = min(max_query_len, num_tokens)  # no query is longer than the step (unchecked input)
    tables = pt.tables if not pt.csr else _padded_table(spec, pt, max_blocks, max_seq_len, host)
    if max_seq_len is None:
        max_seq_len = host.get("max_seq_len", tables.shape[1] * spec.block_size)
    return StepTables(tables, pt.lens, qsl, decode, None if slot_mapping is None else slot_mapping.clone(),
                      num_tokens, max_query_len, max_seq_len, host_lens, host_qsl)


def _padded_table(spec: CacheSpec, pt: _PageTable, max_blocks: int | None, max_seq_len: int | None,
                  host: dict[str, int]) -> torch.Tensor:
    """A CSR page table as a padded ``[num_seqs, max_blocks]`` int32 table (unused entries 0)."""
    if max_blocks is None:
        # (unchecked offsets may decrease: such a sequence has no pages, never a negative count)
        max_blocks = -(-max_seq_len // spec.block_size) if max_seq_len is not None else max(host["max_pages"], 0)
    cols = torch.arange(max_blocks, device=spec.device, dtype=torch.int32)
    pos = pt.indptr[:-1, None] + cols[None, :]
    inside = pos < pt.indptr[1:, None]
    if pt.indices.numel():
        return torch.where(inside, pt.indices[pos.clamp(0, pt.indices.numel() - 1).long()], 0).to(torch.int32)
    return torch.zeros((pt.num_seqs, max_blocks), dtype=torch.int32, device=spec.device)


def _host_ints(name: str, given, want: int, read: list[int] | None) -> list[int] | None:
    """The caller's host copy ``given`` of a length tensor as a list of ints, checked (``want`` values,
    int64, equal to ``read``, the tensor's values where they were read); ``read`` where none was given."""
    if given is None:
        return read
    try:
        given = [operator.index(x) for x in given]
    except TypeError:
        raise bad_argument(name, type(given).__name__, "a sequence of Python ints") from None
    if any(not -(2**63) <= x < 2**63 for x in given):
        raise bad_argument(name, "a value outside int64", "int64 values, as the tensor's")
    if len(given) != want or (read is not None and given != read):
        raise bad_argument(name, f"{len(given)} values" if len(given) != want else "other values than the tensor's",
                           f"{want} host ints equal to the tensor's")
    return given


def _check_values(spec: CacheSpec, host: dict[str, int], pt: _PageTable, decode: bool, num_tokens, max_query_len,
                  max_seq_len, qsl: torch.Tensor, slot_mapping, max_blocks, planned_width: bool) -> None:
    """Raise the named error for the first bad value (values from the one host transfer)."""
    bs, S, lens, csr = spec.block_size, pt.num_seqs, pt.lens, pt.csr
    if host.get("int64_max", 0) > INT32_MAX or host.get("int64_min", 0) < -INT32_MAX - 1:
        raise bad_argument("index tensors", f"a value {host['int64_max']} / {host['int64_min']}",
                           "values within int32 (block ids, lengths and offsets are stored as int32)")
    if csr:
        if host["indptr_first"] != 0 or host["min_pages"] < 0 or host["indptr_last"] > (pt.indices.numel()):
            raise bad_argument("kv_indptr", f"offsets from {host['indptr_first']} to {host['indptr_last']}",
                               f"non-decreasing offsets from 0 to at most len(kv_indices)={pt.indices.numel()}")
        if S and (host["min_last"] < 1 or host["max_last"] > bs):
            raise bad_argument("kv_last_page_len", f"values in [{host['min_last']}, {host['max_last']}]",
                               f"1..block_size={bs} for sequences with pages")
        if max_blocks is not None and host["max_pages"] > max_blocks:
            if planned_width:
                raise bad_argument("kv_indptr", f"a sequence of {host['max_pages']} pages",
                                   f"at most {max_blocks} pages per sequence (the planned block table)")
            raise bad_argument("max_blocks", max_blocks, f">= the most pages of a sequence ({host['max_pages']})")
    if S and host["min_seq_len"] < 0:
        raise bad_argument("seq_lens", host["min_seq_len"], "lengths >= 0")
    if not csr and S and host["max_seq_len"] > pt.tables.shape[1] * bs:
        i = int(lens.argmax())
        raise bad_argument("seq_lens", f"{host['max_seq_len']} for sequence {i}",
                           f"at most {pt.tables.shape[1] * bs} tokens (block_tables has {pt.tables.shape[1]} "
                           f"columns of block_size {bs})")
    if not decode:
        if host["qsl_first"] != 0 or (S and host["min_query_len"] < 0) or (
                num_tokens is not None and host["qsl_last"] != num_tokens):
            starts = qsl.tolist()
            raise bad_argument("query_start_loc", starts[:8] + (["..."] if len(starts) > 8 else []),
                               "non-decreasing offsets from 0 to num_tokens"
                               + (f"={num_tokens}" if num_tokens is not None else ""))
    if S and host["q_over_seq"] > 0:
        i = int(((qsl[1:] - qsl[:-1]) > lens).nonzero()[0, 0])
        what = "kv_indptr/kv_last_page_len" if csr else "seq_lens"  # (CSR: the lengths they give)
        raise bad_argument(what, f"{int(lens[i])} tokens for sequence {i}",
                           f">= its {int(qsl[i + 1] - qsl[i])} query tokens (the lengths include the new tokens)")
    if max_query_len is not None and S and max_query_len < host["max_query_len"]:
        raise bad_argument("max_query_len", max_query_len, f">= the longest query ({host['max_query_len']})")
    if max_seq_len is not None and S and max_seq_len < host["max_seq_len"]:
        raise bad_argument("max_seq_len", max_seq_len, f">= the longest sequence ({host['max_seq_len']})")
    if "min_block" in host and (host["min_block"] < 0 or host["max_block"] >= spec.num_blocks):
        bad = host["min_block"] if host["min_block"] < 0 else host["max_block"]
        raise bad_argument("kv_indices" if csr else "block_tables", f"block {bad}",
                           f"ids in [0, {spec.num_blocks})")
    if "max_slot" in host:
        check_slot_values(spec, slot_mapping, host["max_slot"], host["dup_slot"])


__all__ = ["StepTables", "read_page_table", "read_queries", "read_step"]
