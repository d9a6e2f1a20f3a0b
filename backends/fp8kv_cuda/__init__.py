"""fp8kv's CUDA backend: FP8 cache write and paged attention in CUDA C++, compiled at first use.

Registered through the ``fp8kv.backends`` entry point as ``cuda``
(:class:`fp8kv_cuda.plugin.CudaBackend`). NVIDIA sm70+ (Volta and Turing included, which
Triton does not serve), through CuPy's NVRTC: the ``.cu`` sources in ``csrc/`` are compiled
for the device's architecture the first time a variant is launched, and cached (in the process
and in CuPy's on-disk kernel cache). Modules:

* :mod:`~fp8kv_cuda.kernels`: the public module other backends build on;
* :mod:`~fp8kv_cuda.capabilities`: what is served where, and which CUDA toolkit a device needs;
* :mod:`~fp8kv_cuda.variants`: kernel variants (macros), sources and NVRTC options;
* :mod:`~fp8kv_cuda.runtime`: compile-and-cache through CuPy, launches on torch's stream;
* :mod:`~fp8kv_cuda.write` / :mod:`~fp8kv_cuda.attention`: the host launchers;
* :mod:`~fp8kv_cuda.tma`: TMA descriptors of a paged cache for the sm90 kernels' tile loads;
* :mod:`~fp8kv_cuda.compile`: ``python -m fp8kv_cuda.compile``, the CPU compile cells (NVRTC
  12.x from PyPI, every architecture sm70..sm90, registers and spills from ptxas).

CuPy is imported only when a kernel is launched, so the plugin loads (and says why it cannot
serve) where CuPy is missing.

Public for other backends: :mod:`~fp8kv_cuda.kernels` (NVRTC build and launch, the public
headers, TMA descriptors of a paged cache, the FP8 attention mode's decode). Everything else is
private.
"""

from fp8kv._version import __version__

__all__ = ["__version__"]
