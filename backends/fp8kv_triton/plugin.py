"""The Triton backend as an fp8kv plugin (entry point ``triton`` in ``fp8kv.backends``).

Per step, :meth:`TritonBackend.fp8kv_plan_attention` picks the codec and the launch
configuration (tiles, KV split) from host-side sizes; per layer,
:meth:`TritonBackend.fp8kv_paged_attention` launches the kernels with them, no host sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp8kv.formats import FORMATS
from fp8kv.plugins import BackendInfo, Request, hookimpl
from fp8kv.probe import DeviceInfo, triton_interpreter

from . import __version__
from .capabilities import codec_for, device_arch, supports

if TYPE_CHECKING:
    from fp8kv.metadata import AttentionMetadata

    from .attention import AttnConfig


@functools.cache
@dataclass(frozen=True)
class TritonPlan:
    """The per-step choices of the Triton attention: decoder, interpreter, launch configuration."""

    decode_mode: int
    interpret: bool
    config: AttnConfig


class TritonBackend:
    """Fused FP8 cache write and paged attention in Triton (NVIDIA sm80+, AMD gfx942/gfx950, CPU interpreter)."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo(
            "triton", __version__, priority=100,
            description="Triton kernels: NVIDIA sm80+ (e4m3 on sm80/86 through the integer-bit encoder); "
                        "AMD gfx942/gfx950 through the integer-bit codec (compiled for gfx942/gfx950, "
                        "not run on AMD hardware); CPU through TRITON_INTERPRET=1",
            fast=True,
        )

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return supports(device, request)

    def device_notes(self, device: DeviceInfo) -> list[str]:
        """What ``fp8kv probe`` prints for this device: AMD honesty line, then the codec per format."""
        from .capabilities import device_notes

        return device_notes(device)

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        from .write import write_kv_for_device

        write_kv_for_device(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_plan_attention(self, metadata: AttentionMetadata) -> TritonPlan:
        from .attention import choose_config

        spec = metadata.spec
        interpret = triton_interpreter()
        arch = device_arch(spec.device)
        choice = codec_for(arch, FORMATS[spec.kv_dtype], interpret=interpret)
        config = choose_config(
            spec.device, group=metadata.num_q_heads // spec.num_kv_heads, head_size=spec.head_size,
            num_seqs=metadata.num_seqs, num_kv_heads=spec.num_kv_heads, max_query_len=metadata.max_query_len,
            max_keys=metadata.block_tables.shape[1] * spec.block_size, interpret=interpret,
            query_dtype=metadata.query_dtype, arch=arch)
        return TritonPlan(choice.decoder, interpret, config)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata: AttentionMetadata, out, lse) -> None:
        from .attention import paged_attention

        plan: TritonPlan = metadata.backend_plan
        opts = metadata.options
        paged_attention(query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                        metadata.max_query_len, opts.softmax_scale, opts.causal, opts.sliding_window,
                        opts.logits_soft_cap, out, lse=lse, decode_mode=plan.decode_mode, interpret=plan.interpret,
                        config=plan.config)
