"""Tune the Triton decode kernel on a CUDA GPU: launch configurations against SDPA, FlashInfer and the roofline.

Usage::

    python benchmarks/profiles/triton_decode_tune.py --out X.json [--quick] [--flashinfer]
    python benchmarks/profiles/triton_decode_tune.py --grid none --flashinfer --out X.json   # the shipped tiles
    python benchmarks/profiles/triton_decode_tune.py --plot X.json   # -> X.png

For each decode shape of :data:`fp8kv_bench.kernels.DECODE_SHAPES` (GQA 32/8, D=128, block 16,
e4m3 per-tensor cache, bf16 queries) it times, as CUDA-graph replays in one process:

* the general kernel (``_attn_kernel``, the one chunked prefill runs) with its default configuration;
* the decode kernel (:mod:`fp8kv_triton.decode`) over a grid of tiles (keys per tile, warps,
  pipeline stages), V decoded in registers or not, and KV splits sized to fill the GPU
  ``waves`` times;
* bf16 SDPA on contiguous K/V (``enable_gqa``) and, with ``--flashinfer`` and FlashInfer
  importable, its FP8 decode (tensor-core path) on the same cache bytes.

Every configuration's output is checked against the general kernel's before it is timed (max
abs difference below 1e-2 for outputs of order 1: a tuning guard, not the conformance
tolerance, which ``tests/`` apply). Prints progress and a table; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, replace

import torch


def main(argv: list[str] | None = None) -> int:
    from fp8kv_bench import kernels as kb

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON to write (required unless --plot)")
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of a results JSON (runs anywhere)")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's FP8 decode")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shapes", default="", help="B:L,B:L,... (default: the bench's four)")
    p.add_argument("--grid", default="",
                   help="block_n,warps,stages,v_regs(0/1),waves;... or 'none' (default: the built-in grid)")
    p.add_argument("--decode-mode", type=int, default=None, help="force a decoder (fp8kv_triton.modes)")
    p.add_argument("--granularity", default="tensor", choices=("tensor", "head", "token_head"))
    p.add_argument("--qdtype", default="bfloat16", choices=("bfloat16", "float16"), help="query dtype")
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not args.out:
        p.error("--out is required")

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bw = kb.copy_bandwidth(device)["gbps"]
    shapes = kb.decode_shapes(args.shapes)
    if args.grid == "none":
        grid = []
    elif args.grid:
        grid = [tuple(int(x) for x in g.split(",")) for g in args.grid.split(";")]
        grid = [(bn, w, st, bool(vr), wv) for bn, w, st, vr, wv in grid]
    elif args.quick:
        grid = list(itertools.product((64, 128), (4, 8), (3,), (True,), (2, 4)))
    else:
        grid = list(itertools.product((64, 128), (4, 8), (2, 3, 4), (True,), (1, 2, 4, 8)))
        grid += [(32, 4, 4, True, 4), (32, 8, 4, True, 4), (128, 4, 3, False, 4), (64, 8, 3, False, 4)]
    env = kb.environment(device)
    print(f"{env['device']}: copy {bw:.0f} GB/s, {sms} SMs; {len(grid)} configurations x {len(shapes)} shapes",
          flush=True)
    rows = []
    for B, L in shapes:
        rows += tune_shape(B, L, grid, device, sms, bw, args)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"environment": env, "copy_gbps": bw, "query_dtype": args.qdtype, "granularity": args.granularity,
                   "rows": rows}, f, indent=1)
    print("\n| B | L | SDPA bf16 us | general kernel us | shipped decode us | FP8 roofline | vs SDPA | "
          "FlashInfer fp8 us | vs FlashInfer | best in grid us | its config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B, L in shapes:
        rs = [r for r in rows if (r["B"], r["L"]) == (B, L)]
        get = {r["what"]: r for r in rs if r["what"] != "decode"}
        d = get["default"]
        fi = get.get("flashinfer_fp8_tc", {}).get("ms")
        grid_rows = [r for r in rs if r["what"] == "decode" and r.get("ms")]
        best = min(grid_rows, key=lambda r: r["ms"]) if grid_rows else None
        tiles = (f"N{best['config']['block_n']} w{best['config']['num_warps']} s{best['config']['num_stages']} "
                 f"split{best['config']['num_splits']}") if best else "-"
        print(f"| {B} | {L} | {get['sdpa_bf16']['ms'] * 1e3:.1f} | {get['general']['ms'] * 1e3:.1f} | "
              f"{d['ms'] * 1e3:.1f} | {d['frac_roofline']:.0%} | {d['speedup_vs_sdpa']:.2f}x | "
              f"{fi * 1e3 if fi else float('nan'):.1f} | {fi / d['ms'] if fi else float('nan'):.2f}x | "
              f"{best['ms'] * 1e3 if best else float('nan'):.1f} | "
              f"{tiles} |")
    plot(args.out)
    return 0


def plot(path: str) -> int:
    """A bar chart (PNG beside ``path``) of each shape: SDPA bf16, the general kernel, the shipped decode
    kernel, FlashInfer's FP8 decode (if measured) and the FP8 roofline, in microseconds."""
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    with open(path) as f:
        record = json.load(f)
    rows = record["rows"]
    shapes = list(dict.fromkeys((r["B"], r["L"]) for r in rows))
    series = [("sdpa_bf16", "SDPA bf16 (contiguous K/V)"), ("general", "general kernel (_attn_kernel)"),
              ("default", "fp8kv decode kernel (shipped)"),
              ("flashinfer_fp8_tc", "FlashInfer 0.6.6 FP8 (tensor cores)")]
    series = [(k, label) for k, label in series if any(r["what"] == k for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / (len(series) + 1)
    for j, (what, label) in enumerate(series):
        ys = [next((r["ms"] * 1e3 for r in rows if (r["B"], r["L"]) == sh and r["what"] == what), 0) for sh in shapes]
        ax.bar([i + j * width for i in range(len(shapes))], ys, width, label=label)
    roof = [next(r["ms"] * r["frac_roofline"] * 1e3 for r in rows if (r["B"], r["L"]) == sh and r.get("frac_roofline"))
            for sh in shapes]
    ax.bar([i + len(series) * width for i in range(len(shapes))], roof, width, label="FP8 roofline (bytes / copy BW)")
    for i, sh in enumerate(shapes):
        d = next((r for r in rows if (r["B"], r["L"]) == sh and r["what"] == "default"), None)
        if d:
            j = [k for k, _ in series].index("default")
            ax.text(i + j * width, d["ms"] * 1e3, f"{d['speedup_vs_sdpa']:.2f}x\n{d['frac_roofline']:.0%}",
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + len(series) * width / 2 for i in range(len(shapes))], [f"B={b} L={n}" for b, n in shapes])
    ax.set_ylabel("microseconds")
    env = record["environment"]
    ax.set_title(f"decode, Hq=32 Hkv=8 D=128, block 16, e4m3 {record.get('granularity', 'tensor')} scales, "
                 f"{record.get('query_dtype', 'bfloat16')} queries\n{env['device']}, torch {env['torch']}, "
                 f"Triton {env.get('triton')}, {env['date'][:10]} (label: x vs SDPA, % of roofline)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


def tune_shape(B: int, L: int, grid: list, device, sms: int, bw: float, args) -> list[dict]:
    """Time every configuration of ``grid`` (and the baselines) on decode shape ``(B, L)``."""
    from fp8kv_bench import kernels as kb
    from fp8kv_triton import attention as A
    from fp8kv_triton.capabilities import codec_for

    cache, tables, lens, qsl, q = _workload(B, L, device, args.granularity)
    q = q.to(getattr(torch, args.qdtype))
    mode = codec_for("sm90" if torch.cuda.get_device_capability(device) == (9, 0) else None,
                     cache.fmt, interpret=False).decoder
    mode = mode if args.decode_mode is None else args.decode_mode
    out = torch.empty_like(q)
    max_keys = tables.shape[1] * kb.PAGE
    shipped = A.choose_config(device, group=kb.HQ // kb.HKV, head_size=kb.HEAD, num_seqs=B, num_kv_heads=kb.HKV,
                              max_query_len=1, max_keys=max_keys, interpret=False, arch=_arch(device))
    base = replace(shipped, decode=False, v_regs=False, block_n=128, num_stages=3)  # the general kernel on decode steps

    def run(cfg, o=out):
        A.paged_attention(q, cache, tables, lens, qsl, 1, kb.HEAD ** -0.5, True, None, None, o,
                          decode_mode=mode, interpret=False, config=cfg)

    ref = torch.empty_like(q)
    run(base, ref)
    roof_ms = kb.roofline_ms(kb.decode_kv_bytes(B, L), bw)
    k4 = torch.randn(B, kb.HKV, L, kb.HEAD, device=device, dtype=q.dtype)
    v4 = torch.randn_like(k4)
    q4 = q.view(B, kb.HQ, 1, kb.HEAD)
    sdpa = kb.time_graph(lambda: kb._sdpa(q4, k4, v4, enable_gqa=True), reps=args.reps)
    rows = [{"B": B, "L": L, "what": "sdpa_bf16", "ms": sdpa},
            {"B": B, "L": L, "what": "general", "config": asdict(base),
             "ms": kb.time_graph(lambda: run(base), reps=args.reps)}]
    run(shipped)
    rows.append({"B": B, "L": L, "what": "default", "config": asdict(shipped),
                 "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
                 "ms": kb.time_graph(lambda: run(shipped), reps=args.reps)})
    if args.flashinfer and args.granularity == "tensor" and q.dtype == torch.bfloat16:
        fi = kb.flashinfer_decode(cache, tables, L, q)
        if fi is not None:
            fn, fo = fi
            fn()
            rows.append({"B": B, "L": L, "what": "flashinfer_fp8_tc",
                         "max_abs_diff": (fo.float() - ref.float()).abs().max().item(),
                         "ms": kb.time_graph(fn, reps=args.reps)})
    t0 = time.time()
    for i, (bn, warps, stages, v_regs, waves) in enumerate(grid):
        splits = max(1, min(math.ceil(waves * sms / (B * kb.HKV)), math.ceil(max_keys / (2 * bn)), 256))
        kps = math.ceil(math.ceil(max_keys / splits) / bn) * bn
        cfg = replace(base, decode=True, v_regs=v_regs, block_n=bn, num_warps=warps, num_stages=stages,
                      num_splits=math.ceil(max_keys / kps), keys_per_split=kps)
        row = {"B": B, "L": L, "what": "decode", "config": asdict(cfg), "waves": waves, "ms": None}
        try:
            run(cfg)
            torch.cuda.synchronize()
            row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
            if row["max_abs_diff"] < 1e-2:
                row["ms"] = kb.time_graph(lambda cfg=cfg: run(cfg), reps=args.reps)
        except Exception as exc:  # noqa: BLE001 - a configuration that fails is a result
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        got = f"{row['ms'] * 1e3:.1f} us" if row["ms"] else row.get("error", row.get("max_abs_diff"))
        print(f"  [{i + 1}/{len(grid)}] B={B} L={L} N{bn} w{warps} s{stages} vregs={v_regs} "
              f"splits={cfg.num_splits}: {got}  ({time.time() - t0:.0f}s)", flush=True)
    for r in rows:
        if r.get("ms"):
            r["frac_roofline"] = roof_ms / r["ms"]
            r["speedup_vs_sdpa"] = sdpa / r["ms"]
    best = min((r for r in rows if r["what"] in ("decode", "default") and r.get("ms")), key=lambda r: r["ms"])
    print(f"B={B} L={L}: roofline {roof_ms * 1e3:.1f} us, SDPA {sdpa * 1e3:.1f} us, general "
          f"{rows[1]['ms'] * 1e3:.1f} us, default {rows[2]['ms'] * 1e3:.1f} us, best {best['ms'] * 1e3:.1f} us "
          f"({best['frac_roofline']:.0%} roofline) with {best['config']}", flush=True)
    return rows


def _arch(device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def _workload(B: int, L: int, device, granularity: str = "tensor"):
    """An e4m3 cache of ``B`` sequences of ``L`` random tokens (random block tables), bf16 queries."""
    from fp8kv_bench import kernels as kb

    import fp8kv

    gen = torch.Generator().manual_seed(1)
    tables, nblocks = kb._paged_tables(B, L, device, gen)
    scales = {} if granularity == "token_head" else {"k_scale": 0.05, "v_scale": 0.05}
    cache = fp8kv.KVCache.allocate(nblocks, kb.PAGE, kb.HKV, kb.HEAD, kv_dtype="fp8_e4m3",
                                   scale_granularity=granularity, device=device, **scales)
    kb._fill_cache(cache, kb._backend("triton", "write_kv", cache, torch.bfloat16, device), nblocks * kb.PAGE,
                   device, gen)
    q = torch.randn(B, kb.HQ, kb.HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    return cache, tables, lens, qsl, q


if __name__ == "__main__":
    sys.exit(main())
