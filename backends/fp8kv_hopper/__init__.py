"""fp8kv's Hopper backend: the opt-in FP8 attention mode on FP8 tensor cores (sm90, wgmma).

Registered through the ``fp8kv.backends`` entry point as ``hopper``
(:class:`fp8kv_hopper.plugin.HopperBackend`). Modules:

* :mod:`~fp8kv_hopper.plugin`: what it serves (sm90, ``fp8_attention`` over an e4m3fn cache with
  per-tensor or per-head scales) and the hooks; the cache write is the Triton backend's kernel,
  reused through :mod:`fp8kv_triton.kernels` (the Triton backend's public kernel module);
* :mod:`~fp8kv_hopper.attention`: the Triton kernel (``q @ k`` and ``p @ v`` as e4m3 wgmma) and
  its launcher;
* :mod:`~fp8kv_hopper.wgmma`: a warp-specialized CUDA kernel for prefill (``csrc/fp8_prefill.cu``,
  sm_90a, compiled through :mod:`fp8kv_cuda.runtime`'s public functions); ``Fp8AttnConfig.kernel``
  "auto" (the default) takes it for the prefill steps it serves, and for decode steps the CUDA
  backend's tensor-core decode built for the mode (:class:`fp8kv_cuda.attention.Fp8Mode`, public for
  this backend) (measured on the H100: docs/fp8_attention.md).

Why Triton first and not CUDA through NVRTC: Triton 3.6 emits e4m3 wgmma (``QGMMA`` in the SASS)
for an e4m3 ``tl.dot`` on sm90 with software pipelining of the K/V tiles (cp.async), the kernel
shares the Triton backend's audited building blocks (block-table gather with bounds, scale factors
that never overflow, saturation, split-KV merge), and it compiles ahead of time on a CPU like the
rest. What Triton 3.6 cannot do on sm90 (warp specialization, wgmma overlapped with the softmax) is
why the prefill now also has a CUDA kernel.
"""

from fp8kv._version import __version__

__all__ = ["__version__"]
