"""Static decode steps: fixed shapes, state on the device, no host synchronisation (CUDA graphs).

With ``FP8PagedCache(static=True, max_cache_len=N)`` every row owns ``ceil(N / block_size)``
blocks from its first step on, and a decode step (one column per row, after the first forward)
runs without reading anything back from the device:

* the rows' FP8 token counts live in a device tensor ``lens [B]`` (int32);
* the step's slots are ``table[b, lens // bs] * bs + lens % bs`` (-1 for a padding column),
  computed on the device, then ``lens += 1`` (or ``+= valid``) in place;
* the step's metadata is planned with ``validate=False`` and ``max_seq_len = N``: no value check,
  no transfer, the same launch configuration every step.

Captured in a CUDA graph, these operations replay with the graph, so each replay advances the
cache by one token per row. What the host knows (Python counters, ``cache.seq_lens``) is brought
up to date from the device (one transfer) only when a host-side operation needs it: a prefill
step, batch surgery, ``crop``, introspection. No model library is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Fp8KVError
from ._paging import BlockPool


@dataclass(frozen=True)
class StaticStep:
    """One static decode step's tensors (shared by every layer; duck-types :class:`StepPlan`).

    Attributes:
        slot_mapping: ``[B]`` int64 slot of each row's new token (-1: a padding column).
        seq_lens: ``[B]`` int32 FP8 tokens per row after the step.
        block_tables: ``[B, blocks_per_row]`` int32 (fixed).
        valid: ``[B, 1]`` bool padding flags, or None.
    """

    batch_size: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    valid: torch.Tensor | None
    q_len: int = 1
    token_index: None = None
    query_start_loc: None = None
    max_query_len: int = 1

    @property
    def num_tokens(self) -> int:
        return self.batch_size


class StaticState:
    """The device-side row state of a static cache (see the module docstring)."""

    def __init__(self, pool: BlockPool):
        if pool.max_cache_len is None:
            raise Fp8KVError("static: needs max_cache_len (the blocks every row owns are fixed up front)")
        self.pool = pool
        self.lens: torch.Tensor | None = None  # [B] int32 FP8 tokens per row, on the device
        self.tables: torch.Tensor | None = None  # [B, blocks_per_row] int32
        self.host_ahead = True  # the host's rows changed since lens/tables were copied
        self.device_steps = 0  # static steps since the host last read lens
        self.upper = 0  # an upper bound of the longest row (host arithmetic, no transfer)

    @property
    def blocks_per_row(self) -> int:
        return self.pool._blocks_for(self.pool.max_cache_len)

    def reset(self) -> None:
        self.lens = self.tables = None
        self.host_ahead, self.device_steps, self.upper = True, 0, 0

    def fill_rows(self) -> None:
        """Give every row all its blocks (host; at the first step and after batch surgery)."""
        pool, nb = self.pool, self.blocks_per_row
        for table in pool.tables:
            if len(table) < nb:
                table.extend(pool._take(nb - len(table)))

    def sync_host(self) -> None:
        """Bring the host's row lengths up to date after static steps (one transfer)."""
        if self.device_steps and self.lens is not None:
            self.pool.seq_lens = [int(n) for n in self.lens.tolist()]
            self.device_steps = 0
        self.host_ahead = True

    def begin_step(self, valid: torch.Tensor | None, batch_size: int, device: torch.device) -> StaticStep:
        """The step's slots and lengths, computed on the device; advances ``lens`` in place."""
        pool = self.pool
        if self.host_ahead:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise Fp8KVError("static: the first decode step after a prefill or a batch change copies the "
                                 "rows to the device; run it eagerly before capturing a CUDA graph")
            self.fill_rows()
            pool._device_tables = None  # rebuild: rows may have moved
            self.tables = pool._tables_on(device)
            self.lens = torch.tensor(pool.seq_lens, dtype=torch.int32).to(device)
            self.upper = max(pool.seq_lens, default=0)
            self.host_ahead = False
        if self.upper + 1 > pool.max_cache_len:
            raise Fp8KVError(f"max_cache_len: a row would hold more than max_cache_len={pool.max_cache_len} tokens "
                             "(make the cache with a larger max_cache_len)")
        bs = pool.block_size
        pos = self.lens.to(torch.int64)
        col = (pos // bs).clamp_max(self.tables.shape[1] - 1)  # memory-safe past the end (a replay too far)
        slots = self.tables.gather(1, col[:, None])[:, 0].to(torch.int64) * bs + pos % bs
        if valid is None:
            self.lens.add_(1)
        else:
            v = valid[:, 0]
            slots = torch.where(v, slots, torch.full_like(slots, -1))
            self.lens.add_(v.to(torch.int32))
        self.upper += 1
        self.device_steps += 1
        pool.steps += 1
        pool.plan = None
        return StaticStep(batch_size, slots, self.lens.clone(), self.tables, valid)
