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
==================  ==============================  =====================================

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

from fp8kv import settings
from fp8kv.formats import Fp8Format
from fp8kv.hookspecs import Request
from fp8kv.probe import DeviceInfo, triton_interpreter

from .modes import DEC_NATIVE, ENC_INTEGER, ENC_NATIVE, integer_decoder

NATIVE_PROVEN_ARCHES = frozenset({"sm90"})
"""Architectures where a GPU run of tests/test_triton_gpu.py proved Triton's native OCP
casts bit-exact (every fp16/bf16 pattern, random and tie float32, NaN, saturation)."""

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
    Served: every format (OCP natively or by integer bits, fnuz by integer bits), layouts
    NHD/HND, granularities tensor/head/token_head, head sizes 1..256, fp32/fp16/bf16 I/O,
    features chunked_prefill, sliding_window, soft_cap, non_causal.
    """
    if not 1 <= request.head_size <= MAX_HEAD_SIZE:
        return f"head_size {request.head_size} is outside 1..{MAX_HEAD_SIZE}"
    if request.device_type == "cpu":
        if not triton_interpreter():
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing Triton"
        if not _triton_importable():
            return "triton is not installed (pip install triton)"
        return None
    if request.device_type != "cuda":
        return f"{request.device_type} tensors are not supported (CUDA GPUs and the CPU interpreter only)"
    if device.vendor != "nvidia":
        return f"{device.arch or device.vendor}: these kernels are tested on NVIDIA GPUs only"
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
