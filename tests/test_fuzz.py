"""Random API call sequences on the CPU, each call held to the reference (:mod:`fp8kv.testing.fuzz`).

The state machine builds caches (engine-style views inside canary buffers), plans, writes, attends and
merges through the reference, torch and (under ``TRITON_INTERPRET=1``) Triton backends, a share of the
calls with an invalid input. Every call either succeeds with the reference's result (writes bit-exact,
attention within the derived tolerance) or raises an ``fp8kv.Fp8KVError`` naming the argument with no
byte changed; no canary byte ever changes.

Below it, every failure the machine found, as a plain regression test on :class:`~fp8kv.testing.fuzz.Harness`,
and the proof that the harness fails a backend that breaks the invariant.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import fp8kv
from fp8kv import InvalidArgument, KVCache
from fp8kv.plugins import BackendInfo, hookimpl
from fp8kv.registry import register_backend, unregister_backend
from fp8kv.testing.fuzz import (
    EITHER,
    OK,
    REFUSE,
    VALID,
    Case,
    FuzzConfig,
    FuzzFailure,
    Harness,
    api_machine,
    guarded,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
CPU_BACKENDS = ("reference", "torch") + (("triton",) if INTERPRET else ())

BY_DESIGN = frozenset({
    "cache.replace.tamper",    # dataclasses.replace is the constructor: a new cache over the tensors as they are now
})
"""Case families the machine leaves out because what they expect is not the rule (each has a test below)."""

TestApiFuzz = api_machine(FuzzConfig(backends=CPU_BACKENDS, leave_out=BY_DESIGN)).TestCase
TestApiFuzz.settings = settings(settings.default, stateful_step_count=20)


# ------------------------------------------------------------------------------------------- regressions


def _harness() -> Harness:
    return Harness(FuzzConfig(backends=CPU_BACKENDS))


def _step(cache, **kw) -> dict:
    """A two-sequence decode step over blocks 0..3 of ``cache`` (3 and 4 tokens)."""
    return dict(num_q_heads=2 * cache.num_kv_heads, query_dtype=torch.float32,
                block_tables=torch.tensor([[0, 1], [2, 3]]), seq_lens=torch.tensor([3, 4]), **kw)


@pytest.mark.parametrize("device", ["mps", 5, "xla"])
def test_to_a_device_not_served_is_refused_naming_it(device):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    h.derive(Case(REFUSE, "cache.to.device", ("device",)), "to", lambda: c.cache.to(device), c, "moved")


def test_to_is_a_copy():
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    moved = h.derive(OK, "to", lambda: c.cache.to("cpu"), c, "moved")
    if fp8kv.cache.may_share_bytes(moved.cache.key_cache, c.cache.key_cache):
        raise FuzzFailure("to('cpu') [cache.to.copy]: the copy shares memory with the cache")


@pytest.mark.parametrize("other", [None, "cache", torch.zeros(2)], ids=["None", "str", "tensor"])
def test_copy_from_a_non_cache_is_refused(other):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    h.call(Case(REFUSE, "cache.copy_.type", ("other",)), "copy_", lambda: c.cache.copy_(other))


@pytest.mark.parametrize("other", [
    dict(num_blocks=1),                        # would broadcast over every block
    dict(kv_dtype="fp8_e5m2"),                 # same shape, other format: codes would be reinterpreted
    dict(layout="HND"),                        # [4, 2, 2, 8] either way (block_size == H): would be transposed
    dict(head_size=4),                         # shapes torch cannot copy
])
def test_copy_from_a_cache_of_another_spec_is_refused(other):
    h = _harness()
    dst = h.guarded_cache(4, 2, 2, 8, label="dst")
    geometry = dict(num_blocks=4, block_size=2, num_kv_heads=2, head_size=8) | {
        k: v for k, v in other.items() if k in ("num_blocks", "head_size")}
    src = h.guarded_cache(*geometry.values(), label="src", seed=1,
                          **{k: v for k, v in other.items() if k in ("kv_dtype", "layout")})
    h.copy_into(Case(REFUSE, "cache.copy_.other_spec", ("other",)), dst, src)


def test_copy_into_a_tampered_cache_is_refused():
    h = _harness()
    dst, src = h.guarded_cache(4, 2, 1, 8, label="dst"), h.guarded_cache(4, 2, 1, 8, label="src", seed=1)
    moved = guarded(dst.cache.value_cache.numel(), torch.uint8, h.device, h.world, "moved", pad=256)
    dst.cache.value_cache.set_(moved.untyped_storage(), moved.storage_offset(), dst.cache.value_cache.shape,
                               dst.cache.value_cache.stride())
    h.world.track(dst.cache.value_cache, "dst.value_cache (moved)")
    h.copy_into(Case(REFUSE, "cache.copy_.tamper", ("value_cache",)), dst, src)


@pytest.mark.parametrize("op", ["slice_heads", "clone", "to"])
def test_a_cache_re_pointed_after_the_build_derives_nothing(op):
    h = _harness()
    c = h.guarded_cache(4, 2, 2, 8)
    for name in ("key_cache", "value_cache"):  # both to one block: a self-consistent but different cache
        t = getattr(c.cache, name)
        small = guarded(32, torch.uint8, h.device, h.world, name, pad=t.numel() + 64).view(t.dtype)
        t.set_(small.untyped_storage(), small.storage_offset(), (1, 2, 2, 8), (32, 16, 8, 1))
        h.world.track(t, f"cache.{name} (re-pointed)")
    c.broken = True
    call = {"slice_heads": lambda: c.cache.slice_heads(0, 1), "clone": c.cache.clone, "to": lambda: c.cache.to("cpu")}
    h.derive(OK, op, call[op], c, "derived")


def test_replace_is_a_new_cache_over_the_tensors_as_they_are_now():
    """``dataclasses.replace`` is the constructor: a cache whose K and V were re-pointed in place gives, through
    it, a new cache validated as built over the new memory; the old cache still refuses every call."""
    cache = KVCache.allocate(4, 2, 2, 8)
    for name in ("key_cache", "value_cache"):
        getattr(cache, name).set_(torch.zeros(32, dtype=torch.uint8).view(cache.fmt.torch_dtype).untyped_storage(),
                                  0, (1, 2, 2, 8), (32, 16, 8, 1))
    new = dataclasses.replace(cache, k_scale=torch.tensor(2.0))
    assert new.num_blocks == 1 and float(new.k_scale) == 2.0
    new.check_intact()
    with pytest.raises(InvalidArgument, match="^cache.key_cache:"):
        cache.check_intact()


def test_slice_heads_refuses_bool_bounds():
    h = _harness()
    c = h.guarded_cache(4, 2, 2, 8)
    h.derive(Case(REFUSE, "cache.slice_heads.bounds", ("start",)), "slice_heads",
             lambda: c.cache.slice_heads(False, True), c, "sliced")


def test_merge_of_states_on_two_devices_is_refused():
    h = _harness()
    out, lse = torch.zeros(2, 2, 4), torch.zeros(2, 2)
    h.merge(Case(REFUSE, "merge.device", ("out_b",)), out, lse, out.to("meta"), lse)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_unchecked_csr_offsets_that_decrease_plan_as_empty_sequences(backend):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    meta = h.plan(Case(EITHER, "plan.csr.indptr_first"), c.cache, num_q_heads=1, query_dtype=torch.float32,
                  kv_indptr=torch.tensor([1, 0]), kv_indices=torch.zeros(0, dtype=torch.int64),
                  kv_last_page_len=torch.tensor([1]), validate=False, backend=backend)
    h.attend(Case(EITHER, "plan.csr.indptr_first"), c, torch.randn(1, 1, 8), meta, return_lse=True)


@pytest.mark.parametrize("seq_lens", [[0], [-3], [0, 0]], ids=["empty", "negative", "two_empty"])
def test_torch_rows_without_keys_over_token_head_scales_are_zero(seq_lens):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8, scale_granularity="token_head")
    S = len(seq_lens)
    h.attend_one_shot(Case(EITHER, "plan.seq_lens.below_queries"), c, torch.randn(1, 1, 8),
                      torch.arange(S).reshape(S, 1), torch.tensor(seq_lens), return_lse=True,
                      query_start_loc=torch.tensor([0] * S + [1]), validate=False, backend="torch")


# -- the known holes: their fixes landed; kept as regressions


def test_replace_with_a_bad_scale_value_is_refused():
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    for bad in (0.0, -1.0, math.nan, math.inf):
        h.derive(Case(REFUSE, "cache.replace.scale_value", ("k_scale",)), "dataclasses.replace",
                 lambda bad=bad: dataclasses.replace(c.cache, k_scale=torch.tensor(bad)), c, "replaced")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_tensor_shrunk_after_the_build_is_refused_with_the_canaries_intact(backend):
    """``value_cache.set_(smaller storage)`` after the build: no op may write or read past it."""
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    v = c.cache.value_cache
    small = guarded(2 * 8, torch.uint8, h.device, h.world, "small", pad=v.numel() + 64).view(v.dtype)
    v.set_(small.untyped_storage(), small.storage_offset(), (1, 2, 1, 8), (16, 8, 8, 1))
    h.world.track(v, "cache.value_cache (shrunk)")
    c.broken = True
    meta = h.plan(OK, c.cache, **_step(c.cache, slot_mapping=torch.tensor([2, 7]), backend=backend))
    key = torch.randn(2, 1, 8)
    h.write(OK, c, key, key, meta)
    h.attend(OK, c, torch.randn(2, 2, 8), meta, return_lse=True)
    h.write_one_shot(OK, c, key, key, torch.tensor([2, 7]), backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_a_step_without_sequences_plans_writes_and_attends(backend, prefill):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    step = dict(num_q_heads=1, query_dtype=torch.float32, block_tables=torch.zeros(0, 0, dtype=torch.int32),
                seq_lens=torch.zeros(0, dtype=torch.int32), slot_mapping=torch.tensor([-1]), backend=backend)
    if prefill:
        step["query_start_loc"] = torch.zeros(1, dtype=torch.int32)
    meta = h.plan(Case(VALID, "plan.empty_step"), c.cache, **step)
    h.write(OK, c, torch.randn(1, 1, 8), torch.randn(1, 1, 8), meta)
    h.attend(OK, c, torch.zeros(0, 1, 8), meta, return_lse=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_csr_indices_past_the_last_offset_are_never_read(backend):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    meta = h.plan(Case(VALID, "plan.csr.indices_tail_garbage"), c.cache, num_q_heads=1, query_dtype=torch.float32,
                  kv_indptr=torch.tensor([0, 2, 3]), kv_indices=torch.tensor([1, 3, 0, -1, 2**20]),
                  kv_last_page_len=torch.tensor([1, 2]), backend=backend)
    assert meta.block_tables[:, :2].tolist() == [[1, 3], [0, 0]]
    h.attend(OK, c, torch.randn(2, 1, 8), meta, return_lse=True)


@pytest.mark.parametrize("seq_lens", [[3, 5], (3, 5)], ids=["list", "tuple"])
def test_one_shot_attention_names_seq_lens_given_as_a_sequence(seq_lens):
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    h.attend_one_shot(Case(REFUSE, "attend1.seq_lens.type", ("seq_lens",)), c, torch.randn(2, 1, 8),
                      torch.tensor([[0, 1], [2, 3]]), seq_lens)


# ------------------------------------------------------------------------------------------- the harness fails


class _Faulty:
    """A backend that breaks the invariant in one way (``fault``), else delegates to the reference."""

    fault = ""

    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo(f"faulty_{self.fault}", "0", priority=-1, description="breaks the fuzz invariant",
                           fast=False)

    @hookimpl
    def fp8kv_supports(self, device, request):
        return None

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        fp8kv.reference.write_kv(cache, key, value, slot_mapping)
        if self.fault == "canary":  # one byte past the last block of V
            v = cache.value_cache
            end = v.storage_offset() + v.numel()
            v.untyped_storage()[end] = 0x11 if v.untyped_storage()[end] != 0x11 else 0x22
        if self.fault == "exception":
            raise ZeroDivisionError("a backend's crash")

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse):
        if self.fault == "dropped_key":  # the last key of every sequence unseen
            metadata = dataclasses.replace(metadata, seq_lens=(metadata.seq_lens - 1).clamp_min(0))
        fp8kv.reference.paged_attention(query, cache, metadata, out, lse)


FAULTS = {"canary": "a guard byte of cache.kv", "exception": "a backend failed", "dropped_key": "derived tolerance"}


@pytest.fixture(params=sorted(FAULTS))
def faulty(request):
    backend = type("Faulty", (_Faulty,), {"fault": request.param})()
    name = register_backend(backend).name
    yield name
    unregister_backend(name)


def test_the_harness_fails_a_backend_that_breaks_the_invariant(faulty):
    torch.manual_seed(0)
    h = Harness(FuzzConfig(backends=(faulty,)))
    c = h.guarded_cache(4, 2, 1, 8)
    meta = h.plan(OK, c.cache, **_step(c.cache, slot_mapping=torch.tensor([2, 7]), backend=faulty))
    key = torch.randn(2, 1, 8)
    with pytest.raises(FuzzFailure, match=FAULTS[faulty.removeprefix("faulty_")]):
        h.write(OK, c, key, key, meta)
        h.attend(OK, c, torch.randn(2, 2, 8), meta)


def test_the_machine_finds_a_faulty_backend(faulty):
    machine = api_machine(FuzzConfig(backends=(faulty,), invalid=0.1))
    with pytest.raises(FuzzFailure):
        run_state_machine_as_test(machine, settings=settings(
            max_examples=40, stateful_step_count=10, deadline=None, derandomize=True, database=None,
            phases=[Phase.generate], report_multiple_bugs=False, suppress_health_check=list(HealthCheck)))


def test_the_harness_fails_an_accepted_invalid_input_and_a_refused_valid_one():
    h = _harness()
    c = h.guarded_cache(4, 2, 1, 8)
    with pytest.raises(FuzzFailure, match="accepted an invalid input"):
        h.plan(Case(REFUSE, "test", ("num_q_heads",)), c.cache, **_step(c.cache))
    with pytest.raises(FuzzFailure, match="a valid call was refused"):
        h.plan(OK, c.cache, **_step(c.cache) | {"seq_lens": torch.tensor([3, 50])})
    with pytest.raises(FuzzFailure, match="names none of"):
        h.plan(Case(REFUSE, "test", ("query_start_loc",)), c.cache,
               **_step(c.cache) | {"seq_lens": torch.tensor([-1, 5])})
    assert h.plan(Case(EITHER, "test"), c.cache, **_step(c.cache) | {"seq_lens": torch.tensor([-1, 5]),
                                                                    "validate": False}) is not None
