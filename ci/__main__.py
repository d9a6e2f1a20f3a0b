"""``python -m ci``: the hardware CI matrix (see ci/__init__.py).

    python -m ci cells                      # the cells of ci/matrix.toml
    python -m ci claims CELL                # what the registry claims for CELL's device
    python -m ci run CELL [--part P] [--shard K] [--out DIR] [--budget S]
    python -m ci run sm90 --part sanitize-memcheck   # the GPU tests under compute-sanitizer
    python -m ci aggregate [--out PATH]     # regenerate ci/reports/MATRIX.md
"""

from __future__ import annotations

import argparse

from .runner import TOOLS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ci", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("cells")
    c = sub.add_parser("claims")
    c.add_argument("cell")
    r = sub.add_parser("run")
    r.add_argument("cell")
    r.add_argument("--part", choices=("cpu", "compile", "gpu", *(f"sanitize-{t}" for t in TOOLS)))
    r.add_argument("--out")
    r.add_argument("--budget", type=float)
    r.add_argument("--shard", type=int, help="GPU shard K (1-based) of a cell with gpu_shards > 1")
    a = sub.add_parser("aggregate")
    a.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd == "cells":
        from .cells import load_cells

        for cell in load_cells().values():
            print(f"{cell.name:8s} {cell.kind:8s} {cell.runner:14s} {cell.budget_s:5d} s  compile={list(cell.compile)}"
                  f"  gpu_tests={list(cell.gpu_tests)}")
        return 0
    if args.cmd == "claims":
        from .cells import claims

        for cl in claims(args.cell):
            print(cl.backend, cl.op, cl.mode, cl.kv_dtype, cl.scale_granularity, cl.layout)
        return 0
    if args.cmd == "run":
        from .runner import main_run

        return main_run(args.cell, args.part, args.out, args.budget, args.shard)
    from .aggregate import main_aggregate

    return main_aggregate(args.out)


if __name__ == "__main__":
    raise SystemExit(main())
