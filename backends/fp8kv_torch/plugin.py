"""The fast CPU backend as an fp8kv plugin (entry point ``torch`` in ``fp8kv.backends``).

It serves every format, layout, granularity and attention feature, for CPU tensors only (GPUs
have the Triton kernels). Priority 10: ``backend="auto"`` prefers it to the reference (0) on
the CPU and leaves it below the accelerated backends (100+). Not ``fast`` in fp8kv's sense (no
GPU kernels). PyTorch's indexing raises on an out-of-range index instead of touching other memory;
its C loops (:mod:`fp8kv_torch.native`) skip block ids outside the cache and clamp lengths to the
block tables' width themselves.
"""

from __future__ import annotations

from fp8kv.plugins import BackendInfo, Request, hookimpl
from fp8kv.probe import DeviceInfo

from . import __version__


class TorchBackend:
    """Batched PyTorch write and paged attention for CPU tensors, one index per step."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo("torch", __version__, priority=10,
                           description="PyTorch on the CPU: K+V quantized in one pass, attention over every "
                                       "sequence at once with a per-step gather index (float32 SDPA, float64 "
                                       "where float32 would overflow); decode and the write's scaling in C "
                                       "loops built at first use", fast=False)

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        if request.device_type != "cpu":
            return f"serves CPU tensors only (got {request.device_type}; GPUs have the triton backend)"
        if "fp8_attention" in request.features:
            return ("fp8_attention: the FP8 attention mode (e4m3 query and probabilities) is served by hopper (sm90) "
                    "and the reference")
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        from .write import write_kv

        write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_plan_attention(self, device, metadata):
        from .attention import TorchPlan

        return TorchPlan()

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse) -> None:
        from .attention import paged_attention

        paged_attention(query, cache, metadata, out, lse)
