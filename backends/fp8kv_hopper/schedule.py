"""Which work items each CTA of the persistent wgmma prefill takes, balanced by cost from the step's
host-side lengths (the plan's, never read from the GPU).

The kernel's items are (query block, KV head) pairs, numbered as ``csrc/fp8_prefill.cu``'s ``cta_of``
reads them in a persistent grid: ``item = (qb_rev * num_seqs + seq) * num_kv_heads + kvh`` with query
block ``qb = q_blocks - 1 - qb_rev``. Without a schedule, CTA ``b`` takes item ``b`` of every round of
``grid`` items, in a snake. That deal balances a batch of equal sequences only to within about one item:
at 4 x 2048 new over 2048 cached the busiest of 132 CTAs gets 16 items and 392 key tiles where the mean
is 15.5 and 380 (3% over the mean by the cost model below), and a batch of unequal sequences, whose
rounds mix long and short items, much worse.

:func:`balanced` deals the items by cost instead: sorted from the most expensive down, dealt in a snake,
then improved by moves and swaps out of the busiest CTA while any lowers it (a local search, bounded).
Every item is in exactly one CTA's list, whatever the lengths: a schedule made from stale lengths is
still complete and correct, only less balanced.

The cost model: an item costs its key tiles plus :data:`ITEM_TILES` (the per-item work: the query's
quantization, the first exact tile, the epilogue). Measured on the H100 (session 19,
``benchmarks/results/hopper_h100/session19/parts``): about 1.2-1.3 us a tile and 6.8 us an item.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ITEM_TILES = 5.4
"""An item's fixed cost in key tiles (6.8 us / 1.25 us per tile, H100)."""
SEARCH_ITEMS_PER_CTA = 32
"""The local search runs while no CTA has more items than this (beyond, the sorted snake is within a
fraction of a percent of the mean and a search round costs more)."""
SEARCH_ROUNDS = 160
"""At most this many moves or swaps (4 x 2048 over 2048 takes about 90; a few ms in all)."""


def item_tiles(host_seq_lens: Sequence[int], host_query_start_loc: Sequence[int], *, num_kv_heads: int,
               block_q: int, q_blocks: int, block_n: int, num_tokens: int, max_keys: int, causal: bool,
               window: int) -> np.ndarray:
    """Key tiles of every item ``[num_items]`` int64 (-1: an item with no rows), as the kernel's
    ``cta_of`` computes them from the lengths (clamped as it clamps them)."""
    lens = np.clip(np.asarray(host_seq_lens, dtype=np.int64), 0, max_keys)
    qsl = np.clip(np.asarray(host_query_start_loc, dtype=np.int64), 0, num_tokens)
    q_len = np.maximum(qsl[1:] - qsl[:-1], 0)  # [S]
    qb = (q_blocks - 1 - np.arange(q_blocks, dtype=np.int64))[:, None]  # [q_blocks (qb_rev), 1]
    first = lens - q_len + qb * block_q
    last = lens - q_len + np.minimum(qb * block_q + block_q, q_len) - 1
    hi = last + 1 if causal else np.broadcast_to(lens, first.shape)
    lo = np.maximum(first - window + 1, 0) // block_n * block_n
    tiles = np.where(hi > lo, (hi - lo + block_n - 1) // block_n, 0)
    tiles = np.where(qb * block_q < q_len, tiles, -1)  # [q_blocks, S]
    return np.repeat(tiles.reshape(-1), num_kv_heads)


def balanced(tiles: np.ndarray, grid: int) -> np.ndarray:
    """The schedule of items with ``tiles [num_items]`` (:func:`item_tiles`) over ``grid`` CTAs, as the
    kernel reads it: int32 ``[grid + 1 + num_items]``, CTA ``b``'s items at ``grid + 1 + off[b] ..
    grid + 1 + off[b + 1]`` with ``off = schedule[:grid + 1]``, each list from its most expensive item
    down."""
    n = tiles.shape[0]
    cost = np.where(tiles >= 0, tiles + ITEM_TILES, 0.0)
    order = np.argsort(-cost, kind="stable")
    rank = np.arange(n)
    cta = np.empty(n, dtype=np.int64)
    cta[order] = np.where((rank // grid) % 2 == 1, grid - 1 - rank % grid, rank % grid)
    if -(-n // grid) <= SEARCH_ITEMS_PER_CTA:
        _lower_the_busiest(cost, cta, grid)
    lists = np.lexsort((-cost, cta))  # by CTA, then most expensive first
    off = np.zeros(grid + 1, dtype=np.int64)
    np.cumsum(np.bincount(cta, minlength=grid), out=off[1:])
    return np.concatenate([off, lists]).astype(np.int32)


def _lower_the_busiest(cost: np.ndarray, cta: np.ndarray, grid: int) -> None:
    """Local search, in place on ``cta``: move an item of the busiest CTA to the least busy one, or swap
    it for a cheaper item of another CTA, whichever leaves the pair's larger load the smallest, while
    that is below the busiest load (at most :data:`SEARCH_ROUNDS` steps)."""
    load = np.bincount(cta, weights=cost, minlength=grid)
    for _ in range(SEARCH_ROUNDS):
        top = int(np.argmax(load))
        mine = np.flatnonzero(cta == top)
        others = load.copy()
        others[top] = np.inf
        least = int(np.argmin(others))
        moved = np.maximum(load[top] - cost[mine], others[least] + cost[mine])  # [m]
        d = cost[mine][:, None] - cost[None, :]  # [m, n]: what a swap with item j moves
        swapped = np.maximum(load[top] - d, load[cta][None, :] + d)
        swapped[(d <= 0) | (cta == top)[None, :]] = np.inf
        best_move, best_swap = int(np.argmin(moved)), int(np.argmin(swapped))
        if min(moved[best_move], swapped.flat[best_swap]) >= load[top]:
            return
        if moved[best_move] <= swapped.flat[best_swap]:
            i = mine[best_move]
            cta[i] = least
            load[top] -= cost[i]
            load[least] += cost[i]
        else:
            i, j = mine[best_swap // cost.shape[0]], best_swap % cost.shape[0]
            other = cta[j]
            cta[i], cta[j] = other, top
            load[top] += cost[j] - cost[i]
            load[other] += cost[i] - cost[j]


def for_step(host_seq_lens: Sequence[int], host_query_start_loc: Sequence[int], *, ctas: int, num_kv_heads: int,
             group: int, num_tokens: int, max_query_len: int, max_keys: int, causal: bool,
             sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """The schedule of one step for :func:`fp8kv_hopper.wgmma.launch` with ``ctas`` persistent CTAs, on
    ``device`` (an asynchronous copy; no host sync), or None where there is none to make (``ctas == 0``,
    no work items). Lengths and sizes as the launch gets them (``max_keys``: ``block_tables.shape[1] *
    block_size``)."""
    from .attention import NO_WINDOW
    from .wgmma import BLOCK_M, BLOCK_N

    block_q = max(1, BLOCK_M // group)
    q_blocks = -(-min(max(max_query_len, 1), max(num_tokens, 1)) // block_q)
    items = len(host_seq_lens) * q_blocks * num_kv_heads
    if ctas <= 0 or items == 0:
        return None
    tiles = item_tiles(host_seq_lens, host_query_start_loc, num_kv_heads=num_kv_heads, block_q=block_q,
                       q_blocks=q_blocks, block_n=BLOCK_N, num_tokens=num_tokens, max_keys=max_keys, causal=causal,
                       window=min(int(sliding_window or NO_WINDOW), NO_WINDOW))
    return torch.from_numpy(balanced(tiles, min(ctas, items))).to(device, non_blocking=True)
