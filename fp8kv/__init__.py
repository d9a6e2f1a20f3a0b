"""fp8kv: an FP8 attention KV cache and paged attention over it, on any accelerator.

Plan once per step, run per layer::

    cache = fp8kv.KVCache.allocate(num_blocks, block_size, H, D, kv_dtype="fp8_e4m3")
    meta = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=torch.bfloat16,
                                block_tables=bt, seq_lens=lens, slot_mapping=slots)
    fp8kv.write_kv(cache, key, value, meta)
    out = fp8kv.paged_attention(query, cache, meta)

The public names, by what they are for:

* the cache: :class:`KVCache` (allocate, or wrap an engine's tensors) and its :class:`CacheSpec`;
* a step: :func:`plan_attention` -> :class:`AttentionMetadata` (with its :class:`AttentionOptions`),
  then per layer :func:`write_kv` and :func:`paged_attention`; :func:`merge_attention_states`;
  one-off calls without a plan: :func:`write_kv_one_shot`, :func:`paged_attention_one_shot`;
* checkpoints: :func:`resolve_kv_cache` -> :class:`KVCachePlan`;
* formats and scales: :data:`FORMATS`, :class:`Fp8Format`, :func:`get_format`, :func:`quantize`,
  :func:`dequantize`, :func:`calibrate`;
* the device and its backends: :func:`probe`, :func:`available_backends` (the plugin API is
  :mod:`fp8kv.plugins`; the conformance kit :mod:`fp8kv.testing`);
* errors: :class:`Fp8KVError` and its kinds :class:`InvalidArgument`, :class:`Unsupported`,
  :class:`BackendFailure`, :class:`PluginError`.
"""

from . import plugins  # noqa: F401  (fp8kv.plugins: the API for backend authors)
from ._version import __version__
from .api import merge_attention_states, paged_attention, paged_attention_one_shot, write_kv, write_kv_one_shot
from .cache import CacheSpec, KVCache
from .checkpoint import KVCachePlan, resolve_kv_cache
from .errors import BackendFailure, Fp8KVError, InvalidArgument, PluginError, Unsupported
from .formats import FORMATS, Fp8Format, dequantize, get_format, quantize
from .metadata import AttentionMetadata, AttentionOptions
from .planning import plan_attention
from .probe import probe
from .registry import available_backends
from .scales import calibrate

__all__ = [
    # the cache
    "CacheSpec", "KVCache",
    # a step: plan once, run per layer
    "AttentionMetadata", "AttentionOptions", "merge_attention_states", "paged_attention", "paged_attention_one_shot",
    "plan_attention", "write_kv", "write_kv_one_shot",
    # checkpoints
    "KVCachePlan", "resolve_kv_cache",
    # formats and scales
    "FORMATS", "Fp8Format", "calibrate", "dequantize", "get_format", "quantize",
    # the device and its backends
    "available_backends", "probe",
    # errors
    "BackendFailure", "Fp8KVError", "InvalidArgument", "PluginError", "Unsupported",
    "__version__",
]
