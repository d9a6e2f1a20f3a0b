"""The Triton backend as an fp8kv plugin (entry point ``triton`` in ``fp8kv.backends``)."""

from __future__ import annotations

import functools

import torch

from fp8kv.hookspecs import BackendInfo, Request, hookimpl
from fp8kv.probe import DeviceInfo, triton_interpreter

from . import __version__
from .capabilities import codec_for, supports


@functools.cache
def _real_arch(device: torch.device) -> str | None:
    """The architecture the kernels will actually run on (never a simulated one)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


class TritonBackend:
    """Fused FP8 cache write and paged attention in Triton (NVIDIA sm80+, CPU interpreter)."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo(
            "triton", __version__, priority=100,
            description="Triton kernels: NVIDIA sm80+ (e4m3 on sm80/86 through the integer-bit encoder), "
                        "CPU through TRITON_INTERPRET=1",
            fast=True,
        )

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return supports(device, request)

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        from .write import write_kv

        choice = codec_for(_real_arch(cache.device), cache.fmt, interpret=triton_interpreter())
        write_kv(cache, key, value, slot_mapping, encoder=choice.encoder)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, block_tables, seq_lens, query_start_loc, max_query_len,
                              softmax_scale, causal, sliding_window, logits_soft_cap, out) -> None:
        from .attention import paged_attention

        interpret = triton_interpreter()
        choice = codec_for(_real_arch(cache.device), cache.fmt, interpret=interpret)
        paged_attention(query, cache, block_tables, seq_lens, query_start_loc, max_query_len, softmax_scale,
                        causal, sliding_window, logits_soft_cap, out, decode_mode=choice.decoder,
                        interpret=interpret)
