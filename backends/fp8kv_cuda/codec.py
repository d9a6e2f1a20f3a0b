"""Elementwise launchers of the device codec (``csrc/codec_kernels.cu``), for the GPU proofs.

The ops never call these: they exist so that a test can run the exact encoder and decoder the
write and attention kernels inline (``csrc/codec.cuh``) over millions of inputs on the GPU.
"""

from __future__ import annotations

import torch

from fp8kv.formats import FORMATS, Fp8Format

from . import runtime
from .variants import codec_variant

_BLOCK = 256


def _launch(fmt: Fp8Format, entry: str, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = src.numel()
    if n:
        r = runtime
        runtime.launch(codec_variant(fmt.name), entry, src.device, (-(-n // _BLOCK), 1, 1), _BLOCK,
                       [r.ptr(src), r.ptr(out), r.i64(n)])
    return out


def encode_f32(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """FP8 bytes of float32 ``x`` (already divided by the scale), by the kernels' software encoder."""
    x = x.contiguous().view(torch.int32)
    return _launch(fmt, "fp8kv_encode", x, torch.empty(x.shape, dtype=torch.uint8, device=x.device))


def decode_f32(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float32 values of FP8 bytes (uint8), by the kernels' decoder."""
    codes = codes.contiguous()
    return _launch(fmt, "fp8kv_decode", codes, torch.empty(codes.shape, dtype=torch.float32, device=codes.device))


def widen_f16(h: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns (int32) of float16 bit patterns (int16), by the write's widening (the
    format only selects a compiled module; the widening does not depend on it)."""
    h = h.contiguous()
    return _launch(FORMATS["fp8_e4m3"], "fp8kv_widen_f16", h, torch.empty(h.shape, dtype=torch.int32, device=h.device))



def widen_native(pairs: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float16 pairs (int32: low half from the low byte) of FP8 byte pairs (int16), by the sm89+
    conversion the tensor-core attention kernel uses (OCP formats on sm89+ only)."""
    pairs = pairs.contiguous()
    return _launch(fmt, "fp8kv_widen_native", pairs, torch.empty(pairs.shape, dtype=torch.int32, device=pairs.device))
