"""Plan once per step, run per layer: the metadata, its checks, in-place refills, LSE and merging.

Runs on the reference backend and on the Triton backend through its CPU interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp8kv
from fp8kv import settings
from fp8kv.errors import BackendFailure, Fp8KVError, InvalidArgument, PluginError, Unsupported
from fp8kv.testing.tolerance import assert_attention_close, assert_lse_close, paged_attention_bounds

H, GROUP, D, BS, NB = 2, 2, 16, 4, 12
BACKENDS = ("reference", "triton")


def filled_cache(seed=0, granularity="token_head", layout="NHD", num_blocks=NB) -> fp8kv.KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = fp8kv.KVCache.allocate(num_blocks, BS, H, D, scale_granularity=granularity, layout=layout)
    k, v = torch.randn(num_blocks * BS, H, D, generator=g), torch.randn(num_blocks * BS, H, D, generator=g)
    fp8kv.write_kv_one_shot(cache, k, v, torch.arange(num_blocks * BS), backend="reference")
    return cache


def step(seed=1, prefill=True):
    """Two sequences (lengths 7 and 5); prefill: 3 and 2 new tokens, else decode."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[3, 0, 7, 1], [5, 2, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 5], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32) if prefill else None
    T = 5 if prefill else 2
    query = torch.randn(T, H * GROUP, D, generator=g)
    return query, tables, lens, qsl


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefill", [False, True])
def test_plan_once_run_per_layer_equals_one_shot(backend, prefill):
    caches = [filled_cache(seed) for seed in range(3)]
    query, tables, lens, qsl = step(prefill=prefill)
    meta = fp8kv.plan_attention(caches[0], num_q_heads=H * GROUP, query_dtype=query.dtype, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl, backend=backend)
    assert meta.backend == backend and meta.num_tokens == query.shape[0]
    for cache in caches:  # one metadata, every layer
        got = fp8kv.paged_attention(query, cache, meta)
        want = fp8kv.paged_attention_one_shot(query, cache, tables, lens, query_start_loc=qsl, backend=backend)
        assert torch.equal(got, want)


def test_write_with_metadata_equals_write_with_slots():
    a, b = filled_cache(), filled_cache()
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
    slots = torch.tensor([13, -1, 40])
    query, tables, lens, _ = step(prefill=False)
    meta = fp8kv.plan_attention(a, num_q_heads=H * GROUP, query_dtype=k.dtype, block_tables=tables, seq_lens=lens,
                                slot_mapping=slots, backend="reference")
    fp8kv.write_kv(a, k, v, meta)
    fp8kv.write_kv_one_shot(b, k, v, slots, backend="reference")
    assert a.same_bytes(b)


def test_metadata_for_another_cache_spec_is_refused():
    query, tables, lens, qsl = step()
    meta = fp8kv.plan_attention(filled_cache(), num_q_heads=H * GROUP, query_dtype=query.dtype, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl)
    for other in (filled_cache(granularity="tensor"), filled_cache(layout="HND"), filled_cache(num_blocks=NB + 1)):
        before = other.clone()
        with pytest.raises(InvalidArgument, match="^cache: .*expected a cache like the one the metadata"):
            fp8kv.paged_attention(query, other, meta)
        with pytest.raises(InvalidArgument, match="^cache:"):
            fp8kv.write_kv(other, query[:, :H], query[:, :H], meta)
        assert other.same_bytes(before)


@pytest.mark.parametrize("change,argname", [
    (lambda q: q[:-1], "query"), (lambda q: q.to(torch.float16), "query"), (lambda q: q[:, :H], "query"),
])
def test_per_layer_checks_name_the_argument(change, argname):
    cache = filled_cache()
    query, tables, lens, qsl = step()
    meta = fp8kv.plan_attention(cache, num_q_heads=H * GROUP, query_dtype=query.dtype, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl)
    with pytest.raises(InvalidArgument, match=f"^{argname}:"):
        fp8kv.paged_attention(change(query), cache, meta)
    with pytest.raises(TypeError):  # one signature: the metadata carries the step, nothing beside it
        fp8kv.paged_attention(query, cache, meta, lens)
    with pytest.raises(InvalidArgument, match="^block_tables: got AttentionMetadata"):
        fp8kv.paged_attention_one_shot(query, cache, meta, lens)
    with pytest.raises(InvalidArgument, match="^metadata: .*planned without slot_mapping"):
        fp8kv.write_kv(cache, query[:, :H], query[:, :H], meta)


def test_plan_rejects_bad_values_once_and_names_them():
    cache = filled_cache()
    query, tables, lens, qsl = step()
    kw = dict(num_q_heads=H * GROUP, query_dtype=query.dtype, query_start_loc=qsl)
    bad_tables = tables.clone()
    bad_tables[0, 1] = NB
    cases = [
        (dict(block_tables=bad_tables, seq_lens=lens), "^block_tables: got block 12"),
        (dict(block_tables=tables, seq_lens=torch.tensor([17, 5], dtype=torch.int32)), "^seq_lens: got 17"),
        (dict(block_tables=tables, seq_lens=lens, max_query_len=2), "^max_query_len: got 2"),
        (dict(block_tables=tables, seq_lens=lens, num_tokens=6), "^query_start_loc:"),
        (dict(block_tables=tables, seq_lens=lens, slot_mapping=torch.tensor([1, 1])), "^slot_mapping: got slot 1 more"),
        (dict(block_tables=tables, seq_lens=lens, slot_mapping=torch.tensor([NB * BS])), "^slot_mapping: got slot 48"),
        (dict(block_tables=tables, seq_lens=lens, sliding_window=4, window_left=3), "^window_left:"),
        (dict(block_tables=tables, seq_lens=lens, softmax_scale=1e300), "^softmax_scale:"),
        (dict(block_tables=tables, seq_lens=lens, logits_soft_cap=float("inf")), "^logits_soft_cap:"),
        (dict(block_tables=tables), "^block_tables/seq_lens:"),
        (dict(block_tables=tables, seq_lens=lens, kv_indptr=torch.tensor([0, 1, 2])), "^block_tables/seq_lens:"),
    ]
    for extra, pattern in cases:
        with pytest.raises(InvalidArgument, match=pattern):
            fp8kv.plan_attention(cache, **{**kw, **extra})
    with pytest.raises(InvalidArgument, match="^num_q_heads:"):
        fp8kv.plan_attention(cache, **{**kw, "num_q_heads": 3}, block_tables=tables, seq_lens=lens)
    with pytest.raises(InvalidArgument, match="^query_dtype:"):
        fp8kv.plan_attention(cache, **{**kw, "query_dtype": torch.float64}, block_tables=tables, seq_lens=lens)


def test_validate_false_reads_no_values():
    """``validate=False`` (or ``FP8KV_CHECK=shapes``) skips every value check: nothing is read."""
    cache = filled_cache()
    query, tables, lens, qsl = step()
    bad_tables = tables.clone()
    bad_tables[0, 1] = NB
    meta = fp8kv.plan_attention(cache, num_q_heads=H * GROUP, query_dtype=query.dtype, block_tables=bad_tables,
                                seq_lens=lens, query_start_loc=qsl, max_query_len=3, num_tokens=5,
                                validate=False)
    assert meta.max_query_len == 3 and meta.max_seq_len == tables.shape[1] * BS  # bound, not read
    assert meta.host_seq_lens is None


def test_update_refills_in_place_and_checks_like_plan():
    cache = filled_cache()
    query, tables, lens, qsl = step()
    meta = fp8kv.plan_attention(cache, num_q_heads=H * GROUP, query_dtype=query.dtype, block_tables=tables,
                                seq_lens=lens, query_start_loc=qsl, max_seq_len=16, backend="triton")
    buffers = [t.data_ptr() for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)]
    tables2 = torch.tensor([[1, 4, 6, 9], [8, 10, 0, 0]], dtype=torch.int64)
    lens2 = torch.tensor([6, 8], dtype=torch.int64)
    qsl2 = torch.tensor([0, 2, 5], dtype=torch.int64)
    meta.update(block_tables=tables2, seq_lens=lens2, query_start_loc=qsl2)
    assert [t.data_ptr() for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)] == buffers
    fresh = fp8kv.paged_attention_one_shot(query, cache, tables2, lens2, query_start_loc=qsl2, backend="triton")
    assert torch.equal(fp8kv.paged_attention(query, cache, meta), fresh)
    with pytest.raises(InvalidArgument, match="^max_query_len:"):  # longer than planned
        meta.update(block_tables=tables2, seq_lens=lens2, query_start_loc=torch.tensor([0, 4, 5]))
    with pytest.raises(InvalidArgument, match="^block_tables:"):  # another shape
        meta.update(block_tables=tables2[:, :3], seq_lens=lens2, query_start_loc=qsl2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merging_two_caches_equals_one_cache(backend):
    """Cascade attention: a sequence's first keys in one cache (seen by every query, non-causal),
    the rest in another (causal); merging the two partial results by their LSE gives the
    one-cache result within the derived tolerance."""
    g = torch.Generator().manual_seed(7)
    L, prefix, q_len = 23, 9, 4
    k, v = torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)
    query = torch.randn(q_len, H * GROUP, D, generator=g)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)

    def cache_of(keys, values):
        c = fp8kv.KVCache.allocate(8, BS, H, D, scale_granularity="token_head")
        fp8kv.write_kv_one_shot(c, keys, values, torch.arange(keys.shape[0]), backend="reference")
        return c

    whole, head, tail = cache_of(k, v), cache_of(k[:prefix], v[:prefix]), cache_of(k[prefix:], v[prefix:])
    table = torch.arange(8, dtype=torch.int32)[None]
    one, one_lse = fp8kv.paged_attention_one_shot(query, whole, table, torch.tensor([L], dtype=torch.int32),
                                         query_start_loc=qsl, return_lse=True, backend=backend)
    a, lse_a = fp8kv.paged_attention_one_shot(query, head, table, torch.tensor([prefix], dtype=torch.int32),
                                     query_start_loc=qsl, causal=False, return_lse=True, backend=backend)
    b, lse_b = fp8kv.paged_attention_one_shot(query, tail, table, torch.tensor([L - prefix], dtype=torch.int32),
                                     query_start_loc=qsl, return_lse=True, backend=backend)
    merged, merged_lse = fp8kv.merge_attention_states(a, lse_a, b, lse_b)
    bounds = paged_attention_bounds(query, whole, table, torch.tensor([L], dtype=torch.int32), qsl)
    # the merge adds a few float32 roundings per element: the tolerance's split-KV term covers them
    assert_attention_close(merged, one, **bounds, context=f"{backend}: ")
    assert_lse_close(merged_lse, one_lse, **bounds, context=f"{backend}: ")


def test_merge_handles_rows_without_keys():
    out = torch.ones(1, 2, 4)
    lse = torch.tensor([[0.5, float("-inf")]])
    none = torch.full((1, 2), float("-inf"))
    merged, m_lse = fp8kv.merge_attention_states(out, lse, torch.zeros_like(out), none)
    assert torch.equal(merged[0, 0], out[0, 0]) and float(m_lse[0, 0]) == 0.5
    assert torch.equal(merged[0, 1], torch.zeros(4)) and m_lse[0, 1] == float("-inf")
    with pytest.raises(InvalidArgument, match="^lse_b:"):
        fp8kv.merge_attention_states(out, lse, out, lse.double())


def test_error_hierarchy():
    for cls in (InvalidArgument, Unsupported, BackendFailure, PluginError):
        assert issubclass(cls, Fp8KVError) and issubclass(cls, ValueError)
    assert issubclass(BackendFailure, RuntimeError)
    cache = filled_cache()
    query, tables, lens, _ = step(prefill=False)
    with pytest.raises(InvalidArgument, match="^backend: got 'nope'"):
        fp8kv.paged_attention_one_shot(query, cache, tables, lens, backend="nope")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(Unsupported, match="backend 'triton' cannot serve .*interpreter"):
            fp8kv.plan_attention(cache, num_q_heads=H * GROUP, query_dtype=query.dtype, block_tables=tables,
                                 seq_lens=lens, backend="triton")


def test_settings_are_typed_and_name_the_variable(monkeypatch):
    monkeypatch.setenv("FP8KV_CHECK", "sometimes")
    with pytest.raises(InvalidArgument, match="^FP8KV_CHECK: got 'sometimes'"):
        settings.check_values()
    monkeypatch.setenv("FP8KV_STRICT", "maybe")
    with pytest.raises(InvalidArgument, match="^FP8KV_STRICT:"):
        settings.strict()
    monkeypatch.setenv("FP8KV_BACKEND", "auto")
    assert settings.forced_backend() is None
    assert set(settings.VARIABLES) >= {"FP8KV_BACKEND", "FP8KV_STRICT", "FP8KV_CHECK", "FP8KV_SIMULATE_DEVICE",
                                       "FP8KV_TRITON_CODEC"}


def test_only_settings_reads_the_environment():
    """Every environment variable is read in fp8kv/settings.py, nowhere else in the package."""
    import pathlib

    root = pathlib.Path(fp8kv.__file__).parent
    backends = root.parent / "backends"
    offenders = [str(p) for base in (root, backends) for p in base.rglob("*.py")
                 if p.name != "settings.py" and "os.environ" in p.read_text()]
    assert not offenders, offenders


def test_cache_and_metadata_options_are_frozen():
    cache = filled_cache()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.k_scale = torch.ones(())
    opts = fp8kv.AttentionOptions.build(D)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.causal = False
