"""The fast CPU backend (``backends/fp8kv_torch``): the conformance kit, selection, per-step index reuse."""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.registry import available_backends, select_backend
from fp8kv.testing import check_backend

pytestmark = pytest.mark.skipif("torch" not in available_backends(), reason="the torch backend is not installed")


@pytest.fixture(params=["native", "pytorch"])
def path(request, monkeypatch):
    """Each test twice: with the C loops (``FP8KV_TORCH_NATIVE=1``) and with PyTorch operations only."""
    from fp8kv_torch import native

    monkeypatch.setenv("FP8KV_TORCH_NATIVE", "1" if request.param == "native" else "0")
    if request.param == "native" and native.library() is None:
        pytest.skip(f"the torch backend's C loops: {native.status()}")
    return request.param


@pytest.fixture
def pytorch_path(monkeypatch):
    """PyTorch operations only (the tests of the float32/float64 paths themselves)."""
    monkeypatch.setenv("FP8KV_TORCH_NATIVE", "0")


def test_conforms_to_the_reference(path):
    report = check_backend("torch", device="cpu", examples=60)
    print(report.summary())
    assert report.served["write_kv"] and report.served["paged_attention"]


def test_conforms_on_larger_shapes_and_chunked_prefill(path):
    report = check_backend("torch", device="cpu", examples=15, max_seqs=4, max_seq_len=96, head_sizes=(64, 128))
    assert report.served["paged_attention"]


def test_auto_prefers_it_to_the_reference_on_the_cpu(monkeypatch):
    monkeypatch.delenv("FP8KV_BACKEND", raising=False)
    monkeypatch.setenv("FP8KV_AUTO_BACKENDS", "torch,reference")
    cache = fp8kv.KVCache.allocate(4, 16, 2, 64, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    sel = select_backend(fp8kv.plugins.Request.for_attention(cache.spec, torch.float32), "cpu")
    assert sel.backend.name == "torch"
    assert sel.reasons["reference"].startswith("can serve, lower priority")


def test_refuses_gpu_tensors_by_name():
    cache = fp8kv.KVCache.allocate(4, 16, 2, 64, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    req = fp8kv.plugins.Request.for_attention(cache.spec, torch.float32)
    req = type(req)(req.op, req.kv_dtype, req.layout, req.scale_granularity, req.head_size, req.io_dtype, "cuda")
    reason = available_backends()["torch"].check_supports(fp8kv.probe("cpu"), req)
    assert reason and "CPU tensors only" in reason


def test_one_index_per_step_rebuilt_after_an_update(pytorch_path, monkeypatch):
    """Layers of a step share the step's gather index; refilling the metadata in place
    (``AttentionMetadata.update``) rebuilds it, and the result follows the new lengths."""
    from fp8kv_torch import attention

    built = []
    real = attention.StepIndex.build
    monkeypatch.setattr(attention.StepIndex, "build", classmethod(lambda cls, m: built.append(1) or real(m)))
    caches = [fp8kv.KVCache.allocate(8, 4, 2, 16, kv_dtype="fp8_e4m3", scale_granularity="token_head")
              for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(16, 2, 16, generator=g) for _ in range(2))
    for c in caches:
        fp8kv.write_kv_one_shot(c, k, v, torch.arange(16), backend="reference")
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    meta = fp8kv.plan_attention(caches[0], num_q_heads=4, query_dtype=torch.float32, block_tables=tables,
                                seq_lens=torch.tensor([9, 5], dtype=torch.int32), max_seq_len=12, backend="torch")
    q = torch.randn(2, 4, 16, generator=g)
    outs = [fp8kv.paged_attention(q, c, meta) for c in caches]
    assert len(built) == 1
    meta.update(block_tables=tables, seq_lens=torch.tensor([12, 7], dtype=torch.int32))
    after = fp8kv.paged_attention(q, caches[0], meta)
    assert len(built) == 2
    want = fp8kv.paged_attention_one_shot(q, caches[0], tables, torch.tensor([12, 7], dtype=torch.int32),
                                          backend="reference")
    torch.testing.assert_close(after, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(after, outs[0])


@torch.inference_mode()
def test_inference_mode_metadata_is_supported():
    """transformers' generate runs under inference_mode: its tensors have no version counter."""
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16, kv_dtype="fp8_e5m2", scale_granularity="token_head")
    k = torch.randn(6, 2, 16)
    meta = fp8kv.plan_attention(cache, num_q_heads=2, query_dtype=torch.float32,
                                block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                                seq_lens=torch.tensor([6], dtype=torch.int32), slot_mapping=torch.arange(6),
                                query_start_loc=torch.tensor([0, 6], dtype=torch.int32), backend="torch")
    fp8kv.write_kv(cache, k, k, meta)
    got = fp8kv.paged_attention(k, cache, meta)
    want = fp8kv.paged_attention_one_shot(k, cache, meta.block_tables, meta.seq_lens,
                                          query_start_loc=meta.query_start_loc,
                                 backend="reference")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _decode_case(scale_granularity="tensor", k_scale=None, seq_lens=(9, 5), g=2):
    """A decode step over two sequences of a small NHD e4m3 cache (written by the reference)."""
    gen = torch.Generator().manual_seed(3)
    kw = {} if k_scale is None else {"k_scale": k_scale, "v_scale": 1.0}
    cache = fp8kv.KVCache.allocate(8, 4, 2, 16, kv_dtype="fp8_e4m3", scale_granularity=scale_granularity, **kw)
    k, v = (torch.randn(24, 2, 16, generator=gen) * 100 for _ in range(2))
    fp8kv.write_kv_one_shot(cache, k, v, torch.arange(24), backend="reference")
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(2, 2 * g, 16, generator=gen)
    return cache, q, tables, lens


def _both(cache, q, tables, lens, **kw):
    got = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="torch", **kw)
    want = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="reference", **kw)
    return got, want


def _assert_within_tolerance(got, want, cache, q, tables, lens, qsl=None):
    """The conformance kit's derived tolerance (fp8kv.testing.tolerance), not a picked one."""
    from fp8kv.testing import assert_attention_close, paged_attention_bounds

    assert_attention_close(got, want, **paged_attention_bounds(q, cache, tables, lens, qsl))


@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head"])
def test_float32_path_serves_plain_steps(pytorch_path, monkeypatch, granularity):
    """Decode and chunked prefill without soft-cap, with and without the log-sum-exp, take the
    float32 path: the float64 path is never entered, and output and lse are the reference's
    within the kit's derived tolerances."""
    from fp8kv_torch import attention

    from fp8kv.testing import paged_attention_bounds

    monkeypatch.setattr(attention, "_attend_float64", lambda *a: pytest.fail("took the float64 path"))
    cache, q, tables, lens = _decode_case(granularity if granularity != "head" else "tensor")
    if granularity == "head":
        cache = fp8kv.KVCache.allocate(8, 4, 2, 16, kv_dtype="fp8_e4m3", scale_granularity="head",
                                       k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor([3.0, 0.25]))
        gen = torch.Generator().manual_seed(5)
        fp8kv.write_kv_one_shot(cache, *(torch.randn(24, 2, 16, generator=gen) for _ in range(2)), torch.arange(24),
                       backend="reference")
    got, want = _both(cache, q, tables, lens)
    _assert_within_tolerance(got, want, cache, q, tables, lens)
    qp = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(4))  # prefill: 4 + 3 new tokens
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    got, want = _both(cache, qp, tables, lens, query_start_loc=qsl, max_query_len=4)
    _assert_within_tolerance(got, want, cache, qp, tables, lens, qsl)
    from fp8kv.testing.tolerance import assert_lse_close

    for qq, kw in ((q, {}), (qp, {"query_start_loc": qsl, "max_query_len": 4})):  # with the log-sum-exp
        (got, lse), (want, ref_lse) = _both(cache, qq, tables, lens, return_lse=True, **kw)
        _assert_within_tolerance(got, want, cache, qq, tables, lens, kw.get("query_start_loc"))
        assert_lse_close(lse, ref_lse, **paged_attention_bounds(qq, cache, tables, lens, kw.get("query_start_loc")))


def test_float32_overflow_falls_back_to_float64(pytorch_path):
    """A K scale near the float32 limit overflows float32 logits; the result is still the
    reference's (finite, from float64), not inf or NaN."""
    cache, q, tables, lens = _decode_case(k_scale=1e36)
    got, want = _both(cache, q, tables, lens)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    _assert_within_tolerance(got, want, cache, q, tables, lens)


def test_float32_path_nan_and_keyless_rows_match_the_reference(pytorch_path):
    """A NaN code at a visible key gives that sequence NaN as the reference does; a sequence
    with no visible key (a length of 0 with host checks off) gives 0 (both through the float64 path)."""
    cache, q, tables, lens = _decode_case()
    cache.key_cache.view(torch.uint8)[0, 2, 0, 3] = 0x7F  # NaN in sequence 0's key 2, head 0
    got, want = _both(cache, q, tables, lens)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0, :2]).all()
    _assert_within_tolerance(got, want, cache, q, tables, lens)  # NaN where the reference is NaN passes
    lens = torch.tensor([6, 0], dtype=torch.int32)
    got, want = _both(cache, q, tables, lens, validate=False)  # host checks off
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    _assert_within_tolerance(got, want, cache, q, tables, lens)


def test_float32_path_ignores_nan_bytes_past_a_sequence_end(pytorch_path, monkeypatch):
    """Bytes past a shorter sequence's end (in its own last block) are never read as keys: NaN
    codes and an infinite scale there neither reach the output nor push the step to float64."""
    from fp8kv_torch import attention

    monkeypatch.setattr(attention, "_attend_float64", lambda *a: pytest.fail("took the float64 path"))
    cache, q, tables, lens = _decode_case(scale_granularity="token_head", seq_lens=(9, 5))
    # sequence 1 owns blocks 3, 4, 5 (block size 4): its length 5 ends at block 4, offset 0
    cache.key_cache.view(torch.uint8)[4, 1:] = 0x7F
    cache.value_cache.view(torch.uint8)[4, 1:] = 0xFF
    cache.k_scale[4, 2:] = float("inf")
    got, want = _both(cache, q, tables, lens)
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    _assert_within_tolerance(got, want, cache, q, tables, lens)


@pytest.mark.parametrize("granularity", ["tensor", "token_head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("storage", ["pair", "separate", "vllm"])
def test_k_and_v_as_one_tensor_or_two_give_the_same_bytes_and_outputs(storage, layout, granularity, monkeypatch,
                                                                     path):
    """allocate() puts K and V (and token_head scales) in one storage, which this backend gathers
    and scatters as a pair (kv_pair / scale_pair); separate tensors and a vLLM-style
    [num_blocks, 2, ...] tensor (a pair whose blocks and offsets do not merge) take the per-tensor
    path. Every path writes the reference's bytes and attends within the kit's tolerance."""
    nb, bs, H, D = 6, 4, 2, 16
    shape = (nb, bs, H, D) if layout == "NHD" else (nb, H, bs, D)
    ref = fp8kv.KVCache.allocate(nb, bs, H, D, layout=layout, scale_granularity=granularity)
    if storage == "pair":
        cache = fp8kv.KVCache.allocate(nb, bs, H, D, layout=layout, scale_granularity=granularity)
        assert cache.kv_pair is not None and (cache.scale_pair is not None) == (granularity == "token_head")
    elif storage == "separate":
        cache = fp8kv.KVCache.from_tensors(torch.zeros(shape, dtype=torch.float8_e4m3fn),
                                           torch.zeros(shape, dtype=torch.float8_e4m3fn), layout=layout,
                                           scale_granularity=granularity)
        assert cache.kv_pair is None and cache.scale_pair is None
    else:
        both = torch.zeros((nb, 2, *shape[1:]), dtype=torch.float8_e4m3fn)
        cache = fp8kv.KVCache.from_tensors(both, layout=layout, scale_granularity=granularity, kv_dim=1)
        assert cache.kv_pair is not None  # a pair, but block and offset strides do not merge
    if storage == "pair" and layout == "NHD":  # the pair path only: the per-tensor one would fail
        from fp8kv_torch import attention, write

        monkeypatch.setattr(write, "_scatter", lambda *a, **k: pytest.fail("scattered K and V one by one"))
        monkeypatch.setattr(attention, "_codes", lambda *a, **k: pytest.fail("gathered K and V one by one"))
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(20, H, D, generator=gen) * 3 for _ in range(2))
    slots = torch.tensor([*range(17), -1, 23, 21])  # a padding slot, the last block
    fp8kv.write_kv_one_shot(cache, k, v, slots, backend="torch")
    fp8kv.write_kv_one_shot(ref, k, v, slots, backend="reference")
    for a, b in ((cache.key_cache, ref.key_cache), (cache.value_cache, ref.value_cache)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if granularity == "token_head":
        assert torch.equal(cache.k_scale, ref.k_scale) and torch.equal(cache.v_scale, ref.v_scale)
    q = torch.randn(2, 4, D, generator=gen)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([23, 9], dtype=torch.int32)
    got = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="torch")
    want = fp8kv.paged_attention_one_shot(q, ref, tables, lens, backend="reference")
    _assert_within_tolerance(got, want, ref, q, tables, lens)


def test_paired_refuses_what_is_not_one_storage_at_a_constant_distance():
    from fp8kv.cache import paired

    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    assert paired(a, b) is None  # two allocations
    t = torch.arange(24.0).view(2, 4, 3)
    assert torch.equal(paired(t[0], t[1]), t)
    assert paired(t[1], t[0]) is None  # V before K
    assert paired(t[0], t[1].t().contiguous().t()) is None  # other strides
    assert paired(t[0, :2], t[1]) is None  # other shapes


@pytest.fixture
def native_only(monkeypatch):
    """The C loops, and a failure if a decode step leaves them for the PyTorch paths."""
    from fp8kv_torch import attention, native

    monkeypatch.setenv("FP8KV_TORCH_NATIVE", "1")
    if native.library() is None:
        pytest.skip(f"the torch backend's C loops: {native.status()}")
    for name in ("_attend_float32", "_attend_float64"):
        monkeypatch.setattr(attention, name, lambda *a, name=name: pytest.fail(f"left the C loop for {name}"))


@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_native_decode_is_the_reference_within_tolerance(native_only, granularity, layout, query_dtype, window):
    """Decode through the C loop: every granularity and layout, GQA, a sliding window, narrow
    queries, output and log-sum-exp within the kit's derived tolerances; an absent block (-1) in
    a table is skipped, a length of 0 gives 0 and lse -inf, as in the reference."""
    from fp8kv.testing import assert_attention_close, paged_attention_bounds
    from fp8kv.testing.tolerance import assert_lse_close

    nb, bs, H, D, Hq = 7, 4, 2, 32, 6
    kw = {"k_scale": torch.tensor([0.5, 2.0]), "v_scale": torch.tensor([3.0, 0.25])} if granularity == "head" else \
        {"k_scale": 0.75, "v_scale": 1.5} if granularity == "tensor" else {}
    cache = fp8kv.KVCache.allocate(nb, bs, H, D, layout=layout, scale_granularity=granularity, **kw)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(nb * bs, H, D, generator=gen) * 2 for _ in range(2))
    fp8kv.write_kv_one_shot(cache, k, v, torch.arange(nb * bs), backend="reference")
    tables = torch.tensor([[0, 1, 2, 3], [6, 5, -1, 4], [3, 2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([14, 16, 0], dtype=torch.int32)
    q = torch.randn(3, Hq, D, generator=gen).to(query_dtype)
    opts = {"sliding_window": window, "validate": False}
    got, lse = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="torch", return_lse=True, **opts)
    want, ref_lse = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="reference", return_lse=True, **opts)
    bounds = paged_attention_bounds(q, cache, tables, lens, sliding_window=window)
    assert_attention_close(got, want, **bounds)
    assert_lse_close(lse, ref_lse, **bounds)
    assert torch.equal(got[2], torch.zeros_like(got[2])) and torch.isneginf(lse[2]).all()


def test_native_decode_falls_back_where_float32_is_not_enough(monkeypatch):
    """A NaN code at a visible key, and a K scale that overflows float32 logits, leave the C
    loop's result for the float64 path: NaN where the reference has NaN, finite elsewhere."""
    from fp8kv_torch import attention, native

    monkeypatch.setenv("FP8KV_TORCH_NATIVE", "1")
    if native.library() is None:
        pytest.skip(f"the torch backend's C loops: {native.status()}")
    calls = []
    real = attention._attend_native
    monkeypatch.setattr(attention, "_attend_native", lambda *a: calls.append(r := real(*a)) or r)
    cache, q, tables, lens = _decode_case()
    cache.key_cache.view(torch.uint8)[0, 2, 0, 3] = 0x7F  # NaN in sequence 0's key 2, head 0
    got, want = _both(cache, q, tables, lens)
    assert calls == [False] and torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0, :2]).all()
    for k_scale, falls_back in ((1e35, False), (3e38, True)):  # logits near 7e37, and past the float32 max
        calls.clear()
        cache, q, tables, lens = _decode_case(k_scale=k_scale)
        cache.key_cache.view(torch.uint8)[:, :, :, :8] = 0x7E  # 448: q.k in the hundreds, times 3e38 / 4
        got, want = _both(cache, q.abs(), tables, lens)
        assert calls == [not falls_back] and torch.isfinite(got).all()
        _assert_within_tolerance(got, want, cache, q.abs(), tables, lens)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_extreme_values_bit_exactly(path, kv_dtype, granularity, dtype):
    """NaN of both signs, infinities, the float32 extremes, subnormals, signed zeros, the format's
    max and values just past it, and rows of only NaN or only zeros: the reference's bytes and
    scales on both paths (the C loop's scaling and clamping, PyTorch's)."""
    H, D = 2, 16
    f32max = torch.finfo(torch.float32).max
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), f32max, -f32max, 1e-45,
                            -1e-45, 1e-40, 0.0, -0.0, 448.0, 449.0, 57344.0, 61440.0, 240.0, 0.001953125, 3.0])
    gen = torch.Generator().manual_seed(7)
    rows = [special[torch.randint(0, len(special), (H, D), generator=gen)] for _ in range(6)]
    rows += [torch.full((H, D), float("nan")), torch.zeros(H, D), torch.randn(H, D, generator=gen) * 1e3]
    k = torch.stack(rows).to(dtype)
    v = k.flip(0).clone()
    kw = {"k_scale": torch.tensor([0.5, 3.0]), "v_scale": torch.tensor([2.0, 0.125])} if granularity == "head" else \
        {"k_scale": 0.75, "v_scale": 1e-3} if granularity == "tensor" else {}
    caches = [fp8kv.KVCache.allocate(4, 4, H, D, kv_dtype=kv_dtype, scale_granularity=granularity, **kw)
              for _ in range(2)]
    slots = torch.tensor([3, 0, 7, -1, 12, 9, 15, 1, 4])
    fp8kv.write_kv_one_shot(caches[0], k, v, slots, backend="torch")
    fp8kv.write_kv_one_shot(caches[1], k, v, slots, backend="reference")
    got, want = caches
    for a, b in ((got.key_cache, want.key_cache), (got.value_cache, want.value_cache)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(got.k_scale, want.k_scale) and torch.equal(got.v_scale, want.v_scale)
