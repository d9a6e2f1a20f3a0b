"""Chunked and long causal prefill with the CUDA backend's tensor-core prefill kernel against the
same backend's per-token path (its decode kernels, one CTA row per query token), the Triton backend,
SDPA bf16 and FlashInfer bf16 (its FA3 path), in one process on the same cache bytes.

    python benchmarks/cuda_prefill.py --json benchmarks/results/cuda_prefill/h100.json [--flashinfer]

Shapes (``--shapes``, ``SEQSxNEW+CACHED``): 4 x 2048 new over 2048 cached and 1 x 16384; GQA 32/8,
D=128, block 16, e4m3 cache with per-head scales, bf16 queries (``hopper_prefill.workload``; ``--qdtype
float16`` for float16 ones, SDPA staying bf16). ``FP8KV_CUDA_ARCH=sm75`` times Turing's code paths
on a newer GPU (see ``fp8kv_cuda.runtime``; recorded in the JSON's environment). Times
are medians of CUDA-graph replays; useful FLOPs count the visible (query, key) pairs (``4 D`` per
pair and query head). Before timing, the CUDA output is compared with the Triton backend's (the
largest difference in units of ``max |v|``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fp8kv import settings as fp8kv_settings

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8kv_bench.kernels import causal_sdpa_bf16, environment, time_graph  # noqa: E402
from hopper_prefill import (  # noqa: E402
    HKV,
    HQ,
    D,
    add_common_args,
    bench_flashinfer,
    plot,
    recorder,
    run_shapes,
    table,
    workload,
)


def bench_shape(device, seqs: int, new: int, cached: int, args, rows: list[dict]) -> None:
    from fp8kv_cuda import attention as cuda_attention
    from fp8kv_cuda.attention import paged_attention, plan

    import fp8kv

    gen = torch.Generator().manual_seed(7)
    cache, tables, query, seq_lens, qsl, flops = workload(device, seqs, new, cached, gen)
    qdtype = getattr(torch, args.qdtype)
    query = query.to(qdtype)
    L = new + cached
    tag = f"{seqs}x{new} over {cached}"
    vmax = (cache.v_scale.max() * 448).item()
    print(f"== {tag}: {flops / 1e12:.3f} useful TFLOP", flush=True)

    record = recorder(rows, seqs, new, cached, flops)

    if args.profile:  # the CUDA backend only, three untimed calls (for ncu --launch-skip 1)
        meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=qdtype, block_tables=tables,
                                    seq_lens=seq_lens, query_start_loc=qsl, num_tokens=query.shape[0],
                                    max_query_len=new, max_seq_len=L, validate=False, backend="cuda")
        for _ in range(3):
            meta.attention.backend.paged_attention(query, cache, meta, torch.empty_like(query), None)
        torch.cuda.synchronize()
        return
    q4 = query.view(seqs, new, HQ, D).transpose(1, 2).to(torch.bfloat16).contiguous()
    kd = torch.randn(seqs, HKV, L, D, device=device, dtype=torch.bfloat16)
    vd = torch.randn(seqs, HKV, L, D, device=device, dtype=torch.bfloat16)
    record("sdpa bf16", time_graph(lambda: causal_sdpa_bf16(q4, kd, vd), calls=3, reps=args.reps))
    outs = {}
    default = cuda_attention.WGMMA_PREFILL, cuda_attention.WGMMA_PINGPONG, cuda_attention.WMMA_PREFILL_BELOW_SM
    runs = [("triton", "triton", None), ("cuda", "cuda tensor-core prefill", None)]
    if args.wgmma and torch.cuda.get_device_capability(device) == (9, 0):  # the sm90 kernel (its default)
        runs += [("cuda", "cuda wgmma prefill (ping-pong)", True), ("cuda", "cuda wgmma prefill", False)]
    if args.wmma and qdtype == torch.float16:  # Volta's kernel, on this GPU
        runs += [("cuda", "cuda wmma prefill (Volta's kernel)", "wmma")]
    for name, label, pingpong in runs:
        cuda_attention.WGMMA_PREFILL = pingpong is not None and pingpong != "wmma"
        cuda_attention.WGMMA_PINGPONG = bool(pingpong)
        cuda_attention.WMMA_PREFILL_BELOW_SM = 1000 if pingpong == "wmma" else default[2]
        meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=qdtype, block_tables=tables,
                                    seq_lens=seq_lens, query_start_loc=qsl, num_tokens=query.shape[0],
                                    max_query_len=new, max_seq_len=L, validate=False, backend=name)
        be, out = meta.attention.backend, torch.empty_like(query)
        try:
            be.paged_attention(query, cache, meta, out, None)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a kernel that fails is reported, the rest still timed
            print(f"  {label} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        outs[label] = out
        extra = {}
        if name == "cuda":
            extra = {"plan": str(meta.backend_plan),
                     "max_diff_vs_triton_over_vmax": round((out.float() - outs["triton"].float()).abs().max().item()
                                                           / vmax, 6)}
        ms = time_graph(lambda be=be, meta=meta, out=out: be.paged_attention(query, cache, meta, out, None),
                        calls=3, reps=args.reps)
        record("fp8kv " + label, ms, **extra)
    cuda_attention.WGMMA_PREFILL, cuda_attention.WGMMA_PINGPONG, cuda_attention.WMMA_PREFILL_BELOW_SM = default
    if args.splits:  # the CUDA backend's default prefill kernel at forced KV split counts (the plan's A/B)
        from fp8kv_cuda.attention import plan_prefill

        for ns in (int(x) for x in args.splits.split(",")):
            p = plan_prefill(device, num_seqs=seqs, num_kv_heads=HKV, group=HQ // HKV, head_size=D,
                             max_keys=tables.shape[1] * cache.block_size, max_query_len=new, num_splits=ns)
            out = torch.empty_like(query)

            def forced(p=p, out=out):
                paged_attention(query, cache, tables, seq_lens, qsl, D**-0.5, True, None, None, out, None, plan_=p)
            record(f"fp8kv cuda prefill, {p.num_splits} splits (forced)", time_graph(forced, calls=3, reps=args.reps))
    if args.per_token and seqs * new <= 8192:
        p = plan(device, num_tokens=query.shape[0], num_kv_heads=HKV, group=HQ // HKV, head_size=D, max_keys=L,
                 query_dtype=qdtype, fmt="fp8_e4m3")  # the decode plan: one CTA row per token
        out = torch.empty_like(query)

        def per_token():
            paged_attention(query, cache, tables, seq_lens, qsl, D**-0.5, True, None, None, out, None, plan_=p)
        record("fp8kv cuda per-token (decode kernels)", time_graph(per_token, calls=1, reps=5))
    if args.flashinfer and qdtype == torch.bfloat16:
        bench_flashinfer(device, cache, tables, query, qsl, seqs, args, record)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--per-token", action="store_true", help="also time the per-token path (slow)")
    ap.add_argument("--wgmma", action="store_true",
                    help="on sm90 also time the wgmma prefill kernel (the default there), ping-pong on and off")
    ap.add_argument("--splits", default="", help="also time the CUDA backend's prefill at these forced KV split "
                    "counts, e.g. 1,2,8 (the plan's split rule is measured this way)")
    ap.add_argument("--wmma", action="store_true",
                    help="also time Volta's wmma prefill kernel on this GPU (float16 queries only)")
    ap.add_argument("--profile", action="store_true", help="only run the CUDA kernel, untimed (for ncu)")
    ap.add_argument("--qdtype", choices=("bfloat16", "float16"), default="bfloat16",
                    help="query dtype of the fp8kv backends (SDPA stays bf16; FlashInfer only with bfloat16)")
    args = ap.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    device = torch.device("cuda")
    rows = run_shapes(bench_shape, device, args)
    if args.profile:
        return 0
    print(table(rows))
    if args.json:
        env = environment(device)
        env["query_dtype"] = args.qdtype
        env["FP8KV_CUDA_ARCH"] = fp8kv_settings.cuda_arch() or None
        for mod in ("cupy", "flashinfer"):  # (the CUDA backend's runtime and the peer)
            try:
                env[mod] = __import__(mod).__version__
            except Exception:  # noqa: BLE001 - not installed
                env[mod] = None
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=1)
        plot(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
