"""Targeted pins for argument checks and kernel masks that only the randomized kits reached.

Each test here fails when one specific check or mask is removed or relaxed by one (a slot
bound, a block-id bound, a refusal), so that such a change is caught by a fast, named test and
not only by the Hypothesis conformance kit or the fuzzer. CPU only; Triton through its
interpreter (tiny shapes).
"""

from __future__ import annotations

import pytest
import test_memory_safety as memory_safety
import torch
from test_torch_backend import path  # noqa: F401 (a fixture: each test with the C loops and with PyTorch only)

from fp8kv import InvalidArgument, KVCache, paged_attention
from fp8kv.formats import FORMATS
from fp8kv.registry import available_backends

needs_torch_backend = pytest.mark.skipif("torch" not in available_backends(),
                                         reason="the torch backend is not installed")


# ------------------------------------------------------------------ torch backend, checks off


@needs_torch_backend
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("gran,layout", [("tensor", "NHD"), ("token_head", "HND")])
def test_torch_backend_write_skips_slots_outside_the_cache(gran, layout, monkeypatch):
    """Value checks off: slots ``num_slots``, ``num_slots + 5``, ``2^40`` and every negative one are
    skipped by the torch backend (C loops and PyTorch), the valid ones written as a clean write of
    just them, no guard byte around the cache changed."""
    memory_safety.test_out_of_range_slots_are_not_written("cpu", "torch", gran, layout, torch.int64, "metadata",
                                                          monkeypatch)


@needs_torch_backend
@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("case", ["block_ids", "everything", "query_start_loc"])
def test_torch_backend_masks_hostile_metadata_like_the_oracle(case):
    """Value checks off: block ids negative or ``>= num_blocks`` are masked out, lengths clamped to
    the table, query offsets clamped, on the torch backend's decode (C loop) and prefill paths:
    guard bytes intact and defined rows equal to the float64 oracle."""
    memory_safety.test_hostile_metadata_stays_in_bounds("cpu", "torch", case, "token_head")


# ------------------------------------------------------------------ API refusals


def _small_step():
    """A filled 4-block cache (block_size 4, 2 KV heads, head size 16), a 2-sequence decode step."""
    import fp8kv

    cache = fp8kv.KVCache.allocate(4, 4, 2, 16, kv_dtype="fp8_e4m3")
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(16, 2, 16, generator=gen) for _ in range(2))
    fp8kv.write_kv_one_shot(cache, k, v, torch.arange(16), backend="reference")
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    query = torch.randn(2, 4, 16, generator=gen)
    return cache, query, tables, lens


@pytest.mark.parametrize("name,value", [("num_q_heads", 4), ("query_dtype", torch.float32), ("num_tokens", 2),
                                        ("slot_mapping", torch.tensor([0, 1]))])
def test_one_shot_attention_refuses_keywords_the_call_gives(name, value):
    """``paged_attention_one_shot`` takes the query's heads, dtype and tokens from the query and
    writes nothing: passing one of them (or ``slot_mapping``) is refused by name, not accepted
    silently or turned into a TypeError."""
    import fp8kv

    cache, query, tables, lens = _small_step()
    with pytest.raises(fp8kv.InvalidArgument, match=name):
        fp8kv.paged_attention_one_shot(query, cache, tables, lens, backend="reference", **{name: value})


@pytest.mark.parametrize("bad_query", ["another_device", "another_head_size"])
def test_one_shot_attention_names_a_wrong_query_before_later_arguments(bad_query):
    """The one-shot call checks its arguments in signature order: a query on another device than
    the cache, or of another head size, is named even when ``block_tables`` (a later argument) is
    wrong too (the planned path's own query check would only name it after the page table)."""
    import fp8kv

    cache, query, tables, lens = _small_step()
    query = query.to("meta") if bad_query == "another_device" else torch.randn(2, 4, 17)
    with pytest.raises(fp8kv.InvalidArgument, match=r"^query\b.*(device|head size)"):
        fp8kv.paged_attention_one_shot(query, cache, tables.float(), lens, backend="reference")


def test_one_shot_attention_points_a_metadata_given_as_block_tables_to_paged_attention():
    """A planned metadata passed where the one-shot call wants ``block_tables`` is refused with
    the pointer to ``fp8kv.paged_attention(query, cache, metadata)``."""
    import fp8kv

    cache, query, tables, lens = _small_step()
    meta = fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, block_tables=tables, seq_lens=lens,
                                backend="reference")
    with pytest.raises(fp8kv.InvalidArgument, match=r"^block_tables\b.*paged_attention\(query, cache, metadata\)"):
        fp8kv.paged_attention_one_shot(query, cache, meta, lens, backend="reference")


@pytest.mark.parametrize("planned", [False, True])
def test_attention_refuses_an_out_that_requires_grad(planned):
    """``out`` with autograd history is refused by name (not a RuntimeError from an in-place write
    into a leaf), on the planned and the one-shot path; ``out`` keeps its values."""
    import fp8kv

    cache, query, tables, lens = _small_step()
    out = torch.full(query.shape, 7.0, requires_grad=True)
    with pytest.raises(fp8kv.InvalidArgument, match=r"^out\b.*grad"):
        if planned:
            meta = fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, block_tables=tables,
                                        seq_lens=lens, backend="reference")
            fp8kv.paged_attention(query, cache, meta, out=out)
        else:
            fp8kv.paged_attention_one_shot(query, cache, tables, lens, out=out, backend="reference")
    assert (out.detach() == 7.0).all()


def test_one_shot_attention_names_block_tables_rows_before_the_query_count():
    """Counts come after each argument's own checks, ``block_tables`` rows against ``seq_lens``
    first: a table of 3 rows for 2 lengths is named even when the query's 3 tokens would not
    match the 2 sequences either."""
    import fp8kv

    cache, _, tables, lens = _small_step()
    query = torch.randn(3, 4, 16)
    three_rows = torch.cat([tables, tables[:1]])
    with pytest.raises(fp8kv.InvalidArgument, match=r"^block_tables\b.*3 rows"):
        fp8kv.paged_attention_one_shot(query, cache, three_rows, lens, backend="reference")


@pytest.mark.parametrize("alias", ["same_tensor", "overlapping_view"])
def test_attention_refuses_an_out_sharing_memory_with_the_query(alias):
    """``out`` may not share bytes with ``query`` (a backend writing rows would read overwritten
    queries): refused by name, the query unchanged."""
    import fp8kv

    cache, query, tables, lens = _small_step()
    buf = torch.cat([query, query[:1]])  # [3, Hq, D]
    query = buf[:2]
    before = query.clone()
    out = query if alias == "same_tensor" else buf[1:]
    with pytest.raises(fp8kv.InvalidArgument, match=r"^out\b.*sharing memory with query"):
        fp8kv.paged_attention_one_shot(query, cache, tables, lens, out=out, backend="reference")
    assert torch.equal(query, before)


def _fp8_step():
    """``(cache, query, metadata)``: :func:`_small_step` planned with ``fp8_attention=True``."""
    import fp8kv

    cache, query, tables, lens = _small_step()
    meta = fp8kv.plan_attention(cache, num_q_heads=4, query_dtype=torch.float32, block_tables=tables, seq_lens=lens,
                                fp8_attention=True, backend="reference")
    return cache, query, meta


@pytest.mark.parametrize("layer_scales", [
    pytest.param({"k_scale": torch.ones(())}, id="unknown_key"),
    pytest.param({"q_scale": torch.ones((), dtype=torch.float64)}, id="q_scale_float64"),
    pytest.param({"q_scale": torch.ones((), device="meta")}, id="q_scale_on_another_device"),
    pytest.param({"q_scale": torch.ones(3)}, id="q_scale_shape"),
    pytest.param({"prob_scale": 2.0**-127}, id="prob_scale_below_float32_normals"),
])
def test_layer_scales_refuses_what_the_mode_cannot_use(layer_scales):
    """A layer's ``layer_scales`` take only the keys q_scale/prob_scale, a float32 q_scale of shape
    [], [H] or [Hq] on the cache's device, and a prob_scale in [2^-126, float32 max]."""
    import fp8kv

    cache, query, meta = _fp8_step()
    with pytest.raises(fp8kv.InvalidArgument, match="^layer_scales"):
        fp8kv.paged_attention(query, cache, meta, layer_scales=layer_scales)


def _merge_inputs():
    """Two partial results ``(out_a, lse_a, out_b, lse_b)`` of 3 tokens, 4 query heads, head size 8."""
    gen = torch.Generator().manual_seed(5)
    out_a, out_b = (torch.randn(3, 4, 8, generator=gen) for _ in range(2))
    lse_a, lse_b = (torch.randn(3, 4, generator=gen) for _ in range(2))
    return dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


@pytest.mark.parametrize("name,bad", [
    pytest.param("out_a", lambda t: t.flatten(1), id="out_a_2d"),
    pytest.param("lse_b", lambda t: t[..., None], id="lse_b_3d"),
    pytest.param("out_b", lambda t: t.to(torch.float16), id="out_b_another_dtype"),
    pytest.param("out_b", lambda t: t.to("meta"), id="out_b_another_device"),
    pytest.param("lse_a", lambda t: t.to("meta"), id="lse_a_another_device"),
])
def test_merge_attention_states_names_the_wrong_partial(name, bad):
    """``merge_attention_states`` refuses, by name, a partial of the wrong rank, an ``out_b`` of
    another dtype than ``out_a``, and any tensor on another device than ``out_a``."""
    import fp8kv

    args = _merge_inputs()
    args[name] = bad(args[name])
    with pytest.raises(fp8kv.InvalidArgument, match=rf"^{name}\b"):
        fp8kv.merge_attention_states(args["out_a"], args["lse_a"], args["out_b"], args["lse_b"])


# ------------------------------------------------------------------ cache construction


def test_from_tensors_refuses_a_head_size_dimension_with_a_stride_other_than_one():
    """K/V whose last (head_size) dimension is strided (every other byte of a wider tensor, no
    overlap) are refused by name: the kernels address a row's D codes as contiguous bytes."""
    import fp8kv

    wide = torch.zeros(2, 4, 4, 2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(fp8kv.InvalidArgument, match=r"^key_cache\b.*stride"):
        fp8kv.KVCache.from_tensors(wide[0, ..., ::2], wide[1, ..., ::2])


def test_from_tensors_refuses_heads_that_overlap_by_one_byte():
    """K whose head stride is ``head_size - 1`` (each head's last code is the next head's first)
    is refused by name: a write to one head would change another."""
    import fp8kv

    nb, bs, H, D = 2, 4, 2, 16
    base = torch.zeros(nb * bs * H * D, dtype=torch.float8_e4m3fn)
    k = base.as_strided((nb, bs, H, D), (bs * H * D, H * D, D - 1, 1))
    v = torch.zeros(nb, bs, H, D, dtype=torch.float8_e4m3fn)
    with pytest.raises(fp8kv.InvalidArgument, match=r"^key_cache\b.*non-overlapping"):
        fp8kv.KVCache.from_tensors(k, v)


def test_from_tensors_refuses_token_head_scales_that_overlap():
    """token_head scales are written per slot: an expanded (stride 0) scale tensor, every slot's
    scale one float, is refused by name."""
    import fp8kv

    k = torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn)
    shared = torch.ones(1, 1, 1).expand(2, 4, 2)
    with pytest.raises(fp8kv.InvalidArgument, match=r"^k_scale\b.*overlapping"):
        fp8kv.KVCache.from_tensors(k, k.clone(), scale_granularity="token_head", k_scale=shared)


@needs_torch_backend
def test_torch_backend_c_decode_masks_block_ids_and_lengths_itself(monkeypatch):
    """The C decode loop bounds itself (no NaN-triggered fallback to hide a wrong read): a block id
    equal to num_blocks and a length past the block table, next to blocks of finite codes, give
    the reference's output, with the PyTorch paths forbidden."""
    from fp8kv_torch import attention, native

    import fp8kv

    monkeypatch.setenv("FP8KV_TORCH_NATIVE", "1")
    if native.library() is None:
        pytest.skip(f"the torch backend's C loops: {native.status()}")
    for name in ("_attend_float32", "_attend_float64"):
        monkeypatch.setattr(attention, name, lambda *a, name=name: pytest.fail(f"left the C loop for {name}"))
    nb, bs, H, D, Hq = 4, 4, 2, 16, 4
    gen = torch.Generator().manual_seed(7)
    parents = [(torch.rand(nb + 2, bs, H, D, generator=gen) * 4 - 2).to(torch.float8_e4m3fn) for _ in range(2)]
    cache = fp8kv.KVCache.from_tensors(parents[0][1:nb + 1], parents[1][1:nb + 1], k_scale=0.5, v_scale=0.25)
    tables = torch.tensor([[0, nb], [1, 2], [3, 0]], dtype=torch.int32)  # nb: past the cache; finite codes there
    lens = torch.tensor([8, 12, 8], dtype=torch.int32)  # 12 > 2 columns * block_size: clamped to 8
    q = torch.randn(3, Hq, D, generator=gen)
    got = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="torch", validate=False)
    want = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="reference", validate=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 sums of 8 keys: far below a wrong key


def test_the_cache_constructor_names_a_format_that_is_not_an_fp8_format():
    c = KVCache.allocate(2, 2, 1, 8)
    with pytest.raises(InvalidArgument, match="^fmt: got str"):
        KVCache(c.key_cache, c.value_cache, c.k_scale, c.v_scale, "fp8_e4m3", "NHD", "tensor")


def test_the_cache_constructor_names_codes_of_another_format():
    c = KVCache.allocate(2, 2, 1, 8, kv_dtype="fp8_e4m3")
    with pytest.raises(InvalidArgument, match=r"^key_cache: got dtype torch.float8_e4m3fn"):
        KVCache(c.key_cache, c.value_cache, c.k_scale, c.v_scale, FORMATS["fp8_e5m2"], "NHD", "tensor")


def test_the_cache_constructor_names_a_scale_that_is_not_a_tensor():
    c = KVCache.allocate(2, 2, 1, 8)
    with pytest.raises(InvalidArgument, match="^k_scale: got float"):
        KVCache(c.key_cache, c.value_cache, 1.0, c.v_scale, c.fmt, "NHD", "tensor")


def test_the_cache_constructor_names_a_scale_on_another_device():
    c = KVCache.allocate(2, 2, 1, 8)
    with pytest.raises(InvalidArgument, match="^v_scale: got torch.float32 of shape \\(\\) on meta"):
        KVCache(c.key_cache, c.value_cache, c.k_scale, torch.ones((), device="meta"), c.fmt, "NHD", "tensor")


def test_allocate_names_a_cache_past_2_to_the_59_elements():
    with pytest.raises(InvalidArgument, match="^num_blocks: .*fewer than 2\\^59 elements"):
        KVCache.allocate(2**59 // 128, 1, 1, 128, device="meta")


@pytest.mark.parametrize("key_cache", ["x", None, 3])
def test_from_tensors_names_a_key_cache_that_is_not_a_tensor(key_cache):
    with pytest.raises(InvalidArgument, match="^key_cache: got"):
        KVCache.from_tensors(key_cache)


def test_from_tensors_names_key_and_value_caches_of_the_wrong_rank():
    k = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(InvalidArgument, match="^key_cache: got shape \\(4, 8\\)"):
        KVCache.from_tensors(k, k.clone())


@pytest.mark.parametrize("metadata", [object(), None, {"block_tables": None}])
def test_attention_names_a_metadata_that_is_not_one(metadata):
    c = KVCache.allocate(2, 2, 1, 8)
    with pytest.raises(InvalidArgument, match="^metadata: got"):
        paged_attention(torch.zeros(1, 1, 8), c, metadata)
