"""GPU: a :class:`fp8kv.KVCache` whose tensors are changed in place is refused on CUDA too, and a
CUDA graph captured over it keeps writing into the memory the cache was built over.

* The scenarios of ``tests/test_cache_integrity.py`` (a cache tensor re-pointed with ``set_`` or
  ``.data =``, resized, restrided, its storage freed or shrunk; token_head scales re-pointed), run
  with every GPU backend that serves them here (triton, cuda, hopper: each operation a backend
  serves; a backend that serves none is skipped with its reason): a named error, not one byte
  changed in the cache, its guard blocks or the canary memory around the new storage.
* CUDA-graph replay: ``write_kv`` + ``paged_attention`` captured over a cache, then its V re-pointed
  with ``set_`` to a one-block storage inside canary memory and every other reference to the old
  V memory dropped. The cache keeps that memory alive, so the replay writes there (not into
  memory handed out since, nor around the new storage), and the next eager call is refused.

Skipped without an NVIDIA CUDA GPU (the reason says so).
"""

from __future__ import annotations

import pytest
import torch
from test_cache_integrity import (
    CANARY,
    MUTATIONS,
    check_changed_cache_refused,
    check_intact_cache_served,
    decode_step,
    guarded,
    named,
    served_operations,
    set_one_block,
)

import fp8kv
from fp8kv.testing.graphs import capture

HAS_CUDA = torch.cuda.is_available() and torch.version.hip is None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA CUDA GPU")]

GPU_BACKENDS = ["triton", "cuda", "hopper"]
IO_DTYPE = torch.bfloat16


@pytest.mark.parametrize("granularity", ["tensor", "token_head"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_serve_an_intact_guarded_cache(backend, granularity):
    check_intact_cache_served(backend, granularity, "cuda", IO_DTYPE)


@pytest.mark.parametrize("check", ["full", "shapes"])
@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_operations_refuse_a_cache_tensor_changed_in_place(backend, mutation, check, monkeypatch):
    monkeypatch.setenv("FP8KV_CHECK", check)
    check_changed_cache_refused(backend, mutation, "cuda", IO_DTYPE)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_graph_replay_after_set_writes_only_memory_the_cache_keeps_alive(backend):
    g = guarded("tensor", "cuda")
    served = served_operations(backend, g.cache, IO_DTYPE)
    if "write_kv" not in served or "paged_attention" not in served:
        pytest.skip(f"{backend} does not serve both planned operations here ({sorted(served)})")
    step = decode_step(g.cache, backend, IO_DTYPE, served["paged_attention"])
    out = torch.empty_like(step["query"])

    def run() -> None:
        fp8kv.write_kv(g.cache, step["key"], step["value"], step["meta"])
        fp8kv.paged_attention(step["query"], g.cache, step["meta"], out=out)

    graph = capture(run)  # warmed up (kernels compiled) off the capturing stream, then captured
    torch.cuda.synchronize()
    eager_out = out.clone()
    key_parent = g.parents["key"]
    g.freeze()  # the cache's bytes as the warm-up left them; a replay rewrites the same values

    set_one_block(g)  # V now one block inside canary memory ("arena", watched)
    del g.watched["value"], g.parents["value"]  # the cache's own reference is the only one left
    # were the old V memory freed, the caching allocator would hand its block to this same-size request
    g.watch("decoy", torch.full_like(key_parent, CANARY))

    graph.replay()
    torch.cuda.synchronize()
    g.assert_unchanged()  # K and its guards, the canary memory around V's new storage, the decoy
    torch.testing.assert_close(out, eager_out)  # the replay attended over the same (kept) memory
    named("cache.value_cache", run)  # eager calls after the change are refused
