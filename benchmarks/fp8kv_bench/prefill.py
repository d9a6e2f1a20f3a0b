"""Chunked and long causal prefill on a CUDA GPU, both modes, against SDPA bf16 and FlashInfer bf16.

Shapes (``--shapes``, ``SEQSxNEW+CACHED``): 4 sequences x 2048 new tokens over 2048 cached, and
1 x 16384 causal; GQA 32/8, head size 128, block 16, e4m3 cache with per-KV-head scales, bf16 queries.
Timed as CUDA-graph replays in one process on the same cache bytes:

* ``sdpa bf16``: ``scaled_dot_product_attention``, causal with the bottom-right alignment of chunked
  prefill, on contiguous bf16 K/V (flash path);
* the default mode (bf16 arithmetic over the FP8 cache): ``fp8kv <backend> (selected)``, the backend the
  registry picks (``--backend``, default ``auto``) through its hook; ``fp8kv triton``; the CUDA backend's
  tensor-core prefill (``mma.sync``) and, on sm90, its warp-specialized wgmma kernel with and without
  ping-pong (compared with Triton's output first, in units of ``max |v|``);
* the FP8 attention mode (``fp8_attention=True``, sm90: e4m3 query and probabilities, both products on
  FP8 tensor cores) through the Hopper backend: its CUDA wgmma kernel (persistent, the plan's balanced
  schedule; dynamic and per-head ``q_scale``; also ping-pong, its snake deal and a CTA per item) and its
  Triton kernel (``--grid full``: more tiles). Each is first checked against a dense float64 evaluation
  of the mode's definition (query quantized with its scale, P rounded to e4m3 against the integer row
  maximum of the base-2 logits), the largest difference in units of ``max |v|``;
* ``flashinfer bf16 (FA3 path)``: FlashInfer's paged prefill over a bf16 copy of the cache, where
  importable.

Useful FLOPs count the visible (query, key) pairs only: ``4 * D`` per pair and query head. Ends with a
table (ratios to SDPA, Triton and FlashInfer) and a bar chart per shape.

    python benchmarks/prefill.py                            # -> benchmarks/results/prefill_<device>.json
    python benchmarks/prefill.py --profile fp8 --shapes 4x2048+2048    # three untimed calls, for ncu
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from . import kernels as kb
from .results import log, markdown, progress, record, title

NAME = "prefill"
HQ, HKV, D, PAGE = kb.HQ, kb.HKV, kb.HEAD, kb.PAGE


def add_arguments(p) -> None:
    p.add_argument("--backend", default="auto", help="backend of the default mode's 'selected' row (default auto)")
    p.add_argument("--shapes", default="4x2048+2048,1x16384+0", help="SEQSxNEW+CACHED,... (default %(default)s)")
    p.add_argument("--modes", default="default,fp8_attention", help="default, fp8_attention or both (default)")
    p.add_argument("--reps", type=int, default=20, help="timed repeats per measurement (median)")
    p.add_argument("--grid", choices=("none", "full"), default="none",
                   help="FP8 mode's Triton kernel: the shipped tiles (none) or more (full)")
    p.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out")
    p.add_argument("--qdtype", choices=("bfloat16", "float16"), default="bfloat16",
                   help="query dtype of the default mode's kernels (SDPA stays bf16; FlashInfer only with bfloat16)")
    p.add_argument("--splits", default="", help="also time the CUDA backend's prefill at these forced KV split "
                   "counts, e.g. 1,2,8")
    p.add_argument("--per-token", action="store_true", help="also time the CUDA backend's per-token path (slow)")
    p.add_argument("--profile", choices=("default", "fp8"), default=None,
                   help="only run the CUDA default-mode kernel or the FP8-mode wgmma kernel three times, untimed, "
                        "at the first shape (for ncu --launch-skip 1: benchmarks/profiles/wgmma_ncu.sh)")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"4x2048+2048,1x16384+0"`` -> ``[(4, 2048, 2048), (1, 16384, 0)]`` (seqs, new, cached)."""
    out = []
    for shape in text.split(","):
        sn, cached = shape.split("+")
        seqs, new = sn.split("x")
        out.append((int(seqs), int(new), int(cached)))
    return out


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


class Shape:
    """One prefill shape's data and its row recorder."""

    def __init__(self, device, seqs: int, new: int, cached: int, args, rows: list[dict]):
        self.device, self.seqs, self.new, self.cached, self.args, self.rows = device, seqs, new, cached, args, rows
        gen = torch.Generator().manual_seed(7)
        self.cache, self.tables, self.query, self.seq_lens, self.qsl, self.flops = kb.prefill_case(
            device, seqs, new, cached, gen)
        self.L = new + cached
        self.tag = f"{seqs}x{new} over {cached}"
        self.vmax = (self.cache.v_scale.max() * 448).item()
        self.scale = D**-0.5
        # the dense float64 check of the FP8 mode's definition, where it fits
        self.check = seqs * new <= 8192 and seqs * (new + cached) <= 262144

    def record(self, name: str, ms: float, **kw) -> None:
        row = {"shape": self.tag, "seqs": self.seqs, "new": self.new, "cached": self.cached, "impl": name, "ms": ms,
               "useful_tflops": self.flops / (ms * 1e-3) / 1e12, **kw}
        self.rows.append(row)
        log(f"  {self.tag}: {name:52s} {ms * 1e3:8.1f} us  {row['useful_tflops']:6.1f} TFLOP/s "
            + " ".join(f"{k}={v}" for k, v in kw.items() if k not in ("config", "plan")))

    def time(self, fn) -> float:
        return kb.time_graph(fn, calls=3, reps=self.args.reps)

    def plan(self, backend: str, qdtype=torch.bfloat16):
        import fp8kv

        return fp8kv.plan_attention(self.cache, num_q_heads=HQ, query_dtype=qdtype, block_tables=self.tables,
                                    seq_lens=self.seq_lens, query_start_loc=self.qsl, num_tokens=self.query.shape[0],
                                    max_query_len=self.new, max_seq_len=self.L, validate=False, backend=backend)


def sdpa_row(s: Shape) -> None:
    q4 = s.query.view(s.seqs, s.new, HQ, D).transpose(1, 2).contiguous()
    kd = torch.randn(s.seqs, HKV, s.L, D, device=s.device, dtype=torch.bfloat16)
    vd = torch.randn(s.seqs, HKV, s.L, D, device=s.device, dtype=torch.bfloat16)
    try:
        s.record("sdpa bf16", s.time(lambda: kb.causal_sdpa_bf16(q4, kd, vd)))
    except RuntimeError as exc:  # GQA not accepted with a lower-right mask here
        log(f"  sdpa failed: {exc}")


@contextlib.contextmanager
def _cuda_prefill_kernel(CA, kernel: str | None):
    """The CUDA backend's prefill kernel for plans made inside: ``mma`` (``mma.sync``), ``wgmma``, ``pingpong``
    (wgmma with ping-pong) or None (as shipped)."""
    if CA is None or kernel is None:
        yield
        return
    default = CA.WGMMA_PREFILL, CA.WGMMA_PINGPONG
    CA.WGMMA_PREFILL, CA.WGMMA_PINGPONG = kernel in ("pingpong", "wgmma"), kernel == "pingpong"
    try:
        yield
    finally:
        CA.WGMMA_PREFILL, CA.WGMMA_PINGPONG = default


def default_mode_rows(s: Shape) -> None:
    """Triton, the selected backend, and the CUDA backend's tensor-core kernels (wgmma on sm90)."""
    qdtype = getattr(torch, s.args.qdtype)
    query = s.query.to(qdtype)
    runs = [("triton", "fp8kv triton (default mode: bf16 math)", None),
            (s.args.backend, "fp8kv {} (selected, default mode)", None)]
    try:
        from fp8kv_cuda import attention as CA
    except ImportError:
        CA = None
    if CA is not None:
        runs.append(("cuda", "fp8kv cuda tensor-core prefill", "mma"))
        if torch.cuda.get_device_capability(s.device) == (9, 0):  # the sm90 kernel (the default there)
            runs += [("cuda", "fp8kv cuda wgmma prefill (ping-pong)", "pingpong"),
                     ("cuda", "fp8kv cuda wgmma prefill", "wgmma")]
    ref = None
    for name, label, kernel in runs:
        with _cuda_prefill_kernel(CA, kernel):
            meta = s.plan(name, qdtype)
            be, out = meta.attention.backend, torch.empty_like(query)
            label = label.format(be.name)
            run = lambda be=be, meta=meta, out=out: be.paged_attention(query, s.cache, meta, out, None)  # noqa: E731
            try:
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a kernel that fails is reported, the rest still timed
                log(f"  {label} failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            extra = {}
            if ref is None:
                ref = out
            else:
                extra = {"backend": be.name, "plan": str(meta.backend_plan),
                         "max_diff_vs_triton_over_vmax": round((out.float() - ref.float()).abs().max().item()
                                                               / s.vmax, 6)}
            s.record(label, s.time(run), **extra)
    if CA is not None:
        cuda_variant_rows(s, CA, query)


def cuda_variant_rows(s: Shape, CA, query) -> None:
    """The CUDA backend's prefill at forced KV splits, and its per-token path (``--splits``, ``--per-token``)."""
    for ns in (int(x) for x in s.args.splits.split(",") if x):
        p = CA.plan_prefill(s.device, num_seqs=s.seqs, num_kv_heads=HKV, group=HQ // HKV, head_size=D,
                            max_keys=s.tables.shape[1] * s.cache.block_size, max_query_len=s.new, num_splits=ns)
        out = torch.empty_like(query)
        s.record(f"fp8kv cuda prefill, {p.num_splits} splits (forced)",
                 s.time(lambda p=p, out=out: CA.paged_attention(query, s.cache, s.tables, s.seq_lens, s.qsl, s.scale,
                                                                True, None, None, out, None, plan_=p)))
    if s.args.per_token and s.seqs * s.new <= 8192:
        p = CA.plan(s.device, num_tokens=query.shape[0], num_kv_heads=HKV, group=HQ // HKV, head_size=D,
                    max_keys=s.L, query_dtype=query.dtype, fmt="fp8_e4m3")  # the decode plan: one CTA row per token
        out = torch.empty_like(query)
        fn = lambda: CA.paged_attention(query, s.cache, s.tables, s.seq_lens, s.qsl, s.scale, True, None, None,  # noqa: E731
                                        out, None, plan_=p)
        s.record("fp8kv cuda per-token (decode kernels)", kb.time_graph(fn, calls=1, reps=5))


def fp8_configs(s: Shape):
    """``(config, dynamic q_scale, snake deal)`` of every FP8-mode variant timed, and the shipped config."""
    from fp8kv_hopper.attention import choose_config

    sms = torch.cuda.get_device_properties(s.device).multi_processor_count
    shipped = choose_config(group=HQ // HKV, num_seqs=s.seqs, num_kv_heads=HKV, max_query_len=s.new, max_keys=s.L,
                            num_sms=sms)  # kernel "auto": the CUDA kernel here (prefill), Triton otherwise
    base = dataclasses.replace(shipped, kernel="triton")
    grid = [(base, True), (base, False)]
    if s.args.grid == "full":
        for bm, bn, w, st in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 4, 2), (64, 128, 4, 3),
                              (128, 64, 4, 3), (256, 64, 8, 2)):
            grid.append((dataclasses.replace(base, block_m=bm, block_n=bn, num_warps=w, num_stages=st), True))
    grid += [(dataclasses.replace(c, v_mode=2 - c.v_mode), dyn) for c, dyn in grid]
    grid = [(c, dyn, False) for c, dyn in grid]
    if s.new > 1:  # the warp-specialized CUDA kernel (prefill only); its persistent grid deals the plan's
        # schedule (from the host lengths, as plan_attention makes it), or its snake
        grid += [(dataclasses.replace(base, kernel="wgmma", wgmma_pingpong=pp, wgmma_ctas=ctas), dyn, snake)
                 for ctas, snake in ((shipped.wgmma_ctas, False), (shipped.wgmma_ctas, True), (0, False))
                 for pp in (True, False) for dyn in (True, False)]
    return grid, shipped


def fp8_mode_rows(s: Shape) -> None:
    from fp8kv_hopper import schedule
    from fp8kv_hopper.attention import paged_attention_fp8

    out = torch.empty_like(s.query)

    def diff(q_scale) -> dict:
        if not s.check:
            return {}
        want = fp8_mode_dense(s.query, s.cache, s.tables, s.seq_lens, s.qsl, s.scale, q_scale=q_scale)
        return {"diff_from_fp8_definition_over_vmax": round((out.double() - want).abs().max().item() / s.vmax, 5)}

    grid, shipped = fp8_configs(s)
    planned = schedule.for_step(s.seq_lens.tolist(), s.qsl.tolist(), ctas=shipped.wgmma_ctas, num_kv_heads=HKV,
                                group=HQ // HKV, num_tokens=s.query.shape[0], max_query_len=s.new,
                                max_keys=s.tables.shape[1] * s.cache.block_size, causal=True, sliding_window=None,
                                device=s.device)  # (as plan_attention makes it from the host lengths)
    for cfg, dyn, snake in grid:
        qs = None if dyn else torch.full((HKV,), 0.02, device=s.device)
        sched = planned if cfg.kernel == "wgmma" and cfg.wgmma_ctas == shipped.wgmma_ctas > 0 and not snake else None

        def run(cfg=cfg, qs=qs, sched=sched):
            paged_attention_fp8(s.query, s.cache, s.tables, s.seq_lens, s.qsl, s.new, s.scale, True, None, None, out,
                                q_scale=qs, prob_scale=1.0, config=cfg, schedule=sched)
        try:
            run()
            torch.cuda.synchronize()
            extra = diff(qs)
            ms = s.time(run)
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit
            log(f"  {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        q = "dyn-q" if dyn else "head-q"
        name = (f"hopper fp8 {q} wgmma (CUDA){' ping-pong' if cfg.wgmma_pingpong else ''}"
                f"{' a CTA per item' if cfg.wgmma_ctas == 0 else ''}{' snake deal' if snake else ''}"
                if cfg.kernel == "wgmma"
                else f"hopper fp8 {q} m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} v{cfg.v_mode}")
        default = cfg == dataclasses.replace(shipped, kernel="wgmma" if s.new > 1 else "triton") and not snake
        s.record(name, ms, config=dataclasses.asdict(cfg), dynamic_q=dyn, default=default, **extra)


def flashinfer_row(s: Shape) -> None:
    try:
        peer = kb.flashinfer_prefill(s.cache, s.tables, s.query, s.qsl)
        if peer is None:
            return
        run, out = peer
        torch.cuda.synchronize()
        s.record("flashinfer bf16 (FA3 path)", s.time(run), finite=bool(torch.isfinite(out).all()))
    except Exception as exc:  # noqa: BLE001 - installed but not built for this GPU
        log(f"  flashinfer failed: {type(exc).__name__}: {str(exc)[:300]}")


def profile(args, device):
    """One kernel at the first shape, as a call (for ncu)."""
    seqs, new, cached = parse_shapes(args.shapes)[0]
    s = Shape(device, seqs, new, cached, args, [])
    out = torch.empty_like(s.query)
    if args.profile == "default":
        meta = s.plan("cuda")
        run = lambda: meta.attention.backend.paged_attention(s.query, s.cache, meta, out, None)  # noqa: E731
    else:
        from fp8kv_hopper.attention import paged_attention_fp8

        _, shipped = fp8_configs(s)
        cfg = dataclasses.replace(shipped, kernel="wgmma")
        run = lambda: paged_attention_fp8(s.query, s.cache, s.tables, s.seq_lens, s.qsl, new, s.scale, True,  # noqa: E731
                                          None, None, out, q_scale=None, prob_scale=1.0, config=cfg)
    return run


def run(args) -> dict | None:
    device = kb.cuda_device("the prefill benchmark")
    if args.profile:
        return kb.untimed(profile(args, device))
    modes = set(args.modes.split(","))
    fp8 = "fp8_attention" in modes and torch.cuda.get_device_capability(device) == (9, 0)
    rows: list[dict] = []
    for seqs, new, cached in progress(parse_shapes(args.shapes), "prefill"):
        s = Shape(device, seqs, new, cached, args, rows)
        log(f"== {s.tag}: {s.flops / 1e12:.3f} useful TFLOP")
        sdpa_row(s)
        if "default" in modes:
            default_mode_rows(s)
        if fp8:
            fp8_mode_rows(s)
        if not args.no_flashinfer:
            flashinfer_row(s)
        del s
        torch.cuda.empty_cache()
    from fp8kv import settings

    return record(NAME, device, query_dtype=args.qdtype, FP8KV_CUDA_ARCH=settings.cuda_arch() or None, results=rows)


def table(rec: dict) -> str:
    """Each shape's rows with their ratios to SDPA bf16, the Triton backend and FlashInfer."""
    rows = rec["results"]
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        base = {k: next((r["ms"] for r in rs if r["impl"].startswith(k)), None)
                for k in ("sdpa", "fp8kv triton", "flashinfer")}
        for r in rs:
            out.append([shape, r["impl"], f"{r['ms'] * 1e3:.1f}", f"{r['useful_tflops']:.0f}",
                        *(f"{base[k] / r['ms']:.2f}x" if base[k] else "-" for k in base)])
    return f"{title(rec)}\n" + markdown(["shape", "implementation", "us", "useful TFLOP/s", "vs SDPA bf16",
                                         "vs fp8kv triton", "vs FlashInfer bf16"], out)


def plot(rec: dict, plt):
    rows = rec["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(7.5 * len(shapes), 0.3 * len(rows) / len(shapes) + 3),
                             squeeze=False, layout="constrained")
    for ax, shape in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if r["shape"] == shape]
        colors = ["tab:gray" if r["impl"].startswith(("sdpa", "flashinfer")) else
                  "tab:red" if r["impl"].startswith("hopper") else "tab:blue" for r in rs]
        ax.barh([r["impl"] for r in rs], [r["ms"] * 1e3 for r in rs], color=colors)
        for i, r in enumerate(rs):
            ax.text(r["ms"] * 1e3, i, f" {r['ms'] * 1e3:.0f}", va="center", fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("us (lower is better)\nred: FP8 attention mode, blue: default mode, gray: baselines", fontsize=8)
        ax.set_title(shape, fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(f"prefill, GQA 32/8, D=128, block 16, e4m3, bf16 queries\n{title(rec)}", fontsize=9)
    return fig
