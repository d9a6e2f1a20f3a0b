"""Threads under Triton's CPU interpreter: its launches are serialized (``fp8kv_triton.serial``).

The interpreter patches ``triton.language`` process-wide for the length of a launch, so two threads
interpreting kernels at once used to break each other (a ``BackendFailure``). With every launch
holding the interpreter's lock, threads writing disjoint slots of one cache and attending over
their own caches concurrently give the bytes and outputs of the same calls made one after another.
"""

from __future__ import annotations

import threading

import pytest
import torch

import fp8kv
from fp8kv.probe import triton_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreter(),
                                reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")

THREADS, ROUNDS = 3, 2
H, GROUP, D, BS = 2, 2, 32, 16
HQ = H * GROUP
TOKENS = 5  # per thread and round: its own block of the shared cache, slots [BS * i, BS * i + TOKENS)


def _inputs(i: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thread ``i``'s K, V and queries of round ``r`` (the same whichever way the calls are made)."""
    g = torch.Generator().manual_seed(100 * i + r)
    k, v = torch.randn(TOKENS, H, D, generator=g), torch.randn(TOKENS, H, D, generator=g)
    q = torch.randn(TOKENS, HQ, D, generator=g).to(torch.bfloat16)
    return k, v, q


def _work(i: int, shared: fp8kv.KVCache, own: fp8kv.KVCache, fp8_own: fp8kv.KVCache,
          results: list, start: threading.Barrier | None) -> None:
    """Thread ``i``'s calls: each round, write its tokens into its block of ``shared`` (one-shot) and
    into ``own``/``fp8_own`` (planned), then prefill and decode attention over ``own`` (triton) and
    FP8-mode decode over ``fp8_own`` (hopper), with lse."""
    try:
        if start is not None:
            start.wait()
        qsl = torch.tensor([0, TOKENS], dtype=torch.int32)
        tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([TOKENS], dtype=torch.int32)
        slots = torch.arange(TOKENS)
        outs = []
        for r in range(ROUNDS):
            k, v, q = _inputs(i, r)
            fp8kv.write_kv_one_shot(shared, k, v, BS * i + slots, backend="triton")
            meta = fp8kv.plan_attention(own, num_q_heads=HQ, query_dtype=k.dtype, block_tables=tables,
                                        seq_lens=lens, query_start_loc=qsl, slot_mapping=slots, backend="triton")
            fp8kv.write_kv(own, k, v, meta)
            fp8kv.write_kv_one_shot(fp8_own, k, v, slots, backend="hopper")
            outs.append(fp8kv.paged_attention_one_shot(q, own, tables, lens, query_start_loc=qsl, return_lse=True,
                                                       backend="triton"))
            outs.append(fp8kv.paged_attention_one_shot(q[-1:], own, tables, lens, return_lse=True, backend="triton"))
            outs.append(fp8kv.paged_attention_one_shot(q[-1:], fp8_own, tables, lens, return_lse=True,
                                                       fp8_attention=True, backend="hopper"))
        results[i] = outs
    except BaseException as e:  # (reported by the main thread)
        results[i] = e


def _run(concurrent: bool) -> tuple[fp8kv.KVCache, list[fp8kv.KVCache], list]:
    shared = fp8kv.KVCache.allocate(THREADS, BS, H, D, scale_granularity="token_head")
    own = [fp8kv.KVCache.allocate(1, BS, H, D) for _ in range(THREADS)]
    fp8_own = [fp8kv.KVCache.allocate(1, BS, H, D, scale_granularity="head") for _ in range(THREADS)]
    results: list = [None] * THREADS
    if concurrent:
        start = threading.Barrier(THREADS)
        threads = [threading.Thread(target=_work, args=(i, shared, own[i], fp8_own[i], results, start))
                   for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(THREADS):
            _work(i, shared, own[i], fp8_own[i], results, None)
    for i, res in enumerate(results):
        if isinstance(res, BaseException):
            raise AssertionError(f"thread {i} failed: {res!r}") from res
    return shared, own + fp8_own, results


def _bytes(cache: fp8kv.KVCache) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8) for t in (cache.key_cache, cache.value_cache, cache.k_scale,
                                                      cache.v_scale)]


def test_threads_give_the_bytes_and_outputs_of_sequential_calls():
    shared, caches, results = _run(concurrent=True)
    want_shared, want_caches, want = _run(concurrent=False)
    for a, b in zip(_bytes(shared), _bytes(want_shared), strict=True):
        assert torch.equal(a, b)
    for cache, want_cache in zip(caches, want_caches, strict=True):
        for a, b in zip(_bytes(cache), _bytes(want_cache), strict=True):
            assert torch.equal(a, b)
    for got_thread, want_thread in zip(results, want, strict=True):
        for (out, lse), (want_out, want_lse) in zip(got_thread, want_thread, strict=True):
            assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
            assert torch.equal(lse, want_lse)


def test_interpreted_kernels_launch_under_the_lock_and_compiled_ones_take_none():
    from fp8kv_triton.attention import _attn_kernel
    from fp8kv_triton.kernels import INTERPRETER_LOCK, launching
    from fp8kv_triton.serial import interpreted

    assert interpreted(_attn_kernel)
    assert launching(_attn_kernel) is INTERPRETER_LOCK
    compiled = object()  # (anything that is not an InterpretedFunction: what @triton.jit makes on a GPU)
    assert not interpreted(compiled)
    with launching(compiled):
        assert not INTERPRETER_LOCK.locked()


def test_every_launch_holds_the_lock(monkeypatch):
    """Each kernel launch of the triton and hopper backends (write, attention, split-KV merge, FP8 mode,
    the codec's) runs with the lock held."""
    from dataclasses import replace

    import fp8kv_triton.serial as serial
    from fp8kv_triton.codec import ENC_INTEGER, decode_tensor, encode_tensor
    from fp8kv_triton.kernels import choose_config, paged_attention
    from fp8kv_triton.modes import DEC_E4M3

    held: dict[str, bool] = {}
    original = serial.InterpretedFunction.run

    def run(self, *args, **kwargs):
        name = f"{self.fn.__module__}.{self.fn.__name__}"
        held[name] = held.get(name, True) and serial.INTERPRETER_LOCK.locked()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(serial.InterpretedFunction, "run", run)
    cache = fp8kv.KVCache.allocate(4, BS, H, D, scale_granularity="head")
    g = torch.Generator().manual_seed(5)
    n = 4 * BS
    k, v = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)
    fp8kv.write_kv_one_shot(cache, k, v, torch.arange(n), backend="triton")
    tables, lens = torch.arange(4, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, HQ, D, generator=g)
    fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="triton")
    fp8kv.paged_attention_one_shot(q.repeat(2, 1, 1), cache, tables, lens, query_start_loc=torch.tensor([0, 2]),
                                   backend="triton")
    config = choose_config(q.device, group=GROUP, head_size=D, num_seqs=1, num_kv_heads=H, max_query_len=1,
                           max_keys=n, interpret=True)
    paged_attention(q, cache, tables, lens, qsl, 1, D**-0.5, True, None, None, torch.empty_like(q),
                    decode_mode=DEC_E4M3, interpret=True, config=replace(config, num_splits=2, keys_per_split=n // 2))
    fp8kv.paged_attention_one_shot(q, cache, tables, lens, fp8_attention=True, backend="hopper")
    decode_tensor(encode_tensor(k, cache.fmt, ENC_INTEGER), cache.fmt, torch.float32, DEC_E4M3)
    assert set(held) == {"fp8kv_triton.write._write_kv_kernel", "fp8kv_triton.decode._decode_kernel",
                         "fp8kv_triton.attention._attn_kernel", "fp8kv_triton.attention._reduce_kernel",
                         "fp8kv_hopper.attention.fp8_attention_kernel", "fp8kv_triton.codec._encode_kernel",
                         "fp8kv_triton.codec._decode_kernel"}, held
    assert all(held.values()), held
