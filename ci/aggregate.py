"""Regenerate ``ci/reports/MATRIX.md`` from the cells' reports: ``python -m ci aggregate``.

Rows: backend x op x mode x format x granularity (the two layouts folded); columns: the cells.
Claims come from :func:`ci.cells.claims` at aggregation time, so a backend that changes what it
supports changes the matrix with no hand edit; what verified each claim comes from the reports:

* ``passed``: a run (GPU) or CPU part ran that backend's tests and they passed;
* ``compiled``: the cell compiled every kernel variant serving that claim (its op, format and token
  or per-tensor/head scales) without error, shared memory over the limit or unbudgeted spill, not run;
* ``FAILED``: the part that verifies it failed or timed out (a sharded GPU part: any shard, or a
  shard without a report), or a kernel variant serving the claim failed to compile within limits;
* ``claimed``: claimed, but no report of the cell verifies it (e.g. the reference on a GPU cell
  without a run);
* ``-``: not claimed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .cells import ROOT, Claim, claims, load_cells

REPORTS = ROOT / "ci" / "reports"
GPU_TEST_OF = {"triton": "tests/test_triton_gpu.py", "hopper": "tests/test_hopper_gpu.py",
               "cuda": "tests/test_cuda_gpu.py", "reference": None}
CPU_BACKENDS = ("reference", "torch")
COMPILER_OF = {"cuda": "cuda", "triton": "triton"}

DECODE = "benchmarks/results/decode_h100.json"  # python benchmarks/decode.py on an H100 (FlashInfer timed in it)
PREFILL = "benchmarks/results/prefill_h100.json"  # python benchmarks/prefill.py on an H100
DECODE_SHAPES = ((32, 4096), (8, 32768), (64, 2048), (1, 131072))
DECODE_KERNELS = (("cuda_mma", "cuda"), ("fp8_mode_cuda", "hopper FP8 mode"))  # (row, label): sm90 decode
DECODE_TARGETS = (("frac_roofline", "fraction of the FP8 roofline", 0.80, ""),
                  ("vs:flashinfer_fp8_tc", "speed-up vs FlashInfer FP8", 1.20, "x"),
                  ("vs:sdpa_bf16", "speed-up vs SDPA bf16", 1.80, "x"))
TARGETS = [  # (what, file, how to read the measured value, target, unit); ratios > target are met
    *[(f"decode B={B} L={L} ({label}): {name}", DECODE, (row, B, L, field), target, unit)
      for field, name, target, unit in DECODE_TARGETS for row, label in DECODE_KERNELS for B, L in DECODE_SHAPES],
    *[(f"prefill 4x2048/2048, FP8 mode (hopper wgmma, {q} q_scale): speed-up vs FlashInfer bf16", PREFILL,
       (f"hopper fp8 {tag} wgmma (CUDA)", "4x2048 over 2048", "flashinfer"), 1.30, "x")
      for q, tag in (("per-head", "head-q"), ("dynamic", "dyn-q"))],
]


def _load(cell) -> dict[str, dict]:
    """The cell's part reports by part; a sharded GPU part is one record made of its shards'."""
    out = {}
    for part in ("cpu", "compile", "gpu"):
        path = REPORTS / cell.name / f"{part}.json"
        if path.is_file() and not (part == "gpu" and cell.gpu_shards > 1):
            out[part] = json.loads(path.read_text())
    if cell.kind == "run" and cell.gpu_shards > 1:
        shards = {k: REPORTS / cell.name / f"gpu-{k}.json" for k in range(1, cell.gpu_shards + 1)}
        recs = [json.loads(p.read_text()) for p in shards.values() if p.is_file()]
        if recs:
            out["gpu"] = _merge_shards(recs, missing=[k for k, p in shards.items() if not p.is_file()])
    return out


def _merge_shards(recs: list[dict], missing: list[int]) -> dict:
    """One GPU record from its shards': passed only if every shard has a report and passed."""
    last = max(recs, key=lambda r: r["date"])
    steps = [dict(st, name=f"{st['name']} (shard {r['shard'][0]})") for r in recs for st in r["steps"]]
    steps += [{"name": f"shard {k} (no report)", "rc": None, "timed_out": False} for k in missing]
    return {**last, "steps": steps, "budget_s": max(r["budget_s"] for r in recs),
            "passed": not missing and all(r["passed"] for r in recs),
            "timed_out": sum(r["timed_out"] for r in recs)}


def _variants(cell) -> dict[str, list[dict]]:
    """The per-variant results the cell's compile part wrote, by compiler (absent files left out)."""
    out = {}
    for compiler in cell.compile:
        path = REPORTS / cell.name / f"{compiler}_compile.json"
        if path.is_file():
            out[compiler] = json.loads(path.read_text())["results"]
    return out


def _serves(claim: Claim, variant: dict) -> bool:
    """Whether a compiled kernel variant is one that serves ``claim`` (op, format, token scales or not)."""
    if (claim.op == "write_kv") != ("write" in variant["kernel"]):
        return False
    if variant["fmt"] not in ("-", claim.kv_dtype):
        return False
    token = "token_head" in variant["label"] or "token_scales=1" in variant["label"]
    return token == (claim.scale_granularity == "token_head")


def _status(claim: Claim, cell, parts: dict[str, dict], variants: dict[str, list[dict]]) -> str:
    if cell.kind == "cpu":
        rec = parts.get("cpu")
        if rec and claim.backend in CPU_BACKENDS:
            return "passed" if rec["passed"] else "FAILED"
        return "claimed"
    gpu = parts.get("gpu")
    if gpu is not None and claim.backend in GPU_TEST_OF:
        test = GPU_TEST_OF[claim.backend]
        if test is None or test in cell.gpu_tests:
            return "passed" if gpu["passed"] else "FAILED"
    comp = parts.get("compile")
    compiler = COMPILER_OF.get(claim.backend)
    if comp is not None and compiler in cell.compile:
        step = next((s for s in comp["steps"] if s["name"].startswith(compiler)), None)
        if step is None:
            return "claimed"
        results = variants.get(compiler)
        if step.get("timed_out") or not results:  # no per-variant record: the step decides
            return "compiled" if step["rc"] == 0 else "FAILED"
        mine = [r for r in results if _serves(claim, r)]
        if not mine:
            return "FAILED"  # claimed, but none of its kernels was compiled
        bad = any(r.get("problems") or not r.get("ok", True) for r in mine)
        return "FAILED" if bad else "compiled"
    return "claimed"


def _verdict(rec: dict) -> str:
    """A part's outcome in words: passed, or FAILED with why (a time-out is a failure)."""
    if rec["passed"]:
        return "passed"
    why = []
    if rec.get("timed_out"):
        names = [s["name"] for s in rec["steps"] if s.get("timed_out")]
        why.append(f"timed out in its {rec['budget_s']:.0f}-s budget ({', '.join(names)})")
    failed = [s["name"] for s in rec["steps"] if not s.get("timed_out") and s.get("rc") != 0]
    if failed:
        why.append(f"{', '.join(failed)} failed")
    return f"FAILED ({'; '.join(why)})" if why else "FAILED"


def _bench_rows() -> list[str]:
    rows = ["| benchmark | measured | target | met | source |", "|---|---|---|---|---|"]
    for what, path, key, target, unit in TARGETS:
        p = ROOT / path
        value = None
        if p.is_file():
            rec = json.loads(p.read_text())
            if "rows" in rec:
                impl, B, L, field = key
                at = {r["what"]: r for r in rec["rows"] if r["B"] == B and r["L"] == L}
                if field.startswith("vs:"):
                    base = at.get(field[3:])
                    value = base["ms"] / at[impl]["ms"] if base and impl in at else None
                else:
                    value = at.get(impl, {}).get(field)
            else:
                impl, shape, base = key
                rs = [r for r in rec["results"] if r["shape"] == shape]
                mine = next((r["ms"] for r in rs if r["impl"] == impl), None)  # (the exact row: names share prefixes)
                theirs = next((r["ms"] for r in rs if r["impl"].startswith(base)), None)
                value = theirs / mine if mine and theirs else None
        shown = "-" if value is None else (f"{value:.3f}{unit}" if unit else f"{100 * value:.1f}%")
        goal = f"{target:.2f}{unit}" if unit else f"{100 * target:.0f}%"
        met = "-" if value is None else ("yes" if value >= target else "no")
        rows.append(f"| {what} | {shown} | {goal} | {met} | `{path}` |")
    return rows


def render() -> str:
    cells = load_cells()
    table: dict[tuple, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    reports = {name: _load(cell) for name, cell in cells.items()}
    for name, cell in cells.items():
        variants = _variants(cell)
        for c in claims(name):
            key = (c.backend, c.op, c.mode, c.kv_dtype, c.scale_granularity)
            table[key][name].add((_status(c, cell, reports[name], variants), c.layout))
    lines = ["# Hardware CI matrix", "",
             "Generated by `python -m ci aggregate` from `ci/matrix.toml`, the claims the backend registry makes "
             "for each cell's device, and the reports under `ci/reports/<cell>/`. Entries: **passed** (run and "
             "passed), **compiled** (compiled only), **FAILED**, *claimed* (claimed, not verified by a report), "
             "`-` (not claimed). Layouts NHD and HND are folded (both claimed unless one is named).", ""]
    lines.append("## Cells\n")
    lines.append("| cell | kind | runner | budget | report |")
    lines.append("|---|---|---|---|---|")
    for name, cell in cells.items():
        parts = reports[name]
        rep = ", ".join(f"{p}: {_verdict(r)} ({r['date'][:10]}, {r['device']['name']})"
                        for p, r in parts.items()) or "none yet"
        lines.append(f"| {name} | {cell.kind} | `{cell.runner}` | {cell.budget_s} s | {rep} |")
    lines += ["", "## Claims", "",
              "| backend | op | mode | format | granularity | " + " | ".join(cells) + " |",
              "|" + "---|" * (5 + len(cells))]
    for key in sorted(table):
        row = []
        for name in cells:
            got = table[key].get(name)
            if not got:
                row.append("-")
                continue
            statuses = {s for s, _ in got}
            layouts = {lay for _, lay in got}
            s = "FAILED" if "FAILED" in statuses else min(statuses, key=("passed", "compiled", "claimed").index)
            row.append(s + ("" if len(layouts) == 2 else f" ({next(iter(layouts))})"))
        lines.append("| " + " | ".join(key) + " | " + " | ".join(row) + " |")
    lines += ["", "## Latest benchmark ratios against their targets (H100)", "", *_bench_rows(), ""]
    return "\n".join(lines)


def main_aggregate(out: str | None = None) -> int:
    text = render()
    path = Path(out) if out else REPORTS / "MATRIX.md"
    path.write_text(text)
    print(f"wrote {path} ({text.count(chr(10))} lines)")
    return 0
