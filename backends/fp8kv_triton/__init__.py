"""fp8kv's Triton backend: fused FP8 cache write and paged attention.

NVIDIA sm80+ GPUs, and the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
Registered through the ``fp8kv.backends`` entry point as ``triton``
(:class:`fp8kv_triton.plugin.TritonBackend`). Modules:

* :mod:`~fp8kv_triton.capabilities`: what is served where, and which codec (native cast or
  the integer-bit encoder) each architecture and format uses;
* :mod:`~fp8kv_triton.codec`: the ``@triton.jit`` encoder/decoders;
* :mod:`~fp8kv_triton.write`: the fused quantize-and-scatter kernel;
* :mod:`~fp8kv_triton.tiles`: the ``@triton.jit`` building blocks of both attention kernels;
* :mod:`~fp8kv_triton.attention`: paged attention (the general kernel: chunked prefill, and
  decode on AMD; the split-KV merge; the launcher and its tile choice);
* :mod:`~fp8kv_triton.decode`: the decode kernel (one query token per sequence, NVIDIA);
* :mod:`~fp8kv_triton.kernels`: the **public** kernel module other in-tree backends import
  (write kernel, attention launcher, codec policy and building blocks); everything else is
  private to this backend.

Triton itself is imported only when a kernel module is, so the plugin loads (and says
why it cannot serve) where Triton is missing.
"""

from fp8kv._version import __version__

__all__ = ["__version__"]
