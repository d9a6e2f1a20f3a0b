"""Host launcher of paged attention (``csrc/attention*.cu``, ``csrc/prefill_mma.cu``): plan and
per-layer launch.

:func:`plan` picks the kernel, the tile, the query-head chunks and the KV split from host-side sizes
only (once per step, ``fp8kv_plan_attention``); :func:`paged_attention` launches the kernel (and,
with a split, the merge) per layer, with no host sync. Chunked prefill takes the tensor-core prefill
kernel where it serves (CTAs of 128 query rows); decode and the rest run one row of CTAs per query
token.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fp8kv.cache import KVCache
from fp8kv.errors import InvalidArgument

from . import runtime
from .tma import paged_cache_maps
from .variants import (
    ATTN_THREADS,
    FP8_MODE_MIN_SM,
    MMA_MIN_SM,
    MMA_TILES,
    MMA_WAVE_TILES,
    WGMMA_BLOCK_N,
    WGMMA_PREFILL_FORMATS,
    WGMMA_STAGES,
    WGMMA_THREADS,
    WMMA_THREADS,
    attention_mma_variant,
    attention_tile,
    attention_variant,
    mma_arch_serves,
    mma_stages,
    prefill_arch_serves,
    prefill_mma_variant,
    prefill_stages,
    prefill_wgmma_variant,
    prefill_wmma_variant,
    wmma_smem_bytes,
)
from .write import cache_strides, scale_strides

LOG2E = 1.4426950408889634
FLOAT32_MAX = 3.4028234663852886e38
NO_WINDOW = 1 << 30
MAX_SPLITS = 128
_IO = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class AttnPlan:
    """Launch parameters of one step: tile, head chunks and KV split."""

    d_pad: int
    gpad: int
    block_n: int
    head_chunks: int
    num_splits: int
    keys_per_split: int
    mma: bool = False
    """The tensor-core kernel (``csrc/attention_mma.cu``) rather than the CUDA-core one."""
    warps: int = 4
    """Warps per CTA of the tensor-core kernel."""
    prefill: bool = False
    """The tensor-core chunked-prefill kernel (``csrc/prefill_mma.cu``)."""
    row_tiles: int = 0
    """Prefill: CTAs per (sequence, KV head, split) along the query rows (``max_query_len * group``
    rows in tiles of :data:`PREFILL_ROWS`)."""
    sm: int = 0
    """The architecture the tensor-core kernels are built for (:func:`fp8kv_cuda.runtime.device_sm`):
    their ring depth."""
    stages: int = 0
    """The tensor-core decode's ring depth when not the architecture's (0: :func:`mma_stages`)."""
    nsub: int = 0
    """The tensor-core decode's 16-key sub-tiles a warp step when not the kernel's (0: 2, 1 at head size 256)."""


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MMA_HEADS = 8
"""Query heads per CTA of the tensor-core kernel (the mma's n)."""
MMA_SPLIT_KEYS = 128
"""A split of the tensor-core kernel is a multiple of this many keys (4 warps x 32-key steps)."""
MMA_QUERY_DTYPES = (torch.float16, torch.bfloat16)


def mma_smem_bytes(head_size: int, warps: int, token_scales: bool = False, stages: int | None = None,
                   nsub: int | None = None) -> int:
    """Dynamic shared memory of the tensor-core kernel (its ``SMEM_BYTES``; the kernel traps if
    launched with less): the larger of the copy ring (``stages`` deep, sm80+'s by default; ``nsub``
    16-key sub-tiles a warp step, by default 2, 1 at head size 256) and the epilogue's per-warp outputs."""
    stages = MMA_TILES[head_size][0] if stages is None else stages
    nsub = nsub or (1 if head_size > 128 else 2)
    warp_stage = nsub * (2 * head_size + 32 * int(token_scales))  # 16-byte slots: K and V rows, lanes' scales
    ring = 16 * stages * warp_stage * warps
    epilogue = 4 * (warps * MMA_HEADS * head_size + 4 * warps * MMA_HEADS + 4 * MMA_HEADS)
    return max(ring, epilogue)


def mma_serves(device: torch.device, query_dtype: torch.dtype, head_size: int, token_scales: bool,
               fmt: str, fp8_attention: bool = False) -> bool:
    """Whether the tensor-core kernel serves this step (before the launch's alignment check): float16/
    bfloat16 queries, :func:`fp8kv_cuda.variants.mma_arch_serves` for the GPU (bfloat16 from sm80,
    float16 from sm75), and a CTA that fits its shared memory (:func:`mma_warps`; ``fp8_attention``: the FP8
    mode's build)."""
    if device.type != "cuda" or query_dtype not in MMA_QUERY_DTYPES:
        return False
    return (mma_arch_serves(_sm(device), fmt, head_size, _IO[query_dtype])
            and mma_warps(device, head_size, token_scales, fp8_attention) is not None)


def fp8_attention_static_smem(head_size: int) -> int:
    """Static shared memory of the FP8 mode's build of the tensor-core kernel: its query fragment, which
    the CTA's warps quantize a share each and exchange (``q_frag``: ``head_size / 16`` k steps x 32 lanes
    x 8 bytes)."""
    return 16 * head_size


ARCH_SMEM = {70: (96 << 10, 96 << 10), 75: (64 << 10, 64 << 10), 80: (163 << 10, 164 << 10),
             86: (99 << 10, 100 << 10), 89: (99 << 10, 100 << 10), 90: (227 << 10, 228 << 10)}
"""(opt-in shared memory per block, per SM) by architecture (CUDA programming guide): the plan's
limits when ``FP8KV_CUDA_ARCH`` names an older architecture than the GPU's."""


def _smem_limits(index: int) -> tuple[int, int]:
    """(opt-in shared memory per block, shared memory per SM) of CUDA device ``index``: 227/228 KiB
    on sm90, 163/164 KiB on sm80, 99/100 KiB on sm86/sm89, 64/64 KiB on sm75 (48 KiB when torch does
    not say); capped by :data:`ARCH_SMEM` of the architecture the backend builds for."""
    return _smem_limits_for(index, runtime.device_sm(index))


@functools.cache
def _smem_limits_for(index: int, sm: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    per_block = int(getattr(props, "shared_memory_per_block_optin", 48 << 10))
    per_sm = int(getattr(props, "shared_memory_per_multiprocessor", per_block))
    if sm != props.major * 10 + props.minor and sm in ARCH_SMEM:
        per_block, per_sm = min(per_block, ARCH_SMEM[sm][0]), min(per_sm, ARCH_SMEM[sm][1])
    return per_block, per_sm


def mma_cta_smem(head_size: int, warps: int, token_scales: bool, stages: int, nsub: int | None = None,
                 fp8_attention: bool = False) -> int:
    """Shared memory a CTA of the tensor-core kernel takes: its dynamic part (:func:`mma_smem_bytes`)
    and, in the FP8 mode's build, its static query fragment (:func:`fp8_attention_static_smem`)."""
    static = fp8_attention_static_smem(head_size) if fp8_attention else 0
    return mma_smem_bytes(head_size, warps, token_scales, stages, nsub) + static


def mma_warps(device: torch.device, head_size: int, token_scales: bool = False,
              fp8_attention: bool = False) -> int | None:
    """Warps per CTA of the tensor-core kernel on ``device``: 6 where two such CTAs fit an SM's
    shared memory (measured best on sm90), else 4 where two fit, else the larger that fits one
    CTA; None when none fits (the CUDA-core kernel serves). ``fp8_attention``: the FP8 mode's build, whose
    static shared memory (:func:`fp8_attention_static_smem`) counts too."""
    index = runtime.device_index(device)
    per_block, per_sm = _smem_limits(index)
    stages = mma_stages(runtime.device_sm(index), head_size)
    for need in (2, 1):
        for warps in (6, 4):
            smem = mma_cta_smem(head_size, warps, token_scales, stages, fp8_attention=fp8_attention)
            if smem <= per_block and need * smem <= per_sm:
                return warps
    return None


CTA_RESERVED_SMEM = 1 << 10
"""Shared memory the GPU reserves per resident CTA (sm80+), counted when CTAs per SM are worked out."""


def mma_wave_config(device: torch.device, head_size: int, ctas: int, token_scales: bool = False,
                    fp8_attention: bool = False, fmt: str = "fp8_e4m3") -> tuple[int, int, int] | None:
    """``(warps, stages, nsub)`` of the tensor-core decode for a grid of ``ctas`` CTAs where it has more
    CTAs than SMs, on sm90 at the head sizes of :data:`MMA_WAVE_TILES`: its tile for ceil(ctas / SMs)
    CTAs an SM, when shared memory and the register budget of ``MMA_TILES`` (the native conversion's,
    or for the fnuz formats the bit-level one's) let an SM hold that many. None elsewhere, and for
    grids the table has no tile for (:func:`mma_warps` and ``mma_stages`` decide)."""
    index = runtime.device_index(device)
    sms = _num_sms(index)
    if _sm(device) != 90 or head_size not in MMA_WAVE_TILES or ctas <= sms:
        return None
    per_wave = _cdiv(ctas, sms)
    if per_wave not in MMA_WAVE_TILES[head_size]:
        return None
    warps, stages, nsub = MMA_WAVE_TILES[head_size][per_wave]
    per_block, per_sm = _smem_limits(index)
    smem = mma_cta_smem(head_size, warps, token_scales, stages, nsub, fp8_attention)
    budget = MMA_TILES[head_size][2 if "fnuz" in fmt else 1]  # (warps an SM the registers are budgeted for)
    held = min(per_sm // (smem + CTA_RESERVED_SMEM), budget // warps)
    return (warps, stages, nsub) if smem <= per_block and held >= per_wave else None


def mma_splits(units: int, sms: int, max_splits: int) -> int:
    """KV splits of the tensor-core decode for ``units`` CTAs per split (tokens x KV heads x head
    chunks) on ``sms`` SMs: the split count with the fewest keys per SM, i.e. the least
    ``ceil(units * s / sms) / s`` (a CTA's keys times the CTAs an SM runs) with at most two CTAs
    per SM (one wave: 6 splits of B=8, 384 CTAs, took 238.1 us against 216.9 at 2), preferring fewer splits
    unless more save at least 5% (each split adds partial results and a merge). Measured on the H100
    (``benchmarks/decode.py``): one CTA per SM (B=1 x 8 heads: 16 splits
    113.7 us, B=8: 2 splits 216.9 us) beat two (32 splits 116.3, 4 splits 220.1 us) and lost badly
    to counts in between (20 splits 142.8 us: 28 SMs ran two CTAs, the rest one)."""
    best, best_cost = 1, float(_cdiv(units, sms))
    for s in range(2, min(max_splits, 2 * sms // max(1, units)) + 1):  # (at most two CTAs per SM)
        cost = _cdiv(units * s, sms) / s
        if cost < 0.95 * best_cost:
            best, best_cost = s, cost
    return best


def plan_mma(device: torch.device, *, num_tokens: int, num_kv_heads: int, group: int, head_size: int,
             max_keys: int, num_splits: int | None = None, warps: int | None = None,
             token_scales: bool = False, stages: int | None = None, fp8_attention: bool = False,
             nsub: int | None = None, fmt: str = "fp8_e4m3") -> AttnPlan:
    """Head chunks, KV split and warps per CTA of the tensor-core kernel. Without ``num_splits``/
    ``warps``: 6-warp CTAs, two per SM, where the shared memory allows (:func:`mma_warps`; 4- and
    8-warp CTAs were slower at every decode shape measured), and the keys split by
    :func:`mma_splits`, each split at least ``MMA_SPLIT_KEYS`` keys (short contexts split finer: B=1
    x 8 heads at L=1024, 8 splits of 128 keys took 8.9/10.9/16.5 us at D=64/128/256 against
    9.6/12.1/17.4 for 4 of 256). Grids of more CTAs
    than SMs on sm90 take :func:`mma_wave_config`'s warps, stages and sub-tiles where it has them."""
    chunks = _cdiv(group, MMA_HEADS)
    units = max(1, num_tokens) * num_kv_heads * chunks
    sms = _num_sms(runtime.device_index(device))
    if num_splits is None:
        num_splits = mma_splits(units, sms, min(max(1, max_keys // MMA_SPLIT_KEYS), MAX_SPLITS))
    splits, kps = _split_keys(max_keys, num_splits, MMA_SPLIT_KEYS)
    if warps is None and stages is None and nsub is None:
        warps, stages, nsub = (mma_wave_config(device, head_size, units * splits, token_scales, fp8_attention, fmt)
                               or (None, None, None))
    if warps is None:
        warps = mma_warps(device, head_size, token_scales, fp8_attention) or 4
    return AttnPlan(head_size, MMA_HEADS, MMA_SPLIT_KEYS, chunks, splits, kps, mma=True, warps=warps, sm=_sm(device),
                    stages=stages or 0, nsub=nsub or 0)


PREFILL_WARPS = 4
PREFILL_ROWS = 32 * PREFILL_WARPS
"""Query rows per CTA of the tensor-core prefill kernel (32 per warp: two m16 tiles)."""
PREFILL_BLOCK_N = 32
PREFILL_SPLIT_KEYS = 256
"""A split of the prefill kernel is a multiple of this many keys."""


def prefill_smem_bytes(head_size: int = 128, warps: int = PREFILL_WARPS, stages: int = prefill_stages(80)) -> int:
    """At least the prefill kernel's ``sizeof(PrefillShared)`` (it traps if launched with less): Q
    fragments, the K/V ring (``stages`` deep, sm80+'s by default), the per-stage key bits, the key
    addressing and the query range."""
    q = 16 * warps * 2 * (head_size // 16) * 32
    ring = 2 * 16 * stages * PREFILL_BLOCK_N * (head_size // 16)
    return q + ring + 16 * stages + 80 + 8 * warps + 16


WGMMA_PREFILL = True
"""On sm90 the warp-specialized wgmma kernel (``csrc/prefill_wgmma.cu``) takes the place of
``fp8kv_prefill_mma`` where it serves (:func:`wgmma_prefill_serves`); False keeps the mma kernel
(the benchmark times both). Measured on the H100: docs/cuda.md."""
WGMMA_PINGPONG = True
"""The wgmma prefill's two consumer warpgroups issue their products in turn (FA3's schedule)."""
_NO_TENSOR_MAP = bytes(runtime.TENSOR_MAP_BYTES)  # (the cp.async variant's unused tensor-map parameters)


def wgmma_smem_bytes(head_size: int = 128, block_n: int = WGMMA_BLOCK_N, stages: int = WGMMA_STAGES,
                     tma: bool = True) -> int:
    """``sizeof(WgmmaShared)`` of ``csrc/prefill_wgmma.cu`` (it traps if launched with less; 1024-byte
    aligned): the raw K and V codes (TMA: 4 tiles in the 128-byte swizzle; cp.async: one a stage, rows of
    144 bytes), Q and the widened K in the query's 16-bit type, V^T in float16 (rows padded by 16 bytes
    every 8 dims), the key flags, NaN flags and mbarriers."""
    raw_stages, pitch = (4, 128) if tma else (stages, 144)
    size = 2 * raw_stages * block_n * pitch + 128 * 2 * head_size
    size += stages * (block_n * 2 * head_size + (head_size // 8) * (16 * block_n + 16) + block_n)
    size += raw_stages * block_n + 4 * stages + 4
    size = -(-size // 8) * 8 + 8 * (2 * stages + 2 * raw_stages)
    return -(-size // 1024) * 1024


def wgmma_prefill_serves(sm: int, fmt: str, query: torch.Tensor, logits_soft_cap) -> bool:
    """Whether the sm90 wgmma prefill takes this step (unless :data:`WGMMA_PREFILL` is off): sm90 (not
    an older ``FP8KV_CUDA_ARCH``), an e4m3 cache, head size 128, float16/bfloat16 queries whose
    storage is 16-byte aligned (it loads them 16 bytes at a time), no soft-cap; any KV split. Anything
    it cannot do exactly at run time goes to the exact kernel (redo)."""
    return (WGMMA_PREFILL and sm == 90 and fmt in WGMMA_PREFILL_FORMATS and query.shape[-1] == 128
            and query.dtype in MMA_QUERY_DTYPES and query.data_ptr() % 16 == 0 and logits_soft_cap is None)


WMMA_PREFILL_BELOW_SM = MMA_MIN_SM
"""Architectures below this one run Volta's prefill kernel (``csrc/prefill_wmma.cu``: wmma, which ptxas
lowers to sm70's mma.sync m8n8k4) instead of ``csrc/prefill_mma.cu`` (m16n8k16, sm75+). The GPU tests
raise it to run that kernel on the GPU they have (no sm70 has run it)."""


def wmma_prefill(sm: int) -> bool:
    """Whether chunked prefill on architecture ``sm`` takes Volta's wmma kernel (:data:`WMMA_PREFILL_BELOW_SM`)."""
    return sm < WMMA_PREFILL_BELOW_SM


def wgmma_prefill_planned(sm: int, fmt: str, head_size: int, query_dtype: torch.dtype) -> bool:
    """Whether a prefill step is planned for the sm90 wgmma kernel (one CTA an SM): what
    :func:`wgmma_prefill_serves` checks that is known at plan time (the query's alignment and a soft-cap
    are known at launch only; such a step then runs the mma kernel with this plan)."""
    return (WGMMA_PREFILL and sm == 90 and fmt in WGMMA_PREFILL_FORMATS and head_size == 128
            and query_dtype in MMA_QUERY_DTYPES)


def prefill_serves(device: torch.device, query_dtype: torch.dtype, head_size: int, token_scales: bool,
                   fmt: str) -> bool:
    """Whether the tensor-core prefill kernel serves this step (before the launch's alignment check):
    float16/bfloat16 queries (float16 only on Volta's wmma kernel), static scales,
    :func:`fp8kv_cuda.variants.prefill_arch_serves`, and a CTA that fits the device's shared memory."""
    if device.type != "cuda" or query_dtype not in MMA_QUERY_DTYPES or token_scales:
        return False
    sm = _sm(device)
    per_block, _ = _smem_limits(runtime.device_index(device))
    if wmma_prefill(sm):
        return (query_dtype == torch.float16 and prefill_arch_serves(sm, fmt, head_size, "float16")
                and wmma_smem_bytes(head_size) <= per_block)
    return (prefill_arch_serves(sm, fmt, head_size, _IO[query_dtype])
            and prefill_smem_bytes(head_size, PREFILL_WARPS, prefill_stages(sm)) <= per_block)


def plan_prefill(device: torch.device, *, num_seqs: int, num_kv_heads: int, group: int, head_size: int,
                 max_keys: int, max_query_len: int, num_splits: int | None = None,
                 ctas_per_sm: int = 2) -> AttnPlan:
    """Row tiles and KV split of the prefill kernel: ``max_query_len * group`` rows per (sequence, KV
    head) in tiles of :data:`PREFILL_ROWS`; the keys are split only when the CTAs would not fill
    the GPU's ``ctas_per_sm`` CTAs an SM (long contexts under short query chunks), each split at
    least 2 x :data:`PREFILL_SPLIT_KEYS` keys.

    The mma kernel (two CTAs an SM) splits up to at least two CTAs an SM. The sm90 wgmma kernel (one
    CTA an SM, ``ctas_per_sm=1``: :func:`wgmma_prefill_planned`) splits into as many pieces as fit one
    wave, never into a second: measured on the H100, 256 CTAs ran 6-49% slower split in two than unsplit, and 64 CTAs
    ran fastest in 2 splits (128 CTAs: 228-231 us at 2 x 128 over 16384, against 290 in 3 and 278 in
    5, which spill into a second wave)."""
    row_tiles = _cdiv(max(1, max_query_len) * group, PREFILL_ROWS)
    ctas = row_tiles * num_kv_heads * max(1, num_seqs)
    if num_splits is None:
        slots = ctas_per_sm * _num_sms(runtime.device_index(device))
        num_splits = 1
        if ctas < slots:
            fill = slots // ctas if ctas_per_sm == 1 else _cdiv(slots, ctas)
            num_splits = min(fill, max(1, max_keys // (2 * PREFILL_SPLIT_KEYS)), MAX_SPLITS)
    splits, kps = _split_keys(max_keys, num_splits, PREFILL_SPLIT_KEYS)
    return AttnPlan(head_size, group, PREFILL_BLOCK_N, 1, splits, kps, mma=True, warps=PREFILL_WARPS,
                    prefill=True, row_tiles=row_tiles, sm=_sm(device))


def plan(device: torch.device, *, num_tokens: int, num_kv_heads: int, group: int, head_size: int,
         max_keys: int, query_dtype: torch.dtype | None = None, token_scales: bool = False,
         fmt: str = "fp8_e4m3", max_query_len: int = 1, num_seqs: int = 1) -> AttnPlan:
    """Tile and split from host-known sizes (``max_keys = block_tables.shape[1] * block_size``, an
    upper bound of every sequence): chunked prefill (``max_query_len > 1``) on the tensor-core
    prefill kernel where :func:`prefill_serves` (see :func:`plan_prefill`); otherwise the tensor-core
    decode kernel where :func:`mma_serves` (see :func:`plan_mma`), else the CUDA-core kernel, whose
    keys are split when the CTAs would not fill the GPU 4 times over and each split keeps at least
    4 tiles. Decode and the other kernels run one CTA row per query token."""
    if (max_query_len > 1 and query_dtype is not None
            and prefill_serves(device, query_dtype, head_size, token_scales, fmt)):
        # one CTA an SM: sm90's wgmma kernel, and Volta's wmma kernel (79 KiB of shared memory of 96;
        # its split count follows the wgmma kernel's measured rule, unmeasured on a Volta)
        sm = _sm(device)
        one = wgmma_prefill_planned(sm, fmt, head_size, query_dtype) or wmma_prefill(sm)
        return plan_prefill(device, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=group,
                            head_size=head_size, max_keys=max_keys, max_query_len=max_query_len,
                            ctas_per_sm=1 if one else 2)
    if query_dtype is not None and mma_serves(device, query_dtype, head_size, token_scales, fmt):
        return plan_mma(device, num_tokens=num_tokens, num_kv_heads=num_kv_heads, group=group,
                        head_size=head_size, max_keys=max_keys, token_scales=token_scales, fmt=fmt)
    d_pad, gpad, block_n = attention_tile(head_size, group)
    chunks = _cdiv(group, gpad)
    ctas = max(1, num_tokens) * num_kv_heads * chunks
    target = 1
    if device.type == "cuda":
        target = 4 * _num_sms(runtime.device_index(device))
    splits = 1
    if ctas < target and max_keys > 4 * block_n:
        splits = min(_cdiv(target, ctas), _cdiv(max_keys, 4 * block_n), MAX_SPLITS)
    splits, kps = _split_keys(max_keys, splits, block_n)
    return AttnPlan(d_pad, gpad, block_n, chunks, splits, kps)


def decode_grid(num_tokens: int, head_units: int, num_splits: int) -> tuple[int, int, int]:
    """The decode kernels' grid: ``(num_tokens * head_units, 1, num_splits)``, a token's ``head_units``
    (KV heads x head chunks) CTAs adjacent (``decode_cta`` in ``attention_common.cuh``). The CTAs of one
    token's KV heads read the same blocks' rows; launched side by side, a read-only gather of the decode
    shapes ran up to 4% faster on the H100 than with the tokens adjacent
    (``python benchmarks/profiles/decode_gather_ceiling.py --heads``)."""
    return num_tokens * head_units, 1, num_splits


def _split_keys(max_keys: int, num_splits: int, multiple: int) -> tuple[int, int]:
    """``(splits, keys_per_split)``: about ``num_splits`` pieces of ``max_keys``, each a multiple of
    ``multiple`` keys, the last one not empty."""
    kps = _cdiv(_cdiv(max(max_keys, 1), max(1, num_splits)), multiple) * multiple
    return max(1, _cdiv(max_keys, kps)), kps


def _sm(device: torch.device) -> int:
    """The architecture the backend builds for on a CUDA device as one number (90 for sm90): its
    compute capability, or ``FP8KV_CUDA_ARCH``'s (:func:`fp8kv_cuda.runtime.device_sm`)."""
    return runtime.device_sm(runtime.device_index(device))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _vec(cache: KVCache, D: int) -> int:
    """Widest global load (16, 8, 4, 2, 1 bytes) that divides D, every K/V stride and both bases."""
    vals = (D, cache.key_cache.data_ptr(), cache.value_cache.data_ptr(), *cache_strides(cache, "key"),
            *cache_strides(cache, "value"))
    for v in (16, 8, 4, 2):
        if all(x % v == 0 for x in vals):
            return v
    return 1


@dataclass(frozen=True)
class Fp8Attention:
    """The FP8 attention mode's arguments (docs/fp8_attention.md) for :func:`paged_attention`'s decode on
    the tensor-core kernel (``csrc/attention_mma.cu`` built with ``FP8KV_FP8_MODE``). Public: the Hopper
    backend's FP8-mode decode runs through it (:func:`fp8_decode_why_not` says where it can)."""

    q_scale: torch.Tensor | None
    """float32 ``[]``, ``[H_kv]`` or ``[Hq]`` on the query's device; None: dynamic per (token, head),
    ``max(amax|q| / 448, 2^-126)``."""
    qs_strides: tuple[int, int]
    """``q_scale``'s element strides (per KV head, per query head); (0, 0) per tensor or dynamic."""
    prob_scale: float
    """P is rounded as ``e4m3(p / prob_scale)`` (a finite positive float; the plan checks it)."""


def fp8_decode_why_not(query: torch.Tensor, cache: KVCache, out: torch.Tensor, lse: torch.Tensor | None,
                       max_query_len: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, q_scale: torch.Tensor | None) -> str | None:
    """Why the FP8-mode decode of :func:`paged_attention` cannot take this call (None: it can), from
    host-known facts only: a decode step (``max_query_len <= 1``) on an sm89+ GPU (sm90: where the
    Hopper backend runs) with CuPy, an e4m3fn cache with tensor or head scales whose K/V rows and
    strides are 16-byte aligned, float16/bfloat16 queries with the output alike, a head size the
    tensor-core decode takes (64, 128, 256) in the device's shared memory, int32 metadata and a
    float32 ``q_scale`` if given. Anything else stays with the Hopper backend's Triton kernel."""
    from fp8kv.probe import probe

    D = query.shape[-1]
    on_gpu = query.device.type == "cuda"
    checks = (
        (max_query_len <= 1, "decode steps only"),
        (on_gpu and _sm(query.device) >= FP8_MODE_MIN_SM, f"needs sm{FP8_MODE_MIN_SM}+ (e4m3 conversions)"),
        (on_gpu and probe(query.device).cupy, "needs CuPy"),
        (cache.fmt.name == "fp8_e4m3" and cache.scale_granularity in ("tensor", "head"),
         "an e4m3 cache with tensor or head scales"),
        (query.dtype in MMA_QUERY_DTYPES and out.dtype == query.dtype, "float16/bfloat16 queries, out alike"),
        (on_gpu and mma_serves(query.device, query.dtype, D, False, cache.fmt.name, fp8_attention=True),
         "a head size the tensor-core decode takes (64, 128, 256) in the shared memory"),
        (_vec(cache, D) == 16, "16-byte aligned K/V rows and strides"),
        (all(t.dtype == torch.int32 and t.is_contiguous() for t in (block_tables, seq_lens, query_start_loc)),
         "int32 contiguous block tables, lengths, offsets"),
        (q_scale is None or q_scale.dtype == torch.float32, "a float32 q_scale"),
        (lse is None or (lse.dtype == torch.float32 and lse.is_contiguous()), "a float32 contiguous lse"),
        (query.is_contiguous() and out.is_contiguous(), "contiguous query and out"),
    )
    return next((why for ok, why in checks if not ok), None)


def paged_attention(query: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, softmax_scale: float, causal: bool, sliding_window: int | None,
                    logits_soft_cap: float | None, out: torch.Tensor, lse: torch.Tensor | None,
                    plan_: AttnPlan | None = None, fp8_attention: Fp8Attention | None = None) -> None:
    """Paged attention of ``query [T, Hq, D]`` over ``cache`` into ``out`` (and ``lse [T, Hq]`` float32).

    ``block_tables [S, max_blocks]``, ``seq_lens [S]``, ``query_start_loc [S + 1]``: int32, contiguous
    (the metadata's own). Memory-safe whatever their values (see ``csrc/attention.cu``).
    ``fp8_attention``: the FP8 attention mode's decode on the tensor-core kernel (where :func:`fp8_decode_why_not`
    finds nothing against it; a plan, if given, must be a :func:`plan_mma` one).
    """
    T, HQ, D = query.shape
    H = cache.num_kv_heads
    group = HQ // H
    S = seq_lens.shape[0]
    if T == 0 or S == 0:
        return
    for name, x in (("softmax_scale", softmax_scale), ("logits_soft_cap", logits_soft_cap)):
        if x is not None and not (math.isfinite(x) and 0 < x <= FLOAT32_MAX):
            raise ValueError(f"{name}: got {x!r}, expected a finite number in (0, {FLOAT32_MAX:.4g}]")
    max_keys = block_tables.shape[1] * cache.block_size
    token_scales = cache.scale_granularity == "token_head"
    vec = _vec(cache, D)
    fmt = cache.fmt.name
    # without a plan: T bounds every query's length; T == S is taken for decode
    if fp8_attention is not None:
        p = plan_ or plan_mma(query.device, num_tokens=T, num_kv_heads=H, group=group, head_size=D, max_keys=max_keys,
                              fp8_attention=True)
        if not p.mma or p.prefill:
            raise InvalidArgument(f"plan_: got {p!r}, expected a plan_mma plan (the FP8 mode's decode)")
    else:
        p = plan_ or plan(query.device, num_tokens=T, num_kv_heads=H, group=group, head_size=D, max_keys=max_keys,
                          query_dtype=query.dtype, token_scales=token_scales, fmt=fmt,
                          max_query_len=1 if T == S else T, num_seqs=S)
    if p.mma and not (vec == 16 and query.dtype in MMA_QUERY_DTYPES):  # (the plan checked the rest)
        if fp8_attention is not None:
            raise InvalidArgument(f"fp8_attention: got a cache with {vec}-byte aligned K/V rows and {query.dtype} "
                                  "queries, "
                                  "expected 16-byte aligned rows and float16/bfloat16 queries (the FP8 mode's decode)")
        p = plan(query.device, num_tokens=T, num_kv_heads=H, group=group, head_size=D, max_keys=max_keys)
    # softmax_scale (times log2(e) unless soft-capped: then log2(e) comes after the cap) as a
    # mantissa in [1, 2) and a power-of-two exponent, so that it never overflows float32
    mant, exp = math.frexp(float(softmax_scale) * (1.0 if logits_soft_cap is not None else LOG2E))
    mant, exp = 2.0 * mant, exp - 1
    volta = p.prefill and wmma_prefill(p.sm)
    if volta:
        variant = prefill_wmma_variant(cache.fmt.name, D)
        entry = "fp8kv_prefill_wmma"
    elif p.prefill:
        variant = prefill_mma_variant(cache.fmt.name, _IO[query.dtype], D, p.warps, p.sm)
        entry = "fp8kv_prefill_mma"
    elif p.mma:
        variant = attention_mma_variant(cache.fmt.name, _IO[query.dtype], D, p.warps, token_scales, p.sm,
                                        fp8_attention=fp8_attention is not None, stages=p.stages or None,
                                        nsub=p.nsub or None)
        entry = "fp8kv_paged_attention_mma"
    else:
        variant = attention_variant(cache.fmt.name, _IO[query.dtype], token_scales, p.d_pad, p.gpad, p.block_n, vec)
        entry = "fp8kv_paged_attention"
    split = p.num_splits > 1
    dev = query.device
    if split:
        part_acc = torch.empty((p.num_splits, T, HQ, D), dtype=torch.float32, device=dev)
        part_ml = torch.empty((p.num_splits, T, HQ, 3), dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused
    lse_arg = lse if lse is not None else out  # unused without write_lse
    r = runtime
    window = min(int(sliding_window), NO_WINDOW) if sliding_window is not None else NO_WINDOW
    args = [r.ptr(query), r.ptr(cache.key_cache), r.ptr(cache.value_cache), r.ptr(cache.k_scale),
            r.ptr(cache.v_scale), r.ptr(block_tables), r.ptr(seq_lens), r.ptr(query_start_loc), r.ptr(out),
            r.ptr(lse_arg), r.ptr(part_acc), r.ptr(part_ml),
            r.f32(mant), r.i32(exp), r.f32(logits_soft_cap or 1.0), r.i32(int(logits_soft_cap is not None)),
            r.i32(window), r.i32(int(causal)), r.i32(int(split)), r.i32(int(lse is not None)),
            r.i64(block_tables.stride(0)),
            *map(r.i64, (*cache_strides(cache, "key"), *cache_strides(cache, "value"),
                         *scale_strides(cache, "key"), *scale_strides(cache, "value"))),
            r.i32(T), r.i32(HQ), r.i32(D), r.i32(group), r.i32(p.head_chunks), r.i32(S),
            r.i32(block_tables.shape[1]), r.i32(cache.block_size), r.i32(cache.num_blocks),
            r.i32(p.keys_per_split)]
    grid = decode_grid(T, H * p.head_chunks, p.num_splits)
    if p.prefill:
        # the fast kernel, then the exact one over the CTAs it handed back (redo[cta] = 1)
        grid = (p.row_tiles, H, S * p.num_splits)
        redo = torch.empty(grid[0] * grid[1] * grid[2], dtype=torch.int32, device=dev)
        pargs = [*args, r.ptr(redo)]
        if volta:
            threads, smem, exact = WMMA_THREADS, wmma_smem_bytes(D), "fp8kv_prefill_wmma_exact"
        else:
            threads, smem = 32 * p.warps, prefill_smem_bytes(D, p.warps, prefill_stages(p.sm))
            exact = "fp8kv_prefill_mma_exact"
        if not volta and wgmma_prefill_serves(p.sm, fmt, query, logits_soft_cap):  # (same contract)
            maps = paged_cache_maps(cache, WGMMA_BLOCK_N)  # (None: cp.async loads)
            tmap_k, tmap_v, head_inner, box_rows = maps or (_NO_TENSOR_MAP, _NO_TENSOR_MAP, 0, 0)
            runtime.launch(prefill_wgmma_variant(_IO[query.dtype], WGMMA_PINGPONG, tma=maps is not None),
                           "fp8kv_prefill_wgmma", dev, grid, WGMMA_THREADS,
                           [*pargs, tmap_k, tmap_v, r.i32(head_inner), r.i32(box_rows)],
                           shared_mem=wgmma_smem_bytes(D, tma=maps is not None))
        else:
            runtime.launch(variant, entry, dev, grid, threads, pargs, shared_mem=smem)
        runtime.launch(variant, exact, dev, grid, threads, pargs, shared_mem=smem)
    elif p.mma:
        if fp8_attention is not None:
            qs = fp8_attention.q_scale if fp8_attention.q_scale is not None else cache.k_scale  # (unused when dynamic)
            args += [r.ptr(qs), r.i32(fp8_attention.qs_strides[0]), r.i32(fp8_attention.qs_strides[1]),
                     r.i32(int(fp8_attention.q_scale is None)),
                     r.f32(fp8_attention.prob_scale), r.f32(1.0 / fp8_attention.prob_scale)]
        runtime.launch(variant, entry, dev, grid, 32 * p.warps, args,
                       shared_mem=mma_smem_bytes(D, p.warps, token_scales, p.stages or mma_stages(p.sm, D),
                                                 p.nsub or None))
    else:
        runtime.launch(variant, entry, dev, grid, ATTN_THREADS, args)
    if split:
        margs = [r.ptr(part_acc), r.ptr(part_ml), r.ptr(cache.v_scale), r.ptr(query_start_loc), r.ptr(out),
                 r.ptr(lse_arg), r.i32(int(lse is not None)), r.i64(scale_strides(cache, "value")[2]),
                 r.i32(T), r.i32(HQ), r.i32(D), r.i32(group), r.i32(S), r.i32(p.num_splits)]
        runtime.launch(variant, "fp8kv_merge", dev, (T, HQ, 1), ATTN_THREADS, margs, dependent=True)
