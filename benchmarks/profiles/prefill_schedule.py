"""The persistent wgmma prefill with the plan's balanced schedule, and with the sorted snake made on the
GPU (a plan without host lengths), against its snake deal (A/B/C in one process, alternated):
``fp8kv_hopper.schedule`` deals the work items by cost from the step's host lengths (``balanced``) or from
the length tensors (``device``). The outputs must be bit-identical (each item's arithmetic does not
depend on which CTA runs it).

    python benchmarks/profiles/prefill_schedule.py [--rounds 3] [--json FILE] [SHAPE ...]

A shape is ``NEW+CACHED`` sequences joined by ``,`` with an optional ``Kx`` repeat, e.g. ``4x2048+2048``
or ``3x1000+500,3000+7000`` (causal, GQA 32/8, D=128, page 16, bf16 queries, dynamic q scale). Times are
medians of CUDA-graph replays, as ``benchmarks/prefill.py`` times them; the table gives each arm's range
over the rounds, the cost model's busiest-CTA load of each deal, and each schedule's host time (the
device one's: enqueueing its torch operations).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
from fp8kv_bench.kernels import causal_prefill_flops, save_rows, time_graph

import fp8kv

SHAPES = ("4x2048+2048", "1x16384+0", "3x1000+500,3000+7000", "2x100+3000,5x700+20")
H, HQ, D, PAGE = 8, 32, 128, 16


def parse(shape: str) -> list[tuple[int, int]]:
    """``[(new, cached), ...]`` of a shape string."""
    pairs = []
    for part in shape.split(","):
        count, _, rest = part.rpartition("x")
        new, cached = map(int, rest.split("+"))
        pairs += [(new, cached)] * (int(count) if count else 1)
    return pairs


def workload(pairs: list[tuple[int, int]], device, seed: int = 0):
    """An e4m3 cache (per-head scales) and bf16 queries for sequences of ``(new, cached)`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = [n + c for n, c in pairs]
    nblk = -(-max(lens) // PAGE)
    S = len(pairs)
    tables = torch.randperm(S * nblk, generator=g).to(torch.int32).view(S, nblk).to(device)
    scales = (0.02 + 0.05 * torch.rand(H, generator=g)).to(device)
    cache = fp8kv.KVCache.allocate(S * nblk, PAGE, H, D, kv_dtype="fp8_e4m3", scale_granularity="head",
                                   k_scale=scales, v_scale=scales, device=device)
    n = S * nblk * PAGE
    fp8kv.write_kv_one_shot(cache, torch.randn(n, H, D, generator=g).to(device, torch.bfloat16),
                   torch.randn(n, H, D, generator=g).to(device, torch.bfloat16), torch.arange(n, device=device))
    qsl = [0]
    for new, _ in pairs:
        qsl.append(qsl[-1] + new)
    q = (torch.randn(qsl[-1], HQ, D, generator=g) * 2).to(device, torch.bfloat16)
    return cache, q, tables, lens, qsl


def bench(shape: str, rounds: int, reps: int, device) -> dict:
    from fp8kv_hopper import attention, schedule

    pairs = parse(shape)
    cache, q, tables, lens, qsl = workload(pairs, device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    max_q = max(n for n, _ in pairs)
    max_keys = tables.shape[1] * PAGE
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg = dataclasses.replace(attention.choose_config(group=HQ // H, num_seqs=len(pairs), num_kv_heads=H,
                                                      max_query_len=max_q, max_keys=max_keys, num_sms=sms),
                              kernel="wgmma")
    t0 = time.perf_counter()
    sched = schedule.for_step(lens, qsl, ctas=cfg.wgmma_ctas, num_kv_heads=H, group=HQ // H, num_tokens=qsl[-1],
                              max_query_len=max_q, max_keys=max_keys, causal=True, sliding_window=None,
                              device=device)
    plan_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dsched = schedule.device_schedule(lens_t, qsl_t, ctas=cfg.wgmma_ctas, num_kv_heads=H, group=HQ // H,
                                      num_tokens=qsl[-1], max_query_len=max_q, max_keys=max_keys, causal=True,
                                      sliding_window=None)
    device_ms = (time.perf_counter() - t0) * 1e3
    # the cost model's view of both deals
    tiles = schedule.step_tiles(lens, qsl, num_kv_heads=H, group=HQ // H, num_tokens=qsl[-1], max_query_len=max_q,
                                max_keys=max_keys, causal=True, sliding_window=None)
    items, grid = tiles.shape[0], sched.shape[1]
    deals = {"snake": None, "balanced": sched, "device": dsched}
    lists = {"snake": schedule.snake_lists(items, grid), "balanced": schedule.cta_lists(sched.cpu().numpy(), items),
             "device": schedule.cta_lists(dsched.cpu().numpy(), items)}
    outs = {}

    def run(arm: str) -> None:
        attention.paged_attention_fp8(q, cache, tables, lens_t, qsl_t, max_q, D**-0.5, True, None, None, outs[arm],
                                      q_scale=None, prob_scale=1.0, config=cfg, schedule=deals[arm])

    times: dict[str, list[float]] = {arm: [] for arm in deals}
    for arm in times:
        outs[arm] = torch.empty_like(q)
        run(arm)
    torch.cuda.synchronize()
    identical = all(torch.equal(outs["snake"], outs[arm]) for arm in deals)
    for r in range(rounds):
        for arm in (list(deals) if r % 2 == 0 else list(deals)[::-1]):
            times[arm].append(time_graph(lambda arm=arm: run(arm), calls=3, reps=reps) * 1e3)
        print(f"  {shape} round {r + 1}/{rounds}: " + ", ".join(f"{arm} {times[arm][-1]:.1f} us" for arm in deals),
              flush=True)
    flops = sum(causal_prefill_flops(1, n, c) for n, c in pairs)
    return {"shape": shape, "items": items, "ctas": grid, "identical_outputs": identical,
            **{f"{arm}_us": [round(t, 1) for t in times[arm]] for arm in deals},
            **{f"model_busiest_{arm}": round(schedule.busiest(tiles, lists[arm]), 1) for arm in deals},
            "model_mean": round(float(schedule.item_costs(tiles).sum()) / grid, 1),
            "schedule_host_ms": round(plan_ms, 2), "device_schedule_host_ms": round(device_ms, 2),
            "useful_tflop": round(flops / 1e12, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    rows = [bench(s, args.rounds, args.reps, device) for s in args.shapes]
    print("| shape | items / CTAs | snake us | balanced us | device us | vs snake: balanced / device (medians) | "
          "model busiest: snake / balanced / device / mean (tiles) | host ms: balanced / device | identical |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        snake = float(np.median(r["snake_us"]))
        span = {arm: f"{min(r[arm + '_us'])}-{max(r[arm + '_us'])}" for arm in ("snake", "balanced", "device")}
        print(f"| {r['shape']} | {r['items']} / {r['ctas']} | {span['snake']} | {span['balanced']} | "
              f"{span['device']} | "
              f"{snake / float(np.median(r['balanced_us'])):.3f}x / {snake / float(np.median(r['device_us'])):.3f}x | "
              f"{r['model_busiest_snake']} / {r['model_busiest_balanced']} / {r['model_busiest_device']} / "
              f"{r['model_mean']} | {r['schedule_host_ms']} / {r['device_schedule_host_ms']} | "
              f"{r['identical_outputs']} |")
    save_rows(args.json, device, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
