"""fp8kv: an FP8 attention KV cache and paged attention over it, on any accelerator.

Public API::

    cache = fp8kv.KVCache.allocate(num_blocks, block_size, H, D, kv_dtype="fp8_e4m3")
    fp8kv.write_kv(cache, key, value, slot_mapping)
    out = fp8kv.paged_attention(query, cache, block_tables, seq_lens)
"""

from ._version import __version__
from .api import paged_attention, write_kv
from .cache import KVCache
from .checkpoint import KVCachePlan, resolve_kv_cache
from .errors import Fp8KVError
from .formats import FORMATS, Fp8Format, dequantize, get_format, quantize
from .hookspecs import BackendInfo, Request, hookimpl
from .probe import DeviceInfo, probe, simulate_device
from .registry import Selection, available_backends, register_backend, select_backend, unregister_backend
from .scales import calibrate

__all__ = [
    "FORMATS", "BackendInfo", "DeviceInfo", "Fp8Format", "Fp8KVError", "KVCache", "Request", "Selection",
    "__version__", "available_backends", "calibrate", "dequantize", "get_format", "hookimpl",
    "paged_attention", "probe", "quantize", "register_backend", "select_backend", "simulate_device",
    "unregister_backend", "write_kv",
    "KVCachePlan", "resolve_kv_cache",
]
