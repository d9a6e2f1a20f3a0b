"""The conformance kit: the derived tolerance (sound and tight), the workload strategies,
and ``check_backend`` — run over every backend available on this machine and over
deliberately broken fakes that it must catch."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from fake_backends import ReferenceOps
from fp8_tiled import TiledFP8
from hypothesis import given, settings

import fp8kv
from fp8kv import reference
from fp8kv.formats import FORMATS
from fp8kv.plugins import BackendInfo, hookimpl
from fp8kv.registry import (
    BackendFailure,
    available_backends,
    get_backend,
    register_backend,
    unregister_backend,
)
from fp8kv.testing import (
    Workload,
    assert_attention_close,
    attention_error_bound,
    attention_tolerance,
    check_backend,
    paged_attention_bounds,
    ulp,
    workloads,
)
from fp8kv.testing.conformance import check_attention, check_write

# -- the tolerance ---------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "x", "want"), [
    (torch.float32, 1.0, 2.0**-23), (torch.float32, 3.0, 2.0**-22), (torch.float32, 0.0, 2.0**-149),
    (torch.float32, 2.0**-130, 2.0**-149), (torch.float16, 1.0, 2.0**-10), (torch.float16, 1000.0, 0.5),
    (torch.float16, 0.0, 2.0**-24), (torch.float16, 2.0**-20, 2.0**-24), (torch.float16, 2.0**-14, 2.0**-24),
    (torch.bfloat16, 1.0, 2.0**-7), (torch.bfloat16, -1.5, 2.0**-7), (torch.bfloat16, 0.0, 2.0**-133),
])
def test_ulp_matches_the_dtype_spacing(dtype, x, want):
    assert ulp(torch.tensor(x), dtype).item() == want
    if x and want > 2.0**-133:  # the next representable value above |x| really is one ulp away
        a = torch.tensor(abs(x), dtype=dtype)
        nxt = torch.nextafter(a.float(), torch.tensor(math.inf)).to(dtype) if dtype == torch.float32 else \
            (a.view(torch.int16) + 1).view(dtype)
        assert (nxt.double() - a.double()).item() == want


def test_tolerance_follows_the_documented_formula():
    u = 2.0**-24
    ref = torch.tensor([[[0.75]]], dtype=torch.float16)
    D, N, L, V = 64, 10, 3.0, 2.0
    delta = (D + 4) * u * L + 8 * u * max(1.0, L)
    E = V * (2 * math.expm1(2 * delta) + (8 * N + 8) * u + 16 * u)
    tol = attention_tolerance(ref, out_dtype=torch.float16, head_size=D, num_keys=N, logit_bound=L,
                              v_absmax=V)
    assert tol.dtype == torch.float64 and tol.shape == ref.shape
    assert tol.item() == pytest.approx(E + 2.0**-11, rel=1e-12)  # ulp_fp16(0.75 + E) = 2^-11
    # soft-cap: |s| <= cap and 8 u cap more in the logit error
    capped = attention_error_bound(head_size=D, num_keys=N, logit_bound=L, v_absmax=V, soft_cap=0.5)
    delta_c = (D + 4) * u * L + 8 * u * 1.0 + 8 * u * 0.5
    assert capped.item() == pytest.approx(V * (2 * math.expm1(2 * delta_c) + (8 * N + 24) * u), rel=1e-12)


def test_tolerance_is_infinite_where_rounding_may_overflow_and_for_non_finite_bounds():
    ref = torch.tensor([65504.0, 1.0, 1.0], dtype=torch.float16)
    tol = attention_tolerance(ref, out_dtype=torch.float16, head_size=16, num_keys=4, logit_bound=1.0,
                              v_absmax=torch.tensor([65504.0, 1.0, math.inf]))
    assert math.isinf(tol[0]) and math.isfinite(tol[1]) and math.isinf(tol[2])


def test_assert_attention_close_names_the_worst_element():
    ref = torch.zeros(3, 2, 4)
    out = ref.clone()
    out[2, 1, 3] = 0.5
    out[0, 0, 0] = 0.01
    bounds = dict(head_size=4, num_keys=3, logit_bound=1.0, v_absmax=1.0)
    with pytest.raises(AssertionError, match=r"at 2 of 24 elements; worst at \[token, head, dim\] = "
                       r"\[2, 1, 3\]: got 0.5, reference 0.0"):
        assert_attention_close(out, ref, **bounds)
    assert_attention_close(ref + 1e-6, ref, **bounds)  # inside E = 112 u = 6.7e-6
    nan = torch.full_like(ref, math.nan)
    assert_attention_close(nan, nan, **bounds)  # NaN matches NaN
    with pytest.raises(AssertionError, match="got nan"):
        assert_attention_close(nan, ref, **bounds)


# -- fakes: one correct re-implementation and deliberately broken ones -------------------


class Fake(ReferenceOps):
    """A backend delegating to the reference, for tests. Subclasses break one thing."""

    name = "fake"
    priority = 500

    @hookimpl
    def fp8kv_backend_info(self):
        # not "fast": pure-PyTorch fakes, exempt from the kit's memory-safety pass (their indexing
        # raises instead of touching foreign memory; see test_memory_safety_pass_* below)
        return BackendInfo(self.name, "0", priority=self.priority, description="test fake", fast=False)

    @hookimpl
    def fp8kv_supports(self, device, request):
        return None


class Flash32(Fake):
    """A correct but differently-ordered float32 kernel: K and V scales folded into the logits and
    probabilities, blocked online softmax in base 2, unnormalised accumulation, one final division."""

    name = "flash32"
    block = 3
    drop_last_key = False
    window_shift = 0
    v_scale_from_k = False

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse):
        LOG2E = 1.4426950408889634
        block_tables, seq_lens, query_start_loc = metadata.block_tables, metadata.seq_lens, metadata.query_start_loc
        o = metadata.options
        softmax_scale, causal, sliding_window, logits_soft_cap = (o.softmax_scale, o.causal, o.sliding_window,
                                                                  o.logits_soft_cap)
        g = query.shape[1] // cache.num_kv_heads
        kcode, vcode = cache.token_view("key").float(), cache.token_view("value").float()
        ks = cache.scale_per_slot("key")
        vs = cache.scale_per_slot("key" if self.v_scale_from_k else "value")
        starts = query_start_loc.tolist()
        for i, L in enumerate(seq_lens.tolist()):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            pos = torch.arange(L)
            bs = cache.block_size
            slots = block_tables[i].long()[pos // bs] * bs + pos % bs
            window = None if sliding_window is None else sliding_window + self.window_shift
            vis = reference.visible_mask(L, hi - lo, causal, window, query.device)
            if self.drop_last_key:
                vis = vis & (pos[None, :] != (L - 1))
            q = query[lo:hi].float()
            m = torch.full((hi - lo, q.shape[1]), -math.inf)
            den = torch.zeros_like(m)
            acc = torch.zeros(hi - lo, q.shape[1], q.shape[2])
            for b0 in range(0, L, self.block):
                sl = slots[b0:b0 + self.block]
                kscale = (ks[sl] * softmax_scale).repeat_interleave(g, 1)  # [b, Hq]
                s = torch.einsum("qhd,khd->qhk", q, kcode[sl].repeat_interleave(g, 1)) * kscale.T[None]
                if logits_soft_cap is not None:
                    s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
                s = (s * LOG2E).masked_fill(~vis[:, None, b0:b0 + self.block], -math.inf)
                m_new = torch.maximum(m, s.amax(-1))
                alpha = torch.exp2(torch.where(torch.isinf(m_new), 0.0, m - m_new))
                p = torch.nan_to_num(torch.exp2(s - m_new[..., None]), nan=0.0)
                den = den * alpha + p.sum(-1)
                pv = p * vs[sl].repeat_interleave(g, 1).T[None]  # V scale folded into p
                vv = torch.where(vis[:, None, b0:b0 + self.block, None], vcode[sl].repeat_interleave(g, 1)
                                 .permute(1, 0, 2)[None], 0.0)  # masked keys never read
                acc = acc * alpha[..., None] + torch.einsum("qhk,qhkd->qhd", pv, vv)
                m = m_new
            out[lo:hi] = (acc / den[..., None]).to(out.dtype)
            if lse is not None:
                lse[lo:hi] = (m + torch.log2(den)) / LOG2E


class DroppedKey(Flash32):
    name, drop_last_key = "dropped_key", True


class WindowOffByOne(Flash32):
    name, window_shift = "window_off_by_one", 1


class WrongVScale(Flash32):
    name, v_scale_from_k = "wrong_v_scale", True


class PaddingNotSkipped(Fake):
    """Writes padding rows too: slot -1 wraps to the last slot of the cache."""

    name = "padding_not_skipped"

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        reference.write_kv(cache, key, value, slot_mapping.abs() % cache.num_slots)


class TruncatingWrite(Fake):
    """Rounds keys toward zero instead of to nearest even (NHD only)."""

    name = "truncating_write"

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        reference.write_kv(cache, key, value, slot_mapping)
        slots = slot_mapping[slot_mapping >= 0]
        x = key[slot_mapping >= 0].float() / cache.scale_per_slot("key")[slots][..., None]
        block, offset = slots // cache.block_size, slots % cache.block_size
        codes = cache.key_cache[block, offset]
        rounded_up = codes.float().abs() > x.abs()
        fixed = codes.view(torch.uint8) - rounded_up.to(torch.uint8)
        cache.key_cache.view(torch.uint8)[block, offset] = fixed


class ClobbersBlock(Fake):
    """Zeroes the whole block of every written slot first."""

    name = "clobbers_block"

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        blocks = (slot_mapping[slot_mapping >= 0] // cache.block_size).unique()
        cache.key_cache.view(torch.uint8)[blocks] = 0
        reference.write_kv(cache, key, value, slot_mapping)


class Liar(Fake):
    """Claims everything, fails on HND."""

    name = "liar"

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        if cache.layout == "HND":
            raise NotImplementedError("HND is not written yet")
        reference.write_kv(cache, key, value, slot_mapping)


class NoE5M2(Fake):
    """Honestly refuses fp8_e5m2 and soft-cap."""

    name = "no_e5m2"

    @hookimpl
    def fp8kv_supports(self, device, request):
        if request.kv_dtype == "fp8_e5m2":
            return "fp8_e5m2 is not implemented by no_e5m2"
        if "soft_cap" in request.features:
            return "soft-cap is not implemented by no_e5m2"
        return None


@pytest.fixture
def registered():
    """Register fakes by class for one test; always unregistered afterwards."""
    names = []

    def add(cls):
        names.append(register_backend(cls()).name)
        return get_backend(names[-1])

    yield add
    for n in names:
        unregister_backend(n)


def _wl(**kw) -> Workload:
    """A fixed small workload: 2 sequences (13 and 6 tokens), chunked prefill, shuffled blocks with holes."""
    base = dict(
        seed=7, kv_dtype="fp8_e4m3", layout="NHD", scale_granularity="head", num_kv_heads=2, num_q_heads=4,
        head_size=16, block_size=4, num_blocks=8, seq_lens=(13, 6), q_lens=(3, 1), chunked=True,
        block_tables=((5, 0, 7, 2, -1), (3, 6, -1, -1, -1)),
        write_slots=(21, 1, -1, 3, 0, 2, 28, 29, 30, 31, 8, 15, 20, 22, 23, -7, 12, 13, 14, 24, 25),
        slot_dtype="int64", io_dtype=torch.float32, k_scale=(0.01, 0.013), v_scale=(0.02, 0.0071),
        amplitude=1.0, sliding_window=None, poison="nan",
    )
    base.update(kw)
    return Workload(**base)


def test_fixed_workload_is_consistent():
    wl = _wl()
    assert sorted(wl.mapped_slots()) == sorted(
        t[p // 4] * 4 + p % 4 for t, n in zip(wl.block_tables, wl.seq_lens, strict=True) for p in range(n))


# -- soundness: a correct, differently-ordered kernel always passes ----------------------


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("extra", [{}, {"soft_cap": 2.0, "sliding_window": 5}, {"causal": False},
                                   {"scale_granularity": "token_head", "k_scale": None, "v_scale": None}])
def test_correct_reordered_kernel_is_within_tolerance(registered, io_dtype, extra):
    check_attention(registered(Flash32), _wl(io_dtype=io_dtype, **extra), torch.device("cpu"))


def test_correct_reordered_kernel_passes_the_kit(registered):
    registered(Flash32)
    report = check_backend("flash32", examples=25, max_seqs=2, max_seq_len=24, head_sizes=(16, 32, 64))
    assert report.served["paged_attention"] > 0 and report.served["write_kv"] > 0


# -- tightness: each real bug is caught ----------------------------------------------------


@pytest.mark.parametrize(("fake", "extra"), [
    (DroppedKey, {}),
    (WrongVScale, {}),
    (WindowOffByOne, {"sliding_window": 5}),
    (WrongVScale, {"io_dtype": torch.bfloat16}),
    (DroppedKey, {"io_dtype": torch.float16, "scale_granularity": "token_head", "k_scale": None,
                  "v_scale": None}),
])
def test_attention_bugs_violate_the_tolerance(registered, fake, extra):
    with pytest.raises(AssertionError, match="beyond the derived tolerance"):
        check_attention(registered(fake), _wl(**extra), torch.device("cpu"))


@pytest.mark.parametrize(("fake", "message"), [
    (PaddingNotSkipped, "changed at unmapped slot"),
    (ClobbersBlock, "changed at unmapped slot"),
    (TruncatingWrite, "not bit-exact with the reference: key_cache differs"),
])
def test_write_bugs_are_caught(registered, fake, message):
    with pytest.raises(AssertionError, match=message):
        check_write(registered(fake), _wl(), torch.device("cpu"))


def test_kit_finds_a_broken_backend_end_to_end(registered):
    registered(WrongVScale)
    with pytest.raises(AssertionError, match="wrong_v_scale.*beyond the derived tolerance"):
        check_backend("wrong_v_scale", examples=20, max_seqs=2, max_seq_len=16, head_sizes=(16,),
                      granularities=("tensor", "head"))


def test_backend_that_claims_and_fails_is_named(registered):
    registered(Liar)
    with pytest.raises(BackendFailure, match="backend 'liar' .*claimed support and failed in fp8kv_write_kv"):
        check_write(get_backend("liar"), _wl(layout="HND"), torch.device("cpu"))


def test_refusals_are_checked_and_reported(registered):
    registered(NoE5M2)
    report = check_backend("no_e5m2", examples=30, max_seqs=2, max_seq_len=12, head_sizes=(16,))
    assert report.refused["write_kv"] > 0 and report.served["write_kv"] > 0
    assert report.reasons["fp8_e5m2 is not implemented by no_e5m2"] > 0
    assert "top refusals" in report.summary()


def test_kit_registers_an_unregistered_object_for_the_check_only():
    report = check_backend(NoE5M2(), examples=5, max_seqs=1, max_seq_len=8, head_sizes=(16,))
    assert report.backend == "no_e5m2" and "no_e5m2" not in available_backends()


def test_kit_fails_a_backend_that_serves_nothing(registered):
    class Nothing(Fake):
        name = "nothing"

        @hookimpl
        def fp8kv_supports(self, device, request):
            return "serves nothing"

    registered(Nothing)
    with pytest.raises(AssertionError, match="claimed none of the"):
        check_backend("nothing", examples=3, max_seqs=1, max_seq_len=4, head_sizes=(16,))


# -- the strategies ----------------------------------------------------------------------


class Spy(Fake):
    """Records the Request of every call the API dispatches to it."""

    name = "spy"
    seen: list = []

    @hookimpl
    def fp8kv_supports(self, device, request):
        Spy.seen.append(request)
        return None


@settings(max_examples=25)
@given(wl=workloads(max_seqs=3, max_seq_len=20, head_sizes=(16,)))
def test_workloads_are_valid_and_match_the_api_requests(wl):
    assert all(0 <= q <= n for q, n in zip(wl.q_lens, wl.seq_lens, strict=True))
    assert wl.chunked or wl.q_lens == (1,) * wl.num_seqs
    slots = wl.mapped_slots()
    assert len(slots) == sum(wl.seq_lens) == len(set(slots))  # every token once, padding aside
    assert all(s < 0 for s in wl.write_slots if s not in slots)
    need = [-(-n // wl.block_size) for n in wl.seq_lens]
    used = {b for row, k in zip(wl.block_tables, need, strict=True) for b in row[:k]}
    assert len(used) == sum(need) and max(used) < wl.num_blocks
    a, b = wl.tensors(), wl.tensors()
    assert torch.equal(a.key.view(torch.uint8), b.key.view(torch.uint8))  # NaN specials included
    assert torch.equal(a.query, b.query)
    backend = register_backend(Spy())
    try:
        Spy.seen.clear()
        cache = wl.fill_cache("spy")
        fp8kv.paged_attention_one_shot(a.query, cache, a.block_tables, a.seq_lens, query_start_loc=a.query_start_loc,
                              backend="spy", **wl.attention_kwargs())
        assert Spy.seen == [wl.request("write_kv"), wl.request("paged_attention")]
    finally:
        unregister_backend(backend.name)


def test_workloads_cover_the_interesting_cases():
    seen = {"holes": False, "shuffled": False, "pads": False, "chunked": False, "decode": False,
            "saturating": False, "nan_poison": False}

    @settings(max_examples=80, derandomize=True)
    @given(wl=workloads(max_seqs=3, max_seq_len=20, head_sizes=(16,)))
    def look(wl):
        used = [b for row in wl.block_tables for b in row if b >= 0]
        seen["holes"] |= wl.num_blocks > len(set(used))
        rows = [r[:-(-n // wl.block_size)] for r, n in zip(wl.block_tables, wl.seq_lens, strict=True)]
        seen["shuffled"] |= any(list(r) != sorted(r) for r in rows)
        seen["pads"] |= any(s < 0 for s in wl.write_slots)
        seen["chunked"] |= wl.chunked and wl.max_query_len > 1
        seen["decode"] |= not wl.chunked
        fmt_max = FORMATS[wl.kv_dtype].max
        seen["saturating"] |= wl.k_scale is not None and min(wl.k_scale) < wl.amplitude / fmt_max
        seen["nan_poison"] |= wl.poison == "nan"

    look()
    assert all(seen.values()), seen


def test_poisoned_slots_survive_a_reference_write():
    wl = _wl(poison="finite")
    cache = wl.allocate_cache()
    before = cache.clone()
    t = wl.tensors()
    fp8kv.write_kv_one_shot(cache, t.key, t.value, t.slot_mapping, backend="reference")
    keep = torch.ones(cache.num_slots, dtype=torch.bool)
    keep[wl.mapped_slots()] = False
    after, poison = cache.token_view().view(torch.uint8)[keep], before.token_view().view(torch.uint8)[keep]
    assert torch.equal(after, poison) and (poison != 0).any()  # the poison is really there, untouched


def test_bounds_use_only_visible_keys():
    wl = _wl(sliding_window=2)
    t = wl.tensors()
    cache = wl.fill_cache()
    args = (t.query, cache, t.block_tables, t.seq_lens, t.query_start_loc)
    b = paged_attention_bounds(*args, sliding_window=2)
    assert b["num_keys"].flatten().tolist() == [2, 2, 2, 2]
    full = paged_attention_bounds(*args)
    assert full["num_keys"].flatten().tolist() == [11, 12, 13, 6]
    assert (b["logit_bound"] <= full["logit_bound"]).all() and (b["v_absmax"] <= full["v_absmax"]).all()


# -- the kit over every backend installed here ---------------------------------------------

KNOWN = [
    # found by the kit in the Triton backend (interpreter): non-causal decode with a sliding window of 1
    # attended to the wrong key.
    Workload(seed=0, kv_dtype="fp8_e4m3", layout="NHD", scale_granularity="token_head", num_kv_heads=1,
             num_q_heads=1, head_size=16, block_size=2, num_blocks=1, seq_lens=(2,), q_lens=(1,),
             chunked=False, block_tables=((0,),), write_slots=(0, 1), slot_dtype="int64",
             io_dtype=torch.float32, k_scale=None, v_scale=None, causal=False, sliding_window=1),
]
"""Every failure the kit ever found on any backend: checked first, on every backend."""

ON_GPU = torch.cuda.is_available()
INTERPRETER_LIMITS = dict(examples=10, max_seqs=2, max_seq_len=32, head_sizes=(16, 32))
"""Shapes the Triton CPU interpreter gets through in seconds."""


def _limits(name: str) -> dict:
    if ON_GPU or name == "reference":
        return {}
    return INTERPRETER_LIMITS


@pytest.mark.parametrize("name", sorted(available_backends()))
def test_every_installed_backend_conforms(name):
    backend = get_backend(name)
    device = fp8kv.probe()
    reasons = [backend.check_supports(device, replace(_wl(), kv_dtype=fmt).request(op, device.device_type))
               for op in ("write_kv", "paged_attention") for fmt in FORMATS]
    if all(reasons):
        pytest.skip(f"{name} serves nothing on {device.name}: {reasons[0]}")
    report = check_backend(name, known=KNOWN, **_limits(name))
    print(report.summary())


class WrappingWrite(Fake):
    """A "kernel" that wraps out-of-range slots into the cache instead of skipping them."""

    name = "wrapping_write"

    @hookimpl
    def fp8kv_backend_info(self):
        return BackendInfo(self.name, "0", priority=self.priority, description="test fake", fast=True)

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping):
        reference.write_kv(cache, key, value, torch.where(slot_mapping >= 0, slot_mapping % cache.num_slots, -1))


def test_memory_safety_pass_catches_a_write_that_wraps_bad_slots():
    from fp8kv.testing import check_memory_safety

    register_backend(WrappingWrite())
    try:
        with pytest.raises(AssertionError, match="out-of-range slot must not be written"):
            check_memory_safety("wrapping_write", "cpu")
    finally:
        unregister_backend("wrapping_write")


@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_memory_safety_pass_holds_for_the_reference(layout, granularity):
    from fp8kv.testing import check_memory_safety

    check_memory_safety("reference", "cpu", layout=layout, granularity=granularity)


# -- the FP8 attention mode: the kit's FP8 cases (fp8_attention="only") ----------------------


def test_kit_passes_a_tiled_fp8_mode_kernel():
    """A correct kernel order (random tiles, accumulators truncated to the model's 13 bits) passes."""
    report = check_backend(TiledFP8(tile=4, order="random", acc_bits=13), examples=15, fp8_attention="only",
                           kv_dtypes=("fp8_e4m3",), granularities=("tensor", "head"), max_seqs=2,
                           max_seq_len=24, head_sizes=(16, 32))
    assert report.served["paged_attention"] > 0 and report.refused["paged_attention"] == 0


@pytest.mark.parametrize("mistake", ["p_not_rounded", "no_v_scale", "q_scale_ignored"])
def test_kit_finds_fp8_mode_bugs(mistake):
    with pytest.raises(AssertionError, match="FP8-mode output differs from the reference beyond the derived"):
        check_backend(TiledFP8(name=f"tiled_{mistake}", mistake=mistake), examples=25, fp8_attention="only",
                      kv_dtypes=("fp8_e4m3",), granularities=("tensor", "head"), max_seqs=2, max_seq_len=24,
                      head_sizes=(16, 32))
