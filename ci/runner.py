"""Run one cell: ``python -m ci run CELL [--part compile|gpu|cpu] [--out DIR] [--budget S]``.

* ``cpu`` (the CI machine): the conformance kit over the CPU backends' claims (``tests/test_conformance.py``,
  ``tests/test_torch_backend.py``, ``tests/test_fp8_attention.py``) with the derandomized ``ci`` Hypothesis
  profile (the ``thorough`` one, 2000 examples a test, is for GPU cells: on 2 CPU cores it outruns any budget).
* ``compile`` (any CPU): every compiler the cell lists compiles its kernel variants for the cell's target
  (``python -m fp8kv_cuda.compile``, ``python -m fp8kv_triton.aot``) and records registers and spills.
* ``sanitize-<tool>`` (a run cell's GPU): the cell's GPU tests under ``compute-sanitizer --tool <tool>``
  (memcheck, racecheck, initcheck, synccheck), failed by any sanitizer error (see :func:`sanitize_step`).
* ``gpu`` (a run cell's GPU): first confirms the device is the cell's architecture, then the cell's GPU
  test files (``-m gpu``) under the randomized ``thorough`` Hypothesis profile, with the cell's
  ``kit_examples`` per conformance-kit test (``FP8KV_GPU_EXAMPLES``: sized to the cell's budget, new
  workloads every run), and the Hopper prefill benchmark where it applies. A cell with
  ``gpu_shards`` N > 1 runs as N jobs, ``--shard 1`` .. ``--shard N`` (pytest-split, balanced by
  ``ci/durations/<cell>.json``), each in its own budget and report ``gpu-K.json``; the last one
  runs the benchmark.

Every part writes JUnit XML (pytest parts), ``<part>.json`` (device, driver, versions, commit, date,
passed/failed/timed-out counts, exit codes) and ``SUMMARY.md`` under ``ci/reports/<cell>/`` (or ``--out``).
A step that runs past the budget is killed and counted as **failed** (``timed_out``), never as unfinished.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .cells import ROOT, Cell, load_cells

CPU_TESTS = ("tests/test_conformance.py", "tests/test_torch_backend.py", "tests/test_fp8_attention.py")


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "triton", "cupy", "fp8kv"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - not installed here
            out[mod] = None
    return out


def _device() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "arch": None, "driver": None, "cuda": None}
    major, minor = torch.cuda.get_device_capability()
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"name": torch.cuda.get_device_name(), "arch": f"sm{major}{minor}", "driver": driver,
            "cuda": torch.version.cuda}


def _commit() -> str | None:
    if os.environ.get("FP8KV_CI_COMMIT"):  # a machine given a copy of the tree, not its history
        return os.environ["FP8KV_CI_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _step(name: str, cmd: list[str], deadline: float, env: dict | None = None, log: Path | None = None) -> dict:
    """Run one command until the cell's deadline; a time-out is a failure."""
    left = deadline - time.monotonic()
    t0 = time.monotonic()
    if left <= 0:
        return {"name": name, "cmd": cmd, "rc": None, "timed_out": True, "seconds": 0.0}
    print(f"[ci] {name}: {' '.join(cmd)} (at most {left:.0f} s)", flush=True)
    # its own process group: a time-out stops the step's worker processes too
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = p.communicate(timeout=left)
        rc, timed_out = p.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate()
        rc, timed_out = None, True
    if log is not None:
        log.write_text(text)
    print(text[-2000:], flush=True)
    return {"name": name, "cmd": cmd, "rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1)}


def _junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped of a pytest JUnit file (zeros when absent)."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if not path.is_file():
        return counts
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            counts[{"failures": "failed"}.get(key, key)] += int(s.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def _gpu_env(cell: Cell) -> dict:
    """The GPU tests' environment: the ``thorough`` profile, the cell's examples per kit test
    (``FP8KV_GPU_EXAMPLES`` in the caller's environment wins, for a longer soak)."""
    env = {"HYPOTHESIS_PROFILE": "thorough"}
    examples = os.environ.get("FP8KV_GPU_EXAMPLES") or (str(cell.kit_examples) if cell.kit_examples else None)
    if examples:
        env["FP8KV_GPU_EXAMPLES"] = examples
    return env


DURATIONS = ROOT / "ci" / "durations"
"""Per-cell test durations (pytest-split's JSON: node id -> seconds) that balance a cell's GPU shards."""


def shard_args(cell: Cell, shard: int | None) -> list[str]:
    """pytest-split's arguments for GPU shard ``shard`` (1-based) of ``cell`` ([] for one shard)."""
    if cell.gpu_shards == 1:
        if shard not in (None, 1):
            raise SystemExit(f"shard: got {shard}, but cell {cell.name} has one GPU shard")
        return []
    if shard is None or not 1 <= shard <= cell.gpu_shards:
        raise SystemExit(f"shard: got {shard}, expected 1..{cell.gpu_shards} (cell {cell.name} has "
                         f"{cell.gpu_shards} GPU shards: run each with --shard K)")
    if importlib.util.find_spec("pytest_split") is None:
        raise SystemExit("the GPU shards need pytest-split (pip install pytest-split)")
    args = ["--splits", str(cell.gpu_shards), "--group", str(shard), "--splitting-algorithm", "least_duration"]
    durations = DURATIONS / f"{cell.name}.json"
    if durations.is_file():
        args += ["--durations-path", str(durations)]
    return args


TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
"""compute-sanitizer's tools, each a part ``sanitize-<tool>`` of a run cell."""


def sanitize_step(cell: Cell, tool: str, out: Path, deadline: float) -> dict:
    """The cell's GPU tests under ``compute-sanitizer --tool <tool>``; the step passes only when
    the tests pass and the sanitizer reports no error.

    Every CUDA allocation is its own (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so an access past a
    tensor is past its allocation, which memcheck sees; the xdist workers are followed
    (``--target-processes all``). The ``ci`` Hypothesis profile keeps the instrumented run short.
    ``FP8KV_SANITIZE_SELECT`` (a pytest ``-k`` expression) narrows the tests."""
    if tool not in TOOLS:
        raise SystemExit(f"part: got sanitize-{tool}, expected one of {[f'sanitize-{t}' for t in TOOLS]}")
    dev = _device()
    if dev["arch"] != cell.name:
        raise SystemExit(f"cell {cell.name}: this machine is {dev['name']}, not {cell.name}")
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    select = os.environ.get("FP8KV_SANITIZE_SELECT")
    log = out / f"sanitize-{tool}.log"
    cmd = ["compute-sanitizer", "--tool", tool, "--target-processes", "all", "--print-limit", "20",
           "--error-exitcode", "86", "--log-file", str(out / f"sanitize-{tool}.%p.txt"),
           sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *workers,
           f"--junitxml={out / f'sanitize-{tool}.xml'}", *(["-k", select] if select else []), *cell.gpu_tests]
    step = _step(f"GPU tests under compute-sanitizer {tool}", cmd, deadline,
                 env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "HYPOTHESIS_PROFILE": "ci"}, log=log)
    step["sanitizer"] = sanitizer_summary(sorted(out.glob(f"sanitize-{tool}.*.txt")))
    return step


def sanitizer_summary(logs: list[Path]) -> dict:
    """Errors per process log (``ERROR SUMMARY: N errors``) and the first error lines."""
    errors, processes, first = 0, 0, []
    for path in logs:
        text = path.read_text(errors="replace")
        found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
        processes += bool(found)
        errors += sum(int(n) for n in found)
        first += [line for line in text.splitlines() if line.startswith("=========") and "Invalid" in line][:5]
    return {"processes": processes, "errors": errors, "first_errors": first[:20]}


def part_name(cell: Cell, part: str, shard: int | None) -> str:
    """The report's name: ``gpu``, or ``gpu-K`` for shard K of a sharded cell."""
    return f"{part}-{shard}" if part == "gpu" and cell.gpu_shards > 1 else part


def run_part(cell: Cell, part: str, out: Path, budget: float, shard: int | None = None) -> dict:
    """Run ``part`` of ``cell`` (GPU shard ``shard`` of a sharded run cell); returns the record also
    written to ``out/<name>.json`` (name: :func:`part_name`)."""
    out.mkdir(parents=True, exist_ok=True)
    name = part_name(cell, part, shard)
    split = shard_args(cell, shard) if part == "gpu" else []
    deadline = time.monotonic() + budget
    steps, junit = [], {}
    py = sys.executable
    if part == "cpu":
        xml = out / "cpu_kit.xml"
        steps.append(_step("conformance kit (ci profile)", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                         f"--junitxml={xml}", *CPU_TESTS], deadline,
                           env={"HYPOTHESIS_PROFILE": "ci"}, log=out / "cpu_kit.log"))
        junit["cpu_kit"] = _junit_counts(xml)
    elif part == "compile":
        if "cuda" in cell.compile:
            steps.append(_step("cuda kernels (NVRTC 12)", [py, "-m", "fp8kv_cuda.compile", "--arch", cell.name,
                                                           "--set", "full", "--json", str(out / "cuda_compile.json")],
                               deadline, log=out / "cuda_compile.log"))
        if "triton" in cell.compile:
            steps.append(_step("triton kernels (AOT)", [py, "-m", "fp8kv_triton.aot", "--target", cell.name,
                                                        "--set", "full", "--jobs", "2", "--json",
                                                        str(out / "triton_compile.json"), "--baseline",
                                                        str(ROOT / "ci/reports/compile/nvidia_spill_baseline.json")],
                               deadline, log=out / "triton_compile.log"))
    elif part == "gpu":
        dev = _device()
        if dev["arch"] != cell.name:
            raise SystemExit(f"cell {cell.name}: this machine is {dev['name']} ({dev['arch']}), not {cell.name}")
        tests = name.replace("gpu", "gpu_tests")
        xml = out / f"{tests}.xml"
        workers = []
        if importlib.util.find_spec("xdist") is not None:  # pytest-xdist where installed: one GPU, 8 workers
            workers = ["-n", str(min(8, os.cpu_count() or 1))]
        steps.append(_step("GPU tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *workers,
                                         f"--junitxml={xml}", *split, *cell.gpu_tests], deadline,
                           env=_gpu_env(cell),
                           log=out / f"{tests}.log"))
        junit[tests] = _junit_counts(xml)
        if cell.name == "sm90" and (shard or 1) == cell.gpu_shards:  # the last shard runs the benchmark
            steps.append(_step("hopper prefill benchmark", [py, "benchmarks/prefill.py", "--shapes", "4x2048+2048",
                                                            "--json", str(out / "bench_hopper_prefill.json")],
                               deadline, log=out / "bench.log"))
    elif part.startswith("sanitize-"):
        steps.append(sanitize_step(cell, part.removeprefix("sanitize-"), out, deadline))
        junit[part] = _junit_counts(out / f"{part}.xml")
    else:
        raise SystemExit(f"part: got {part!r}, expected cpu, compile, gpu or sanitize-TOOL ({', '.join(TOOLS)})")
    record = {
        "cell": cell.name, "part": part, "shard": [shard or 1, cell.gpu_shards] if part == "gpu" else None,
        "runner": cell.runner, "budget_s": budget, "device": _device(),
        "versions": _versions(), "commit": _commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "steps": steps, "junit": junit,
        "hypothesis": _gpu_env(cell) if part == "gpu" else {"HYPOTHESIS_PROFILE": "ci"} if part != "compile" else None,
        "passed": all(s["rc"] == 0 for s in steps) and bool(steps),
        "timed_out": sum(s["timed_out"] for s in steps), "failed_steps": sum(s["rc"] != 0 for s in steps),
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    write_summary(out)
    return record


def write_summary(out: Path) -> None:
    """``SUMMARY.md`` of every part recorded in ``out``."""
    lines = [f"# CI cell {out.name}", ""]
    for path in sorted(out.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or "part" not in rec:
            continue
        dev, ver = rec["device"], rec["versions"]
        shard = rec.get("shard")
        title = rec["part"] + (f" (shard {shard[0]} of {shard[1]})" if shard and shard[1] > 1 else "")
        lines += [f"## {title}: {'passed' if rec['passed'] else 'FAILED'}", "",
                  f"device {dev['name']} ({dev['arch']}), driver {dev['driver']}, CUDA {dev['cuda']}; "
                  f"torch {ver['torch']}, triton {ver['triton']}, cupy {ver['cupy']}, fp8kv {ver['fp8kv']}; "
                  f"{rec['date']}; budget {rec['budget_s']} s"
                  + (f"; Hypothesis {rec['hypothesis']}" if rec.get("hypothesis") else ""), "",
                  "| step | exit | timed out | seconds |", "|---|---|---|---|"]
        lines += [f"| {s['name']} | {s['rc']} | {s['timed_out']} | {s['seconds']} |" for s in rec["steps"]]
        for s in rec["steps"]:
            if "sanitizer" in s:
                z = s["sanitizer"]
                lines.append(f"\ncompute-sanitizer: {z['errors']} errors in {z['processes']} processes")
        for name, c in rec["junit"].items():
            lines.append(f"\n{name}: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                         f"{c['skipped']} skipped")
        lines.append("")
    (out / "SUMMARY.md").write_text("\n".join(lines))


def main_run(cell_name: str, part: str | None, out: str | None, budget: float | None,
             shard: int | None = None) -> int:
    cells = load_cells()
    if cell_name not in cells:
        raise SystemExit(f"cell: got {cell_name!r}, expected one of {list(cells)}")
    cell = cells[cell_name]
    part = part or {"cpu": "cpu", "compile": "compile", "run": "gpu"}[cell.kind]
    where = Path(out) if out else ROOT / "ci" / "reports" / cell.name
    rec = run_part(cell, part, where, budget or (cell.compile_budget_s if part == "compile" else cell.budget_s),
                   shard)
    return 0 if rec["passed"] else 1
