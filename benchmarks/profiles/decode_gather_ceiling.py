"""The paged decode's memory ceiling on this GPU: kernels that only read the FP8 cache through the block
table (no attention), timed against fp8kv's decode (both modes) and a contiguous read on the same cache bytes.

For each decode shape (GQA 32/8, D=128, block 16, e4m3; the bench's cache over a random permutation of
blocks) it times, as CUDA-graph replays in one process, the kernels of ``decode_gather_ceiling.cu``
(16-byte loads, cp.async into a per-thread ring as ``attention_mma.cu`` copies, TMA page boxes) for
each KV split and warp count asked for, ``read_stream`` over the same number of bytes (contiguous),
and fp8kv's decode as planned (default mode and the FP8 attention mode, dynamic q_scale). Every
figure is given as a fraction of the FP8 roofline (K/V bytes / copy bandwidth, read + write bytes of a
copy, as the decode benchmarks count it). Needs sm90 (TMA), CuPy. Prints progress and a table; writes
JSON (and, with ``--plot``, the PNG beside it).

    python benchmarks/profiles/decode_gather_ceiling.py --out X.json [--shapes 32:4096,...]
    python benchmarks/profiles/decode_gather_ceiling.py --plot X.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import sys
import time

import torch

SOURCE = pathlib.Path(__file__).with_suffix(".cu")
SMS_CTAS = (1, 2, 4)
"""CTAs per SM each kernel is timed at (the split chosen so the grid is about that many CTAs an SM)."""


class _Fields(ctypes.Structure):
    _fields_ = [("tk", ctypes.c_uint8 * 128), ("tv", ctypes.c_uint8 * 128),
                ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("blk_stride", ctypes.c_int64), ("tok_stride", ctypes.c_int64),
                *[(n, ctypes.c_int) for n in ("bt_stride", "seq_len", "kps", "num_blocks", "head_inner")],
                ("stream_bytes", ctypes.c_int64)]


class Params(_Fields):
    """``Params`` of the .cu, field for field, padded to its 64-byte alignment."""

    _fields_ = [("pad", ctypes.c_char * (-ctypes.sizeof(_Fields) % 64))]


def kernel(entry: str, warps: int, stages: int, pages: int, index: int, hpc: int = 1, heads_fast: bool = False):
    """The compiled ``entry`` (sm_90a, through the CUDA backend's runtime)."""
    from fp8kv_cuda import runtime
    from fp8kv_cuda.variants import inline_headers

    opts = ("-std=c++17", f"-DFP8KV_NW={warps}", f"-DFP8KV_STAGES={stages}", f"-DFP8KV_PAGES={pages}",
            f"-DFP8KV_HPC={hpc}", f"-DFP8KV_HEADS_FAST={int(heads_fast)}")
    mod = runtime.module(("decode_gather_ceiling", opts), lambda: runtime.compile_source(
        inline_headers(SOURCE.read_text()), SOURCE.name, opts, "sm_90a"), (entry,), index)
    return mod.get_function(entry)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def smem(entry: str, warps: int, stages: int, pages: int) -> int:
    """Dynamic shared memory bytes of ``entry``."""
    if entry == "gather_cp":
        return stages * 16 * 32 * warps * 16
    if entry == "gather_tma":
        return stages * pages * 2 * 16 * 128 + 8 * stages
    return 0


def main(argv: list[str] | None = None) -> int:
    from fp8kv_bench.results import add_output_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(ap, "JSON to write (required unless --plot)", shapes=True)
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", action="store_true",
                    help="only gather_heads: 1, 2, 4, 8 KV heads a CTA, sequence- or head-fastest grid "
                         "(about 2 CTAs an SM), against gather_ldg and fp8kv's decode")
    args = ap.parse_args(argv)
    if args.plot:
        return plot(args.plot)
    if not args.out:
        ap.error("--out is required")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from fp8kv_bench import kernels as kb

    device = torch.device("cuda")
    bw = kb.copy_bandwidth(device)["gbps"]
    shapes = kb.decode_shapes(args.shapes)
    rows, t0 = [], time.time()
    for i, (B, L) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] B={B} L={L} ({time.time() - t0:.0f}s)", flush=True)
        bench = bench_heads if args.heads else bench_shape
        rows += bench(B, L, device, bw, [int(w) for w in args.warps.split(",")], args.reps)
    print(table(rows))
    with open(args.out, "w") as f:
        json.dump({"environment": {**kb.environment(device), "copy_gbps": bw}, "rows": rows}, f, indent=1)
    return 0


def setup(B: int, L: int, device, bw: float, reps: int):
    """The bench's decode case, the kernels' Params over it, and ``timed(what, fn, **extra)`` appending to ``rows``."""
    from fp8kv_bench import kernels as kb
    from fp8kv_cuda import tma

    cache, tables, lens, qsl, q = kb.decode_case(B, L, device)
    nbytes = kb.decode_kv_bytes(B, L)
    roof_ms = kb.roofline_ms(nbytes, bw)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    maps = tma.paged_cache_maps(cache, 16)
    assert maps is not None, "the bench's cache has a TMA description"
    kc, vc = cache.key_cache, cache.value_cache
    p = Params(k=kc.data_ptr(), v=vc.data_ptr(), bt=tables.data_ptr(), out=out.data_ptr(),
               blk_stride=kc.stride(0), tok_stride=kc.stride(1), bt_stride=tables.stride(0), seq_len=L,
               num_blocks=kc.shape[0], head_inner=maps[2], stream_bytes=nbytes)
    ctypes.memmove(p.tk, maps[0], 128)
    ctypes.memmove(p.tv, maps[1], 128)
    rows = []

    def timed(what: str, fn, **extra) -> None:
        ms = kb.time_graph(fn, reps=reps)
        rows.append({"what": what, "B": B, "L": L, "ms": ms, "frac_roofline": roof_ms / ms, **extra})
        print(f"  {what:>34}: {ms * 1e3:7.1f} us ({roof_ms / ms:.0%} roofline)", flush=True)

    return (cache, tables, lens, q), p, rows, timed


def time_decode(case, L: int, timed) -> None:
    """fp8kv's decode as planned, default and FP8 mode (dynamic q_scale)."""
    from fp8kv_bench import kernels as kb

    import fp8kv

    cache, tables, lens, q = case
    o = torch.empty_like(q)
    for mode, kw in (("default mode", {"backend": "cuda"}),
                     ("FP8 mode, dynamic q", {"backend": "hopper", "fp8_attention": True, "prob_scale": 1.0})):
        meta = fp8kv.plan_attention(cache, num_q_heads=kb.HQ, query_dtype=q.dtype, block_tables=tables,
                                    seq_lens=lens, max_seq_len=L, validate=False, **kw)
        timed(f"fp8kv decode ({kw['backend']}, {mode})", lambda meta=meta: fp8kv.paged_attention(q, cache, meta, out=o))


def bench_heads(B: int, L: int, device, bw: float, warp_list: list[int], reps: int) -> list[dict]:
    from fp8kv_bench import kernels as kb
    from fp8kv_cuda import runtime

    case, p, rows, timed = setup(B, L, device, bw, reps)
    index = runtime.device_index(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for hpc in (1, 2, 4, 8):
        groups = kb.HKV // hpc
        kps = cdiv(cdiv(L, max(1, round(2 * sms / (B * groups)))), 32) * 32
        p.kps, splits = kps, cdiv(L, kps)
        for heads_fast in (False, True):
            for w in warp_list:
                fn = kernel("gather_heads", w, 1, 1, index, hpc, heads_fast)
                grid = (groups, B, splits) if heads_fast else (B, groups, splits)
                timed(f"gather_heads w{w} h{hpc} z{splits}" + (" heads-fast" if heads_fast else ""),
                      lambda fn=fn, w=w, grid=grid: runtime.launch_struct(fn, index, grid, 32 * w, p),
                      entry="gather_heads", warps=w, hpc=hpc, heads_fast=heads_fast, splits=splits)
    time_decode(case, L, timed)
    return rows


def bench_shape(B: int, L: int, device, bw: float, warp_list: list[int], reps: int) -> list[dict]:
    from fp8kv_bench import kernels as kb
    from fp8kv_cuda import runtime

    case, p, rows, timed = setup(B, L, device, bw, reps)
    index = runtime.device_index(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    stream = kernel("read_stream", 8, 1, 1, index)
    timed("read_stream", lambda: runtime.launch_struct(stream, index, (4 * sms, 1, 1), 256, p))
    configs = [("gather_ldg", 1, 1), ("gather_cp", 2, 1), ("gather_cp", 3, 1), ("gather_tma", 4, 2),
               ("gather_tma", 8, 2), ("gather_tma", 4, 4)]
    units, seen = B * kb.HKV, set()
    for per_sm in SMS_CTAS:
        kps = cdiv(cdiv(L, max(1, round(per_sm * sms / units))), 32) * 32  # (whole 32-key steps)
        splits = cdiv(L, kps)
        if splits in seen:  # (many sequences: one split already gives several CTAs an SM)
            continue
        seen.add(splits)
        p.kps = kps
        for entry, stages, pages in configs:
            for w in warp_list:
                shm = smem(entry, w, stages, pages)
                if shm > 227 * 1024 or (per_sm > 1 and shm * per_sm > 227 * 1024):
                    continue
                fn = kernel(entry, w, stages, pages, index)
                timed(f"{entry} w{w} s{stages}" + (f" p{pages}" if entry == "gather_tma" else "") + f" z{splits}",
                      lambda fn=fn, w=w, shm=shm, s=splits: runtime.launch_struct(fn, index, (B, kb.HKV, s), 32 * w,
                                                                                   p, shm),
                      entry=entry, warps=w, stages=stages, pages=pages, splits=splits, ctas_per_sm=per_sm)
    time_decode(case, L, timed)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| B | L | kernel | time | FP8 roofline |", "|---|---|---|---|---|"]
    lines += [f"| {r['B']} | {r['L']} | {r['what']} | {r['ms'] * 1e3:.1f} us | {r['frac_roofline']:.0%} |"
              for r in rows]
    return "\n".join(lines)


def plot(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))["rows"]
    shapes = sorted({(r["B"], r["L"]) for r in rows}, key=lambda s: (s[1], s[0]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 6), squeeze=False)
    for ax, (B, L) in zip(axes[0], shapes, strict=True):
        sel = sorted((r for r in rows if (r["B"], r["L"]) == (B, L)), key=lambda r: r["frac_roofline"])
        colors = ["tab:red" if r["what"].startswith("fp8kv") else "tab:gray" if r["what"] == "read_stream"
                  else "tab:blue" for r in sel]
        ax.barh([r["what"] for r in sel], [100 * r["frac_roofline"] for r in sel], color=colors)
        ax.axvline(80, color="k", ls="--", lw=0.8)
        ax.set_title(f"B={B} L={L}")
        ax.set_xlabel("% of FP8 roofline (copy bandwidth)")
        ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    png = str(pathlib.Path(path).with_suffix(".png"))
    fig.savefig(png, dpi=110)
    print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
