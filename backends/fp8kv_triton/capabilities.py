"""What the Triton backend serves, where, and with which FP8 codec.

Codec policy (per architecture and format), the single place it is decided:

==================  ==============================  =====================================
where               encoder (float32 -> FP8)        decoder (FP8 -> float16/bfloat16)
==================  ==============================  =====================================
CPU interpreter     integer bits                    integer bits
sm90, OCP formats   native ``cvt`` (proven exact    e4m3: native ``cvt``; e5m2: a shift
                    by tests/test_triton_gpu.py)    (exact, NaN/inf included)
sm80/86             integer bits                    integer bits
other sm (89, 100+) integer bits (native casts not  integer bits
                    yet proven there by a GPU run)
fnuz formats        integer bits                    integer bits
(NVIDIA)
gfx942 (MI300), all integer bits (a cast to         integer bits
formats             ``tl.float8e4b8`` compiles, but
                    is not proven: no AMD GPU run)
gfx950 (MI350), all integer bits (native OCP casts   integer bits
formats             not proven: no AMD GPU run)
other gfx           not served
==================  ==============================  =====================================

AMD (vendor policy in this backend, not a separate plugin: the same kernels, launcher and
plan serve both vendors, and only this table and the wavefront-aware launch sizes differ;
see docs/rocm.md). gfx942/gfx950 are served with the integer-bit codec for every format:
the kernels are compiled ahead of time for both targets by ``python -m fp8kv_triton.aot``
(CPU CI: a variant per kernel and format class; the CI matrix's compile cells: every claimed
variant; no VGPR spill, no scratch, LDS within limits), and the same integer code paths are
proven bit-exact against the reference on the H100 by tests/test_triton_gpu.py, but no
kernel has run on AMD hardware. A native cast enters this table only after a GPU run proves
it (add the arch to :data:`NATIVE_PROVEN_ARCHES`). The fnuz x2 scale rule stays in the
checkpoint layer (:mod:`fp8kv.checkpoint`): kernels see the scales they are given.

Why not trust Triton's casts everywhere: its CPU interpreter drops the carry when
rounding crosses a power of two (127.8 -> 64 instead of 128; triton-lang/triton#8322);
its software e5m2 conversion on sm80/86 does not round ties to even (triton#5925); it has
no e4m3 conversion below sm89 at all, and refuses ``fp8e4b8`` (fnuz) on NVIDIA. The
integer-bit encoder (:func:`fp8kv_triton.codec.encode_f32_bits`, a mirror of
:mod:`fp8kv.codec`) is exact everywhere, which is also what gives ``fp8_e4m3`` on
Ampere. ``FP8KV_TRITON_CODEC=integer`` forces the integer paths (benchmarks, tests).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from fp8kv import settings
from fp8kv.formats import Fp8Format
from fp8kv.plugins import Request
from fp8kv.probe import DeviceInfo, triton_interpreter

from .modes import DEC_NATIVE, ENC_INTEGER, ENC_NATIVE, integer_decoder

NATIVE_PROVEN_ARCHES = frozenset({"sm90"})
"""Architectures where a GPU run of tests/test_triton_gpu.py proved Triton's native OCP
casts bit-exact (every fp16/bf16 pattern, random and tie float32, NaN, saturation)."""

AMD_ARCHES = frozenset({"gfx942", "gfx950"})
"""AMD architectures served: the kernels are compiled for them (python -m fp8kv_triton.aot), none run there."""

AMD_NOTE = "compiled for {arch}, not run on AMD hardware"

AMD_MAX_HEAD_SIZE = 128
"""Head sizes above 128 are not served on AMD: compiled for gfx942, the 64-row prefill tile with
head size 256 spills VGPRs to scratch (float32 queries, and e5m2fnuz with float16 ones), whatever
the warps (4, 8), rows (32, 64) or keys per tile (32, 64) (ci/reports/compile/)."""

MIN_SM = 80
MAX_HEAD_SIZE = 256
OCP = ("fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CodecChoice:
    """The encoder and decoder one (architecture, format) uses, and why."""

    encoder: int
    decoder: int
    why: str

    @property
    def encoder_name(self) -> str:
        return "native cvt" if self.encoder == ENC_NATIVE else "integer bits"

    @property
    def decoder_name(self) -> str:
        return "native cvt" if self.decoder == DEC_NATIVE else "integer bits"


@functools.cache
def _codec_for(arch: str | None, fmt_name: str, interpret: bool, override: str) -> CodecChoice:
    integer = CodecChoice(ENC_INTEGER, integer_decoder(fmt_name), "")
    if override == "integer":
        return CodecChoice(integer.encoder, integer.decoder, "forced by FP8KV_TRITON_CODEC=integer")
    if interpret or arch is None:
        return CodecChoice(integer.encoder, integer.decoder,
                           "CPU interpreter: its fp8 cast drops the rounding carry (triton#8322)")
    if arch.startswith("gfx"):
        # never native on AMD until a run there proves it (fnuz 0x80 read as a number instead of
        # NaN, SGLang PR 28455, is the kind of bug a native path can hide); the override does not
        # apply either: FP8KV_TRITON_CODEC=native is about NVIDIA cvt
        fnuz_arch = arch == "gfx942"
        if (fmt_name not in OCP) == fnuz_arch:
            why = "a native cvt exists there, but no AMD run has proven it bit-exact"
        else:
            why = f"{arch} has no native {'OCP' if fnuz_arch else 'fnuz'} conversion"
        return CodecChoice(integer.encoder, integer.decoder, f"{AMD_NOTE.format(arch=arch)}; {why}")
    if fmt_name not in OCP:
        return CodecChoice(integer.encoder, integer.decoder, "fnuz: Triton has no fnuz casts on NVIDIA")
    sm = int(arch[2:]) if arch.startswith("sm") else 0
    # e5m2 decodes by a shift whatever the arch: as cheap as the cast, and Triton's native
    # e5m2 -> bf16 conversion turns inf/NaN bytes into finite numbers (seen on sm90)
    native_dec = DEC_NATIVE if fmt_name == "fp8_e4m3" else integer.decoder
    if override == "native" and sm >= 89:
        return CodecChoice(ENC_NATIVE, native_dec, "forced by FP8KV_TRITON_CODEC=native")
    if arch in NATIVE_PROVEN_ARCHES:
        return CodecChoice(ENC_NATIVE, native_dec, f"native casts proven bit-exact on {arch}")
    if sm < 89:
        why = ("Triton has no e4m3 cast below sm89" if fmt_name == "fp8_e4m3"
               else "Triton's software e5m2 cast below sm89 does not round ties to even (triton#5925)")
        return CodecChoice(integer.encoder, integer.decoder, why)
    return CodecChoice(integer.encoder, integer.decoder, f"native casts not yet proven on {arch}")


def codec_for(arch: str | None, fmt: Fp8Format, *, interpret: bool) -> CodecChoice:
    """The codec for ``fmt`` on ``arch`` (``"sm90"``...; None = CPU). Reads ``FP8KV_TRITON_CODEC``."""
    return _codec_for(arch, fmt.name, interpret, settings.triton_codec())


def _triton_importable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def supports(device: DeviceInfo, request: Request) -> str | None:
    """None when the Triton backend serves ``request`` on ``device``, else the reason.

    Decided from the fields of ``device`` (which may be simulated) and the environment.
    Served on NVIDIA sm80+ and AMD gfx942/gfx950 (integer-bit codec, compiled for them, not
    run on AMD hardware): every format (OCP natively or by integer bits, fnuz by integer bits), layouts
    NHD/HND, granularities tensor/head/token_head, head sizes 1..256, fp32/fp16/bf16 I/O,
    features chunked_prefill, sliding_window, soft_cap, non_causal.
    """
    if "fp8_attention" in request.features:
        return ("fp8_attention: the FP8 attention mode (e4m3 query and probabilities) is served by hopper (sm90) "
                "and the reference")
    if not 1 <= request.head_size <= MAX_HEAD_SIZE:
        return f"head_size {request.head_size} is outside 1..{MAX_HEAD_SIZE}"
    if request.device_type == "cpu":
        if not triton_interpreter():
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing Triton"
        if not _triton_importable():
            return "triton is not installed (pip install triton)"
        return None
    if request.device_type != "cuda":
        return f"{request.device_type} tensors are not supported (CUDA/ROCm GPUs and the CPU interpreter only)"
    if device.vendor == "amd":
        if device.arch not in AMD_ARCHES:
            return (f"{device.arch}: AMD GPUs served are {', '.join(sorted(AMD_ARCHES))} "
                    "(the kernels are compiled for those only)")
        if request.head_size > AMD_MAX_HEAD_SIZE:
            return (f"head_size {request.head_size}: AMD is served up to {AMD_MAX_HEAD_SIZE} (compiled for "
                    f"{device.arch}, larger prefill tiles spill VGPRs to scratch)")
        if not device.triton:
            return "triton is not installed (pip install triton)"
        if triton_interpreter():
            return "TRITON_INTERPRET is set: Triton would interpret these kernels on the CPU"
        return None
    if device.vendor != "nvidia":
        return f"{device.arch or device.vendor}: these kernels run on NVIDIA sm80+ and AMD gfx942/gfx950 only"
    if device.sm is None or device.sm < MIN_SM:
        return f"{device.arch}: needs sm80+ (bf16 tensor-core dots)"
    if not device.triton:
        return "triton is not installed (pip install triton)"
    if triton_interpreter():
        return "TRITON_INTERPRET is set: Triton would interpret these kernels on the CPU"
    return None


def describe(device: DeviceInfo) -> list[str]:
    """One line per format: the codec this device would use (for ``fp8kv probe``)."""
    interpret = device.arch is None
    lines = []
    for name in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"):
        from fp8kv.formats import FORMATS

        c = codec_for(device.arch, FORMATS[name], interpret=interpret)
        lines.append(f"{name}: encode {c.encoder_name}, decode {c.decoder_name} ({c.why})")
    return lines


def device_notes(device: DeviceInfo) -> list[str]:
    """``fp8kv probe`` notes: on AMD GPUs what was verified (compiled) and what was not (run)."""
    if device.vendor != "amd":
        return []
    if device.arch not in AMD_ARCHES:
        return [f"{device.arch}: not served (kernels compiled for {', '.join(sorted(AMD_ARCHES))} only)"]
    return [f"{AMD_NOTE.format(arch=device.arch)}: the kernels compile ahead of time to an hsaco for "
            f"{device.arch} on a CPU (python -m fp8kv_triton.aot, ci/reports/compile/: no VGPR spill, LDS "
            "within limits) and the same integer-bit codec is bit-exact against the reference on the H100; "
            "no kernel has run on an AMD GPU (docs/rocm.md)", *describe(device)]


def device_arch(device: torch.device) -> str | None:
    """The architecture the kernels will actually run on (never a simulated one): ``"sm90"``,
    ``"gfx942"``...; None off the GPU."""
    if device.type != "cuda":
        return None
    if torch.version.hip:  # ROCm: torch's "cuda" device is an AMD GPU; get_device_capability() is (9, 4)
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"
