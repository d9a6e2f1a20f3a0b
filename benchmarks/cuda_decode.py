"""The CUDA backend's decode on a GPU: tensor-core kernel vs CUDA-core kernel, Triton, SDPA and FlashInfer.

Usage::

    python benchmarks/cuda_decode.py --out benchmarks/results/cuda_decode_h100.json [--flashinfer] [--splits 1,2,4]
    python benchmarks/cuda_decode.py --plot benchmarks/results/cuda_decode_h100.json   # -> .png beside it

For each decode shape of :data:`fp8kv_bench.kernels.DECODE_SHAPES` (GQA 32/8, D=128, block 16,
e4m3 per-tensor cache, bf16 queries) it times, as CUDA-graph replays in one process on the same
cache bytes: the CUDA backend's tensor-core kernel (``csrc/attention_mma.cu``) with its planned
split and with each of ``--splits``, its CUDA-core kernel (``csrc/attention.cu``), the Triton
backend as shipped, SDPA bf16 on contiguous K/V and, with ``--flashinfer`` where importable,
FlashInfer's FP8 tensor-core decode. With ``--fp8-attention`` (e4m3, tensor or head scales) also the
FP8 attention mode (docs/fp8_attention.md, dynamic q_scale, prob_scale 1) as the Hopper backend runs
it: on the CUDA backend's tensor-core decode (``kernel="cuda"``, its default) and on its Triton kernel.
Every output is compared with Triton's first (max abs difference below 1e-2 for outputs of order 1: a
guard, the tests apply the derived tolerance; the FP8 mode's with the Hopper Triton kernel's).
Prints progress and a table; writes JSON (and the plot with ``--plot``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from fp8kv import settings as fp8kv_settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON to write (required unless --plot)")
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of a results JSON (runs anywhere)")
    p.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's FP8 decode")
    p.add_argument("--fp8-attention", action="store_true", help="also time the FP8 attention mode's decode"
                   " (Hopper backend: CUDA tensor-core kernel and Triton kernel)")
    p.add_argument("--splits", default="", help="extra KV splits of the tensor-core kernel to time: 1,2,4")
    p.add_argument("--warps", default="", help="extra warps per CTA of the tensor-core kernel to time (with each"
                   " --splits, or the planned split): 4,6,8")
    p.add_argument("--stages", default="", help="extra ring depths of the tensor-core kernel to time (with each"
                   " --splits/--warps, or the planned ones): 2,3,4")
    p.add_argument("--nsub", default="", help="16-key sub-tiles a warp step of the tensor-core kernel to time"
                   " (with each --warps/--stages): 1,2")
    p.add_argument("--shapes", default="", help="B:L,B:L,... (default: the bench's four)")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--granularity", default="tensor", choices=("tensor", "head", "token_head"))
    p.add_argument("--qdtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not args.out:
        p.error("--out is required")
    from fp8kv_bench import kernels as kb

    device = torch.device("cuda")
    bw = kb.copy_bandwidth(device)["gbps"]
    shapes = kb.decode_shapes(args.shapes)
    splits = [int(x) for x in args.splits.split(",") if x]
    args.warp_list = [int(x) for x in args.warps.split(",") if x]
    args.stage_list = [int(x) for x in args.stages.split(",") if x]
    args.nsub_list = [int(x) for x in args.nsub.split(",") if x]
    rows = []
    t0 = time.time()
    for i, (B, L) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] B={B} L={L} ({time.time() - t0:.0f}s)", flush=True)
        rows += bench_shape(B, L, device, bw, splits, args)
    print(table(rows))
    with open(args.out, "w") as f:
        env = {**kb.environment(device), "copy_gbps": bw, "FP8KV_CUDA_ARCH": fp8kv_settings.cuda_arch() or None}
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    return 0


def bench_shape(B: int, L: int, device, bw: float, splits: list[int], args) -> list[dict]:
    from fp8kv_bench import kernels as kb
    from fp8kv_cuda import attention as CA

    import fp8kv

    qdtype = getattr(torch, args.qdtype)
    gen = torch.Generator().manual_seed(1)
    tables, nblocks = kb._paged_tables(B, L, device, gen)
    token = args.granularity == "token_head"
    scales = {} if token else {"k_scale": 0.05, "v_scale": 0.05}
    cache = fp8kv.KVCache.allocate(nblocks, kb.PAGE, kb.HKV, kb.HEAD, kv_dtype=args.kv_dtype,
                                   scale_granularity=args.granularity, device=device, **scales)
    kb._fill_cache(cache, kb._backend("cuda", "write_kv", cache, torch.bfloat16, device), nblocks * kb.PAGE,
                   device, gen)
    q = torch.randn(B, kb.HQ, kb.HEAD, generator=gen).to(device=device, dtype=qdtype)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    scale = kb.HEAD ** -0.5
    max_keys = tables.shape[1] * kb.PAGE
    roof_ms = kb.roofline_ms(kb.decode_kv_bytes(B, L), bw)

    def cuda_run(plan, o):
        return lambda: CA.paged_attention(q, cache, tables, lens, qsl, scale, True, None, None, o, None, plan_=plan)

    meta = fp8kv.plan_attention(cache, num_q_heads=kb.HQ, query_dtype=qdtype, block_tables=tables, seq_lens=lens,
                                max_seq_len=L, validate=False, backend="triton")
    ref = torch.empty_like(q)
    triton_run = lambda: meta.attention.backend.paged_attention(q, cache, meta, ref, None)  # noqa: E731
    triton_run()
    plans = {"cuda_mma": CA.plan(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV, head_size=kb.HEAD,
                                 max_keys=max_keys, query_dtype=qdtype, token_scales=token, fmt=args.kv_dtype),
             "cuda_cores": CA.plan(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV,
                                   head_size=kb.HEAD, max_keys=max_keys, token_scales=token)}
    for n, w, st, ns in itertools.product(splits or [None], args.warp_list or [None], args.stage_list or [None],
                                          args.nsub_list or [None]):
        if n is None and w is None and st is None and ns is None:
            continue
        p = CA.plan_mma(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV, head_size=kb.HEAD,
                        max_keys=max_keys, num_splits=n, warps=w, token_scales=token, stages=st, nsub=ns)
        plans[f"cuda_mma_splits{p.num_splits}_warps{p.warps}" + (f"_stages{st}" if st else "")
              + (f"_nsub{ns}" if ns else "")] = p
    rows = [{"what": "triton", "ms": kb.time_graph(triton_run, reps=args.reps)}]
    for name, plan in plans.items():
        out = torch.empty_like(q)
        fn = cuda_run(plan, out)
        fn()
        torch.cuda.synchronize()
        diff = (out.float() - ref.float()).abs().max().item()
        row = {"what": name, "num_splits": plan.num_splits, "warps": plan.warps if plan.mma else None,
               "max_abs_diff_vs_triton": diff, "ms": None}
        if diff < 1e-2:
            row["ms"] = kb.time_graph(fn, reps=args.reps)
        rows.append(row)
    if args.fp8_attention and args.kv_dtype == "fp8_e4m3" and not token:
        rows += fp8_mode_rows(q, cache, tables, lens, qsl, scale, args)
    kv4 = torch.randn(2, B, kb.HKV, L, kb.HEAD, device=device, dtype=qdtype)
    q4 = q.view(B, kb.HQ, 1, kb.HEAD)
    sdpa = kb.time_graph(lambda: kb._sdpa(q4, kv4[0], kv4[1], enable_gqa=True), reps=args.reps)
    rows.append({"what": "sdpa_bf16", "ms": sdpa})
    if args.flashinfer and qdtype == torch.bfloat16 and args.granularity == "tensor":
        fi = kb.flashinfer_decode(cache, tables, L, q)
        if fi is not None:
            fn, fo = fi
            fn()
            torch.cuda.synchronize()
            diff = (fo.float() - ref.float()).abs().max().item()
            rows.append({"what": "flashinfer_fp8_tc", "max_abs_diff_vs_triton": diff,
                         "ms": kb.time_graph(fn, reps=args.reps)})
    fi_ms = next((r["ms"] for r in rows if r["what"] == "flashinfer_fp8_tc"), None)
    for r in rows:
        r.update(B=B, L=L, kv_dtype=args.kv_dtype, qdtype=args.qdtype, granularity=args.granularity,
                 roofline_ms=roof_ms)
        if r.get("ms"):
            r["frac_roofline"] = roof_ms / r["ms"]
            r["speedup_vs_sdpa"] = sdpa / r["ms"]
            if fi_ms:
                r["speedup_vs_flashinfer"] = fi_ms / r["ms"]
        got = f"{r['ms'] * 1e3:.1f} us ({r['frac_roofline']:.0%} roofline)" if r.get("ms") else \
            f"skipped: max abs diff {r.get('max_abs_diff_vs_triton', r.get('max_abs_diff_vs_fp8_triton'))}"
        print(f"  {r['what']:>22}: {got}", flush=True)
    return rows


def fp8_mode_rows(q, cache, tables, lens, qsl, scale, args) -> list[dict]:
    """The FP8 attention mode's decode through the Hopper backend's launcher, each of its kernels."""
    import dataclasses

    from fp8kv_bench import kernels as kb
    from fp8kv_hopper import attention as HA

    B = q.shape[0]
    cfg = HA.choose_config(group=kb.HQ // kb.HKV, num_seqs=B, num_kv_heads=kb.HKV, max_query_len=1,
                           max_keys=tables.shape[1] * kb.PAGE,
                           num_sms=torch.cuda.get_device_properties(q.device).multi_processor_count)
    outs, rows = {}, []
    for kernel in ("triton", "cuda"):
        o = outs[kernel] = torch.empty_like(q)
        c = dataclasses.replace(cfg, kernel=kernel)

        def fn(o=o, c=c):
            HA.paged_attention_fp8(q, cache, tables, lens, qsl, 1, scale, True, None, None, o, q_scale=None,
                                   prob_scale=1.0, config=c)

        fn()
        torch.cuda.synchronize()
        diff = (o.float() - outs["triton"].float()).abs().max().item()
        row = {"what": f"fp8_mode_{kernel}", "max_abs_diff_vs_fp8_triton": diff, "ms": None}
        if diff < 1e-2:
            row["ms"] = kb.time_graph(fn, reps=args.reps)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| B | L | kernel | splits | time | FP8 roofline | vs SDPA bf16 | vs FlashInfer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ms"):
            continue
        fi = f"{r['speedup_vs_flashinfer']:.2f}x" if "speedup_vs_flashinfer" in r else "-"
        lines.append(f"| {r['B']} | {r['L']} | {r['what']} | {r.get('num_splits', '-')} | {r['ms'] * 1e3:.1f} us | "
                     f"{r['frac_roofline']:.0%} | {r['speedup_vs_sdpa']:.2f}x | {fi} |")
    return "\n".join(lines)


def plot(path: str) -> int:
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if r.get("ms") and "_splits" not in r["what"]]
    shapes = sorted({(r["B"], r["L"]) for r in rows}, key=lambda s: (s[1], s[0]))
    kinds = sorted({r["what"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        ys = [next((r["frac_roofline"] for r in rows if (r["B"], r["L"]) == s and r["what"] == kind), 0)
              for s in shapes]
        ax.bar([i + k * width for i in range(len(shapes))], ys, width, label=kind)
    ax.axhline(0.8, color="k", ls="--", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], [f"B={b} L={n}" for b, n in shapes])
    ax.set_ylabel("fraction of the FP8 roofline")
    ax.set_title(f"decode, {data['environment']['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
