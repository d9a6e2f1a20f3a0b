"""Chunked and long causal prefill on the H100: the Hopper FP8 tensor-core kernel against the Triton
backend (FP8 cache, bf16 math), SDPA bf16 and FlashInfer bf16 (its FA3 path), same process.

    python benchmarks/hopper_prefill.py --json benchmarks/results/hopper_prefill_h100.json [--flashinfer]

Shapes: 4 sequences x 2048 new tokens over 2048 cached, and 1 x 16384 (no cache); GQA 32/8, D=128,
block 16, e4m3 cache with per-head scales, bf16 queries. Times are medians of CUDA-graph replays.
Useful FLOPs count the visible (query, key) pairs only: ``4 * D`` per pair per query head. Before
timing, every FP8-mode configuration is checked against a dense float64 evaluation of the mode's
definition (docs/fp8_attention.md): query quantized to e4m3 with its scale, P rounded to e4m3
relative to the row maximum of the base-2 logits rounded up to an integer, row sum of the
unrounded P. The report gives the largest difference in
units of ``max |v|``, next to the default mode's difference from the same definition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fp8kv_bench.kernels import (  # noqa: E402
    _backend,
    _fill_cache,
    _paged_tables,
    causal_prefill_flops,
    causal_sdpa_bf16,
    environment,
    time_graph,
)

HQ, HKV, D, PAGE = 32, 8, 128, 16


def fp8_mode_dense(query, cache, block_tables, seq_lens, qsl, softmax_scale, q_scale=None):
    """The FP8 mode's definition, dense and in float64 (the benchmark's own check, independent of
    fp8kv.reference): returns ``[T, Hq, D]`` float64."""
    e4 = torch.float8_e4m3fn
    T = query.shape[0]
    group = HQ // HKV
    out = torch.zeros(T, HQ, D, dtype=torch.float64, device=query.device)
    ks, vs = cache.k_scale.double(), cache.v_scale.double()
    for s in range(seq_lens.shape[0]):
        L = int(seq_lens[s])
        a, b = int(qsl[s]), int(qsl[s + 1])
        blocks = block_tables[s, : (L + PAGE - 1) // PAGE].long()
        k8 = cache.key_cache[blocks].reshape(-1, HKV, D)[:L].to(torch.float64)
        v8 = cache.value_cache[blocks].reshape(-1, HKV, D)[:L].to(torch.float64)
        q = query[a:b].float()
        if q_scale is None:
            qs = (q.abs().amax(-1) / torch.full_like(q[..., 0], 448.0)).clamp_min(2.0**-126)
        else:
            qs = q_scale.float().repeat_interleave(group)[None, :].expand(q.shape[0], HQ)
        q8 = (q / qs[..., None]).clamp(-448, 448).to(e4).to(torch.float64)
        kh = k8.repeat_interleave(group, 1)  # [L, Hq, D]
        vh = v8.repeat_interleave(group, 1)
        logits = torch.einsum("thd,lhd->htl", q8, kh) * (qs.double().T[..., None] * softmax_scale)
        logits = logits * ks.repeat_interleave(group)[:, None, None] if ks.numel() > 1 else logits * ks
        n = b - a
        pos = torch.arange(L - n, L, device=query.device)
        mask = torch.arange(L, device=query.device)[None, :] <= pos[:, None]
        b2 = logits.masked_fill(~mask[None], float("-inf")) / math.log(2.0)  # base-2 logits
        p = torch.exp2(b2 - torch.ceil(b2.amax(-1, keepdim=True)))  # against the integer row maximum
        l_sum = p.sum(-1, keepdim=True)
        p8 = p.float().clamp(max=448).to(e4).to(torch.float64)
        o = torch.einsum("htl,lhd->thd", p8 / l_sum, vh)
        out[a:b] = o * (vs.repeat_interleave(group)[None, :, None] if vs.numel() > 1 else vs)
    return out


def workload(device, seqs, new, cached, gen):
    import fp8kv

    L = new + cached
    tables, nblocks = _paged_tables(seqs, L, device, gen)
    cache = fp8kv.KVCache.allocate(nblocks, PAGE, HKV, D, kv_dtype="fp8_e4m3", scale_granularity="head",
                                   k_scale=(0.03 + 0.04 * torch.rand(HKV, generator=gen)).to(device),
                                   v_scale=(0.03 + 0.04 * torch.rand(HKV, generator=gen)).to(device), device=device)
    _fill_cache(cache, _backend("triton", "write_kv", cache, torch.bfloat16, device), nblocks * PAGE, device, gen)
    T = seqs * new
    query = torch.randn(T, HQ, D, generator=gen).to(device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((seqs,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32, device=device)
    return cache, tables, query, seq_lens, qsl, causal_prefill_flops(seqs, new, cached, HQ, D)


def recorder(rows: list[dict], seqs: int, new: int, cached: int, flops: float):
    """``record(name, ms, **extra)``: appends a result row for the shape and prints it."""
    tag = f"{seqs}x{new} over {cached}"

    def record(name, ms, **kw):
        row = {"shape": tag, "seqs": seqs, "new": new, "cached": cached, "impl": name, "ms": ms,
               "useful_tflops": flops / (ms * 1e-3) / 1e12, **kw}
        rows.append(row)
        print(f"  {name:48s} {ms * 1e3:8.1f} us  {row['useful_tflops']:6.1f} TFLOP/s "
              + " ".join(f"{k}={v}" for k, v in kw.items() if k != "config"), flush=True)

    return record


def bench_shape(device, seqs: int, new: int, cached: int, args, rows: list[dict]) -> None:
    """Time every implementation on one shape (appends rows)."""
    from fp8kv_hopper import schedule
    from fp8kv_hopper.attention import choose_config, paged_attention_fp8

    import fp8kv

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator().manual_seed(7)
    cache, tables, query, seq_lens, qsl, flops = workload(device, seqs, new, cached, gen)
    L = new + cached
    scale = D**-0.5
    out = torch.empty_like(query)
    tag = f"{seqs}x{new} over {cached}"
    check = seqs * new <= 8192 and seqs * (new + cached) <= 262144  # the dense float64 check of the definition
    vmax = (cache.v_scale.max() * 448).item()
    print(f"== {tag}: {flops / 1e12:.3f} useful TFLOP", flush=True)

    record = recorder(rows, seqs, new, cached, flops)
    if args.profile:  # the FP8-mode wgmma kernel only, three untimed calls (for ncu --launch-skip 1)
        cfg = choose_config(group=HQ // HKV, num_seqs=seqs, num_kv_heads=HKV, max_query_len=new, max_keys=L,
                            num_sms=sms)
        for _ in range(3):
            paged_attention_fp8(query, cache, tables, seq_lens, qsl, new, scale, True, None, None, out, q_scale=None,
                                prob_scale=1.0, config=dataclasses.replace(cfg, kernel="wgmma"))
        torch.cuda.synchronize()
        return

    def diff(q_scale) -> dict:
        if not check:
            return {}
        want = fp8_mode_dense(query, cache, tables, seq_lens, qsl, scale, q_scale=q_scale)
        return {"diff_from_fp8_definition_over_vmax": round((out.double() - want).abs().max().item() / vmax, 5)}

    # SDPA bf16 (flash, lower-right causal), dense K/V of the same length
    q4 = query.view(seqs, new, HQ, D).transpose(1, 2).contiguous()
    kd = torch.randn(seqs, HKV, L, D, device=device, dtype=torch.bfloat16)
    vd = torch.randn(seqs, HKV, L, D, device=device, dtype=torch.bfloat16)
    try:
        record("sdpa bf16", time_graph(lambda: causal_sdpa_bf16(q4, kd, vd), calls=3, reps=args.reps))
    except RuntimeError as exc:
        print("  sdpa failed:", exc)
    # the Triton backend, default mode
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=tables,
                                seq_lens=seq_lens, query_start_loc=qsl, num_tokens=query.shape[0],
                                max_query_len=new, max_seq_len=L, validate=False, backend="triton")
    tb = meta.attention.backend
    ms = time_graph(lambda: tb.paged_attention(query, cache, meta, out, None), calls=3, reps=args.reps)
    record("fp8kv triton (default mode: bf16 math)", ms, **diff(None))
    # the Hopper FP8 kernel
    shipped = choose_config(group=HQ // HKV, num_seqs=seqs, num_kv_heads=HKV, max_query_len=new, max_keys=L,
                            num_sms=sms)  # kernel "auto": the CUDA kernel here (prefill), Triton otherwise
    base = dataclasses.replace(shipped, kernel="triton")
    grid = [(base, True), (base, False)]
    if args.grid == "full":
        for bm, bn, w, st in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 4, 2), (64, 128, 4, 3),
                              (128, 64, 4, 3), (256, 64, 8, 2)):
            grid.append((dataclasses.replace(base, block_m=bm, block_n=bn, num_warps=w, num_stages=st), True))
    grid += [(dataclasses.replace(c, v_mode=2 - c.v_mode), dyn) for c, dyn in grid]
    grid = [(c, dyn, False) for c, dyn in grid]
    if new > 1:  # the warp-specialized CUDA kernel (fp8kv_hopper.wgmma; prefill only); its persistent grid
        # deals the plan's schedule (from the host lengths, as plan_attention makes it), or its snake
        grid += [(dataclasses.replace(base, kernel="wgmma", wgmma_pingpong=pp, wgmma_ctas=ctas), dyn, snake)
                 for ctas, snake in ((shipped.wgmma_ctas, False), (shipped.wgmma_ctas, True), (0, False))
                 for pp in (True, False) for dyn in (True, False)]
    planned = schedule.for_step(seq_lens.tolist(), qsl.tolist(), ctas=shipped.wgmma_ctas, num_kv_heads=HKV,
                                group=HQ // HKV, num_tokens=query.shape[0], max_query_len=new,
                                max_keys=tables.shape[1] * cache.block_size, causal=True, sliding_window=None,
                                device=device)  # (as plan_attention makes it from the host lengths)
    for cfg, dyn, snake in grid:
        qs = None if dyn else torch.full((HKV,), 0.02, device=device)
        sched = planned if cfg.kernel == "wgmma" and cfg.wgmma_ctas == shipped.wgmma_ctas > 0 and not snake else None

        def run(cfg=cfg, qs=qs, sched=sched):
            paged_attention_fp8(query, cache, tables, seq_lens, qsl, new, scale, True, None, None, out,
                                q_scale=qs, prob_scale=1.0, config=cfg, schedule=sched)
        try:
            run()
            torch.cuda.synchronize()
            extra = diff(qs)
            ms = time_graph(run, calls=3, reps=args.reps)
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit
            print(f"  {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        name = (f"hopper fp8 {'dyn-q' if dyn else 'head-q'} wgmma (CUDA){' ping-pong' if cfg.wgmma_pingpong else ''}"
                f"{' a CTA per item' if cfg.wgmma_ctas == 0 else ''}{' snake deal' if snake else ''}"
                if cfg.kernel == "wgmma"
                else f"hopper fp8 {'dyn-q' if dyn else 'head-q'} m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} "
                f"s{cfg.num_stages} v{cfg.v_mode}")
        default = cfg == dataclasses.replace(shipped, kernel="wgmma" if new > 1 else "triton") and not snake
        record(name, ms, config=dataclasses.asdict(cfg), dynamic_q=dyn, default=default, **extra)
    if args.flashinfer:
        bench_flashinfer(device, cache, tables, query, qsl, seqs, args, record)


def bench_flashinfer(device, cache, tables, query, qsl, seqs: int, args, record) -> None:
    """FlashInfer's paged prefill, bf16 queries and a bf16 copy of the cache (its FA3 path)."""
    try:
        import flashinfer

        ws = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        kb = (cache.key_cache.to(torch.bfloat16) * 0.05).contiguous()
        vb = (cache.value_cache.to(torch.bfloat16) * 0.05).contiguous()
        nblk = tables.shape[1]
        indptr = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * nblk
        last = torch.full((seqs,), PAGE, dtype=torch.int32, device=device)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qsl, indptr, tables.reshape(-1).contiguous(), last, HQ, HKV, D, PAGE, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        o_fi = w.run(query, (kb, vb))
        torch.cuda.synchronize()
        ms = time_graph(lambda: w.run(query, (kb, vb)), calls=3, reps=args.reps)
        record("flashinfer bf16 (FA3 path)", ms, finite=bool(torch.isfinite(o_fi).all()))
    except Exception as exc:  # noqa: BLE001 - not installed or not built
        print("  flashinfer failed:", type(exc).__name__, str(exc)[:300], flush=True)


def sass_evidence() -> dict:
    """Tensor-core instructions in the SASS of every compiled Hopper kernel variant (cuobjdump)."""
    import collections
    import re
    import shutil
    import subprocess
    import tempfile

    from fp8kv_hopper.attention import fp8_attention_kernel

    tool = shutil.which("cuobjdump")
    found = {}
    for cache in fp8_attention_kernel.device_caches.values():
        for key, kernel in cache[0].items():
            if tool is None:
                return {"error": "cuobjdump not found"}
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
            ops = collections.Counter(re.findall(r"\b([QH]GMMA\.[0-9x]+\.F32[.A-Z0-9]*)", sass))
            found[str(key)[:160]] = dict(ops)
    return found


def table(rows: list[dict]) -> str:
    """Markdown: each shape's rows with their ratios to SDPA bf16, the Triton backend and FlashInfer."""
    lines = ["| shape | implementation | us | useful TFLOP/s | vs SDPA bf16 | vs fp8kv triton | vs FlashInfer bf16 |",
             "|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        base = {k: next((r["ms"] for r in rs if r["impl"].startswith(k)), None)
                for k in ("sdpa", "fp8kv triton", "flashinfer")}
        for r in rs:
            ratio = [f"{base[k] / r['ms']:.2f}x" if base[k] else "-" for k in ("sdpa", "fp8kv triton", "flashinfer")]
            lines.append(f"| {shape} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['useful_tflops']:.0f} | "
                         + " | ".join(ratio) + " |")
    return "\n".join(lines)


def plot(path: str) -> int:
    """A bar chart (PNG beside the JSON) of a recorded run: time per implementation and shape."""
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    with open(path) as f:
        rec = json.load(f)
    rows = rec["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if r["shape"] == shape]
        ax.barh([r["impl"] for r in rs], [r["ms"] * 1e3 for r in rs])
        ax.set_xlabel("us (lower is better)")
        ax.set_title(f"{shape}\n{rec['environment'].get('device', '')}")
        ax.invert_yaxis()
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)
    return 0


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options every prefill benchmark takes (this one and ``cuda_prefill.py``)."""
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--flashinfer", action="store_true", help="time FlashInfer bf16 (needs its JIT build)")
    ap.add_argument("--shapes", default="4x2048+2048,1x16384+0",
                    help="SEQSxNEW+CACHED,... (NEW=1: decode, e.g. 32x1+4095)")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of a recorded run (CPU)")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"4x2048+2048,1x16384+0"`` -> ``[(4, 2048, 2048), (1, 16384, 0)]`` (seqs, new, cached)."""
    out = []
    for shape in text.split(","):
        sn, cached = shape.split("+")
        seqs, new = sn.split("x")
        out.append((int(seqs), int(new), int(cached)))
    return out


def run_shapes(bench, device, args) -> list[dict]:
    """``bench(device, seqs, new, cached, args, rows)`` for every shape of ``--shapes``; the rows."""
    rows: list[dict] = []
    for seqs, new, cached in parse_shapes(args.shapes):
        bench(device, seqs, new, cached, args, rows)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--grid", choices=("full", "none"), default="full")
    ap.add_argument("--profile", action="store_true", help="only run the FP8-mode wgmma kernel, untimed (for ncu)")
    args = ap.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    device = torch.device("cuda")
    rows = run_shapes(bench_shape, device, args)
    print(table(rows), flush=True)
    env = environment(device)
    env["sass"] = sass_evidence()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
