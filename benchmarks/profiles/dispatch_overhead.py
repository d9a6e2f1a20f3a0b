"""Per-layer host overhead of fp8kv's API: what the library adds around a kernel.

A do-nothing backend (``null``: claims every request, its op hooks return at once) is
registered for the measurement, so the time of an API call through it *is* the host
overhead: argument checks, metadata use, dispatch. Timed, in µs per call:

* ``attention, per layer``: ``paged_attention(q, cache, meta)`` with a prebuilt metadata
  (the engine path: nothing but shape/dtype checks and the backend call);
* ``write, per layer``: ``write_kv(cache, k, v, meta)`` with the metadata's slots;
* ``plan, per step``: ``plan_attention(...)`` (all value checks, selection, backend plan);
* ``attention, one-shot`` / ``write, one-shot``: the convenience forms, which plan inside
  every call;
* ``reference kernel``: the reference backend's own work for the same tiny decode, for scale.

Shape: the decode step of a 30-layer model such as SmolLM2 (batch 1, 9 KV heads, 3 query
heads per KV head, head size 64) on a short sequence, so the kernel does not hide the cost.
Run::

    python benchmarks/profiles/dispatch_overhead.py [--device cpu|cuda] [--repeat 7] [--number 2000] [--out X]

It prints a table and, with ``--out``, writes JSON with the machine line. Timings are medians over
``--repeat`` runs of ``--number`` calls (CUDA: the host time of enqueueing, after a synchronize per run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import timeit
from pathlib import Path

import torch

import fp8kv
from fp8kv import reference
from fp8kv.plugins import BackendInfo, hookimpl, register_backend


class NullBackend:
    """Claims everything, does nothing: its op time is the API's own host overhead."""

    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo("null", "0", priority=-1, description="does nothing (benchmark)", fast=False)

    @hookimpl
    def fp8kv_supports(self, device, request):
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        return None

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse):
        return None


def per_call_us(fn, number: int, repeat: int, device: torch.device) -> float:
    """Median µs per call of ``fn()`` (host time)."""
    fn()

    def run():
        for _ in range(number):
            fn()

    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(timeit.timeit(run, number=1))
    return statistics.median(times) / number * 1e6


def machine_line(device: torch.device) -> str:
    info = fp8kv.probe(device)
    return (f"{info.name}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads), Python {platform.python_version()}, {platform.system()} {platform.release()}, "
            f"fp8kv {fp8kv.__version__}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids pool wake-up noise)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for var in ("FP8KV_BACKEND", "FP8KV_SIMULATE_DEVICE", "FP8KV_STRICT", "FP8KV_CHECK"):
        os.environ.pop(var, None)
    dev = torch.device(args.device)
    register_backend(NullBackend())

    H, group, D, bs, L = 9, 3, 64, 16, 40
    cache = fp8kv.KVCache.allocate(8, bs, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head", device=dev)
    k = torch.randn(L, H, D, device=dev)
    fp8kv.write_kv_one_shot(cache, k, k, torch.arange(L, device=dev), backend="reference")
    key = value = torch.randn(1, H, D, device=dev)
    query = torch.randn(1, H * group, D, device=dev)
    tables = torch.arange(4, dtype=torch.int32, device=dev)[None]
    lens = torch.tensor([L + 1], dtype=torch.int32, device=dev)
    slots = torch.tensor([L], device=dev)
    out = torch.empty_like(query)
    plan_kw = dict(num_q_heads=H * group, query_dtype=query.dtype, block_tables=tables, seq_lens=lens,
                   slot_mapping=slots)
    meta_null = fp8kv.plan_attention(cache, **plan_kw, backend="null")
    meta_ref = fp8kv.plan_attention(cache, **plan_kw, backend="reference")
    cases = {
        "attention, per layer (metadata)": lambda: fp8kv.paged_attention(query, cache, meta_null, out=out),
        "write, per layer (metadata)": lambda: fp8kv.write_kv(cache, key, value, meta_null),
        "plan, per step": lambda: fp8kv.plan_attention(cache, **plan_kw, backend="null"),
        "attention, one-shot": lambda: fp8kv.paged_attention_one_shot(query, cache, tables, lens, out=out,
                                                                      backend="null"),
        "write, one-shot": lambda: fp8kv.write_kv_one_shot(cache, key, value, slots, backend="null"),
        "reference attention kernel": lambda: reference.paged_attention(query, cache, meta_ref, out, None),
    }
    results = {}
    for name, fn in cases.items():
        results[name] = round(per_call_us(fn, args.number, args.repeat, dev), 2)
        print(f"  {name:<34} {results[name]:>9.2f} µs", flush=True)

    line = machine_line(dev)
    layers = 30
    step = {"per_step_metadata_path_us": round(results["plan, per step"] + layers * (
        results["attention, per layer (metadata)"] + results["write, per layer (metadata)"]), 1),
        "per_step_one_shot_path_us": round(layers * (results["attention, one-shot"] + results["write, one-shot"]), 1)}
    print(f"fp8kv host overhead, µs per call (median of {args.repeat} x {args.number}), {dev.type}")
    print(f"machine: {line}")
    print(f"{'call':<34} {'µs':>9}")
    for name, v in results.items():
        print(f"{name:<34} {v:>9.2f}")
    print(f"a {layers}-layer decode step: metadata path {step['per_step_metadata_path_us']} µs of host overhead, "
          f"one-shot path {step['per_step_one_shot_path_us']} µs")
    record = {
        "benchmark": "dispatch_overhead", "unit": "us_per_call", "machine": line, "device": str(dev),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/profiles/dispatch_overhead.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "inputs": {"num_kv_heads": H, "num_q_heads": H * group, "head_size": D, "block_size": bs,
                   "seq_len": L + 1, "scale_granularity": "token_head", "query": "1 decode token, float32"},
        "repeat": args.repeat, "number": args.number, "results": results, "step": step,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
