"""fp8kv's fast CPU backend in plain PyTorch: fused K+V quantize-and-scatter, and paged attention
as one gather of the FP8 codes, dequantization in float32 and one ``scaled_dot_product_attention``
per layer (float64 where float32 would overflow: see :mod:`~fp8kv_torch.attention`).

Registered through the ``fp8kv.backends`` entry point as ``torch``
(:class:`fp8kv_torch.plugin.TorchBackend`), priority 10: above the reference (0) on the CPU,
below the accelerated backends. Modules:

* :mod:`~fp8kv_torch.write`: K and V quantized together with fp8kv's codec, bit-exact with the
  reference write;
* :mod:`~fp8kv_torch.attention`: the per-step plan (gather indices and masks, computed once per
  step and shared by every layer) and the per-layer attention.
"""

from fp8kv._version import __version__

__all__ = ["__version__"]
