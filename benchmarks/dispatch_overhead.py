"""Per-call overhead of fp8kv's API (validation + backend selection) on tiny CPU inputs.

For ``write_kv`` and ``paged_attention`` (decode) it times, in µs per call:

* ``api``: the public call with ``backend="auto"`` (validation, cached selection, dispatch);
* ``api_forced``: the same with ``backend="reference"``;
* ``direct``: the reference backend's function called directly with prepared arguments;
* ``select``: ``fp8kv.select_backend`` alone (a cache hit), and ``probe``: ``fp8kv.probe`` alone.

``overhead = api - direct`` is what the API adds; the inputs are tiny so that the kernel
time does not hide it. Selections are cached per (device, request), so ``select`` is a
dictionary lookup plus hashing. Run::

    python benchmarks/dispatch_overhead.py [--repeat 7] [--number 2000] [--threads 1]

It prints a table and writes ``benchmarks/results/dispatch_overhead_cpu.json`` with the
machine line. Timings are medians over ``--repeat`` runs of ``--number`` calls.
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
from fp8kv.hookspecs import Request

RESULTS = Path(__file__).resolve().parent / "results" / "dispatch_overhead_cpu.json"


def per_call_us(fn, number: int, repeat: int) -> float:
    """Median µs per call of ``fn()``."""
    fn()  # warm up (and fill the selection cache)
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(times) / number * 1e6


def machine_line() -> str:
    info = fp8kv.probe("cpu")
    return (f"{info.name}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads), Python {platform.python_version()}, {platform.system()} {platform.release()}, "
            f"fp8kv {fp8kv.__version__}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids pool wake-up noise)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for var in ("FP8KV_BACKEND", "FP8KV_SIMULATE_DEVICE", "FP8KV_STRICT"):
        os.environ.pop(var, None)

    H, D, bs = 1, 16, 4
    cache = fp8kv.KVCache.allocate(4, bs, H, D, kv_dtype="fp8_e4m3")
    key, value = torch.randn(1, H, D), torch.randn(1, H, D)
    slots = torch.tensor([5])
    query = torch.randn(1, H, D)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    qsl = torch.arange(2, dtype=torch.int32)
    out = torch.empty_like(query)
    fp8kv.write_kv(cache, torch.randn(6, H, D), torch.randn(6, H, D), torch.tensor([0, 1, 2, 3, 4, 5]),
                   backend="reference")
    requests = {op: Request(op, "fp8_e4m3", "NHD", "tensor", D, torch.float32, "cpu")
                for op in ("write_kv", "paged_attention")}
    auto = {op: fp8kv.select_backend(r, "cpu").backend.name for op, r in requests.items()}
    req = requests["write_kv"]
    cases = {
        "write_kv": {
            "api": lambda: fp8kv.write_kv(cache, key, value, slots),
            "api_forced": lambda: fp8kv.write_kv(cache, key, value, slots, backend="reference"),
            "direct": lambda: reference.write_kv(cache, key, value, slots),
        },
        "paged_attention": {
            "api": lambda: fp8kv.paged_attention(query, cache, tables, lens, out=out),
            "api_forced": lambda: fp8kv.paged_attention(query, cache, tables, lens, out=out,
                                                        backend="reference"),
            "direct": lambda: reference.paged_attention(query, cache, tables, lens, qsl, 1, D**-0.5, True,
                                                        None, None, out),
        },
        "selection": {
            "select": lambda: fp8kv.select_backend(req, "cpu"),
            "probe": lambda: fp8kv.probe("cpu"),
        },
    }
    results: dict = {}
    for op in ("selection", "write_kv", "paged_attention"):
        fns = cases[op]
        results[op] = {name: round(per_call_us(fn, args.number, args.repeat), 2) for name, fn in fns.items()}
        if "direct" in fns:
            r = results[op]
            api = r["api"] if auto[op] == "reference" else r["api_forced"]  # same backend as "direct"
            r["overhead"] = round(api - r["direct"], 2)
            r["validation"] = round(r["overhead"] - results["selection"]["select"], 2)
            r["auto_picks"] = auto[op]

    line = machine_line()
    print(f"fp8kv dispatch overhead, µs per call (median of {args.repeat} x {args.number}), tiny CPU inputs")
    print(f"machine: {line}")
    sel = results["selection"]
    print(f"{'op':<16} {'api':>8} {'forced':>8} {'direct':>8} {'overhead':>9} {'select':>7} {'checks':>7}"
          "  auto picks")
    for op in ("write_kv", "paged_attention"):
        r = results[op]
        print(f"{op:<16} {r['api']:>8.2f} {r['api_forced']:>8.2f} {r['direct']:>8.2f} {r['overhead']:>9.2f} "
              f"{sel['select']:>7.2f} {r['validation']:>7.2f}  {r['auto_picks']}")
    print(f"select_backend (cached, includes probe): {sel['select']:.2f} µs; probe(): {sel['probe']:.2f} µs; "
          "checks = overhead - select (argument validation, incl. reading slot/length values)")
    if any(results[op]["auto_picks"] != "reference" for op in ("write_kv", "paged_attention")):
        print("note: 'auto' picked another backend here; overhead is computed from the forced reference call")
    record = {
        "benchmark": "dispatch_overhead", "unit": "us_per_call", "machine": line,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "inputs": {"num_blocks": 4, "block_size": bs, "num_kv_heads": H, "head_size": D, "write_tokens": 1,
                   "attention": "decode, 1 sequence of 6 tokens", "kv_dtype": "fp8_e4m3",
                   "io_dtype": "float32"},
        "repeat": args.repeat, "number": args.number, "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
