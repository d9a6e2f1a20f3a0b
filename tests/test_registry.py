"""The backend registry: registration, selection by priority with reasons, forcing, caching,
the no-silent-slow-path warning, faults (never fatal for the other backends, SystemExit
included), reserved names, hooks outside the registry lock, the FP8KV_AUTO_BACKENDS allowlist
and the log line when a third-party backend wins ``auto``."""

from __future__ import annotations

import logging
import re
import threading
import warnings

import pluggy
import pytest
import torch
from fake_backends import ReferenceOps

import fp8kv
import fp8kv.registry as registry_mod
from fp8kv import reference
from fp8kv.plugins import BackendInfo, Request, hookimpl
from fp8kv.registry import (
    RESERVED_NAMES,
    BackendFailure,
    DuplicateBackendError,
    ReservedNameError,
    available_backends,
    faults,
    register_backend,
    select_backend,
    unregister_backend,
)


class Fake(ReferenceOps):
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


def test_the_reserved_names_are_fp8kvs_own_entry_points():
    eps = registry_mod.entry_points(group=registry_mod.ENTRY_POINT_GROUP)
    assert {ep.name for ep in eps if ep.dist.name == registry_mod.BUILTIN_DISTRIBUTION} == RESERVED_NAMES
    assert available_backends()["reference"].builtin


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
        fp8kv.write_kv_one_shot(cache, k, v, slots)


def test_a_forced_backend_that_cannot_serve_raises_its_reason_and_leaves_the_cache(isolated):
    register_backend(Fake("picky", priority=90, refuse=lambda d, r: "HND is not implemented"
                          if r.layout == "HND" else None))
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16, layout="HND")
    before = cache.clone()
    k, v, slots = torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.tensor([1, 2])
    with pytest.raises(fp8kv.Fp8KVError, match="backend 'picky' cannot serve write_kv fp8_e4m3 HND tensor "
                       "D=16 float32 features=- on .*: HND is not implemented"):
        fp8kv.write_kv_one_shot(cache, k, v, slots, backend="picky")
    assert cache.same_bytes(before)
    fp8kv.write_kv_one_shot(cache, k, v, slots)  # auto: the reference


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
    with fp8kv.plugins.simulate_device("sm90"):
        select_backend(req(), None)
    assert len(calls) == 3 and calls[-1][0].arch == "sm90"
    register_backend(Fake("other"))  # a new backend invalidates the caches
    select_backend(req(), "cpu")
    assert len(calls) == 4


def test_gpu_falling_back_to_a_slow_backend_warns_once_naming_the_reasons(isolated, monkeypatch):
    register_backend(Fake("gpu_fast", priority=90, refuse=lambda d, r: f"{d.arch}: needs sm90+"
                          if (d.sm or 0) < 90 else None))
    with fp8kv.plugins.simulate_device("sm80"):
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
    with fp8kv.plugins.simulate_device("sm90"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_backend(req(device_type="cuda")).backend.name == "gpu_fast"


def test_no_fast_backend_installed_is_said_so(isolated):
    with fp8kv.plugins.simulate_device("gfx942"), pytest.warns(RuntimeWarning, match="no fast backend is installed"):
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


@pytest.mark.parametrize("make,failure", [
    (lambda: FailingWrite("flaky", priority=90), "RuntimeError: kernel launch failed"),
    (lambda: ExitingWrite("flaky", priority=90), "SystemExit: plugin called sys.exit"),  # SystemExit too
])
def test_a_backend_that_claims_support_and_fails_is_named(isolated, make, failure):
    register_backend(make(), distribution="flaky-dist")
    cache, k, v, slots = small_cache()
    with pytest.raises(BackendFailure, match=r"backend 'flaky' \(flaky-dist\) claimed support and failed in "
                       f"fp8kv_write_kv: {failure}"):
        fp8kv.write_kv_one_shot(cache, k, v, slots)
    fp8kv.write_kv_one_shot(cache, k, v, slots, backend="reference")
    unregister_backend("flaky")
    register_backend(RejectingWrite("strict", priority=90))
    with pytest.raises(fp8kv.Fp8KVError, match=r"backend 'strict' \(<runtime>\) in fp8kv_write_kv: slot_"):
        fp8kv.write_kv_one_shot(cache, k, v, slots)


@pytest.mark.parametrize(("plugin", "error", "match"), [
    (object(), fp8kv.Fp8KVError, "does not implement fp8kv_backend_info"),
    (Fake("auto"), fp8kv.Fp8KVError, "expected a non-empty name other than 'auto'"),
    (Fake(" padded"), fp8kv.Fp8KVError, "expected a non-empty name"),
])
def test_invalid_plugins_are_refused_at_registration(isolated, plugin, error, match):
    with pytest.raises(error, match=match):
        register_backend(plugin)
    assert list(available_backends()) == ["reference"]
    register_backend(Fake("fine"))  # the plugin manager is left clean


@pytest.mark.parametrize("name", sorted(RESERVED_NAMES))
def test_a_reserved_name_is_refused_and_reported_and_the_builtin_keeps_working(isolated, name):
    with pytest.warns(RuntimeWarning, match=rf"{name} \(impostor\) failed to load: ReservedNameError"), \
            pytest.raises(ReservedNameError, match=rf"backend name '{name}' is reserved for fp8kv's built-in "
                          r"backend: the backend from 'impostor' claiming it is refused") as caught:
        register_backend(Fake(name, priority=1000), distribution="impostor")
    assert isinstance(caught.value, fp8kv.errors.PluginError) and caught.value.name == name
    assert [(f.name, f.distribution, f.where) for f in faults()] == [(name, "impostor", "load")]
    assert list(available_backends()) == ["reference"]  # 'triton' too: reserved even while absent
    cache, k, v, slots = small_cache()
    for _ in range(2):  # every call still works
        fp8kv.write_kv_one_shot(cache, k, v, slots)
        assert select_backend(req(), "cpu", backend="reference").backend.distribution == "fp8kv"


def test_a_taken_name_is_refused_naming_both_and_the_first_stays(isolated):
    first = register_backend(Fake("dup", priority=90), distribution="dist-one")
    with pytest.warns(RuntimeWarning, match="failed to load: DuplicateBackendError"), \
            pytest.raises(DuplicateBackendError, match="two backends are named 'dup': the one from the distribution "
                          "'dist-one' \\(registered first\\) is kept, the one from 'dist-two' is refused"):
        register_backend(Fake("dup", priority=95), distribution="dist-two")
    assert available_backends()["dup"] is first
    assert select_backend(req(), "cpu").backend is first  # no call is broken by it
    assert [(f.name, f.distribution) for f in faults()] == [("dup", "dist-two")]


def test_bad_info_and_typos_are_refused(isolated):
    class BadInfo(Fake):
        @hookimpl
        def fp8kv_backend_info(self):
            return {"name": "dict"}

    class Typo(Fake):
        @hookimpl
        def fp8kv_support(self, device, request):
            return None

    with pytest.raises(fp8kv.Fp8KVError, match="expected a fp8kv.plugins.BackendInfo"):
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
    fp8kv.write_kv_one_shot(cache, k, v, slots)
    q = torch.randn(1, 2, 16)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    fp8kv.paged_attention_one_shot(q, cache, tables, lens, sliding_window=3)
    assert [(r.op, r.features) for _, r in calls] == [("write_kv", frozenset()),
                                                      ("paged_attention", frozenset({"sliding_window"}))]


# -- containment (hardening: SystemExit and friends, the lock, the allowlist) ----------------------


class ExitingWrite(Fake):
    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        raise SystemExit("plugin called sys.exit")


def test_system_exit_from_a_support_check_is_a_refusal_and_a_fault(isolated):
    def leave(device, request):
        raise SystemExit(3)

    register_backend(Fake("quitter", priority=90, refuse=leave))
    cache, k, v, slots = small_cache()
    with pytest.warns(RuntimeWarning, match=r"quitter \(<runtime>\) raised in fp8kv_supports: SystemExit: 3"):
        fp8kv.write_kv_one_shot(cache, k, v, slots)  # served by the reference
    sel = select_backend(req(), "cpu")
    assert sel.backend.name == "reference" and sel.reasons["quitter"] == "fp8kv_supports raised SystemExit: 3"
    with pytest.raises(fp8kv.Fp8KVError, match="cannot serve .*fp8kv_supports raised SystemExit: 3"):
        select_backend(req(), "cpu", backend="quitter")


def test_keyboard_interrupt_in_a_support_check_propagates_and_is_not_cached(isolated):
    interrupts = [KeyboardInterrupt()]

    def maybe_interrupt(device, request):
        if interrupts:
            raise interrupts.pop()
        return None

    register_backend(Fake("slow", priority=90, refuse=maybe_interrupt))
    with pytest.raises(KeyboardInterrupt):
        select_backend(req(), "cpu")
    assert select_backend(req(), "cpu").backend.name == "slow"  # asked again, now it answers
    assert faults() == []


@pytest.mark.parametrize("where", ["constructor", "backend_info"])
@pytest.mark.parametrize("exc", [SystemExit(1), GeneratorExit("odd")])
def test_a_plugin_raising_base_exceptions_at_registration_is_refused(isolated, where, exc):
    class Raising(Fake):
        def __init__(self):
            if where == "constructor":
                raise exc
            super().__init__("raising")

        @hookimpl
        def fp8kv_backend_info(self):
            raise exc

    with pytest.raises(fp8kv.errors.PluginError, match=type(exc).__name__):
        register_backend(Raising)
    assert list(available_backends()) == ["reference"]
    register_backend(Fake("fine"))  # the plugin manager is left clean


def test_a_plugin_stuck_in_fp8kv_supports_blocks_only_its_own_thread(isolated):
    entered, release = threading.Event(), threading.Event()

    def stuck_on_d128(device, request):
        if request.head_size == 128:
            entered.set()
            release.wait(30)
        return None

    register_backend(Fake("stuck", priority=90, refuse=stuck_on_d128))
    assert select_backend(req(), "cpu").backend.name == "stuck"  # D=64: answered and cached
    picked = []
    a = threading.Thread(target=lambda: picked.append(select_backend(req(D=128), "cpu").backend.name))
    a.start()
    try:
        assert entered.wait(10), "the plugin was never asked"
        done = []

        def other_thread():
            cache, k, v, slots = small_cache()
            done.append(select_backend(req(), "cpu").backend.name)  # cached
            done.append(select_backend(req(D=256), "cpu", backend="reference").backend.name)  # asks the reference
            fp8kv.write_kv_one_shot(cache, k, v, slots, backend="reference")
            done.append(sorted(available_backends()))
            done.append(register_backend(Fake("late", priority=1)).name)

        b = threading.Thread(target=other_thread)
        b.start()
        b.join(10)
        assert not b.is_alive(), "a plugin stuck in fp8kv_supports blocked another thread"
        assert done == ["stuck", "reference", ["reference", "stuck"], "late"]
    finally:
        release.set()
        a.join(10)
    assert picked == ["stuck"]
    assert select_backend(req(D=128), "cpu").backend.name == "stuck"


def test_auto_backends_restricts_auto_only(isolated, monkeypatch):
    calls, writes = [], []

    class Counting(Fake):
        @hookimpl
        def fp8kv_write_kv(self, cache, key, value, slot_mapping):
            writes.append(self.name)
            reference.write_kv(cache, key, value, slot_mapping)

    register_backend(Counting("fast", priority=90, calls=calls))
    cache, k, v, slots = small_cache()
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "reference")
    sel = select_backend(req(), "cpu")
    assert sel.backend.name == "reference"
    assert sel.reasons == {"fast": "not in FP8KV_AUTO_BACKENDS=reference"}
    fp8kv.write_kv_one_shot(cache, k, v, slots)
    assert calls == [] and writes == []  # a backend left out is not even asked
    assert select_backend(req(), "cpu", backend="fast").backend.name == "fast"  # forcing is not affected
    monkeypatch.setenv("FP8KV_BACKEND", "fast")
    assert select_backend(req(), "cpu").backend.name == "fast"
    monkeypatch.delenv("FP8KV_BACKEND")
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", " fast, reference ,")  # a change between calls takes effect
    fp8kv.write_kv_one_shot(cache, k, v, slots)
    assert writes == ["fast"]
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "")  # empty: any backend
    assert select_backend(req(), "cpu").backend.name == "fast"
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "ghost,reference")  # a name not installed is ignored ...
    assert select_backend(req(), "cpu").backend.name == "reference"
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "ghost")  # ... and named when nothing is left
    with pytest.raises(fp8kv.errors.Unsupported, match=r"fast: not in FP8KV_AUTO_BACKENDS=ghost; reference: not in "
                       r"FP8KV_AUTO_BACKENDS=ghost \(FP8KV_AUTO_BACKENDS names backends that are not installed: "
                       r"ghost\)"):
        fp8kv.write_kv_one_shot(cache, k, v, slots)
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "auto,reference")
    with pytest.raises(fp8kv.errors.InvalidArgument, match="FP8KV_AUTO_BACKENDS: got 'auto,reference'"):
        select_backend(req(), "cpu")


def test_auto_backends_setting():
    from fp8kv import settings

    assert "FP8KV_AUTO_BACKENDS" in settings.VARIABLES and "FP8KV_AUTO_BACKENDS" in settings.__doc__
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FP8KV_AUTO_BACKENDS", raising=False)
        assert settings.auto_backends() is None
        mp.setenv("FP8KV_AUTO_BACKENDS", " , ")
        assert settings.auto_backends() is None
        mp.setenv("FP8KV_AUTO_BACKENDS", "triton, reference")
        assert settings.auto_backends() == frozenset({"triton", "reference"})


def test_a_third_party_backend_winning_auto_is_logged_once(isolated, caplog):
    caplog.set_level(logging.INFO, logger="fp8kv")
    select_backend(req(), "cpu")
    assert caplog.records == []  # the built-in reference is not announced
    register_backend(Fake("plug", priority=90), distribution="fp8kv-plug")
    select_backend(req(), "cpu", backend="plug")  # forced: not announced
    assert caplog.records == []
    select_backend(req(), "cpu")
    select_backend(req(D=128), "cpu")
    select_backend(req(op="paged_attention"), "cpu")
    [record] = caplog.records
    assert record.name == "fp8kv" and record.levelno == logging.INFO
    assert re.fullmatch(
        r"fp8kv: 'auto' picked the third-party backend 'plug' \(distribution 'fp8kv-plug'\) for write_kv fp8_e4m3 "
        r"NHD tensor D=64 bfloat16 features=- on .+; FP8KV_AUTO_BACKENDS restricts which backends 'auto' may pick",
        record.getMessage())


def test_a_per_request_priority_reorders_only_its_requests(isolated):
    """``fp8kv_priority`` lifts a backend above a higher-ranked one for the requests it names (here
    attention without chunked prefill: decode), and nowhere else; a failing hook is a fault and the
    static priority stands."""

    class DecodeFirst(Fake):
        @hookimpl
        def fp8kv_priority(self, device, request):
            if request.op == "paged_attention" and "chunked_prefill" not in request.features:
                return 200
            return None

    class Broken(Fake):
        @hookimpl
        def fp8kv_priority(self, device, request):
            raise RuntimeError("boom")

    register_backend(Fake("static", priority=100))
    register_backend(DecodeFirst("decoder", priority=90))
    dev = torch.device("cpu")
    assert select_backend(req("paged_attention"), dev).backend.name == "decoder"
    sel = select_backend(req("paged_attention", features=("chunked_prefill",)), dev)
    assert sel.backend.name == "static" and sel.reasons["decoder"] == "can serve, lower priority than static"
    assert select_backend(req("write_kv"), dev).backend.name == "static"
    register_backend(Broken("broken", priority=95))
    assert select_backend(req("write_kv"), dev).backend.name == "static"
    assert any(f.name == "broken" and f.where == "fp8kv_priority" for f in isolated.faults)
