"""What the core and a backend say to each other about one operation: the request, the
backend's description of itself, and the registry's choice.

These are plain data, below the metadata, the hook specifications and the registry, so each of
those can name them without importing the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .cache import CacheSpec, KVCache
    from .probe import DeviceInfo

OPS = ("write_kv", "paged_attention")
"""The operations a request can name."""
FEATURES = ("chunked_prefill", "sliding_window", "soft_cap", "non_causal", "fp8_attention")
"""Optional features a paged-attention request can ask for:

* ``chunked_prefill``: ``query_start_loc`` given and some sequence has more than one query;
* ``sliding_window`` / ``soft_cap``: those arguments are set;
* ``non_causal``: ``causal=False``;
* ``fp8_attention``: the opt-in FP8 attention mode (query and probabilities rounded to e4m3 for
  FP8 tensor cores; :mod:`fp8kv.fp8_attention`, docs/fp8_attention.md). A backend that does not
  implement it must decline requests with this feature.
"""


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
        features: subset of :data:`FEATURES` (attention only; empty for writes).

    Requests are frozen and hashable; the registry caches each backend's answer per
    (device, request). ``fp8kv.testing.Workload.request(op)`` builds the same request an
    API call on that workload builds.
    """

    op: str
    kv_dtype: str
    layout: str
    scale_granularity: str
    head_size: int
    io_dtype: torch.dtype
    device_type: str = "cpu"
    features: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def for_write(cls, spec: CacheSpec, io_dtype: torch.dtype) -> Request:
        """The request of a ``write_kv`` of ``io_dtype`` K/V into a cache of ``spec``."""
        return cls("write_kv", spec.kv_dtype, spec.layout, spec.scale_granularity, spec.head_size, io_dtype,
                   spec.device.type)

    @classmethod
    def for_attention(cls, spec: CacheSpec, io_dtype: torch.dtype, features: frozenset[str] = frozenset()) -> Request:
        """The request of a ``paged_attention`` with ``io_dtype`` queries over a cache of ``spec``."""
        return cls("paged_attention", spec.kv_dtype, spec.layout, spec.scale_granularity, spec.head_size, io_dtype,
                   spec.device.type, features)

    def describe(self) -> str:
        feats = ",".join(sorted(self.features)) or "-"
        return (f"{self.op} {self.kv_dtype} {self.layout} {self.scale_granularity} "
                f"D={self.head_size} {str(self.io_dtype).removeprefix('torch.')} features={feats}")


class ChosenBackend(Protocol):
    """The backend a :class:`Selection` names, as the API calls it (:class:`fp8kv.registry.Backend`
    implements it: each method runs the plugin's hook of the same name behind the registry's guard)."""

    @property
    def name(self) -> str: ...

    def write_kv(self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def plan_attention(self, device: DeviceInfo, metadata: Any) -> Any: ...

    def update_plan(self, device: DeviceInfo, metadata: Any) -> None: ...

    def paged_attention(self, query: torch.Tensor, cache: KVCache, metadata: Any, out: torch.Tensor,
                        lse: torch.Tensor | None) -> None: ...


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`fp8kv.plugins.select_backend`.

    Attributes:
        backend: the backend that will serve the request.
        reasons: every backend passed over -> why (lower priority ones that could
            also serve say ``"can serve, lower priority than <name>"``; backends
            ``FP8KV_AUTO_BACKENDS`` leaves out say so).
        request, device: what was asked, where.
        forced: True when the backend was named by the caller or ``FP8KV_BACKEND``.
    """

    backend: ChosenBackend
    reasons: dict[str, str]
    request: Request
    device: DeviceInfo
    forced: bool = False

    def explain(self) -> str:
        lines = [f"{self.request.describe()} on {self.device.name}: {self.backend.name}"
                 + (" (forced)" if self.forced else "")]
        lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


__all__ = ["FEATURES", "OPS", "BackendInfo", "ChosenBackend", "Request", "Selection"]
