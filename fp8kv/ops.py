"""fp8kv's two operations as torch custom ops, so that ``torch.compile`` traces a whole step.

Ops (namespace ``fp8kv``, defined when ``fp8kv`` is imported; the schemas are
:data:`WRITE_KV_SCHEMA` and :data:`PAGED_ATTENTION_SCHEMA`)::

    fp8kv::write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!) k_scale,
                    Tensor(d!) v_scale, Tensor key, Tensor value, Tensor slot_mapping,
                    str kv_dtype, str layout, str scale_granularity, str backend) -> ()
    fp8kv::paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor k_scale,
                    Tensor v_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc,
                    Tensor(a!) out, Tensor(b!)? lse, str kv_dtype, str layout,
                    str scale_granularity, SymInt max_query_len, SymInt max_seq_len,
                    bool is_decode, float softmax_scale, bool causal, SymInt? sliding_window,
                    float? logits_soft_cap, str backend) -> ()

They are defined with :class:`torch.library.Library` (schema with its mutation annotations,
one ``CompositeExplicitAutograd`` kernel, a fake kernel from :func:`torch.library.register_fake`,
tag ``needs_exact_strides`` so that inductor hands them the strides seen while tracing) and
not with :func:`torch.library.custom_op`, which for mutating ops adds a Python
``ADInplaceOrView`` kernel costing ~100 us (write) and ~300 us (attention) per call in torch 2.13
(see the comment at the definition); what torch.compile does with the op is the same.

Both write in place and return nothing. ``write_kv`` declares all four cache tensors mutated
(``token_head`` scales are written; static scales are declared too, since the schema is one
for every granularity, and left as they are); ``paged_attention`` mutates ``out`` and the
optional ``lse``. The cache codes may be passed as their float8 dtype or as uint8 views
(``kv_dtype`` names the format). The fake implementations do nothing: there is no output.
The real ones rebuild the layer's :class:`~fp8kv.KVCache` and the step's
:class:`~fp8kv.AttentionMetadata` from those tensors and primitives without validating them
again (the ``KVCache`` constructor and :func:`fp8kv.plan_attention` did, outside the compiled
region), select the backend by name and call it. Nothing there reads a tensor value: no host
sync is added. The selection and the backend's plan (``fp8kv_plan_attention``, which may only
look at host-side numbers) are memoised per host-side key.

How an engine compiles its step
-------------------------------

Plan the step outside the compiled function and pass the metadata *as an argument*, a new
one per step, and the layers' caches as arguments too::

    @torch.compile(fullgraph=True)             # inductor (default), or "eager"
    def decode_step(x, caches, meta):
        for layer, cache in enumerate(caches):
            q, k, v = qkv_proj(layer, x)
            fp8kv.write_kv(cache, k, v, meta)
            x = o_proj(layer, fp8kv.paged_attention(q, cache, meta))
        return x

    for _ in range(steps):
        meta = fp8kv.plan_attention(caches[0], num_q_heads=Hq, query_dtype=torch.bfloat16,
                                    block_tables=bt, seq_lens=lens, slot_mapping=slots)
        x = decode_step(x, caches, meta)

What dynamo traces is :func:`fp8kv.write_kv` and :func:`fp8kv.paged_attention` themselves,
checks included: they only look at shapes, dtypes, devices and the metadata's Python fields,
which dynamo evaluates while tracing and guards on, so they cost nothing per call; an input
that would fail a check fails a guard, is traced again and raises the named
:class:`fp8kv.InvalidArgument` (with ``fullgraph=True`` dynamo reports it as an "Observed
exception" quoting that error). Where eager calls the backend (pluggy, the registry, Python
launch code: several graph breaks), under ``torch.compiler.is_compiling()`` they emit one
``fp8kv::write_kv`` / ``fp8kv::paged_attention`` node instead, fed with the cache's tensors,
the metadata's index tensors (graph inputs) and its host numbers. So the graph has no break.

Guards and recompiles: dynamo specialises on the metadata fields it reads (the spec, the
query dtype and heads, ``is_decode``, the options, the backend names: constants of a model)
and on ``num_tokens``, ``max_query_len`` and ``max_seq_len``. When one of those changes,
dynamo recompiles once and, by its automatic dynamic shapes, makes it a symbolic int
(``SymInt`` in the schemas): a decode loop whose ``max_seq_len`` grows by one per step
compiles twice in all, and a change of batch size once more. (``dynamic=True`` should compile
once but fails today in ``AttentionMetadata.check_cache``, a dataclass ``!=`` dynamo cannot
evaluate on symbolic ints; ``tests/test_ops.py::test_dynamic_true_compiles_once`` is its
strict xfail.) A metadata closed over (a global, a closure variable reassigned per step) is
guarded the same way; an argument is the robust form.

The metadata's ``backend_plan`` object is not passed to the op (a schema has no slot for
Python objects): the op asks the backend's ``fp8kv_plan_attention`` again, once per
host-side key, from the same host numbers, so it gets the same plan. CUDA graphs
(``mode="reduce-overhead"``) are not covered by the tests yet.

Compilers: ``inductor`` re-inplaces the mutations (the ops write into the caches directly,
no copy; checked in its output code) and ``eager`` calls the ops as they are. ``aot_eager``
(a debugging compiler) runs the functionalized graph as is: it copies every mutated cache
tensor per call. Correct everywhere, bit-identical to eager.

Not fullgraph-traceable: the one-shot calls (``write_kv_one_shot(cache, k, v, slots)``,
``paged_attention_one_shot(q, cache, block_tables, seq_lens, ...)``), which check index values on
the host and select a backend per call. They still work under a compile that allows graph
breaks, and their dispatch goes through the ops too.

Eager calls (no compile) never touch this module: the API calls the backend directly, so the
per-layer host overhead is what it was. :func:`check_compile_on_device` checks all of the
above on a GPU (``tests/test_ops.py::test_compile_on_cuda_device`` runs it).
"""

import functools
import itertools
import time
from collections.abc import Callable

import torch
from torch import Tensor

from .cache import CacheSpec, KVCache
from .formats import FORMATS
from .metadata import AttentionMetadata, AttentionOptions
from .probe import _simulated_override
from .registry import Selection, registry, select_backend
from .request import Request

__all__ = ["PAGED_ATTENTION_SCHEMA", "WRITE_KV_SCHEMA", "check_compile_on_device", "paged_attention_op",
           "traced_paged_attention", "traced_write_kv", "write_kv_op"]


# ------------------------------------------------------------------------ rebuilding, cached
@functools.lru_cache(maxsize=256)
def _spec(kv_dtype: str, layout: str, scale_granularity: str, shape: tuple[int, ...],
          device: torch.device) -> CacheSpec:
    nb, a, b, D = shape
    bs, H = (a, b) if layout == "NHD" else (b, a)
    return CacheSpec(kv_dtype, layout, scale_granularity, nb, bs, H, D, device)


def _cache(key_cache: Tensor, value_cache: Tensor, k_scale: Tensor, v_scale: Tensor, kv_dtype: str, layout: str,
           scale_granularity: str) -> KVCache:
    """The layer's :class:`KVCache` without re-validation (it was validated when the caller built it;
    under ``aot_eager`` the tensors may be functional copies of those, with the same shapes).

    ``key_cache`` / ``value_cache`` may also be uint8 views of the codes (viewed back here).
    """
    fmt = FORMATS[kv_dtype]
    if key_cache.dtype != fmt.torch_dtype:
        key_cache = key_cache.view(fmt.torch_dtype)
    if value_cache.dtype != fmt.torch_dtype:
        value_cache = value_cache.view(fmt.torch_dtype)
    return KVCache.unchecked(key_cache, value_cache, k_scale, v_scale, fmt, layout, scale_granularity,
                             _spec(kv_dtype, layout, scale_granularity, tuple(key_cache.shape), key_cache.device))


_SELECTIONS: dict = {}


def _select(key: tuple, request: Callable[[], Request], device: torch.device, backend: str) -> Selection:
    """``select_backend(request(), device, backend)``, memoised under ``key`` (a host-side tuple that
    determines the request). A hit is checked against the live registry (a re-registered backend is
    honoured) and the innermost :func:`fp8kv.plugins.simulate_device` (so is a simulated device); the
    environment (``FP8KV_SIMULATE_DEVICE``, ``TRITON_INTERPRET``) is read on a miss only."""
    sel = _SELECTIONS.get(key)
    simulated = _simulated_override[-1] if _simulated_override else None
    if sel is None or registry().backends.get(backend) is not sel.backend or (
            simulated is not None and simulated is not sel.device):
        if len(_SELECTIONS) > 256:
            _SELECTIONS.clear()
        sel = _SELECTIONS[key] = select_backend(request(), device, backend)
    return sel


_PLANS: dict = {}


def _metadata(spec: CacheSpec, query: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
              max_query_len: int, max_seq_len: int, is_decode: bool, options: AttentionOptions,
              backend: str) -> AttentionMetadata:
    """The step's :class:`AttentionMetadata` as :func:`fp8kv.plan_attention` built it, from its parts.

    The backend's plan (``fp8kv_plan_attention``) is made once per host-side key: the hook may
    only look at host numbers (the hookspec forbids reading tensor values), so it is shared.
    """
    chunked = not is_decode and max_query_len > 1

    def request() -> Request:  # as plan_attention builds it
        features = set(options.features)
        if chunked:
            features.add("chunked_prefill")
        return Request.for_attention(spec, query.dtype, frozenset(features))

    selection = _select(("attention", spec, query.dtype, options, chunked, backend), request, spec.device, backend)
    num_tokens, num_q_heads = query.shape[0], query.shape[1]
    meta = AttentionMetadata(spec, num_q_heads, query.dtype, num_tokens, block_tables, seq_lens, query_start_loc,
                             is_decode, None, max_query_len, max_seq_len, options, selection.request, selection, None)
    key = (id(selection), num_q_heads, num_tokens, block_tables.shape[0], block_tables.shape[1], is_decode,
           max_query_len, max_seq_len, options)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is selection:
        meta.backend_plan = hit[1]
    else:
        if len(_PLANS) > 256:
            _PLANS.clear()
        meta.backend_plan = selection.backend.plan_attention(selection.device, meta)
        _PLANS[key] = (selection, meta.backend_plan)
    return meta


# ------------------------------------------------------------------------------------- ops
WRITE_KV_SCHEMA = (
    "fp8kv::write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, "
    "Tensor key, Tensor value, Tensor slot_mapping, str kv_dtype, str layout, str scale_granularity, "
    "str backend) -> ()")
PAGED_ATTENTION_SCHEMA = (
    "fp8kv::paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor k_scale, Tensor v_scale, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor(a!) out, Tensor(b!)? lse, "
    "str kv_dtype, str layout, str scale_granularity, SymInt max_query_len, SymInt max_seq_len, bool is_decode, "
    "float softmax_scale, bool causal, SymInt? sliding_window, float? logits_soft_cap, str backend) -> ()")


def _write_kv_impl(key_cache: Tensor, value_cache: Tensor, k_scale: Tensor, v_scale: Tensor, key: Tensor,
                   value: Tensor, slot_mapping: Tensor, kv_dtype: str, layout: str, scale_granularity: str,
                   backend: str) -> None:
    """:func:`fp8kv.write_kv` of ``key``/``value`` at ``slot_mapping`` by the backend named ``backend``."""
    cache = _cache(key_cache, value_cache, k_scale, v_scale, kv_dtype, layout, scale_granularity)
    spec = cache.spec
    selection = _select(("write", spec, key.dtype, backend), lambda: Request.for_write(spec, key.dtype), spec.device,
                        backend)
    selection.backend.write_kv(cache, key, value, slot_mapping)


def _write_kv_fake(key_cache, value_cache, k_scale, v_scale, key, value, slot_mapping, kv_dtype, layout,
                   scale_granularity, backend) -> None:
    return None


def _paged_attention_impl(query: Tensor, key_cache: Tensor, value_cache: Tensor, k_scale: Tensor, v_scale: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, out: Tensor,
                          lse: Tensor | None, kv_dtype: str, layout: str, scale_granularity: str, max_query_len: int,
                          max_seq_len: int, is_decode: bool, softmax_scale: float, causal: bool,
                          sliding_window: int | None, logits_soft_cap: float | None, backend: str) -> None:
    """:func:`fp8kv.paged_attention` of ``query`` into ``out`` (and ``lse``) by the backend named ``backend``."""
    cache = _cache(key_cache, value_cache, k_scale, v_scale, kv_dtype, layout, scale_granularity)
    options = AttentionOptions(softmax_scale, causal, sliding_window, logits_soft_cap)
    meta = _metadata(cache.spec, query, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                     is_decode, options, backend)
    meta.attention.backend.paged_attention(query, cache, meta, out, lse)


def _paged_attention_fake(query, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                          out, lse, kv_dtype, layout, scale_granularity, max_query_len, max_seq_len, is_decode,
                          softmax_scale, causal, sliding_window, logits_soft_cap, backend) -> None:
    return None


# Registered through torch.library.Library rather than torch.library.custom_op: for an op that
# mutates its arguments, custom_op (torch 2.13) adds a Python ADInplaceOrView kernel whose
# argument normalisation costs O(arguments^2) pybind conversions, ~100 us per write_kv and
# ~300 us per paged_attention call (even under inference_mode), against ~8 us here.
# The schema, its mutation annotations, the fake kernel and what torch.compile does with
# the op (auto-functionalisation, re-inplacing) are the same either way.
_STRIDES = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)
_LIB = torch.library.Library("fp8kv", "DEF")
for _schema, _impl, _fake in ((WRITE_KV_SCHEMA, _write_kv_impl, _write_kv_fake),
                              (PAGED_ATTENTION_SCHEMA, _paged_attention_impl, _paged_attention_fake)):
    _name = _schema.split("(", 1)[0].removeprefix("fp8kv::")
    _LIB.define(_schema.removeprefix("fp8kv::"), tags=(_STRIDES,))
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fp8kv::{_name}", _fake, lib=_LIB)

write_kv_op = torch.ops.fp8kv.write_kv.default
"""The ``fp8kv::write_kv`` operator (an OpOverload: call it, or pass it to ``torch.library.opcheck``)."""
paged_attention_op = torch.ops.fp8kv.paged_attention.default
"""The ``fp8kv::paged_attention`` operator."""


# -------------------------------------------------------------- the routing from fp8kv.api
def traced_write_kv(cache: KVCache, key: Tensor, value: Tensor, slot_mapping: Tensor, backend: str) -> None:
    """:func:`fp8kv.write_kv`'s dispatch under ``torch.compile`` (arguments already checked)."""
    torch.ops.fp8kv.write_kv(cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale, key, value,
                             slot_mapping, cache.fmt.name, cache.layout, cache.scale_granularity, backend)


def traced_paged_attention(query: Tensor, cache: KVCache, meta: AttentionMetadata, out: Tensor,
                           lse: Tensor | None) -> None:
    """:func:`fp8kv.paged_attention`'s dispatch under ``torch.compile`` (arguments already checked)."""
    opts = meta.options
    torch.ops.fp8kv.paged_attention(
        query, cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, out, lse, cache.fmt.name, cache.layout, cache.scale_granularity, meta.max_query_len,
        meta.max_seq_len, meta.is_decode, opts.softmax_scale, opts.causal, opts.sliding_window,
        opts.logits_soft_cap, meta.attention.backend.name)


# ---------------------------------------------------------------------------- self-check
def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def check_compile_on_device(device: str | torch.device = "cuda", *, backend: str = "triton",
                            compile_backend: str = "inductor", small: bool | None = None) -> dict:
    """Check the custom ops and a compiled step on ``device``; raises AssertionError on a failure.

    For each cache kind (per-tensor scales NHD, vLLM-style K/V views of one tensor; per-token-head
    scales HND), with the metadata's backend forced to ``backend``:

    1. :func:`torch.library.opcheck` of ``fp8kv::write_kv`` and ``fp8kv::paged_attention`` (decode
       with ``lse``, chunked prefill without), on uint8 views of the cache (opcheck's schema check
       compares tensors with ``allclose``, which float8 lacks), and its fake-tensor check on the
       float8 tensors themselves;
    2. ``torch.compile(step, fullgraph=True, backend=compile_backend)`` of a two-layer step
       (``write_kv`` then ``paged_attention(..., return_lse=True)`` per layer) over two decode steps
       (``max_seq_len`` grows: one recompile, then symbolic) and one chunked-prefill step: no graph
       break (:func:`torch._dynamo.explain`), and the caches, outputs and LSEs are bit-identical to
       eager;
    3. on CUDA, under ``torch.cuda.set_sync_debug_mode("error")``: the eager per-layer calls with the
       metadata and the compiled step run without a host sync.

    ``small`` (default: on the CPU) picks interpreter-sized shapes. Resets dynamo's caches
    (``torch._dynamo.reset()``) between cache kinds. Returns a summary dict.
    """
    import fp8kv

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    small = dev.type != "cuda" if small is None else small
    H, Hq, D, bs = (2, 4, 16, 4) if small else (8, 32, 128, 16)
    start_lens = [1, 5, 11] if small else [1, 37, 300, 2000]  # sequence lengths after step 0
    S = len(start_lens)
    steps = [("decode", [1] * S), ("decode", [1] * S), ("prefill", [2, 1, 3, 4][:S])]  # query tokens per sequence
    max_len = max(start_lens) + sum(max(q_lens) for _, q_lens in steps[1:])
    blocks_per_seq = -(-max_len // bs)
    num_blocks = S * blocks_per_seq + 3
    gen = torch.Generator().manual_seed(1234)
    perm = torch.randperm(num_blocks, generator=gen)[:S * blocks_per_seq]
    block_tables = perm.reshape(S, blocks_per_seq).to(torch.int32)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(dev)

    def slots_of(positions: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor([int(block_tables[s, p // bs]) * bs + p % bs for s, p in positions], dtype=torch.int32)

    def bits(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])

    def make_cache(kind: str) -> fp8kv.KVCache:
        if kind == "tensor/NHD/views":
            base = torch.zeros((num_blocks, 2, bs, H, D), dtype=torch.float8_e4m3fn, device=dev)
            return fp8kv.KVCache.from_tensors(base, kv_dim=1, k_scale=0.05, v_scale=0.03)
        return fp8kv.KVCache.allocate(num_blocks, bs, H, D, kv_dtype="fp8_e4m3", layout="HND",
                                      scale_granularity="token_head", device=dev)

    def copy_of(cache: KVCache, kind: str) -> KVCache:  # same structure (views stay views), same bytes
        return make_cache(kind).copy_(cache)

    def step(q, k, v, caches, meta):
        outs = []
        for cache in caches:
            fp8kv.write_kv(cache, k, v, meta)
            outs.append(fp8kv.paged_attention(q, cache, meta, return_lse=True))
        return outs

    def opcheck_all(cache: KVCache, q, k, v, meta: AttentionMetadata, with_lse: bool) -> None:
        for codes in (torch.uint8, None):  # uint8 views: every test; float8: the fake-tensor one
            tests = None if codes else ("test_faketensor",)
            kc = cache.key_cache.view(codes) if codes else cache.key_cache
            vc = cache.value_cache.view(codes) if codes else cache.value_cache
            kw = {} if tests is None else {"test_utils": tests}
            torch.library.opcheck(write_kv_op, (kc, vc, cache.k_scale, cache.v_scale, k, v, meta.slot_mapping,
                                                cache.kv_dtype, cache.layout, cache.scale_granularity,
                                                meta.write.backend.name), **kw)
            o = meta.options
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev) if with_lse else None
            torch.library.opcheck(paged_attention_op, (
                q, kc, vc, cache.k_scale, cache.v_scale, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                torch.empty_like(q), lse, cache.kv_dtype, cache.layout, cache.scale_granularity, meta.max_query_len,
                meta.max_seq_len, meta.is_decode, o.softmax_scale, o.causal, o.sliding_window, o.logits_soft_cap,
                meta.backend), **kw)

    summary: dict = {"device": str(dev), "backend": backend, "compile_backend": compile_backend, "kinds": {}}
    for kind in ("tensor/NHD/views", "token_head/HND"):
        t0 = time.perf_counter()
        torch._dynamo.reset()
        eager_caches = [make_cache(kind) for _ in range(2)]
        lens = [n - 1 for n in start_lens]  # the history, written before step 0
        hist = [(i, p) for i, n in enumerate(lens) for p in range(n)]
        hk, hv = rand(len(hist), H, D), rand(len(hist), H, D)
        for cache in eager_caches:
            fp8kv.write_kv_one_shot(cache, hk, hv, slots_of(hist).to(dev), backend=backend)
        compiled_caches = [copy_of(c, kind) for c in eager_caches]
        compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
        info = summary["kinds"][kind] = {"steps": 0, "opchecks": 0}
        for i, (what, q_lens) in enumerate(steps):
            lens = [n + ql for n, ql in zip(lens, q_lens, strict=True)]
            decode = what == "decode"
            new = [(j, p) for j, n in enumerate(lens) for p in range(n - q_lens[j], n)]
            qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev)
            meta = fp8kv.plan_attention(
                eager_caches[0], num_q_heads=Hq, query_dtype=torch.bfloat16, block_tables=block_tables.to(dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), slot_mapping=slots_of(new).to(dev),
                query_start_loc=None if decode else qsl, backend=backend)
            T = len(new)
            q, k, v = rand(T, Hq, D), rand(T, H, D), rand(T, H, D)
            if i != 1:  # opcheck on scratch copies: decode with lse, prefill without
                scratch = make_cache(kind)
                opcheck_all(scratch, q, k, v, meta, with_lse=decode)
                info["opchecks"] += 2
            if i == 0:
                explained = torch._dynamo.explain(step)(q, k, v, [copy_of(c, kind) for c in eager_caches], meta)
                _expect(explained.graph_break_count == 0, f"{kind}: graph breaks {explained.break_reasons}")
                torch._dynamo.reset()
            want = step(q, k, v, eager_caches, meta)
            got = compiled(q, k, v, compiled_caches, meta)
            for layer, ((o1, l1), (o2, l2), c1, c2) in enumerate(zip(want, got, eager_caches, compiled_caches,
                                                                     strict=True)):
                where = f"{kind}, step {i} ({what}), layer {layer}"
                _expect(c1.same_bytes(c2), f"{where}: the compiled write left different cache bytes")
                _expect(torch.equal(bits(o1), bits(o2)), f"{where}: compiled and eager outputs differ")
                _expect(torch.equal(bits(l1), bits(l2)), f"{where}: compiled and eager LSEs differ")
            info["steps"] += 1
            if dev.type == "cuda" and i == 1:  # warmed up: no host sync per layer, eager or compiled
                torch.cuda.synchronize(dev)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    for cache in eager_caches:
                        fp8kv.write_kv(cache, k, v, meta)
                        fp8kv.paged_attention(q, cache, meta, return_lse=True)
                    compiled(q, k, v, compiled_caches, meta)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize(dev)
                info["sync_free"] = True
        info["seconds"] = round(time.perf_counter() - t0, 2)
    torch._dynamo.reset()
    return summary
