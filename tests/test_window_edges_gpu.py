"""The sliding window at its edges in the GPU kernels (tests/test_window_edges.py's cases on CUDA).

The same edges as on the CPU (``W`` equal to the sequence length, one less, one more, the window's
first key at a block boundary and +- 1; ``W`` = 1, ``block_size`` and ``block_size`` +- 1, and one
longer than any sequence), for decode (one query per sequence) and chunked prefill (causal, and one
non-causal step), at the GPU shapes (block size 16, head size 128, GQA 4, bfloat16 queries), plus
long sequences whose window starts at multiples of 128 keys +- 1, the boundaries of the kernels' key
tiles and KV splits. Served on every backend and mode where the GPU has them: the Triton, CUDA and
Hopper backends, the default mode against the float64 dense oracle (:mod:`dense_oracle`) and the FP8
attention mode against the reference's FP8 mode, each within its derived tolerance, and each case
checked to tell a window one key off. On an sm90 GPU the Triton and CUDA backends' default mode and
the Hopper backend's FP8 mode must be served (no skip); elsewhere a backend that cannot serve a case
is skipped with its reason.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_window_edges import (
    BIG_WINDOW,
    FP8_QUERY_SCALE,
    assert_matches_oracle,
    assert_tells_off_by_one,
    check_fp8_mode,
    make_step,
    run_public,
    window_step,
)

import fp8kv
from fp8kv.errors import Unsupported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE, HEAD, KV_HEADS, GROUP = 16, 128, 2, 4
WINDOWS = (1, PAGE - 1, PAGE, PAGE + 1, BIG_WINDOW)
BACKENDS = ("triton", "cuda", "hopper")
MODES = ("default", "fp8")
SERVED_ON_SM90 = {("triton", "default"), ("cuda", "default"), ("hopper", "fp8")}
"""What an H100 must serve here (anything else is skipped with the backend's reason)."""


@functools.cache
def gpu_step(kind: str, window: int, mode: str, long: bool = False):
    """One step per case, shared by the backends (and so is its oracle)."""
    if long:  # the window (for the query at the end) starts at 128, 384 and 768 keys, one before and one after
        lens = [window + start + d for start in (128, 384, 768) for d in (-1, 0, 1)]
        return make_step(lens, decode=kind == "decode", prefill_len=2, **gpu_shape(mode))
    return window_step(window, decode=kind == "decode", **gpu_shape(mode))


def gpu_shape(mode: str) -> dict:
    fp8 = dict(granularity="head", query_scale=FP8_QUERY_SCALE) if mode == "fp8" else {}
    return dict(block_size=PAGE, head_size=HEAD, num_kv_heads=KV_HEADS, group=GROUP, device="cuda",
                dtype=torch.bfloat16, **fp8)


def require(backend: str, mode: str, step, window: int, causal: bool = True) -> None:
    """Skip (with the backend's reason) where ``backend`` does not serve this case here; on sm90 the
    :data:`SERVED_ON_SM90` ones must be served."""
    try:
        fp8kv.plan_attention(step.cache, num_q_heads=step.query.shape[1], query_dtype=step.query.dtype,
                             sliding_window=window, causal=causal, fp8_attention=mode == "fp8", backend=backend,
                             **step.kwargs)
    except Unsupported as exc:
        if torch.cuda.get_device_capability() == (9, 0) and (backend, mode) in SERVED_ON_SM90:
            raise
        pytest.skip(f"{backend} ({mode} mode) on this GPU: {exc}")


def check(step, window: int, backend: str, mode: str, *, causal: bool = True, context: str = "") -> None:
    require(backend, mode, step, window, causal)
    if mode == "fp8":
        check_fp8_mode(step, window, backend, causal=causal, context=context)
        return
    out, lse = run_public(step, window, backend, causal=causal, lse=True)
    assert_matches_oracle(step, window, out, lse, causal=causal, context=context)
    if window != BIG_WINDOW:
        assert_tells_off_by_one(step, window, causal=causal)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_gpu_window_edges(kind, window, backend, mode):
    check(gpu_step(kind, window, mode), window, backend, mode, context=f"{backend} {mode} {kind}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_gpu_window_edges_at_tile_and_split_boundaries(kind, backend, mode):
    """Long sequences whose window starts at 128, 384 and 768 keys +- 1: key tile and KV split boundaries."""
    window = PAGE + 1
    check(gpu_step(kind, window, mode, long=True), window, backend, mode, context=f"{backend} {mode} {kind}, long")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_non_causal_prefill_window_edges(backend, mode):
    window = PAGE + 1
    check(gpu_step("prefill", window, mode), window, backend, mode, causal=False,
          context=f"{backend} {mode} non-causal")
