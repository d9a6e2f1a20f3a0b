"""Compile the CUDA kernels for GPUs that are not here: ``python -m fp8kv_cuda.compile``.

Uses NVRTC from PyPI (``nvidia-cuda-nvrtc-cu12`` through ``cuda-bindings<13``, the
``cuda-compile`` extra) on a CPU-only machine: no GPU, driver or toolkit headers needed. Each
variant is compiled to a cubin for each architecture with ptxas' verbose report (``-Xptxas -v``),
from which registers, spill stores/loads, stack frame and static shared memory are read.

CUDA 12 is required for sm70 (CUDA 13's NVRTC refuses ``sm_70``); 12.x compiles sm70..sm90.

Sets: ``representative`` (CPU CI, tests/test_cuda_compile.py: one variant per kernel and format
class and the heaviest tiles) and ``full`` (every format, dtype, granularity, head size and
query-head packing the runtime can launch; the CI matrix's compile cells).

    python -m fp8kv_cuda.compile --arch sm70 --arch sm90 --set full --json out.json

Exits 1 when a variant fails to compile or a hot kernel spills.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from .variants import (
    FORMAT_NAMES,
    FP8_MODE_MIN_SM,
    MMA_MIN_SM,
    MMA_TILES,
    MMA_WARPS,
    MMA_WAVE_TILES,
    Variant,
    arch_target,
    attention_mma_variant,
    attention_tile,
    attention_variant,
    mma_arch_serves,
    options,
    prefill_arch_serves,
    prefill_variant,
    prefill_wgmma_variant,
    source,
    write_d_pad,
    write_variant,
)

ARCHES = ("sm70", "sm75", "sm80", "sm86", "sm89", "sm90")
HOT_KERNELS = ("fp8kv_write_kv", "fp8kv_paged_attention", "fp8kv_paged_attention_mma", "fp8kv_merge",
               "fp8kv_prefill_wgmma", "fp8kv_prefill_wmma")
"""Kernels in which any spill fails the compile cell: the kernels ``auto``'s picks run on their fast
path (sm90's wgmma prefill and Volta's wmma prefill included: ``auto`` picks them where they
serve). Not yet the mma prefill
kernels (``fp8kv_prefill_mma[_exact]``, reported with their spills): ``auto`` reaches them only on sm90,
for the steps the wgmma kernel cannot take (a KV split, an unaligned query) and the CTAs it hands back
(docs/cuda.md)."""
WGMMA_ARCH = "sm90"
"""The architecture of the ``sm_90a`` kernels (``variants.SM90A_KERNELS``), compiled only for it."""


def hot_kernels(arch: str) -> tuple[str, ...]:
    """The hot kernels compiled for ``arch`` (the tensor-core kernels only where they serve at all)."""
    mma = mma_arch_serves(int(arch[2:]), "fp8_e4m3", 128, "float16")
    volta = int(arch[2:]) < MMA_MIN_SM
    return tuple(k for k in HOT_KERNELS if (k != "fp8kv_paged_attention_mma" or mma)
                 and (k != "fp8kv_prefill_wgmma" or arch == WGMMA_ARCH) and (k != "fp8kv_prefill_wmma" or volta))


@dataclass
class Result:
    """One (variant, architecture, entry point): what ptxas reported."""

    arch: str
    kernel: str
    fmt: str
    label: str
    ok: bool
    regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    smem: int | None = None
    seconds: float = 0.0
    error: str = ""

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what}: {err}")


def compile_cubin(variant: Variant, arch: str) -> tuple[bytes, str]:
    """Compile one variant for ``arch`` (``"sm70"``...): the cubin and NVRTC's log (with ptxas -v).

    Raises RuntimeError with the log on a compile error.
    """
    return _compile(variant, arch_target(variant.kernel, int(arch[2:])), ptx=False)


def compile_ptx(variant: Variant, arch: str) -> str:
    """The PTX of one variant for ``arch``'s virtual architecture (``"sm75"`` -> ``compute_75``):
    what ``FP8KV_CUDA_ARCH`` has the driver JIT-compile on a newer GPU (fp8kv_cuda.runtime)."""
    image, _ = _compile(variant, arch_target(variant.kernel, int(arch[2:])).replace("sm_", "compute_"), ptx=True)
    return image.rstrip(b"\x00").decode()


def _compile(variant: Variant, gpu_arch: str, ptx: bool) -> tuple[bytes, str]:
    return compile_text(source(variant.kernel), f"{variant.kernel}.cu", options(variant), gpu_arch, ptx,
                        variant.label)


def compile_text(src: str, name: str, opts, gpu_arch: str, ptx: bool = False, label: str = "") -> tuple[bytes, str]:
    """Compile CUDA source ``src`` with NVRTC options ``opts`` for ``gpu_arch`` (``"sm_90a"``,
    ``"compute_75"``): the cubin (with ptxas -v in the log) or the PTX, and NVRTC's log. Other
    in-tree backends' CPU compile tests use it (fp8kv_hopper's sm_90a kernel)."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        verbose = () if ptx else ("-Xptxas", "-v")
        opts = [o.encode() for o in (*opts, f"--gpu-architecture={gpu_arch}", *verbose)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: they must be mutable. (`b" " * n` was used here:
        # for n == 1, an empty log, that is CPython's cached one-byte object b" ", which NVRTC then
        # overwrote with a NUL, turning every later space written through bytes into a NUL.)
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.decode(errors="replace").rstrip("\x00")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{label or name} for {gpu_arch}: {err}\n{text}")
        get_size, get = (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else (nvrtc.nvrtcGetCUBINSize,
                                                                                nvrtc.nvrtcGetCUBIN)
        _, size = get_size(prog)
        image = bytearray(size)
        (err,) = get(prog, image)
        _check(err, "nvrtcGetPTX" if ptx else "nvrtcGetCUBIN")
        return bytes(image), text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+a?)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """``{entry point: {regs, spill_stores, spill_loads, stack, smem}}`` from a ptxas -v log."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), {"smem": 0})
        elif current is not None and (m := _STACK.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            current["regs"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["smem"] = int(s.group(1))
    return out


def variants(set_name: str = "representative", arch: str = "sm90") -> list[Variant]:
    """The variants of a set (see the module docstring) that ``arch`` launches."""
    sm = int(arch[2:])
    if set_name == "representative":
        out = []
        for fmt, io in (("fp8_e4m3", "bfloat16"), ("fp8_e5m2fnuz", "float32")):  # OCP and fnuz classes
            for tok in (False, True):
                out.append(write_variant(fmt, io, tok, write_d_pad(128), vec=True, slot64=True))
        out.append(write_variant("fp8_e5m2", "float16", True, write_d_pad(40), vec=False, slot64=False))
        for fmt, io, tok, d, g, vec in (("fp8_e4m3", "bfloat16", False, 128, 4, 16),
                                        ("fp8_e5m2", "float16", True, 128, 16, 16),
                                        ("fp8_e4m3fnuz", "float32", True, 256, 16, 16),
                                        ("fp8_e5m2fnuz", "bfloat16", False, 40, 8, 8)):
            out.append(attention_variant(fmt, io, tok, *attention_tile(d, g), vec=vec))
        for fmt, io, d, w, tok in (("fp8_e4m3", "bfloat16", 128, 6, False),
                                   ("fp8_e5m2", "float16", 256, 4, True),
                                   ("fp8_e5m2fnuz", "bfloat16", 128, 8, True),
                                   ("fp8_e4m3fnuz", "float16", 64, 4, False),
                                   ("fp8_e4m3", "float16", 128, 6, True)):
            if mma_arch_serves(sm, fmt, d, io):
                out.append(attention_mma_variant(fmt, io, d, w, tok, sm))
        if sm >= FP8_MODE_MIN_SM:  # the FP8 attention mode's decode (the Hopper backend's)
            out.append(attention_mma_variant("fp8_e4m3", "bfloat16", 128, 6, False, sm, fp8_attention=True))
        for fmt, io in (("fp8_e4m3", "bfloat16" if sm >= 80 else "float16"), ("fp8_e5m2fnuz", "float16")):
            if prefill_arch_serves(sm, fmt, 128, io):
                out.append(prefill_variant(fmt, io, 128, sm))
        if arch == WGMMA_ARCH:  # both loaders (TMA, cp.async), both query types
            out += [prefill_wgmma_variant("bfloat16", True, True), prefill_wgmma_variant("float16", False, False)]
        return out
    if set_name == "full":
        out = []
        for fmt, io, tok in itertools.product(FORMAT_NAMES, ("float32", "float16", "bfloat16"), (False, True)):
            for d in (64, 128, 256):
                out.append(write_variant(fmt, io, tok, write_d_pad(d), vec=True, slot64=True))
                for g in (1, 4, 8, 16):
                    out.append(attention_variant(fmt, io, tok, *attention_tile(d, g), vec=16))
                if d in MMA_TILES and mma_arch_serves(sm, fmt, d, io):
                    waves = sorted(set(MMA_WAVE_TILES.get(d, {}).values())) if sm == 90 else []
                    tiles = [(w, None, None) for w in MMA_WARPS] + waves
                    out += [attention_mma_variant(fmt, io, d, w, tok, sm, stages=s, nsub=n) for w, s, n in tiles]
                    if fmt == "fp8_e4m3" and not tok and sm >= FP8_MODE_MIN_SM:
                        out += [attention_mma_variant(fmt, io, d, w, False, sm, fp8_attention=True, stages=s, nsub=n)
                                for w, s, n in tiles]
                if not tok and prefill_arch_serves(sm, fmt, d, io):
                    out.append(prefill_variant(fmt, io, d, sm))
        if arch == WGMMA_ARCH:
            out += [prefill_wgmma_variant(io, pingpong, tma)
                    for io, pingpong, tma in itertools.product(("bfloat16", "float16"), (True, False), (True, False))]
        return out
    raise ValueError(f"set: got {set_name!r}, expected 'representative' or 'full'")


def compile_one(variant: Variant, arch: str) -> list[Result]:
    t0 = time.perf_counter()
    try:
        _, log = compile_cubin(variant, arch)
    except RuntimeError as exc:
        return [Result(arch, variant.kernel, variant.fmt, variant.label, False, seconds=time.perf_counter() - t0,
                       error=str(exc)[-2000:])]
    dt = time.perf_counter() - t0
    info = parse_ptxas(log)
    results = []
    for entry in variant.entry_points:
        i = info.get(entry)
        if i is None or "regs" not in i:
            results.append(Result(arch, entry, variant.fmt, variant.label, False, seconds=dt,
                                  error=f"no ptxas report for {entry}:\n{log[-2000:]}"))
            continue
        results.append(Result(arch, entry, variant.fmt, variant.label, True, i["regs"], i.get("spill_stores"),
                              i.get("spill_loads"), i.get("stack"), i.get("smem"), dt))
    return results


def run(arches: tuple[str, ...] = ARCHES, set_name: str = "representative", jobs: int = 2) -> list[Result]:
    """Compile every variant of ``set_name`` for every arch (``jobs`` NVRTC compiles at a time)."""
    work = [(v, a) for a in arches for v in variants(set_name, a)]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return [r for rs in pool.map(lambda va: compile_one(*va), work) for r in rs]


def failures(results: list[Result]) -> list[str]:
    """Why the cell fails: compile errors, and any spill in a hot kernel."""
    bad = [f"{r.arch} {r.label}: {r.error.splitlines()[0] if r.error else 'failed'}" for r in results if not r.ok]
    bad += [f"{r.arch} {r.kernel} ({r.label}): {r.spill_stores} bytes spill stores, {r.spill_loads} loads"
            for r in results if r.ok and r.kernel in HOT_KERNELS and r.spills]
    return bad


def table(results: list[Result]) -> str:
    """Markdown: per architecture and kernel, the worst registers, spills and shared memory."""
    rows = ["| arch | kernel | variants | max registers | spill bytes | max static smem |",
            "|---|---|---|---|---|---|"]
    key = lambda r: (r.arch, r.kernel)  # noqa: E731
    for (arch, kernel), group in itertools.groupby(sorted((r for r in results if r.ok), key=key), key=key):
        g = list(group)
        rows.append(f"| {arch} | {kernel} | {len(g)} | {max(r.regs or 0 for r in g)} | "
                    f"{sum(r.spills for r in g)} | {max(r.smem or 0 for r in g)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8kv_cuda.compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=ARCHES, help="repeatable; default: all of them")
    ap.add_argument("--set", default="representative", choices=("representative", "full"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    arches = tuple(args.arch or ARCHES)
    try:
        version = nvrtc_version()
    except ImportError as exc:
        print(f"fp8kv_cuda.compile: error: NVRTC bindings missing ({exc}); pip install -e '.[cuda-compile]'",
              file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    results = run(arches, args.set, args.jobs)
    elapsed = time.perf_counter() - t0
    print(f"NVRTC {version[0]}.{version[1]}, set {args.set}, {len(results)} kernels in {elapsed:.1f} s")
    print(table(results))
    bad = failures(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nvrtc": f"{version[0]}.{version[1]}", "set": args.set, "arches": list(arches),
                       "results": [asdict(r) for r in results], "failures": bad}, f, indent=1)
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
