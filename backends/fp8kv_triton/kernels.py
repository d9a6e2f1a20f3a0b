"""The Triton backend's public kernel module: what other in-tree backends may reuse.

A backend that wants the bit-exact fused write (the Hopper backend, a ROCm policy) or the
codec building blocks imports them from here, never from the private modules, so the
kernels live in one place and are never copied. Everything below is stable API of
``fp8kv_triton``; names not listed here are private.

Host-side launchers (tensors in, work enqueued, no host sync):

* :func:`write_kv` ``(cache, key, value, slot_mapping, *, encoder)``: quantize and scatter
  ``key``/``value [T, H, D]`` into a :class:`fp8kv.KVCache` (any K/V/scale strides),
  bit-exact with :func:`fp8kv.reference.write_kv`; :func:`write_kv_for_device` ``(cache, key,
  value, slot_mapping)`` with the encoder the cache's GPU (:func:`device_arch`) and format use.
* :func:`paged_attention` ``(query, cache, block_tables, seq_lens, query_start_loc,
  max_query_len, softmax_scale, causal, sliding_window, logits_soft_cap, out, *, lse,
  decode_mode, interpret, config)``: decode and chunked prefill with split-KV;
  :func:`choose_config` picks an :class:`AttnConfig` from host-known sizes.
* :func:`launching` ``(kernel)``: the context every launch of a ``@triton.jit`` kernel goes in
  (``with launching(kernel): kernel[grid](...)``): under Triton's CPU interpreter, which is not
  thread-safe, it holds :data:`INTERPRETER_LOCK` (one interpreted launch at a time in the process);
  on a GPU it takes no lock.
* :func:`cache_strides` / :func:`scale_strides`: the (block, token, head) strides a kernel
  needs for K, V and their scales.

Codec policy (which FP8 conversion is exact where): :func:`codec_for` returns a
:class:`CodecChoice` (``encoder``/``decoder`` mode numbers and why) for an architecture and
format (``"sm90"``, ``"gfx942"``...); :func:`supports` is the Triton backend's capability rule
(NVIDIA sm80+, AMD gfx942/gfx950: see docs/rocm.md). :func:`write_launch` and
:func:`choose_config` take the arch for their launch sizes (64-wide wavefronts on AMD).

``@triton.jit`` building blocks for kernels of your own: :func:`encode_f32_bits` (the
integer-bit encoder mirroring :mod:`fp8kv.codec`), :func:`encode_native` (Triton's cast,
after a clamp), :func:`decode` (FP8 byte to an exact 16/32-bit float), and
:func:`codec_args` (the per-format constexpr arguments they take); the attention kernel's
pieces: :func:`tile_keys` (a tile's key positions, mask and K/V offsets through the block table,
block ids checked against the cache), :func:`scale_factors` (a scale times ``softmax_scale`` as
two float32 factors that never overflow on their own), :func:`saturate` / :func:`saturate_out`,
:func:`softcap_tanh`, :func:`pow2`, :func:`lse_from_state` (natural-log lse from the base-2
online-softmax state), and the host launcher :func:`merge_splits` (the split-KV merge).
"""

from .attention import AttnConfig, choose_config, merge_splits, paged_attention
from .capabilities import CodecChoice, codec_for, device_arch, supports
from .codec import codec_args, decode, encode_f32_bits, encode_native
from .modes import DEC_E4M3, DEC_E5M2, DEC_GENERIC, DEC_NATIVE, ENC_INTEGER, ENC_NATIVE
from .serial import INTERPRETER_LOCK, launching
from .tiles import _key_range as key_range
from .tiles import _lse as lse_from_state
from .tiles import _pow2 as pow2
from .tiles import _program_rows as program_rows
from .tiles import _query_span as query_span
from .tiles import _saturate as saturate
from .tiles import _saturate_out as saturate_out
from .tiles import _scale_factors as scale_factors
from .tiles import _tanh as softcap_tanh
from .tiles import _tile as tile_keys
from .write import cache_strides, scale_strides, write_kv, write_kv_for_device, write_launch

__all__ = [
    "DEC_E4M3", "DEC_E5M2", "DEC_GENERIC", "DEC_NATIVE", "ENC_INTEGER", "ENC_NATIVE", "INTERPRETER_LOCK",
    "AttnConfig", "CodecChoice", "cache_strides", "choose_config", "codec_args", "codec_for", "decode", "device_arch",
    "encode_f32_bits", "encode_native", "key_range", "launching", "lse_from_state", "merge_splits", "paged_attention",
    "pow2", "program_rows",
    "query_span", "saturate", "saturate_out", "scale_factors", "scale_strides", "softcap_tanh", "supports",
    "tile_keys", "write_kv", "write_kv_for_device", "write_launch",
]
