"""The shipped transforms (``FP8PagedCache(sink_tokens=, k_centering=)``): KL and CPU speed cost.

Unlike ``hf_candidates.py`` (fake quantization), this runs the real fp8kv cache: FP8 codes in
the paged cache, attention over them with the log-sum-exp merge of :mod:`fp8kv.transforms`
(``torch`` backend on the CPU). SmolLM2-135M-Instruct (float32), teacher forced over 4 windows x
512 predicted tokens of the Python Language Reference after a 128-token prompt (so ``"prefill"``
means come from 127 prompt keys per row and layer; calibrated means from the first 1024 tokens of
Python's LICENSE.txt, position 0 excluded). KL changes are paired per token against the same
format without transform, with batch-means standard errors.

Speed: ``generate()`` of ``--speed-tokens`` new tokens at batch 1 in ``--speed-rounds`` rounds,
each running every cache once in turn (the unquantized cache, fp8kv e4m3, fp8kv e4m3 with the
transform, with ``static=True``, both); ratios are medians of the per-round ratios.

    python benchmarks/hf_transforms.py                  # -> benchmarks/results/hf_transforms_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from fp8kv_bench import hf_eval, hf_kl  # noqa: E402

VARIANTS = {  # name -> FP8PagedCache kwargs beyond the format
    "": {},
    "sink1": {"sink_tokens": 1},
    "kcenter": {"k_centering": "prefill"},
    "sink1+kcenter": {"sink_tokens": 1, "k_centering": "prefill"},
    "sink1+kcenter(calibrated)": {"sink_tokens": 1, "k_centering": "calibrated"},
    "sink4+kcenter": {"sink_tokens": 4, "k_centering": "prefill"},
    "static": {"static": True, "max_cache_len": 1024},
    "sink1+kcenter+static": {"sink_tokens": 1, "k_centering": "prefill", "static": True, "max_cache_len": 1024},
}
DEFAULT = ["e4m3", "e4m3 sink1", "e4m3 kcenter", "e4m3 sink1+kcenter", "e4m3 sink1+kcenter(calibrated)",
           "e4m3 sink4+kcenter", "e5m2", "e5m2 sink1+kcenter", "e5m2 sink1+kcenter(calibrated)"]


def maker(model, name: str, backend: str, k_means) -> hf_kl.Maker:
    from fp8kv.integrations.transformers import FP8PagedCache, register

    register()
    fmt, _, variant = name.partition(" ")
    kw = dict(VARIANTS[variant])
    if kw.get("k_centering") == "calibrated":
        kw["k_means"] = k_means
    return hf_kl.Maker(name, lambda: FP8PagedCache(model.config, kv_dtype="fp8_" + fmt, backend=backend, **kw),
                       "fp8kv")


@torch.inference_mode()
def calibrated_means(model, ids: torch.Tensor) -> list[torch.Tensor]:
    from transformers.cache_utils import DynamicCache

    from fp8kv.transforms import calibrate_key_means

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return calibrate_key_means([layer.keys for layer in cache.layers], skip_first=1)


def speed(model, tok, makers: list[hf_kl.Maker], rounds: int, tokens: int, log=print) -> dict:
    per = {m.name: [] for m in makers}
    for r in range(rounds):
        for m in makers:
            res = hf_eval.generate_speed(model, tok, lambda m=m: m(model), max_new_tokens=tokens, repeats=1)
            per[m.name].append(res["tokens_per_s"])
        log(f"  speed round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in per.items()))
    base = makers[0].name
    out = {"tokens_per_s": per, "best_tokens_per_s": {k: max(v) for k, v in per.items()}}
    out["median_ratio_vs_" + base.replace(" ", "_")] = {
        k: statistics.median(a / b for a, b in zip(v, per[base], strict=True)) for k, v in per.items()}
    if len(makers) > 2:
        ref = makers[1].name
        out["median_ratio_vs_fp8kv"] = {k: statistics.median(a / b for a, b in zip(v, per[ref], strict=True))
                                        for k, v in per.items()}
    return out


def _c_loops() -> str:
    try:
        from fp8kv_torch import native
    except ImportError:
        return "torch backend not installed"
    return native.status()


def _commit() -> str | None:
    import subprocess

    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return r.stdout.strip() or None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caches", nargs="+", default=DEFAULT, help="<e4m3|e5m2>[ <variant>], variants: "
                   + ", ".join(v for v in VARIANTS if v))
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--speed-rounds", type=int, default=5)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--speed-variants", nargs="+", default=["sink1+kcenter", "static", "sink1+kcenter+static"])
    p.add_argument("--skip-kl", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--backend", default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results", "hf_transforms_cpu.json"))
    args = p.parse_args(argv)
    import transformers

    import fp8kv

    t_all = time.perf_counter()
    model, tok = hf_eval.load_smollm2("cpu", torch.float32)
    backend = args.backend or hf_kl.default_backend("cpu")
    text, _ = hf_eval.eval_text("python-license")
    k_means = calibrated_means(model, torch.tensor(tok(text).input_ids[:1024])[None])
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "fp8kv": fp8kv.__version__, "device": f"cpu: {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads", "backend": backend,
           "load_average_start": os.getloadavg(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> float32)",
           "torch_backend_c_loops": _c_loops(), "commit": _commit()}
    result: dict = {"environment": env}
    if not args.skip_kl:
        ids = hf_kl.windows(tok, args.windows, args.prompt_len + args.tokens)
        makers = [hf_kl.Maker("none", lambda: __import__("transformers").DynamicCache(config=model.config))]
        makers += [maker(model, n, backend, k_means) for n in args.caches]
        rows, kept = hf_kl.kl_rows(model, ids, args.prompt_len, makers, keep=True)
        for row in rows[1:]:
            fmt = row["cache"].split(" ")[0]
            if row["cache"] != fmt and fmt in kept:
                d = hf_kl.paired_kl_difference(kept[row["cache"]], kept[fmt])
                row["kl_change_pct"] = 100 * d["diff"] / float(kept[fmt]["kl"].mean())
                row["kl_change_se_pct"] = 100 * d["diff_se"] / float(kept[fmt]["kl"].mean())
                row["vs"] = fmt
                print(f"  {row['cache']:32s} KL change vs {fmt}: {row['kl_change_pct']:+.1f}% "
                      f"+- {row['kl_change_se_pct']:.1f}")
        result["kl"] = {"rows": rows, "text": hf_kl.eval_text()[1], "windows": args.windows,
                        "predicted_tokens": args.tokens, "prompt_len": args.prompt_len,
                        "calibration": "k_means: first 1024 tokens of Python's LICENSE.txt (reflowed), "
                                       "unquantized, position 0 excluded",
                        "standard_errors": "batch means over blocks of 32 predictions; changes paired per token"}
    if not args.skip_speed:
        from transformers.cache_utils import DynamicCache

        sm = [hf_kl.Maker("none", lambda: DynamicCache(config=model.config)), maker(model, "e4m3", backend, k_means)]
        sm += [maker(model, f"e4m3 {v}", backend, k_means) for v in args.speed_variants]
        result["speed"] = {"rounds": args.speed_rounds, "new_tokens": args.speed_tokens, "batch": 1,
                           **speed(model, tok, sm, args.speed_rounds, args.speed_tokens)}
    env["load_average_end"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - t_all
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} in {result['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
