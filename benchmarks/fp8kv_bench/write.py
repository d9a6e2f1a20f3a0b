"""Cache write on a CUDA GPU: bf16 K/V quantized and scattered into an FP8 cache, against the copy bandwidth.

For each scale granularity (per-tensor and per-token-head by default) it writes ``--tokens`` (16k)
tokens x 8 KV heads x 128 (bf16 in, random slots) into an e4m3 cache and times:

* the backend the registry picks (``--backend``, default ``auto``): its write hook as CUDA-graph
  replays (``us``), and the public per-layer call ``fp8kv.write_kv(cache, k, v, metadata)`` launched
  eagerly (``API us``: host cost included; the metadata planned once, without value checks);
* with ``--rows``/``--warps``, the Triton write kernel at each launch (rows per program x warps), its
  bytes checked equal to the backend's before it is timed.

GB/s counts bytes read plus written (bf16 K/V in, FP8 codes out, int64 slots, float32 scales where
per-token-head), against the same run's copy bandwidth (the faster of a memcpy and an elementwise copy
of 1 GiB). Ends with a table and a bar chart of the fraction of the copy bandwidth.

    python benchmarks/write.py                              # -> benchmarks/results/write_<device>.json
    python benchmarks/write.py --rows 8,16 --warps 2,4      # and the Triton kernel's launches
"""

from __future__ import annotations

import itertools

import torch

from . import kernels as kb
from .results import log, markdown, progress, record, title

NAME = "write"


def add_arguments(p) -> None:
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--kv-dtype", default="fp8_e4m3", help="storage format (default fp8_e4m3)")
    p.add_argument("--granularities", default="tensor,token_head", help="scale granularities (default %(default)s)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens written per call (default 16384)")
    p.add_argument("--rows", default="", help="Triton launches: rows per program to try, e.g. 8,16")
    p.add_argument("--warps", default="", help="Triton launches: warps per program to try, e.g. 2,4")
    p.add_argument("--reps", type=int, default=20, help="timed repeats per measurement (median)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _nbytes(T: int, granularity: str) -> int:
    """Bytes a write moves: bf16 K and V read, FP8 codes written, int64 slots, float32 per-token-head scales."""
    n = 2 * T * kb.HKV * kb.HEAD * (2 + 1) + T * 8
    return n + (2 * T * kb.HKV * 4 if granularity == "token_head" else 0)


def _snapshot(cache) -> list[torch.Tensor]:
    return [t.clone() for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)]


def _same(cache, ref: list[torch.Tensor]) -> bool:
    now = (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)
    return all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(now, ref, strict=True))


def bench_granularity(args, device, bw: float, gran: str) -> list[dict]:
    """The rows of one scale granularity: the selected backend, then each Triton launch asked for."""
    import fp8kv

    T = args.tokens
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(T, kb.HKV, kb.HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    v = torch.randn(T, kb.HKV, kb.HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    slots = torch.randperm(T, generator=gen).to(device)
    scales = {} if gran == "token_head" else {"k_scale": 0.05, "v_scale": 0.05}
    cache = fp8kv.KVCache.allocate(T // kb.PAGE, kb.PAGE, kb.HKV, kb.HEAD, kv_dtype=args.kv_dtype,
                                   scale_granularity=gran, device=device, **scales)
    # one sequence over every block, T new tokens: a step whose metadata carries the slots
    meta = fp8kv.plan_attention(cache, num_q_heads=kb.HQ, query_dtype=torch.bfloat16,
                                block_tables=torch.arange(T // kb.PAGE, dtype=torch.int32, device=device)[None],
                                seq_lens=torch.tensor([T], dtype=torch.int32, device=device),
                                query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=device),
                                slot_mapping=slots, num_tokens=T, max_query_len=T, max_seq_len=T, validate=False,
                                backend=args.backend)
    backend = meta.write.backend
    backend.write_kv(cache, k, v, slots)
    torch.cuda.synchronize()
    ref = _snapshot(cache)
    nbytes = _nbytes(T, gran)

    def row(ms: float, **kw) -> dict:
        gbps = nbytes / (ms * 1e-3) / 1e9
        return {"granularity": gran, "tokens": T, "bytes": nbytes, **kw, "ms": ms, "gbps": gbps, "frac_copy": gbps / bw}

    ms = kb.time_graph(lambda: backend.write_kv(cache, k, v, slots), reps=args.reps)
    api = kb.time_eager(lambda: fp8kv.write_kv(cache, k, v, meta), reps=args.reps)
    rows = [row(ms, backend=backend.name, launch="selected", api_ms=api)]
    launches = list(itertools.product(_ints(args.rows), _ints(args.warps)))
    if launches:
        from fp8kv_triton.capabilities import codec_for
        from fp8kv_triton.kernels import device_arch
        from fp8kv_triton.write import write_kv

        arch = device_arch(device)
        enc = codec_for(arch, cache.fmt, interpret=False).encoder
    for block_rows, warps in launches:
        for t in (cache.key_cache, cache.value_cache):
            t.view(torch.uint8).zero_()

        def call(block_rows=block_rows, warps=warps):
            write_kv(cache, k, v, slots, encoder=enc, block_rows=block_rows, num_warps=warps, arch=arch)

        call()
        torch.cuda.synchronize()
        same = _same(cache, ref)
        kw = {"backend": "triton", "launch": f"{block_rows}x{warps}", "block_rows": block_rows, "num_warps": warps,
              "bit_exact": same}
        rows.append(row(kb.time_graph(call, reps=args.reps), **kw) if same else {"granularity": gran, **kw, "ms": None})
    for r in rows:
        got = (f"{r['ms'] * 1e3:.1f} us, {r['gbps']:.0f} GB/s, {r['frac_copy']:.1%} of copy" if r["ms"]
               else "bytes differ")
        log(f"  {gran} {r['backend']} {r['launch']}: {got}")
    return rows


def run(args) -> dict:
    device = kb.cuda_device("the write benchmark")
    copy = kb.copy_bandwidth(device)
    log(f"{torch.cuda.get_device_name(device)}: copy {copy['gbps']:.0f} GB/s")
    rows = []
    for gran in progress(args.granularities.split(","), "write"):
        rows += bench_granularity(args, device, copy["gbps"], gran)
        torch.cuda.empty_cache()
    return record(NAME, device, copy_gbps=copy["gbps"], copy=copy, kv_dtype=args.kv_dtype, rows=rows)


def _label(r: dict) -> str:
    """``selected`` or the launch ``ROWSxWARPS`` of a row (saved rows of the tuning grid carry only the launch)."""
    return r.get("launch") or f"{r['block_rows']}x{r['num_warps']}"


def table(rec: dict) -> str:
    rows = []
    for r in rec["rows"]:
        if not r.get("ms"):
            rows.append([r["granularity"], r.get("backend", "triton"), _label(r), "bytes differ", "-", "-", "-"])
            continue
        api = f"{r['api_ms'] * 1e3:.1f}" if r.get("api_ms") else "-"
        rows.append([r["granularity"], r.get("backend", "triton"), _label(r), f"{r['ms'] * 1e3:.1f}", api,
                     f"{r['gbps']:.0f}", f"{r['frac_copy']:.1%}"])
    head = f"copy bandwidth {rec['copy_gbps']:.0f} GB/s (read + write); {title(rec)}\n"
    return head + markdown(["granularity", "backend", "launch (rows x warps)", "us", "API us", "GB/s", "of copy"],
                           rows)


def plot(rec: dict, plt):
    grans = list(dict.fromkeys(r["granularity"] for r in rec["rows"]))
    fig, axes = plt.subplots(1, len(grans), figsize=(4.5 * len(grans), 3.8), squeeze=False, sharey=True)
    for ax, gran in zip(axes[0], grans, strict=True):
        rows = [r for r in rec["rows"] if r["granularity"] == gran]
        ax.bar(range(len(rows)), [100 * (r.get("frac_copy") or 0) for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            if r.get("ms"):
                ax.text(i, 100 * r["frac_copy"], f"{r['ms'] * 1e3:.1f} us", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=8)
        ax.axhline(100, color="gray", lw=0.8, ls="--")
        ax.set_title(gran, fontsize=9)
        ax.set_xlabel("launch (rows per program x warps)")
    axes[0][0].set_ylabel("% of copy bandwidth")
    tokens = rec["rows"][0].get("tokens", 16384)
    fig.suptitle(f"fp8kv cache write, {tokens // 1024}k tokens x 8 x 128, bf16 -> {rec.get('kv_dtype', 'fp8_e4m3')} "
                 f"(copy {rec['copy_gbps']:.0f} GB/s)\n{title(rec)}", fontsize=9)
    fig.tight_layout()
    return fig
