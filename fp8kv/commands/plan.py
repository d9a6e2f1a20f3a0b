"""``fp8kv plan``: explain which FP8 KV cache a checkpoint may use on a device, or why not.

Examples::

    fp8kv plan ./Llama-3-8B-W4A16 --kv-cache-dtype fp8_e5m2 --simulate sm80
    fp8kv plan ./Llama-3-8B-FP8-KV/config.json --kv-cache-dtype fp8 --simulate gfx942 --json

Exit status: 0 with the plan; 1 with the refusal and its reason (on stdout, as text or JSON);
2 for a usage error (a checkpoint path that does not exist, an unknown ``--simulate``), on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint import KV_CACHE_DTYPES, resolve_kv_cache
from ..cli import EXIT_FAILURE, existing_path
from ..errors import Fp8KVError
from ..probe import SIMULATED, probe, simulated

NAME = "plan"
HELP = "explain the KV-cache format, scales and backend a checkpoint gets on a device (or the refusal)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=existing_path,
                   help="model directory (config.json + *.safetensors), a config JSON file, or a KV-scales JSON "
                        "(vLLM's and SGLang's quantization_param_path file)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="requested KV cache dtype (default: auto)")
    p.add_argument("--simulate", default=None, choices=sorted(SIMULATED), metavar="DEVICE",
                   help=f"plan for a simulated device: {', '.join(SIMULATED)} (default: this machine)")
    p.add_argument("--layout", default="NHD", choices=("NHD", "HND"), help="cache layout (default: NHD)")
    p.add_argument("--tp-rank", type=int, default=None, metavar="RANK",
                   help="the tensor-parallel rank whose scales a KV-scales JSON gives (needed when it has several)")
    p.add_argument("--json", action="store_true", help="print the plan (or refusal) as JSON")


def run(args: argparse.Namespace) -> int:
    device = simulated(args.simulate) if args.simulate else probe()
    try:
        plan = resolve_kv_cache(args.kv_cache_dtype, args.checkpoint, device, layout=args.layout,
                                tp_rank=args.tp_rank)
    except (Fp8KVError, OSError) as exc:  # the refusal is the answer: print it, exit 1
        if args.json:
            print(json.dumps({"refused": True, "requested": args.kv_cache_dtype,
                              "checkpoint": args.checkpoint, "device": device.name, "arch": device.arch,
                              "reason": str(exc)},
                             indent=2))
        else:
            print(f"checkpoint    {args.checkpoint}\ndevice        {device.name}"
                  f"{f' [{device.arch}]' if device.arch else ''}\nrequested     {args.kv_cache_dtype}\n"
                  f"REFUSED       {exc}", file=sys.stdout)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps({"refused": False, **plan.to_dict()}, indent=2))
    else:
        print(plan.describe())
    return 0
