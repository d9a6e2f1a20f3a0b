"""The paged FP8 KV cache: layout, allocation, scales and memory accounting.

Layouts (``H`` = KV heads, ``D`` = head size):

- ``NHD``: ``[num_blocks, block_size, H, D]`` (vLLM's flash layout)
- ``HND``: ``[num_blocks, H, block_size, D]`` (FlashInfer / paged-attention v1 layout)

A token at ``slot = block * block_size + offset`` lives in ``cache[block, offset]``
(NHD) or ``cache[block, :, offset]`` (HND).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import Fp8KVError, bad_argument
from .formats import Fp8Format, check_scale, ensure_fp8
from .scales import check_granularity

if TYPE_CHECKING:
    from .checkpoint import KVCachePlan

LAYOUTS = ("NHD", "HND")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise bad_argument("layout", repr(layout), f"one of {LAYOUTS}")
    return layout


def _static_scale(value, name: str, granularity: str, num_kv_heads: int, device) -> torch.Tensor:
    """A validated float32 static scale of shape ``()`` (tensor) or ``(H,)`` (head)."""
    s = check_scale(1.0 if value is None else value, name)
    if granularity == "tensor":
        if s.numel() != 1:
            raise bad_argument(name, tuple(s.shape), "one value (shape () or (1,)) for per-tensor scales")
        s = s.reshape(())
    else:
        if s.numel() == 1:
            s = s.reshape(()).expand(num_kv_heads)
        elif tuple(s.shape) != (num_kv_heads,):
            raise bad_argument(name, tuple(s.shape), f"shape ({num_kv_heads},) for per-head scales")
    return s.to(device=device, dtype=torch.float32).contiguous().clone()


@dataclass
class KVCache:
    """One layer's paged FP8 K and V cache with its scales.

    Attributes:
        key_cache / value_cache: float8 tensors, NHD ``[num_blocks, block_size, H, D]``
            or HND ``[num_blocks, H, block_size, D]``.
        k_scale / v_scale: float32 dequant multipliers: ``()`` (tensor), ``(H,)``
            (head) or ``(num_blocks, block_size, H)`` (token_head, written by write_kv).
        fmt: the storage format; ``kv_dtype`` is its name.
        layout: ``"NHD"`` or ``"HND"``; scale_granularity: see :mod:`fp8kv.scales`.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    fmt: Fp8Format
    layout: str
    scale_granularity: str
    meta: dict = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        kv_dtype: str | None = None,
        layout: str = "NHD",
        scale_granularity: str | None = None,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        device: torch.device | str | None = None,
        plan: KVCachePlan | None = None,
        layer: int | None = None,
    ) -> KVCache:
        """Allocate a zero-filled cache (static scales default to 1.0).

        ``kv_dtype`` defaults to ``"fp8_e4m3"`` and ``scale_granularity`` to ``"tensor"``;
        ``kv_dtype="fp8"`` means the platform's e4m3 of ``device`` (fnuz on gfx942).
        ``plan`` (from :func:`fp8kv.resolve_kv_cache`) supplies kv_dtype, granularity and
        ``layer``'s k/v scales; explicit arguments that conflict with it raise Fp8KVError.
        """
        if plan is not None:
            kv_dtype, scale_granularity, k_scale, v_scale = plan.cache_arguments(
                layer, kv_dtype=kv_dtype, scale_granularity=scale_granularity,
                k_scale=k_scale, v_scale=v_scale)
        elif layer is not None:
            raise bad_argument("layer", repr(layer), "None without a plan (it picks the plan's scales)")
        kv_dtype = "fp8_e4m3" if kv_dtype is None else kv_dtype
        scale_granularity = "tensor" if scale_granularity is None else scale_granularity
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad_argument(name, repr(v), "a positive int")
        device = torch.device(device) if device is not None else torch.device("cpu")
        if kv_dtype == "fp8":
            from .probe import probe

            fmt = ensure_fp8(probe(device).fp8_alias)
        else:
            fmt = ensure_fp8(kv_dtype)
        check_layout(layout)
        check_granularity(scale_granularity)
        shape = ((num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_size))
        key_cache = torch.zeros(shape, dtype=fmt.torch_dtype, device=device)
        value_cache = torch.zeros(shape, dtype=fmt.torch_dtype, device=device)
        if scale_granularity == "token_head":
            if k_scale is not None or v_scale is not None:
                raise Fp8KVError("k_scale/v_scale: got static scales, expected None with "
                                 "scale_granularity='token_head' (scales are computed at write time)")
            ks = torch.ones((num_blocks, block_size, num_kv_heads), dtype=torch.float32, device=device)
            vs = ks.clone()
        else:
            ks = _static_scale(k_scale, "k_scale", scale_granularity, num_kv_heads, device)
            vs = _static_scale(v_scale, "v_scale", scale_granularity, num_kv_heads, device)
        return cls(key_cache, value_cache, ks, vs, fmt, layout, scale_granularity)

    # -- geometry -----------------------------------------------------------------
    @property
    def kv_dtype(self) -> str:
        return self.fmt.name

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1 if self.layout == "NHD" else 2]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2 if self.layout == "NHD" else 1]

    @property
    def head_size(self) -> int:
        return self.key_cache.shape[3]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def device(self) -> torch.device:
        return self.key_cache.device

    # -- memory accounting --------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token costs: K and V codes, plus its dynamic scales if any."""
        per = 2 * self.num_kv_heads * self.head_size
        if self.scale_granularity == "token_head":
            per += 2 * self.num_kv_heads * self.k_scale.element_size()
        return per

    @property
    def constant_bytes(self) -> int:
        """Bytes that do not grow with tokens (static k and v scales)."""
        if self.scale_granularity == "token_head":
            return 0
        return self.k_scale.nbytes + self.v_scale.nbytes

    @property
    def nbytes(self) -> int:
        """Total bytes held: both caches and all scales."""
        return self.key_cache.nbytes + self.value_cache.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    @property
    def bf16_nbytes(self) -> int:
        """Bytes a bf16 cache of the same capacity would hold."""
        return 2 * self.key_cache.numel() * 2

    @property
    def bf16_ratio(self) -> float:
        """``nbytes / bf16_nbytes`` (0.5 plus the scales' share)."""
        return self.nbytes / self.bf16_nbytes

    # -- views used by the reference and tests -----------------------------------
    def token_view(self, which: str = "key") -> torch.Tensor:
        """The cache as ``[num_slots, H, D]`` (a copy for HND)."""
        c = self.key_cache if which == "key" else self.value_cache
        if self.layout == "HND":
            c = c.transpose(1, 2)
        return c.reshape(self.num_slots, self.num_kv_heads, self.head_size)

    def scale_per_slot(self, which: str = "key") -> torch.Tensor:
        """The dequant scale of every slot and head as ``[num_slots, H]`` float32."""
        s = self.k_scale if which == "key" else self.v_scale
        if self.scale_granularity == "token_head":
            return s.reshape(self.num_slots, self.num_kv_heads)
        return s.reshape(1, -1).expand(self.num_slots, self.num_kv_heads)

    def dequantized(self, which: str = "key") -> torch.Tensor:
        """Every slot dequantized to float32, ``[num_slots, H, D]``."""
        q = self.token_view(which).to(torch.float32)
        return q * self.scale_per_slot(which)[..., None]

    def clone(self) -> KVCache:
        return KVCache(self.key_cache.clone(), self.value_cache.clone(), self.k_scale.clone(),
                       self.v_scale.clone(), self.fmt, self.layout, self.scale_granularity, dict(self.meta))

    def same_bytes(self, other: KVCache) -> bool:
        """True when both caches and scales are byte-identical."""
        return all(
            torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                        b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))
            for a, b in ((self.key_cache, other.key_cache), (self.value_cache, other.value_cache),
                         (self.k_scale, other.k_scale), (self.v_scale, other.v_scale))
        )
