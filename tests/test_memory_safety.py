"""Memory safety without the host checks: the kernels bound themselves.

With value checks off (``validate=False``, ``FP8KV_CHECK=shapes``, or a CUDA graph replayed
after :meth:`fp8kv.AttentionMetadata.update` with ``validate=False``), hostile index values
reach the backends unchecked. Every backend must then stay inside the tensors it was given:

* **writes**: a slot is written only if ``0 <= slot < num_slots`` (an out-of-range slot is not
  written: it behaves like padding), compared in 64 bits (``2^40`` too);
* **attention**: ``query_start_loc`` is clamped to ``[0, num_tokens]``, ``seq_lens`` to
  ``[0, max_blocks * block_size]``, a key whose block id is outside ``[0, num_blocks)`` is masked
  out (not visible, never loaded), and ``max_query_len`` is bounded by ``num_tokens``; rows whose
  keys are all masked give ``out = 0`` and ``lse = -inf``.

The cache K/V (and token_head scales) are views into bigger "guard" tensors whose extra blocks
hold NaN bytes: after hostile calls the guard bytes must be byte-identical (nothing written out
of bounds) and the outputs free of NaN (nothing read out of bounds); far-away addresses
(``2^40``, block ``2^31 - 1``) would crash the process (the interpreter, a segfault; the GPU,
an illegal memory access). In-range results equal a clean run, or a float64 oracle of the
semantics above, wherever they are defined (rows covered by exactly one sequence's queries).

CPU: the reference, and Triton through its interpreter (``TRITON_INTERPRET=1``, tiny shapes).
GPU (skipped without an NVIDIA GPU sm80+): the same, plus CUDA-graph capture of ``write_kv`` +
``paged_attention`` replayed after a refill with hostile values.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import pytest
import torch

import fp8kv
from fp8kv.cache import KVCache
from fp8kv.errors import InvalidArgument
from fp8kv.formats import FORMATS

HAS_SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_SM80, reason="needs an NVIDIA GPU sm80+")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, needs_gpu])]

G = 6  # guard blocks on each side of the cache
NB, BS, H, HQ, D, MAXB = 8, 4, 2, 4, 16, 6  # blocks, block size, KV heads, query heads, head size, table columns


def _backends(device: str) -> list[str]:
    return ["reference", "triton"] if device == "cuda" or INTERPRET else ["reference"]


def _params():
    """(device, backend) pairs: the CPU ones always listed (skipped if Triton cannot run there)."""
    out = []
    for dev in DEVICES:
        for b in ("reference", "triton"):
            marks = list(dev.marks)
            if dev.values[0] == "cpu" and b == "triton":
                marks.append(pytest.mark.skipif(not INTERPRET, reason="Triton on the CPU needs TRITON_INTERPRET=1"))
            out.append(pytest.param(dev.values[0], b, id=f"{dev.id}-{b}", marks=marks))
    return out


# ------------------------------------------------------------------------------ guarded caches


@dataclass
class Guarded:
    """A cache whose K/V (and token_head scales) are the middle blocks of bigger tensors."""

    cache: KVCache
    parents: list[torch.Tensor]
    snapshot: list[torch.Tensor]

    def assert_guard_intact(self) -> None:
        for p, s in zip(self.parents, self.snapshot, strict=True):
            for sl in (slice(0, G), slice(G + NB, None)):
                a, b = p[sl], s[sl]
                if a.dtype == torch.float32:
                    a, b = a.view(torch.int32), b.view(torch.int32)
                assert torch.equal(a, b), "a guard byte around the cache changed"

    def inner_bytes(self) -> list[torch.Tensor]:
        return [p[G:G + NB].clone() for p in self.parents]


def guarded_cache(device: str, *, kv_dtype: str = "fp8_e4m3", layout: str = "NHD", gran: str = "tensor",
                  fill: bool = True) -> Guarded:
    """A cache of NB blocks inside NaN-filled guard blocks, filled (deterministically) through the reference."""
    fmt = FORMATS[kv_dtype]
    shape = (NB + 2 * G, BS, H, D) if layout == "NHD" else (NB + 2 * G, H, BS, D)
    nan = fmt.nan_encodings[0]
    big_k = torch.full(shape, nan, dtype=torch.uint8, device=device)
    big_v = torch.full(shape, nan, dtype=torch.uint8, device=device)
    parents = [big_k, big_v]
    if gran == "token_head":
        big_ks = torch.full((NB + 2 * G, BS, H), math.nan, device=device)
        big_vs = torch.full((NB + 2 * G, BS, H), math.nan, device=device)
        parents += [big_ks, big_vs]
        scales = dict(k_scale=big_ks[G:G + NB], v_scale=big_vs[G:G + NB])
    elif gran == "head":
        scales = dict(k_scale=torch.tensor([0.05, 0.02], device=device), v_scale=torch.tensor([0.07, 0.03],
                                                                                                device=device))
    else:
        scales = dict(k_scale=0.05, v_scale=0.07)
    cache = KVCache.from_tensors(big_k[G:G + NB], big_v[G:G + NB], kv_dtype=kv_dtype, layout=layout,
                                 scale_granularity=gran, **scales)
    if fill:
        g = torch.Generator().manual_seed(0)
        k = torch.randn(NB * BS, H, D, generator=g).to(device)
        v = torch.randn(NB * BS, H, D, generator=g).to(device)
        fp8kv.write_kv_one_shot(cache, k, v, torch.arange(NB * BS, device=device), backend="reference")
    return Guarded(cache, parents, [p.clone() for p in parents])


# ------------------------------------------------------------------------------------- writes

NUM_SLOTS = NB * BS


def _hostile_slots(dtype: torch.dtype) -> list[int]:
    if dtype == torch.int64:
        return [0, NUM_SLOTS, 5, NUM_SLOTS + 5, 2**40, -(2**40), -1, NUM_SLOTS - 1, 2**63 - 1, -(2**63), 17]
    return [0, NUM_SLOTS, 5, NUM_SLOTS + 5, 2**31 - 1, -(2**31), -1, NUM_SLOTS - 1, 17]


def _write_inputs(n: int, device: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(n, H, D, generator=g) * 3).to(dtype).to(device)
    v = (torch.randn(n, H, D, generator=g) * 3).to(dtype).to(device)
    return k, v


@pytest.mark.parametrize("device,backend", _params())
@pytest.mark.parametrize("gran,layout", [("tensor", "NHD"), ("head", "HND"), ("token_head", "NHD"),
                                         ("token_head", "HND")])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("how", ["metadata", "shapes_only"])
def test_out_of_range_slots_are_not_written(device, backend, gran, layout, slot_dtype, how, monkeypatch):
    """Slots num_slots, num_slots + 5, 2^40, 2^31 - 1 (and all negatives) are skipped; the valid
    ones are written exactly as a clean write of just them; no guard byte changes."""
    slots_list = _hostile_slots(slot_dtype)
    slots = torch.tensor(slots_list, dtype=slot_dtype, device=device)
    key, value = _write_inputs(len(slots_list), device, torch.bfloat16)
    gc = guarded_cache(device, layout=layout, gran=gran)
    clean = guarded_cache(device, layout=layout, gran=gran)
    if how == "metadata":
        meta = fp8kv.plan_attention(gc.cache, num_q_heads=HQ, query_dtype=torch.bfloat16,
                                    block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
                                    seq_lens=torch.ones(1, dtype=torch.int32, device=device),
                                    slot_mapping=slots, validate=False, backend=backend)
        fp8kv.write_kv(gc.cache, key, value, meta)
    else:
        monkeypatch.setenv("FP8KV_CHECK", "shapes")
        fp8kv.write_kv_one_shot(gc.cache, key, value, slots, backend=backend)
    gc.assert_guard_intact()
    valid = torch.tensor([0 <= s < NUM_SLOTS for s in slots_list], device=device)
    fp8kv.write_kv_one_shot(clean.cache, key[valid], value[valid], slots[valid], backend="reference")
    for got, want in zip(gc.inner_bytes(), clean.inner_bytes(), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("device,backend", _params())
def test_host_checks_still_refuse_bad_slots(device, backend):
    """With checks on (the default) a slot past the cache raises the named error and writes nothing."""
    gc = guarded_cache(device)
    key, value = _write_inputs(2, device)
    before = gc.inner_bytes()
    for bad in (NUM_SLOTS, 2**40):
        with pytest.raises(InvalidArgument, match="slot_mapping"):
            fp8kv.write_kv_one_shot(gc.cache, key, value, torch.tensor([0, bad], device=device), backend=backend)
    for got, want in zip(gc.inner_bytes(), before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    gc.assert_guard_intact()


# ---------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class Step:
    """Hostile step metadata (plain lists; ``qsl`` None: decode)."""

    tables: tuple
    lens: tuple
    qsl: tuple | None
    num_tokens: int
    max_query_len: int = 10**10
    causal: bool = True
    window: int | None = None


V = NB  # the first block id past the cache
CASES = {
    "block_ids": Step(tables=((0, V, 1, 2, 3, 4), (2**31 - 1, 3, -5, 5, 6, 7), (-5, -1, V, 2**31 - 1, -(2**31), V)),
                      lens=(10, 12, 5), qsl=None, num_tokens=3),
    "seq_lens": Step(tables=((0, 1, 2, 3, 4, 5), (3, 0, 1, 2, 6, 7), (2, 3, 0, 1, 7, 6)),
                     lens=(100, -3, 2**31 - 1), qsl=None, num_tokens=3),
    "query_start_loc": Step(tables=((0, 1, 2, 3, 4, 5), (3, 0, 1, 2, 6, 7), (7, 6, 5, 4, 3, 2)),
                            lens=(9, 20, 24), qsl=(0, 4, 2, 2**31 - 1), num_tokens=6),
    "negative_starts": Step(tables=((0, 1, 2, 3, 4, 5), (3, 0, 1, 2, 6, 7), (7, 6, 5, 4, 3, 2)),
                            lens=(9, 2, 13), qsl=(-7, 3, 3, 7), num_tokens=7, causal=False),
    "everything": Step(tables=((0, V, 1, -5, 3, 4), (2**31 - 1, 3, -5, 5, 6, 7), (7, 6, V + 3, 4, 3, 2)),
                       lens=(2**31 - 1, -(2**31), 30), qsl=(3, -2, 7, 5), num_tokens=7, window=5),
    "query_longer_than_keys": Step(tables=((0, 1, 2, 3, 4, 5), (6, 7, 0, 1, 2, 3)),
                                   lens=(2, 5), qsl=(0, 5, 6), num_tokens=6),
}


def _tensors(step: Step, device: str):
    i32 = dict(dtype=torch.int32, device=device)
    tables = torch.tensor(step.tables, **i32)
    lens = torch.tensor(step.lens, **i32)
    qsl = None if step.qsl is None else torch.tensor(step.qsl, **i32)
    return tables, lens, qsl


def _semantics(step: Step):
    """Per sequence: clamped (q_lo, q_hi), clamped seq_len; per row: covered exactly once."""
    T, S = step.num_tokens, len(step.lens)
    qsl = list(range(S + 1)) if step.qsl is None else list(step.qsl)
    ranges = [(min(max(qsl[i], 0), T), min(max(qsl[i + 1], 0), T)) for i in range(S)]
    lens = [min(max(n, 0), MAXB * BS) for n in step.lens]
    cover = [0] * T
    for lo, hi in ranges:
        for t in range(lo, hi):
            cover[t] += 1
    return ranges, lens, [c == 1 for c in cover]


def _oracle(query, cache: KVCache, step: Step, scale: float):
    """float64 attention with the masking rules of the module docstring (independent of the backends)."""
    ranges, lens, _ = _semantics(step)
    T = query.shape[0]
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full(query.shape[:2], -math.inf, dtype=torch.float64)
    kd = cache.dequantized("key").double().cpu()
    vd = cache.dequantized("value").double().cpu()
    q64 = query.double().cpu()
    group = HQ // H
    for i, (lo, hi) in enumerate(ranges):
        q_len, L = max(hi - lo, 0), lens[i]
        for j in range(q_len):
            t, p = lo + j, L - q_len + j
            keys = []
            for k in range(L):
                blk = step.tables[i][k // BS]
                if not 0 <= blk < NB:
                    continue
                if step.causal and k > p:
                    continue
                if step.window is not None and k <= p - step.window:
                    continue
                keys.append(blk * BS + k % BS)
            if not keys or t >= T:
                continue
            for h in range(HQ):
                s = kd[keys, h // group] @ q64[t, h] * scale
                w = torch.softmax(s, 0)
                out[t, h] = w @ vd[keys, h // group]
                lse[t, h] = torch.logsumexp(s, 0)
    return out, lse


@pytest.mark.parametrize("device,backend", _params())
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_hostile_metadata_stays_in_bounds(device, backend, case, gran):
    """Block ids past the cache or negative, lengths past the table or negative, query offsets
    decreasing / negative / past num_tokens, max_query_len 10^10: no out-of-bounds access (guard
    bytes identical, no NaN read from the guard), defined rows equal the float64 oracle."""
    step = CASES[case]
    gc = guarded_cache(device, gran=gran, layout="HND" if gran == "tensor" else "NHD")
    tables, lens, qsl = _tensors(step, device)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(step.num_tokens, HQ, D, generator=g).to(device)
    meta = fp8kv.plan_attention(gc.cache, num_q_heads=HQ, query_dtype=torch.float32, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl, num_tokens=step.num_tokens,
                                max_query_len=step.max_query_len, causal=step.causal,
                                sliding_window=step.window, validate=False, backend=backend)
    big_out = torch.full((step.num_tokens + 2, HQ, D), 1234.5, device=device)
    out, lse = fp8kv.paged_attention(query, gc.cache, meta, out=big_out[1:-1], return_lse=True)
    if device == "cuda":
        torch.cuda.synchronize()
    gc.assert_guard_intact()
    assert torch.equal(big_out[0], torch.full_like(big_out[0], 1234.5))
    assert torch.equal(big_out[-1], torch.full_like(big_out[-1], 1234.5))
    _, _, defined = _semantics(step)
    rows = torch.tensor(defined, device=device)
    want, want_lse = _oracle(query, gc.cache, step, D**-0.5)
    got, got_lse = out[rows].double().cpu(), lse[rows].double().cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want[rows.cpu()], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse[rows.cpu()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(
    not INTERPRET, reason="Triton on the CPU needs TRITON_INTERPRET=1")), DEVICES[1]])
@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_hostile_metadata_split_kv_kernel(device, gran):
    """The kernel-level launcher with a forced split-KV configuration (partials and merge) and a
    guarded ``lse``: same bounds, same results as the float64 oracle on defined rows."""
    from fp8kv_triton.attention import paged_attention

    step = CASES["everything"]
    gc = guarded_cache(device, gran=gran)
    tables, lens, qsl = _tensors(step, device)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(step.num_tokens, HQ, D, generator=g).to(device)
    meta = fp8kv.plan_attention(gc.cache, num_q_heads=HQ, query_dtype=torch.float32, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl, num_tokens=step.num_tokens,
                                max_query_len=step.max_query_len, sliding_window=step.window, validate=False,
                                backend="triton")
    plan = meta.backend_plan
    config = replace(plan.config, block_n=16, num_splits=2, keys_per_split=16, num_stages=1)
    T = step.num_tokens
    big_out = torch.full((T + 2, HQ, D), 1234.5, device=device)
    big_lse = torch.full((T + 2, HQ), 4321.0, device=device)
    paged_attention(query, gc.cache, tables, lens, qsl, 10**10, D**-0.5, True, step.window, None,
                    big_out[1:-1], lse=big_lse[1:-1], decode_mode=plan.decode_mode, interpret=plan.interpret,
                    config=config)
    if device == "cuda":
        torch.cuda.synchronize()
    gc.assert_guard_intact()
    for big, fill in ((big_out, 1234.5), (big_lse, 4321.0)):
        assert (big[0] == fill).all() and (big[-1] == fill).all()
    _, _, defined = _semantics(step)
    rows = torch.tensor(defined)
    want, want_lse = _oracle(query, gc.cache, step, D**-0.5)
    got, got_lse = big_out[1:-1].double().cpu()[rows], big_lse[1:-1].double().cpu()[rows]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,backend", _params())
def test_backends_agree_on_garbage(device, backend):
    """Every case, both granularities: the backend and the reference give the same defined rows
    (including ``out = 0``, ``lse = -inf`` for rows that see no key)."""
    for case, step in sorted(CASES.items()):
        gc = guarded_cache(device, gran="token_head")
        tables, lens, qsl = _tensors(step, device)
        query = torch.randn(step.num_tokens, HQ, D, generator=torch.Generator().manual_seed(4)).to(device)
        res = []
        for b in (backend, "reference"):
            meta = fp8kv.plan_attention(gc.cache, num_q_heads=HQ, query_dtype=torch.float32, block_tables=tables,
                                        seq_lens=lens, query_start_loc=qsl, num_tokens=step.num_tokens,
                                        max_query_len=step.max_query_len, causal=step.causal,
                                        sliding_window=step.window, validate=False, backend=b)
            res.append(fp8kv.paged_attention(query, gc.cache, meta, return_lse=True))
        rows = torch.tensor(_semantics(step)[2], device=device)
        (o1, l1), (o2, l2) = res
        torch.testing.assert_close(o1[rows], o2[rows], rtol=1e-5, atol=1e-5, msg=case)
        torch.testing.assert_close(l1[rows], l2[rows], rtol=1e-5, atol=1e-5, msg=case)
        gc.assert_guard_intact()


def test_api_still_refuses_bad_metadata_when_checking():
    """Checks on (the default): the same hostile values raise InvalidArgument at plan time."""
    gc = guarded_cache("cpu")
    for case in ("block_ids", "seq_lens", "query_start_loc"):
        step = CASES[case]
        tables, lens, qsl = _tensors(step, "cpu")
        with pytest.raises(InvalidArgument):
            fp8kv.plan_attention(gc.cache, num_q_heads=HQ, query_dtype=torch.float32, block_tables=tables,
                                 seq_lens=lens, query_start_loc=qsl, num_tokens=step.num_tokens)


# ------------------------------------------------------------------------------ CUDA graphs (GPU)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_graph_replay_with_hostile_refill_stays_in_bounds(gran):
    """Capture write_kv + paged_attention on a valid metadata, refill it in place with hostile values
    (``meta.update(..., validate=False)``), replay: no illegal memory access, guard bytes identical,
    and the defined rows equal an eager run on the same hostile metadata."""
    dev = "cuda"
    step = CASES["everything"]
    T = step.num_tokens
    gc = guarded_cache(dev, gran=gran)
    ok_tables = torch.arange(3 * MAXB, dtype=torch.int32, device=dev).view(3, MAXB) % NB
    ok_lens = torch.tensor([10, 12, 20], dtype=torch.int32, device=dev)
    ok_qsl = torch.tensor([0, 2, 5, T], dtype=torch.int32, device=dev)
    ok_slots = torch.arange(T, dtype=torch.int64, device=dev) + 3
    meta = fp8kv.plan_attention(gc.cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=ok_tables,
                                seq_lens=ok_lens, query_start_loc=ok_qsl, slot_mapping=ok_slots,
                                max_query_len=T, max_seq_len=MAXB * BS, sliding_window=step.window,
                                backend="triton")
    g = torch.Generator(device=dev).manual_seed(5)
    key = torch.randn(T, H, D, device=dev, generator=g).bfloat16()
    query = torch.randn(T, HQ, D, device=dev, generator=g).bfloat16()
    big_out = torch.full((T + 2, HQ, D), 1234.5, device=dev, dtype=torch.bfloat16)
    out = big_out[1:-1]

    def run(cache, m, o):
        fp8kv.write_kv(cache, key, -key, m)
        fp8kv.paged_attention(query, cache, m, out=o)

    warm = guarded_cache(dev, gran=gran)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(warm.cache, meta, torch.empty_like(out))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(gc.cache, meta, out)
    tables, lens, qsl = _tensors(step, dev)
    bad_slots = torch.tensor([NUM_SLOTS, NUM_SLOTS + 5, 2**40, -(2**40), 2**62, 7, NUM_SLOTS - 1], device=dev)
    meta.update(block_tables=tables, seq_lens=lens, query_start_loc=qsl, slot_mapping=bad_slots, validate=False)
    graph.replay()
    torch.cuda.synchronize()
    gc.assert_guard_intact()
    assert (big_out[0] == 1234.5).all() and (big_out[-1] == 1234.5).all()
    # eager on the same hostile metadata (fresh cache): the same bytes and defined rows
    eager = guarded_cache(dev, gran=gran)
    bad = fp8kv.plan_attention(eager.cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=tables,
                               seq_lens=lens, query_start_loc=qsl, slot_mapping=bad_slots, num_tokens=T,
                               max_query_len=T, max_seq_len=MAXB * BS, sliding_window=step.window,
                               validate=False, backend="triton")
    eager_out = torch.empty_like(out)
    run(eager.cache, bad, eager_out)
    torch.cuda.synchronize()
    eager.assert_guard_intact()
    for a, b in zip(gc.inner_bytes(), eager.inner_bytes(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    rows = torch.tensor(_semantics(step)[2], device=dev)
    assert torch.equal(out[rows].view(torch.int16), eager_out[rows].view(torch.int16))
    assert torch.isfinite(out[rows].float()).all()


@pytest.mark.gpu
@needs_gpu
def test_huge_index_values_on_the_gpu_with_checks_off(monkeypatch):
    """The issue's reproducers with FP8KV_CHECK=shapes (one-shot calls): slot num_slots + 5 and 2^40,
    block id past the cache, max_query_len 10^10: no error, guard intact, nothing NaN."""
    monkeypatch.setenv("FP8KV_CHECK", "shapes")
    dev = "cuda"
    gc = guarded_cache(dev)
    key, value = _write_inputs(3, dev, torch.bfloat16)
    fp8kv.write_kv_one_shot(gc.cache, key, value, torch.tensor([NUM_SLOTS + 5, 2**40, 3], device=dev), backend="triton")
    torch.cuda.synchronize()
    gc.assert_guard_intact()
    tables = torch.tensor([[0, NB, 2**31 - 1, 1, 2, 3]], dtype=torch.int32, device=dev)
    query = torch.randn(4, HQ, D, device=dev).bfloat16()
    out = fp8kv.paged_attention_one_shot(query, gc.cache, tables, torch.tensor([24], dtype=torch.int32, device=dev),
                                query_start_loc=torch.tensor([0, 4], dtype=torch.int32, device=dev),
                                max_query_len=10**10, backend="triton")
    torch.cuda.synchronize()
    gc.assert_guard_intact()
    assert torch.isfinite(out.float()).all()
