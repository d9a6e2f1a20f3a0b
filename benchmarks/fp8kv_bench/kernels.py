"""The GPU harness every kernel benchmark shares: timing, the copy-bandwidth roofline, workloads, baselines.

* **timing**: :func:`time_graph` (median milliseconds per call from CUDA-graph replays of several calls,
  after warm-up on a side stream: launch cost left out, as an engine replaying a captured step sees it)
  and :func:`time_eager` (calls launched one by one: host cost included);
* **roofline**: :func:`copy_bandwidth` (the faster of a memcpy and an elementwise copy of 1 GiB, bytes
  read plus written); a decode step's FP8 roofline is its K/V bytes over that bandwidth
  (:func:`roofline_ms`);
* **workloads**: caches over a random permutation of blocks (:func:`decode_case`, :func:`prefill_case`),
  GQA 32/8, head size 128, block 16 unless asked otherwise;
* **baselines** on the same data: ``scaled_dot_product_attention`` on contiguous bf16 K/V (decode with
  ``enable_gqa``, :func:`causal_sdpa_bf16` for prefill), and FlashInfer where importable: its FP8 decode on
  the cache's own bytes (:func:`flashinfer_decode`) and its bf16 paged prefill (:func:`flashinfer_prefill`).

This harness lives outside the ``fp8kv`` package (``benchmarks/fp8kv_bench``, installed as the
top-level package ``fp8kv_bench``); importing it does not touch CUDA.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

DECODE_SHAPES = ((32, 4096), (8, 32768), (64, 2048), (1, 131072))
HQ, HKV, HEAD, PAGE = 32, 8, 128, 16


# ------------------------------------------------------------------------------ timing


def cuda_device(what: str) -> torch.device:
    """The current CUDA device; SystemExit naming ``what`` needs one when there is none."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA device (none is available here; torch {torch.__version__})")
    return torch.device("cuda", torch.cuda.current_device())


def decode_kv_bytes(B: int, L: int, head_size: int = HEAD) -> int:
    """K and V code bytes a decode step of B sequences of L tokens reads (HKV heads, one byte a value)."""
    return 2 * B * L * HKV * head_size


def roofline_ms(nbytes: int, gbps: float) -> float:
    """Milliseconds to move ``nbytes`` at ``gbps`` (the copy bandwidth: the FP8 roofline of a decode step)."""
    return nbytes / (gbps * 1e9) * 1e3


def decode_shapes(spec: str) -> list[tuple[int, int]]:
    """``"B:L,B:L,..."`` (a benchmark's ``--shapes``) as (B, L) pairs; empty: :data:`DECODE_SHAPES`."""
    return [tuple(map(int, s.split(":"))) for s in spec.split(",") if s] or list(DECODE_SHAPES)


def time_graph(fn: Callable[[], object], *, calls: int = 10, reps: int = 20) -> float:
    """Median milliseconds per ``fn()`` call, from CUDA-graph replays of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _median_events(graph.replay, reps) / calls


def untimed(fn: Callable[[], object], calls: int = 3) -> None:
    """``calls`` untimed calls of ``fn`` (a profiler skips the first: ``ncu --launch-skip 1 --launch-count 1``)."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()


def time_eager(fn: Callable[[], object], *, reps: int = 20, inner: int = 10) -> float:
    """Median milliseconds per ``fn()`` launched eagerly (host launch cost included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def burst() -> None:
        for _ in range(inner):
            fn()

    return _median_events(burst, reps) / inner


def _median_events(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    Two copies of ``nbytes``: ``copy_`` (the driver's memcpy) and an elementwise kernel
    (``torch.mul(x, 1, out=y)`` on float32); ``gbps`` is the faster, the stricter roofline.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    memcpy = 2 * nbytes / (time_graph(lambda: dst.copy_(src), calls=4, reps=reps) * 1e-3) / 1e9
    a, b = src.view(torch.float32), dst.view(torch.float32)
    a.copy_(torch.randn(a.shape, device=device))
    kernel = 2 * nbytes / (time_graph(lambda: torch.mul(a, 1.0, out=b), calls=4, reps=reps) * 1e-3) / 1e9
    return {"gbps": max(memcpy, kernel), "memcpy_gbps": memcpy, "elementwise_gbps": kernel}


# ------------------------------------------------------------------------------ workloads


def _backend(name: str, request_op: str, cache, io_dtype, device, features=frozenset()):
    """The backend that serves ``request_op`` (``"write_kv"`` or ``"paged_attention"``) on ``cache``."""
    from fp8kv.registry import select_backend
    from fp8kv.request import Request

    if request_op == "write_kv":
        req = Request.for_write(cache.spec, io_dtype)
    else:
        req = Request.for_attention(cache.spec, io_dtype, frozenset(features))
    return select_backend(req, device, name).backend


def _paged_tables(num_seqs: int, seq_len: int, device, gen) -> tuple[torch.Tensor, int]:
    """Block tables ``[num_seqs, blocks]`` over a random permutation of all blocks."""
    blocks = math.ceil(seq_len / PAGE)
    perm = torch.randperm(num_seqs * blocks, generator=gen).to(torch.int32)
    return perm.view(num_seqs, blocks).to(device), num_seqs * blocks


def decode_case(B: int, L: int, device, writer: str = "auto", kv_dtype: str = "fp8_e4m3", head_size: int = HEAD,
                group: int = HQ // HKV, granularity: str = "tensor"):
    """The decode benchmarks' step: a cache over a random permutation of blocks (static scales 0.05, or
    per-token-head ones with ``granularity="token_head"``), written with random bf16 K/V by backend
    ``writer``, B sequences of L tokens, bf16 queries ``[B, HKV * group, head_size]`` (HQ heads by default).
    Returns ``(cache, block_tables, seq_lens, query_start_loc, query)``."""
    import fp8kv

    gen = torch.Generator().manual_seed(1)
    tables, nblocks = _paged_tables(B, L, device, gen)
    scales = {} if granularity == "token_head" else {"k_scale": 0.05, "v_scale": 0.05}
    cache = fp8kv.KVCache.allocate(nblocks, PAGE, HKV, head_size, kv_dtype=kv_dtype, scale_granularity=granularity,
                                   device=device, **scales)
    _fill_cache(cache, _backend(writer, "write_kv", cache, torch.bfloat16, device), nblocks * PAGE, device, gen)
    q = torch.randn(B, HKV * group, head_size, generator=gen).to(device=device, dtype=torch.bfloat16)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    return cache, tables, lens, torch.arange(B + 1, dtype=torch.int32, device=device), q


def _fill_cache(cache, backend, num_tokens: int, device, gen) -> None:
    """Write random bf16 K/V into the first ``num_tokens`` slots, in chunks."""
    chunk = 1 << 16
    for lo in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - lo)
        k = torch.randn(n, HKV, cache.head_size, generator=gen).to(device=device, dtype=torch.bfloat16)
        v = torch.randn(n, HKV, cache.head_size, generator=gen).to(device=device, dtype=torch.bfloat16)
        slots = torch.arange(lo, lo + n, device=device)
        backend.write_kv(cache, k, v, slots)


def _sdpa(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def flashinfer_decode(cache, block_tables: torch.Tensor, seq_len: int, query: torch.Tensor):
    """FlashInfer's FP8 paged decode (tensor-core path) over ``cache``'s own bytes, or None.

    ``cache``: an NHD e4m3 per-tensor :class:`fp8kv.KVCache` (FlashInfer's NHD paged layout
    ``[pages, page_size, H, D]`` is the same memory); ``block_tables [B, pages]`` with every
    sequence ``seq_len`` tokens long; ``query [B, Hq, D]`` bfloat16. Returns ``(run, out)``:
    ``run()`` writes FlashInfer's output into ``out``, planned once here (None when FlashInfer
    is not importable, the cache is not NHD e4m3 per-tensor, or its plan refuses the shape).
    """
    try:
        import flashinfer
    except ImportError:
        return None
    if cache.layout != "NHD" or cache.kv_dtype != "fp8_e4m3" or cache.scale_granularity != "tensor":
        return None
    B, pages = block_tables.shape
    page = cache.block_size
    dev = query.device
    indptr = torch.arange(0, B + 1, dtype=torch.int32, device=dev) * pages
    indices = block_tables.reshape(-1).to(torch.int32).contiguous()
    last = torch.full((B,), seq_len - (pages - 1) * page, dtype=torch.int32, device=dev)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, indices, last, query.shape[1], cache.num_kv_heads, cache.head_size, page,
                 q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    kc, vc = cache.key_cache, cache.value_cache
    ks, vs = float(cache.k_scale), float(cache.v_scale)
    out = torch.empty_like(query)
    return (lambda: wrapper.run(query, (kc, vc), k_scale=ks, v_scale=vs, out=out)), out


def causal_sdpa_bf16(q, k, v, gqa: bool = True):
    """SDPA causal with the bottom-right alignment of chunked prefill (q shorter than k).

    ``gqa=False`` expands K/V to the query heads first (same arithmetic).
    """
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[-2], k.shape[-2])
    if not gqa:
        group = q.shape[1] // k.shape[1]
        return _sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
    return _sdpa(q, k, v, attn_mask=mask, enable_gqa=True)


def causal_prefill_flops(seqs: int, new: int, cached: int, q_heads: int = HQ, head_size: int = HEAD) -> int:
    """Useful FLOPs of a causal prefill of ``new`` queries a sequence over ``cached`` keys: ``Q K^T`` and ``P V``
    over the visible (query, key) pairs only, ``4 head_size`` each."""
    visible = seqs * q_heads * (new * cached + new * (new + 1) // 2)
    return 4 * visible * head_size


def prefill_case(device, seqs: int, new: int, cached: int, gen, writer: str = "auto"):
    """The prefill benchmarks' step: ``seqs`` sequences of ``new`` tokens over ``cached`` cached ones in an
    e4m3 cache with random per-KV-head scales (0.03-0.07), written with random bf16 K/V by backend
    ``writer``; bf16 queries. Returns ``(cache, block_tables, query, seq_lens, query_start_loc, flops)``."""
    import fp8kv

    L = new + cached
    tables, nblocks = _paged_tables(seqs, L, device, gen)
    cache = fp8kv.KVCache.allocate(nblocks, PAGE, HKV, HEAD, kv_dtype="fp8_e4m3", scale_granularity="head",
                                   k_scale=(0.03 + 0.04 * torch.rand(HKV, generator=gen)).to(device),
                                   v_scale=(0.03 + 0.04 * torch.rand(HKV, generator=gen)).to(device), device=device)
    _fill_cache(cache, _backend(writer, "write_kv", cache, torch.bfloat16, device), nblocks * PAGE, device, gen)
    T = seqs * new
    query = torch.randn(T, HQ, HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((seqs,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32, device=device)
    return cache, tables, query, seq_lens, qsl, causal_prefill_flops(seqs, new, cached)


def flashinfer_prefill(cache, block_tables: torch.Tensor, query: torch.Tensor, query_start_loc: torch.Tensor):
    """FlashInfer's paged prefill with bf16 queries over a bf16 copy of ``cache`` (its FA3 path on sm90), or
    None when FlashInfer is not importable. Every sequence fills all its blocks. Returns ``(run, out)``."""
    try:
        import flashinfer
    except ImportError:
        return None
    device = query.device
    seqs, nblk = block_tables.shape
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    kb = (cache.key_cache.to(torch.bfloat16) * 0.05).contiguous()
    vb = (cache.value_cache.to(torch.bfloat16) * 0.05).contiguous()
    indptr = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * nblk
    last = torch.full((seqs,), cache.block_size, dtype=torch.int32, device=device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(query_start_loc, indptr, block_tables.reshape(-1).contiguous(), last, query.shape[1],
           cache.num_kv_heads, cache.head_size, cache.block_size, causal=True, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    out = w.run(query, (kb, vb))
    return (lambda: w.run(query, (kb, vb))), out


def environment(device) -> dict:
    """The run's device, versions and date (:func:`fp8kv_bench.results.environment`)."""
    from .results import environment as env

    return env(device)


def save_rows(path: str | None, device, rows: list[dict], **extra) -> None:
    """Write ``{"command", "environment": environment(device) + extra, "rows": rows}`` to ``path`` as JSON
    (None: nothing)."""
    from .results import command, write_json

    if path:
        write_json(path, {"command": command(), "environment": {**environment(device), **extra}, "rows": rows})


