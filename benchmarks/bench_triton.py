"""Benchmark the Triton backend on a CUDA GPU; record JSON; plot it.

Usage::

    python benchmarks/bench_triton.py run  --out benchmarks/results/triton_h100.json [--sweep]
    python benchmarks/bench_triton.py plot benchmarks/results/triton_h100.json   # -> .png beside it
    python benchmarks/bench_triton.py diag   # facts the design relies on, measured on this GPU

``run`` does what ``fp8kv bench --backend triton`` does (write, decode, prefill against the
same-run copy bandwidth and bf16 SDPA; see :mod:`fp8kv_bench.kernels`) and adds:

* the integer-bit codec against the native casts (``FP8KV_TRITON_CODEC=integer``) for the
  write and for decode, to show what the native path buys on this GPU;
* with ``--sweep``, the attention kernel under several launch configurations per shape
  (tile sizes, warps, pipeline stages, KV splits, the two-half P product on/off), so the
  defaults in :func:`fp8kv_triton.attention.choose_config` can be checked against the best.

``plot`` needs matplotlib (it runs anywhere, from the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import triton
import triton.language as tl


def _decode_workload(B: int, L: int, device):
    from fp8kv_bench import kernels as cb

    cache, tables, lens, qsl, q = cb.decode_case(B, L, device, writer="triton")
    return cache, tables, lens, qsl, q, 1


def _prefill_workload(device, seqs: int = 4, new: int = 2048, cached: int = 2048):
    import torch
    from fp8kv_bench import kernels as cb

    import fp8kv

    gen = torch.Generator().manual_seed(2)
    tables, nblocks = cb._paged_tables(seqs, new + cached, device, gen)
    cache = fp8kv.KVCache.allocate(nblocks, cb.PAGE, cb.HKV, cb.HEAD, kv_dtype="fp8_e4m3", k_scale=0.05,
                                   v_scale=0.05, device=device)
    cb._fill_cache(cache, cb._backend("triton", "write_kv", cache, torch.bfloat16, device), nblocks * cb.PAGE,
                   device, gen)
    q = torch.randn(seqs * new, cb.HQ, cb.HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    lens = torch.full((seqs,), new + cached, dtype=torch.int32, device=device)
    qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=device)
    return cache, tables, lens, qsl, q, new


def _time_config(work, config, decode_mode: int, reps: int) -> float:
    import torch
    from fp8kv_bench.kernels import time_graph
    from fp8kv_triton.attention import paged_attention

    cache, tables, lens, qsl, q, max_q = work
    out = torch.empty_like(q)

    def call() -> None:
        paged_attention(q, cache, tables, lens, qsl, max_q, q.shape[-1] ** -0.5, True, None, None, out,
                        decode_mode=decode_mode, interpret=False, config=config)

    return time_graph(call, calls=3 if max_q > 1 else 10, reps=reps)


def sweep(device, reps: int) -> list[dict]:
    """Time the attention kernel under several launch configurations per benchmark shape."""
    import torch
    from fp8kv_bench import kernels as cb
    from fp8kv_triton.attention import choose_config
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.plugin import _real_arch

    rows = []
    for B, L in cb.DECODE_SHAPES:
        work = _decode_workload(B, L, device)
        cache, tables = work[0], work[1]
        mode = codec_for(_real_arch(device), cache.fmt, interpret=False).decoder
        base = choose_config(device, group=cb.HQ // cb.HKV, head_size=cb.HEAD, num_seqs=B,
                             num_kv_heads=cb.HKV, max_query_len=1, max_keys=tables.shape[1] * cb.PAGE,
                             interpret=False)
        configs = [base]
        for bn in (64, 128):
            for nw in (2, 4, 8):
                for ns in (2, 3, 4):
                    configs.append(replace(base, block_n=bn, num_warps=nw, num_stages=ns))
        max_keys = tables.shape[1] * cb.PAGE
        for f in (0.5, 2.0, 4.0):
            splits = max(1, int(base.num_splits * f))
            configs.append(replace(base, keys_per_split=-(-max_keys // splits)))
        configs.append(replace(base, pv_split=False))
        for cfg in configs:
            cfg = _fix_split(cfg, max_keys)
            try:
                ms = _time_config(work, cfg, mode, reps)
            except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                ms = None
                print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            rows.append({"part": "decode", "B": B, "L": L, "config": asdict(cfg), "default": cfg == base,
                         "kernel_ms": ms})
        del work, cache, tables
        torch.cuda.empty_cache()
    work = _prefill_workload(device)
    mode = codec_for(_real_arch(device), work[0].fmt, interpret=False).decoder
    base = choose_config(device, group=cb.HQ // cb.HKV, head_size=cb.HEAD, num_seqs=4, num_kv_heads=cb.HKV,
                         max_query_len=2048, max_keys=work[1].shape[1] * cb.PAGE, interpret=False)
    configs = [base]
    for bm in (64, 128):
        for bn in (64, 128):
            for nw in (4, 8):
                for ns in (2, 3):
                    configs.append(replace(base, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns))
    configs.append(replace(base, pv_split=False))
    for cfg in configs:
        try:
            ms = _time_config(work, cfg, mode, reps)
        except Exception as exc:
            ms = None
            print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        rows.append({"part": "prefill", "config": asdict(cfg), "default": cfg is base, "kernel_ms": ms})
    return rows


def _fix_split(cfg, max_keys: int):
    """Recompute the split count for ``cfg.keys_per_split`` rounded to its block_n."""
    kps = -(-cfg.keys_per_split // cfg.block_n) * cfg.block_n
    return replace(cfg, keys_per_split=kps, num_splits=-(-max_keys // kps))


def run(args: argparse.Namespace) -> int:
    import torch
    from fp8kv_bench import kernels as cb

    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    record = cb.run_all("triton", "fp8_e4m3", device, ["write", "decode", "prefill"], args.reps)
    env = record["env"]
    print(f"{env['device']} sm{''.join(map(str, env['capability']))} torch {env['torch']} "
          f"triton {env['triton']} copy {record['copy_gbps']:.0f} GB/s")
    print(cb.format_table(record["results"]))
    # the integer-bit codec on the same GPU, for comparison with the native casts
    os.environ["FP8KV_TRITON_CODEC"] = "integer"
    integer = [cb.bench_write("triton", "fp8_e4m3", device, record["copy_gbps"], args.reps, "tensor"),
               cb.bench_decode("triton", "fp8_e4m3", device, record["copy_gbps"], args.reps, 32, 4096)]
    os.environ.pop("FP8KV_TRITON_CODEC")
    for r in integer:
        r["codec"] = "integer"
    record["integer_codec"] = integer
    print("integer-bit codec:")
    print(cb.format_table(integer))
    if args.sweep:
        record["sweep"] = sweep(device, args.reps)
        for part in ("decode", "prefill"):
            rows = [r for r in record["sweep"] if r["part"] == part and r["kernel_ms"] is not None]
            keys = sorted({(r.get("B"), r.get("L")) for r in rows})
            for key in keys:
                sel = [r for r in rows if (r.get("B"), r.get("L")) == key]
                best = min(sel, key=lambda r: r["kernel_ms"])
                default = next((r for r in sel if r["default"]), None)
                print(f"sweep {part} {key}: default {default and default['kernel_ms'] * 1e3:.1f} us, "
                      f"best {best['kernel_ms'] * 1e3:.1f} us with {best['config']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


def plot(args: argparse.Namespace) -> int:
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    with open(args.json) as f:
        record = json.load(f)
    env = record["env"]
    dec = [r for r in record["results"] if r["part"] == "decode"]
    pre = [r for r in record["results"] if r["part"] == "prefill"]
    wr = [r for r in record["results"] if r["part"] == "write"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 1, 1.3]})
    ax = axes[0]
    labels = [f"B={r['B']}\nL={r['L']}" for r in dec]
    x = range(len(dec))
    w = 0.27
    ax.bar([i - w for i in x], [r["sdpa_bf16_ms"] * 1e3 for r in dec], w, label="SDPA bf16 (contiguous K/V)")
    ax.bar(list(x), [r["kernel_ms"] * 1e3 for r in dec], w, label="fp8kv triton, FP8 paged")
    ax.bar([i + w for i in x], [r["fp8_roofline_ms"] * 1e3 for r in dec], w,
           label="FP8 roofline (bytes / copy BW)")
    for i, r in enumerate(dec):
        ax.text(i, r["kernel_ms"] * 1e3, f"{r['speedup_vs_sdpa']:.2f}x\n{100 * r['frac_roofline']:.0f}%",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("microseconds")
    ax.set_title("decode, Hq=32 Hkv=8 D=128, block 16 (label: x vs bf16, % of roofline)")
    ax.legend(fontsize=8)
    ax = axes[1]
    if pre:
        r = pre[0]
        ax.bar(["SDPA bf16", "fp8kv triton"], [r["sdpa_bf16_ms"], r["kernel_ms"]], color=["C0", "C1"])
        ax.set_ylabel("milliseconds")
        ax.set_title(f"prefill {r['seqs']}x{r['new']} over {r['cached']}\n"
                     f"{r['speedup_vs_sdpa']:.2f}x vs bf16")
    ax = axes[2]
    ax.bar(["copy"] + [f"write\n{r['granularity']}" for r in wr],
           [record["copy_gbps"]] + [r["gbps"] for r in wr], color=["grey"] + ["C1"] * len(wr))
    for i, r in enumerate(wr):
        ax.text(i + 1, r["gbps"], f"{100 * r['frac_copy']:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB/s (read + write)")
    ax.set_title("cache write 16k tok x 8 x 128, bf16 in")
    fig.suptitle(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}")
    fig.tight_layout()
    out = os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


@triton.jit
def _div_kernel(a_ptr, b_ptr, o1, o2, n, BLOCK: tl.constexpr):
    """``a / b`` (Triton's division) and ``div_rn(a, b)`` (IEEE), for :func:`diag`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m)
    b = tl.load(b_ptr + offs, mask=m)
    tl.store(o1 + offs, a / b, mask=m)
    tl.store(o2 + offs, tl.math.div_rn(a, b), mask=m)


def _diag_write_mismatch(dev) -> None:
    """Print every byte where the triton write differs from the CPU reference (bf16 inputs)."""
    import importlib.util
    import sys

    import torch

    import fp8kv

    spec = importlib.util.spec_from_file_location("tg", os.path.join(os.path.dirname(__file__), "..", "tests",
                                                                      "test_triton_gpu.py"))
    tg = importlib.util.module_from_spec(spec)
    sys.modules["tg"] = tg
    spec.loader.exec_module(tg)
    for dtype in (torch.bfloat16, torch.float32):
        key, value, slots = tg._write_inputs(512, 4, 128, dtype, seed=123)
        kw = dict(kv_dtype="fp8_e4m3", k_scale=0.0123, v_scale=3.7)
        ref = fp8kv.KVCache.allocate(64, 16, 4, 128, **kw)
        gpu = fp8kv.KVCache.allocate(64, 16, 4, 128, device=dev, **kw)
        fp8kv.write_kv(ref, key, value, slots, backend="reference")
        fp8kv.write_kv(gpu, key.to(dev), value.to(dev), slots.to(dev), backend="triton")
        a = ref.key_cache.view(torch.uint8)
        b = gpu.key_cache.view(torch.uint8).cpu()
        for idx in (a != b).nonzero()[:5].tolist():
            slot = idx[0] * 16 + idx[1]
            t = int((slots == slot).nonzero()[0])
            x = key[t, idx[2], idx[3]]
            xb = int(x.view(torch.int16)) & 0xFFFF if dtype == torch.bfloat16 else int(x.view(torch.int32))
            print(f"  write mismatch {dtype}: token {t} head {idx[2]} dim {idx[3]}: x={x.item()!r} "
                  f"bits=0x{xb:x} cpu=0x{int(a[tuple(idx)]):02x} gpu=0x{int(b[tuple(idx)]):02x}")
        print(f"  write {dtype}: {int((a != b).sum())} key bytes differ")


def diag(args: argparse.Namespace) -> int:
    """Facts the design relies on, measured on this GPU (printed, not asserted)."""
    import torch

    import fp8kv
    from fp8kv.scales import token_head_scale

    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1 << 16, 8, 128, generator=g) * torch.logspace(-3, 3, 1 << 16)[:, None, None]).bfloat16()
    fmt = fp8kv.get_format("fp8_e4m3")
    cpu = token_head_scale(x, fmt)
    gpu = token_head_scale(x.to(dev), fmt).cpu()
    ndiff = int((cpu.view(torch.int32) != gpu.view(torch.int32)).sum())
    print(f"reference token_head_scale on CUDA vs CPU: {ndiff} of {cpu.numel()} scales differ "
          "(torch divides by a Python scalar on CUDA as a * (1/b))")
    for gran in ("tensor", "token_head"):
        kw = {} if gran == "token_head" else {"k_scale": 0.37, "v_scale": 0.37}
        n = x.shape[0]
        a = fp8kv.KVCache.allocate(n // 16, 16, 8, 128, scale_granularity=gran, **kw)
        b = fp8kv.KVCache.allocate(n // 16, 16, 8, 128, scale_granularity=gran, device=dev, **kw)
        slots = torch.arange(n)
        fp8kv.write_kv(a, x, x, slots, backend="reference")
        fp8kv.write_kv(b, x.to(dev), x.to(dev), slots.to(dev), backend="reference")
        diff = int((a.key_cache.view(torch.uint8) != b.key_cache.view(torch.uint8).cpu()).sum())
        print(f"reference write_kv ({gran}) on CUDA vs CPU: {diff} key bytes differ")

    _diag_write_mismatch(dev)
    n = 1 << 24
    a = torch.randn(n, generator=g) * 100
    b = torch.rand(n, generator=g) * 10 + 1e-3
    ag, bg = a.to(dev), b.to(dev)
    o1, o2 = torch.empty_like(ag), torch.empty_like(ag)
    _div_kernel[(triton.cdiv(n, 1024),)](ag, bg, o1, o2, n, BLOCK=1024)
    exact = (a.double() / b.double()).float()
    print(f"triton '/' vs IEEE division: {int((o1.cpu() != exact).sum())} of {n} differ; "
          f"tl.math.div_rn: {int((o2.cpu() != exact).sum())} differ")
    return 0


def profile(args: argparse.Namespace) -> int:
    """Run the default attention kernel once per shape after a warm-up: for ``ncu -k regex:_attn_kernel
    --launch-skip 1 --launch-count 1``."""
    import torch
    from fp8kv_triton.attention import paged_attention
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.plugin import _real_arch

    device = torch.device("cuda", torch.cuda.current_device())
    work = _decode_workload(32, 4096, device) if args.shape == "decode" else _prefill_workload(device)
    cache, tables, lens, qsl, q, max_q = work
    mode = codec_for(_real_arch(device), cache.fmt, interpret=False).decoder
    out = torch.empty_like(q)
    for _ in range(2):
        paged_attention(q, cache, tables, lens, qsl, max_q, q.shape[-1] ** -0.5, True, None, None, out,
                        decode_mode=mode, interpret=False)
    torch.cuda.synchronize()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default=None)
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--sweep", action="store_true")
    pl = sub.add_parser("plot")
    pl.add_argument("json")
    sub.add_parser("diag")
    pr = sub.add_parser("profile")
    pr.add_argument("shape", choices=("decode", "prefill"))
    args = p.parse_args(argv)
    return {"run": run, "plot": plot, "diag": diag, "profile": profile}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
