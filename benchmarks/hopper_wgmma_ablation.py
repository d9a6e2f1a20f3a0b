"""Where the Hopper FP8 wgmma prefill's time goes: the kernel timed with parts of it removed from its
source (the outputs are wrong then; only the times mean anything), at 4 x 2048 new over 2048 cached
(GQA 32/8, D=128, block 16, dynamic q scale, bf16 queries; ``--shape`` for others); medians of CUDA-graph replays, as
``hopper_prefill.py`` times.

    python benchmarks/hopper_wgmma_ablation.py [--shape 4x2048+2048] [--json FILE] [--baseline OLD.cu] [VARIANT ...]

Every variant runs as shipped but for what it names: since 2026-11-27 without ping-pong (before, with it;
the iteration files say which). Variants: ``base`` (as shipped), ``pp`` (the consumer warpgroups take turns,
FA3's ping-pong), ``nolazy`` (no conditional rescaling: every tile's row maxima before its
exponentials), ``nopp`` (no ping-pong: now the same as ``base``), ``cpasync``
(the cp.async loads instead of TMA), ``vt128`` (V^T's 8-dim groups 1152 bytes apart: its core matrices
128-byte aligned, the transpose's stores no longer conflict-free), ``noprod`` (the producer loads and
transposes nothing: it only hands tiles over; the valid flags are then stale, so every tile takes the
masking path), ``notrans`` (no V transpose), ``nosoftmax`` (the consumers skip the softmax: the products
only), ``gemm_only`` (noprod and nosoftmax: the wgmma pipeline alone), ``gemm_only_vt128``,
``noprod_nopp``, ``nopp_nosoftmax``, ``nopp_notrans``, ``qmul`` (the query's 64 divisions a thread
replaced by products: what the prologue's divisions cost), ``fdiv`` (those divisions as IEEE float32
divisions, before 2026-11-27, in place of ``div_by_scale``'s), ``f64div`` (every scale's divisions through
a float64 reciprocal, as before session 18; since then scales in [2^-80, 2^80] take float32 Markstein
divisions), ``epidiv`` (the
epilogue's 64 IEEE divisions a thread by l, as before 2026-11-27, in place of one reciprocal and
products), ``lazymax`` (the conditional rescaling's test on the row maxima, as before 2026-11-28, in
place of the chain sums), ``grid`` and ``grid_pp`` (a CTA per work item, as before 2026-11-28,
without and with ping-pong; ``base`` and ``pp`` run the persistent grid of one CTA per SM since then),
``nooverlap`` and ``nooverlap_pp`` (each phase waits for both products before the softmax, as before
2026-11-28; since then a tile's softmax runs while the previous tile's ``p8 @ v8`` does), ``nomask`` (edge
tiles unmasked), ``qprefetch`` (the producer prefetching each item's query rows into L2), ``baseline``
(the kernel of ``--baseline``'s source file, e.g. ``git show REV:backends/fp8kv_hopper/csrc/fp8_prefill.cu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests")
from fp8kv_bench.kernels import causal_prefill_flops, environment, time_graph  # noqa: E402
from fp8kv_cuda import runtime  # noqa: E402
from fp8kv_hopper import attention, wgmma  # noqa: E402
from test_hopper_gpu import _case  # noqa: E402

LOAD = "load_tile(sh, P, cta, bt_row, t, g, lane, ids);"
TRANSPOSE = "tail >= BLOCK_N ? transpose_v<false, 1>(vr, vt, lane, tail) : transpose_v<true, 1>(vr, vt, lane, tail);"
SOFTMAX = "        const int s = stage(t), n0 = cta.lo + t * BLOCK_N;"
NOPROD = [(LOAD, "if (!TMA || lane == 0) mbar_arrive(&sh.loaded[s]);"), (TRANSPOSE, "")]
NOTRANS = [(TRANSPOSE, "")]
NOSOFT = (SOFTMAX, "        return;\n" + SOFTMAX)
VT128 = ("constexpr int VT_SBO = 1040;", "constexpr int VT_SBO = 1152;")
# the query's float32 division (scales in [2^-80, 2^80]); F64DIV: every scale through the float64 reciprocal
QDIV = "return div_by_scale(v, qs, rs);"
QMUL = (QDIV, "return v * rs;")  # (timing only: not the quantization)
FDIV = (QDIV, "return __fdiv_rn(v, qs);")
F64DIV = ("if (qs >= 0x1p-80f && qs <= 0x1p80f) {", "if (false) {")
EPIDIV = [("((o[4 * j + 2 * h] * inv_l) * v_scale)", "(__fdiv_rn(o[4 * j + 2 * h], 1.0f / inv_l) * v_scale)"),
          ("((o[4 * j + 2 * h + 1] * inv_l) * v_scale)", "(__fdiv_rn(o[4 * j + 2 * h + 1], 1.0f / inv_l) * v_scale)")]
LAZYMAX = [  # the conditional rescaling's test on the row maxima (before 2026-11-28) instead of the chain sums
    ("    float lsum[2][4] = {}, msafe[2];\n",
     "    float lsum[2][4] = {}, msafe[2], part[2][4];\n"
     "    for (int h = 0; h < 2; ++h) for (int k = 0; k < 4; ++k) part[h][k] = NEG_INF;\n"),
    ("                lsum[h][k] += p;\n",
     "                lsum[h][k] += p;\n                part[h][k] = fmaxf(part[h][k], sa[i]);\n"),
    ("        jump |= sm.rv[h] && (!within || sm.m[h] == NEG_INF);",
     "        jump |= sm.rv[h] && __fmul_rn(fmaxf(fmaxf(part[h][0], part[h][1]), fmaxf(part[h][2], part[h][3])), "
     "sm.f[h]) > sm.m[h] + P.lazy_t;")]
VT128_SMEM = 16 * (1152 - 1040)  # per stage
# per-item costs: the epilogue's stores skipped (NOEPI), the query's quantization skipped (NOQUANT: q8 keeps
# the previous item's codes), consumer warpgroup 1 starting N microseconds after warpgroup 0 (STAGGER: does a
# lasting offset between the two hide one's item boundary behind the other's tiles?)
STORE = "            store_out2(P.out, orow[h] + 8 * j + 2 * c,"
NOEPI = (STORE, "            if (P.T < 0)" + STORE[11:])
NOQUANT = [("        store_q8(qdst, x, ql, half, [&](float v) { return div_by_scale(v, qs, rs); });", ""),
           ("        store_q8(qdst, x, ql, half, [&](float v) { return div_by_scale(v, rq); });", "")]
CONSUME = "    Work work = first_work(P);\n"
# the edge tiles' masking skipped (timing only: what masking the diagonal tile of every item costs)
NOMASK = [("    if (!interior) {  // an edge tile: mask", "    if (P.T < 0) {")]
# the producer prefetching each item's query rows into L2 as it starts the item's tiles (ahead of the consumers)
BT_ROW = "        const int* bt_row = P.bt + (i64)cta.seq * P.stride_bt;\n"
QPREFETCH = (BT_ROW, BT_ROW + """        for (int hr = threadIdx.x; hr < 2 * BLOCK_M; hr += 128) {
            const int qi = (hr >> 1) / P.group, tin = cta.qb * P.block_q + qi;
            if (qi >= P.block_q || tin >= cta.q_len) continue;
            const int qh = cta.kvh * P.group + (hr >> 1) % P.group;
            const i64 base = ((i64)(cta.q_start + tin) * P.HQ + qh) * D + 64 * (hr & 1);
            const char* a = static_cast<const char*>(P.q) + base * (QT == 0 ? 4 : 2);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
            if (QT == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(a + 128));
        }
""")


def stagger(us: int) -> tuple[str, str]:
    wait = f"const long long t0 = clock64(); while (clock64() - t0 < {us} * 1800LL) {{}}"
    return (CONSUME, f"    if (cw == 1) {{ {wait} }}\n" + CONSUME)


VARIANTS = {"base": (wgmma.STAGES, False, [], {}), "nolazy": (wgmma.STAGES, False, [], {"lazy": False}),
            "nopp": (wgmma.STAGES, False, [], {}), "pp": (wgmma.STAGES, True, [], {}),
            "cpasync": (wgmma.STAGES, False, [], {"tma": False}),
            "vt128": (wgmma.STAGES, False, [VT128], {}),
            "noprod": (wgmma.STAGES, False, NOPROD, {}), "notrans": (wgmma.STAGES, False, NOTRANS, {}),
            "nosoftmax": (wgmma.STAGES, False, [NOSOFT], {}), "gemm_only": (wgmma.STAGES, False, [*NOPROD, NOSOFT], {}),
            "gemm_only_vt128": (wgmma.STAGES, False, [*NOPROD, NOSOFT, VT128], {}),
            "noprod_nopp": (wgmma.STAGES, False, NOPROD, {}),
            "nopp_nosoftmax": (wgmma.STAGES, False, [NOSOFT], {}), "nopp_notrans": (wgmma.STAGES, False, NOTRANS, {}),
            "qmul": (wgmma.STAGES, False, [QMUL], {}), "fdiv": (wgmma.STAGES, False, [FDIV], {}),
            "f64div": (wgmma.STAGES, False, [F64DIV], {}),
            "epidiv": (wgmma.STAGES, False, EPIDIV, {}), "lazymax": (wgmma.STAGES, False, LAZYMAX, {}),
            "grid": (wgmma.STAGES, False, [], {}), "grid_pp": (wgmma.STAGES, True, [], {}),
            "nooverlap": (wgmma.STAGES, False, [], {"overlap": False}),
            "nooverlap_pp": (wgmma.STAGES, True, [], {"overlap": False}),
            "noepi": (wgmma.STAGES, False, [NOEPI], {}), "noquant": (wgmma.STAGES, False, NOQUANT, {}),
            "stagger1": (wgmma.STAGES, False, [stagger(1)], {}), "stagger3": (wgmma.STAGES, False, [stagger(3)], {}),
            "stagger10": (wgmma.STAGES, False, [stagger(10)], {}),
            "nomask": (wgmma.STAGES, False, NOMASK, {}), "qprefetch": (wgmma.STAGES, False, [QPREFETCH], {})}
CONFIG = {"grid": {"wgmma_ctas": 0}, "grid_pp": {"wgmma_ctas": 0}}  # Fp8AttnConfig fields a variant sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", default=[], help=f"any of {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shape", default="4x2048+2048", help="SEQSxNEW+CACHED (causal, GQA 32/8, D=128, page 16)")
    ap.add_argument("--baseline", metavar="CU", help="variant 'baseline': the kernel compiled from this source file "
                    "(an earlier fp8_prefill.cu with the same Params), for an A/B against the working tree")
    args = ap.parse_args(argv)
    if "baseline" in args.variants and not args.baseline:
        ap.error("variant 'baseline' needs --baseline FILE (the earlier fp8_prefill.cu to compile)")
    seqs, rest = args.shape.split("x")
    seqs, new_len, cached = int(seqs), *map(int, rest.split("+"))
    cache, q, tables, lens, qsl, new = _case(seqs, new_len, cached)
    useful = causal_prefill_flops(seqs, new_len, cached)
    source, smem_bytes, rows = wgmma.source(), wgmma.smem_bytes, []
    variants = dict(VARIANTS, baseline=(wgmma.STAGES, False, [], {}))
    for name in args.variants or list(VARIANTS):
        stages, pingpong, patches, extra = variants[name]
        src = source
        if name == "baseline":
            from fp8kv_cuda.variants import inline_headers

            with open(args.baseline) as f:
                src = inline_headers(f.read())
        for old, new_text in patches:
            assert old in src, f"{name}: the kernel source changed ({old!r} not found)"
            src = src.replace(old, new_text)
        opts = wgmma.options(q.dtype, pingpong, stages, **extra) + (f"-DFP8KV_ABLATION_{name}=1",)
        mod = runtime.module(("ablation", opts), lambda src=src, opts=opts: runtime.compile_source(
            src, "fp8_prefill.cu", opts, "sm_90a"), (wgmma.ENTRY,), runtime.device_index(q.device))
        wgmma.function = lambda entry, dtype, device, pingpong=True, tma=True, mod=mod: mod.get_function(entry)
        extra_smem = VT128_SMEM * stages if VT128 in patches else 0
        wgmma.smem_bytes = lambda st=stages, x=extra_smem: (smem_bytes(st) + x + 1023) // 1024 * 1024
        cfg = dataclasses.replace(attention.choose_config(group=4, num_seqs=seqs, num_kv_heads=8, max_query_len=new,
                                                          max_keys=tables.shape[1] * 16, num_sms=132),
                                  kernel="wgmma", wgmma_pingpong=pingpong, **CONFIG.get(name, {}))
        out = torch.empty_like(q)

        def run(cfg=cfg, out=out):
            attention.paged_attention_fp8(q, cache, tables, lens, qsl, new, 128**-0.5, True, None, None, out,
                                          q_scale=None, prob_scale=1.0, config=cfg)
        us = time_graph(run, calls=3, reps=args.reps) * 1e3
        rows.append({"variant": name, "shape": args.shape, "stages": stages, "pingpong": pingpong, "us": round(us, 1),
                     "useful_tflops": round(useful / us / 1e6, 1)})
        print(f"  {name:12s} {us:8.1f} us  {useful / us / 1e6:6.0f} TFLOP/s", flush=True)
    wgmma.smem_bytes = smem_bytes
    print("| variant | stages | ping-pong | us | useful TFLOP/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['stages']} | {r['pingpong']} | {r['us']} | {r['useful_tflops']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(q.device), "shape": args.shape, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
