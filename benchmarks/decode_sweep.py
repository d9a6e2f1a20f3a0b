"""Decode speed-up over bf16 SDPA across shapes, drawn as heatmaps: ``python benchmarks/decode_sweep.py``.

Usage::

    python benchmarks/decode_sweep.py --out benchmarks/results/decode_sweep_h100.json [--backend triton]
        [--heads 64,128,256] [--groups 1,4,8] [--blocks 16,64] [--reps 10]
    python benchmarks/decode_sweep.py --plot benchmarks/results/decode_sweep_h100.json   # -> .png beside it

Cells: B in {1, 8, 32, 128} x L in {1k, 4k, 16k, 64k} x GQA group in {1, 4, 8} (8 KV heads, so 8,
32 or 64 query heads) x head size in {64, 128, 256} x block size in {16, 64}: an e4m3 per-tensor
cache filled with random finite codes (no NaN bytes) on the device, bf16 queries, random block
tables. Each cell times the backend's attention hook over a plan made once (CUDA-graph replays,
as ``fp8kv bench``) against ``scaled_dot_product_attention`` on contiguous bf16 K/V of the same
shape (``enable_gqa``), and reports the speed-up and the fraction of the FP8 roofline (K/V bytes
/ same-run copy bandwidth). A cell whose FP8 cache plus bf16 K/V would exceed ``--max-gib`` is
recorded as skipped. Progress per cell, a table per (head size, group, block size) at the end,
JSON, and a PNG of heatmaps (``--plot`` redraws it from the JSON anywhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch

BATCHES = (1, 8, 32, 128)
LENGTHS = (1024, 4096, 16384, 65536)
HKV = 8


def _time_fp8(backend: str, B: int, L: int, hq: int, D: int, page: int, reps: int, device):
    """Milliseconds of the backend's decode hook on a random e4m3 cache, and the backend's name."""
    from fp8kv_bench import kernels as kb

    import fp8kv

    nblk = math.ceil(L / page)
    cache = fp8kv.KVCache.allocate(B * nblk, page, HKV, D, kv_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.05,
                                   device=device)
    for t in (cache.key_cache, cache.value_cache):  # random finite e4m3 codes: 0x7F / 0xFF are NaN
        codes = t.view(torch.uint8)
        codes.random_(0, 255)
        codes[codes == 0x7F] = 0x7E
    tables = torch.randperm(B * nblk, device=device, dtype=torch.int32).view(B, nblk)
    q = torch.randn(B, hq, D, device=device, dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    meta = fp8kv.plan_attention(cache, num_q_heads=hq, query_dtype=torch.bfloat16, block_tables=tables,
                                seq_lens=lens, max_seq_len=L, validate=False, backend=backend)
    hook = meta.attention.backend
    return kb.time_graph(lambda: hook.paged_attention(q, cache, meta, out, None), reps=reps), hook.name


def _cell(backend: str, B: int, L: int, group: int, D: int, page: int, bw: float, reps: int, device) -> dict:
    from fp8kv_bench import kernels as kb

    hq = HKV * group
    ms, name = _time_fp8(backend, B, L, hq, D, page, reps, device)
    torch.cuda.empty_cache()
    k = torch.randn(B, HKV, L, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q4 = torch.randn(B, hq, 1, D, device=device, dtype=torch.bfloat16)
    ms_sdpa = kb.time_graph(lambda: kb._sdpa(q4, k, v, enable_gqa=True), reps=reps)
    roof_ms = 2 * B * L * HKV * D / (bw * 1e9) * 1e3
    return {"B": B, "L": L, "group": group, "D": D, "block_size": page, "ms": ms, "sdpa_bf16_ms": ms_sdpa,
            "speedup_vs_sdpa": ms_sdpa / ms, "frac_roofline": roof_ms / ms, "backend": name}


def run(args) -> int:
    from fp8kv_bench import kernels as kb

    device = torch.device("cuda")
    bw = kb.copy_bandwidth(device)["gbps"]
    heads = [int(x) for x in args.heads.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    cells = list(itertools.product(heads, groups, blocks, BATCHES, LENGTHS))
    env = kb.environment(device)
    print(f"{env['device']}: copy {bw:.0f} GB/s; {len(cells)} cells", flush=True)
    rows, t0 = [], time.time()
    for i, (D, group, page, B, L) in enumerate(cells):
        gib = (2 * B * L * HKV * D * 2) / 2**30  # the larger of the two: contiguous bf16 K/V for SDPA
        if gib > args.max_gib:
            rows.append({"B": B, "L": L, "group": group, "D": D, "block_size": page, "skipped": f"{gib:.0f} GiB"})
            print(f"[{i + 1}/{len(cells)}] D={D} group={group} block={page} B={B} L={L}: skipped ({gib:.0f} GiB)",
                  flush=True)
            continue
        try:
            row = _cell(args.backend, B, L, group, D, page, bw, args.reps, device)
        except Exception as exc:  # noqa: BLE001 - a failing cell is a result, reported as such
            row = {"B": B, "L": L, "group": group, "D": D, "block_size": page,
                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.cuda.empty_cache()
        rows.append(row)
        _save(args.out, env, bw, args.backend, rows)  # after every cell: a cut-off run keeps what it measured
        got = (f"{row['ms'] * 1e3:.1f} us, SDPA {row['sdpa_bf16_ms'] * 1e3:.1f} us, {row['speedup_vs_sdpa']:.2f}x, "
               f"{row['frac_roofline']:.0%} roofline") if "ms" in row else row["error"]
        print(f"[{i + 1}/{len(cells)}] D={D} group={group} block={page} B={B} L={L}: {got} ({time.time() - t0:.0f}s)",
              flush=True)
    record = _save(args.out, env, bw, args.backend, rows)
    print(table(record))
    return plot(args.out)


def _save(path: str, env: dict, bw: float, backend: str, rows: list[dict]) -> dict:
    record = {"environment": env, "copy_gbps": bw, "backend": backend, "rows": rows}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return record


def table(record: dict) -> str:
    """Markdown: one block per (head size, group, block size), speed-up vs SDPA per (B, L)."""
    lines = []
    keys = sorted({(r["D"], r["group"], r["block_size"]) for r in record["rows"]})
    for D, group, page in keys:
        lines += [f"\nD={D} group={group} block={page}: speed-up vs SDPA bf16 (% of FP8 roofline)",
                  "| B \\ L | " + " | ".join(str(n) for n in LENGTHS) + " |", "|---" * (len(LENGTHS) + 1) + "|"]
        for B in BATCHES:
            cells = []
            for L in LENGTHS:
                r = next((r for r in record["rows"] if (r["D"], r["group"], r["block_size"], r["B"], r["L"])
                          == (D, group, page, B, L)), None)
                cells.append("-" if r is None or "ms" not in r else
                             f"{r['speedup_vs_sdpa']:.2f}x ({r['frac_roofline']:.0%})")
            lines.append(f"| {B} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str) -> int:
    """Heatmaps of the speed-up over SDPA (rows: head size; columns: group x block size)."""
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    with open(path) as f:
        record = json.load(f)
    rows = record["rows"]
    heads = sorted({r["D"] for r in rows})
    cols = sorted({(r["group"], r["block_size"]) for r in rows})
    fig, axes = plt.subplots(len(heads), len(cols), figsize=(2.6 * len(cols) + 1, 2.4 * len(heads) + 1),
                             squeeze=False)
    im = None
    for a, D in enumerate(heads):
        for b, (group, page) in enumerate(cols):
            ax = axes[a][b]
            grid = torch.full((len(BATCHES), len(LENGTHS)), float("nan"))
            for r in rows:
                if (r["D"], r["group"], r["block_size"]) == (D, group, page) and "ms" in r:
                    grid[BATCHES.index(r["B"]), LENGTHS.index(r["L"])] = r["speedup_vs_sdpa"]
            im = ax.imshow(grid.numpy(), cmap="RdYlGn", vmin=0.5, vmax=2.0)
            for i, j in itertools.product(range(len(BATCHES)), range(len(LENGTHS))):
                val = grid[i, j].item()
                ax.text(j, i, "skip" if math.isnan(val) else f"{val:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(LENGTHS)), [f"{n // 1024}k" for n in LENGTHS], fontsize=7)
            ax.set_yticks(range(len(BATCHES)), [str(x) for x in BATCHES], fontsize=7)
            ax.set_title(f"D={D} group={group} block={page}", fontsize=8)
            if b == 0:
                ax.set_ylabel("batch")
            if a == len(heads) - 1:
                ax.set_xlabel("context")
    env = record["environment"]
    served = sorted({r["backend"] for r in rows if "backend" in r})
    fig.suptitle(f"fp8kv {record['backend']} decode (served by {', '.join(served)}; e4m3, bf16 queries) speed-up over "
                 f"SDPA bf16\n"
                 f"{env['device']}, torch {env['torch']}, Triton {env.get('triton')}, {env['date'][:10]}", fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="x SDPA bf16")
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON to write (required unless --plot)")
    p.add_argument("--plot", metavar="JSON", help="only draw the heatmaps of a results JSON (runs anywhere)")
    p.add_argument("--backend", default="triton")
    p.add_argument("--heads", default="64,128,256")
    p.add_argument("--groups", default="1,4,8")
    p.add_argument("--blocks", default="16,64")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-gib", type=float, default=60.0, help="skip cells needing more device memory")
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not args.out:
        p.error("--out is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
