"""Paged decode on a CUDA GPU: fp8kv's decode kernels against SDPA bf16, FlashInfer's FP8 decode and the roofline.

For each decode shape (``--shapes``; default B=32 L=4096, B=8 L=32768, B=64 L=2048, B=1 L=131072;
GQA 32/8, head size 128, block 16, e4m3 per-tensor cache over a random permutation of blocks, bf16
queries) it times, as CUDA-graph replays in one process on the same cache bytes:

* ``selected``: the backend the registry picks (``--backend``, default ``auto``) through its hook with a
  metadata planned once, and the public call ``fp8kv.paged_attention(q, cache, metadata)`` launched
  eagerly (``API us``, host cost included);
* each decode kernel that can run here: ``triton`` (the Triton backend as shipped), ``cuda_mma`` (the
  CUDA backend's tensor-core kernel, its planned split; more with ``--splits``/``--warps``/``--stages``/
  ``--nsub``), ``cuda_cores`` (its CUDA-core kernel) and, on sm90, the FP8 attention mode
  (``fp8_attention=True``: e4m3 query and probabilities, dynamic ``q_scale``) on the CUDA backend's
  tensor-core decode (``fp8_mode_cuda``, the default) and on the Hopper backend's Triton kernel
  (``fp8_mode_triton``);
* ``sdpa_bf16``: ``scaled_dot_product_attention`` on contiguous bf16 K/V (``enable_gqa``), and
  ``flashinfer_fp8_tc``: FlashInfer's FP8 tensor-core decode on the same cache bytes, where importable.

Every output is compared with Triton's first (the FP8 mode's with the Hopper Triton kernel's): max abs
difference below 1e-2 for outputs of order 1 (a guard; the tests apply the derived tolerance). The FP8
roofline is the K/V bytes over the same run's copy bandwidth. Ends with a table and a plot (fraction
of the roofline per kernel and shape).

    python benchmarks/decode.py                   # -> benchmarks/results/decode_<device>.json
    python benchmarks/decode.py --profile fp8_dynamic_q --shapes 64:2048   # three untimed calls, for ncu
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from . import kernels as kb
from .results import log, markdown, progress, record, title

NAME = "decode"
PROFILE_MODES = ("default", "fp8_dynamic_q", "fp8_head_q")


def add_arguments(p) -> None:
    p.add_argument("--backend", default="auto", help="backend of the 'selected' row: a name or 'auto' (default)")
    p.add_argument("--kv-dtype", default="fp8_e4m3", help="storage format (default fp8_e4m3)")
    p.add_argument("--granularity", default="tensor", choices=("tensor", "head", "token_head"))
    p.add_argument("--qdtype", default="bfloat16", choices=("bfloat16", "float16"), help="query dtype")
    p.add_argument("--shapes", default="", help="B:L,B:L,... (default: the four above)")
    p.add_argument("--reps", type=int, default=15, help="timed repeats per measurement (median)")
    p.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out")
    p.add_argument("--no-fp8-attention", action="store_true", help="leave the FP8 attention mode out")
    p.add_argument("--splits", default="", help="extra KV splits of the tensor-core kernel to time: 1,2,4")
    p.add_argument("--warps", default="", help="extra warps per CTA of the tensor-core kernel: 4,6,8")
    p.add_argument("--stages", default="", help="extra ring depths of the tensor-core kernel: 2,3,4")
    p.add_argument("--nsub", default="", help="16-key sub-tiles a warp step of the tensor-core kernel: 1,2")
    p.add_argument("--profile", choices=PROFILE_MODES, default=None,
                   help="only run the tensor-core decode in this mode three times, untimed, at the first shape "
                        "(for ncu --launch-skip 1 --launch-count 1: benchmarks/profiles/decode_ncu.sh)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _cuda_attention():
    """The CUDA backend's launcher, or None where it cannot run (no CuPy or NVRTC)."""
    try:
        from fp8kv_cuda import attention
    except ImportError:
        return None
    return attention


def _variant_plans(CA, device, B: int, max_keys: int, token: bool, args) -> dict:
    plans = {}
    for n, w, st, ns in itertools.product(_ints(args.splits) or [None], _ints(args.warps) or [None],
                                          _ints(args.stages) or [None], _ints(args.nsub) or [None]):
        if n is None and w is None and st is None and ns is None:
            continue
        p = CA.plan_mma(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV, head_size=kb.HEAD,
                        max_keys=max_keys, num_splits=n, warps=w, token_scales=token, stages=st, nsub=ns)
        plans[f"cuda_mma_splits{p.num_splits}_warps{p.warps}" + (f"_stages{st}" if st else "")
              + (f"_nsub{ns}" if ns else "")] = p
    return plans


def _timed(name: str, fn, ref: torch.Tensor, out: torch.Tensor, reps: int, key: str = "max_abs_diff_vs_triton",
           **kw) -> dict:
    """Run ``fn`` once (writing ``out``), compare with ``ref``, time it if it agrees."""
    fn()
    torch.cuda.synchronize()
    diff = (out.float() - ref.float()).abs().max().item()
    return {"what": name, **kw, key: diff, "ms": kb.time_graph(fn, reps=reps) if diff < 1e-2 else None}


def bench_shape(B: int, L: int, device, bw: float, args) -> list[dict]:
    import fp8kv

    qdtype = getattr(torch, args.qdtype)
    token = args.granularity == "token_head"
    cache, tables, lens, qsl, q = kb.decode_case(B, L, device, kv_dtype=args.kv_dtype, granularity=args.granularity)
    q = q.to(qdtype)
    scale = kb.HEAD ** -0.5
    max_keys = tables.shape[1] * kb.PAGE
    roof_ms = kb.roofline_ms(kb.decode_kv_bytes(B, L), bw)
    plan = dict(num_q_heads=kb.HQ, query_dtype=qdtype, block_tables=tables, seq_lens=lens, max_seq_len=L,
                validate=False)
    ref = torch.empty_like(q)
    triton_meta = fp8kv.plan_attention(cache, **plan, backend="triton")
    triton_run = lambda: triton_meta.attention.backend.paged_attention(q, cache, triton_meta, ref, None)  # noqa: E731
    triton_run()
    rows = [{"what": "triton", "ms": kb.time_graph(triton_run, reps=args.reps)}]
    # the selected backend, through its hook and through the public call
    meta = fp8kv.plan_attention(cache, **plan, backend=args.backend)
    sel, out = meta.attention.backend, torch.empty_like(q)
    row = _timed("selected", lambda: sel.paged_attention(q, cache, meta, out, None), ref, out, args.reps,
                 backend=sel.name)
    if row["ms"]:
        row["api_ms"] = kb.time_eager(lambda: fp8kv.paged_attention(q, cache, meta, out=out), reps=args.reps)
    rows.append(row)
    CA = _cuda_attention()
    if CA is not None:
        plans = {"cuda_mma": CA.plan(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV,
                                     head_size=kb.HEAD, max_keys=max_keys, query_dtype=qdtype, token_scales=token,
                                     fmt=args.kv_dtype),
                 "cuda_cores": CA.plan(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV,
                                       head_size=kb.HEAD, max_keys=max_keys, token_scales=token),
                 **_variant_plans(CA, device, B, max_keys, token, args)}
        for name, p in plans.items():
            o = torch.empty_like(q)
            fn = lambda p=p, o=o: CA.paged_attention(q, cache, tables, lens, qsl, scale, True, None, None, o,  # noqa: E731
                                                     None, plan_=p)
            rows.append(_timed(name, fn, ref, o, args.reps, num_splits=p.num_splits,
                               warps=p.warps if p.mma else None))
    fp8_mode = (not args.no_fp8_attention and args.kv_dtype == "fp8_e4m3" and not token
                and torch.cuda.get_device_capability(device) == (9, 0))
    if fp8_mode:
        rows += fp8_mode_rows(q, cache, tables, lens, qsl, scale, args.reps)
    kv4 = torch.randn(2, B, kb.HKV, L, kb.HEAD, device=device, dtype=qdtype)
    q4 = q.view(B, kb.HQ, 1, kb.HEAD)
    sdpa = kb.time_graph(lambda: kb._sdpa(q4, kv4[0], kv4[1], enable_gqa=True), reps=args.reps)
    rows.append({"what": "sdpa_bf16", "ms": sdpa})
    if not args.no_flashinfer and qdtype == torch.bfloat16 and args.granularity == "tensor":
        fi = kb.flashinfer_decode(cache, tables, L, q)
        if fi is not None:
            rows.append(_timed("flashinfer_fp8_tc", fi[0], ref, fi[1], args.reps))
    fi_ms = next((r["ms"] for r in rows if r["what"] == "flashinfer_fp8_tc"), None)
    for r in rows:
        r.update(B=B, L=L, kv_dtype=args.kv_dtype, qdtype=args.qdtype, granularity=args.granularity,
                 roofline_ms=roof_ms)
        if r.get("ms"):
            r["frac_roofline"] = roof_ms / r["ms"]
            r["speedup_vs_sdpa"] = sdpa / r["ms"]
            if fi_ms:
                r["speedup_vs_flashinfer"] = fi_ms / r["ms"]
        got = f"{r['ms'] * 1e3:.1f} us ({r['frac_roofline']:.0%} of the roofline)" if r.get("ms") else \
            f"skipped: max abs diff {r.get('max_abs_diff_vs_triton', r.get('max_abs_diff_vs_fp8_triton'))}"
        log(f"  B={B} L={L} {r['what']:>22}: {got}")
    return rows


def _fp8_runs(q, cache, tables, lens, qsl, scale):
    """The FP8 attention mode's decode through the Hopper backend's launcher: ``{kernel: (run(out), ...)}``."""
    from fp8kv_hopper import attention as HA

    cfg = HA.choose_config(group=kb.HQ // kb.HKV, num_seqs=q.shape[0], num_kv_heads=kb.HKV, max_query_len=1,
                           max_keys=tables.shape[1] * kb.PAGE,
                           num_sms=torch.cuda.get_device_properties(q.device).multi_processor_count)

    def runner(kernel: str, q_scale):
        c = dataclasses.replace(cfg, kernel=kernel)
        return lambda o: HA.paged_attention_fp8(q, cache, tables, lens, qsl, 1, scale, True, None, None, o,
                                                q_scale=q_scale, prob_scale=1.0, config=c)

    return runner


def fp8_mode_rows(q, cache, tables, lens, qsl, scale, reps: int) -> list[dict]:
    """The FP8 attention mode's decode on the Hopper backend's Triton kernel and the CUDA tensor-core decode."""
    runner = _fp8_runs(q, cache, tables, lens, qsl, scale)
    ref = torch.empty_like(q)
    runner("triton", None)(ref)
    rows = []
    for kernel in ("triton", "cuda"):
        o, run = torch.empty_like(q), runner(kernel, None)
        fn = lambda run=run, o=o: run(o)  # noqa: E731
        rows.append(_timed(f"fp8_mode_{kernel}", fn, ref, o, reps, key="max_abs_diff_vs_fp8_triton"))
    return rows


def profile(args, device):
    """The tensor-core decode in one mode at the first shape, as a call (for ncu)."""
    B, L = kb.decode_shapes(args.shapes)[0]
    cache, tables, lens, qsl, q = kb.decode_case(B, L, device, granularity=args.granularity)
    scale, out = kb.HEAD ** -0.5, torch.empty_like(q)
    if args.profile == "default":
        CA = _cuda_attention()
        p = CA.plan(device, num_tokens=B, num_kv_heads=kb.HKV, group=kb.HQ // kb.HKV, head_size=kb.HEAD,
                    max_keys=tables.shape[1] * kb.PAGE, query_dtype=q.dtype, fmt=cache.kv_dtype)
        run = lambda: CA.paged_attention(q, cache, tables, lens, qsl, scale, True, None, None, out, None,  # noqa: E731
                                         plan_=p)
    else:
        q_scale = None if args.profile == "fp8_dynamic_q" else torch.full((kb.HKV,), 0.02, device=device)
        fn = _fp8_runs(q, cache, tables, lens, qsl, scale)("cuda", q_scale)
        run = lambda: fn(out)  # noqa: E731
    return run


def run(args) -> dict | None:
    device = kb.cuda_device("the decode benchmark")
    if args.profile:
        return kb.untimed(profile(args, device))
    bw = kb.copy_bandwidth(device)["gbps"]
    shapes = kb.decode_shapes(args.shapes)
    log(f"{torch.cuda.get_device_name(device)}: copy {bw:.0f} GB/s; {len(shapes)} shapes")
    rows = []
    for B, L in progress(shapes, "decode"):
        rows += bench_shape(B, L, device, bw, args)
        torch.cuda.empty_cache()
    from fp8kv import settings

    return record(NAME, device, copy_gbps=bw, FP8KV_CUDA_ARCH=settings.cuda_arch() or None, rows=rows)


def table(rec: dict) -> str:
    out = []
    for r in rec["rows"]:
        if not r.get("ms"):
            continue
        fi = f"{r['speedup_vs_flashinfer']:.2f}x" if "speedup_vs_flashinfer" in r else "-"
        what = r["what"] + (f" ({r['backend']})" if r.get("backend") else "")
        api = f"{r['api_ms'] * 1e3:.1f}" if r.get("api_ms") else "-"
        out.append([r["B"], r["L"], what, r.get("num_splits", "-") if r.get("num_splits") is not None else "-",
                    f"{r['ms'] * 1e3:.1f}", api, f"{r['frac_roofline']:.0%}", f"{r['speedup_vs_sdpa']:.2f}x", fi])
    return f"{title(rec)}\n" + markdown(["B", "L", "kernel", "splits", "us", "API us", "of FP8 roofline",
                                         "vs SDPA bf16", "vs FlashInfer FP8"], out)


def plot(rec: dict, plt):
    rows = [r for r in rec["rows"] if r.get("ms") and "_splits" not in r["what"]]
    shapes = list(dict.fromkeys((r["B"], r["L"]) for r in rows))
    kinds = list(dict.fromkeys(r["what"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        ys = [next((r["frac_roofline"] for r in rows if (r["B"], r["L"]) == s and r["what"] == kind), 0)
              for s in shapes]
        ax.bar([i + k * width for i in range(len(shapes))], ys, width, label=kind)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], [f"B={b} L={n}" for b, n in shapes])
    ax.set_ylabel("fraction of the FP8 roofline (K/V bytes / copy bandwidth)")
    ax.set_title(f"paged decode, GQA 32/8, D=128, block 16, e4m3, bf16 queries\n{title(rec)}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
