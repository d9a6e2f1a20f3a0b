"""The CUDA backend's public kernel module: what another backend may build on.

Backends share code only through a declared public module (docs/plugins.md); for this backend
it is this one, the counterpart of :mod:`fp8kv_triton.kernels`. Everything not named here is
private to ``fp8kv_cuda``. The Hopper backend (the sm90 FP8 attention mode) uses it for its CUDA
kernel's build and launch and for the FP8 mode's decode.

Building and launching a CUDA kernel of your own (CuPy's NVRTC, torch's current stream):

* :func:`compile_source` ``(text, name, opts, arch)``: NVRTC through CuPy;
* :func:`module` ``(key, build, entry_points, index)``: compile once per process and device;
* :func:`launch_struct` ``(function, index, grid, block, params, shared_mem)``: a kernel whose one
  parameter is a ``ctypes`` struct; :func:`device_index` ``(device)``;
* :func:`inline_headers` ``(text)``: ``text`` with its ``#include "x.cuh"`` of the headers in
  :data:`PUBLIC_HEADERS` inlined (another header raises ``ValueError``: it is private);
* :func:`paged_cache_maps` ``(cache, tile_keys)``: TMA descriptors of a paged cache's K and V for
  tiles of ``tile_keys`` keys (or None where TMA cannot describe them).

The tensor-core decode in its FP8 attention mode variant (e4m3 query and probabilities):

* :func:`plan_mma` (once per step), :class:`AttnPlan`;
* :func:`fp8_decode_why_not` (None when the kernel takes the call, else the reason);
* :func:`paged_attention` with ``fp8=Fp8Attention(q_scale, q_scale_strides, prob_scale)``.
"""

from __future__ import annotations

import re

from .attention import AttnPlan, Fp8Attention, fp8_decode_why_not, paged_attention, plan_mma
from .runtime import compile_source, device_index, launch_struct, module
from .tma import paged_cache_maps
from .variants import inline_headers as _inline_all_headers

PUBLIC_HEADERS = ("wgmma_common.cuh", "ptx_math.cuh")
"""Headers of ``csrc/`` another backend's kernel may include: wgmma descriptors, fences and the
e4m3 product helpers of sm90 (``wgmma_common.cuh``, which includes ``ptx_math.cuh``)."""

_INCLUDE = re.compile(r'^\s*#include "([\w.]+\.cuh)"', re.M)


def inline_headers(text: str) -> str:
    """``text`` (CUDA source) with its ``#include "x.cuh"`` of :data:`PUBLIC_HEADERS` inlined."""
    private = sorted(set(_INCLUDE.findall(text)) - set(PUBLIC_HEADERS))
    if private:
        raise ValueError(f"#include of {', '.join(private)}: private to fp8kv_cuda (public: "
                         f"{', '.join(PUBLIC_HEADERS)})")
    return _inline_all_headers(text)


__all__ = [
    "PUBLIC_HEADERS", "AttnPlan", "Fp8Attention", "compile_source", "device_index", "fp8_decode_why_not",
    "inline_headers", "launch_struct", "module", "paged_attention", "paged_cache_maps", "plan_mma",
]
