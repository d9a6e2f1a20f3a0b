"""fp8kv's fast CPU backend in plain PyTorch: fused K+V quantize-and-scatter, and paged attention
as one gather of the FP8 codes, dequantization in float32 and one ``scaled_dot_product_attention``
per layer (float64 where float32 would overflow: see :mod:`~fp8kv_torch.attention`).

Registered through the ``fp8kv.backends`` entry point as ``torch``
(:class:`fp8kv_torch.plugin.TorchBackend`), priority 10: above the reference (0) on the CPU,
below the accelerated backends. Modules:

* :mod:`~fp8kv_torch.write`: K and V quantized together with fp8kv's codec, bit-exact with the
  reference write;
* :mod:`~fp8kv_torch.attention`: the per-step plan (gather indices and masks, computed once per
  step and shared by every layer) and the per-layer attention;
* :mod:`~fp8kv_torch.native`: C loops (``csrc/kernels.c``, built at first use with the system C
  compiler, ``FP8KV_TORCH_NATIVE=0`` turns them off) for decode attention and the write's scaling,
  where a chain of small PyTorch operations costs more in dispatch than in arithmetic. They bound
  every index themselves and leave anything non-finite to the float64 path.
"""

from fp8kv._version import __version__

__all__ = ["__version__"]
