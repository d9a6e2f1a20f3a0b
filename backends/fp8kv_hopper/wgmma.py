"""The FP8-mode chunked prefill in CUDA on sm_90a (``csrc/fp8_prefill.cu``): warp-specialized,
e4m3 wgmma for both products.

Why CUDA here when the rest of the backend is Triton: Triton 3.6 waits for each wgmma right after
issuing it and offers no warp specialization on sm90, so its kernel is latency-bound at 0.56x
FlashInfer's FA3 (docs/fp8_attention.md). This kernel gives a producer warpgroup the loads (TMA,
one box per page, where :func:`tma_maps` can describe the cache; else cp.async) and the V transpose
(so ``p8 @ v8`` runs on e4m3 tensor cores too) and two consumer warpgroups the products and the
softmax, and is compiled through the CUDA backend's public runtime (:mod:`fp8kv_cuda.kernels`: NVRTC
through CuPy, cached per process; ``sm_90a``, which ``wgmma`` needs; TMA descriptors from its
``tensor_map_uint8``).

Serves (:func:`why_not` says why not): prefill steps (``max_query_len > 1``, one split) of an e4m3fn cache with
per-tensor or per-head scales, head size 128, no soft-cap, float16/bfloat16/float32 queries with the
output in the same type, on an sm90 GPU with CuPy. Everything else goes to the Triton kernel of
:mod:`fp8kv_hopper.attention`, which computes the same definition. The default where it serves
(``Fp8AttnConfig(kernel="auto")``); tests/test_hopper_gpu.py holds its GPU tests.
"""

from __future__ import annotations

import ctypes
import functools
from importlib import resources

import torch

from fp8kv.errors import InvalidArgument
from fp8kv.fp8_attention import lazy_threshold
from fp8kv.probe import probe

THREADS = 384
BLOCK_M = 128
BLOCK_N = 128
STAGES = 4
HEAD_SIZE = 128
QUERY_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ENTRY = "fp8kv_fp8_prefill"
LAYOUT_TEST = "fp8kv_wgmma_layout_test"
OPTIONS = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
"""IEEE division (``q / q_scale`` must round as the cache's quantization) and float32 subnormals."""


def smem_bytes(stages: int = STAGES) -> int:
    """``sizeof(Smem)`` of the kernel (it traps if launched with less; 1024-byte aligned)."""
    per_stage = 2 * BLOCK_N * HEAD_SIZE + (HEAD_SIZE // 8) * 1040 + BLOCK_N
    size = BLOCK_M * HEAD_SIZE + stages * per_stage + 8 * BLOCK_M + 3 * 8 * stages
    return (size + 1023) // 1024 * 1024


_TensorMap = ctypes.c_uint8 * 128  # CUtensorMap (64-byte aligned in the kernel's struct)


class _ParamFields(ctypes.Structure):
    _fields_ = [
        ("tmap_k", _TensorMap), ("tmap_v", _TensorMap),
        *[(n, ctypes.c_void_p) for n in ("q", "qs", "ks", "vs", "kc", "vc", "bt", "seq_lens", "qsl", "out", "lse",
                                         "sched")],
        *[(n, ctypes.c_float) for n in ("sm_mant", "prob_scale", "inv_prob_scale", "lazy_t")],
        *[(n, ctypes.c_int) for n in ("sm_exp", "window", "causal")],
        *[(n, ctypes.c_int64) for n in ("stride_bt", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
                                        "stride_vt", "stride_vh")],
        *[(n, ctypes.c_int) for n in ("stride_qs_kv", "stride_qs_q", "stride_ksh", "stride_vsh", "T", "HQ", "group",
                                      "block_q", "q_blocks", "page", "page_shift", "num_blocks", "max_keys",
                                      "q_dynamic", "write_lse", "scale_p", "head_inner", "box_rows",
                                      "num_seqs", "num_items", "persistent", "sched_rows")],
    ]


class Params(_ParamFields):
    """The kernel's ``Params`` struct, field for field (passed by value), padded to its 64-byte alignment."""

    _fields_ = [("pad", ctypes.c_char * (-ctypes.sizeof(_ParamFields) % 64))]


@functools.cache
def source() -> str:
    """The kernel's source with the CUDA backend's ``wgmma_common.cuh`` inlined (its public helpers)."""
    from fp8kv_cuda.kernels import inline_headers

    return inline_headers(resources.files("fp8kv_hopper").joinpath("csrc/fp8_prefill.cu").read_text())


def options(query_dtype: torch.dtype, pingpong: bool = False, stages: int = STAGES, tma: bool = True,
            lazy: bool = True, overlap: bool = True) -> tuple[str, ...]:
    """NVRTC options of a variant: the query type, whether the consumer warpgroups take turns issuing
    their products (``FP8KV_PINGPONG``), the pipeline depth, TMA loads (else cp.async), the conditional
    rescaling (``FP8KV_LAZY``), a tile's softmax overlapping the previous tile's ``p8 @ v8``
    (``FP8KV_OVERLAP``)."""
    return (*OPTIONS, f"-DFP8KV_QT={QUERY_TYPES[query_dtype]}", f"-DFP8KV_PINGPONG={int(pingpong)}",
            f"-DFP8KV_STAGES={stages}", f"-DFP8KV_TMA={int(tma)}", f"-DFP8KV_LAZY={int(lazy)}",
            f"-DFP8KV_OVERLAP={int(overlap)}")


def function(entry: str, query_dtype: torch.dtype, device: torch.device, pingpong: bool = False, tma: bool = True):
    """The compiled ``entry`` for ``query_dtype`` on ``device`` (sm_90a cubin, built on first use)."""
    from fp8kv_cuda import kernels as cuda_kernels

    opts = options(query_dtype, pingpong, tma=tma)
    index = cuda_kernels.device_index(device)
    mod = cuda_kernels.module(("fp8kv_hopper.fp8_prefill", opts), lambda: cuda_kernels.compile_source(
        source(), "fp8_prefill.cu", opts, "sm_90a"), (ENTRY, LAYOUT_TEST), index)
    return mod.get_function(entry)


def why_not(query: torch.Tensor, out: torch.Tensor, max_query_len: int, logits_soft_cap, num_splits: int,
            lse: torch.Tensor | None, indices: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...],
            group: int) -> str | None:
    """Why this kernel cannot take the call (None: it can); host-known facts only. The cache is the
    FP8 mode's (e4m3fn, tensor or head scales), checked at plan time; ``indices`` (block tables,
    sequence lengths, query offsets) must be int32 and ``scales`` (k, v and a given q scale) float32,
    as the plan makes them; ``group`` is the query heads per KV head (a CTA's 128 rows hold them all)."""
    T, HQ, D = query.shape
    checks = (
        (all(t.dtype == torch.int32 and t.stride(-1) == 1 for t in indices), "int32 block tables, lengths, offsets"),
        (all(t.dtype == torch.float32 for t in scales), "float32 scales"),
        (query.device.type == "cuda" and torch.cuda.get_device_capability(query.device) == (9, 0),
         "needs an sm90 GPU (sm_90a code)"),
        (max_query_len > 1 and num_splits == 1, "prefill steps without split-KV only"),
        (logits_soft_cap is None, "no soft-cap"),
        (D == HEAD_SIZE, f"head size {HEAD_SIZE} only"),
        (group <= BLOCK_M, f"GQA groups of at most {BLOCK_M} query heads (got {group})"),
        (query.dtype in QUERY_TYPES and out.dtype == query.dtype, "float16/bfloat16/float32 queries, out alike"),
        (query.is_contiguous() and out.is_contiguous() and (lse is None or lse.is_contiguous()),
         "contiguous query, out and lse"),
        (query.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0, "16-byte aligned query and out"),
        (T * HQ < 2**31 // HEAD_SIZE, "fewer than 2^24 query rows"),
        (probe(query.device).cupy, "needs CuPy"),
    )
    return next((why for ok, why in checks if not ok), None)


def tma_maps(cache) -> tuple[bytes, bytes, int, int] | None:
    """TMA descriptors of the K and V caches for the kernel (``tmap_k``, ``tmap_v``, ``head_inner``,
    ``box_rows``: :func:`fp8kv_cuda.kernels.paged_cache_maps` for 128-key tiles), or None where TMA cannot
    describe them (the kernel then copies with cp.async): a page that neither divides 128 keys nor is
    a multiple of them, K and V with their head and key strides in different orders, or addresses and
    strides that are not multiples of 16 bytes."""
    from fp8kv_cuda.kernels import paged_cache_maps

    return paged_cache_maps(cache, BLOCK_N)


def launch(query, cache, block_tables, seq_lens, query_start_loc, max_query_len: int, sm_mant: float, sm_exp: int,
           causal: bool, window: int, out, lse, q_scale, qs_strides: tuple[int, int], prob_scale: float,
           pingpong: bool = False, ctas: int = 0, schedule: torch.Tensor | None = None) -> None:
    """Enqueue the kernel for ``query [T, Hq, 128]`` into ``out`` (and ``lse [T, Hq]``); arguments as
    :func:`fp8kv_hopper.attention.paged_attention_fp8` prepares them (no host sync). The work items are
    ``num_seqs * ceil(max_query_len / block_q) * H_kv`` (query block, KV head) pairs; ``ctas``: 0 launches
    a CTA per item, ``n > 0`` a persistent grid of ``min(n, items)`` CTAs that take the items in turn
    (the launcher's choice: :attr:`fp8kv_hopper.attention.Fp8AttnConfig.wgmma_ctas`). ``schedule``: with
    ``ctas > 0``, which items each CTA takes (:func:`fp8kv_hopper.schedule.balanced`, int32 ``[rows, grid]``
    on the query's device); None: the snake deal (``csrc/fp8_prefill.cu``'s ``cta_item``)."""
    from fp8kv_cuda import kernels as cuda_kernels
    from fp8kv_triton.kernels import cache_strides, scale_strides

    T, HQ, _ = query.shape
    H = cache.num_kv_heads
    group = HQ // H
    block_q = max(1, BLOCK_M // group)
    q_blocks = -(-max_query_len // block_q)
    S = seq_lens.shape[0]
    items = S * q_blocks * H
    grid = min(ctas, items) if ctas > 0 else items
    if items + grid >= 2**31:  # (the kernel's item indices, int32, run up to items + grid)
        raise InvalidArgument(f"max_query_len: got {max_query_len} ({S} sequences x {q_blocks} query blocks x {H} KV "
                              f"heads = {items} work items), expected fewer than 2^31 - {grid} work items")
    if schedule is not None and not (ctas > 0 and schedule.dtype == torch.int32 and schedule.is_contiguous()
                                     and schedule.device == query.device and schedule.dim() == 2
                                     and schedule.shape[1] == grid):
        raise InvalidArgument(f"schedule: got {schedule.dtype} {tuple(schedule.shape)} on {schedule.device} with "
                              f"ctas={ctas}, expected a persistent grid (ctas > 0) and int32 [rows, {grid}] "
                              f"contiguous on {query.device} (fp8kv_hopper.schedule.balanced)")
    page = cache.block_size
    kb, kt, kh = cache_strides(cache, "key")
    vb, vt, vh = cache_strides(cache, "value")
    p = Params(
        q=query.data_ptr(), qs=(cache.k_scale if q_scale is None else q_scale).data_ptr(),
        ks=cache.k_scale.data_ptr(), vs=cache.v_scale.data_ptr(), kc=cache.key_cache.data_ptr(),
        vc=cache.value_cache.data_ptr(), bt=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(),
        qsl=query_start_loc.data_ptr(), out=out.data_ptr(), lse=(out if lse is None else lse).data_ptr(),
        sched=None if schedule is None else schedule.data_ptr(),
        sched_rows=0 if schedule is None else schedule.shape[0],
        sm_mant=sm_mant, prob_scale=prob_scale, inv_prob_scale=1.0 / prob_scale,
        lazy_t=float(lazy_threshold(prob_scale)),  # (the conditional rescaling's threshold)
        sm_exp=sm_exp, window=window,
        causal=int(causal), stride_bt=block_tables.stride(0), stride_kb=kb, stride_kt=kt, stride_kh=kh,
        stride_vb=vb, stride_vt=vt, stride_vh=vh, stride_qs_kv=qs_strides[0], stride_qs_q=qs_strides[1],
        stride_ksh=scale_strides(cache, "key")[2], stride_vsh=scale_strides(cache, "value")[2], T=T, HQ=HQ,
        group=group, block_q=block_q, q_blocks=q_blocks, page=page,
        page_shift=page.bit_length() - 1 if page & (page - 1) == 0 else -1, num_blocks=cache.key_cache.shape[0],
        max_keys=block_tables.shape[1] * page, q_dynamic=int(q_scale is None), write_lse=int(lse is not None),
        scale_p=int(prob_scale != 1.0), num_seqs=S, num_items=items, persistent=int(ctas > 0))
    maps = tma_maps(cache)
    if maps is not None:
        p.tmap_k[:], p.tmap_v[:], p.head_inner, p.box_rows = maps
    fn = function(ENTRY, query.dtype, query.device, pingpong, tma=maps is not None)
    if grid > 0:
        cuda_kernels.launch_struct(fn, cuda_kernels.device_index(query.device), (grid, 1, 1), THREADS, p, smem_bytes())


def layout_test(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, p_scale: float):
    """Run the kernel's layouts and both wgmma forms on e4m3 codes ``a [64, 128]``, ``b [128, 128]``,
    ``v [128, 128]`` (uint8, CUDA): returns ``(s, p8, o)``, ``s = a b^T`` (float32), ``p8 =
    e4m3(s * p_scale)`` (uint8) and ``o = p8 v`` (float32)."""
    from fp8kv_cuda import kernels as cuda_kernels

    s = torch.empty(64, 128, dtype=torch.float32, device=a.device)
    p8 = torch.empty(64, 128, dtype=torch.uint8, device=a.device)
    o = torch.empty(64, 128, dtype=torch.float32, device=a.device)
    fn = function(LAYOUT_TEST, torch.bfloat16, a.device)

    class Args(ctypes.Structure):
        _fields_ = [(n, ctypes.c_void_p) for n in ("a", "b", "v", "s", "p8", "o")] + [("p_scale", ctypes.c_float)]

    args = Args(a.data_ptr(), b.data_ptr(), v.data_ptr(), s.data_ptr(), p8.data_ptr(), o.data_ptr(), p_scale)
    cuda_kernels.launch_struct(fn, cuda_kernels.device_index(a.device), (1, 1, 1), 128, args, smem_bytes())
    return s, p8, o
