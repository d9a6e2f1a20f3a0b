"""Decode speed-up over bf16 SDPA across shapes, as heatmaps, on a CUDA GPU.

Cells: B in {1, 8, 32, 128} x L in {1k, 4k, 16k, 64k} x GQA group in {1, 4, 8} (8 KV heads, so 8, 32
or 64 query heads) x head size in {64, 128, 256} x block size in {16, 64}: an e4m3 per-tensor cache
filled with random finite codes on the device, bf16 queries, random block tables. Each cell times the
hook of the backend the registry picks (``--backend``, default ``auto``) over a plan made once
(CUDA-graph replays) against ``scaled_dot_product_attention`` on contiguous bf16 K/V of the same shape
(``enable_gqa``), and reports the speed-up and the fraction of the FP8 roofline (K/V bytes / the same
run's copy bandwidth). A cell whose bf16 K/V would exceed ``--max-gib`` is recorded as skipped. The
record is saved after every cell (a cut-off run keeps what it measured); ends with a table per
(head size, group, block size) and a PNG of heatmaps.

    python benchmarks/decode_sweep.py          # -> benchmarks/results/decode_sweep_<device>.json (~20 min on an H100)
    python benchmarks/decode_sweep.py --heads 128 --groups 4 --blocks 16    # one heatmap
"""

from __future__ import annotations

import itertools
import math
import statistics

import torch

from . import kernels as kb
from .results import log, progress, record, title

NAME = "decode_sweep"
BATCHES = (1, 8, 32, 128)
LENGTHS = (1024, 4096, 16384, 65536)
HKV = 8


def add_arguments(p) -> None:
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--heads", default="64,128,256", help="head sizes (default %(default)s)")
    p.add_argument("--groups", default="1,4,8", help="query heads per KV head (default %(default)s)")
    p.add_argument("--blocks", default="16,64", help="block sizes (default %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="timed repeats per measurement (median)")
    p.add_argument("--max-gib", type=float, default=60.0, help="skip cells whose bf16 K/V need more device memory")


def _time_fp8(backend: str, B: int, L: int, hq: int, D: int, page: int, reps: int, device):
    """Milliseconds of the backend's decode hook on a random e4m3 cache, and the backend's name."""
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
    hq = HKV * group
    ms, name = _time_fp8(backend, B, L, hq, D, page, reps, device)
    torch.cuda.empty_cache()
    k = torch.randn(B, HKV, L, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q4 = torch.randn(B, hq, 1, D, device=device, dtype=torch.bfloat16)
    ms_sdpa = kb.time_graph(lambda: kb._sdpa(q4, k, v, enable_gqa=True), reps=reps)
    roof_ms = kb.roofline_ms(2 * B * L * HKV * D, bw)
    return {"B": B, "L": L, "group": group, "D": D, "block_size": page, "ms": ms, "sdpa_bf16_ms": ms_sdpa,
            "speedup_vs_sdpa": ms_sdpa / ms, "frac_roofline": roof_ms / ms, "backend": name}


def run(args) -> dict:
    device = kb.cuda_device("the decode sweep")
    bw = kb.copy_bandwidth(device)["gbps"]
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    cells = list(itertools.product(ints(args.heads), ints(args.groups), ints(args.blocks), BATCHES, LENGTHS))
    rec = record(NAME, device, copy_gbps=bw, backend=args.backend, rows=[])
    log(f"{rec['environment']['device']}: copy {bw:.0f} GB/s; {len(cells)} cells")
    for D, group, page, B, L in progress(cells, "decode sweep"):
        where = f"D={D} group={group} block={page} B={B} L={L}"
        gib = (2 * B * L * HKV * D * 2) / 2**30  # the larger of the two: contiguous bf16 K/V for SDPA
        if gib > args.max_gib:
            rec["rows"].append({"B": B, "L": L, "group": group, "D": D, "block_size": page,
                                "skipped": f"{gib:.0f} GiB"})
            log(f"  {where}: skipped ({gib:.0f} GiB)")
            continue
        try:
            row = _cell(args.backend, B, L, group, D, page, bw, args.reps, device)
        except Exception as exc:  # noqa: BLE001 - a failing cell is a result, reported as such
            row = {"B": B, "L": L, "group": group, "D": D, "block_size": page,
                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.cuda.empty_cache()
        rec["rows"].append(row)
        args.save(rec)
        log(f"  {where}: " + (f"{row['ms'] * 1e3:.1f} us, SDPA {row['sdpa_bf16_ms'] * 1e3:.1f} us, "
                              f"{row['speedup_vs_sdpa']:.2f}x, {row['frac_roofline']:.0%} of the roofline"
                              if "ms" in row else row["error"]))
    return rec


def _cells(rec: dict, D: int, group: int, page: int) -> dict:
    return {(r["B"], r["L"]): r for r in rec["rows"] if (r["D"], r["group"], r["block_size"]) == (D, group, page)}


def table(rec: dict) -> str:
    """One block per (head size, group, block size): speed-up vs SDPA (fraction of the roofline) per (B, L)."""
    measured = [r for r in rec["rows"] if "ms" in r]
    ratios = sorted(r["speedup_vs_sdpa"] for r in measured)
    lines = [title(rec), f"{len(measured)} cells measured, {len(rec['rows']) - len(measured)} skipped or failed"
             + (f"; speed-up over SDPA bf16: median {statistics.median(ratios):.2f}x, range {ratios[0]:.2f}x-"
                f"{ratios[-1]:.2f}x, {sum(x < 1 for x in ratios)} cells below 1x" if ratios else "")]
    for D, group, page in sorted({(r["D"], r["group"], r["block_size"]) for r in rec["rows"]}):
        at = _cells(rec, D, group, page)
        lines += [f"\nD={D} group={group} block={page}: speed-up vs SDPA bf16 (% of FP8 roofline)",
                  "| B \\ L | " + " | ".join(str(n) for n in LENGTHS) + " |", "|---" * (len(LENGTHS) + 1) + "|"]
        for B in BATCHES:
            cells = ["-" if "ms" not in at.get((B, L), {}) else
                     f"{at[B, L]['speedup_vs_sdpa']:.2f}x ({at[B, L]['frac_roofline']:.0%})" for L in LENGTHS]
            lines.append(f"| {B} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rec: dict, plt):
    """Heatmaps of the speed-up over SDPA (rows: head size; columns: group x block size)."""
    rows = rec["rows"]
    heads = sorted({r["D"] for r in rows})
    cols = sorted({(r["group"], r["block_size"]) for r in rows})
    fig, axes = plt.subplots(len(heads), len(cols), figsize=(2.6 * len(cols) + 1, 2.4 * len(heads) + 1),
                             squeeze=False)
    im = None
    for a, D in enumerate(heads):
        for b, (group, page) in enumerate(cols):
            ax = axes[a][b]
            grid = torch.full((len(BATCHES), len(LENGTHS)), float("nan"))
            for (B, L), r in _cells(rec, D, group, page).items():
                if "ms" in r:
                    grid[BATCHES.index(B), LENGTHS.index(L)] = r["speedup_vs_sdpa"]
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
    served = sorted({r["backend"] for r in rows if "backend" in r})
    fig.suptitle(f"fp8kv {rec['backend']} decode (served by {', '.join(served)}; e4m3, bf16 queries) speed-up over "
                 f"SDPA bf16\n{title(rec)}", fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="x SDPA bf16")
    return fig
