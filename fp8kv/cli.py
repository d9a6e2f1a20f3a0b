"""``fp8kv`` command line: one sub-command per module in :mod:`fp8kv.commands`.

A command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; dropping such a module into ``fp8kv/commands/`` adds it.

Commands stay thin: measurement harnesses live outside the ``fp8kv`` package, in the
top-level package ``fp8kv_bench`` (``benchmarks/fp8kv_bench`` in the source tree), which a
command imports only when it runs, through :func:`load_harness`.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands
from ._version import __version__
from .errors import Fp8KVError

HARNESS = "fp8kv_bench"


def load_harness(module: str, command: str):
    """Import ``fp8kv_bench.<module>`` for ``fp8kv <command>``.

    Returns the module, or None after printing (to stderr, no traceback) that the harness is
    not installed; the command then exits with status 2. A module the harness itself imports
    being missing is a real error and keeps its traceback.
    """
    name = f"{HARNESS}.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (HARNESS, name):
            raise
        print(f"fp8kv {command}: error: needs the benchmark harness {name} (package {HARNESS!r}), which is "
              "not installed. It ships in the fp8kv source tree (benchmarks/fp8kv_bench) and is installed "
              "with it: pip install -e <fp8kv checkout>", file=sys.stderr)
        return None


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="fp8kv", description="FP8 KV cache and paged attention.")
    parser.add_argument("--version", action="version", version=f"fp8kv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        modules[mod.NAME] = mod
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except Fp8KVError as exc:
        print(f"fp8kv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
