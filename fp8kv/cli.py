"""``fp8kv`` command line: one sub-command per module in :mod:`fp8kv.commands`.

A command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; dropping such a module into ``fp8kv/commands/`` adds it.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands
from ._version import __version__
from .errors import Fp8KVError


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
