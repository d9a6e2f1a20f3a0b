"""A/B of the tensor-core decode's grid order (``fp8kv_cuda.attention.MMA_HEADS_FASTEST``), in one process,
alternated: ``(T, H * head_chunks, splits)`` (a head's tokens side by side) against ``(H * head_chunks, T,
splits)`` (a token's heads side by side, so that the CTAs reading the same pages launch together), for the
default mode and the FP8 attention mode (dynamic q_scale), at the decode shapes (GQA 32/8, D=128, block 16,
e4m3 per-tensor cache, bf16 queries). Outputs must be bit-identical across the two orders.

    python benchmarks/cuda_decode_grid_ab.py [--rounds 3] [--json FILE] [--shapes 64:2048,...]
"""

from __future__ import annotations

import argparse
import json

import torch
from fp8kv_bench import kernels as kb

import fp8kv

ARMS = ("tokens_fastest", "heads_fastest")


def bench(B: int, L: int, rounds: int, reps: int, device, bw: float) -> list[dict]:
    import dataclasses

    from fp8kv_cuda import attention as CA
    from fp8kv_hopper import attention as HA

    gen = torch.Generator().manual_seed(1)
    tables, nblocks = kb._paged_tables(B, L, device, gen)
    cache = fp8kv.KVCache.allocate(nblocks, kb.PAGE, kb.HKV, kb.HEAD, kv_dtype="fp8_e4m3", k_scale=0.05,
                                   v_scale=0.05, device=device)
    kb._fill_cache(cache, kb._backend("cuda", "write_kv", cache, torch.bfloat16, device), nblocks * kb.PAGE,
                   device, gen)
    q = torch.randn(B, kb.HQ, kb.HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    max_keys = tables.shape[1] * kb.PAGE
    plan = CA.plan_mma(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV, head_size=kb.HEAD,
                       max_keys=max_keys)
    cfg = dataclasses.replace(HA.choose_config(group=kb.HQ // kb.HKV, num_seqs=B, num_kv_heads=kb.HKV,
                                               max_query_len=1, max_keys=max_keys,
                                               num_sms=torch.cuda.get_device_properties(device).multi_processor_count),
                              kernel="cuda")
    roof_ms = 2 * B * L * kb.HKV * kb.HEAD / (bw * 1e9) * 1e3
    runs = {
        "default": lambda o: CA.paged_attention(q, cache, tables, lens, qsl, kb.HEAD**-0.5, True, None, None, o,
                                                None, plan_=plan),
        "fp8_mode": lambda o: HA.paged_attention_fp8(q, cache, tables, lens, qsl, 1, kb.HEAD**-0.5, True, None,
                                                     None, o, q_scale=None, prob_scale=1.0, config=cfg),
    }
    rows = []
    for mode, run in runs.items():
        times = {a: [] for a in ARMS}
        outs = {}
        for arm in ARMS:
            CA.MMA_HEADS_FASTEST = arm == "heads_fastest"
            outs[arm] = torch.empty_like(q)
            run(outs[arm])
        torch.cuda.synchronize()
        same = torch.equal(outs[ARMS[0]], outs[ARMS[1]])
        for r in range(rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                CA.MMA_HEADS_FASTEST = arm == "heads_fastest"
                o = outs[arm]
                times[arm].append(kb.time_graph(lambda o=o, run=run: run(o), reps=reps) * 1e3)
        CA.MMA_HEADS_FASTEST = False
        med = {a: sorted(t)[len(t) // 2] for a, t in times.items()}
        print(f"  B={B} L={L} {mode}: " + ", ".join(f"{a} {min(t):.1f}-{max(t):.1f} us" for a, t in times.items())
              + f" (roofline {roof_ms * 1e3:.1f} us), identical {same}", flush=True)
        rows.append({"B": B, "L": L, "mode": mode, "splits": plan.num_splits, "identical_outputs": same,
                     "roofline_us": round(roof_ms * 1e3, 2), **{f"{a}_us": [round(x, 2) for x in t]
                                                                 for a, t in times.items()},
                     "median_ratio": round(med["tokens_fastest"] / med["heads_fastest"], 4)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="B:L,B:L,... (default: the bench's four)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    bw = kb.copy_bandwidth(device)["gbps"]
    shapes = [tuple(map(int, s.split(":"))) for s in args.shapes.split(",") if s] or list(kb.DECODE_SHAPES)
    rows = [r for B, L in shapes for r in bench(B, L, args.rounds, args.reps, device, bw)]
    print("| B | L | mode | splits | tokens fastest us | heads fastest us | ratio (medians) | roofline us |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['L']} | {r['mode']} | {r['splits']} | {min(r['tokens_fastest_us'])}-"
              f"{max(r['tokens_fastest_us'])} | {min(r['heads_fastest_us'])}-{max(r['heads_fastest_us'])} | "
              f"{r['median_ratio']:.3f}x | {r['roofline_us']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": {**kb.environment(device), "copy_gbps": bw}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
