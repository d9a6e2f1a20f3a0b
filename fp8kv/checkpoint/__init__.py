"""KV-cache policy and scale loading from checkpoints.

``fp8kv.resolve_kv_cache(kv_cache_dtype, checkpoint, device)`` decides which FP8
format a model's KV cache may use on a device, with which scales, on which
backend, and returns a :class:`KVCachePlan` (or refuses with the reason).

Modules: :mod:`.config` (what a config declares; typed and bounded), :mod:`.files`
(regular files only, bounded JSON and safetensors headers; never pickle),
:mod:`.tensors` (scale tensors in safetensors), :mod:`.scales_plan` (per-layer scales),
:mod:`.resolve` (the policy), :mod:`.plan` (the plan object).
"""

from .plan import KVCachePlan
from .resolve import KV_CACHE_DTYPES, resolve_kv_cache

__all__ = ["KV_CACHE_DTYPES", "KVCachePlan", "resolve_kv_cache"]
