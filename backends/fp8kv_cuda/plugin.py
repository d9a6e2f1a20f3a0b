"""The CUDA backend as an fp8kv plugin (entry point ``cuda`` in ``fp8kv.backends``).

Priority 90: below Triton (100) wherever both serve (NVIDIA sm80+), except on sm90 decode-only steps
that its tensor-core kernel serves and chunked prefill that its wgmma kernel serves (110: measured
faster, ``capabilities.priority``); above
the reference (0) everywhere; on sm70/sm75, where Triton does not run, it is what ``auto``
picks. CuPy and the kernels are imported only when an op runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8kv.plugins import BackendInfo, Request, hookimpl
from fp8kv.probe import DeviceInfo

from . import __version__
from .capabilities import device_notes, priority, supports

if TYPE_CHECKING:
    from fp8kv.metadata import AttentionMetadata

    from .attention import AttnPlan

PRIORITY = 90


class CudaBackend:
    """Fused FP8 cache write and paged attention in CUDA C++ through CuPy/NVRTC (NVIDIA sm70+)."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo(
            "cuda", __version__, priority=PRIORITY, fast=True,
            description="CUDA C++ through CuPy/NVRTC: NVIDIA sm70+ (Volta/Turing included), all formats; "
                        "decode on tensor cores (float16 queries from sm75, bfloat16 from sm80), chunked prefill "
                        "on tensor cores (float16 queries from sm70, bfloat16 from sm80), else CUDA cores "
                        "(GQA-packed, split-KV)",
        )

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return supports(device, request)

    @hookimpl
    def fp8kv_priority(self, device: DeviceInfo, request: Request) -> int | None:
        return priority(device, request)

    def device_notes(self, device: DeviceInfo) -> list[str]:
        """What ``fp8kv probe`` prints for this device: toolkit, codec per format."""
        return device_notes(device)

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        from .write import write_kv

        write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_plan_attention(self, metadata: AttentionMetadata) -> AttnPlan:
        from .attention import plan

        spec = metadata.spec
        return plan(spec.device, num_tokens=metadata.num_tokens, num_kv_heads=spec.num_kv_heads,
                    group=metadata.num_q_heads // spec.num_kv_heads, head_size=spec.head_size,
                    max_keys=metadata.block_tables.shape[1] * spec.block_size, query_dtype=metadata.query_dtype,
                    token_scales=spec.scale_granularity == "token_head", fmt=spec.kv_dtype,
                    max_query_len=metadata.max_query_len, num_seqs=metadata.seq_lens.shape[0])

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata: AttentionMetadata, out, lse) -> None:
        from .attention import paged_attention

        o = metadata.options
        paged_attention(query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                        o.softmax_scale, o.causal, o.sliding_window, o.logits_soft_cap, out, lse,
                        plan_=metadata.backend_plan)
