"""``fp8kv`` command line: one sub-command per module in :mod:`fp8kv.commands`.

A command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; dropping such a module into ``fp8kv/commands/`` adds it.

Commands stay thin: measurement harnesses live outside the ``fp8kv`` package, in the
top-level package ``fp8kv_bench`` (``benchmarks/fp8kv_bench`` in the source tree), which a
command imports only when it runs, through :func:`load_harness`.

Exit status (decided here, in :func:`main`, and nowhere else):

* **0**: success.
* **1**: a refusal or a failure. The command line was fine, but this machine, this
  installation or this input cannot do it: ``fp8kv plan`` refusing a KV-cache dtype for the
  checkpoint on the device (the refusal is the command's answer, printed on stdout),
  :class:`~fp8kv.errors.Unsupported`, :class:`~fp8kv.errors.BackendFailure`,
  :class:`~fp8kv.errors.PluginError`, a missing optional package or harness
  (:class:`MissingPackage`), ``bench`` without a CUDA device, an ``OSError`` (a file that
  cannot be read or written), ``probe`` finding the backend registry broken. Also a closed
  standard output (``fp8kv probe --json | head -c 10``): the command stops quietly with 1,
  as Python's documentation recommends for ``BrokenPipeError``; the output already written
  went through, and nothing is printed (no traceback).
* **2**: a usage error: something typed on the command line (or set in an ``FP8KV_*``
  variable) is wrong, and changing it fixes it. argparse's own errors (unknown flags or
  choices, ``--simulate nonsense``), values argparse accepts but fp8kv refuses (``--device
  garbage``; ``--device cuda`` on a torch without CUDA; ``--seqs 0``; a checkpoint path that
  does not exist; a ``--json`` file in a directory that does not exist) and any
  :class:`~fp8kv.errors.InvalidArgument` raised by a command (``--backend nosuch``).
  Values are checked before any work starts.
* **130**: interrupted (Ctrl-C), quietly.

Errors are one line on stderr, ``fp8kv <command>: error: <message>``, as argparse writes
them (argparse adds its usage line above). No user mistake, refusal, ``Fp8KVError``,
``OSError`` or missing optional package prints a traceback; any other exception is a bug
in fp8kv and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pkgutil
import sys

from . import commands
from ._version import __version__
from .errors import Fp8KVError, InvalidArgument

HARNESS = "fp8kv_bench"

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(InvalidArgument):
    """A command-line value fp8kv refuses, found after parsing (exit 2)."""


class Refusal(Fp8KVError):
    """The command line is fine, but this machine, installation or input cannot do it (exit 1)."""


class MissingPackage(Refusal):
    """An optional package (or the benchmark harness) a command needs is not installed (exit 1)."""


def exit_code(exc: BaseException) -> int:
    """The exit status for an exception a command raised (see the module docstring)."""
    if isinstance(exc, InvalidArgument):
        return EXIT_USAGE
    return EXIT_FAILURE


# -- argparse types: a bad value is a usage error (exit 2) naming the flag, before any work ---------------


def _parsed(text: str, parse, what: str, ok) -> int | float:
    """``parse(text)``, refused as ``what`` unless ``ok(value)``: a usage error naming the value."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"got {value if isinstance(value, int) else repr(text)}, expected {what}")
    return value


def positive_int(text: str) -> int:
    """``type=`` for counts and sizes: an integer >= 1."""
    return _parsed(text, int, "a positive integer (>= 1)", lambda v: v >= 1)


def positive_float(text: str) -> float:
    """``type=`` for factors: a finite number > 0."""
    return _parsed(text, float, "a finite number > 0", lambda v: math.isfinite(v) and v > 0)


def device_arg(text: str) -> str:
    """``type=`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N`` that this torch can use.

    Returns the string as given (commands pass it on and may print it or write it to JSON).
    """
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"got {text!r}, expected cpu, cuda or cuda:<index>") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"got {text!r}, expected cpu, cuda or cuda:<index> "
                                         "(fp8kv runs on the CPU and on CUDA/ROCm GPUs)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch has no CUDA" if torch.version.cuda is None and torch.version.hip is None
                   else "no CUDA device is available (torch.cuda.is_available() is False)")
            raise argparse.ArgumentTypeError(f"{text}: {why} (torch {torch.__version__})")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s)")
    return text


def existing_path(text: str) -> str:
    """``type=`` for an input path that must exist (anything else about it is the command's to judge)."""
    try:
        os.stat(text)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory") from None
    except (OSError, ValueError):
        pass  # exists but unreadable, or an odd name: the command reports it, with its reason
    return text


def output_path(text: str) -> str:
    """``type=`` for a file a command writes at the end: its directory must exist now."""
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    return text


def load_harness(module: str, command: str):
    """Import ``fp8kv_bench.<module>`` for ``fp8kv <command>``.

    Raises :class:`MissingPackage` (exit 1, one line, no traceback) if the harness is not
    installed. A module the harness itself imports being missing is a real error and keeps
    its traceback.
    """
    name = f"{HARNESS}.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (HARNESS, name):
            raise
        raise MissingPackage(f"needs the benchmark harness {name} (package {HARNESS!r}), which is not "
                             "installed. It ships in the fp8kv source tree (benchmarks/fp8kv_bench) and is "
                             "installed with it: pip install -e <fp8kv checkout>") from None


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="fp8kv", description="FP8 KV cache and paged attention.",
                                     epilog="exit status: 0 success, 1 refusal or failure, 2 usage error")
    parser.add_argument("--version", action="version", version=f"fp8kv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        modules[mod.NAME] = mod
    return parser, modules


def _error(command: str, message: object) -> None:
    """``fp8kv <command>: error: <message>`` on stderr; silent if stderr is closed too."""
    try:
        print(f"fp8kv {command}: error: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _stdout_closed() -> int:
    """Standard output's reader went away: send what Python still holds for it to /dev/null (so
    nothing fails again at exit) and stop with 1, as the ``signal`` module's documentation shows."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return EXIT_FAILURE  # not a real file (called in-process with a replaced stdout)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    """Run ``fp8kv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    argparse's usage errors raise ``SystemExit(2)`` as usual (``--help``/``--version``:
    ``SystemExit(0)``).
    """
    command = "COMMAND"
    try:
        parser, modules = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            sys.stdout.flush()
            return EXIT_USAGE
        command = args.command
        code = int(modules[command].run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here when the output was buffered
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (Fp8KVError, OSError) as exc:
        _error(command, exc)
        return exit_code(exc)


if __name__ == "__main__":  # python -m fp8kv.cli: run the one fp8kv.cli the commands import
    from fp8kv.cli import main as _main

    sys.exit(_main())
