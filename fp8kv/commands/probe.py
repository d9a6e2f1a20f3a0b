"""``fp8kv probe``: the device, every backend x op x format (can serve, or why not), and what ``auto`` picks.

The table asks each installed backend about one baseline request per op and format
(NHD layout, per-tensor scales, head size 128, bfloat16 I/O, or float16 before sm80,
decode), exactly as an API call would; backends that are not installed are not listed.

Exit status: 0, or 1 when the backend registry itself failed to load (the report says why);
2 for a bad ``--device`` or ``--simulate``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import textwrap

import torch

from .. import settings
from ..cli import device_arg
from ..formats import FORMATS
from ..probe import SIMULATED, DeviceInfo, probe, simulate_device
from ..registry import Registry, registry
from ..request import OPS, Request

NAME = "probe"
HELP = "show the device, which backend can serve what (and why not), and what 'auto' picks"

BASE_LAYOUT, BASE_GRANULARITY, BASE_HEAD_SIZE = "NHD", "tensor", 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", metavar="DEVICE", choices=list(SIMULATED),
                        help=f"answer for a simulated device: {', '.join(SIMULATED)}")
    parser.add_argument("--device", default=None, type=device_arg,
                        help="torch device to probe: cpu, cuda or cuda:N (default: cuda if present, else cpu)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def baseline_io_dtype(device: DeviceInfo) -> torch.dtype:
    """bfloat16, except float16 on NVIDIA GPUs without bf16 hardware (before sm80)."""
    return torch.float16 if device.sm is not None and device.sm < 80 else torch.bfloat16


def baseline_request(op: str, kv_dtype: str, device: DeviceInfo) -> Request:
    return Request(op, kv_dtype, BASE_LAYOUT, BASE_GRANULARITY, BASE_HEAD_SIZE, baseline_io_dtype(device),
                   device.device_type)


def build_report(device: DeviceInfo, reg: Registry | None = None) -> dict:
    """Everything ``fp8kv probe`` shows, as JSON-friendly data."""
    reg = reg or registry()
    support, auto = [], []
    for op in OPS:
        for fmt in FORMATS:
            answers = reg.explain(baseline_request(op, fmt, device), device)
            for name, reason in answers.items():
                support.append({"backend": name, "op": op, "kv_dtype": fmt, "ok": reason is None,
                                "reason": reason})
            pick = next((n for n, r in answers.items() if r is None and reg.allowed_for_auto(n)), None)
            auto.append({"op": op, "kv_dtype": fmt, "backend": pick,
                         "fast": pick is not None and reg.backends[pick].info.fast})
    io = baseline_io_dtype(device)
    return {
        "device": device.as_dict(),
        "device_line": device.describe(),
        "fp8_alias": device.fp8_alias,
        "baseline": {"layout": BASE_LAYOUT, "scale_granularity": BASE_GRANULARITY,
                     "head_size": BASE_HEAD_SIZE, "io_dtype": str(io).removeprefix("torch."),
                     "device_type": device.device_type, "features": []},
        "backends": [{"name": b.name, "version": b.info.version, "priority": b.info.priority,
                      "fast": b.info.fast, "distribution": b.distribution, "description": b.info.description}
                     for b in reg.ranked()],
        "faults": [{"name": f.name, "distribution": f.distribution, "where": f.where, "error": f.error}
                   for f in reg.faults],
        "error": None if reg.error is None else str(reg.error),
        "forced": settings.forced_backend(),
        "auto_backends": sorted(settings.auto_backends() or []),
        "support": support,
        "auto": auto,
        "device_notes": device_notes(device, reg),
    }


def device_notes(device: DeviceInfo, reg: Registry) -> dict[str, list[str]]:
    """Per backend, what it says about this device (codec per format, what was and was not run).

    Optional: a backend plugin object with a ``device_notes(device) -> list[str]`` method is
    asked; one that raises is skipped (its table cells already say everything required).
    """
    notes = {}
    for b in reg.ranked():
        fn = getattr(b.plugin, "device_notes", None)
        if not callable(fn):
            continue
        try:
            lines = [str(x) for x in fn(device)]
        except Exception:  # noqa: BLE001 - an optional extra: a failing one is left out
            continue
        if lines:
            notes[b.name] = lines
    return notes


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _pick(auto: dict) -> str:
    if auto["backend"] is None:
        return "none"
    return auto["backend"] + ("" if auto["fast"] else " (slow)")


def render(report: dict) -> str:
    """The human-readable report."""
    formats = list(FORMATS)
    base = report["baseline"]
    out = [f"device: {report['device_line']}",
           f"'fp8' means {report['fp8_alias']} here", ""]
    if report["error"]:
        out += [f"ERROR: {report['error']}", ""]
    out.append("backends (best first):" if report["backends"] else "backends: none installed")
    rows = [[b["name"], b["version"], f"priority {b['priority']}", "fast" if b["fast"] else "slow",
             f"from {b['distribution']}", b["description"]] for b in report["backends"]]
    out += _table(rows) if rows else []
    if report["faults"]:
        out += ["", "faults (these plugins are skipped or treated as refusing):"]
        for f in report["faults"]:
            what = "failed to load" if f["where"] == "load" else f"raised in {f['where']}"
            out.append(f"  {f['name']} ({f['distribution']}) {what}: {f['error']}")
    notes: dict[str, int] = {}

    def cell(ok: bool, reason: str | None) -> str:
        if ok:
            return "✓"
        return f"✗ [{notes.setdefault(reason, len(notes) + 1)}]"

    out += ["", f"support (requests: {base['layout']} layout, per-{base['scale_granularity']} scales, "
                f"head_size {base['head_size']}, {base['io_dtype']} on {base['device_type']}, decode; "
                "✓ = can serve):"]
    rows = [["backend", "op", *formats]]
    for b in report["backends"]:
        for op in OPS:
            rows.append([b["name"], op] + [
                next(cell(s["ok"], s["reason"]) for s in report["support"]
                     if s["backend"] == b["name"] and s["op"] == op and s["kv_dtype"] == f) for f in formats])
    out += _table(rows) if report["backends"] else ["  (no backend installed)"]
    for reason, n in notes.items():
        out.append(f"  [{n}] {reason}")
    out += ["", "auto picks:" + (f" (restricted by FP8KV_AUTO_BACKENDS={','.join(report['auto_backends'])})"
                                 if report["auto_backends"] else "")]
    rows = [["op", *formats]]
    for op in OPS:
        picks = {a["kv_dtype"]: a for a in report["auto"] if a["op"] == op}
        rows.append([op] + [_pick(picks[f]) for f in formats])
    out += _table(rows)
    if report["forced"]:
        out.append(f"  but FP8KV_BACKEND={report['forced']} forces that backend on every call")
    for name, lines in report.get("device_notes", {}).items():
        out += ["", f"{name} on this device:"] + [f"  {ln}" for ln in lines]
    out += [""] + [textwrap.fill(note, width=100, initial_indent="- ", subsequent_indent="  ")
                   for note in explain(report)]
    return "\n".join(out)


def explain(report: dict) -> list[str]:
    """Closing notes that say what the table means for this machine."""
    fast = [b["name"] for b in report["backends"] if b["fast"]]
    gpu = report["device"]["vendor"] != "cpu"
    lines = []
    if not fast:
        names = ", ".join(b["name"] for b in report["backends"])
        lines.append(f"Only slow backends are installed ({names or 'none'}): "
                     "the reference serves every request on any device in pure PyTorch float32; "
                     "it is the oracle, not a fast path. Install a fast backend plugin (a distribution "
                     "registering the 'fp8kv.backends' entry point) and it appears here.")
    slow_picks = [a for a in report["auto"] if a["backend"] and not a["fast"]]
    if gpu and slow_picks:
        lines.append("On this GPU, 'auto' landing on a slow backend warns once per request "
                     "(FP8KV_STRICT=1 makes it an error).")
    elif slow_picks:
        lines.append("On the CPU a slow backend is the expected one (torch, else the reference): 'auto' uses it "
                     "without a warning.")
    if any(a["backend"] is None for a in report["auto"]):
        lines.append("'none': no installed backend can serve that request; calls raise fp8kv.Fp8KVError "
                     "with every backend's reason.")
    lines.append("Other layouts, scale granularities, head sizes and features are decided per call; "
                 "force a backend with backend='name' or FP8KV_BACKEND=name.")
    return lines


def run(args: argparse.Namespace) -> int:
    ctx = simulate_device(args.simulate) if args.simulate else contextlib.nullcontext()
    with ctx:
        device = probe(args.device)
        report = build_report(device)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if report["error"] else 0
