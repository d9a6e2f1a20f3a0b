"""The CUDA backend's software FP8 codec (backends/fp8kv_cuda/csrc/codec.cuh), proven on the CPU.

codec.cuh is written to compile as plain host C++ too: this test builds it with the host C++
compiler (g++/c++), once per format with the same macros the kernels get
(:meth:`fp8kv_cuda.variants.Variant.defines`), and checks the very functions the kernels inline:

* the encoder against the reference cast (:func:`fp8kv.formats.quantize_scaled`, i.e. torch's)
  on every fp16 and bf16 value, every rounding tie of the format and its float32 neighbours,
  saturation and specials, and 2^22 random float32 bit patterns (NaN with both signs included);
* the decoder against torch on all 256 bytes (NaN as NaN, -0 as -0);
* the float16 -> float32 widening of the write against torch on all 65536 patterns, and the
  bfloat16 rounding of the attention output against torch on random and tie patterns.

The GPU run (tests/test_cuda_gpu.py) repeats the encoder/decoder proofs with the device build.
Skipped, with the reason, where no host C++ compiler is installed.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch
from write_checks import codec_inputs

from fp8kv.formats import FORMATS, quantize_scaled

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++/c++) to build codec.cuh for the CPU")

HARNESS = r"""
#include "codec.cuh"
using namespace fp8kv;
extern "C" {
void encode_array(const u32* x, u8* out, long n) { for (long i = 0; i < n; ++i) out[i] = (u8)encode_bits(x[i]); }
void decode_array(const u8* q, float* out, long n) { for (long i = 0; i < n; ++i) out[i] = decode(q[i]); }
void widen_array(const u16* h, u32* out, long n) { for (long i = 0; i < n; ++i) out[i] = f16_to_f32_bits(h[i]); }
void bf16_array(const float* x, u16* out, long n) { for (long i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(x[i]); }
}
"""

ALL = list(FORMATS.values())


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(fmt_name)`` -> the ctypes library of codec.cuh compiled with that format's macros."""
    from importlib import resources

    from fp8kv_cuda.variants import codec_variant

    root = tmp_path_factory.mktemp("codec")
    (root / "codec.cuh").write_text(resources.files("fp8kv_cuda").joinpath("csrc", "codec.cuh").read_text())
    (root / "harness.cpp").write_text(HARNESS)
    libs = {}

    def get(name: str):
        if name not in libs:
            so = root / f"codec_{name}.so"
            defines = list(codec_variant(name).defines())
            r = subprocess.run([CXX, "-O2", "-std=c++17", "-shared", "-fPIC", "-fno-fast-math", *defines,
                                "-I", str(root), str(root / "harness.cpp"), "-o", str(so)],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-3000:]
            libs[name] = ctypes.CDLL(str(so))
        return libs[name]

    return get


def _call(lib, fn: str, src: np.ndarray, out_dtype) -> np.ndarray:
    src = np.ascontiguousarray(src)
    out = np.empty(src.shape, dtype=out_dtype)
    getattr(lib, fn)(src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                     ctypes.c_long(src.size))
    return out


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_encoder_is_bit_exact_with_the_reference(build, fmt):
    x = codec_inputs(fmt)
    got = torch.from_numpy(_call(build(fmt.name), "encode_array", x.view(torch.int32).numpy().view(np.uint32),
                                 np.uint8))
    want = quantize_scaled(x, fmt).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} mismatches; first x={x[bad[0]].item()!r} "
                              f"(bits 0x{int(x.view(torch.int32)[bad[0]]) & 0xFFFFFFFF:08x}): "
                              f"got 0x{int(got[bad[0]]):02x}, want 0x{int(want[bad[0]]):02x}")
    # NaN keeps its sign in the OCP formats (0x7F / 0xFF), fnuz has the one NaN 0x80
    nan = torch.tensor([math.nan, -math.nan]).view(torch.int32)
    nan[1] |= -(2**31)
    nb = _call(build(fmt.name), "encode_array", nan.numpy().view(np.uint32), np.uint8).tolist()
    assert nb == ([0x80, 0x80] if fmt.fnuz else [0x7F, 0xFF])


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_decoder_gives_the_exact_value_of_every_byte(build, fmt):
    codes = np.arange(256, dtype=np.uint8)
    got = torch.from_numpy(_call(build(fmt.name), "decode_array", codes, np.float32))
    want = torch.from_numpy(codes).view(fmt.torch_dtype).float()
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"bytes {(~same).nonzero().flatten().tolist()[:8]}: {got[~same][:4].tolist()}"
    signs_match = torch.signbit(got) == torch.signbit(want)
    assert bool(signs_match[~want.isnan()].all()), "a zero lost its sign"


def test_float16_widening_is_exact_for_every_pattern(build):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = torch.from_numpy(_call(build("fp8_e4m3"), "widen_array", h, np.uint32).view(np.int32))
    want = torch.from_numpy(h.view(np.int16).copy()).view(torch.float16).float()
    gf = got.view(torch.float32)
    finite = ~want.isnan()
    assert torch.equal(got[finite], want.view(torch.int32)[finite])
    assert bool(gf[~finite].isnan().all())
    assert torch.equal(torch.signbit(gf[~finite]), torch.signbit(want[~finite]))  # -NaN stays negative


def test_bfloat16_rounding_matches_torch(build):
    g = torch.Generator().manual_seed(3)
    rnd = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16) | 0x8000  # exactly half an ulp
    x = torch.cat([rnd, ties, ties ^ 0x1]).view(torch.float32)
    x = x[x.abs() <= 3.3895313892515355e38]  # the kernels saturate first
    got = torch.from_numpy(_call(build("fp8_e4m3"), "bf16_array", x.numpy(), np.uint16).view(np.int16))
    want = x.to(torch.bfloat16)
    finite = ~x.isnan()
    assert torch.equal(got[finite], want.view(torch.int16)[finite])
    gb = got.view(torch.bfloat16)
    assert bool(gb[~finite].isnan().all()) and torch.equal(torch.signbit(gb[~finite]), torch.signbit(x[~finite]))
