"""Ahead-of-time compile of the Triton backend's kernels, without a GPU: ``python -m fp8kv_triton.aot``.

Every kernel variant the backend claims on a target is compiled by Triton's real compiler
(not the interpreter) for ``GPUTarget("hip", "gfx942", 64)``, ``("hip", "gfx950", 64)``,
``("cuda", 80 | 86 | 89 | 90, 32)``: TTIR -> TTGIR -> LLVM -> AMDGCN/hsaco or
PTX/cubin. This catches "does not compile on that architecture" on a CPU-only machine, and
the compiled metadata gives the resources: registers (VGPR/SGPR on AMD, from the AMDGCN
metadata; ``n_regs`` on NVIDIA), spills and shared memory (LDS). A compile error, a spill or
shared memory above the target's limit is a failure.

Variants are built with the codec policy of :mod:`fp8kv_triton.capabilities` (the encoder
and decoder the backend would really use on that arch) and the launch configuration of
:func:`fp8kv_triton.attention.choose_config` / :func:`fp8kv_triton.write.write_kv`
(wavefront-aware warps on AMD).

* ``--set full`` (the CI matrix's compile cells): every format x I/O dtype x scale
  granularity x head-size class claimed there (64, 128, 256; AMD up to 128) x attention shape (decode, split-KV decode
  with LSE, prefill), the write kernel per format x input dtype x granularity x head-size
  class, and the split-KV reduce per head-size class;
* ``--set representative`` (``.ci/run`` and tests/test_aot_compile.py): one variant per kernel
  and format class (OCP, fnuz) with the codec the policy picks.

TRITON_INTERPRET must be unset in the compiling process (the interpreter replaces
``triton.jit``); the CLI refuses to run otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

TARGETS = {
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
    "sm80": ("cuda", 80, 32),
    "sm86": ("cuda", 86, 32),
    "sm89": ("cuda", 89, 32),
    "sm90": ("cuda", 90, 32),
}
"""Name -> ``GPUTarget(backend, arch, warp_size)`` arguments."""

SHARED_LIMIT = {"gfx942": 64 << 10, "gfx950": 160 << 10, "sm80": 163 << 10, "sm86": 99 << 10, "sm89": 99 << 10,
                "sm90": 227 << 10}
"""Shared memory (LDS) per workgroup a launch may use, in bytes."""

FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")
HEAD_SIZES_FULL = (64, 128, 256)
IO_DTYPES = ("float16", "bfloat16", "float32")

_ATTN_PTRS = {"Q": "*fp16", "KC": "*u8", "VC": "*u8", "KS": "*fp32", "VS": "*fp32", "BT": "*i32",
              "SEQ_LENS": "*i32", "QSL": "*i32", "OUT": "*fp16", "PACC": "*fp32", "PM": "*fp32", "PL": "*fp32",
              "LSE": "*fp32", "sm_scale": "fp32", "soft_cap": "fp32", "stride_kb": "i64", "stride_vb": "i64",
              "stride_ksb": "i64", "stride_vsb": "i64"}
_TL_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
ALIGNED_INTS = frozenset({"D", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh",
                          "k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh"})
"""Integer arguments compiled as multiples of 16 (head size and K/V cache strides, as in a typical call)."""


@dataclass
class Variant:
    """One kernel specialisation: the kernel, a label, its argument types, constexprs and launch options."""

    kernel: str
    label: str
    fmt: str
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int = 1


@dataclass
class Result:
    target: str
    kernel: str
    label: str
    fmt: str
    ok: bool
    seconds: float
    num_warps: int
    num_stages: int
    regs: int | None = None
    vgpr: int | None = None
    sgpr: int | None = None
    spills: int = 0
    sgpr_spills: int = 0
    scratch: int = 0
    shared: int = 0
    occupancy: int | None = None
    error: str = ""
    problems: list[str] = field(default_factory=list)


def target_arch(target: str) -> str:
    """The codec policy's arch name of a target (``gfx942``, ``sm90``...)."""
    return target


def _is_amd(target: str) -> bool:
    return TARGETS[target][0] == "hip"


def _attn_variants(target: str, fmt: str, io: str, token: bool, D: int, shape: str) -> Variant:
    import torch
    import triton.language as tl

    from fp8kv.formats import FORMATS as ALL

    from .attention import FULL_P_KEYS, choose_config
    from .capabilities import codec_for
    from .codec import codec_args

    a = codec_args(ALL[fmt])
    choice = codec_for(target_arch(target), ALL[fmt], interpret=False)
    dtype = getattr(torch, io)
    decode = shape != "prefill"
    cfg = choose_config(torch.device("cpu"), group=8, head_size=D, num_seqs=1 if shape == "split" else 64,
                        num_kv_heads=8, max_query_len=1 if decode else 512, max_keys=8192, interpret=False,
                        query_dtype=dtype, arch=target_arch(target))
    split = shape == "split"
    block_d = max(16, 1 << (D - 1).bit_length())
    sig = dict(_ATTN_PTRS, Q=_TL_PTR[io], OUT=_TL_PTR[io])
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, EVEN_D=block_d == D,
                  FULL_P_KEYS=FULL_P_KEYS, PAGE_POW2=True, USE_CAP=False, TOKEN_SCALES=token, Q_BITS=False,
                  SPLIT=split, WRITE_LSE=split or shape == "lse",
                  QK_DT={"float16": tl.float16, "bfloat16": tl.bfloat16, "float32": tl.float32}[io],
                  PV_F32=io == "float32", PV_SPLIT=cfg.pv_split, DEC_MODE=choice.decoder, F_KIND=a.fp8_kind,
                  F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias, F_DROP=a.drop_bits, F_FNUZ=a.fnuz,
                  F_HASINF=a.has_inf, F_MAXMAG=a.max_mag, F_BIAS=a.bias)
    kernel = "_attn_kernel"
    if cfg.decode:  # one query token per sequence: the decode kernel (fp8kv_triton.decode)
        kernel = "_decode_kernel"
        consts["V_REGS"] = cfg.v_regs
    else:
        consts["PREFETCH_BT"] = cfg.num_stages > 1
    label = (f"attn {shape} {io} {'token_head' if token else 'tensor'} D{D} "
             f"M{cfg.block_m} N{cfg.block_n} dec={choice.decoder_name}")
    return Variant(kernel, label, fmt, sig, consts, cfg.num_warps, cfg.num_stages)


def _reduce_variant(target: str, D: int, token: bool) -> Variant:
    sig = {"PACC": "*fp32", "PM": "*fp32", "PL": "*fp32", "VS": "*fp32", "OUT": "*bf16", "LSE": "*fp32"}
    block_d = max(16, 1 << (D - 1).bit_length())
    from .attention import reduce_warps

    return Variant("_reduce_kernel", f"reduce D{D} {'token_head' if token else 'tensor'}", "-", sig,
                   dict(BLOCK_S=16, BLOCK_D=block_d, TOKEN_SCALES=token, WRITE_LSE=True),
                   reduce_warps(target_arch(target)))


def _write_variant(target: str, fmt: str, src: str, token: bool, D: int) -> Variant:
    from fp8kv.formats import FORMATS as ALL

    from .capabilities import codec_for
    from .codec import ENC_NATIVE, codec_args
    from .write import write_launch

    a = codec_args(ALL[fmt])
    choice = codec_for(target_arch(target), ALL[fmt], interpret=False)
    block_d, block_rows, warps = write_launch(D, target_arch(target), token)
    src_kind = {"float32": 0, "float16": 1, "bfloat16": 2}[src]
    sig = {n: "*u8" for n in ("kc_ptr", "vc_ptr")} | {n: "*fp32" for n in ("ks_ptr", "vs_ptr")} | {
        "key_ptr": "*fp32" if src_kind == 0 else "*i16", "value_ptr": "*fp32" if src_kind == 0 else "*i16",
        "slot_ptr": "*i64", "k_sb": "i64", "v_sb": "i64", "ks_sb": "i64", "vs_sb": "i64"}
    consts = dict(PAGE_POW2=True, BLOCK_R=block_rows, BLOCK_D=block_d, SRC_KIND=src_kind, TOKEN_SCALES=token,
                  ENC=int(choice.encoder == ENC_NATIVE), F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias,
                  F_DROP=a.drop_bits, F_MAXBITS=a.max_f32_bits, F_MAXSHIFT=a.max_shift, F_NANBYTE=a.nan_byte,
                  F_FNUZ=a.fnuz, F_KIND=a.fp8_kind, F_MAX=a.fmt_max)
    label = f"write {src} {'token_head' if token else 'tensor'} D{D} R{block_rows} enc={choice.encoder_name}"
    return Variant("_write_kv_kernel", label, fmt, sig, consts, warps)


def claimed_formats(target: str) -> tuple[str, ...]:
    """The formats the backend serves on ``target`` (every format today: see capabilities.supports)."""
    return FORMATS


def claimed_head_sizes(target: str) -> tuple[int, ...]:
    """The head-size classes claimed on ``target`` (AMD: up to 128, see capabilities.AMD_MAX_HEAD_SIZE)."""
    from .capabilities import AMD_MAX_HEAD_SIZE

    return tuple(d for d in HEAD_SIZES_FULL if not _is_amd(target) or d <= AMD_MAX_HEAD_SIZE)


def variants(target: str, which: str = "representative") -> list[Variant]:
    """The kernel variants of ``which`` set (``representative`` or ``full``) on ``target``."""
    out: list[Variant] = []
    fmts = claimed_formats(target)
    heads = claimed_head_sizes(target)
    if which == "representative":
        # one variant per kernel and format class (OCP, fnuz), with the policy's codec; the
        # shapes alternate so that decode, split-KV and prefill tiles are all compiled
        for fmt, shape, token, io in (("fp8_e4m3", "decode", False, "bfloat16"),
                                      ("fp8_e4m3fnuz", "prefill", True, "bfloat16")):
            if fmt in fmts:
                out.append(_attn_variants(target, fmt, io, token, 128, shape))
        out.append(_attn_variants(target, "fp8_e5m2", "float16", True, 128, "split"))
        out.append(_reduce_variant(target, 128, True))
        out.append(_write_variant(target, "fp8_e4m3", "bfloat16", False, 128))
        out.append(_write_variant(target, "fp8_e5m2fnuz", "float16", True, 128))
        return out
    if which != "full":
        raise ValueError(f"which: got {which!r}, expected 'representative' or 'full'")
    for fmt in fmts:
        for io in IO_DTYPES:
            for token in (False, True):
                for D in heads:
                    for shape in ("decode", "split", "prefill"):
                        out.append(_attn_variants(target, fmt, io, token, D, shape))
                    out.append(_write_variant(target, fmt, io, token, D))
    for D in heads:
        for token in (False, True):
            out.append(_reduce_variant(target, D, token))
    return out


_AMD_FIELDS = {"vgpr": r"\.vgpr_count:\s*(\d+)", "sgpr": r"\.sgpr_count:\s*(\d+)",
               "vgpr_spill": r"\.vgpr_spill_count:\s*(\d+)", "sgpr_spill": r"\.sgpr_spill_count:\s*(\d+)",
               "lds": r"\.group_segment_fixed_size:\s*(\d+)", "scratch": r"\.private_segment_fixed_size:\s*(\d+)"}


def _amd_resources(asm: str) -> dict[str, int]:
    """VGPR/SGPR counts, spills, LDS and scratch from the AMDGCN code object metadata."""
    out = {}
    for key, pattern in _AMD_FIELDS.items():
        m = re.search(pattern, asm)
        out[key] = int(m.group(1)) if m else 0
    m = re.search(r";\s*Occupancy:\s*(\d+)", asm)
    out["occupancy"] = int(m.group(1)) if m else None
    return out


def _ptxas_resources(ptx: str, sm: int) -> dict[str, int]:
    """Registers and spill bytes of the kernel, from ``ptxas -v`` (Triton's bundled ptxas; the
    compiled kernel only learns ``n_regs``/``n_spills`` when a driver loads it)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(sm).path
    suffix = "a" if sm >= 90 else ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{sm}{suffix}", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr

    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {"regs": num(r"Used (\d+) registers"),
            "spill": num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads"),
            "stack": num(r"(\d+) bytes stack frame")}


def compile_variant(target: str, v: Variant) -> Result:
    """Compile one variant for ``target`` with Triton's compiler and read its resources."""
    import triton
    from triton.backends.compiler import GPUTarget

    from . import attention, decode, write

    fn = {"_attn_kernel": attention._attn_kernel, "_decode_kernel": decode._decode_kernel,
          "_reduce_kernel": attention._reduce_kernel, "_write_kv_kernel": write._write_kv_kernel}[v.kernel]
    names = fn.arg_names
    signature = {n: v.signature.get(n, "constexpr" if n in v.constexprs else "i32") for n in names}
    constexprs = {(names.index(k),): val for k, val in v.constexprs.items()}
    # specialised as the JIT specialises a typical call: 16-byte aligned tensors, and head size and
    # cache strides that are multiples of 16 (without it the code is not the code that runs:
    # no vector loads, and e.g. 208 spill bytes in the sm90 decode kernel that has none when launched)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n in ALIGNED_INTS}
    res = Result(target, v.kernel, v.label, v.fmt, False, 0.0, v.num_warps, v.num_stages)
    t0 = time.perf_counter()
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget(*TARGETS[target]),
                           options=dict(num_warps=v.num_warps, num_stages=v.num_stages))
    except Exception as exc:  # noqa: BLE001 - every compile error is a result, reported as such
        res.seconds = time.perf_counter() - t0
        res.error = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        res.problems.append("compile error")
        return res
    res.seconds = time.perf_counter() - t0
    res.shared = int(getattr(k.metadata, "shared", 0) or 0)
    if _is_amd(target):
        r = _amd_resources(k.asm["amdgcn"])
        res.vgpr, res.sgpr, res.occupancy = r["vgpr"], r["sgpr"], r["occupancy"]
        # VGPR spills go to scratch memory: failures. SGPR spills go to VGPR lanes (``v_writelane``,
        # no memory traffic), recorded but not failing; any scratch at all fails.
        res.spills, res.sgpr_spills, res.scratch = r["vgpr_spill"], r["sgpr_spill"], r["scratch"]
        res.shared = max(res.shared, r["lds"])
        if res.scratch:
            res.problems.append(f"scratch {res.scratch} B/lane (private memory)")
        if "hsaco" not in k.asm:
            res.problems.append("no hsaco")
    else:
        r = _ptxas_resources(k.asm["ptx"], TARGETS[target][1])
        res.regs, res.spills, res.scratch = r["regs"], r["spill"], r["stack"]
        if "cubin" not in k.asm:
            res.problems.append("no cubin")
    if res.spills and _is_amd(target):
        res.problems.append(f"{res.spills} VGPR spills")
    if res.shared > SHARED_LIMIT[target]:
        res.problems.append(f"shared {res.shared} B > {SHARED_LIMIT[target]} B")
    res.ok = not res.problems
    return res


def load_baseline(paths: list[str]) -> dict[tuple[str, str, str, str], int]:
    """NVIDIA spill bytes recorded in committed reports (``--json`` files): the spill budget."""
    out = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["results"]:
                out[(r["target"], r["kernel"], r["fmt"], r["label"])] = r["spills"]
    return out


def apply_spill_budget(results: list[Result], baseline: dict[tuple[str, str, str, str], int]) -> None:
    """NVIDIA: spilling more than the committed baseline (or at all, for a variant not in it) fails.

    The shipping NVIDIA kernels already spill (Nsight Compute on the H100 shows local-memory traffic),
    so the gate there is "no new or larger spill"; on AMD any VGPR spill or scratch fails.
    """
    for r in results:
        if _is_amd(r.target) or not r.spills:
            continue
        budget = baseline.get((r.target, r.kernel, r.fmt, r.label), 0)
        if r.spills > budget:
            r.problems.append(f"{r.spills} spill bytes > baseline {budget}")
            r.ok = False


def run(target: str, which: str = "representative", *, jobs: int = 1,
        baseline: dict[tuple[str, str, str, str], int] | None = None) -> list[Result]:
    """Compile every variant of ``which`` set for ``target``; ``jobs`` > 1 uses processes."""
    from fp8kv import settings

    if settings.triton_interpreter():
        raise RuntimeError("TRITON_INTERPRET is set: unset it to compile (the interpreter replaces triton.jit)")
    vs = variants(target, which)
    if jobs <= 1:
        results = [compile_variant(target, v) for v in vs]
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(compile_variant, [target] * len(vs), vs))
    apply_spill_budget(results, baseline or {})
    return results


def table(results: list[Result]) -> str:
    """A markdown table of the results."""
    amd = any(r.vgpr is not None for r in results)
    regs = ("VGPR | SGPR | occupancy (waves/SIMD) | VGPR spills | SGPR spills (to VGPR lanes) | scratch (B/lane)"
            if amd else "regs/thread | spill bytes (st+ld) | stack (B)")
    header = f"| target | kernel | format | variant | warps | stages | {regs} | LDS/shared (B) | compile s | ok |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        reg = (f"{r.vgpr} | {r.sgpr} | {r.occupancy} | {r.spills} | {r.sgpr_spills} | {r.scratch}" if amd
               else f"{r.regs} | {r.spills} | {r.scratch}")
        lines.append(f"| {r.target} | {r.kernel} | {r.fmt} | {r.label} | {r.num_warps} | {r.num_stages} | {reg} | "
                     f"{r.shared} | {r.seconds:.1f} | "
                     f"{'yes' if r.ok else 'NO: ' + '; '.join(r.problems)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8kv_triton.aot", description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", choices=list(TARGETS),
                   help="target to compile for (repeatable; default: all four)")
    p.add_argument("--set", dest="which", default="representative", choices=("representative", "full"))
    p.add_argument("--jobs", type=int, default=1, help="compile processes")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    p.add_argument("--baseline", metavar="JSON", action="append", default=[],
                   help="committed report whose NVIDIA spills are the budget (repeatable)")
    args = p.parse_args(argv)
    results: list[Result] = []
    baseline = load_baseline(args.baseline)
    for target in args.target or list(TARGETS):
        rs = run(target, args.which, jobs=args.jobs, baseline=baseline)
        print(table(rs), flush=True)
        results += rs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"set": args.which, "results": [asdict(r) for r in results]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            for target in dict.fromkeys(r.target for r in results):
                f.write(f"## {target} ({args.which} set)\n\n{table([r for r in results if r.target == target])}\n\n")
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"FAIL {r.target} {r.kernel} {r.fmt} {r.label}: {'; '.join(r.problems)} {r.error}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
