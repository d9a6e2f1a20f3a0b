"""The matrix's cells (``ci/matrix.toml``) and what each one claims.

A cell's claims are derived, never listed: for the cell's (simulated) device the backend registry
answers every request the probe would ask about, over every op x format x layout x granularity
(and the FP8 attention mode), exactly as ``fp8kv probe --simulate CELL`` does for its baseline
request. A backend that changes what it supports changes the claims, and so the matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from fp8kv.cache import LAYOUTS
from fp8kv.formats import FORMATS as ALL_FORMATS
from fp8kv.scales import GRANULARITIES

ROOT = Path(__file__).resolve().parent.parent
MATRIX = Path(__file__).resolve().parent / "matrix.toml"
KINDS = ("cpu", "compile", "run")
COMPILERS = ("cuda", "triton")
FORMATS = tuple(ALL_FORMATS)
MODES = ("default", "fp8_attention")


@dataclass(frozen=True)
class Cell:
    """One device cell of the matrix."""

    name: str
    kind: str
    runner: str
    budget_s: int
    compile: tuple[str, ...] = ()
    gpu_tests: tuple[str, ...] = field(default=())
    compile_budget_s: int = 0
    """Time limit of the compile part (default: ``budget_s``)."""
    kit_examples: int = 0
    """Run cells: Hypothesis examples per conformance-kit test under the ``thorough`` profile
    (randomized: each run draws new workloads), sized to fit ``budget_s``; 0: the profile's own."""
    gpu_shards: int = 1
    """Run cells: the GPU tests split into this many jobs (pytest-split, balanced by the durations in
    ``ci/durations/<cell>.json``), each with its own ``budget_s``, as a CI service runs shards."""


def load_cells(path: Path = MATRIX) -> dict[str, Cell]:
    """The cells of ``matrix.toml``, checked (kinds, compilers, budgets, test files)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    cells = {}
    for name, c in data.get("cells", {}).items():
        cell = Cell(name, c["kind"], c["runner"], int(c["budget_s"]), tuple(c.get("compile", ())),
                    tuple(c.get("gpu_tests", ())), int(c.get("compile_budget_s", c["budget_s"])),
                    int(c.get("kit_examples", 0)), int(c.get("gpu_shards", 1)))
        if cell.kind not in KINDS:
            raise ValueError(f"cell {name}: kind {cell.kind!r}, expected one of {KINDS}")
        if not set(cell.compile) <= set(COMPILERS):
            raise ValueError(f"cell {name}: compile {cell.compile}, expected a subset of {COMPILERS}")
        if cell.budget_s <= 0:
            raise ValueError(f"cell {name}: budget_s must be positive")
        if cell.kit_examples < 0 or (cell.kit_examples and cell.kind != "run"):
            raise ValueError(f"cell {name}: kit_examples {cell.kit_examples}, expected >= 0, on run cells only")
        if cell.gpu_shards < 1 or (cell.gpu_shards > 1 and cell.kind != "run"):
            raise ValueError(f"cell {name}: gpu_shards {cell.gpu_shards}, expected >= 1, above 1 on run cells only")
        if (cell.kind == "run") != bool(cell.gpu_tests):
            raise ValueError(f"cell {name}: gpu_tests belong to run cells (and every run cell has some)")
        for t in cell.gpu_tests:
            if not (ROOT / t).is_file():
                raise ValueError(f"cell {name}: gpu test file {t} does not exist")
        cells[name] = cell
    return cells


@dataclass(frozen=True, order=True)
class Claim:
    """One row of the matrix: a backend claims an op for this format, layout and granularity."""

    backend: str
    op: str
    mode: str
    kv_dtype: str
    scale_granularity: str
    layout: str


def claims(cell: str) -> list[Claim]:
    """Every (backend, op, mode, format, granularity, layout) the registry says the cell's device serves.

    Requests are those of the probe's baseline (head size 128, bfloat16 I/O on a GPU, float32 on the
    CPU); the attention request asks for chunked prefill, and in the FP8 mode for ``fp8_attention``.
    Each backend is asked directly (the registry's per-device answer cache is not consulted).
    """
    import torch

    from fp8kv.plugins import Request
    from fp8kv.probe import simulated
    from fp8kv.registry import registry

    device = simulated(cell)
    backends = registry().ranked()
    dtype = "cpu" if device.vendor == "cpu" else "cuda"
    io = torch.float32 if dtype == "cpu" else torch.bfloat16
    out = []
    for fmt in FORMATS:
        for gran in GRANULARITIES:
            for layout in LAYOUTS:
                requests = [("write_kv", "default", Request("write_kv", fmt, layout, gran, 128, io, dtype))]
                for mode in MODES:
                    feats = {"chunked_prefill"} | ({"fp8_attention"} if mode == "fp8_attention" else set())
                    requests.append(("paged_attention", mode,
                                     Request("paged_attention", fmt, layout, gran, 128, io, dtype, frozenset(feats))))
                for op, mode, req in requests:
                    for b in backends:
                        if _answer(b, device, req) is None:
                            out.append(Claim(b.name, op, mode, fmt, gran, layout))
    return sorted(set(out))


def _answer(backend, device, request) -> str | None:
    """The backend's own answer for the cell's device, as on that machine: Triton's CPU interpreter
    (``TRITON_INTERPRET``, set while this repository's tests run) is not the cell's environment."""
    from fp8kv.probe import interpreter_ignored

    with interpreter_ignored():
        return backend.supports(device, request)
