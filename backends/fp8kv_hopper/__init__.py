"""fp8kv's Hopper backend: the opt-in FP8 attention mode on FP8 tensor cores (sm90).

Registered through the ``fp8kv.backends`` entry point as ``hopper``
(:class:`fp8kv_hopper.plugin.HopperBackend`). It owns the mode (``fp8_attention=True``: e4m3
query and probabilities, both products on e4m3 tensor cores) over an e4m3fn cache with per-tensor
or per-head scales: what it serves, its planning, and the choice, call by call, among three
kernels built by two toolchains:

* decode steps: the CUDA backend's tensor-core decode in its FP8 variant;
* prefill steps: a warp-specialized CUDA kernel of its own (:mod:`~fp8kv_hopper.wgmma`,
  ``csrc/fp8_prefill.cu``, sm_90a, TMA loads, e4m3 wgmma);
* anything those do not take (other head sizes, soft-cap, split-KV prefill, float32 queries,
  Triton's CPU interpreter): a Triton kernel of its own (:mod:`~fp8kv_hopper.attention`).

The cache write is the Triton backend's kernel. Other backends' code is reached only through
their declared public modules: :mod:`fp8kv_triton.kernels` (the write, the Triton building
blocks: block-table gather with bounds, scale factors that never overflow, saturation, split-KV
merge) and :mod:`fp8kv_cuda.kernels` (NVRTC build and launch, the public ``wgmma_common.cuh``
header, TMA descriptors, the FP8-mode decode).

Modules: :mod:`~fp8kv_hopper.plugin` (the hooks), :mod:`~fp8kv_hopper.attention` (the launcher and
the Triton kernel), :mod:`~fp8kv_hopper.wgmma` (the CUDA prefill), :mod:`~fp8kv_hopper.schedule`
(the persistent prefill's work schedule).
"""

from fp8kv._version import __version__

__all__ = ["__version__"]
