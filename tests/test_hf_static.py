"""``FP8PagedCache(static=True)``: decode steps with fixed shapes and the row state on the device.

On the CPU: the static path gives the same logits as the host path (padding, block boundaries,
batch surgery, sink tokens and K centering), never touches the host-side paging in a decode step,
and keeps the host's counters right through :meth:`FP8PagedCache.replayed`. CUDA-graph capture is
checked on a GPU by tests/test_hf_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the optional extra 'hf' (transformers)")

from test_hf_integration import padded_batch, teacher_forced_logits, tiny_llama  # noqa: E402

import fp8kv  # noqa: E402
from fp8kv.integrations import _paging, _sinks  # noqa: E402
from fp8kv.integrations.transformers import FP8PagedCache, enable  # noqa: E402

BACKEND = "torch" if "torch" in fp8kv.available_backends() else "reference"


def no_host_paging(monkeypatch):
    """Make the host-side step planning raise: a static decode step must not reach it."""
    def boom(*a, **k):
        raise AssertionError("host paging used in a static decode step")
    monkeypatch.setattr(_paging.BlockPool, "step", boom)
    monkeypatch.setattr(_sinks.SinkState, "begin_step", boom)


@pytest.mark.parametrize("kw", [{}, {"sink_tokens": 2, "k_centering": "prefill"}, {"k_centering": "prefill"}])
@torch.no_grad()
def test_static_decode_equals_the_host_path(kw, monkeypatch):
    model = tiny_llama()
    ids, mask = padded_batch()
    dyn = enable(model, block_size=4, backend=BACKEND, max_cache_len=32, **kw)
    want = teacher_forced_logits(model, dyn, ids, mask, n_decode=9)  # crosses block boundaries
    static = FP8PagedCache.from_model(model, static=True)
    first = model(input_ids=ids, attention_mask=mask, past_key_values=static, use_cache=True).logits
    got = [first]
    no_host_paging(monkeypatch)
    for t in range(9):
        step = torch.full((2, 1), 10 + t)
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        got.append(model(input_ids=step, attention_mask=mask, past_key_values=static, use_cache=True).logits)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"step {i}")
    monkeypatch.undo()
    assert static.seq_lens == dyn.seq_lens == [7 + 9, 4 + 9]
    assert static.layers[0].get_seq_length() == 7 + 9


@torch.no_grad()
def test_static_after_surgery_and_a_second_prefill_chunk():
    model = tiny_llama()
    ids, mask = padded_batch()
    caches = [enable(model, block_size=4, backend=BACKEND, max_cache_len=40),
              FP8PagedCache(model.config, block_size=4, backend=BACKEND, max_cache_len=40, static=True)]
    outs = []
    for cache in caches:
        m = mask
        o = [model(input_ids=ids, attention_mask=m, past_key_values=cache, use_cache=True).logits]
        for t in range(3):
            step = torch.full((2, 1), 20 + t)
            m = torch.cat([m, torch.ones_like(step)], 1)
            o.append(model(input_ids=step, attention_mask=m, past_key_values=cache, use_cache=True).logits)
        cache.reorder_cache(torch.tensor([1, 1]))  # a copied row gets blocks of its own
        cache.crop(-2)
        m = torch.cat([m[1:2], m[1:2]], 0)[:, :-2]
        chunk = torch.tensor([[5, 6, 7], [8, 9, 10]])
        m = torch.cat([m, torch.ones_like(chunk)], 1)
        o.append(model(input_ids=chunk, attention_mask=m, past_key_values=cache, use_cache=True).logits)
        for t in range(5):
            step = torch.full((2, 1), 30 + t)
            m = torch.cat([m, torch.ones_like(step)], 1)
            o.append(model(input_ids=step, attention_mask=m, past_key_values=cache, use_cache=True).logits)
        outs.append(o)
    for i, (w, g) in enumerate(zip(*outs, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"step {i}")
    assert caches[0].seq_lens == caches[1].seq_lens


@torch.no_grad()
def test_static_bounds_and_arguments():
    model = tiny_llama()
    with pytest.raises(fp8kv.InvalidArgument, match="static"):
        enable(model, static=True)  # no max_cache_len
    with pytest.raises(fp8kv.InvalidArgument, match="static"):
        enable(model, static=1, max_cache_len=8)
    cache = enable(model, block_size=4, backend=BACKEND, max_cache_len=6, static=True)
    model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), past_key_values=cache, use_cache=True)
    model(input_ids=torch.tensor([[8]]), past_key_values=cache, use_cache=True)
    with pytest.raises(fp8kv.Fp8KVError, match="max_cache_len"):
        model(input_ids=torch.tensor([[9]]), past_key_values=cache, use_cache=True)
    with pytest.raises(fp8kv.Fp8KVError, match="not static"):
        FP8PagedCache(model.config, max_cache_len=8).replayed(1)
    with pytest.raises(fp8kv.InvalidArgument, match="steps"):
        cache.replayed(-1)


@torch.no_grad()
def test_replayed_advances_the_host_counters():
    model = tiny_llama()
    cache = enable(model, block_size=4, backend=BACKEND, max_cache_len=16, static=True)
    model(input_ids=torch.tensor([[3, 4, 5]]), past_key_values=cache, use_cache=True)
    model(input_ids=torch.tensor([[8]]), past_key_values=cache, use_cache=True)
    # what a replay does on the device: run the static state's step without the model
    cache.static.begin_step(None, 1, torch.device("cpu"))
    cache.static.upper -= 1  # begin_step counted it already; replayed() is what a graph user calls
    cache.static.device_steps -= 1
    cache.pool.steps -= 1
    cache.replayed(1)
    assert cache.layers[0].get_seq_length() == 5 and cache.seq_lens == [5]
