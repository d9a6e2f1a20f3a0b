"""Time one launch configuration of a Triton kernel and name the kernels it compiled (registers, spills).

Shared by ``benchmarks/fp32_decode_probe.py`` and ``benchmarks/fp32_prefill_probe.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


def compiled_kernels(*fns) -> set[tuple]:
    """``(name, n_regs, n_spills)`` of every kernel the Triton JIT functions ``fns`` have compiled."""
    out = set()
    for fn in fns:
        for dc in getattr(fn, "device_caches", {}).values():
            cache = dc[0] if isinstance(dc, tuple) else dc
            for k in cache.values():
                out.add((fn.__name__, getattr(k, "n_regs", None), getattr(k, "n_spills", None)))
    return out


def time_config(rows: list, label: str, name: str, cfg, run: Callable[[], None], kernels: Callable[[], set],
                bench: Callable[[Callable[[], None]], float]) -> None:
    """Run ``run`` once (compiling), then time it with ``bench`` (ms); append a row and print it."""
    import torch

    try:
        before = kernels()
        run()
        torch.cuda.synchronize()
        new = sorted(kernels() - before, key=str)
        ms = bench(run)
    except Exception as e:  # noqa: BLE001 - a configuration that fails is a result
        print(label, name, "failed", type(e).__name__, str(e)[:300], flush=True)
        return
    rows.append({"q": label, "variant": name, "us": ms * 1e3, "cfg": dataclasses.asdict(cfg),
                 "new_kernels": [list(k) for k in new]})
    print(f"{label:15s} {name:18s} {ms * 1e3:9.1f} us  m={cfg.block_m} n={cfg.block_n} w={cfg.num_warps} "
          f"st={cfg.num_stages} splits={cfg.num_splits} kernels {new}", flush=True)
