"""``check_backend``: cross-check a backend against the reference on Hypothesis-drawn workloads.

For every drawn :class:`~fp8kv.testing.strategies.Workload` and each op, the backend's own
``fp8kv_supports`` on the probed device decides what is checked:

* it **claims** the request:

  - ``write_kv`` (through :func:`fp8kv.write_kv` with ``backend=<name>``) into a poisoned
    cache must give caches *and* scales byte-identical to :func:`fp8kv.reference.write_kv`;
    nothing outside the mapped slots may change, padding slots are skipped, the inputs
    are not modified;
  - ``paged_attention`` (decode or chunked prefill, through :func:`fp8kv.paged_attention`
    with ``out`` pre-filled with NaN and ``return_lse=True``) must match the reference within
    the derived tolerance of :mod:`fp8kv.testing.tolerance` (the output and the log-sum-exp),
    write every output element and leave the cache alone; workloads in the FP8 attention mode
    (``check_backend(..., fp8_attention=True)``) are held to the mode's own derived tolerance
    (:func:`~fp8kv.testing.tolerance.fp8_attention_tolerance`);

* once per check, for a ``fast`` backend that claims NHD e4m3 caches:
  :func:`~fp8kv.testing.safety.check_memory_safety` (out-of-range slots, block ids, lengths and
  query offsets with the host checks off must not touch memory outside the cache, nor write an
  out-of-range slot);

* it **refuses** the request: forcing it must raise :class:`fp8kv.Fp8KVError` containing
  its reason, and leave the cache unchanged.

Usage from a plugin's test suite::

    from fp8kv.testing import check_backend

    def test_conformance():
        report = check_backend("mybackend", examples=50, head_sizes=(64, 128))
        print(report.summary())

Do not call it from inside a ``@given`` test (Hypothesis does not nest). Run it on the
real device: under ``FP8KV_SIMULATE_DEVICE`` the backend would be asked about a device the
tensors are not on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, example, given, settings

from .. import reference
from ..api import paged_attention_one_shot, write_kv_one_shot
from ..cache import CacheSpec, KVCache
from ..errors import Fp8KVError
from ..planning import plan_attention
from ..probe import DeviceInfo, probe
from ..registry import Backend, registry, unregister_backend
from ..request import OPS, Request
from .safety import as_bits, check_memory_safety
from .strategies import Workload, workloads
from .tolerance import (
    assert_attention_close,
    assert_fp8_attention_close,
    assert_lse_close,
    fp8_attention_tolerance,
    paged_attention_bounds,
)

__all__ = ["ConformanceReport", "check_attention", "check_backend", "check_refusal", "check_write"]


@dataclass
class ConformanceReport:
    """What :func:`check_backend` exercised.

    Attributes:
        backend: the backend's name; device: where it ran.
        examples: workloads drawn (Hypothesis' generation and replay runs included).
        served: op -> requests checked against the reference.
        refused: op -> requests refused (and checked to raise when forced).
        reasons: refusal reason -> count.
        memory_safe: granularities checked by :func:`fp8kv.testing.safety.check_memory_safety`
            (hostile slots, block ids, lengths and offsets with the host checks off).
    """

    backend: str
    device: DeviceInfo
    examples: int = 0
    served: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    memory_safe: list = field(default_factory=list)

    def summary(self) -> str:
        ops = ", ".join(f"{op}: {self.served[op]} checked, {self.refused[op]} refused" for op in OPS)
        top = "; ".join(f"{r} (x{n})" for r, n in self.reasons.most_common(3))
        return (f"backend {self.backend!r} on {self.device.name}: {self.examples} workloads; {ops}"
                + (f"; top refusals: {top}" if top else ""))


def _first_difference(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if byte-identical, else where and what differs."""
    g, w = as_bits(got), as_bits(want)
    if torch.equal(g, w):
        return None
    ne = (g != w).nonzero()
    idx = tuple(int(i) for i in ne[0])
    return (f"{name} differs at {int(ne.shape[0])} positions, first at index {list(idx)}: "
            f"got {got[idx].item()!r} (0x{int(g[idx]):x}), expected {want[idx].item()!r} (0x{int(w[idx]):x})")


def _unmapped_changed(before: KVCache, after: KVCache, mapped: list[int]) -> str | None:
    """Describe a change outside the mapped slots, or None."""
    keep = torch.ones(before.num_slots, dtype=torch.bool)
    keep[torch.tensor(mapped, dtype=torch.long)] = False
    for which in ("key", "value"):
        a = as_bits(before.token_view(which)).cpu()[keep]
        b = as_bits(after.token_view(which)).cpu()[keep]
        if not torch.equal(a, b):
            slot = int(keep.nonzero()[(a != b).flatten(1).any(1).nonzero()[0, 0]])
            return f"{which}_cache changed at unmapped slot {slot} (padding or untouched slot written)"
    if before.scale_granularity == "token_head":
        for which in ("key", "value"):
            a = as_bits(before.scale_per_slot(which)).cpu()[keep]
            b = as_bits(after.scale_per_slot(which)).cpu()[keep]
            if not torch.equal(a, b):
                slot = int(keep.nonzero()[(a != b).any(1).nonzero()[0, 0]])
                return f"{which[0]}_scale changed at unmapped slot {slot}"
    return None


def check_write(backend: Backend, wl: Workload, device: torch.device) -> None:
    """``write_kv`` through ``backend`` is byte-identical to the reference (AssertionError if not)."""
    t = wl.tensors(device)
    key0, value0 = t.key.clone(), t.value.clone()
    want = wl.allocate_cache(device)
    reference.write_kv(want, t.key, t.value, t.slot_mapping)
    got = wl.allocate_cache(device)
    before = got.clone()
    write_kv_one_shot(got, t.key, t.value, t.slot_mapping, backend=backend.name)
    where = f"backend {backend.name!r}, {wl.request('write_kv', device.type).describe()}: "
    if not (torch.equal(as_bits(key0), as_bits(t.key)) and torch.equal(as_bits(value0), as_bits(t.value))):
        raise AssertionError(where + "write_kv modified its key/value inputs")
    changed = _unmapped_changed(before, got, wl.mapped_slots())
    if changed:
        raise AssertionError(where + changed)
    for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
        diff = _first_difference(name, getattr(got, name), getattr(want, name))
        if diff:
            raise AssertionError(where + "write not bit-exact with the reference: " + diff)


def _reference_attention(wl: Workload, t, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's output and log-sum-exp for the workload."""
    meta = plan_attention(cache, num_q_heads=wl.num_q_heads, query_dtype=t.query.dtype, block_tables=t.block_tables,
                          seq_lens=t.seq_lens, query_start_loc=t.query_start_loc, backend="reference",
                          **wl.attention_kwargs(), **wl.fp8_kwargs(t.query.device))
    out = torch.empty_like(t.query)
    lse = torch.empty(t.query.shape[:2], dtype=torch.float32, device=t.query.device)
    reference.paged_attention(t.query, cache, meta, out, lse)
    return out, lse


def check_attention(backend: Backend, wl: Workload, device: torch.device) -> None:
    """``paged_attention`` through ``backend`` matches the reference within the derived tolerance,
    its output and its log-sum-exp (``return_lse=True``)."""
    wl = wl.without_specials()
    t = wl.tensors(device)
    cache = wl.allocate_cache(device)
    reference.write_kv(cache, t.key, t.value, t.slot_mapping)
    snapshot = cache.clone()
    out = torch.full_like(t.query, float("nan"))
    res, lse = paged_attention_one_shot(t.query, cache, t.block_tables, t.seq_lens, query_start_loc=t.query_start_loc,
                               out=out, return_lse=True, backend=backend.name, **wl.attention_kwargs(),
                               **wl.fp8_kwargs(device))
    where = f"backend {backend.name!r}, {wl.request('paged_attention', device.type).describe()}: "
    if res is not out:
        raise AssertionError(where + "paged_attention did not return the given out tensor")
    if not cache.same_bytes(snapshot):
        raise AssertionError(where + "paged_attention modified the cache")
    ref, ref_lse = _reference_attention(wl, t, cache)
    if wl.fp8_attention:  # the FP8 mode's own derived tolerance
        fp8 = wl.fp8_kwargs(device)
        tol, lse_tol = fp8_attention_tolerance(
            t.query, cache, t.block_tables, t.seq_lens, t.query_start_loc, ref, ref_lse,
            softmax_scale=wl.softmax_scale, causal=wl.causal, sliding_window=wl.sliding_window,
            logits_soft_cap=wl.soft_cap, q_scale=fp8["q_scale"], prob_scale=fp8["prob_scale"])
        assert_fp8_attention_close(out, ref, tol, lse=lse, ref_lse=ref_lse, lse_tol=lse_tol, context=where)
        return
    bounds = paged_attention_bounds(t.query, cache, t.block_tables, t.seq_lens, t.query_start_loc,
                                    softmax_scale=wl.softmax_scale, causal=wl.causal,
                                    sliding_window=wl.sliding_window, logits_soft_cap=wl.soft_cap)
    assert_attention_close(out, ref, **bounds, context=where)
    assert_lse_close(lse, ref_lse, **bounds, context=where)


def check_refusal(backend: Backend, wl: Workload, device: torch.device, op: str, reason: str) -> None:
    """Forcing ``backend`` on a request it refuses raises Fp8KVError with ``reason``; cache unchanged."""
    wl = wl.without_specials()
    t = wl.tensors(device)
    cache = wl.allocate_cache(device)
    if op == "paged_attention":
        reference.write_kv(cache, t.key, t.value, t.slot_mapping)
    snapshot = cache.clone()
    where = f"backend {backend.name!r} refuses {wl.request(op, device.type).describe()} ({reason!r}) but "
    try:
        if op == "write_kv":
            write_kv_one_shot(cache, t.key, t.value, t.slot_mapping, backend=backend.name)
        else:
            paged_attention_one_shot(t.query, cache, t.block_tables, t.seq_lens, query_start_loc=t.query_start_loc,
                            backend=backend.name, **wl.attention_kwargs(), **wl.fp8_kwargs(device))
    except Fp8KVError as exc:
        if reason not in str(exc):
            raise AssertionError(where + f"the error does not give that reason: {exc}") from exc
    else:
        raise AssertionError(where + "forcing it did not raise Fp8KVError")
    if not cache.same_bytes(snapshot):
        raise AssertionError(where + "the refused call changed the cache")


def _resolve(backend: Any) -> tuple[Backend, bool]:
    """The registered Backend for a name, class or object; True if we registered it here."""
    reg = registry()
    if isinstance(backend, Backend):
        return backend, False
    if isinstance(backend, str):
        if backend not in reg.backends:
            raise Fp8KVError(f"backend: got {backend!r}, expected one of {sorted(reg.backends)}")
        return reg.backends[backend], False
    for b in reg.backends.values():
        if b.plugin is backend or (isinstance(backend, type) and type(b.plugin) is backend):
            return b, False
    return reg.add(backend), True


def check_backend(
    backend: Any,
    *,
    device: torch.device | str | None = None,
    examples: int | None = None,
    require_support: bool = True,
    known: Iterable[Workload] = (),
    memory_safety: bool | None = None,
    **strategy_limits: Any,
) -> ConformanceReport:
    """Cross-check ``backend`` against the reference for exactly what it claims to support.

    Args:
        backend: a registered backend's name, a registered :class:`~fp8kv.registry.Backend`,
            or a plugin object/class (registered for the duration of the check if it is not).
        device: where to run (default: ``cuda`` if available, else ``cpu``); the backend is
            asked ``fp8kv_supports`` with ``fp8kv.probe(device)``.
        examples: Hypothesis ``max_examples`` (default: the active settings profile's).
        require_support: fail if the backend claimed none of the drawn requests (usually
            a sign that ``strategy_limits`` or the device do not fit the backend).
        known: workloads always checked first (``@example``s): keep every failure the
            kit ever found here, e.g. ``known=[Workload(...)]`` pasted from its report.
        memory_safety: run :func:`~fp8kv.testing.safety.check_memory_safety` (default: for
            ``fast`` backends, whose kernels could touch memory outside a tensor; a slow
            PyTorch backend's indexing raises instead).
        **strategy_limits: passed to :func:`fp8kv.testing.strategies.workloads`
            (``max_seqs``, ``max_seq_len``, ``head_sizes``, ``kv_dtypes``, ``io_dtypes`` ...).
    Returns:
        a :class:`ConformanceReport`. Raises AssertionError (with Hypothesis' falsifying
        :class:`Workload`) on the first non-conforming behaviour.
    """
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    info = probe(dev)
    be, ours = _resolve(backend)
    report = ConformanceReport(be.name, info)
    if memory_safety is None:
        memory_safety = be.info.fast
    base = settings.default
    run_settings = settings(
        base, max_examples=examples if examples is not None else base.max_examples, deadline=None,
        suppress_health_check=[*base.suppress_health_check, HealthCheck.too_slow, HealthCheck.data_too_large],
    )

    def conformance(wl: Workload) -> None:
        report.examples += 1
        for op in OPS:
            req = wl.request(op, dev.type)
            reason = be.check_supports(info, req)
            if reason is None:
                report.served[op] += 1
                (check_write if op == "write_kv" else check_attention)(be, wl, dev)
            else:
                report.refused[op] += 1
                report.reasons[reason] += 1
                check_refusal(be, wl, dev, op, reason)

    for wl in reversed(list(known)):
        conformance = example(wl=wl)(conformance)
    conformance = run_settings(given(wl=workloads(**strategy_limits))(conformance))
    try:
        conformance()
        for gran in ("tensor", "token_head") if memory_safety else ():  # hostile indices, host checks off
            spec = CacheSpec("fp8_e4m3", "NHD", gran, 6, 4, 2, 16, dev)
            if all(be.check_supports(info, r) is None for r in (Request.for_write(spec, torch.float32),
                                                                 Request.for_attention(spec, torch.float32))):
                check_memory_safety(be.name, dev, granularity=gran)
                report.memory_safe.append(gran)
    finally:
        if ours:
            unregister_backend(be.name)
    if require_support and not sum(report.served.values()):
        raise AssertionError(f"backend {be.name!r} claimed none of the {report.examples} drawn requests on "
                             f"{info.name}: {report.summary()}")
    return report
