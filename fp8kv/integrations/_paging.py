"""Paging bookkeeping for a batch of sequences that share one block pool (no model library).

One :class:`BlockPool` serves every layer of a model: all layers store the same tokens at
the same slots, so the block tables, sequence lengths and slot mapping of a forward step
are computed once (by the first layer that reaches the step) and reused by the others.

A *column* is one position of the padded ``[batch, q_len]`` input; a *token* is a column
whose attention-mask entry is true. Only tokens are stored: padding columns get slot -1
(``write_kv`` skips them) and are not queries of ``paged_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Fp8KVError, bad_argument


@dataclass(frozen=True)
class StepPlan:
    """The paged-attention arguments of one forward step, shared by every layer.

    Attributes:
        batch_size / q_len: the padded input shape ``[B, q_len]`` of the step.
        slot_mapping: ``[B * q_len]`` int64: the slot of each column (row-major), -1 for padding.
        token_index: ``[num_tokens]`` int64 indices of the non-padding columns in the flattened
            ``[B * q_len]`` input, or None when every column is a token.
        query_start_loc: ``[B + 1]`` int32 offsets of each row's tokens among the packed
            queries, or None for a pure decode step (one token per row).
        seq_lens: ``[B]`` int32: tokens stored per row after this step.
        block_tables: ``[B, max_blocks]`` int32: each row's blocks (unused entries are 0).
        max_query_len: the most tokens one row adds in this step.
        num_tokens: tokens written in this step (padding excluded).
    """

    batch_size: int
    q_len: int
    slot_mapping: torch.Tensor
    token_index: torch.Tensor | None
    query_start_loc: torch.Tensor | None
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    num_tokens: int


class BlockPool:
    """Blocks handed to the rows of one batch; grows geometrically or stays fixed.

    Args:
        block_size: tokens per block.
        max_cache_len: if given, each row may hold at most this many tokens and the pool is
            sized once, at the first step, to ``batch * ceil(max_cache_len / block_size)``
            blocks; a row that would exceed it raises :class:`fp8kv.Fp8KVError`. If None, the
            pool starts with what the first step needs and doubles whenever it runs out
            (amortised O(1) copying per token; layers copy their FP8 bytes when they
            next run, never a dequantized copy).
    """

    def __init__(self, block_size: int = 16, *, max_cache_len: int | None = None):
        for name, v in (("block_size", block_size), ("max_cache_len", max_cache_len)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                want = "a positive int" + (" or None" if name == "max_cache_len" else "")
                raise bad_argument(name, repr(v), want)
        self.block_size = block_size
        self.max_cache_len = max_cache_len
        self.reset()

    def reset(self) -> None:
        """Forget every row and block (the capacity is kept)."""
        self.batch_size: int | None = None
        self.seq_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.next_free = 0
        self.free: list[int] = []  # blocks below next_free that no row holds (after a rearrange)
        self.steps = 0
        self.plan: StepPlan | None = None
        self._device_tables: torch.Tensor | None = None  # [B, capacity] int32 block ids, see _tables_on
        self._device_known: list[int] = []  # entries of each row already in _device_tables
        if not hasattr(self, "capacity"):
            self.capacity = 0
            self.growths = 0

    # -- blocks ---------------------------------------------------------------------
    def _reserve(self, extra: int, batch_size: int) -> None:
        """Make room for ``extra`` more blocks, growing the pool if allowed."""
        need = self.next_free + max(0, extra - len(self.free))
        if self.max_cache_len is not None:
            if self.capacity == 0:
                self.capacity = batch_size * -(-self.max_cache_len // self.block_size)
            return  # rows are bounded by max_cache_len, so need <= capacity
        if need > self.capacity:
            self.capacity = max(need, 2 * self.capacity)
            self.growths += 1

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _take(self, n: int) -> list[int]:
        """``n`` block ids for a row: freed ones first, then new ones (the caller reserved room)."""
        if n <= 0:
            return []
        reuse = min(n, len(self.free))
        out = self.free[:reuse]
        del self.free[:reuse]
        out += range(self.next_free, self.next_free + n - reuse)
        self.next_free += n - reuse
        return out

    # -- batch surgery (beam search, batch select / repeat, crop) ----------------------
    def rearrange(self, index: list[int]) -> tuple[list[int], list[int]]:
        """Make row ``i`` hold what row ``index[i]`` holds; return the block copies this needs.

        The first new row that takes an old row takes its blocks as they are; every further
        copy of that row gets blocks of its own, whose contents the caller must copy (the
        returned ``(src, dst)`` block ids, same length). Blocks of rows nobody takes are freed.
        May grow :attr:`capacity` (the caller grows the layers' caches before copying).
        """
        if self.batch_size is None:
            raise Fp8KVError("cache: it holds no rows yet (nothing to reorder, select or repeat)")
        bad = [j for j in index if not 0 <= j < self.batch_size]
        if bad or not index:
            raise bad_argument("index", f"rows {bad[:4] or index}",
                               f"a non-empty list of rows in [0, {self.batch_size})")
        for j in sorted(set(range(self.batch_size)) - set(index)):  # rows nobody takes: free first
            self.free += self.tables[j]
        copies = [j for i, j in enumerate(index) if j in index[:i]]
        self._reserve_blocks(sum(self._blocks_for(self.seq_lens[j]) for j in copies), len(index))
        taken: set[int] = set()
        tables, src, dst = [], [], []
        for j in index:
            if j not in taken:
                taken.add(j)
                tables.append(self.tables[j])
                continue
            n = self._blocks_for(self.seq_lens[j])
            new = self._take(n)
            src += self.tables[j][:n]
            dst += new
            tables.append(new)
        self.seq_lens = [self.seq_lens[j] for j in index]
        self.tables = tables
        self._device_tables = None  # rows moved: rebuild
        self.batch_size = len(index)
        self.plan = None
        return src, dst

    def _reserve_blocks(self, n: int, batch_size: int) -> None:
        """Room for ``n`` more blocks outside a step: grows the pool in either mode."""
        need = self.next_free + max(0, n - len(self.free))
        if self.max_cache_len is not None:
            need = max(need, batch_size * self._blocks_for(self.max_cache_len))
        if need > self.capacity:
            self.capacity = need if self.max_cache_len is not None else max(need, 2 * self.capacity)
            self.growths += 1

    def crop(self, n: int) -> None:
        """Forget the last ``n`` tokens of every row (their blocks stay with the row for reuse)."""
        if self.batch_size is None or n == 0:
            return
        short = [i for i, s in enumerate(self.seq_lens) if s < n]
        if short:
            raise bad_argument("tokens_to_remove", str(-n), f"at most the shortest row's {min(self.seq_lens)} "
                               "tokens")
        self.seq_lens = [s - n for s in self.seq_lens]
        self.plan = None

    # -- steps ----------------------------------------------------------------------
    def step(self, valid: torch.Tensor | None, batch_size: int, q_len: int, device: torch.device,
             *, new: bool) -> StepPlan:
        """The plan of the current step: a new one (``new``) or the one already made.

        Args:
            valid: ``[B, q_len]`` bool (True = token, False = padding) or None (all tokens).
            batch_size / q_len: the padded input shape.
            device: where the plan's tensors live.
            new: True for the first layer of a step (advances the rows), False for the others.
        """
        if not new:
            plan = self.plan
            if plan is None or (plan.batch_size, plan.q_len) != (batch_size, q_len):
                got = "no step" if plan is None else f"[{plan.batch_size}, {plan.q_len}]"
                raise Fp8KVError(f"layers out of step: this layer sees input [{batch_size}, {q_len}] but the "
                                 f"step's first layer saw {got}; every layer must run once per forward")
            return plan
        if self.batch_size is None:
            self.batch_size = batch_size
            self.seq_lens = [0] * batch_size
            self.tables = [[] for _ in range(batch_size)]
        elif batch_size != self.batch_size:
            raise bad_argument("input", f"batch size {batch_size}", f"the cache's batch size "
                               f"{self.batch_size} (call cache.reset() for a new batch)")
        if valid is None:
            counts = [q_len] * batch_size
        else:
            counts = valid.sum(dim=1).tolist()
        new_lens = [n + c for n, c in zip(self.seq_lens, counts, strict=True)]
        if self.max_cache_len is not None and max(new_lens, default=0) > self.max_cache_len:
            i = max(range(batch_size), key=lambda j: new_lens[j])
            raise Fp8KVError(f"max_cache_len: row {i} would hold {new_lens[i]} tokens, expected at most "
                             f"max_cache_len={self.max_cache_len} (make the cache with a larger "
                             "max_cache_len, or None to grow by blocks)")
        extra = [self._blocks_for(n) - len(t) for n, t in zip(new_lens, self.tables, strict=True)]
        self._reserve(sum(extra), batch_size)
        for table, e in zip(self.tables, extra, strict=True):
            table.extend(self._take(e))
        old = torch.tensor(self.seq_lens, dtype=torch.int64, device=device)
        self.seq_lens = new_lens
        self.steps += 1
        self.plan = self._make_plan(valid, old, counts, batch_size, q_len, device)
        return self.plan

    def _tables_on(self, device: torch.device) -> torch.Tensor:
        """``[B, width]`` int32 block tables on ``device`` (width: the longest row, at least 1).

        Kept on the device between steps and updated with only the entries added since (a row's
        table only grows, except in :meth:`rearrange`, which drops the copy), so a decode step
        at a long context does not rebuild and copy every row's table from Python lists."""
        width = max((len(t) for t in self.tables), default=0) or 1
        dev = self._device_tables
        if dev is None or dev.device != device or dev.shape[0] != len(self.tables) or dev.shape[1] < width:
            cap = max(width, 2 * dev.shape[1] if dev is not None and dev.shape[0] == len(self.tables) else width)
            full = torch.zeros((len(self.tables), cap), dtype=torch.int32)
            for i, t in enumerate(self.tables):
                full[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            self._device_tables, self._device_known = full.to(device), [len(t) for t in self.tables]
        else:
            rows, cols, vals = [], [], []
            for i, t in enumerate(self.tables):
                k = self._device_known[i]
                if len(t) > k:
                    rows += [i] * (len(t) - k)
                    cols += range(k, len(t))
                    vals += t[k:]
                    self._device_known[i] = len(t)
            if rows:
                self._device_tables[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = \
                    torch.tensor(vals, dtype=torch.int32, device=device)
        return self._device_tables[:, :width].contiguous()

    def _make_plan(self, valid, old: torch.Tensor, counts: list[int], batch_size: int, q_len: int,
                   device: torch.device) -> StepPlan:
        tables = self._tables_on(device)
        if valid is None:
            rank = torch.arange(q_len, device=device).expand(batch_size, q_len)
        else:
            valid = valid.to(device=device, dtype=torch.bool)
            rank = valid.to(torch.int64).cumsum(dim=1) - 1
        pos = old[:, None] + rank  # [B, q]
        block = tables.gather(1, (pos // self.block_size).clamp_min(0)).to(torch.int64)
        slots = block * self.block_size + pos % self.block_size
        token_index = None
        if valid is not None and sum(counts) != batch_size * q_len:
            slots = torch.where(valid, slots, torch.full_like(slots, -1))
            token_index = valid.reshape(-1).nonzero().reshape(-1)
        decode = q_len == 1 and token_index is None
        qsl = None
        if not decode:
            starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
            qsl = torch.tensor(starts, dtype=torch.int32, device=device)
        return StepPlan(
            batch_size=batch_size, q_len=q_len, slot_mapping=slots.reshape(-1), token_index=token_index,
            query_start_loc=qsl, seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=tables, max_query_len=max(counts, default=0),
            num_tokens=sum(counts),
        )
