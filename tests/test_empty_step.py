"""The empty step: no token (and no sequence, or sequences without queries) is a no-op everywhere.

An engine's step may hold nothing to attend (every request finished, a prefill-only batch's decode
half): planning it, attending over it (with and without ``return_lse``, into a given ``out``) and
writing its zero tokens must succeed on every backend and mode, give ``out [0, Hq, D]`` and
``lse [0, Hq]``, and leave the cache as it was. On the CPU the Triton and Hopper backends run
through Triton's interpreter (set by conftest); the CUDA backend's host code (its plans, its
launchers' early returns, its driver launch of an empty grid) is run directly with the GPU's
facts stubbed, as in tests/test_cuda_backend.py. On a GPU the same steps run on it, through every
backend that serves them there (the others skip, saying why).
"""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.probe import triton_interpreter

H, GROUP, D, BS, NB = 2, 2, 32, 16, 4
HQ = H * GROUP
I32 = torch.int32
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _served() -> list[tuple[str, bool]]:
    """(backend, fp8_attention) pairs to run: reference and torch everywhere; triton and hopper (the
    FP8 mode) on a GPU and on the CPU through Triton's interpreter; cuda on a GPU."""
    pairs = [("reference", False), ("reference", True), ("torch", False)]
    if DEVICE.type == "cuda" or triton_interpreter():
        pairs += [("triton", False), ("hopper", True)]
    if DEVICE.type == "cuda":
        pairs.append(("cuda", False))
    return pairs


SERVED = _served()


def _steps() -> dict[str, dict]:
    """Empty steps in every page-table form: no sequence (decode, prefill; padded with and without
    columns, CSR), and sequences without a query token (prefill; cached keys or none)."""
    z = lambda n: torch.zeros(n, dtype=I32, device=DEVICE)
    tables = lambda rows: torch.tensor(rows, dtype=I32, device=DEVICE)
    none_padded = dict(block_tables=torch.zeros(0, 4, dtype=I32, device=DEVICE), seq_lens=z(0))
    none_csr = dict(kv_indptr=z(1), kv_indices=z(0), kv_last_page_len=z(0))
    return {
        "decode-padded": none_padded,
        "decode-padded-no-columns": dict(block_tables=torch.zeros(0, 0, dtype=I32, device=DEVICE), seq_lens=z(0)),
        "decode-csr": none_csr,
        "decode-csr-int64": {k: v.long() for k, v in none_csr.items()},
        "prefill-padded": {**none_padded, "query_start_loc": z(1)},
        "prefill-csr": {**none_csr, "query_start_loc": z(1)},
        "prefill-padded-sequences-without-queries": dict(
            block_tables=tables([[1], [2]]), seq_lens=tables([3, 5]), query_start_loc=z(3)),
        "prefill-padded-sequences-without-keys": dict(block_tables=torch.zeros(2, 0, dtype=I32, device=DEVICE),
                                                      seq_lens=z(2), query_start_loc=z(3)),
        "prefill-csr-sequences-without-pages": dict(kv_indptr=z(3), kv_indices=z(0), kv_last_page_len=z(2),
                                                     query_start_loc=z(3)),
    }


STEPS = _steps()


def _filled_cache(fmt: str = "fp8_e4m3", gran: str = "tensor", device: torch.device = DEVICE) -> fp8kv.KVCache:
    g = torch.Generator().manual_seed(3)
    cache = fp8kv.KVCache.allocate(NB, BS, H, D, kv_dtype=fmt, scale_granularity=gran, device=device)
    k, v = torch.randn(NB * BS, H, D, generator=g), torch.randn(NB * BS, H, D, generator=g)
    fp8kv.write_kv_one_shot(cache, k.to(device), v.to(device), torch.arange(NB * BS, device=device),
                            backend="reference")
    return cache


def _plan(cache: fp8kv.KVCache, backend: str, **step) -> fp8kv.AttentionMetadata:
    """The step planned for ``backend``; on a GPU, a backend that does not serve it there skips."""
    try:
        return fp8kv.plan_attention(cache, num_q_heads=HQ, backend=backend, **step)
    except fp8kv.Unsupported as e:
        if DEVICE.type != "cuda":
            raise
        pytest.skip(f"{backend} does not serve this step on this GPU: {e}")


def _snapshot(cache: fp8kv.KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)]


def _assert_unchanged(cache: fp8kv.KVCache, before: list[torch.Tensor]) -> None:
    now = (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)
    for name, a, b in zip(("key_cache", "value_cache", "k_scale", "v_scale"), before, now, strict=True):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{name} changed"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
@pytest.mark.parametrize(("backend", "fp8_attention"), SERVED, ids=[f"{b}-fp8" if f else b for b, f in SERVED])
def test_the_empty_step_is_a_no_op(backend, fp8_attention, step, dtype):
    """Plan, attend (no lse, lse, a given ``out``), write zero tokens, update in place: nothing fails,
    the outputs are empty and the cache is unchanged."""
    cache = _filled_cache()
    before = _snapshot(cache)
    tables = STEPS[step]
    no_slots = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    meta = _plan(cache, backend, query_dtype=dtype, slot_mapping=no_slots, fp8_attention=fp8_attention, **tables)
    assert meta.attention.backend.name == backend and meta.num_tokens == 0
    query = torch.zeros(0, HQ, D, dtype=dtype, device=DEVICE)
    out = fp8kv.paged_attention(query, cache, meta)
    assert out.shape == (0, HQ, D) and out.dtype == dtype
    given = torch.empty(0, HQ, D, dtype=dtype, device=DEVICE)
    out, lse = fp8kv.paged_attention(query, cache, meta, out=given, return_lse=True)
    assert out is given
    assert lse.shape == (0, HQ) and lse.dtype == torch.float32
    nothing = torch.zeros(0, H, D, dtype=dtype, device=DEVICE)
    fp8kv.write_kv(cache, nothing, nothing, meta)
    fp8kv.write_kv_one_shot(cache, nothing, nothing, no_slots, backend=backend)
    meta.update(slot_mapping=no_slots, **tables)
    assert fp8kv.paged_attention(query, cache, meta, return_lse=True)[1].shape == (0, HQ)
    _assert_unchanged(cache, before)


@pytest.mark.parametrize("gran", ["tensor", "head", "token_head"])
@pytest.mark.parametrize("backend", sorted({b for b, fp8 in SERVED if not fp8}))
def test_the_empty_step_in_one_call_on_every_scale_granularity(backend, gran):
    """The one-shot attention and write of an empty decode step, per scale granularity."""
    cache = _filled_cache(gran=gran)
    before = _snapshot(cache)
    meta = _plan(cache, backend, query_dtype=torch.float16, block_tables=torch.zeros(0, 3, dtype=I32, device=DEVICE),
                 seq_lens=torch.zeros(0, dtype=I32, device=DEVICE))
    query = torch.zeros(0, HQ, D, dtype=torch.float16, device=DEVICE)
    out, lse = fp8kv.paged_attention_one_shot(query, cache, meta.block_tables, meta.seq_lens, return_lse=True,
                                              backend=backend)
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ)
    nothing = torch.zeros(0, H, D, dtype=torch.float16, device=DEVICE)
    fp8kv.write_kv_one_shot(cache, nothing, nothing, torch.zeros(0, dtype=I32, device=DEVICE), backend=backend)
    _assert_unchanged(cache, before)


# ------------------------------------------------------------------ the backends' host code, directly


EMPTY_SIZES = [dict(num_seqs=0, max_keys=64), dict(num_seqs=0, max_keys=0), dict(num_seqs=2, max_keys=0)]


@pytest.mark.parametrize("max_query_len", [0, 1, 7])
@pytest.mark.parametrize("sizes", EMPTY_SIZES, ids=["no-sequence", "no-sequence-no-key", "no-key"])
def test_triton_plans_an_empty_step(monkeypatch, sizes, max_query_len):
    """The Triton launch configuration of an empty step, on a CPU and on a (stubbed) H100: one split
    of at least one key, whatever the interpreter says."""
    pytest.importorskip("triton")
    from fp8kv_triton import attention
    from fp8kv_triton.kernels import choose_config

    kw = dict(group=GROUP, head_size=D, num_kv_heads=H, max_query_len=max_query_len, **sizes)
    configs = [choose_config(torch.device("cpu"), interpret=True, **kw),
               choose_config(torch.device("cpu"), interpret=False, **kw)]
    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    configs.append(choose_config(torch.device("cuda", 0), interpret=False, arch="sm90", **kw))
    for config in configs:
        assert config.num_splits >= 1 and config.keys_per_split >= config.block_n >= 1


@pytest.mark.parametrize("max_query_len", [0, 1, 7])
@pytest.mark.parametrize("sizes", EMPTY_SIZES, ids=["no-sequence", "no-sequence-no-key", "no-key"])
def test_hopper_plans_an_empty_step(sizes, max_query_len):
    """The Hopper FP8 kernel's configuration of an empty step on 132 SMs and in the interpreter."""
    pytest.importorskip("triton")
    from fp8kv_hopper.attention import choose_config

    for interpret in (False, True):
        config = choose_config(group=GROUP, num_kv_heads=H, max_query_len=max_query_len, num_sms=132,
                               interpret=interpret, **sizes)
        assert config.num_splits >= 1 and config.keys_per_split >= config.block_n >= 1


def test_hopper_and_triton_launch_nothing_for_no_token():
    """The launchers return before any launch (or CUDA query) for no token or no sequence."""
    pytest.importorskip("triton")
    from fp8kv_hopper.attention import paged_attention_fp8
    from fp8kv_triton.kernels import merge_splits, paged_attention

    cache = _filled_cache(device=torch.device("cpu"))
    before = _snapshot(cache)
    for T, S in ((0, 0), (0, 2), (3, 0)):
        query, out = torch.zeros(T, HQ, D), torch.zeros(T, HQ, D)
        tables, lens = torch.zeros(S, 2, dtype=I32), torch.zeros(S, dtype=I32)
        paged_attention_fp8(query, cache, tables, lens, torch.zeros(S + 1, dtype=I32), 1, 0.5, True, None, None, out,
                            q_scale=None, prob_scale=1.0, interpret=False)
        paged_attention(query, cache, tables, lens, torch.zeros(S + 1, dtype=I32), 1, 0.5, True, None, None, out,
                        decode_mode=0, interpret=False)
    merge_splits(torch.zeros(2, 0, HQ, D), torch.zeros(2, 0, HQ), torch.zeros(2, 0, HQ), cache, torch.zeros(0, HQ, D),
                 torch.zeros(0, HQ), group=GROUP, num_splits=2)
    _assert_unchanged(cache, before)


@pytest.fixture
def h100(monkeypatch):
    """The CUDA backend's plan as on an H100 (132 SMs, sm90, its shared memory), no GPU needed."""
    from fp8kv_cuda import attention, runtime

    monkeypatch.setattr(runtime, "device_index", lambda device: 0)
    monkeypatch.setattr(runtime, "device_sm", lambda index: 90)
    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    monkeypatch.setattr(attention, "_sm", lambda device: 90)
    monkeypatch.setattr(attention, "_smem_limits", lambda index: attention.ARCH_SMEM[90])
    return attention


@pytest.mark.parametrize("query_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_tokens", "num_seqs", "max_keys", "max_query_len"),
                         [(0, 0, 64, 1), (0, 0, 0, 0), (0, 2, 0, 0), (0, 2, 64, 0), (0, 0, 0, 5), (2, 2, 0, 1)])
def test_cuda_plans_an_empty_step(h100, num_tokens, num_seqs, max_keys, max_query_len, query_dtype):
    """Every CUDA plan (CUDA-core, tensor-core decode, the FP8 mode's decode, prefill) of an empty
    step: at least one split of at least one key, no division by zero."""
    attention = h100
    kw = dict(num_kv_heads=8, group=4, head_size=128, max_keys=max_keys)
    plans = [attention.plan(torch.device("cuda", 0), num_tokens=num_tokens, query_dtype=query_dtype,
                            max_query_len=max_query_len, num_seqs=num_seqs, **kw),
             attention.plan_mma(torch.device("cuda", 0), num_tokens=num_tokens, fp8_attention=True, **kw)]
    for ctas_per_sm in (1, 2):
        plans.append(attention.plan_prefill(torch.device("cuda", 0), num_seqs=num_seqs, max_query_len=max_query_len,
                                            ctas_per_sm=ctas_per_sm, **kw))
    for p in plans:
        assert p.num_splits >= 1 and p.keys_per_split >= 1 and p.head_chunks >= 1


def test_cuda_launchers_return_before_launching_for_no_token():
    """The CUDA backend's attention and write launchers return for no token (or no sequence) before
    anything needs CuPy or a GPU."""
    from fp8kv_cuda.kernels import paged_attention
    from fp8kv_cuda.write import write_kv

    cache = _filled_cache(device=torch.device("cpu"))
    before = _snapshot(cache)
    for T, S in ((0, 0), (0, 2), (3, 0)):
        query, out = torch.zeros(T, HQ, D), torch.zeros(T, HQ, D)
        paged_attention(query, cache, torch.zeros(S, 2, dtype=I32), torch.zeros(S, dtype=I32),
                        torch.zeros(S + 1, dtype=I32), 0.5, True, None, None, out, None)
    nothing = torch.zeros(0, H, D)
    write_kv(cache, nothing, nothing, torch.zeros(0, dtype=I32))
    _assert_unchanged(cache, before)


@pytest.mark.parametrize("grid", [(0, 8, 1), (4, 0, 1), (4, 8, 0)])
def test_cuda_launch_of_an_empty_grid_launches_nothing(monkeypatch, grid):
    """A grid with a dimension 0 (the driver refuses it) is never handed to the driver."""
    from fp8kv_cuda import runtime

    def no_launch(*args, **kwargs):
        raise AssertionError("an empty grid reached the launch")

    monkeypatch.setattr(runtime, "function", no_launch)
    monkeypatch.setattr(runtime, "cupy", no_launch)
    monkeypatch.setattr(runtime, "struct_launch", no_launch)
    runtime.launch(None, "fp8kv_paged_attention", torch.device("cuda", 0), grid, 128, [])
    runtime.launch_struct(None, 0, grid, 128, None)
