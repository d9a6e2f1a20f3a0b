"""The paged FP8 KV cache: layout, allocation, wrapping an engine's tensors, memory accounting.

Layouts (``H`` = KV heads, ``D`` = head size) name the order of the dimensions:

- ``NHD``: ``[num_blocks, block_size, H, D]`` (vLLM's flash layout)
- ``HND``: ``[num_blocks, H, block_size, D]`` (FlashInfer / paged-attention v1 layout)

A token at ``slot = block * block_size + offset`` lives in ``cache[block, offset]``
(NHD) or ``cache[block, :, offset]`` (HND). Strides are free apart from ``D``'s, which is 1:
K and V may be views of one engine tensor (``t[:, 0]`` and ``t[:, 1]``), two allocations
with different paddings, a permutation (vLLM's HND storage seen as NHD), or a slice of the
heads (a tensor-parallel rank); every backend honours each tensor's own strides.

A :class:`KVCache` is validated when it is built and frozen afterwards, so a cache that
passed stays valid. :meth:`KVCache.allocate` makes a new one; :meth:`KVCache.from_tensors`
wraps an engine's memory without copying (``docs/engines.md`` has a recipe per engine).
Every way of building one (the constructor, ``dataclasses.replace``, :meth:`~KVCache.allocate`,
:meth:`~KVCache.from_tensors`, :meth:`~KVCache.slice_heads`, :meth:`~KVCache.to`,
:meth:`~KVCache.clone`) runs the same checks, static scale values included.

Frozen fields cannot stop a tensor from being changed in place (``set_``, ``resize_``,
``as_strided_``, ``untyped_storage().resize_``). The cache records what each of its tensors was
when it was built and keeps each original storage alive; every operation calls
:meth:`KVCache.check_intact` before it reaches a backend, so a kernel is never launched on memory
the cache was not built over.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .checks import int_at_least
from .errors import Unsupported, bad_argument
from .formats import FORMATS, Fp8Format, check_scale, ensure_fp8, get_format
from .scales import GRANULARITIES, check_granularity

LAYOUTS = ("NHD", "HND")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise bad_argument("layout", repr(layout), f"one of {LAYOUTS}")
    return layout


@dataclass(frozen=True)
class CacheSpec:
    """What a backend, a metadata object and a request need to know about a cache (hashable).

    Every layer of a model has the same spec, so one :class:`fp8kv.AttentionMetadata`
    serves all of them.
    """

    kv_dtype: str
    layout: str
    scale_granularity: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    device: torch.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"{self.kv_dtype} {self.layout} {self.scale_granularity} num_blocks={self.num_blocks} "
                f"block_size={self.block_size} H={self.num_kv_heads} D={self.head_size} on {self.device}")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last]`` byte addresses ``t`` may touch."""
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size() - 1


def may_share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may address a common byte.

    Decided on byte addresses, whatever storage objects hold the tensors (two NumPy or DLPack
    imports of one buffer are different storages over the same bytes): disjoint extents never
    share; two views with the same shape, strides and element size (the engines' ``t[:, 0]`` /
    ``t[:, 1]``, interleaved) are checked exactly; anything else whose extents overlap is
    assumed to share. Meta tensors have no memory: only views of one meta storage can share.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.device.type == "meta" and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    if a1 < b0 or b1 < a0:
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.element_size() != b.element_size():
        return True
    # b's element 0 starts q elements and r bytes after a's: it overlaps a's elements at
    # relative offsets q and, when misaligned, q + 1
    q, r = divmod(b0 - a0, a.element_size())
    return _offset_reachable(q, a.shape, a.stride()) or (r != 0 and _offset_reachable(q + 1, a.shape, a.stride()))


def _offset_reachable(delta: int, shape, stride) -> bool:
    """Is ``delta = sum_k c_k stride_k`` for some integers ``|c_k| < shape_k``? (Two views of one
    geometry ``delta`` elements apart share an element exactly then.) A pruned search: with
    nested strides each level leaves at most two candidates; past its budget it answers True."""
    dims = sorted(((s, n) for s, n in zip(stride, shape, strict=True) if n > 1), reverse=True)

    def search(rest: int, k: int, budget: list[int]) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return True  # too many branches: assume they may overlap
        if k == len(dims):
            return rest == 0
        bound = sum((n - 1) * s for s, n in dims[k + 1:])  # what the inner dims can still reach
        s, n = dims[k]
        lo = max(-(n - 1), -((bound - rest) // s) if s else -(n - 1))
        hi = min(n - 1, (rest + bound) // s if s else n - 1)
        return any(search(rest - c * s, k + 1, budget) for c in range(lo, hi + 1))

    return search(delta, 0, [4096])


def _check_strides(name: str, t: torch.Tensor) -> None:
    """``D`` contiguous and the outer dims non-overlapping (nested strides, any order)."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise bad_argument(name, f"strides {t.stride()}", "a stride of 1 for the last (head_size) dimension")
    extent = t.shape[-1]
    for s, n in sorted((s, n) for s, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1):
        if s < extent:
            raise bad_argument(name, f"shape {tuple(t.shape)} with strides {t.stride()}",
                               "non-overlapping strides (every element its own bytes)")
        extent = s * n
    if any(s < 0 for s in t.stride()):
        raise bad_argument(name, f"strides {t.stride()}", "non-negative strides")


def _as_format(name: str, t, fmt: Fp8Format | None) -> tuple[torch.Tensor, Fp8Format]:
    """``t`` as the format's float8 dtype (uint8 storage is viewed, never copied)."""
    if not isinstance(t, torch.Tensor):
        raise bad_argument(name, type(t).__name__, "a torch.Tensor")
    if t.dtype == torch.uint8:
        if fmt is None:
            raise bad_argument("kv_dtype", None, f"a format name when {name} is uint8 storage")
        return t.view(fmt.torch_dtype), fmt
    by_dtype = {f.torch_dtype: f for f in FORMATS.values()}
    if t.dtype not in by_dtype:
        raise bad_argument(name, f"dtype {t.dtype}", "a float8 dtype or uint8 storage")
    if fmt is not None and by_dtype[t.dtype] is not fmt:
        raise bad_argument(name, f"dtype {t.dtype}",
                           f"{fmt.torch_dtype} (kv_dtype={fmt.name!r}) or uint8 storage")
    return t, by_dtype[t.dtype]


def _static_scale(value, name: str, granularity: str, num_kv_heads: int, device) -> torch.Tensor:
    """A validated float32 static scale of shape ``()`` (tensor) or ``(H,)`` (head).

    A float32 tensor already on ``device`` with the right shape is used as is (zero-copy:
    an engine may update it in place; its values are checked by the constructor, in the one host
    transfer it makes for both scales); anything else is checked and converted.
    """
    want = () if granularity == "tensor" else (num_kv_heads,)
    given = value if isinstance(value, torch.Tensor) else None
    if (given is not None and given.dtype == torch.float32 and given.device == torch.device(device)
            and given.device.type != "meta"):
        if given.numel() == 1 and granularity == "tensor":
            return given.reshape(())
        if tuple(given.shape) == want:
            return given
    s = check_scale(1.0 if value is None else value, name)
    if granularity == "tensor":
        if s.numel() != 1:
            raise bad_argument(name, f"shape {tuple(s.shape)}", "one value (shape () or (1,)) for per-tensor scales")
        s = s.reshape(())
    elif s.numel() == 1:
        s = s.reshape(()).expand(num_kv_heads)
    elif tuple(s.shape) != want:
        raise bad_argument(name, f"shape {tuple(s.shape)}", f"shape ({num_kv_heads},) for per-head scales")
    return s.to(device=device, dtype=torch.float32).contiguous().clone()


def _static_scale_values_ok(k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple[bool, bool]:
    """Whether every value of each static scale is finite and > 0: one host transfer for both
    (a device sync for CUDA scales; build time only, never per layer)."""
    checks = [(torch.isfinite(s) & (s > 0)).all() for s in (k_scale, v_scale)]
    k_ok, v_ok = torch.stack(checks).tolist()
    return k_ok, v_ok


def _values_readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read now: not on the meta device, not a fake tensor under
    ``torch.compile``, and not on a CUDA stream that is capturing a graph (no sync allowed)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _fingerprint(t: torch.Tensor) -> tuple:
    """What the memory a cache tensor addresses is: its first byte, geometry and storage size.

    ``set_`` (another storage or offset), ``resize_``, ``as_strided_``, ``.data =`` and a resize of
    the storage itself (``untyped_storage().resize_``, which moves or frees the bytes) each change
    at least one entry."""
    return t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes()


def _describe_fingerprint(fp: tuple) -> str:
    ptr, shape, stride, offset, nbytes = fp
    return (f"shape {tuple(shape)}, strides {tuple(stride)}, storage offset {offset}, "
            f"address {ptr:#x} in a storage of {nbytes} bytes")


def _token_head_scale(value, name: str, shape: tuple[int, int, int], device) -> torch.Tensor:
    """The engine's ``[num_blocks, block_size, H]`` float32 scale tensor, or a new one of ones."""
    if value is None:
        return torch.ones(shape, dtype=torch.float32, device=device)
    if not isinstance(value, torch.Tensor):
        raise bad_argument(name, type(value).__name__,
                           f"None or a float32 tensor of shape {list(shape)} (token_head scales are written "
                           "by write_kv)")
    if value.dtype != torch.float32 or tuple(value.shape) != shape or value.device != torch.device(device):
        raise bad_argument(name, f"{value.dtype} {tuple(value.shape)} on {value.device}",
                           f"float32 of shape {list(shape)} on {device}")
    if any(s < 0 for s in value.stride()) or (value.numel() and torch._debug_has_internal_overlap(value) == 1):
        raise bad_argument(name, f"strides {value.stride()}", "non-overlapping strides")
    return value


def paired(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``[2, *a.shape]``: ``a`` and ``b`` as one strided view of their common storage, or None.

    Only when they have the same dtype, device, shape and strides, and ``b`` starts a positive
    number of elements after ``a`` in the same storage (never for separate allocations)."""
    if (a.dtype != b.dtype or a.device != b.device or a.shape != b.shape or a.stride() != b.stride()
            or a.device.type == "meta" or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    delta = b.storage_offset() - a.storage_offset()
    if delta <= 0:
        return None
    return a.as_strided((2, *a.shape), (delta, *a.stride()), a.storage_offset())


def _of_spec(name: str) -> property:
    """A read-only attribute of a cache that is its spec's ``name``."""
    return property(lambda self: getattr(self.spec, name), doc=f"The spec's ``{name}``.")


@dataclass(frozen=True)
class KVCache:
    """One layer's paged FP8 K and V cache with its scales. Frozen; validated when built.

    Attributes:
        key_cache / value_cache: float8 tensors, NHD ``[num_blocks, block_size, H, D]``
            or HND ``[num_blocks, H, block_size, D]``, each with its own strides (``D``'s is 1).
        k_scale / v_scale: float32 dequant multipliers: ``()`` (tensor), ``(H,)``
            (head) or ``(num_blocks, block_size, H)`` (token_head, written by write_kv).
        fmt: the storage format; ``kv_dtype`` is its name.
        layout: ``"NHD"`` or ``"HND"``; scale_granularity: see :mod:`fp8kv.scales`.
        spec: the :class:`CacheSpec` (derived).

    Build one with :meth:`allocate` or :meth:`from_tensors`; the constructor checks the
    same things (shapes, dtypes, devices, strides, scale shapes, static scale values finite and
    > 0, no shared bytes), and so does every other way of building one (``dataclasses.replace``,
    :meth:`slice_heads`, :meth:`to`, :meth:`clone`). ``token_head`` scale values are not read
    (see :meth:`_check_static_scale_values`). Tensors changed in place afterwards are caught
    by :meth:`check_intact`, which every operation calls.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    fmt: Fp8Format
    layout: str
    scale_granularity: str
    spec: CacheSpec = dataclasses.field(init=False, repr=False, compare=False)
    _extents: tuple = dataclasses.field(init=False, repr=False, compare=False)
    _span: tuple = dataclasses.field(init=False, repr=False, compare=False)
    _fingerprints: tuple = dataclasses.field(init=False, repr=False, compare=False)
    _storages: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("key_cache", "value_cache", "k_scale", "v_scale"):  # inference only: never in a graph
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                object.__setattr__(self, name, t.detach())
        object.__setattr__(self, "spec", self._validate())
        self._record_addresses()

    def _record_addresses(self) -> None:
        """Remember each tensor's byte extent, and their span, for :meth:`shares_memory_with`; its
        fingerprint for :meth:`check_intact`; and its storage, kept alive with the cache."""
        tensors = (self.key_cache, self.value_cache, self.k_scale, self.v_scale)
        extents = tuple(_extent(t) for t in tensors)
        object.__setattr__(self, "_extents", extents)
        object.__setattr__(self, "_span", (min(a for a, _ in extents), max(b for _, b in extents)))
        object.__setattr__(self, "_fingerprints", tuple(_fingerprint(t) for t in tensors))
        object.__setattr__(self, "_storages", tuple(t.untyped_storage() for t in tensors))

    def check_intact(self, argument: str = "cache") -> None:
        """Raise :class:`fp8kv.InvalidArgument` naming the cache tensor that was changed in place
        since the cache was built: re-pointed (``set_``, ``.data =``), resized (``resize_``, or its
        storage's ``untyped_storage().resize_``) or restrided (``as_strided_``).

        The kernels address a cache by its live tensors and its spec; a tensor changed under a
        frozen cache could lead them outside its memory. Every operation of :mod:`fp8kv.api`
        calls this before any backend, whatever ``FP8KV_CHECK`` says: a comparison of host
        integers (about 2 us a call on the CPU; no device sync). Skipped while
        ``torch.compile`` traces (fake tensors have no addresses).

        The cache keeps the storage each tensor had when it was built alive, so a CUDA graph
        captured on its addresses still writes into memory the cache owns after a ``set_``. A
        resize of the storage itself frees its old bytes (torch's own semantics, which no handle
        can prevent): calls made after it raise here, but a graph captured before it must not be
        replayed. The cache's own methods that read or derive from its tensors (:meth:`slice_heads`,
        :meth:`clone`, :meth:`to`, :meth:`copy_`) call it too. ``argument`` prefixes the name in
        the error (``cache.value_cache``).
        """
        if torch.compiler.is_compiling():
            return
        fingerprints = (_fingerprint(self.key_cache), _fingerprint(self.value_cache), _fingerprint(self.k_scale),
                        _fingerprint(self.v_scale))
        if fingerprints != self._fingerprints:
            self._raise_changed(fingerprints, argument)

    def _raise_changed(self, fingerprints: tuple, argument: str) -> None:
        names = ("key_cache", "value_cache", "k_scale", "v_scale")
        for name, now, built in zip(names, fingerprints, self._fingerprints, strict=True):
            if now != built:
                raise bad_argument(f"{argument}.{name}",
                                   f"a tensor resized or re-pointed in place after the cache was built (now "
                                   f"{_describe_fingerprint(now)}; built with {_describe_fingerprint(built)})",
                                   "the tensor the cache was built with, unchanged; build a new KVCache over "
                                   "the new memory (KVCache.from_tensors)")

    @classmethod
    def unchecked(cls, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
                  v_scale: torch.Tensor, fmt: Fp8Format, layout: str, scale_granularity: str,
                  spec: CacheSpec) -> KVCache:
        """A cache from tensors already validated as one with ``spec`` (no checks; for fp8kv's own
        rebuilds, e.g. inside its torch custom ops). Anything else should use the constructor.
        Records the tensors' fingerprints for :meth:`check_intact` (host integers only)."""
        cache = object.__new__(cls)
        fields = dict(key_cache=key_cache, value_cache=value_cache, k_scale=k_scale, v_scale=v_scale, fmt=fmt,
                      layout=layout, scale_granularity=scale_granularity, spec=spec)
        for name, value in fields.items():
            object.__setattr__(cache, name, value)
        cache._record_addresses()
        return cache

    def shares_memory_with(self, t: torch.Tensor) -> str | None:
        """The name of the cache tensor ``t`` may share bytes with, or None (cheap: extents first)."""
        if t.numel() == 0 or t.device != self.spec.device or t.device.type == "meta":
            return None
        if t.is_contiguous():
            lo = t.data_ptr()
            hi = lo + t.numel() * t.element_size() - 1
        else:
            lo, hi = _extent(t)
        if hi < self._span[0] or self._span[1] < lo:  # the usual case: nowhere near the cache
            return None
        names = ("key_cache", "value_cache", "k_scale", "v_scale")
        for name, (a, b) in zip(names, self._extents, strict=True):
            if lo <= b and a <= hi and may_share_bytes(t, getattr(self, name)):
                return name
        return None

    def _validate(self) -> CacheSpec:
        if not isinstance(self.fmt, Fp8Format):
            raise bad_argument("fmt", type(self.fmt).__name__, "an fp8kv.Fp8Format")
        check_layout(self.layout)
        check_granularity(self.scale_granularity)
        k, v = self.key_cache, self.value_cache
        for name, t in (("key_cache", k), ("value_cache", v)):
            if not isinstance(t, torch.Tensor):
                raise bad_argument(name, type(t).__name__, "a torch.Tensor")
            if t.dtype != self.fmt.torch_dtype:
                raise bad_argument(name, f"dtype {t.dtype}", f"{self.fmt.torch_dtype} (kv_dtype={self.fmt.name!r})")
            if t.dim() != 4 or 0 in t.shape:
                order = "[num_blocks, block_size, H, D]" if self.layout == "NHD" else "[num_blocks, H, block_size, D]"
                raise bad_argument(name, f"shape {tuple(t.shape)}", f"4 non-empty dimensions {order}")
            _check_strides(name, t)
        if v.shape != k.shape:
            raise bad_argument("value_cache", f"shape {tuple(v.shape)}", f"key_cache's shape {tuple(k.shape)}")
        if v.device != k.device:
            raise bad_argument("value_cache", f"device {v.device}", f"key_cache's device {k.device}")
        nb = k.shape[0]
        bs, H = (k.shape[1], k.shape[2]) if self.layout == "NHD" else (k.shape[2], k.shape[1])
        want = {"tensor": (), "head": (H,), "token_head": (nb, bs, H)}[self.scale_granularity]
        for name, s in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if not isinstance(s, torch.Tensor):
                raise bad_argument(name, type(s).__name__, "a float32 tensor")
            if s.dtype != torch.float32 or tuple(s.shape) != want or s.device != k.device:
                raise bad_argument(name, f"{s.dtype} of shape {tuple(s.shape)} on {s.device}",
                                   f"float32 of shape {want} on {k.device} for scale_granularity="
                                   f"{self.scale_granularity!r}")
        if self.scale_granularity != "token_head":
            self._check_static_scale_values()
        named = (("key_cache", k), ("value_cache", v), ("k_scale", self.k_scale), ("v_scale", self.v_scale))
        for i, (na, a) in enumerate(named):
            for nb_, b in named[i + 1:]:
                read_only = na == "k_scale" and self.scale_granularity != "token_head"
                if not read_only and may_share_bytes(a, b):
                    raise bad_argument(nb_, f"a tensor sharing memory with {na}",
                                       "separate memory for key_cache, value_cache, k_scale and v_scale "
                                       "(static k/v scales may share)")
        return CacheSpec(self.fmt.name, self.layout, self.scale_granularity, nb, bs, H, k.shape[3], k.device)

    def _check_static_scale_values(self) -> None:
        """Tensor and head scales: every value finite and > 0, as :func:`fp8kv.formats.check_scale`
        demands of a scale given to :meth:`allocate` or :meth:`from_tensors` (a zero, negative,
        NaN or inf scale would make every later write store +-max or NaN codes).

        Read once, when the cache is built (one host transfer for both; a device sync for CUDA
        scales), not per operation: an engine that updates a scale in place afterwards owns its
        values. Skipped where values cannot be read (meta tensors, ``torch.compile`` tracing, CUDA
        graph capture). ``token_head`` scales are not read: write_kv stores a slot's scales with
        its codes, and attention reads only slots within the step's lengths, so the scales of a
        slot never written may be anything (an engine's fresh memory), as its codes may; and
        reading a ``[num_blocks, block_size, H]`` tensor would cost a pass over it.
        """
        if not _values_readable(self.k_scale):
            return
        for name, ok, s in zip(("k_scale", "v_scale"), _static_scale_values_ok(self.k_scale, self.v_scale),
                               (self.k_scale, self.v_scale), strict=True):
            if not ok:
                check_scale(s, name)  # raises, naming the scale and its first bad values
                raise bad_argument(name, "a non-finite or non-positive value", "finite scales > 0 (in float32)")

    # -- construction -------------------------------------------------------------
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
    ) -> KVCache:
        """Allocate a zero-filled cache (static scales default to 1.0).

        ``kv_dtype`` defaults to ``"fp8_e4m3"`` and ``scale_granularity`` to ``"tensor"``;
        ``kv_dtype="fp8"`` means the platform's e4m3 of ``device`` (fnuz on gfx942).
        A checkpoint's :class:`fp8kv.KVCachePlan` supplies kv_dtype, granularity and a layer's
        scales: ``KVCache.allocate(num_blocks, block_size, H, D, **plan.cache_kwargs(layer))``.
        """
        num_blocks, block_size, num_kv_heads, head_size = (  # the int scalar rule: plain ints from here on
            int_at_least(name, v, 1, "a positive int") for name, v in (
                ("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                ("head_size", head_size)))
        device = check_device(device)
        fmt = _resolve_format("fp8_e4m3" if kv_dtype is None else kv_dtype, device)
        check_layout(layout)
        check_granularity("tensor" if scale_granularity is None else scale_granularity)
        shape = ((num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_size))
        numel = num_blocks * block_size * num_kv_heads * head_size
        if numel >= 2**62 // 8:
            raise bad_argument("num_blocks", num_blocks, f"a cache of fewer than 2^59 elements (asked for {numel})")
        try:  # K and V in one allocation, and token_head scales too: a backend may address each as a pair
            key_cache, value_cache = torch.zeros((2, *shape), dtype=fmt.torch_dtype, device=device)
            if scale_granularity == "token_head" and k_scale is None and v_scale is None:
                k_scale, v_scale = torch.ones((2, num_blocks, block_size, num_kv_heads), device=device)
        except (RuntimeError, MemoryError) as exc:  # out of memory, or a device this torch lacks
            raise Unsupported(f"num_blocks: allocating 2 x {numel} bytes ({list(shape)}) on {device} failed: "
                              f"{str(exc).splitlines()[0][:200]}") from None
        return cls._wrap(key_cache, value_cache, fmt, layout, scale_granularity, k_scale, v_scale)

    @classmethod
    def from_tensors(
        cls,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor | None = None,
        *,
        kv_dtype: str | None = None,
        layout: str = "NHD",
        scale_granularity: str | None = None,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        kv_dim: int = 1,
    ) -> KVCache:
        """Wrap an engine's own cache tensors, zero-copy (writes land in the engine's memory).

        Args:
            key_cache: K as ``[num_blocks, block_size, H, D]`` (NHD) or
                ``[num_blocks, H, block_size, D]`` (HND), any strides with ``D``'s 1; or, when
                ``value_cache`` is None, one 5-d tensor holding both with K/V at ``kv_dim``:
                FlashInfer's single paged tensor ``[num_pages, 2, ...]`` (``kv_dim=1``, the
                default), vLLM's flash-attention cache ``[2, num_blocks, ...]`` (``kv_dim=0``).
                float8 or uint8 storage.
            value_cache: V, same shape and dtype as K, its own strides (FlashInfer's
                ``(k, v)`` pair from two allocations), or None (see ``key_cache``).
            kv_dtype: the format; may be omitted for float8 tensors (taken from the dtype),
                required for uint8 storage, which is viewed as the format's dtype.
                ``"fp8"``: the platform's e4m3 of the tensors' device.
            layout: the order of the dimensions (``"NHD"`` or ``"HND"``), not the storage order.
            scale_granularity: ``tensor`` (default), ``head`` or ``token_head``.
            k_scale / v_scale: static scales (float, or a float32 tensor of shape ``()``/``(H,)``,
                kept zero-copy when already float32 on the device; default 1.0), or for
                ``token_head`` the engine's ``[num_blocks, block_size, H]`` float32 tensors (None:
                allocated).

        Everything is checked here (first disagreeing field named): dtype against the format,
        K/V shapes and devices, strides the backends serve, scale shapes, no shared bytes.
        """
        fmt = None if kv_dtype is None else _resolve_format(kv_dtype, getattr(key_cache, "device", "cpu"))
        if value_cache is None:
            if not isinstance(key_cache, torch.Tensor):
                raise bad_argument("key_cache", type(key_cache).__name__, "a torch.Tensor")
            kv_dim = int_at_least("kv_dim", kv_dim, -5, "the int index (0..4) of the size-2 K/V dimension")
            if kv_dim >= 5:
                raise bad_argument("kv_dim", repr(kv_dim), "the int index (0..4) of the size-2 K/V dimension")
            kv_dim %= 5
            if key_cache.dim() != 5 or key_cache.shape[kv_dim] != 2:
                raise bad_argument("key_cache", f"shape {tuple(key_cache.shape)} (value_cache None, kv_dim={kv_dim})",
                                   "one 5-d tensor with K and V along kv_dim (size 2): [num_pages, 2, ...] with "
                                   "kv_dim=1 (FlashInfer), [2, num_blocks, ...] with kv_dim=0 (vLLM); or pass "
                                   "value_cache")
            key_cache, value_cache = key_cache.select(kv_dim, 0), key_cache.select(kv_dim, 1)
        k, fmt = _as_format("key_cache", key_cache, fmt)
        v, _ = _as_format("value_cache", value_cache, fmt)
        return cls._wrap(k, v, fmt, layout, scale_granularity, k_scale, v_scale)

    @classmethod
    def _wrap(cls, k, v, fmt, layout, scale_granularity, k_scale, v_scale) -> KVCache:
        scale_granularity = "tensor" if scale_granularity is None else scale_granularity
        check_layout(layout)
        check_granularity(scale_granularity)
        if k.dim() != 4:
            raise bad_argument("key_cache", f"shape {tuple(k.shape)}", "4 dimensions")
        H = k.shape[2] if layout == "NHD" else k.shape[1]
        if scale_granularity == "token_head":
            for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
                if not (given is None or isinstance(given, torch.Tensor)):
                    raise bad_argument(name, f"a static scale {given!r}",
                                       "None or a float32 [num_blocks, block_size, H] tensor with "
                                       "scale_granularity='token_head' (scales are computed at write time)")
            nb, bs = k.shape[0], (k.shape[1] if layout == "NHD" else k.shape[2])
            ks = _token_head_scale(k_scale, "k_scale", (nb, bs, H), k.device)
            vs = _token_head_scale(v_scale, "v_scale", (nb, bs, H), k.device)
        else:
            ks = _static_scale(k_scale, "k_scale", scale_granularity, H, k.device)
            vs = _static_scale(v_scale, "v_scale", scale_granularity, H, k.device)
        return cls(k, v, ks, vs, fmt, layout, scale_granularity)

    def slice_heads(self, start: int, stop: int) -> KVCache:
        """The KV heads ``[start, stop)`` as a cache of their own, zero-copy (a tensor-parallel
        rank's share); per-head and per-token-head scales are sliced with them."""
        H = self.num_kv_heads
        expected = f"ints with 0 <= start < stop <= num_kv_heads={H}"
        start, stop = int_at_least("start", start, 0, expected), int_at_least("stop", stop, 1, expected)
        if not start < stop <= H:
            raise bad_argument("start/stop", f"{start!r}, {stop!r}", expected)
        self.check_intact()
        dim = 2 if self.layout == "NHD" else 1
        k = self.key_cache.narrow(dim, start, stop - start)
        v = self.value_cache.narrow(dim, start, stop - start)
        if self.scale_granularity == "tensor":
            ks, vs = self.k_scale, self.v_scale
        else:
            ks, vs = self.k_scale[..., start:stop], self.v_scale[..., start:stop]
        return KVCache(k, v, ks, vs, self.fmt, self.layout, self.scale_granularity)

    # -- K and V as one tensor -----------------------------------------------------
    @functools.cached_property
    def kv_pair(self) -> torch.Tensor | None:
        """``[2, *key_cache.shape]``: K (index 0) and V (1) as one view, or None.

        A view exists when the two lie in one storage at a constant distance with the same shape
        and strides (as :meth:`allocate` makes them, or a vLLM-style ``[2, ...]`` or ``[..., 2, ...]``
        tensor given to :meth:`from_tensors`): one gather or scatter then serves both."""
        return paired(self.key_cache, self.value_cache)

    @functools.cached_property
    def scale_pair(self) -> torch.Tensor | None:
        """``[2, num_blocks, block_size, H]``: the token_head K and V scales as one view, or None
        (other granularities, or scales that are not one storage at a constant distance)."""
        if self.scale_granularity != "token_head":
            return None
        return paired(self.k_scale, self.v_scale)

    # -- geometry -----------------------------------------------------------------
    @property
    def kv_dtype(self) -> str:
        return self.fmt.name

    num_blocks = _of_spec("num_blocks")
    block_size = _of_spec("block_size")
    num_kv_heads = _of_spec("num_kv_heads")
    head_size = _of_spec("head_size")
    num_slots = _of_spec("num_slots")
    device = _of_spec("device")

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
        """Bytes of all the cache's elements (codes and scales; an engine's padding not counted)."""
        return (self.key_cache.numel() + self.value_cache.numel()) * self.key_cache.element_size() \
            + (self.k_scale.numel() + self.v_scale.numel()) * 4

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
        """The cache as ``[num_slots, H, D]`` (a copy unless NHD and contiguous)."""
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
        """A deep copy (contiguous tensors, same values)."""
        self.check_intact()
        return KVCache(self.key_cache.clone(), self.value_cache.clone(), self.k_scale.clone(),
                       self.v_scale.clone(), self.fmt, self.layout, self.scale_granularity)

    def copy_(self, other: KVCache) -> KVCache:
        """Copy ``other``'s codes and scales into this cache's own tensors, in place (same shapes;
        each tensor keeps its strides, so a view of an engine tensor stays one). Returns self.

        ``other`` must be a cache of the same spec (format, layout, granularity, geometry; any
        device), and neither cache's tensors may have been changed in place since it was built."""
        if not isinstance(other, KVCache):
            raise bad_argument("other", type(other).__name__, "an fp8kv.KVCache")
        if dataclasses.replace(other.spec, device=self.spec.device) != self.spec:
            raise bad_argument("other", other.spec.describe(), f"a cache of the same spec: {self.spec.describe()} "
                                                               "(any device)")
        self.check_intact("cache")
        other.check_intact("other")
        for dst, src in ((self.key_cache, other.key_cache), (self.value_cache, other.value_cache),
                         (self.k_scale, other.k_scale), (self.v_scale, other.v_scale)):
            if dst.element_size() == 1:
                dst.view(torch.uint8).copy_(src.view(torch.uint8))
            else:
                dst.copy_(src)
        return self

    def to(self, device: torch.device | str) -> KVCache:
        """A copy on ``device`` (a copy on the cache's own device too: no tensor is shared)."""
        device = check_device(device)
        self.check_intact()
        k, v, ks, vs = (t.to(device, copy=True) for t in (self.key_cache, self.value_cache, self.k_scale, self.v_scale))
        return KVCache(k, v, ks, vs, self.fmt, self.layout, self.scale_granularity)

    def same_bytes(self, other: KVCache) -> bool:
        """True when both caches and scales are byte-identical."""
        return all(
            torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                        b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))
            for a, b in ((self.key_cache, other.key_cache), (self.value_cache, other.value_cache),
                         (self.k_scale, other.k_scale), (self.v_scale, other.v_scale))
        )


def check_device(device) -> torch.device:
    """``device`` (None = the CPU) as a torch.device this torch can use, or a named error."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise bad_argument("device", repr(device), "a torch.device or a string such as 'cpu' or 'cuda:0'")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise bad_argument("device", repr(device), "a torch device such as 'cpu', 'cuda' or 'cuda:0'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise bad_argument("device", repr(device), f"a device this torch can use (torch {torch.__version__} sees no "
                                                   "CUDA device)")
    if dev.type not in ("cpu", "cuda", "meta"):
        raise bad_argument("device", repr(device), "'cpu', 'cuda' or 'meta' (other torch devices are not served)")
    return dev


def _resolve_format(kv_dtype, device) -> Fp8Format:
    if kv_dtype == "fp8":
        from .probe import probe

        return ensure_fp8(probe(torch.device(device)).fp8_alias)
    if isinstance(kv_dtype, (Fp8Format, torch.dtype)):
        return get_format(kv_dtype)
    return ensure_fp8(kv_dtype)


__all__ = ["GRANULARITIES", "LAYOUTS", "CacheSpec", "KVCache", "check_device", "check_layout", "may_share_bytes"]
