"""Cache write, decode and chunked prefill against bf16 SDPA and the roofline (``fp8kv bench``).

Backend-agnostic (any registered backend, through the registry), CUDA only. In one run it
measures the device's copy bandwidth (a large device-to-device copy, bytes read plus
written) and then, for the chosen backend:

* **copy**: the faster of a ``copy_`` (memcpy) and an elementwise copy kernel, 1 GiB;
* **write**: 16k tokens x 8 KV heads x 128 (bf16 in) quantized into an FP8 cache, in GB/s
  (bytes read + written) and as a fraction of the copy bandwidth;
* **decode**: (B, L) in (32, 4096), (8, 32768), (64, 2048), (1, 131072) with Hq=32, H=8,
  D=128, block size 16, against ``torch.nn.functional.scaled_dot_product_attention`` on
  contiguous bf16 K/V (``enable_gqa=True``), against the FP8 roofline (KV bytes / copy
  bandwidth) and, when ``flashinfer`` is importable, against FlashInfer's FP8 decode on the same
  cache bytes (:func:`flashinfer_decode`; outputs compared before timing);
* **prefill**: 4 sequences x 2048 new tokens over 2048 cached, against SDPA causal bf16
  (bottom-right aligned, as chunked prefill is).

Times: ``kernel`` is the backend hook called directly with a metadata planned once
(``fp8kv.plan_attention(..., validate=False)``) and timed as CUDA graph replays; ``api``
the public per-layer call (``fp8kv.write_kv`` / ``fp8kv.paged_attention`` with that
metadata) in eager mode; value checks, which synchronise, are never timed (the metadata is
planned with ``validate=False``); ``sdpa`` the baseline timed like ``kernel``.
Medians over repeats, after warm-up; inputs rotate where they could sit in L2.

This harness lives outside the ``fp8kv`` package (``benchmarks/fp8kv_bench``, installed as
the top-level package ``fp8kv_bench``); ``fp8kv bench`` and ``benchmarks/bench_triton.py``
drive it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

PARTS = ("write", "decode", "prefill")
DECODE_SHAPES = ((32, 4096), (8, 32768), (64, 2048), (1, 131072))
HQ, HKV, HEAD, PAGE = 32, 8, 128, 16


# ------------------------------------------------------------------------------ timing


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
    from fp8kv.hookspecs import Request
    from fp8kv.registry import select_backend

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


def decode_case(B: int, L: int, device, writer: str = "cuda", kv_dtype: str = "fp8_e4m3", head_size: int = HEAD,
                group: int = HQ // HKV):
    """The decode benchmarks' step: a per-tensor-scaled cache (0.05) over a random permutation of blocks,
    written with random bf16 K/V by backend ``writer``, B sequences of L tokens, bf16 queries
    ``[B, HKV * group, head_size]`` (HQ heads by default).
    Returns ``(cache, block_tables, seq_lens, query_start_loc, query)``."""
    import fp8kv

    gen = torch.Generator().manual_seed(1)
    tables, nblocks = _paged_tables(B, L, device, gen)
    cache = fp8kv.KVCache.allocate(nblocks, PAGE, HKV, head_size, kv_dtype=kv_dtype, k_scale=0.05, v_scale=0.05,
                                   device=device)
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


def bench_write(name: str, kv_dtype: str, device, bw: float, reps: int, granularity: str = "tensor") -> dict:
    import fp8kv

    T = 16384
    gen = torch.Generator().manual_seed(0)
    kw = {} if granularity == "token_head" else {"k_scale": 0.05, "v_scale": 0.05}
    cache = fp8kv.KVCache.allocate(T // PAGE, PAGE, HKV, HEAD, kv_dtype=kv_dtype,
                                   scale_granularity=granularity, device=device, **kw)
    sets = []
    for _ in range(3):  # rotate inputs so they do not sit in L2
        k = torch.randn(T, HKV, HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
        v = torch.randn(T, HKV, HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
        slots = torch.randperm(T, generator=gen).to(device)
        sets.append((k, v, slots))
    # One sequence over every block, T new tokens: a step whose metadata carries the slots
    # (planned without value checks, so neither timed call synchronises).
    tables = torch.arange(T // PAGE, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([T], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=device)
    metas = [fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=tables,
                                  seq_lens=lens, query_start_loc=qsl, slot_mapping=s, num_tokens=T,
                                  max_query_len=T, max_seq_len=T, validate=False, backend=name)
             for _, _, s in sets]
    backend = metas[0].write.backend
    it = [0]

    def kernel() -> None:
        k, v, s = sets[it[0] % 3]
        it[0] += 1
        backend.write_kv(cache, k, v, s)

    def api() -> None:
        i = it[0] % 3
        k, v, _ = sets[i]
        it[0] += 1
        fp8kv.write_kv(cache, k, v, metas[i])

    ms = time_graph(kernel, calls=6, reps=reps)
    ms_api = time_eager(api, reps=reps)
    nbytes = 2 * T * HKV * HEAD * 2 + 2 * T * HKV * HEAD + T * 8
    if granularity == "token_head":
        nbytes += 2 * T * HKV * 4
    gbs = nbytes / (ms * 1e-3) / 1e9
    return {"part": "write", "backend": backend.name, "granularity": granularity, "tokens": T,
            "bytes": nbytes, "kernel_ms": ms, "api_ms": ms_api, "gbps": gbs, "copy_gbps": bw,
            "frac_copy": gbs / bw}


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


def bench_decode(name: str, kv_dtype: str, device, bw: float, reps: int, B: int, L: int) -> dict:
    import fp8kv

    cache, tables, seq_lens, _, query = decode_case(B, L, device, writer=name, kv_dtype=kv_dtype)
    out = torch.empty_like(query)
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=tables,
                                seq_lens=seq_lens, max_seq_len=L, validate=False, backend=name)
    backend = meta.attention.backend

    def kernel() -> None:
        backend.paged_attention(query, cache, meta, out, None)

    def api() -> None:
        fp8kv.paged_attention(query, cache, meta, out=out)

    ms = time_graph(kernel, reps=reps)
    ms_api = time_eager(api, reps=reps)
    k = torch.randn(B, HKV, L, HEAD, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, L, HEAD, device=device, dtype=torch.bfloat16)
    q4 = query.view(B, HQ, 1, HEAD)
    ms_sdpa = time_graph(lambda: _sdpa(q4, k, v, enable_gqa=True), reps=reps)
    kv_bytes = decode_kv_bytes(B, L)
    roof_ms = roofline_ms(kv_bytes, bw)
    row = {"part": "decode", "backend": backend.name, "B": B, "L": L, "Hq": HQ, "Hkv": HKV, "D": HEAD,
           "block_size": PAGE, "kernel_ms": ms, "api_ms": ms_api, "sdpa_bf16_ms": ms_sdpa,
           "speedup_vs_sdpa": ms_sdpa / ms, "api_speedup_vs_sdpa": ms_sdpa / ms_api,
           "fp8_roofline_ms": roof_ms, "frac_roofline": roof_ms / ms,
           "sdpa_frac_bf16_roofline": 2 * roof_ms / ms_sdpa, "kv_bytes": kv_bytes}
    peer = flashinfer_decode(cache, tables, L, query)
    if peer is not None:  # the same cache bytes; outputs compared before timing
        run, peer_out = peer
        kernel()
        run()
        torch.cuda.synchronize()
        row["flashinfer_max_abs_diff"] = (peer_out.float() - out.float()).abs().max().item()
        row["flashinfer_fp8_ms"] = time_graph(run, reps=reps)
        row["speedup_vs_flashinfer"] = row["flashinfer_fp8_ms"] / ms
    return row


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


def bench_prefill(name: str, kv_dtype: str, device, reps: int, seqs: int = 4, new: int = 2048,
                  cached: int = 2048) -> dict:
    import fp8kv

    gen = torch.Generator().manual_seed(2)
    L = new + cached
    tables, nblocks = _paged_tables(seqs, L, device, gen)
    cache = fp8kv.KVCache.allocate(nblocks, PAGE, HKV, HEAD, kv_dtype=kv_dtype, k_scale=0.05, v_scale=0.05,
                                   device=device)
    _fill_cache(cache, _backend(name, "write_kv", cache, torch.bfloat16, device), nblocks * PAGE, device, gen)
    T = seqs * new
    query = torch.randn(T, HQ, HEAD, generator=gen).to(device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((seqs,), L, dtype=torch.int32, device=device)
    qsl = torch.arange(0, T + 1, new, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    meta = fp8kv.plan_attention(cache, num_q_heads=HQ, query_dtype=torch.bfloat16, block_tables=tables,
                                seq_lens=seq_lens, query_start_loc=qsl, num_tokens=T, max_query_len=new,
                                max_seq_len=L, validate=False, backend=name)
    backend = meta.attention.backend

    def kernel() -> None:
        backend.paged_attention(query, cache, meta, out, None)

    def api() -> None:
        fp8kv.paged_attention(query, cache, meta, out=out)

    ms = time_graph(kernel, calls=3, reps=reps)
    ms_api = time_eager(api, reps=reps, inner=3)
    q = query.view(seqs, new, HQ, HEAD).transpose(1, 2).contiguous()
    k = torch.randn(seqs, HKV, L, HEAD, device=device, dtype=torch.bfloat16)
    v = torch.randn(seqs, HKV, L, HEAD, device=device, dtype=torch.bfloat16)
    variant = "flash lower-right, enable_gqa"
    try:
        ms_sdpa = time_graph(lambda: causal_sdpa_bf16(q, k, v), calls=3, reps=reps)
    except RuntimeError:  # GQA not accepted with a lower-right mask: expand K/V once, outside timing
        variant = "lower-right, K/V expanded to the query heads"
        group = HQ // HKV
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        ms_sdpa = time_graph(lambda: causal_sdpa_bf16(q, k, v), calls=3, reps=reps)
    flops = causal_prefill_flops(seqs, new, cached)
    return {"part": "prefill", "backend": backend.name, "seqs": seqs, "new": new, "cached": cached,
            "kernel_ms": ms, "api_ms": ms_api, "sdpa_bf16_ms": ms_sdpa, "sdpa_variant": variant,
            "speedup_vs_sdpa": ms_sdpa / ms, "tflops": flops / (ms * 1e-3) / 1e12,
            "sdpa_tflops": flops / (ms_sdpa * 1e-3) / 1e12}


def save_rows(path: str | None, device, rows: list[dict], **extra) -> None:
    """Write ``{"environment": environment(device) + extra, "rows": rows}`` to ``path`` as JSON (None:
    nothing)."""
    import json

    if path:
        with open(path, "w") as f:
            json.dump({"environment": {**environment(device), **extra}, "rows": rows}, f, indent=1)


def environment(device) -> dict:
    import datetime

    import fp8kv

    info = {"device": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "torch": torch.__version__, "cuda": torch.version.cuda, "fp8kv": fp8kv.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def format_table(results: list[dict]) -> str:
    """A short plain-text table of the results (ratios against the same-run baselines)."""
    lines = []
    for r in results:
        if r["part"] == "write":
            lines.append(f"write {r['granularity']:<10} {r['tokens']} tok: "
                         f"kernel {r['kernel_ms'] * 1e3:7.1f} us api {r['api_ms'] * 1e3:7.1f} us  "
                         f"{r['gbps']:7.0f} GB/s = "
                         f"{100 * r['frac_copy']:5.1f}% of copy ({r['copy_gbps']:.0f} GB/s)")
        elif r["part"] == "decode":
            lines.append(f"decode B={r['B']:<3} L={r['L']:<6}: kernel {r['kernel_ms'] * 1e3:7.1f} us "
                         f"api {r['api_ms'] * 1e3:7.1f} us  sdpa bf16 {r['sdpa_bf16_ms'] * 1e3:7.1f} us  "
                         f"{r['speedup_vs_sdpa']:4.2f}x vs bf16, "
                         f"{100 * r['frac_roofline']:5.1f}% of fp8 roofline"
                         + (f", FlashInfer fp8 {r['flashinfer_fp8_ms'] * 1e3:7.1f} us "
                            f"({r['speedup_vs_flashinfer']:4.2f}x)" if "flashinfer_fp8_ms" in r else ""))
        elif r["part"] == "prefill":
            lines.append(f"prefill {r['seqs']}x{r['new']} over {r['cached']}: "
                         f"kernel {r['kernel_ms']:6.3f} ms api {r['api_ms']:6.3f} ms  "
                         f"sdpa bf16 {r['sdpa_bf16_ms']:6.3f} ms  "
                         f"{r['speedup_vs_sdpa']:4.2f}x vs bf16 "
                         f"({r['tflops']:.0f} vs {r['sdpa_tflops']:.0f} TFLOP/s)")
    return "\n".join(lines)


def run_all(name: str, kv_dtype: str, device, parts=PARTS, reps: int = 20) -> dict:
    """Every benchmark of ``parts`` for backend ``name``; returns the JSON-able record.

    Value checks are never timed: every metadata is planned with ``validate=False``.
    """
    copy = copy_bandwidth(device)
    bw = copy["gbps"]
    results = []
    if "write" in parts:
        for gran in ("tensor", "token_head"):
            results.append(bench_write(name, kv_dtype, device, bw, reps, gran))
    if "decode" in parts:
        for B, L in DECODE_SHAPES:
            results.append(bench_decode(name, kv_dtype, device, bw, reps, B, L))
            torch.cuda.empty_cache()
    if "prefill" in parts:
        results.append(bench_prefill(name, kv_dtype, device, reps))
    return {"env": environment(device), "copy_gbps": bw, "copy": copy, "kv_dtype": kv_dtype,
            "results": results}

