"""``fp8kv bench``: cache write, decode and chunked prefill against bf16 SDPA and the roofline (CUDA).

A thin command: the harness is the separate top-level package ``fp8kv_bench``
(``benchmarks/fp8kv_bench/kernels.py`` in the source tree, installed alongside ``fp8kv``),
imported only when the command runs. See that module for what is measured and how.

Exit status: 0; 1 without a CUDA device or without the harness; 2 for a bad value.
"""

from __future__ import annotations

import argparse
import json

from ..cli import Refusal, load_harness, output_path, positive_int

NAME = "bench"
HELP = "benchmark cache write, decode and prefill against bf16 SDPA and the copy-bandwidth roofline (CUDA)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--kv-dtype", default="fp8_e4m3", help="storage format (default fp8_e4m3)")
    p.add_argument("--only", choices=("write", "decode", "prefill"), action="append",
                   help="run only these parts (repeatable; default all)")
    p.add_argument("--json", default=None, type=output_path, help="also write the results as JSON to this path")
    p.add_argument("--reps", type=positive_int, default=20, help="timed repeats per measurement (median)")


def run(args: argparse.Namespace) -> int:
    import torch

    kernels = load_harness("kernels", NAME)
    if not torch.cuda.is_available():
        raise Refusal(f"needs a CUDA device (none is available here; torch {torch.__version__})")
    device = torch.device("cuda", torch.cuda.current_device())
    parts = args.only or list(kernels.PARTS)
    record = kernels.run_all(args.backend, args.kv_dtype, device, parts, args.reps)
    env = record["env"]
    print(f"{env['device']} (sm{''.join(map(str, env['capability']))}), torch {env['torch']}, "
          f"triton {env['triton']}, copy bandwidth {record['copy_gbps']:.0f} GB/s (read + write)")
    print(kernels.format_table(record["results"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0
