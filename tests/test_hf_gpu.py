"""The transformers cache on an NVIDIA GPU: a static decode step captured in a CUDA graph.

Skipped (by exact capability) where there is no NVIDIA GPU of sm80+ (the Triton backend that
serves bf16 attention over the FP8 cache) or no transformers. What it proves:

* a static decode step (``FP8PagedCache(static=True)``) runs with
  ``torch.cuda.set_sync_debug_mode("error")``: no host synchronisation;
* it can be captured in a CUDA graph, and each replay gives the logits of the same step run
  eagerly on an identical cache (the graph advances the cache on the device), with and without
  sink tokens and K centering.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the optional extra 'hf' (transformers)")

import fp8kv  # noqa: E402
from fp8kv.integrations.transformers import FP8PagedCache, enable  # noqa: E402

HAS_SM80 = (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
            and not torch.version.hip)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_SM80, reason="needs an NVIDIA GPU sm80+ (Triton "
                                                                         "bf16 attention over the FP8 cache)")]


def model_and_prompt():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(3, 256, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return model, ids


def decode(model, cache, tok, pos):
    return model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos,
                 position_ids=pos.expand(tok.shape[0], 1), logits_to_keep=1).logits


@pytest.mark.parametrize("kw", [{}, {"sink_tokens": 1, "k_centering": "prefill"}])
@torch.inference_mode()
def test_static_decode_step_is_sync_free_and_capturable(kw):
    model, ids = model_and_prompt()
    caches = []
    for _ in range(2):  # the captured one, and an identical one run eagerly
        cache = enable(model, max_cache_len=128, static=True, **kw)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        caches.append(cache)
    graph_cache, eager_cache = caches
    assert graph_cache.layer_cache(0).spec == eager_cache.layer_cache(0).spec
    tok = torch.full((2, 1), 7, device="cuda")
    pos = torch.tensor([40], device="cuda")
    for cache in caches:  # the first decode step copies the rows to the device (eager, outside the graph)
        decode(model, cache, tok, pos)
    pos += 1
    assert graph_cache.layer_cache(0) is not None and fp8kv.available_backends()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode(model, eager_cache, tok, pos)  # a sync-free eager step (raises on any host sync)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    static_pos = pos.clone()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        logits = decode(model, graph_cache, tok, static_pos)
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()  # the graph's step: the same as the eager cache's step above
    torch.cuda.synchronize()
    eager_pos = pos.clone()
    for _ in range(3):  # further steps: replay vs eager
        static_pos += 1
        eager_pos += 1
        graph.replay()
        want = decode(model, eager_cache, tok, eager_pos)
        torch.cuda.synchronize()
        torch.testing.assert_close(logits.float(), want.float(), atol=2e-2, rtol=2e-2)
    graph_cache.replayed(4 - 1)  # the capture counted once on the host, the 4 replays on the device
    assert graph_cache.seq_lens == eager_cache.seq_lens
    assert isinstance(graph_cache, FP8PagedCache)
