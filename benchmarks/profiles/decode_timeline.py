"""Where a decode step's time goes, CTA by CTA: the tensor-core decode (``csrc/attention_mma.cu``) built with
timestamps (``%globaltimer``) at three points of every CTA (start, end of its key loop, end of the epilogue)
and its SM (``%smid``), launched as the package launches it, inside a CUDA graph of ``--calls`` calls (the
timestamps are the last call's). Prints, per shape and mode: the graph's time a call, the last call's span
(first start to last end), the start spread (launch), the CTAs' loop and epilogue times, and the tail (how
long the last CTAs run after the median CTA ended); writes JSON.

    python benchmarks/profiles/decode_timeline.py --out X.json [--shapes 64:2048,1:131072]
    python benchmarks/profiles/decode_timeline.py --plot X.json   # -> X.png: each row's CTA end times

The instrumented source is the package's with four lines added (string patches below); the timestamps go
to a float32 buffer passed as ``lse`` past its ``T * HQ`` rows. Needs a CUDA GPU and CuPy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8kv_bench import kernels as kb  # noqa: E402

ANCHOR_START = "    const int lane = tid & 31, warp = tid >> 5;\n    const int g = lane >> 2, c = lane & 3;\n"
ANCHOR_LOOP = "    __syncthreads();  // every warp is done with the ring: the epilogue reuses it\n"
STAMP = ("    unsigned long long ts_{n}; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ts_{n}));\n")
ANCHOR_END_TAIL = ("            if (d == 0 && write_lse) lse[row] = l > 0.0f ? (m + log2f(l)) * LN2 : NEG_INF;\n"
                   "        }\n    }\n")
END = ("    __syncthreads();\n" + STAMP.format(n=2)
       + "    if (tid == 0) { unsigned smid; asm(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
       "        unsigned long long* ts = reinterpret_cast<unsigned long long*>(lse + (i64)T * HQ)\n"
       "            + 4 * ((i64)blockIdx.z * gridDim.x + blockIdx.x);\n"
       "        ts[0] = ts_0; ts[1] = ts_1; ts[2] = ts_2; ts[3] = smid; }\n")


def instrumented_source() -> str:
    from fp8kv_cuda import variants

    path = Path(variants.__file__).with_name("csrc") / "attention_mma.cu"
    text = path.read_text()
    for anchor in (ANCHOR_START, ANCHOR_LOOP, ANCHOR_END_TAIL):
        if text.count(anchor) != 1:
            raise SystemExit(f"decode_timeline: the kernel source changed; anchor not found once: {anchor!r}")
    text = text.replace(ANCHOR_START, ANCHOR_START + STAMP.format(n=0))
    text = text.replace(ANCHOR_LOOP, ANCHOR_LOOP + STAMP.format(n=1))
    return text.replace(ANCHOR_END_TAIL, ANCHOR_END_TAIL + END)


def timeline(B: int, L: int, mode: str, calls: int, device) -> dict:
    """The last of ``calls`` graph-replayed calls' CTA timestamps at B x L in ``mode`` (``default`` or
    ``fp8_dynamic_q``), summarised; ``raw_ns``: per CTA (start, loop end, end, SM)."""
    from fp8kv_cuda import attention as CA

    cache, tables, lens, qsl, q = kb.decode_case(B, L, device)
    T, HQ, D = q.shape
    plan = CA.plan_mma(device, num_tokens=T, num_kv_heads=kb.HKV, group=HQ // kb.HKV, head_size=D,
                       max_keys=tables.shape[1] * kb.PAGE, fp8_attention=mode != "default")
    ctas = T * kb.HKV * plan.head_chunks * plan.num_splits
    lse = torch.zeros(T * HQ + 8 * ctas, dtype=torch.float32, device=device)
    out = torch.empty_like(q)
    fp8 = CA.Fp8Attention(None, (0, 0), 1.0) if mode != "default" else None

    def run():
        CA.paged_attention(q, cache, tables, lens, qsl, D**-0.5, True, None, None, out, lse, plan_=plan,
                           fp8_attention=fp8)

    per_call_ms = kb.time_graph(run, calls=calls, reps=20)  # (lse then holds its last replay's last call)
    torch.cuda.synchronize()
    ts = lse[T * HQ:].view(torch.int64).view(ctas, 4).cpu()
    start, loop_end, end = (ts[:, i].double() for i in range(3))
    t0 = start.min().item()
    ends = sorted(((end - t0) / 1e3).tolist())
    loops = ((loop_end - start) / 1e3).tolist()
    per_sm: dict[int, int] = {}
    for sm in ts[:, 3].tolist():
        per_sm[sm] = per_sm.get(sm, 0) + 1
    return {"B": B, "L": L, "mode": mode, "ctas": ctas, "splits": plan.num_splits, "warps": plan.warps,
            "stages": plan.stages, "nsub": plan.nsub,
            "graph_us_per_call": round(per_call_ms * 1e3, 2),
            "span_us": round(ends[-1], 2),
            "start_spread_us": round((start.max().item() - t0) / 1e3, 2),
            "loop_us": [round(min(loops), 2), round(statistics.median(loops), 2), round(max(loops), 2)],
            "epilogue_us_median": round(statistics.median(((end - loop_end) / 1e3).tolist()), 2),
            "end_us": [round(ends[len(ends) // 10], 2), round(statistics.median(ends), 2),
                       round(ends[9 * len(ends) // 10], 2), round(ends[-1], 2)],
            "sms_used": len(per_sm), "ctas_per_sm": sorted(per_sm.values()),
            "raw_ns": ts.tolist()}


def main(argv: list[str] | None = None) -> int:
    from fp8kv_bench.results import add_output_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(ap, "JSON to write (required unless --plot)", shapes=True)
    ap.add_argument("--modes", default="default,fp8_dynamic_q")
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not args.out:
        ap.error("--out is required")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cuda_decode_ab as ab

    device = torch.device("cuda")
    ab.use_baseline(instrumented_source())
    shapes = kb.decode_shapes(args.shapes)
    rows = []
    for B, L in shapes:
        for mode in args.modes.split(","):
            r = timeline(B, L, mode, args.calls, device)
            rows.append(r)
            print(f"B={B} L={L} {mode}: {r['graph_us_per_call']} us a call (graph); last call: span "
                  f"{r['span_us']} us, starts within {r['start_spread_us']}, loop min/med/max {r['loop_us']}, "
                  f"epilogue {r['epilogue_us_median']}, ends p10/med/p90/max {r['end_us']}, "
                  f"{r['sms_used']} SMs, CTAs an SM {min(r['ctas_per_sm'])}-{max(r['ctas_per_sm'])}", flush=True)
    print("| B | L | mode | us a call | span | start spread | loop med | epilogue | end med | end max |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['L']} | {r['mode']} | {r['graph_us_per_call']} | {r['span_us']} | "
              f"{r['start_spread_us']} | {r['loop_us'][1]} | {r['epilogue_us_median']} | {r['end_us'][1]} | "
              f"{r['end_us'][3]} |")
    kb.save_rows(args.out, device, rows)
    plot(args.out)
    return 0


def plot(path: str) -> int:
    """``path`` with .png: per row, when each CTA's key loop and the CTA itself ended (us after the first
    CTA started), sorted, with the graph's time a call for comparison."""
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()
    with open(path) as f:
        rows = json.load(f)["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], rows, strict=True):
        t0 = min(x[0] for x in r["raw_ns"])
        for k, label in ((1, "key loop ends"), (2, "CTA ends")):
            ax.plot(sorted((x[k] - t0) / 1e3 for x in r["raw_ns"]), label=label)
        ax.axhline(r["graph_us_per_call"], color="grey", ls="--", lw=0.8, label="graph time a call")
        tag = "PDL launch\n" if r.get("pdl") else ""  # (rows timed as a programmatic dependent launch)
        ax.set_title(f"{tag}B={r['B']} L={r['L']} {r['mode']}", fontsize=8)
        ax.set_xlabel("CTAs, sorted")
    axes[0][0].set_ylabel("us after the first CTA started")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = str(Path(path).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
