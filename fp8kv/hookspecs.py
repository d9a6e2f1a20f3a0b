"""The contract a backend plugin implements (pluggy project name ``fp8kv``).

A backend is any object with ``@hookimpl``-decorated methods named below, found
through the ``fp8kv.backends`` entry-point group (the value may be a class, which
is instantiated without arguments, a module, or an instance) or passed to
:func:`fp8kv.register_backend`. The built-in reference backend registers itself
exactly this way.

The core validates every argument before a backend sees it: shapes, dtypes,
devices, ranges and scales are already checked, contiguity is as documented, and
``out`` is allocated. A backend only decides whether it can serve a request and
then serves it exactly (writes bit-exact with :mod:`fp8kv.reference`, attention
within the documented tolerance).

Each hook is called on one backend at a time (the registry keeps each backend's
implementations apart), so every hook is ``firstresult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pluggy
import torch

if TYPE_CHECKING:
    from .cache import KVCache
    from .probe import DeviceInfo

PROJECT = "fp8kv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

OPS = ("write_kv", "paged_attention")
FEATURES = ("chunked_prefill", "sliding_window", "soft_cap", "fp8_query", "non_causal")
"""Optional features a paged-attention request can ask for."""


@dataclass(frozen=True)
class BackendInfo:
    """What a backend says about itself.

    Attributes:
        name: unique, short, lowercase (``"triton"``); what ``backend=`` names.
        version: the backend's version string.
        priority: higher wins when several backends can serve a request. The
            reference uses 0; fast GPU backends use 100 and up.
        description: one line for ``fp8kv probe``.
        fast: whether this is an accelerated backend (landing on a non-fast backend
            when a GPU is present warns once).
    """

    name: str
    version: str
    priority: int
    description: str = ""
    fast: bool = True


@dataclass(frozen=True)
class Request:
    """What an API call needs, as backends see it (hashable: selections are cached).

    Attributes:
        op: ``"write_kv"`` or ``"paged_attention"``.
        kv_dtype: canonical format name (``"fp8_e4m3"``...; never an alias).
        layout: ``"NHD"`` or ``"HND"``.
        scale_granularity: ``"tensor"``, ``"head"`` or ``"token_head"``.
        head_size: D.
        io_dtype: dtype of key/value (write) or query (attention).
        device_type: ``"cpu"`` or ``"cuda"`` (where the tensors live).
        features: subset of :data:`FEATURES` (attention only).
    """

    op: str
    kv_dtype: str
    layout: str
    scale_granularity: str
    head_size: int
    io_dtype: torch.dtype
    device_type: str = "cpu"
    features: frozenset[str] = field(default_factory=frozenset)

    def describe(self) -> str:
        feats = ",".join(sorted(self.features)) or "-"
        return (f"{self.op} {self.kv_dtype} {self.layout} {self.scale_granularity} "
                f"D={self.head_size} {str(self.io_dtype).removeprefix('torch.')} features={feats}")


class BackendSpec:
    """Hook specifications. Implement them on your backend object with ``@hookimpl``."""

    @hookspec(firstresult=True)
    def fp8kv_backend_info(self) -> BackendInfo:
        """Return this backend's :class:`BackendInfo` (name, version, priority).

        Called once when the backend is registered.
        """

    @hookspec(firstresult=True)
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        """Return ``None`` if this backend serves ``request`` on ``device``, else a
        short human-readable reason it does not (shown by ``fp8kv probe`` and in
        errors), e.g. ``"fp8_e4m3 needs sm89+ for native casts"``.

        ``device`` may be simulated: decide from its fields, not by touching hardware.
        Called once per (device, request); the answer is cached.
        """

    @hookspec(firstresult=True)
    def fp8kv_write_kv(
        self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Quantize and scatter ``key``/``value`` into ``cache``, in place.

        Args:
            cache: the layer's cache; for ``token_head`` granularity also write the
                new scales into ``cache.k_scale``/``v_scale[block, offset, head]``.
            key, value: ``[num_tokens, H, D]`` fp32/fp16/bf16, contiguous.
            slot_mapping: ``[num_tokens]`` int32/int64; negative = padding, skip it.
                Valid slots are distinct and < ``cache.num_slots``.
        Must be bit-exact with :func:`fp8kv.reference.write_kv`; must not touch any
        byte outside the mapped slots.
        """

    @hookspec(firstresult=True)
    def fp8kv_paged_attention(
        self,
        query: torch.Tensor,
        cache: KVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        softmax_scale: float,
        causal: bool,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        out: torch.Tensor,
    ) -> None:
        """Paged attention over the FP8 cache, written into ``out``.

        Args:
            query: ``[num_tokens, Hq, D]``, Hq a multiple of H.
            block_tables: ``[num_seqs, max_blocks]`` int32.
            seq_lens: ``[num_seqs]`` int32: cached tokens per sequence incl. new ones.
            query_start_loc: ``[num_seqs + 1]`` int32, monotone, last = num_tokens
                (decode: ``arange(num_seqs + 1)``).
            max_query_len: largest ``query_start_loc`` step (1 for decode).
            softmax_scale: multiplies q·k before the soft-cap.
            causal: the i-th of a sequence's q_len queries sits at position
                ``seq_len - q_len + i`` and sees keys up to it; False: all keys.
            sliding_window: ``W``: only the last W visible keys (incl. its own).
            logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``.
            out: ``[num_tokens, Hq, D]`` in the query dtype.
        """
