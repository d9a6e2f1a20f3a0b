"""fp8kv's torch custom ops (:mod:`fp8kv.ops`) and ``torch.compile`` of a step through them.

What each test proves:

* the two ops have the documented schemas, mutation annotations included;
* ``torch.library.opcheck`` passes for both ops (schema and mutations, fake tensors, AOT
  dispatch with dynamic shapes, autograd registration) over tensor / head / token_head
  scales, NHD / HND, K/V views of one tensor, decode and chunked prefill, with and without
  ``lse``, window and soft cap; on the reference backend and on the Triton one through its
  interpreter; and opcheck does catch a write op that leaves a mutation undeclared;
* ``torch.compile(fullgraph=True)`` of a two-layer step (``write_kv`` then
  ``paged_attention``) has no graph break and leaves cache bytes, outputs and LSEs
  bit-identical to eager, with the ``eager``, ``aot_eager`` and ``inductor`` compilers; a
  growing ``max_seq_len`` costs one recompile, then none (``dynamic=True``: one compile);
* the eager API never goes through the ops (its host overhead is unchanged), bad input
  under compile still raises the named error, and the rebuilt cache / metadata inside the
  ops equal what the API validated and planned;
* the same self-check the H100 runs (:func:`fp8kv.ops.check_compile_on_device`) passes on
  the CPU with the Triton interpreter; on a CUDA device it runs for real (skipped here).

opcheck compares tensors with ``allclose``, which float8 lacks on the CPU, so its schema
check runs on uint8 views of the cache codes (the ops accept both); the fake-tensor check
also runs on the float8 tensors themselves, and the aot_eager compile test runs them through
AOT dispatch.
"""

import pytest
import torch
import torch._dynamo.testing
from torch._inductor.utils import run_and_get_code

import fp8kv
from fp8kv import ops
from fp8kv.reference import write_kv as reference_write_kv

H, HQ, D, BS, NB = 2, 4, 16, 4, 8
FAKE_ONLY = ("test_faketensor",)  # float8 codes: aot_eager runs them too (test_compiled_step_...)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cache(granularity: str = "tensor", layout: str = "NHD", *, views: bool = False) -> fp8kv.KVCache:
    if views:  # vLLM / FlashInfer: K and V are views of one [num_blocks, 2, ...] tensor
        shape = (NB, 2, BS, H, D) if layout == "NHD" else (NB, 2, H, BS, D)
        base = torch.zeros(shape, dtype=torch.float8_e4m3fn)
        return fp8kv.KVCache.from_tensors(base, kv_dim=1, layout=layout, scale_granularity=granularity,
                                          **({} if granularity == "token_head" else {"k_scale": 0.05,
                                                                                      "v_scale": 0.03}))
    scales = {"tensor": {"k_scale": 0.05, "v_scale": 0.03},
              "head": {"k_scale": torch.tensor([0.05, 0.07]), "v_scale": torch.tensor([0.03, 0.02])},
              "token_head": {}}[granularity]
    return fp8kv.KVCache.allocate(NB, BS, H, D, layout=layout, scale_granularity=granularity, **scales)


def _step_inputs(cache: fp8kv.KVCache, *, lens=(3, 6), q_lens=(1, 1), backend="reference", seed=0, **options):
    """(q, k, v, meta) of one step over two sequences (blocks 0-1 and 3-4 in reverse), history written."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[1, 0], [4, 3]], dtype=torch.int32)

    def slot(s, p):
        return int(tables[s, p // BS]) * BS + p % BS

    hist = [(s, p) for s, (n, ql) in enumerate(zip(lens, q_lens, strict=True)) for p in range(n - ql)]
    new = [(s, p) for s, (n, ql) in enumerate(zip(lens, q_lens, strict=True)) for p in range(n - ql, n)]
    hk = torch.randn(len(hist), H, D, generator=g).to(torch.bfloat16)
    fp8kv.write_kv_one_shot(cache, hk, hk * 0.5, torch.tensor([slot(*x) for x in hist], dtype=torch.int32),
                   backend="reference")
    decode = all(ql == 1 for ql in q_lens)
    qsl = None if decode else torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=tables,
                                seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=qsl,
                                slot_mapping=torch.tensor([slot(*x) for x in new], dtype=torch.int32),
                                backend=backend, **options)
    T = len(new)
    q, k, v = (torch.randn(T, h, D, generator=g).to(torch.bfloat16) for h in (HQ, H, H))
    return q, k, v, meta


def _write_args(cache, k, v, meta, codes=torch.uint8):
    kc, vc = (cache.key_cache, cache.value_cache) if codes is None else (cache.key_cache.view(codes),
                                                                         cache.value_cache.view(codes))
    return (kc, vc, cache.k_scale, cache.v_scale, k, v, meta.slot_mapping, cache.kv_dtype, cache.layout,
            cache.scale_granularity, meta.write.backend.name)


def _attention_args(cache, q, meta, lse: bool, codes=torch.uint8):
    kc, vc = (cache.key_cache, cache.value_cache) if codes is None else (cache.key_cache.view(codes),
                                                                         cache.value_cache.view(codes))
    o = meta.options
    return (q, kc, vc, cache.k_scale, cache.v_scale, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            torch.empty_like(q), torch.empty(q.shape[:2]) if lse else None, cache.kv_dtype, cache.layout,
            cache.scale_granularity, meta.max_query_len, meta.max_seq_len, meta.is_decode, o.softmax_scale,
            o.causal, o.sliding_window, o.logits_soft_cap, meta.backend)


def _copy(cache: fp8kv.KVCache, granularity: str, layout: str, views: bool) -> fp8kv.KVCache:
    """A copy with the same structure (K/V views of one tensor stay so) and the same bytes."""
    new = _cache(granularity, layout, views=views).copy_(cache)
    assert new.same_bytes(cache)
    return new


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def step(q, k, v, caches, meta):
    """A decode step of a 2-layer model, as far as fp8kv is concerned."""
    outs = []
    for cache in caches:
        fp8kv.write_kv(cache, k, v, meta)
        out, lse = fp8kv.paged_attention(q, cache, meta, return_lse=True)
        outs += [out, lse]
    return outs


# ------------------------------------------------------------------------------ schemas
def test_schemas():
    assert str(ops.write_kv_op._schema) == ops.WRITE_KV_SCHEMA == (
        "fp8kv::write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, "
        "Tensor key, Tensor value, Tensor slot_mapping, str kv_dtype, str layout, str scale_granularity, "
        "str backend) -> ()")
    assert str(ops.paged_attention_op._schema) == ops.PAGED_ATTENTION_SCHEMA == (
        "fp8kv::paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor k_scale, Tensor v_scale, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor(a!) out, Tensor(b!)? lse, "
        "str kv_dtype, str layout, str scale_granularity, SymInt max_query_len, SymInt max_seq_len, bool is_decode, "
        "float softmax_scale, bool causal, SymInt? sliding_window, float? logits_soft_cap, str backend) -> ()")
    assert ops.write_kv_op is torch.ops.fp8kv.write_kv.default
    assert ops.paged_attention_op is torch.ops.fp8kv.paged_attention.default
    for op in (ops.write_kv_op, ops.paged_attention_op):
        assert torch.Tag.needs_exact_strides in op.tags


# ------------------------------------------------------------------------------ opcheck
@pytest.mark.parametrize("granularity,layout,views,backend", [
    ("tensor", "NHD", True, "reference"),
    ("head", "HND", False, "reference"),
    ("token_head", "NHD", False, "reference"),
    ("token_head", "HND", True, "reference"),
    ("tensor", "HND", False, "triton"),
    ("token_head", "NHD", True, "triton"),
])
def test_opcheck_write_kv(granularity, layout, views, backend):
    cache = _cache(granularity, layout, views=views)
    q, k, v, meta = _step_inputs(cache, q_lens=(2, 3), backend=backend)
    torch.library.opcheck(ops.write_kv_op, _write_args(cache, k, v, meta))
    torch.library.opcheck(ops.write_kv_op, _write_args(cache, k, v, meta, codes=None), test_utils=FAKE_ONLY)


@pytest.mark.parametrize("granularity,q_lens,lse,backend,options", [
    ("tensor", (1, 1), True, "reference", {}),
    ("tensor", (1, 1), False, "reference", {}),
    ("tensor", (2, 3), True, "reference", {"sliding_window": 3, "logits_soft_cap": 20.0}),
    ("head", (2, 3), False, "reference", {"causal": False}),
    ("token_head", (1, 1), False, "reference", {}),
    ("token_head", (2, 3), True, "reference", {}),
    ("tensor", (1, 1), True, "triton", {}),
    ("token_head", (2, 3), False, "triton", {"sliding_window": 4, "logits_soft_cap": 20.0}),
])
def test_opcheck_paged_attention(granularity, q_lens, lse, backend, options):
    cache = _cache(granularity, "HND" if granularity == "head" else "NHD", views=granularity == "tensor")
    q, k, v, meta = _step_inputs(cache, q_lens=q_lens, backend=backend, **options)
    fp8kv.write_kv(cache, k, v, meta)
    torch.library.opcheck(ops.paged_attention_op, _attention_args(cache, q, meta, lse))
    torch.library.opcheck(ops.paged_attention_op, _attention_args(cache, q, meta, lse, codes=None),
                          test_utils=FAKE_ONLY)


def _write_undeclared(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_dtype: str, layout: str, scale_granularity: str, backend: str) -> None:
    reference_write_kv(ops._cache(key_cache, value_cache, k_scale, v_scale, kv_dtype, layout, scale_granularity),
                       key, value, slot_mapping)


def test_opcheck_catches_an_undeclared_mutation():
    """The control: the same write declared without the scales it writes (token_head) fails opcheck."""
    bad = torch.library.custom_op("fp8kv_test::write_kv_undeclared", _write_undeclared,
                                  mutates_args=("key_cache", "value_cache"))
    cache = _cache("token_head")
    q, k, v, meta = _step_inputs(cache)
    with pytest.raises(Exception, match="k_scale is not defined as mutable but was mutated"):
        torch.library.opcheck(bad, _write_args(cache, k, v, meta))


# ------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("compiler,granularity,layout,views", [
    ("eager", "tensor", "NHD", True),
    ("eager", "token_head", "HND", False),
    ("aot_eager", "tensor", "NHD", True),
    ("aot_eager", "token_head", "HND", False),
    ("inductor", "tensor", "NHD", True),  # one inductor case: its CPU compile takes seconds
])
def test_compiled_step_fullgraph_bit_identical(compiler, granularity, layout, views):
    eager = [_cache(granularity, layout, views=views) for _ in range(2)]
    q, k, v, meta = _step_inputs(eager[0], q_lens=(1, 1))
    _step_inputs(eager[1], q_lens=(1, 1), seed=1)  # layer 1: another history
    compiled = [_copy(c, granularity, layout, views) for c in eager]
    explained = torch._dynamo.explain(step)(q, k, v, [_copy(c, granularity, layout, views) for c in eager], meta)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True, backend=compiler)
    for i in range(2):  # two decode steps: the second one's max_seq_len is one more
        if i:
            lens = [int(n) + 1 for n in meta.seq_lens]
            q, k, v, meta = _step_inputs(_cache(granularity, layout), lens=lens, seed=i)
        want = step(q, k, v, eager, meta)
        if compiler == "inductor" and i == 0:  # the mutations are re-inplaced: no copy of a cache
            got, code = run_and_get_code(fn, q, k, v, compiled, meta)
            assert "torch.ops.fp8kv.write_kv.default(" in code[0] and "copy_" not in code[0]
        else:
            got = fn(q, k, v, compiled, meta)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(_bits(a), _bits(b))
        for a, b in zip(eager, compiled, strict=True):
            assert a.same_bytes(b)


def test_compiled_prefill_and_mixed_dtype_fullgraph():
    """Chunked prefill with window and soft cap, and K/V in another dtype than the query (the op
    re-selects the write backend by name), under fullgraph: bit-identical to eager."""
    def prefill(q, k, v, cache, meta):
        fp8kv.write_kv(cache, k.half(), v.half(), meta)
        return fp8kv.paged_attention(q, cache, meta, return_lse=True)

    eager = _cache("token_head", "HND")
    q, k, v, meta = _step_inputs(eager, q_lens=(2, 3), sliding_window=3, logits_soft_cap=20.0)
    compiled = eager.clone()
    want = prefill(q, k, v, eager, meta)
    got = torch.compile(prefill, fullgraph=True, backend="eager")(q, k, v, compiled, meta)
    assert eager.same_bytes(compiled)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(want, got, strict=True))


def test_one_shot_forms_under_compile():
    """The one-shot forms check values on the host (graph breaks), yet compile and agree with eager."""
    def one_shot(q, k, v, cache, slots, tables, lens):
        fp8kv.write_kv_one_shot(cache, k, v, slots, backend="reference")
        return fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="reference")

    eager = _cache()
    q, k, v, meta = _step_inputs(eager)
    compiled = eager.clone()
    args = (meta.slot_mapping, meta.block_tables, meta.seq_lens)
    want = one_shot(q, k, v, eager, *args)
    got = torch.compile(one_shot, backend="eager")(q, k, v, compiled, *args)
    assert eager.same_bytes(compiled) and torch.equal(_bits(want), _bits(got))


def test_growing_max_seq_len_recompiles_once():
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(step, fullgraph=True, backend=counter)
    caches = [_cache() for _ in range(2)]
    lens = [3, 6]
    for i in range(3):  # max_seq_len 6, 7, 8
        q, k, v, meta = _step_inputs(_cache(), lens=lens, seed=i)
        fn(q, k, v, caches, meta)
        lens = [n + 1 for n in lens]
    assert counter.frame_count == 2  # max_seq_len specialised once, then symbolic


def test_dynamic_true_compiles_once():
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(step, fullgraph=True, backend=counter, dynamic=True)
    caches = [_cache() for _ in range(2)]
    for i, lens in enumerate(([3, 6], [4, 7])):
        q, k, v, meta = _step_inputs(_cache(), lens=lens, seed=i)  # planned on another cache of the same spec
        fn(q, k, v, caches, meta)
    assert counter.frame_count == 1


def test_eager_calls_never_use_the_ops(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the eager path went through fp8kv.ops")

    monkeypatch.setattr(ops, "traced_write_kv", refuse)
    monkeypatch.setattr(ops, "traced_paged_attention", refuse)
    cache = _cache()
    q, k, v, meta = _step_inputs(cache)
    fp8kv.write_kv(cache, k, v, meta)
    fp8kv.paged_attention(q, cache, meta)


def test_bad_input_under_compile_raises_the_named_error():
    cache = _cache()
    q, k, v, meta = _step_inputs(cache)
    wrong = torch.zeros(k.shape[0], H + 1, D, dtype=k.dtype)
    with pytest.raises(fp8kv.InvalidArgument, match=r"key: got shape \(2, 3, 16\)"):
        torch.compile(step, backend="eager")(q, wrong, wrong, [cache], meta)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"key: got shape \(2, 3, 16\)"):  # fullgraph: dynamo's error quotes it
        torch.compile(step, fullgraph=True, backend="eager")(q, wrong, wrong, [cache], meta)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("granularity,layout,views", [("tensor", "NHD", True), ("token_head", "HND", False)])
def test_rebuilt_cache_and_metadata_match_the_api(backend, granularity, layout, views):
    import dataclasses

    cache = _cache(granularity, layout, views=views)
    rebuilt = ops._cache(cache.key_cache.view(torch.uint8), cache.value_cache, cache.k_scale, cache.v_scale,
                         cache.kv_dtype, cache.layout, cache.scale_granularity)
    for f in dataclasses.fields(fp8kv.KVCache):
        a, b = getattr(cache, f.name), getattr(rebuilt, f.name)
        if isinstance(a, torch.Tensor):  # the same memory, seen the same way
            assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)
        else:
            assert a == b, f.name
    for q_lens, options in (((1, 1), {}), ((2, 3), {"sliding_window": 2, "causal": True}),
                            ((1, 3), {"logits_soft_cap": 5.0, "causal": False})):
        q, k, v, meta = _step_inputs(_cache(granularity, layout, views=views), q_lens=q_lens, backend=backend,
                                     **options)
        for _ in range(2):  # built, then from the plan cache
            again = ops._metadata(rebuilt.spec, q, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  meta.max_query_len, meta.max_seq_len, meta.is_decode, meta.options, backend)
            assert again.request == meta.request
            assert again.attention.backend is meta.attention.backend
            assert again.backend_plan == meta.backend_plan
            for name in ("spec", "num_q_heads", "query_dtype", "num_tokens", "is_decode", "max_query_len",
                         "max_seq_len", "options"):
                assert getattr(again, name) == getattr(meta, name), name


def test_self_check_on_the_cpu_with_the_triton_interpreter():
    """The check the H100 runs, at interpreter sizes (sync checks are CUDA-only)."""
    summary = ops.check_compile_on_device("cpu", backend="triton", compile_backend="eager")
    assert all(k["steps"] == 3 and k["opchecks"] == 4 for k in summary["kinds"].values()), summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compile_on_cuda_device():
    """opcheck on CUDA, fullgraph inductor compile with Triton bit-equal to eager, no host sync per layer."""
    summary = ops.check_compile_on_device("cuda", backend="triton", compile_backend="inductor")
    assert all(k.get("sync_free") for k in summary["kinds"].values()), summary
