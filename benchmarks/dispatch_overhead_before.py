"""The same per-layer host overhead as ``dispatch_overhead.py``, measured on fp8kv 0.1.0 (before the
per-step metadata existed, every layer paid the one-shot path): same shapes, a null backend.

Run it against the 0.1.0 tree (commit 7329a6c)::

    git worktree add /tmp/fp8kv-0.1.0 7329a6c
    PYTHONPATH=/tmp/fp8kv-0.1.0:/tmp/fp8kv-0.1.0/backends python benchmarks/dispatch_overhead_before.py

It prints JSON (µs per call, median of 5 runs of ``number`` calls) and writes
``benchmarks/results/dispatch_overhead_cpu_v0.1.0.json``.
"""
import json
import pathlib
import statistics
import sys
import timeit

import torch

import fp8kv
from fp8kv.hookspecs import hookimpl

assert fp8kv.__version__ == "0.1.0", f"run this against fp8kv 0.1.0, got {fp8kv.__version__} ({fp8kv.__file__})"
torch.set_num_threads(1)



class Null:
    @hookimpl
    def fp8kv_backend_info(self):
        return fp8kv.BackendInfo("null", "0", priority=-1, fast=False)
    @hookimpl
    def fp8kv_supports(self, device, request):
        return None
    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        return None
    @hookimpl
    def fp8kv_paged_attention(self, query, cache, block_tables, seq_lens, query_start_loc, max_query_len,
                              softmax_scale, causal, sliding_window, logits_soft_cap, out):
        return None



fp8kv.register_backend(Null())
H, group, D, bs, L = 9, 3, 64, 16, 40
cache = fp8kv.KVCache.allocate(8, bs, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head")
k = torch.randn(L, H, D)
fp8kv.write_kv(cache, k, k, torch.arange(L), backend="reference")
key = value = torch.randn(1, H, D)
query = torch.randn(1, H * group, D)
tables = torch.arange(4, dtype=torch.int32)[None]
lens = torch.tensor([L + 1], dtype=torch.int32)
slots = torch.tensor([L])
out = torch.empty_like(query)


NUMBER = int(sys.argv[1]) if len(sys.argv) > 1 else 2000


def t(fn, n=NUMBER):
    fn()
    return round(statistics.median(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6, 2)


r = {"fp8kv": fp8kv.__version__, "unit": "us_per_call",
     "attention per layer": t(lambda: fp8kv.paged_attention(query, cache, tables, lens, out=out, backend="null")),
     "write per layer": t(lambda: fp8kv.write_kv(cache, key, value, slots, backend="null"))}
print(json.dumps(r))
out_path = pathlib.Path(__file__).resolve().parent / "results" / "dispatch_overhead_cpu_v0.1.0.json"
out_path.write_text(json.dumps(r, indent=2) + "\n")
