"""What every benchmark shares: its command line, the results record, progress, tables and the plot.

A benchmark is a module of this package with

* ``NAME``: the results' stem (``benchmarks/results/<NAME>_<device>.json``);
* ``add_arguments(parser)``: its own options (``--out``/``--json`` and ``--plot`` are common);
* ``run(args) -> dict``: measures and returns the record (:func:`record`); a long run may save
  partial records on the way with ``args.save(record)``;
* ``table(record) -> str`` and ``plot(record, plt) -> Figure``, both from the record alone, so
  ``--plot FILE`` redraws any saved result anywhere;
* optionally ``exit_status(record) -> int`` (default 0).

:func:`main` runs one: parse, measure, write the JSON (device, versions, date and the command that
produced it), print the table, draw the PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import plotting

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""``benchmarks/results`` of the source tree (the default place of a benchmark's record)."""

_DISTRIBUTIONS = {"triton": ("triton",), "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy"),
                  "flashinfer": ("flashinfer-python", "flashinfer"), "transformers": ("transformers",)}


# ------------------------------------------------------------------------------------ the record


def versions() -> dict:
    """Python, torch (and its CUDA), fp8kv and, where installed, Triton, CuPy, FlashInfer, transformers."""
    import torch

    import fp8kv

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "fp8kv": fp8kv.__version__}
    for module, dists in _DISTRIBUTIONS.items():
        version = getattr(sys.modules.get(module), "__version__", None)
        if version is None and importlib.util.find_spec(module) is not None:
            for dist in dists:
                try:
                    version = importlib.metadata.version(dist)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        out[module] = version
    return out


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def environment(device=None, **extra) -> dict:
    """The machine and software of a run: ``device`` (the GPU's name, or the CPU's with its cores and
    torch threads), its capability, :func:`versions`, the platform and the date (UTC)."""
    import torch

    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        info = {"device": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device)),
                "sms": torch.cuda.get_device_properties(device).multi_processor_count}
    else:
        info = {"device": f"cpu: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"}
    info.update(versions())
    info.update(platform=platform.platform(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra)
    return info


def command() -> str:
    """The command line of this process, as typed from the source tree's root where it ran there."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        try:
            argv[0] = os.path.relpath(argv[0], RESULTS.parents[1])
        except ValueError:
            pass
        argv.insert(0, "python")
    elif argv and os.path.basename(argv[0]) == "fp8kv":
        argv[0] = "fp8kv"
    return shlex.join(argv)


def record(benchmark: str, device=None, **fields) -> dict:
    """A results record: ``benchmark``, the ``command`` that produced it, its ``environment``, then
    ``fields`` (rows, configuration...)."""
    return {"benchmark": benchmark, "command": command(), "environment": environment(device), **fields}


def device_tag(env: dict) -> str:
    """A short name of the recorded device for file names: ``h100``, ``h200``, ``a100``... or ``cpu``."""
    name = str(env.get("device", "cpu"))
    if name.startswith("cpu"):
        return "cpu"
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.removeprefix("NVIDIA "))
    if found:
        return found.group(1).lower()
    cap = env.get("capability")
    return f"sm{cap[0]}{cap[1]}" if isinstance(cap, list | tuple) and len(cap) == 2 else "gpu"


def default_path(benchmark: str, rec: dict) -> Path:
    """``benchmarks/results/<benchmark>_<device tag>.json``."""
    return RESULTS / f"{benchmark}_{device_tag(rec.get('environment', {}))}.json"


def write_json(path, rec: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")


def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------ output


def progress(items: Iterable, desc: str = "", total: int | None = None) -> Iterator:
    """``items`` with a progress bar (tqdm where installed, else one line per item)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    total = total if total is not None else len(items)
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(items):
            print(f"[{i + 1}/{total}] {desc} {item if isinstance(item, str | int | tuple) else ''}".rstrip(),
                  flush=True)
            yield item
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stdout, dynamic_ncols=True)


def log(text: str) -> None:
    """Print a line, above a running progress bar if there is one."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(text, flush=True)
        return
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def markdown(header: list[str], rows: Iterable[Iterable]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def title(rec: dict) -> str:
    """One line naming the device, the versions and the date of a record (for plots)."""
    env = rec.get("environment", {})
    parts = [str(env.get("device", "?"))]
    parts += [f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "flashinfer", "fp8kv") if env.get(k)]
    return ", ".join([*parts, str(env.get("date", ""))[:10]])


# ------------------------------------------------------------------------------------ the runner


def add_output_options(p: argparse.ArgumentParser, out_help: str, shapes: bool = False) -> None:
    """``--out``/``--json`` (the results JSON, its plot beside it), ``--plot`` (only redraw a saved result) and,
    with ``shapes``, the decode shapes ``--shapes B:L,...``."""
    p.add_argument("--out", "--json", dest="out", default=None, metavar="JSON", help=out_help)
    p.add_argument("--plot", metavar="JSON", default=None,
                   help="only redraw the plot (and print the table) of a saved result (any machine)")
    if shapes:
        p.add_argument("--shapes", default="", help="B:L,B:L,... (default: the decode benchmark's four)")


def parser(bench) -> argparse.ArgumentParser:
    doc = (bench.__doc__ or bench.NAME).strip()
    p = argparse.ArgumentParser(prog=f"benchmarks/{bench.NAME}.py", description=doc.split("\n\n")[0],
                                epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_options(p, f"write the results here (default: benchmarks/results/{bench.NAME}_<device>.json); "
                          "the plot goes beside it (.png)")
    bench.add_arguments(p)
    return p


def parse(bench, argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (its defaults for anything ``argv`` leaves out)."""
    args = parser(bench).parse_args(argv)
    args.save = _saver(bench, args)
    return args


def _saver(bench, args):
    def save(rec: dict) -> str:
        path = args.out or default_path(bench.NAME, rec)
        write_json(path, rec)
        return str(path)

    return save


def main(bench, argv: list[str] | None = None) -> int:
    """Run benchmark module ``bench`` as a script (see the module docstring)."""
    args = parse(bench, argv)
    if args.plot:
        rec = load_json(args.plot)
        print(bench.table(rec))
        plotting.draw(bench.plot, rec, args.plot)
        return 0
    rec = bench.run(args)
    if rec is None:  # (a profiling run: nothing measured)
        return 0
    path = args.save(rec)
    print()
    print(bench.table(rec))
    print(f"wrote {path}", flush=True)
    plotting.draw(bench.plot, rec, path)
    status = getattr(bench, "exit_status", None)
    return status(rec) if status else 0
