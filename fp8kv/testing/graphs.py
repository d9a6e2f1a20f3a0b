"""CUDA-graph capture for tests: an engine replays fp8kv's calls from a graph, so a backend's
launches must capture and replay to the same bits as eager calls."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run ``fn`` once on a side stream (warm-up: compiles and allocations happen outside the capture),
    then capture it in a CUDA graph; returns the graph, not yet replayed (e.g. for a metadata update
    between capture and replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def capture_and_replay(fn: Callable[[], object], out: torch.Tensor) -> torch.Tensor:
    """:func:`capture` ``fn`` (which writes ``out``), zero ``out`` and replay the graph once. Returns
    ``out`` as the replay left it (compare it with an eager result)."""
    graph = capture(fn)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out
