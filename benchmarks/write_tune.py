"""Tune the Triton cache write on a CUDA GPU: rows per program and warps, per scale granularity.

Usage::

    python benchmarks/write_tune.py --out benchmarks/results/write_tune_h100.json [--rows 8,16 --warps 2,4]
    python benchmarks/write_tune.py --plot benchmarks/results/write_tune_h100.json   # -> .png beside it

Writes 16k tokens x 8 KV heads x 128 (bf16 in) into an e4m3 cache, as CUDA-graph replays, for
each (granularity, rows per program, warps), and reports GB/s (bytes read + written, scales
included) against the same-run copy bandwidth. Every configuration's cache bytes (and scales)
must equal the default configuration's before it is timed. Ends with a table and a PNG (``--plot``
redraws the PNG from a JSON anywhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    from fp8kv_bench import kernels as kb
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.write import write_kv

    import fp8kv

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON to write (required unless --plot)")
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of a results JSON (runs anywhere)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rows", default="4,8,16,32", help="rows per program to try")
    p.add_argument("--warps", default="2,4,8", help="warps per program to try")
    p.add_argument("--granularities", default="tensor,token_head", help="scale granularities to time")
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not args.out:
        p.error("--out is required")
    device = torch.device("cuda")
    bw = kb.copy_bandwidth(device)["gbps"]
    T, H, D = 16384, kb.HKV, kb.HEAD
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(T, H, D, generator=gen).to(device=device, dtype=torch.bfloat16)
    v = torch.randn(T, H, D, generator=gen).to(device=device, dtype=torch.bfloat16)
    slots = torch.randperm(T, generator=gen).to(device)
    rows = []
    print(f"{kb.environment(device)['device']}: copy {bw:.0f} GB/s", flush=True)
    for gran in args.granularities.split(","):
        scales = {} if gran == "token_head" else {"k_scale": 0.05, "v_scale": 0.05}
        cache = fp8kv.KVCache.allocate(T // kb.PAGE, kb.PAGE, H, D, kv_dtype="fp8_e4m3", scale_granularity=gran,
                                       device=device, **scales)
        enc = codec_for("sm90", cache.fmt, interpret=False).encoder
        write_kv(cache, k, v, slots, encoder=enc)
        ref = [t.clone() for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)]
        # as fp8kv_bench.kernels.bench_write: bf16 read, FP8 written, int64 slots, float32 scales
        nbytes = 2 * k.numel() * (2 + 1) + T * 8 + (2 * T * H * 4 if gran == "token_head" else 0)
        for block_rows, warps in itertools.product(_ints(args.rows), _ints(args.warps)):
            for t in (cache.key_cache, cache.value_cache):
                t.view(torch.uint8).zero_()

            def call(block_rows=block_rows, warps=warps, cache=cache, enc=enc):
                write_kv(cache, k, v, slots, encoder=enc, block_rows=block_rows, num_warps=warps)

            call()
            now = (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)
            same = all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                       for a, b in zip(now, ref, strict=True))
            ms = kb.time_graph(call, reps=args.reps) if same else None
            row = {"granularity": gran, "block_rows": block_rows, "num_warps": warps, "bit_exact": same,
                   "ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9 if ms else None}
            row["frac_copy"] = row["gbps"] / bw if ms else None
            rows.append(row)
            got = f"{ms * 1e3:.1f} us, {row['gbps']:.0f} GB/s, {row['frac_copy']:.1%} of copy" if ms else "MISMATCH"
            print(f"{gran} rows={block_rows} warps={warps}: {got}", flush=True)
    record = {"environment": kb.environment(device), "copy_gbps": bw, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(table(record))
    return plot(args.out)


def table(record: dict) -> str:
    """Markdown: one line per (granularity, rows, warps); the fastest of each granularity in bold."""
    lines = ["| granularity | rows | warps | µs | GB/s | of copy |", "|---|---|---|---|---|---|"]
    for gran in dict.fromkeys(r["granularity"] for r in record["rows"]):
        rows = [r for r in record["rows"] if r["granularity"] == gran]
        best = min((r["ms"] for r in rows if r["ms"]), default=None)
        for r in rows:
            if not r["ms"]:
                lines.append(f"| {gran} | {r['block_rows']} | {r['num_warps']} | bytes differ | - | - |")
                continue
            cell = f"{r['ms'] * 1e3:.1f}"
            lines.append(f"| {gran} | {r['block_rows']} | {r['num_warps']} | "
                         f"{f'**{cell}**' if r['ms'] == best else cell} | {r['gbps']:.0f} | {r['frac_copy']:.1%} |")
    return "\n".join(lines)


def plot(path: str) -> int:
    """Bars of the fraction of copy bandwidth per launch, one group per granularity."""
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    with open(path) as f:
        record = json.load(f)
    grans = list(dict.fromkeys(r["granularity"] for r in record["rows"]))
    fig, axes = plt.subplots(1, len(grans), figsize=(4.5 * len(grans), 3.6), squeeze=False, sharey=True)
    for ax, gran in zip(axes[0], grans, strict=True):
        rows = [r for r in record["rows"] if r["granularity"] == gran]
        ax.bar(range(len(rows)), [100 * (r["frac_copy"] or 0) for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), [f"{r['block_rows']}x{r['num_warps']}" for r in rows], fontsize=8)
        ax.axhline(100, color="gray", lw=0.8, ls="--")
        ax.set_title(f"{gran}", fontsize=9)
        ax.set_xlabel("rows per program x warps")
    axes[0][0].set_ylabel("% of copy bandwidth")
    env = record["environment"]
    fig.suptitle(f"fp8kv Triton cache write, 16k tokens x 8 x 128, bf16 -> e4m3 "
                 f"(copy {record['copy_gbps']:.0f} GB/s)\n{env['device']}, torch {env['torch']}, "
                 f"Triton {env.get('triton')}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
