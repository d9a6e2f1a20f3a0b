"""Anatomy: merge cost and PDL at the decode shapes (dev probe, not shipped)."""
import sys, json, torch
sys.path.insert(0, "benchmarks")
from fp8kv_bench import kernels as kb
import cuda_decode_ab as ab
from fp8kv_cuda import runtime, attention as CA

orig = runtime.launch
def no_merge(variant, entry, *a, **k):
    if entry == "fp8kv_merge":
        return
    return orig(variant, entry, *a, **k)

dev = torch.device("cuda")
rows = []
for B, L in ((1, 131072), (8, 32768), (64, 2048), (32, 4096)):
    runs, q, plan = ab.decode_runs(B, L, dev)
    for mode in ("fp8_dynamic_q", "default"):
        arms = ["pdl", "plain"] + (["pdl_nomerge", "plain_nomerge"] if plan.num_splits > 1 else [])
        outs = {a: torch.empty_like(q) for a in arms}
        def t(a):
            CA.DECODE_PDL = a.startswith("pdl")
            runtime.launch = no_merge if a.endswith("nomerge") else orig
            r = kb.time_graph(lambda: runs[mode](outs[a]), reps=20) * 1e3
            runtime.launch = orig
            return r
        for a in arms:
            t(a)
        times = ab.alternated(arms, t, 5)
        same = torch.equal(outs["pdl"], outs["plain"])
        med = {a: ab.median(v) for a, v in times.items()}
        print(B, L, mode, plan.num_splits, {a: round(m, 2) for a, m in med.items()}, "identical", same, flush=True)
        rows.append({"B": B, "L": L, "mode": mode, "splits": plan.num_splits, "times": times, "median": med, "identical": same})
json.dump({"env": kb.environment(dev), "rows": rows}, open(sys.argv[1], "w"), indent=1)
