"""Which work items each CTA of the persistent wgmma prefill takes, balanced by cost from the step's
lengths: from the host-side lengths where the plan has them (never read from the GPU), else from the
length tensors on the GPU (:func:`device_schedule`, torch operations, no host sync).

The kernel's items are (query block, KV head) pairs, numbered as ``csrc/fp8_prefill.cu``'s ``cta_of``
reads them in a persistent grid: ``item = (qb_rev * num_seqs + seq) * num_kv_heads + kvh`` with query
block ``qb = q_blocks - 1 - qb_rev``. Without a schedule, CTA ``b`` takes item ``b`` of every round of
``grid`` items, in a snake. That deal balances a batch of equal sequences only to within about one item:
at 4 x 2048 new over 2048 cached the busiest of 132 CTAs gets 16 items and 392 key tiles where the mean
is 15.5 and 380 (3% over the mean by the cost model below), and a batch of unequal sequences, whose
rounds mix long and short items, much worse.

:func:`balanced` deals the items by cost instead: sorted from the most expensive down, dealt in a snake,
then improved by moves and swaps between busy and idle CTAs while any lowers the busier one (a local
search in rounds of array operations, bounded). Without host lengths the plan makes the first part, the
sorted snake (:func:`sorted_snake`), on the GPU: the item count and the grid are host-known, only the
costs are not (:func:`device_schedule`; by the cost model it keeps most of the search's gain on ragged
batches and none of it on a batch of equal sequences).
Every item is in exactly one CTA's list, whatever the lengths: a schedule made from stale lengths is
still complete and correct, only less balanced.

The cost model: an item costs its key tiles plus :data:`ITEM_TILES` (the per-item work: the query's
quantization, the first exact tile, the epilogue). Measured on the H100 by timing the kernel with
parts of it left out: about 1.2-1.3 us a tile and 6.8 us an item.
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
SEARCH_ROUNDS = 32
"""At most this many rounds of the local search (each round pairs every busy CTA with an idle one; the
shapes of ``benchmarks/profiles/prefill_schedule.py`` settle in 3-6)."""
SETTLED = 1.005
"""No local search where the sorted snake's busiest CTA is within this factor of the mean load."""
END = 2**31 - 1
"""What pads a CTA's list: the kernel ends a list at its first entry >= num_items."""
SPARE_ROWS = 2
"""Padding rows a planned schedule keeps beyond its lists (at least; a quarter of its rows for longer
lists): a CTA reads its list up to the first pad, so they cost nothing but the bytes."""


def item_tiles(host_seq_lens: Sequence[int], host_query_start_loc: Sequence[int], *, num_kv_heads: int,
               block_q: int, q_blocks: int, block_n: int, num_tokens: int, max_keys: int, causal: bool,
               window: int) -> np.ndarray:
    """Key tiles of every item ``[num_items]`` int64 (-1: an item with no rows), as the kernel's
    ``cta_of`` computes them from the lengths (clamped as it clamps them)."""
    return tensor_tiles(torch.as_tensor(host_seq_lens, dtype=torch.int64).reshape(-1),
                        torch.as_tensor(host_query_start_loc, dtype=torch.int64).reshape(-1),
                        num_kv_heads=num_kv_heads, block_q=block_q, q_blocks=q_blocks, block_n=block_n,
                        num_tokens=num_tokens, max_keys=max_keys, causal=causal, window=window).numpy()


def tensor_tiles(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, num_kv_heads: int, block_q: int,
                 q_blocks: int, block_n: int, num_tokens: int, max_keys: int, causal: bool,
                 window: int) -> torch.Tensor:
    """:func:`item_tiles` from length tensors ``seq_lens [S]`` and ``query_start_loc [S + 1]`` (any integer
    dtype), on their device: int64 ``[q_blocks * S * num_kv_heads]``."""
    lens = seq_lens.to(torch.int64).clamp(0, max_keys)
    qsl = query_start_loc.to(torch.int64).clamp(0, num_tokens)
    q_len = (qsl[1:] - qsl[:-1]).clamp(min=0)  # [S]
    qb = (q_blocks - 1 - torch.arange(q_blocks, dtype=torch.int64, device=lens.device))[:, None]  # [q_blocks, 1]
    first = lens - q_len + qb * block_q
    last = lens - q_len + torch.minimum(qb * block_q + block_q, q_len) - 1
    hi = last + 1 if causal else lens.expand_as(first)
    lo = torch.div((first - window + 1).clamp(min=0), block_n, rounding_mode="floor") * block_n
    tiles = torch.where(hi > lo, torch.div(hi - lo + block_n - 1, block_n, rounding_mode="floor"), 0)
    tiles = torch.where(qb * block_q < q_len, tiles, -1)  # [q_blocks, S]
    return tiles.reshape(-1).repeat_interleave(num_kv_heads)


def item_costs(tiles: np.ndarray) -> np.ndarray:
    """The cost model's cost of items with ``tiles`` (:func:`item_tiles`): tiles + :data:`ITEM_TILES`, 0 for an
    item with no rows (the kernel skips it)."""
    return np.where(tiles >= 0, tiles + ITEM_TILES, 0.0)


def snake_lists(num_items: int, grid: int) -> list[np.ndarray]:
    """The kernel's deal without a schedule (``cta_item``'s snake): CTA ``b``'s items, for comparisons."""
    rounds = np.arange(-(-num_items // grid))[:, None]
    b = np.arange(grid)[None, :]
    item = grid * rounds + np.where(rounds % 2 == 1, grid - 1 - b, b)  # [rounds, grid]
    return [col[col < num_items] for col in item.T]


def cta_lists(schedule: np.ndarray, num_items: int) -> list[np.ndarray]:
    """Each CTA's items of a schedule (:func:`balanced`'s ``[rows, grid]``, padding dropped)."""
    return [col[col < num_items] for col in schedule.T]


def busiest(tiles: np.ndarray, lists: list[np.ndarray]) -> float:
    """The cost model's load of the busiest CTA (in tiles) of a deal of items with ``tiles`` into ``lists``
    (:func:`cta_lists`, :func:`snake_lists`)."""
    cost = item_costs(tiles)
    return max(float(cost[x].sum()) for x in lists)


def _by_cta(cost: np.ndarray, cta: np.ndarray, grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, slot, counts)``: the items by CTA, each CTA's from its most expensive down; each of those
    items' place in its CTA's list; the items per CTA."""
    order = np.lexsort((-cost, cta))
    counts = np.bincount(cta, minlength=grid)
    return order, np.arange(cta.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts), counts


def balanced(tiles: np.ndarray, grid: int) -> np.ndarray:
    """The schedule of items with ``tiles [num_items]`` (:func:`item_tiles`) over ``grid`` CTAs, as the
    kernel reads it: int32 ``[rows, grid]``, column ``b`` CTA ``b``'s items from its most expensive down,
    padded with :data:`END`."""
    cost = item_costs(tiles)
    cta = sorted_snake(tiles, grid)
    load = np.bincount(cta, weights=cost, minlength=grid)
    if -(-tiles.shape[0] // grid) <= SEARCH_ITEMS_PER_CTA and load.max() > SETTLED * load.mean():
        _pair_off(cost, cta, grid)
    lists, row, counts = _by_cta(cost, cta, grid)
    out = np.full((max(int(counts.max()), 1), grid), END, dtype=np.int32)
    out[row, cta[lists]] = lists
    return out


def sorted_snake(tiles: np.ndarray, grid: int) -> np.ndarray:
    """The CTA of every item ``[num_items]`` when the items, sorted from the most expensive down (among
    equals by index), are dealt in a snake over ``grid`` CTAs: :func:`balanced`'s first deal."""
    n = tiles.shape[0]
    order = np.argsort(-item_costs(tiles), kind="stable")
    rank = np.arange(n)
    cta = np.empty(n, dtype=np.int64)
    cta[order] = np.where((rank // grid) % 2 == 1, grid - 1 - rank % grid, rank % grid)
    return cta


def _pair_off(cost: np.ndarray, cta: np.ndarray, grid: int) -> None:
    """Local search, in place on ``cta``, many CTAs at a time: each round pairs the busiest half of the CTAs
    with the least busy half (the busiest with the least busy, and so on) and in every pair makes the one
    move or swap of items that leaves the pair's larger load the smallest, where that is below the busier
    one's load (at most :data:`SEARCH_ROUNDS` rounds; a round is one batch of array operations)."""
    by_cta, slot, counts = _by_cta(cost, cta, grid)
    width = int(counts.max()) + SPARE_ROWS  # (empty slots: where a move puts an item)
    member = np.full((grid, width), -1, dtype=np.int64)  # [grid, width] item indices, -1: empty
    member[cta[by_cta], slot] = by_cta
    held = np.where(member >= 0, cost[np.maximum(member, 0)], 0.0)  # their costs
    load = held.sum(1)
    pairs = grid // 2
    for _ in range(SEARCH_ROUNDS if pairs else 0):
        ascending = np.argsort(load, kind="stable")
        busy, idle = ascending[::-1][:pairs], ascending[:pairs]
        d = held[busy][:, :, None] - held[idle][:, None, :]  # [pairs, width, width]: what a swap moves
        after = np.maximum(load[busy][:, None, None] - d, load[idle][:, None, None] + d)
        after = np.where((member[busy] >= 0)[:, :, None] & (d > 0), after, np.inf).reshape(pairs, -1)
        best = after.argmin(1)
        gains = np.flatnonzero(after[np.arange(pairs), best] < load[busy])
        if gains.size == 0:
            break
        b, i, o, j = busy[gains], best[gains] // width, idle[gains], best[gains] % width
        moved, back = held[b, i], held[o, j]
        member[b, i], member[o, j] = member[o, j], member[b, i]
        held[b, i], held[o, j] = back, moved
        load[b] += back - moved
        load[o] += moved - back
    rows, cols = np.nonzero(member >= 0)
    cta[member[rows, cols]] = rows


def for_step(host_seq_lens: Sequence[int], host_query_start_loc: Sequence[int], *, ctas: int, num_kv_heads: int,
             group: int, num_tokens: int, max_query_len: int, max_keys: int, causal: bool,
             sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """The schedule of one step for :func:`fp8kv_hopper.wgmma.launch` with ``ctas`` persistent CTAs, on
    ``device`` (an asynchronous copy; no host sync), or None where there is none to make (``ctas == 0``,
    no work items). Lengths and sizes as the launch gets them (``max_keys``: ``block_tables.shape[1] *
    block_size``), with spare rows of padding (:func:`on_device`), room for :func:`refill` to re-deal
    other lengths in place."""
    host = host_schedule(host_seq_lens, host_query_start_loc, ctas=ctas, num_kv_heads=num_kv_heads, group=group,
                         num_tokens=num_tokens, max_query_len=max_query_len, max_keys=max_keys, causal=causal,
                         sliding_window=sliding_window)
    return on_device(host, device)


def spare_rows(rows: int) -> int:
    """Padding rows a planned schedule of ``rows`` rows of lists keeps (:data:`SPARE_ROWS`, or a quarter of
    its rows for longer lists)."""
    return max(SPARE_ROWS, rows // 4)


def on_device(host: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """A host schedule (:func:`host_schedule`) on ``device``, with :data:`SPARE_ROWS` (or a quarter of its
    rows) more rows of padding, by an asynchronous copy; None for None."""
    if host is None:
        return None
    spare = np.full((spare_rows(host.shape[0]), host.shape[1]), END, dtype=np.int32)
    return torch.from_numpy(np.concatenate([host, spare])).to(device, non_blocking=True)


def refill(schedule: torch.Tensor, host: np.ndarray | None) -> bool:
    """Write the schedule ``host`` (:func:`host_schedule`, for the same grid and items) into ``schedule``
    in place, its lists padded with :data:`END` to ``schedule``'s rows (an asynchronous copy). False, and
    ``schedule`` unchanged, where there is none or it does not fit (more rows, or another grid)."""
    if host is None or host.shape[1] != schedule.shape[1] or host.shape[0] > schedule.shape[0]:
        return False
    padded = np.full(tuple(schedule.shape), END, dtype=np.int32)
    padded[:host.shape[0]] = host
    schedule.copy_(torch.from_numpy(padded), non_blocking=True)
    return True


def host_schedule(host_seq_lens: Sequence[int], host_query_start_loc: Sequence[int], *, ctas: int,
                  num_kv_heads: int, group: int, num_tokens: int, max_query_len: int, max_keys: int, causal: bool,
                  sliding_window: int | None) -> np.ndarray | None:
    """:func:`for_step`'s schedule on the host (numpy int32 ``[rows, grid]``), or None."""
    tiles = step_tiles(host_seq_lens, host_query_start_loc, num_kv_heads=num_kv_heads, group=group,
                       num_tokens=num_tokens, max_query_len=max_query_len, max_keys=max_keys, causal=causal,
                       sliding_window=sliding_window)
    if ctas <= 0 or tiles.shape[0] == 0:
        return None
    return balanced(tiles, min(ctas, tiles.shape[0]))


def device_schedule(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, ctas: int, num_kv_heads: int,
                    group: int, num_tokens: int, max_query_len: int, max_keys: int, causal: bool,
                    sliding_window: int | None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The sorted snake (:func:`sorted_snake`) of a step's items as :func:`balanced` lays a schedule out,
    made from the length tensors on their device by torch operations (no host sync: the item count and
    the grid follow from host-known sizes), with :func:`on_device`'s spare rows; None where there is none to
    make (as :func:`host_schedule`). With ``out`` (a planned schedule of the same grid and at least the
    rows): written into it in place and returned; None, ``out`` unchanged, where it does not fit."""
    block_q, q_blocks, block_n, window = _step_geometry(group, num_tokens, max_query_len, sliding_window)
    tiles = tensor_tiles(seq_lens, query_start_loc, num_kv_heads=num_kv_heads, block_q=block_q, q_blocks=q_blocks,
                         block_n=block_n, num_tokens=num_tokens, max_keys=max_keys, causal=causal, window=window)
    n = tiles.shape[0]
    if ctas <= 0 or n == 0:
        return None
    grid = min(ctas, n)
    rows = -(-n // grid)
    total = rows + spare_rows(rows) if out is None else out.shape[0]
    if out is not None and (out.shape[1] != grid or total < rows):
        return None
    # tiles order the items as their costs do (cost = tiles + ITEM_TILES, 0 for -1): a stable sort alike
    order = torch.argsort(-tiles, stable=True)
    r = torch.arange(total, device=tiles.device)[:, None]
    b = torch.arange(grid, device=tiles.device)[None, :]
    rank = r * grid + torch.where(r % 2 == 1, grid - 1 - b, b)  # [total, grid]: the snake's deal by rank
    sched = torch.where(rank < n, order[rank.clamp(max=n - 1)], END).to(torch.int32)
    if out is None:
        return sched
    out.copy_(sched)
    return out


def _step_geometry(group: int, num_tokens: int, max_query_len: int,
                   sliding_window: int | None) -> tuple[int, int, int, int]:
    """``(block_q, q_blocks, block_n, window)`` of a step's items as :func:`fp8kv_hopper.wgmma.launch` makes
    them (query blocks of ``BLOCK_M // group`` tokens, ``max_query_len`` clamped to ``[1, num_tokens]``, keys
    in ``BLOCK_N`` tiles)."""
    from .attention import NO_WINDOW
    from .wgmma import BLOCK_M, BLOCK_N

    block_q = max(1, BLOCK_M // group)
    q_blocks = -(-min(max(max_query_len, 1), max(num_tokens, 1)) // block_q)
    return block_q, q_blocks, BLOCK_N, min(int(sliding_window or NO_WINDOW), NO_WINDOW)


def step_tiles(host_seq_lens: Sequence[int], host_query_start_loc: Sequence[int], *, num_kv_heads: int, group: int,
               num_tokens: int, max_query_len: int, max_keys: int, causal: bool,
               sliding_window: int | None) -> np.ndarray:
    """:func:`item_tiles` of a step's items as :func:`fp8kv_hopper.wgmma.launch` makes them
    (:func:`_step_geometry`)."""
    block_q, q_blocks, block_n, window = _step_geometry(group, num_tokens, max_query_len, sliding_window)
    return item_tiles(host_seq_lens, host_query_start_loc, num_kv_heads=num_kv_heads, block_q=block_q,
                      q_blocks=q_blocks, block_n=block_n, num_tokens=num_tokens, max_keys=max_keys, causal=causal,
                      window=window)
