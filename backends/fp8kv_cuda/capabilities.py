"""What the CUDA backend serves, where, and why not elsewhere: named predicates.

Each predicate takes the (possibly simulated) :class:`~fp8kv.probe.DeviceInfo` and the
:class:`~fp8kv.hookspecs.Request` and returns None (fine) or the reason users see in
``fp8kv probe`` and in errors; :func:`supports` asks them in order.

Served: NVIDIA sm70+ with CuPy, every format (fp8_e4m3, fp8_e5m2 and the fnuz pair), layouts
NHD/HND, granularities tensor/head/token_head, head sizes 1..256, float32/float16/bfloat16
I/O, and the features sliding_window, soft_cap, non_causal and chunked_prefill.

Kernels: the write; decode attention on tensor cores (``csrc/attention_mma.cu``: float16 queries
from sm75 (Turing's m16n8k8), bfloat16 from sm80, any granularity, head sizes 64/128 (256 on sm89+
for the OCP formats), 16-byte aligned K/V rows); chunked prefill on tensor cores
(``csrc/prefill_mma.cu``: the same queries and architectures, static scales, head size 128, 16-byte
aligned rows; on Volta ``csrc/prefill_wmma.cu``: float16 queries through PTX wmma, which ptxas
lowers to sm70's m8n8k4); everything else (float32 queries, bfloat16 queries below sm80, other head
sizes, per-token-head prefill, decode on sm70) on the CUDA-core kernel (``csrc/attention.cu``), one
CTA row per query token.

Codec: the write encodes through the software codec (integer bits, ``csrc/codec.cuh``, a mirror
of :mod:`fp8kv.codec`) on every architecture and for every format (a native encode enters only
once a GPU test proves it bit-exact: :data:`NATIVE_PROVEN_ARCHES`, empty today). Attention
decodes by bit operations, and on sm89+ the tensor-core kernel widens e4m3/e5m2 to float16 with
``cvt.rn.f16x2.{e4m3x2,e5m2x2}`` (exact by definition for every code; checked against torch on
the GPU by tests/test_cuda_gpu.py).

Priority: 90, below Triton (100), except :func:`priority`: decode-only attention on sm90 that the
tensor-core kernel serves, measured faster than Triton there (``benchmarks/decode.py``).

Toolkit: CUDA 13's NVRTC refuses ``sm_70`` (and sm72), so Volta needs CuPy for CUDA 12
(``cupy-cuda12x``); sm75+ works with CUDA 12 or 13.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

from fp8kv.plugins import Request
from fp8kv.probe import DeviceInfo

from .variants import WGMMA_PREFILL_FORMATS, mma_arch_serves

_IO = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
MIN_SM = 70
CUDA13_MIN_SM = 75
MAX_HEAD_SIZE = 256
NATIVE_PROVEN_ARCHES: frozenset[str] = frozenset()
"""Architectures where a GPU test proved native FP8 conversions bit-exact (none yet: the
software codec serves everywhere)."""
COMPILED_ARCHES = ("sm70", "sm75", "sm80", "sm86", "sm89", "sm90")
"""Architectures every kernel is compiled for in CPU CI (python -m fp8kv_cuda.compile)."""
CODE_RUN_ON_NEWER: dict[str, str] = {"sm75": "H100"}
"""Architectures whose code (not hardware) passed tests/test_cuda_gpu.py on a newer GPU through
``FP8KV_CUDA_ARCH`` (sm75 on the H100)."""
RUN_ARCHES: tuple[str, ...] = ("sm90",)
"""Architectures where tests/test_cuda_gpu.py has passed on real hardware (add one only after a
recorded run: sm90, the H100 and the H200); the others are compiled, not run."""


def cupy_importable() -> bool:
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def cupy_cuda_major() -> int | None:
    """The CUDA major version of the installed CuPy's NVRTC (None when unknown or absent)."""
    if not cupy_importable():
        return None
    try:
        import cupy

        major, _ = cupy.cuda.nvrtc.getVersion()
        return int(major)
    except Exception:  # a broken CuPy install: decided at compile time instead
        return None


def needs_gpu_tensors(device: DeviceInfo, request: Request) -> str | None:
    if request.device_type != "cuda":
        return f"{request.device_type} tensors: the CUDA backend runs on NVIDIA GPUs only (CuPy/NVRTC)"
    return None


def is_nvidia_sm70_plus(device: DeviceInfo, request: Request) -> str | None:
    if device.vendor != "nvidia":
        return f"{device.arch or device.vendor}: the CUDA backend runs on NVIDIA GPUs only"
    if device.sm is None or device.sm < MIN_SM:
        return f"{device.arch}: needs sm70+ (Volta or newer)"
    return None


def has_cupy(device: DeviceInfo, request: Request) -> str | None:
    if not device.cupy:
        return "cupy is not installed (pip install cupy-cuda12x; cupy-cuda13x serves sm75+ only)"
    return None


def toolkit_compiles_arch(device: DeviceInfo, request: Request) -> str | None:
    """CUDA 13's NVRTC refuses sm70/sm72: a real Volta with a CUDA 13 CuPy is refused up front.
    (Simulated devices assume the right toolkit; ``fp8kv probe`` says which one that is.)"""
    if device.simulated or device.sm is None or device.sm >= CUDA13_MIN_SM:
        return None
    major = cupy_cuda_major()
    if major is not None and major >= 13:
        return (f"{device.arch}: CUDA {major}'s NVRTC cannot compile for {device.arch} (dropped in CUDA 13); "
                "install CuPy for CUDA 12 (pip install cupy-cuda12x)")
    return None


def head_size_in_range(device: DeviceInfo, request: Request) -> str | None:
    if not 1 <= request.head_size <= MAX_HEAD_SIZE:
        return f"head_size {request.head_size} is outside 1..{MAX_HEAD_SIZE}"
    return None


def default_mode_only(device: DeviceInfo, request: Request) -> str | None:
    if "fp8_attention" in request.features:
        return ("fp8_attention: the FP8 attention mode (e4m3 query and probabilities) is served by hopper (sm90) "
                "and the reference")
    return None


PREDICATES: tuple[Callable[[DeviceInfo, Request], str | None], ...] = (
    default_mode_only, head_size_in_range, needs_gpu_tensors, is_nvidia_sm70_plus, has_cupy, toolkit_compiles_arch)


def supports(device: DeviceInfo, request: Request) -> str | None:
    """None when the CUDA backend serves ``request`` on ``device``, else the first reason."""
    for predicate in PREDICATES:
        reason = predicate(device, request)
        if reason is not None:
            return reason
    return None


DECODE_PRIORITY = 110
"""Priority of decode-only attention the tensor-core kernel serves on :data:`DECODE_FASTER_ARCHES`
(above Triton's 100)."""
DECODE_FASTER_ARCHES = frozenset({"sm90"})
"""Where the tensor-core decode was measured faster than Triton's decode (same runs, the four decode
shapes of docs/performance.md, on the H100 and the H200). Other sm80+ architectures keep Triton until measured."""


PREFILL_PRIORITY = 110
"""Priority of chunked prefill the sm90 wgmma kernel serves on :data:`PREFILL_FASTER_ARCHES` (above
Triton's 100)."""
PREFILL_FASTER_ARCHES = frozenset({"sm90"})
"""Where the wgmma prefill was measured faster than Triton's prefill (same runs on the H100: 4 x 2048
over 2048, 1 x 16384 causal, and short chunks over long contexts from 16 x 64 over 4096 to 1 x 64
over 32768, split or not; docs/performance.md). It serves an
e4m3 cache with static scales, head size 128, float16 or bfloat16 queries, no soft-cap, any KV split;
a query that is not 16-byte aligned runs the mma prefill kernel instead, 0.79-1.06x Triton on the
measured shapes."""


def priority(device: DeviceInfo, request: Request) -> int | None:
    """:data:`DECODE_PRIORITY` for attention without chunked prefill (decode steps) that the
    tensor-core kernel serves on an architecture where it was measured faster;
    :data:`PREFILL_PRIORITY` for chunked prefill the sm90 wgmma kernel serves; else None. The
    kernels' alignment is checked at launch (an unaligned cache falls back to the CUDA-core kernel,
    an unaligned query to the mma prefill kernel)."""
    if (request.op != "paged_attention" or "fp8_attention" in request.features or device.sm is None
            or request.io_dtype not in (torch.float16, torch.bfloat16)):
        return None
    if "chunked_prefill" in request.features:
        if (device.arch in PREFILL_FASTER_ARCHES and request.kv_dtype in WGMMA_PREFILL_FORMATS
                and request.head_size == 128 and request.scale_granularity in ("tensor", "head")
                and "soft_cap" not in request.features):
            return PREFILL_PRIORITY
        return None
    if (device.arch not in DECODE_FASTER_ARCHES
            or not mma_arch_serves(device.sm, request.kv_dtype, request.head_size, _IO[request.io_dtype])):
        return None
    return DECODE_PRIORITY


def toolkit_note(device: DeviceInfo) -> str:
    """Which CUDA toolkit (CuPy build) this device needs."""
    if device.sm is not None and device.sm < CUDA13_MIN_SM:
        return (f"{device.arch}: needs CUDA 12 (pip install cupy-cuda12x): CUDA 13's NVRTC refuses "
                f"sm_{device.sm} (CUDA 13 dropped Volta)")
    return f"{device.arch}: CUDA 12 or 13 (cupy-cuda12x or cupy-cuda13x)"


def codec_note(device: DeviceInfo, fmt_name: str) -> str:
    """Which codec a format's write gets on this device, and why (attention: see the module)."""
    sm = device.sm or 0
    if sm < 89:
        why = f"{device.arch} has no FP8 conversion instructions"
    elif device.arch in NATIVE_PROVEN_ARCHES and fmt_name in ("fp8_e4m3", "fp8_e5m2"):
        why = "native cvt proven"  # pragma: no cover - none proven yet
    elif fmt_name in ("fp8_e4m3", "fp8_e5m2"):
        why = f"native cvt exists on {device.arch} but is not yet proven bit-exact by a GPU test"
    else:
        why = "NVIDIA has no fnuz conversions"
    return f"{fmt_name}: write encodes through the software codec (bit operations): {why}"


def device_notes(device: DeviceInfo) -> list[str]:
    """``fp8kv probe`` lines for an NVIDIA device: toolkit, codec per format, what ran where."""
    if device.vendor != "nvidia" or device.sm is None or device.sm < MIN_SM:
        return []
    if device.arch in RUN_ARCHES:
        ran = f"compiled in CPU CI and run on {device.arch} (tests/test_cuda_gpu.py)"
    else:
        ran = f"compiled for {device.arch} in CPU CI (NVRTC 12.9), not run on {device.arch} hardware"
        if device.arch in CODE_RUN_ON_NEWER:
            ran += (f" (its {device.arch} code passed the GPU tests on an {CODE_RUN_ON_NEWER[device.arch]} through "
                    f"FP8KV_CUDA_ARCH={device.arch})")
    if device.sm >= 80:
        mma = "decode on tensor cores (float16/bfloat16 queries)"
    elif device.sm >= 75:
        mma = ("decode on tensor cores for float16 queries (Turing's m16n8k8; bfloat16 and float32 queries on "
               "CUDA cores: no bfloat16 tensor cores before sm80)")
    else:
        mma = "decode on CUDA cores (Volta's m8n8k4 tensor cores serve the chunked prefill only)"
    if device.arch in DECODE_FASTER_ARCHES:
        mma += f", ranked above triton for decode-only steps on {device.arch} (measured faster)"
    if device.arch in PREFILL_FASTER_ARCHES:
        prefill = ("chunked prefill on wgmma tensor cores (e4m3, float16/bfloat16 queries, static scales, head size "
                   f"128, no soft-cap; ranked above triton on {device.arch}: measured faster), else on mma.sync "
                   "tensor cores below triton")
    elif device.sm >= 80:
        prefill = ("chunked prefill on tensor cores (float16/bfloat16 queries, static scales, head size 128; "
                   "not faster than triton, so ranked below it)")
    elif device.sm >= 75:
        prefill = ("chunked prefill on tensor cores for float16 queries (static scales, head size 128), else on "
                   "CUDA cores, one CTA row per query token")
    else:
        prefill = ("chunked prefill on tensor cores for float16 queries (static scales, head size 128; PTX wmma, "
                   "which ptxas lowers to Volta's m8n8k4: its code ran on an H100 only), else on CUDA cores, one CTA "
                   "row per query token")
    lines = [toolkit_note(device), f"kernels: {ran}; {mma}; {prefill}"]
    lines += [codec_note(device, f) for f in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")]
    return lines
