"""The probe call 1 ran on 243b545 (it needs that tree's ``DECODE_PDL``): the decode launched as a programmatic
dependent launch or plainly and, at split shapes, without its merge kernel (timing only), 5 alternated rounds.

    git checkout 243b545 && python benchmarks/results/hopper_h100/session24/pdl_probe.py OUT.json
"""

import json
import sys

import torch

sys.path.insert(0, "benchmarks")
import cuda_decode_ab as ab  # noqa: E402
from fp8kv_bench import kernels as kb  # noqa: E402
from fp8kv_cuda import attention as CA  # noqa: E402
from fp8kv_cuda import runtime  # noqa: E402

launch = runtime.launch


def no_merge(variant, entry, *a, **k):
    if entry != "fp8kv_merge":
        launch(variant, entry, *a, **k)


def main(path: str) -> None:
    dev = torch.device("cuda")
    rows = []
    for B, L in ((1, 131072), (8, 32768), (64, 2048), (32, 4096)):
        runs, q, plan = ab.decode_runs(B, L, dev)
        for mode in ("fp8_dynamic_q", "default"):
            arms = ["pdl", "plain"] + (["pdl_nomerge", "plain_nomerge"] if plan.num_splits > 1 else [])
            outs = {a: torch.empty_like(q) for a in arms}

            def time_arm(a, mode=mode, runs=runs, outs=outs):
                CA.DECODE_PDL = a.startswith("pdl")
                runtime.launch = no_merge if a.endswith("nomerge") else launch
                try:
                    return kb.time_graph(lambda: runs[mode](outs[a]), reps=20) * 1e3
                finally:
                    runtime.launch = launch

            for a in arms:
                time_arm(a)
            times = ab.alternated(arms, time_arm, 5)
            same = torch.equal(outs["pdl"], outs["plain"])
            med = {a: ab.median(v) for a, v in times.items()}
            print(B, L, mode, plan.num_splits, {a: round(m, 2) for a, m in med.items()}, "identical", same, flush=True)
            rows.append({"B": B, "L": L, "mode": mode, "splits": plan.num_splits, "times": times, "median": med,
                         "identical": same})
    with open(path, "w") as f:
        json.dump({"env": kb.environment(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
