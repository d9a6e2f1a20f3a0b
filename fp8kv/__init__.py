"""fp8kv: an FP8 attention KV cache and paged attention over it, on any accelerator.

Public API (plan once per step, run per layer)::

    cache = fp8kv.KVCache.allocate(num_blocks, block_size, H, D, kv_dtype="fp8_e4m3")
    meta = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=torch.bfloat16,
                                block_tables=bt, seq_lens=lens, slot_mapping=slots)
    fp8kv.write_kv(cache, key, value, meta)
    out = fp8kv.paged_attention(query, cache, meta)
"""

from ._version import __version__
from .api import merge_attention_states, paged_attention, write_kv
from .cache import CacheSpec, KVCache
from .checkpoint import KVCachePlan, resolve_kv_cache
from .errors import BackendFailure, Fp8KVError, InvalidArgument, PluginError, Unsupported
from .formats import FORMATS, Fp8Format, dequantize, get_format, quantize
from .hookspecs import BackendInfo, Request, hookimpl
from .metadata import AttentionMetadata, AttentionOptions, plan_attention
from .probe import DeviceInfo, probe, simulate_device
from .registry import Selection, available_backends, register_backend, select_backend, unregister_backend
from .scales import calibrate

__all__ = [
    "FORMATS", "AttentionMetadata", "AttentionOptions", "BackendFailure", "BackendInfo", "CacheSpec", "DeviceInfo",
    "Fp8Format", "Fp8KVError", "InvalidArgument", "KVCache", "KVCachePlan", "PluginError", "Request", "Selection",
    "Unsupported", "__version__", "available_backends", "calibrate", "dequantize", "get_format", "hookimpl",
    "merge_attention_states", "paged_attention", "plan_attention", "probe", "quantize", "register_backend",
    "resolve_kv_cache", "select_backend", "simulate_device", "unregister_backend", "write_kv",
]
