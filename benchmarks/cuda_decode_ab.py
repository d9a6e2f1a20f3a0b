"""A/B of the tensor-core decode (``csrc/attention_mma.cu``) against an earlier source of it, in one process,
alternated: the default mode and the FP8 attention mode (dynamic and per-KV-head q_scale) at the decode shapes
(GQA 32/8 or ``--group``, D=128 or ``--head-size``, block 16, e4m3 per-tensor cache, bf16 queries), CUDA-graph
replays as ``cuda_decode.py`` times them. Each arm's outputs are compared with the other's (bit-identical unless
the change alters them).

    python benchmarks/cuda_decode_ab.py --baseline OLD.cu [--rounds 3] [--json FILE] [--shapes 64:2048,...]
    python benchmarks/cuda_decode_ab.py --profile fp8_dynamic_q --shapes 64:2048   # three untimed calls (ncu)
    python benchmarks/cuda_decode_ab.py --plans plan,4x3x2,2x3x1 [--rounds 5]      # tiles of today's kernel

``--plans``: the package's kernel under several tiles, alternated the same way: ``plan`` (as planned) or
``WxSxN`` (warps per CTA, ring stages, 16-key sub-tiles a warp step; ``plan_mma(warps=, stages=, nsub=)``),
either with ``/sK`` to split the keys K ways (``plan_mma(num_splits=K)``; the tile then is the plan's for
that grid unless given); ratios are against the first.

``OLD.cu``: e.g. ``git show REV:backends/fp8kv_cuda/csrc/attention_mma.cu``, compiled with the current headers.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from fp8kv_bench import kernels as kb

ARMS = ("baseline", "current")


def legacy_smem_bytes(head_size: int, warps: int, token_scales: bool = False, stages: int | None = None) -> int:
    """``mma_smem_bytes`` of the sources before session 22 (each thread's own copy slots: K chunks, V rows
    of 16 or 8 bytes, a token_head slot per sub-tile), for a baseline from then (``--legacy-ring``); it
    differs from today's at head size 64 only, where the kernel would trap on the new, smaller ring."""
    from fp8kv_cuda import attention as CA

    stages = CA.MMA_TILES[head_size][0] if stages is None else stages
    nsub = 1 if head_size > 128 else 2
    chunks = nsub * (2 * (head_size // 64) + 4 * max(1, head_size // 128) + int(token_scales))
    today = getattr(CA, "_ab_smem_bytes", CA.mma_smem_bytes)  # (use_baseline may have swapped the module's)
    return max(16 * stages * chunks * 32 * warps, today(head_size, warps, token_scales, stages))


def legacy_grid(num_tokens: int, head_units: int, num_splits: int) -> tuple[int, int, int]:
    """``decode_grid`` of the sources before session 23: ``(T, H * head_chunks, num_splits)``, the tokens
    adjacent, for a baseline from then (``--legacy-grid``)."""
    return num_tokens, head_units, num_splits


def use_baseline(text: str | None, legacy_ring: bool = False, legacy_grid_: bool = False) -> None:
    """Compile and launch the tensor-core decode from ``text`` (None: from the package's source);
    ``legacy_ring``: launch it with :func:`legacy_smem_bytes`; ``legacy_grid_``: with :func:`legacy_grid`."""
    from fp8kv_cuda import attention as CA
    from fp8kv_cuda import runtime, variants

    if not hasattr(runtime, "_ab_function"):
        runtime._ab_function = runtime.function
        CA._ab_smem_bytes = CA.mma_smem_bytes
        CA._ab_decode_grid = CA.decode_grid
    CA.mma_smem_bytes = legacy_smem_bytes if text is not None and legacy_ring else CA._ab_smem_bytes
    CA.decode_grid = legacy_grid if text is not None and legacy_grid_ else CA._ab_decode_grid
    if text is None:
        runtime.function = runtime._ab_function
        return
    source = variants.inline_headers(text)

    def function(variant, entry, device):
        if variant.kernel != "attention_mma":
            return runtime._ab_function(variant, entry, device)
        index = runtime.device_index(device)
        sm = runtime.device_sm(index)
        return runtime.module(("ab_baseline", variant, sm), lambda: runtime.compile_source(
            source, "attention_mma.cu", variants.options(variant), variants.arch_target(variant.kernel, sm),
            variant.label), variant.entry_points, index).get_function(entry)

    runtime.function = function


def decode_runs(B: int, L: int, device, head_size: int = kb.HEAD, tiles: dict | None = None, case=None,
                group: int = kb.HQ // kb.HKV):
    """``(runs, query, plan)``: the decode step of B sequences of L tokens in each mode, ``runs[mode](out)``
    (``default``, ``fp8_dynamic_q``, ``fp8_head_q``), all on the same cache (``case``: a ``decode_case``
    to reuse), planned once (``tiles``: ``plan_mma``'s warps/stages/nsub)."""
    from fp8kv_cuda import attention as CA
    from fp8kv_hopper import attention as HA

    cache, tables, lens, qsl, q = case or kb.decode_case(B, L, device, head_size=head_size, group=group)
    max_keys = tables.shape[1] * kb.PAGE
    plan = CA.plan_mma(device, num_tokens=B, num_kv_heads=kb.HKV, group=group, head_size=head_size,
                       max_keys=max_keys, **(tiles or {}))
    cfg = dataclasses.replace(HA.choose_config(group=group, num_seqs=B, num_kv_heads=kb.HKV,
                                               max_query_len=1, max_keys=max_keys,
                                               num_sms=torch.cuda.get_device_properties(device).multi_processor_count),
                              kernel="cuda")
    head_qs = torch.full((kb.HKV,), 0.02, device=device)

    def fp8(qs):
        return lambda o: HA.paged_attention_fp8(q, cache, tables, lens, qsl, 1, head_size**-0.5, True, None, None, o,
                                                q_scale=qs, prob_scale=1.0, config=cfg, decode_plan=plan)

    runs = {"default": lambda o: CA.paged_attention(q, cache, tables, lens, qsl, head_size**-0.5, True, None, None, o,
                                                    None, plan_=plan),
            "fp8_dynamic_q": fp8(None), "fp8_head_q": fp8(head_qs)}
    return runs, q, plan


def alternated(arms: list[str], time_arm, rounds: int) -> dict[str, list[float]]:
    """Each arm's timings (``time_arm(arm)``), ``rounds`` rounds over the arms, in reverse order every
    other round."""
    times = {a: [] for a in arms}
    for r in range(rounds):
        for a in (arms if r % 2 == 0 else arms[::-1]):
            times[a].append(time_arm(a))
    return times


def median(t: list[float]) -> float:
    return sorted(t)[len(t) // 2]


def bench(B: int, L: int, baseline: str, rounds: int, reps: int, device, bw: float, head_size: int = kb.HEAD,
          modes: tuple[str, ...] = (), legacy_ring: bool = False, legacy_grid_: bool = False,
          group: int = kb.HQ // kb.HKV) -> list[dict]:
    runs, q, plan = decode_runs(B, L, device, head_size, group=group)
    roof_us = kb.roofline_ms(kb.decode_kv_bytes(B, L, head_size), bw) * 1e3
    rows = []
    for mode, run in runs.items():
        if modes and mode not in modes:
            continue
        outs = {}
        for arm in ARMS:
            use_baseline(baseline if arm == "baseline" else None, legacy_ring, legacy_grid_)
            outs[arm] = torch.empty_like(q)
            run(outs[arm])
        torch.cuda.synchronize()
        same = torch.equal(outs[ARMS[0]], outs[ARMS[1]])

        def time_arm(arm, run=run, outs=outs):
            use_baseline(baseline if arm == "baseline" else None, legacy_ring, legacy_grid_)
            return kb.time_graph(lambda: run(outs[arm]), reps=reps) * 1e3

        times = alternated(list(ARMS), time_arm, rounds)
        use_baseline(None)
        med = {a: median(t) for a, t in times.items()}
        print(f"  B={B} L={L} {mode}: " + ", ".join(f"{a} {min(t):.1f}-{max(t):.1f} us" for a, t in times.items())
              + f" (roofline {roof_us:.1f} us), identical {same}", flush=True)
        rows.append({"B": B, "L": L, "head_size": head_size, "group": group, "mode": mode, "splits": plan.num_splits,
                     "identical_outputs": same,
                     "roofline_us": round(roof_us, 2),
                     **{f"{a}_us": [round(x, 2) for x in t] for a, t in times.items()},
                     "median_ratio": round(med["baseline"] / med["current"], 4)})
    return rows


def parse_tiles(spec: str) -> dict:
    """``plan`` -> {}; ``WxSxN`` -> plan_mma's warps, stages and nsub; a ``/sK`` suffix adds num_splits=K."""
    tiles, _, splits = spec.partition("/s")
    out = {"num_splits": int(splits)} if splits else {}
    if tiles != "plan":
        w, st, n = (int(x) for x in tiles.split("x"))
        out |= {"warps": w, "stages": st, "nsub": n}
    return out


def bench_plans(B: int, L: int, specs: list[str], rounds: int, reps: int, device, bw: float, head_size: int,
                modes: tuple[str, ...], group: int = kb.HQ // kb.HKV) -> list[dict]:
    """The package's kernel under each of ``specs``' tiles, alternated round by round (reversed every
    other round), on one cache; ratios of medians against the first spec."""
    case = kb.decode_case(B, L, device, head_size=head_size, group=group)
    arms = {spec: decode_runs(B, L, device, head_size, parse_tiles(spec), case, group) for spec in specs}
    q = case[4]
    roof_us = kb.roofline_ms(kb.decode_kv_bytes(B, L, head_size), bw) * 1e3
    rows = []
    for mode in arms[specs[0]][0]:
        if modes and mode not in modes:
            continue
        outs = {spec: torch.empty_like(q) for spec in specs}
        for spec in specs:
            arms[spec][0][mode](outs[spec])
        torch.cuda.synchronize()

        def time_arm(spec, mode=mode, outs=outs):
            return kb.time_graph(lambda: arms[spec][0][mode](outs[spec]), reps=reps) * 1e3

        times = alternated(specs, time_arm, rounds)
        med = {spec: median(t) for spec, t in times.items()}
        for spec in specs:
            p = arms[spec][2]
            diff = (outs[spec].float() - outs[specs[0]].float()).abs().max().item()
            rows.append({"B": B, "L": L, "head_size": head_size, "group": group, "mode": mode, "tiles": spec,
                         "warps": p.warps, "stages": p.stages, "nsub": p.nsub, "splits": p.num_splits,
                         "roofline_us": round(roof_us, 2),
                         "us": [round(x, 2) for x in times[spec]], "median_us": round(med[spec], 2),
                         "ratio_vs_first": round(med[specs[0]] / med[spec], 4), "max_abs_diff_vs_first": diff})
            print(f"  B={B} L={L} {mode} {spec} ({p.warps} warps, stages {p.stages or 'arch'}, "
                  f"nsub {p.nsub or 'kernel'}): {min(times[spec]):.1f}-{max(times[spec]):.1f} us, "
                  f"x{med[specs[0]] / med[spec]:.3f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="the earlier attention_mma.cu (required but with --profile)")
    ap.add_argument("--profile", choices=("default", "fp8_dynamic_q", "fp8_head_q"),
                    help="only run this mode's decode three times, untimed, at the first of --shapes (for ncu "
                         "--launch-skip 1 --launch-count 1: benchmarks/profiles/decode_ncu.sh)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="B:L,B:L,... (default: the bench's four)")
    ap.add_argument("--head-size", type=int, default=kb.HEAD, help="64, 128 or 256 (default 128)")
    ap.add_argument("--group", type=int, default=kb.HQ // kb.HKV, help="query heads a KV head (8 KV heads; default 4)")
    ap.add_argument("--modes", default="", help="default,fp8_dynamic_q,fp8_head_q (default: all three)")
    ap.add_argument("--legacy-ring", action="store_true", help="the baseline is from before session 22: launch it"
                    " with that ring's shared memory (legacy_smem_bytes)")
    ap.add_argument("--legacy-grid", action="store_true", help="the baseline is from before session 23: launch it"
                    " on the grid (T, H * head_chunks, splits) (legacy_grid)")
    ap.add_argument("--plans", default="", help="plan,WxSxN,...: tiles of today's kernel to A/B (see above)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not (args.baseline or args.profile or args.plans):
        ap.error("--baseline FILE is required (the earlier attention_mma.cu), unless --profile or --plans")
    device = torch.device("cuda")
    shapes = kb.decode_shapes(args.shapes)
    modes = tuple(m for m in args.modes.split(",") if m)
    if args.plans:
        bw = kb.copy_bandwidth(device)["gbps"]
        rows = [r for B, L in shapes for r in bench_plans(B, L, args.plans.split(","), args.rounds, args.reps, device,
                                                          bw, args.head_size, modes, args.group)]
        print("| B | L | mode | tiles | warps | stages | nsub | median us | vs first | roofline us |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['B']} | {r['L']} | {r['mode']} | {r['tiles']} | {r['warps']} | {r['stages'] or '-'} | "
                  f"{r['nsub'] or '-'} | {r['median_us']} | {r['ratio_vs_first']:.3f}x | {r['roofline_us']} |")
        kb.save_rows(args.json, device, rows, copy_gbps=bw)
        return 0
    if args.profile:
        runs, q, _ = decode_runs(*shapes[0], device, args.head_size, group=args.group)
        out = torch.empty_like(q)
        for _ in range(3):
            runs[args.profile](out)
        torch.cuda.synchronize()
        return 0
    with open(args.baseline) as f:
        baseline = f.read()
    bw = kb.copy_bandwidth(device)["gbps"]
    rows = [r for B, L in shapes
            for r in bench(B, L, baseline, args.rounds, args.reps, device, bw, args.head_size, modes, args.legacy_ring,
                           args.legacy_grid, args.group)]
    print("| B | L | mode | splits | baseline us | current us | ratio (medians) | roofline us | identical |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['L']} | {r['mode']} | {r['splits']} | "
              f"{min(r['baseline_us'])}-{max(r['baseline_us'])} | "
              f"{min(r['current_us'])}-{max(r['current_us'])} | {r['median_ratio']:.3f}x | {r['roofline_us']} | "
              f"{r['identical_outputs']} |")
    kb.save_rows(args.json, device, rows, copy_gbps=bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
