"""``fp8kv bench``: the cache write, decode and chunked prefill benchmarks on a CUDA GPU.

A thin command over the benchmark harness, the separate top-level package ``fp8kv_bench``
(``benchmarks/fp8kv_bench`` in the source tree, installed alongside ``fp8kv``), imported only when the
command runs. Each part is the benchmark ``benchmarks/<part>.py`` runs, with its defaults
(``fp8kv_bench.write``, ``.decode``, ``.prefill``, ``.decode_sweep``): the backend ``auto`` picks (or
``--backend``) against the same run's baselines: the copy bandwidth (write; the FP8 roofline of decode),
SDPA bf16, and FlashInfer where importable (its FP8 decode on the same cache bytes, its bf16 prefill).

Exit status: 0; 1 without a CUDA device or without the harness; 2 for a bad value.
"""

from __future__ import annotations

import argparse

from ..cli import Refusal, load_harness, output_path, positive_int

NAME = "bench"
HELP = "benchmark cache write, decode and prefill against SDPA bf16, FlashInfer and the copy-bandwidth roofline (CUDA)"
PARTS = ("write", "decode", "prefill", "decode_sweep")
DEFAULT_PARTS = ("write", "decode", "prefill")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--kv-dtype", default="fp8_e4m3", help="storage format of write and decode (default fp8_e4m3)")
    p.add_argument("--only", choices=PARTS, action="append",
                   help="run only these parts (repeatable; default write, decode and prefill)")
    p.add_argument("--json", default=None, type=output_path, help="also write the results as JSON to this path")
    p.add_argument("--reps", type=positive_int, default=20, help="timed repeats per measurement (median)")


def run(args: argparse.Namespace) -> int:
    import torch

    results = load_harness("results", NAME)
    if not torch.cuda.is_available():
        raise Refusal(f"needs a CUDA device (none is available here; torch {torch.__version__})")
    records = {}
    for part in args.only or DEFAULT_PARTS:
        bench = load_harness(part, NAME)
        argv = ["--backend", args.backend, "--reps", str(args.reps)]
        if part in ("write", "decode"):
            argv += ["--kv-dtype", args.kv_dtype]
        print(f"== {part}", flush=True)
        records[part] = bench.run(results.parse(bench, argv))
        print(bench.table(records[part]), flush=True)
    if args.json:
        results.write_json(args.json, {"command": results.command(), "benchmarks": records})
    return 0
