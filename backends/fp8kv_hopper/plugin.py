"""The Hopper backend as an fp8kv plugin (entry point ``hopper`` in ``fp8kv.backends``).

It serves the opt-in FP8 attention mode (docs/fp8_attention.md) on sm90 with FP8 tensor cores,
and the cache write through the Triton backend's kernel (:mod:`fp8kv_triton.kernels`: the same
bytes, bit-exact with the reference). Default-mode attention (bf16/fp16/fp32 math) is declined:
the Triton backend serves it. Priority 200: above Triton for what it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp8kv.plugins import BackendInfo, Request, hookimpl
from fp8kv.probe import DeviceInfo, probe, triton_interpreter

from . import __version__

if TYPE_CHECKING:
    from fp8kv_cuda.kernels import AttnPlan

    from fp8kv.metadata import AttentionMetadata

    from .attention import Fp8AttnConfig

HEAD_SIZES = (32, 64, 128, 256)
"""Head sizes served: the FP8 dot needs a power of two of at least 32 (wgmma's K step)."""

GRANULARITIES = ("tensor", "head")
"""FA3-style descales: one K and one V scale per (tensor or KV head); per-token-head V scales would
have to enter P before its e4m3 rounding."""


def fp8_attention(request: Request) -> bool:
    """Whether ``request`` asks for the FP8 attention mode."""
    return "fp8_attention" in request.features


def supports(device: DeviceInfo, request: Request) -> str | None:
    """None when the Hopper backend serves ``request`` on ``device``, else the reason."""
    if request.device_type == "cpu":
        if not triton_interpreter():
            return "sm90 only (FP8 wgmma); CPU tensors only through Triton's interpreter (TRITON_INTERPRET=1)"
    elif request.device_type != "cuda" or device.vendor != "nvidia":
        return f"{device.arch or device.vendor}: needs an NVIDIA sm90 GPU (FP8 wgmma)"
    elif device.sm != 90:
        return f"{device.arch}: needs sm90 (FP8 wgmma; other architectures are not compiled for or proven)"
    elif not device.triton:
        return "triton is not installed (pip install triton)"
    elif triton_interpreter():
        return "TRITON_INTERPRET is set: Triton would interpret these kernels on the CPU"
    if request.op == "write_kv":
        from fp8kv_triton.kernels import supports as triton_supports

        return triton_supports(device, request)
    if not fp8_attention(request):
        return "default-mode attention (16/32-bit math) is the triton backend's; hopper serves fp8_attention=True"
    if request.kv_dtype != "fp8_e4m3":
        return f"fp8_attention over {request.kv_dtype}: needs an fp8_e4m3 cache (e4m3 x e4m3 tensor cores)"
    if request.scale_granularity not in GRANULARITIES:
        return (f"fp8_attention with {request.scale_granularity} scales: needs {' or '.join(GRANULARITIES)} "
                "(one K/V descale per head, as FA3)")
    if request.head_size not in HEAD_SIZES:
        return f"head_size {request.head_size}: fp8_attention serves {', '.join(map(str, HEAD_SIZES))}"
    if request.io_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"query dtype {request.io_dtype}: needs float16, bfloat16 or float32"
    return None


def _triton_kernels():
    """:mod:`fp8kv_triton.kernels`, the Triton backend's public module, imported when first used."""
    import fp8kv_triton.kernels

    return fp8kv_triton.kernels


@dataclass(frozen=True)
class HopperPlan:
    """Per-step choices: the launch configuration, the interpreter flag, for a decode step the
    tensor-core decode's plan (fp8kv_cuda's ``plan_mma``: head chunks, KV split, warps), and for a
    prefill step the persistent wgmma kernel's work schedule (:func:`fp8kv_hopper.schedule.for_step`,
    from the step's host lengths), made once here rather than at every layer's call (None: not that
    kind of step, no CuPy, or no host lengths; the call then decides, or deals the snake)."""

    config: Fp8AttnConfig
    interpret: bool
    decode: AttnPlan | None = None
    schedule: torch.Tensor | None = None


def _decode_plan(metadata: AttentionMetadata, config: Fp8AttnConfig, interpret: bool) -> AttnPlan | None:
    """fp8kv_cuda's ``plan_mma`` plan for an FP8-mode decode step that its tensor-core decode may take."""
    if interpret or metadata.max_query_len > 1 or config.kernel not in ("auto", "cuda"):
        return None
    spec = metadata.spec
    if spec.device.type != "cuda" or not probe(spec.device).cupy:
        return None
    from fp8kv_cuda import kernels as cuda_kernels

    return cuda_kernels.plan_mma(spec.device, num_tokens=metadata.num_tokens, num_kv_heads=spec.num_kv_heads,
                                   group=metadata.num_q_heads // spec.num_kv_heads, head_size=spec.head_size,
                                   max_keys=metadata.block_tables.shape[1] * spec.block_size, fp8_attention=True)


def _prefill_schedule(metadata: AttentionMetadata, config: Fp8AttnConfig, interpret: bool,
                      into: torch.Tensor | None = None) -> torch.Tensor | None:
    """The persistent wgmma prefill's work schedule for a prefill step that kernel may serve, on the length
    tensors' device (None where it would not deal by one): with host lengths balanced on the host
    (:func:`fp8kv_hopper.schedule.host_schedule`, an asynchronous copy with spare rows for updates);
    without, the sorted snake made on the GPU from the length tensors (``device_schedule``). ``into``: a
    planned schedule to re-deal in place instead (left as it was where the new deal does not fit)."""
    from . import schedule, wgmma

    spec = metadata.spec
    if (interpret or metadata.max_query_len <= 1 or config.kernel not in ("auto", "wgmma") or config.wgmma_ctas <= 0
            or spec.device.type != "cuda" or spec.head_size != wgmma.HEAD_SIZE):
        return None
    opts = metadata.options
    sizes = dict(ctas=config.wgmma_ctas, num_kv_heads=spec.num_kv_heads,
                 group=metadata.num_q_heads // spec.num_kv_heads, num_tokens=metadata.num_tokens,
                 max_query_len=metadata.max_query_len, max_keys=metadata.block_tables.shape[1] * spec.block_size,
                 causal=opts.causal, sliding_window=opts.sliding_window)
    if metadata.host_seq_lens is None or metadata.host_query_start_loc is None:
        return schedule.device_schedule(metadata.seq_lens, metadata.query_start_loc, **sizes, out=into)
    host = schedule.host_schedule(metadata.host_seq_lens, metadata.host_query_start_loc, **sizes)
    if into is None:
        return schedule.on_device(host, metadata.seq_lens.device)
    return into if schedule.refill(into, host) else None


class HopperBackend:
    """FP8 tensor-core paged attention (FA3-style FP8 mode) on sm90; the Triton write kernel."""

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return BackendInfo(
            "hopper", __version__, priority=200,
            description="sm90 FP8 tensor cores (wgmma e4m3) for fp8_attention=True over fp8_e4m3 caches with "
                        "tensor/head scales; writes through the triton kernel",
            fast=True,
        )

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return supports(device, request)

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        """The Triton backend's write kernel (the same bytes on every backend)."""
        _triton_kernels().write_kv_for_device(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_plan_attention(self, metadata: AttentionMetadata) -> HopperPlan:
        from .attention import choose_config

        spec = metadata.spec
        interpret = triton_interpreter()
        sms = 1 if interpret else torch.cuda.get_device_properties(spec.device).multi_processor_count
        config = choose_config(group=metadata.num_q_heads // spec.num_kv_heads, num_seqs=metadata.num_seqs,
                               num_kv_heads=spec.num_kv_heads, max_query_len=metadata.max_query_len,
                               max_keys=metadata.block_tables.shape[1] * spec.block_size, num_sms=sms,
                               interpret=interpret)
        return HopperPlan(config, interpret, _decode_plan(metadata, config, interpret),
                          _prefill_schedule(metadata, config, interpret))

    @hookimpl
    def fp8kv_update_plan(self, metadata: AttentionMetadata) -> None:
        """Re-deal the prefill's work schedule in place by the updated lengths: balanced from the host
        lengths where given, else the sorted snake from the length tensors on the GPU; only where the new
        deal fits the planned buffer (else the planned one stays: complete for any lengths, balanced for
        the planned)."""
        plan: HopperPlan = metadata.backend_plan
        if plan is not None and plan.schedule is not None:
            _prefill_schedule(metadata, plan.config, plan.interpret, into=plan.schedule)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata: AttentionMetadata, out, lse) -> None:
        from .attention import paged_attention_fp8

        plan: HopperPlan = metadata.backend_plan
        opts = metadata.options
        paged_attention_fp8(query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                            metadata.max_query_len, opts.softmax_scale, opts.causal, opts.sliding_window,
                            opts.logits_soft_cap, out, q_scale=opts.q_scale, prob_scale=opts.prob_scale, lse=lse,
                            config=plan.config, interpret=plan.interpret, decode_plan=plan.decode,
                            schedule=plan.schedule)
