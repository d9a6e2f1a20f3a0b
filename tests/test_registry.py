"""The backend registry: registration, selection by priority with reasons, forcing, caching,
the no-silent-slow-path warning, and faults (never fatal for the other backends)."""

from __future__ import annotations

import warnings

import pluggy
import pytest
import torch

import fp8kv
import fp8kv.registry as registry_mod
from fp8kv import reference
from fp8kv.hookspecs import BackendInfo, Request, hookimpl
from fp8kv.registry import (
    BackendFailure,
    DuplicateBackendError,
    Registry,
    available_backends,
    faults,
    register_backend,
    select_backend,
    unregister_backend,
)


@pytest.fixture
def isolated(monkeypatch):
    """A registry holding only the reference (whatever else is installed), restored afterwards."""
    reg = Registry(loaded=True)
    reg.add(reference.ReferenceBackend(), distribution="fp8kv")
    monkeypatch.setattr(registry_mod, "_REGISTRY", reg)
    for var in ("FP8KV_BACKEND", "FP8KV_STRICT", "FP8KV_SIMULATE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    return reg


class Fake:
    """A configurable backend that delegates to the reference."""

    def __init__(self, name="fake", priority=50, refuse=None, fast=True, calls=None):
        self.name, self.priority, self.refuse, self.fast = name, priority, refuse, fast
        self.calls = calls if calls is not None else []

    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo(self.name, "1.0", priority=self.priority, description="fake", fast=self.fast)

    @hookimpl
    def fp8kv_supports(self, device, request):
        self.calls.append((device, request))
        return self.refuse(device, request) if self.refuse else None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        reference.write_kv(cache, key, value, slot_mapping)

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse):
        reference.paged_attention(query, cache, metadata, out, lse)


def req(op="write_kv", kv_dtype="fp8_e4m3", device_type="cpu", **kw) -> Request:
    return Request(op, kv_dtype, kw.pop("layout", "NHD"), kw.pop("granularity", "tensor"), kw.pop("D", 64),
                   kw.pop("io", torch.bfloat16), device_type, frozenset(kw.pop("features", ())))


def small_cache():
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16)
    return cache, torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.tensor([0, 5, -1])


def test_reference_comes_from_the_entry_point():
    b = available_backends()["reference"]
    assert b.distribution == "fp8kv" and b.info.priority == 0 and not b.info.fast
    eps = registry_mod.entry_points(group=registry_mod.ENTRY_POINT_GROUP)
    assert any(ep.name == "reference" and ep.dist.name == "fp8kv" for ep in eps)


def test_highest_priority_wins_and_the_others_keep_their_reasons(isolated):
    register_backend(Fake("low", priority=10))
    register_backend(Fake("high", priority=90, refuse=lambda d, r: "e5m2 only" if r.kv_dtype != "fp8_e5m2"
                          else None))
    sel = select_backend(req(kv_dtype="fp8_e4m3"), "cpu")
    assert sel.backend.name == "low"
    assert sel.reasons == {"high": "e5m2 only", "reference": "can serve, lower priority than low"}
    sel = select_backend(req(kv_dtype="fp8_e5m2"), "cpu")
    assert sel.backend.name == "high" and sel.reasons["low"] == "can serve, lower priority than high"
    assert "high: e5m2 only" in select_backend(req(), "cpu").explain()
    assert list(available_backends()) == ["high", "low", "reference"]


def test_forcing_by_argument_and_environment(isolated, monkeypatch):
    register_backend(Fake("fast", priority=90))
    assert select_backend(req(), "cpu").backend.name == "fast"
    sel = select_backend(req(), "cpu", backend="reference")
    assert sel.backend.name == "reference" and sel.forced
    monkeypatch.setenv("FP8KV_BACKEND", "reference")
    assert select_backend(req(), "cpu").backend.name == "reference"
    assert select_backend(req(), "cpu", backend="fast").backend.name == "fast"  # the argument wins
    monkeypatch.setenv("FP8KV_BACKEND", "auto")
    assert select_backend(req(), "cpu").backend.name == "fast"
    cache, k, v, slots = small_cache()
    monkeypatch.setenv("FP8KV_BACKEND", "nope")
    with pytest.raises(fp8kv.Fp8KVError, match=r"got 'nope', expected one of \['fast', 'reference'\]"):
        fp8kv.write_kv(cache, k, v, slots)


def test_a_forced_backend_that_cannot_serve_raises_its_reason_and_leaves_the_cache(isolated):
    register_backend(Fake("picky", priority=90, refuse=lambda d, r: "HND is not implemented"
                          if r.layout == "HND" else None))
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16, layout="HND")
    before = cache.clone()
    k, v, slots = torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.tensor([1, 2])
    with pytest.raises(fp8kv.Fp8KVError, match="backend 'picky' cannot serve write_kv fp8_e4m3 HND tensor "
                       "D=16 float32 features=- on .*: HND is not implemented"):
        fp8kv.write_kv(cache, k, v, slots, backend="picky")
    assert cache.same_bytes(before)
    fp8kv.write_kv(cache, k, v, slots)  # auto: the reference


def test_no_backend_at_all_names_every_reason(isolated):
    unregister_backend("reference")
    register_backend(Fake("a", refuse=lambda d, r: "no a"))
    with pytest.raises(fp8kv.Fp8KVError, match="no backend can serve .*: a: no a"):
        select_backend(req(), "cpu")
    unregister_backend("a")
    with pytest.raises(fp8kv.Fp8KVError, match="none is installed"):
        select_backend(req(), "cpu")


def test_answers_and_selections_are_cached_per_device_and_request(isolated):
    calls = []
    register_backend(Fake("counted", priority=90, calls=calls))
    first = select_backend(req(), "cpu")
    for _ in range(5):
        assert select_backend(req(), "cpu") is first
        select_backend(req(), "cpu", backend="counted")
    assert len(calls) == 1
    select_backend(req(D=128), "cpu")
    with fp8kv.simulate_device("sm90"):
        select_backend(req(), None)
    assert len(calls) == 3 and calls[-1][0].arch == "sm90"
    register_backend(Fake("other"))  # a new backend invalidates the caches
    select_backend(req(), "cpu")
    assert len(calls) == 4


def test_gpu_falling_back_to_a_slow_backend_warns_once_naming_the_reasons(isolated, monkeypatch):
    register_backend(Fake("gpu_fast", priority=90, refuse=lambda d, r: f"{d.arch}: needs sm90+"
                          if (d.sm or 0) < 90 else None))
    with fp8kv.simulate_device("sm80"):
        with pytest.warns(RuntimeWarning, match=r"falls back to the slow 'reference' backend "
                          r"\(gpu_fast: sm80: needs sm90\+\)"):
            select_backend(req(device_type="cuda"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            select_backend(req(device_type="cuda"))  # once per request
            select_backend(req(device_type="cuda"), backend="reference")  # forced: no warning
            select_backend(req(device_type="cpu"))  # CPU tensors: the reference is expected
        monkeypatch.setenv("FP8KV_STRICT", "1")
        with pytest.raises(fp8kv.Fp8KVError, match="FP8KV_STRICT=1 forbids this"):
            select_backend(req(device_type="cuda"))
    with fp8kv.simulate_device("sm90"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_backend(req(device_type="cuda")).backend.name == "gpu_fast"


def test_no_fast_backend_installed_is_said_so(isolated):
    with fp8kv.simulate_device("gfx942"), pytest.warns(RuntimeWarning, match="no fast backend is installed"):
        select_backend(req(device_type="cuda"))


def test_a_hook_that_raises_is_a_refusal_and_a_fault_not_a_crash(isolated):
    def boom(device, request):
        raise ZeroDivisionError("bad plugin")

    register_backend(Fake("broken", priority=90, refuse=boom))
    with pytest.warns(RuntimeWarning, match=r"broken \(<runtime>\) raised in fp8kv_supports: "
                      "ZeroDivisionError: bad plugin"):
        sel = select_backend(req(), "cpu")
    assert sel.backend.name == "reference"
    assert sel.reasons["broken"] == "fp8kv_supports raised ZeroDivisionError: bad plugin"
    assert [(f.name, f.where) for f in faults()] == [("broken", "fp8kv_supports")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_backend(req(D=128), "cpu")  # the same fault warns once
    with pytest.raises(fp8kv.Fp8KVError, match="cannot serve .*fp8kv_supports raised ZeroDivisionError"):
        select_backend(req(), "cpu", backend="broken")


def test_a_non_string_answer_is_a_fault(isolated):
    register_backend(Fake("yes", priority=90, refuse=lambda d, r: True))
    with pytest.warns(RuntimeWarning, match="returned True, expected None or a reason string"):
        assert select_backend(req(), "cpu").backend.name == "reference"


class FailingWrite(Fake):
    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        raise RuntimeError("kernel launch failed")


class RejectingWrite(Fake):
    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        raise fp8kv.Fp8KVError("slot_mapping: got int16, expected int32")


def test_a_backend_that_claims_support_and_fails_is_named(isolated):
    register_backend(FailingWrite("flaky", priority=90), distribution="flaky-dist")
    cache, k, v, slots = small_cache()
    with pytest.raises(BackendFailure, match=r"backend 'flaky' \(flaky-dist\) claimed support and failed in "
                       "fp8kv_write_kv: RuntimeError: kernel launch failed"):
        fp8kv.write_kv(cache, k, v, slots)
    unregister_backend("flaky")
    register_backend(RejectingWrite("strict", priority=90))
    with pytest.raises(fp8kv.Fp8KVError, match=r"backend 'strict' \(<runtime>\) in fp8kv_write_kv: slot_"):
        fp8kv.write_kv(cache, k, v, slots)


@pytest.mark.parametrize(("plugin", "error", "match"), [
    (object(), fp8kv.Fp8KVError, "does not implement fp8kv_backend_info"),
    (Fake("auto"), fp8kv.Fp8KVError, "expected a non-empty name other than 'auto'"),
    (Fake(" padded"), fp8kv.Fp8KVError, "expected a non-empty name"),
    (Fake("reference"), DuplicateBackendError,
     "two backends are named 'reference': one from the distribution 'fp8kv', one from '<runtime>'"),
])
def test_invalid_plugins_are_refused_at_registration(isolated, plugin, error, match):
    with pytest.raises(error, match=match):
        register_backend(plugin)
    assert list(available_backends()) == ["reference"]
    register_backend(Fake("fine"))  # the plugin manager is left clean


def test_bad_info_and_typos_are_refused(isolated):
    class BadInfo(Fake):
        @hookimpl
        def fp8kv_backend_info(self):
            return {"name": "dict"}

    class Typo(Fake):
        @hookimpl
        def fp8kv_support(self, device, request):
            return None

    with pytest.raises(fp8kv.Fp8KVError, match="expected a fp8kv.BackendInfo"):
        register_backend(BadInfo())
    with pytest.raises(pluggy.PluginValidationError, match="fp8kv_support"):
        register_backend(Typo("typo"))
    assert list(available_backends()) == ["reference"]


def test_missing_op_hook_refuses_that_op_and_subset_signatures_work(isolated):
    class WriteOnly:
        @hookimpl
        def fp8kv_backend_info(self):
            return BackendInfo("write_only", "1", priority=90)

        @hookimpl
        def fp8kv_supports(self, request):  # pluggy: an implementation may take fewer arguments
            return None

        @hookimpl
        def fp8kv_write_kv(self, cache, key, value, slot_mapping):
            reference.write_kv(cache, key, value, slot_mapping)

    register_backend(WriteOnly)  # a class is instantiated
    assert select_backend(req(), "cpu").backend.name == "write_only"
    sel = select_backend(req(op="paged_attention"), "cpu")
    assert sel.backend.name == "reference"
    assert sel.reasons["write_only"] == "does not implement fp8kv_paged_attention"


def test_unregister_unknown_name(isolated):
    with pytest.raises(fp8kv.Fp8KVError, match=r"got 'ghost', expected one of \['reference'\]"):
        unregister_backend("ghost")


def test_the_api_dispatches_to_the_selected_backend(isolated):
    calls = []
    register_backend(Fake("seen", priority=90, calls=calls))
    cache, k, v, slots = small_cache()
    fp8kv.write_kv(cache, k, v, slots)
    q = torch.randn(1, 2, 16)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    fp8kv.paged_attention(q, cache, tables, lens, sliding_window=3)
    assert [(r.op, r.features) for _, r in calls] == [("write_kv", frozenset()),
                                                      ("paged_attention", frozenset({"sliding_window"}))]
