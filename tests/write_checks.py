"""Helpers of the write tests (CPU and GPU): caches moved between devices, byte comparison, and
inputs that stress the write kernels' division ``x / scale``.

The Triton write divides by the scale with one multiplication by the scale's reciprocal and two
FMAs (Markstein's correction) where that is exact, and falls back to ``tl.math.div_rn`` elsewhere
(see :mod:`fp8kv_triton.write`). These inputs put every finite 16-bit pattern through both, at
scales whose reciprocals round badly and at the edges of the fast path's scale range.
"""

from __future__ import annotations

import math
import struct

import torch

import fp8kv


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


FAST_SCALES = [
    1.0, 3.0, 0.1, 1 / 448, 1 / 57344, 0.0123, 7.0e4, 1.0e30,
    _f32(0x3F7FFFFF), _f32(0x3F800001), _f32(0x3FFFFFFF), _f32(0x3FAAAAAB),  # reciprocals that round badly
    2.0**-80, _f32(0x17800001), 2.0**125, _f32(0x7DFFFFFF),  # the fast range's edges, just inside
]
"""Per-head scales inside the fast division's range ``[2^-80, 2^125]``."""

SLOW_SCALES = [_f32(0x177FFFFF), 2.0**-100 * 1.5, 7.0e-30, 1.1754944e-38,
               _f32(0x7E000001), 2.0**126, 3.0e38, 2.0**-126 * 3]
"""Per-head scales outside that range (the exact division)."""


def every_finite_half(dtype: torch.dtype, D: int = 128) -> torch.Tensor:
    """Every finite float16 or bfloat16 bit pattern, sorted by bits, as ``[T, D]`` rows of ``dtype``
    (zero-padded to whole rows): a bfloat16 row is one binade of one sign (7 mantissa bits), so the
    rows' maxima span every exponent, subnormals included."""
    bits = torch.arange(65536, dtype=torch.int32)
    exp = (bits >> 10) & 0x1F if dtype == torch.float16 else (bits >> 7) & 0xFF
    finite = exp != (0x1F if dtype == torch.float16 else 0xFF)
    vals = bits[finite].to(torch.int16).view(dtype)
    pad = (-len(vals)) % D
    return torch.cat([vals, torch.zeros(pad, dtype=dtype)]).view(-1, D)


def stress_case(fmt: str, gran: str, dtype: torch.dtype, scales: list[float], device: str = "cpu"):
    """``(cache, key, value, slots)``: each head's rows hold every finite half pattern (float32
    inputs: the bfloat16 patterns plus random low bits); static scales from ``scales`` (one per
    head; ``token_head`` ignores them and uses one head)."""
    rows = every_finite_half(torch.float16 if dtype == torch.float16 else torch.bfloat16)
    if dtype == torch.float32:
        low = torch.randint(0, 1 << 16, rows.shape, generator=torch.Generator().manual_seed(5), dtype=torch.int32)
        rows = (rows.view(torch.int16).to(torch.int32) << 16 | low).view(torch.float32)
    H = 1 if gran == "token_head" else len(scales)
    key = rows[:, None, :].expand(-1, H, -1).contiguous()
    value = -key.flip(0)
    T, bs = key.shape[0], 16
    if gran == "head":
        kw = dict(k_scale=torch.tensor(scales), v_scale=torch.tensor(scales[::-1]))
    elif gran == "tensor":
        kw = dict(k_scale=scales[0], v_scale=scales[-1])
    else:
        kw = {}
    cache = fp8kv.KVCache.allocate(-(-T // bs), bs, H, rows.shape[1], kv_dtype=fmt, scale_granularity=gran,
                                   device=device, **kw)
    slots = torch.randperm(T, generator=torch.Generator().manual_seed(6)).to(device)
    return cache, key.to(device), value.to(device), slots


def cache_to(cache: fp8kv.KVCache, device: str) -> fp8kv.KVCache:
    """The same cache on ``device`` (codes and scales copied there; the same tensors if already there)."""
    return fp8kv.KVCache(cache.key_cache.to(device), cache.value_cache.to(device), cache.k_scale.to(device),
                         cache.v_scale.to(device), cache.fmt, cache.layout, cache.scale_granularity)


def assert_same_bytes(got: fp8kv.KVCache, want: fp8kv.KVCache) -> None:
    """Codes and scales byte-identical (``got`` may live on another device); the message names the
    tensor, how many elements differ and where the first ones are."""
    for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
        a, b = getattr(got, name).to(getattr(want, name).device), getattr(want, name)
        a = a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32)
        b = b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ at {(a != b).nonzero()[:3].tolist()}"


def codec_inputs(fmt) -> torch.Tensor:
    """Every fp16/bf16 value, the format's ties and their neighbours, specials, random float32 bits."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    halves = torch.cat([bits.view(torch.float16).float(), bits.view(torch.bfloat16).float()])
    codes = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(fmt.torch_dtype).double()
    vals = vals[torch.isfinite(vals)].unique().sort().values
    mids = ((vals[1:] + vals[:-1]) / 2).float()
    up, down = torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf))
    near = torch.cat([mids, up, down])
    over = torch.tensor([fmt.max * 1.0625, fmt.max * 1.25, fmt.max * 2, 3.0e38, math.inf, 1e-45, 0.0, math.nan])
    x = torch.cat([near, vals.float(), over])
    g = torch.Generator().manual_seed(7)
    rnd = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([halves, x, -x, rnd.view(torch.float32)])


def extreme_write_inputs(T: int, H: int, D: int, dtype, seed: int):
    """Key/value ``[T, H, D]`` of ``dtype`` over magnitudes 1e-40..3e38 with specials, and ``T``
    distinct slots among ``2T`` with three padding slots: the GPU write tests' inputs."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-40, 38, T * H, dtype=torch.float64).clamp(max=3e38)
    mag = mag[torch.randperm(T * H, generator=g)]
    key = (torch.randn(T, H, D, generator=g, dtype=torch.float64) * mag.view(T, H, 1)).float()
    value = torch.randn(T, H, D, generator=g) * 37.0
    # specials, zero rows, subnormal-only rows (float32 and bf16 subnormals)
    key[0, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    key[1, :, :] = 0.0
    key[2, 0, :] = -0.0
    key[3, 0, :] = torch.randn(D, generator=g) * 1e-39
    value[4, :, 0] = math.nan
    value[5, 0, :] = torch.randn(D, generator=g) * 3e-41
    key, value = key.to(dtype), value.to(dtype)
    # negative NaNs (a GPU division would make them positive; the reference keeps the sign)
    neg_nan = {torch.float32: -0x400000, torch.float16: -0x200, torch.bfloat16: -0x40}[dtype]
    bits = key.view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits[0, 1, 5] = neg_nan
    value.view(bits.dtype)[6, 0, 7] = neg_nan
    slots = torch.randperm(T * 2, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[:3]] = -1
    return key, value, slots


def shuffled_block_tables(B: int, L, bs: int, g: torch.Generator) -> tuple[list[int], torch.Tensor, int]:
    """``(lens, block_tables [B, max_blocks] int32, num_blocks)`` for ``B`` sequences of lengths ``L``
    (an int or a list) over a random permutation of ``num_blocks`` blocks (3 to spare)."""
    lens = [L] * B if isinstance(L, int) else list(L)
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 3
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(B, max(need), dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    return lens, tables, nblocks


def planned_gpu_step(backend: str, prefill: bool):
    """``(cache, meta, key, query, step)`` of a small planned bf16 step on the GPU: 4 sequences over a
    token-head-scaled cache, one query each (decode) or 12 queries in all (prefill); ``step`` holds the
    page table and lengths it was planned from."""
    H, Hq, D, bs = 8, 32, 128, 16
    cache = fp8kv.KVCache.allocate(32, bs, H, D, scale_granularity="token_head", device="cuda")
    step = dict(block_tables=torch.arange(32, dtype=torch.int32, device="cuda").view(4, 8),
                seq_lens=torch.tensor([100, 7, 128, 64], dtype=torch.int32, device="cuda"))
    if prefill:
        step["query_start_loc"] = torch.tensor([0, 3, 4, 10, 12], dtype=torch.int32, device="cuda")
        slots = torch.arange(12, device="cuda")
    else:
        slots = torch.tensor([99, 6, 127, 63], device="cuda")
    meta = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=torch.bfloat16, slot_mapping=slots,
                                backend=backend, **step)
    T = slots.shape[0]
    key = torch.randn(T, H, D, device="cuda").bfloat16()
    query = torch.randn(T, Hq, D, device="cuda").bfloat16()
    return cache, meta, key, query, step


def assert_per_layer_calls_never_sync(cache, meta, key, query) -> None:
    """``write_kv`` then ``paged_attention`` (with its lse) of a planned step, three layers' worth, under
    CUDA's sync-debug mode ``error`` (each kernel run once before, so that its compilation is not counted)."""
    fp8kv.write_kv(cache, key, key, meta)
    fp8kv.paged_attention(query, cache, meta, return_lse=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fp8kv.write_kv(cache, key, key, meta)
            fp8kv.paged_attention(query, cache, meta, return_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def gpu_queries(lens: torch.Tensor, q_len: int, Hq: int, D: int, dtype):
    """``(query_start_loc [S + 1] int32, query [T, Hq, D], out)`` on the GPU: each sequence's last
    ``min(q_len, len)`` tokens are queries (random, of ``dtype``); ``out`` is filled with NaN."""
    q_lens = [min(q_len, int(n)) for n in lens.tolist()]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = torch.randn(int(qsl[-1]), Hq, D, device="cuda").to(dtype)
    return qsl, query, torch.full_like(query, math.nan)


def poisoned_cache(T: int, H: int, D: int, bs: int, fmt: str, gran: str, layout: str) -> fp8kv.KVCache:
    """A CPU cache of room for ``2T`` tokens whose bytes are random (so a write that touches the
    wrong place shows), with fixed extreme static scales for ``tensor``/``head`` granularity."""
    kw = {}
    if gran == "tensor":
        kw = dict(k_scale=0.0123, v_scale=3.7)
    elif gran == "head":
        kw = dict(k_scale=torch.tensor([1e-3, 0.37, 1.0, 5e4]), v_scale=torch.tensor([0.1, 2.0**-20, 7.0, 1.5]))
    cache = fp8kv.KVCache.allocate(2 * T // bs, bs, H, D, kv_dtype=fmt, layout=layout, scale_granularity=gran, **kw)
    cache.key_cache.view(torch.uint8).random_(generator=torch.Generator().manual_seed(3))
    cache.value_cache.view(torch.uint8).random_(generator=torch.Generator().manual_seed(4))
    return cache


def paged_gpu_cache(B: int, L, H: int, D: int, bs: int, fmt: str, gran: str, layout: str, seed: int, *,
                    backend: str, io_dtype=torch.float32, spread_head_scales: bool = False):
    """``(cache, block_tables, seq_lens)`` on the GPU: ``B`` sequences of lengths ``L`` (an int or a list)
    over shuffled blocks, written through ``backend`` from ``io_dtype`` K/V; static scales 0.02 / 0.03
    (``spread_head_scales``: a different scale per KV head for ``head`` granularity)."""
    g = torch.Generator().manual_seed(seed)
    lens, tables, nblocks = shuffled_block_tables(B, L, bs, g)
    kw = {} if gran == "token_head" else dict(k_scale=0.02, v_scale=0.03)
    if gran == "head" and spread_head_scales:
        kw = dict(k_scale=torch.linspace(0.01, 0.03, H), v_scale=torch.linspace(0.05, 0.02, H))
    cache = fp8kv.KVCache.allocate(nblocks, bs, H, D, kv_dtype=fmt, layout=layout, scale_granularity=gran,
                                   device="cuda", **kw)
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    key = torch.randn(len(slots), H, D, generator=g) * 3
    value = torch.randn(len(slots), H, D, generator=g)
    fp8kv.write_kv_one_shot(cache, key.cuda().to(io_dtype), value.cuda().to(io_dtype), slots.cuda(), backend=backend)
    return cache, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def grown_step(cache: fp8kv.KVCache, tables: torch.Tensor, lens: torch.Tensor, new: int, Hq: int, gran: str,
               g: torch.Generator):
    """A step that appends ``new`` tokens to each of 4 sequences of ``cache`` (GPU): a copy of the cache
    with room for them, and the step's tensors. Returns ``(big, tables2, lens2, slots, key, value, query,
    qsl)``: the larger cache, its ``[4, blocks]`` table and lengths, the new tokens' slots, their bf16
    K/V ``[4 * new, H, D]`` and queries ``[4 * new, Hq, D]``, and ``query_start_loc``."""
    H, D, bs = cache.num_kv_heads, cache.head_size, cache.block_size
    lens2 = lens + new
    need = int(-(-int(lens2.max()) // bs))
    extra = torch.arange(cache.num_blocks, cache.num_blocks + 4 * need, dtype=torch.int32, device="cuda")
    static = {} if gran == "token_head" else dict(k_scale=0.02, v_scale=0.03)
    big = fp8kv.KVCache.allocate(cache.num_blocks + 4 * need, bs, H, D, kv_dtype="fp8_e4m3", scale_granularity=gran,
                                 device="cuda", **static)
    for name in ("key_cache", "value_cache"):
        getattr(big, name)[:cache.num_blocks].copy_(getattr(cache, name))
    if gran == "token_head":
        big.k_scale[:cache.num_blocks].copy_(cache.k_scale)
        big.v_scale[:cache.num_blocks].copy_(cache.v_scale)
    tables2 = torch.cat([tables, extra.view(4, need)], dim=1)
    pos = lens[:, None] + torch.arange(new, device="cuda")[None, :]  # [4, new]
    slots = (tables2.gather(1, (pos // bs).long()).long() * bs + pos % bs).flatten()
    key = torch.randn(4 * new, H, D, device="cuda", generator=g).bfloat16()
    value = torch.randn(4 * new, H, D, device="cuda", generator=g).bfloat16()
    query = torch.randn(4 * new, Hq, D, device="cuda", generator=g).bfloat16()
    qsl = torch.arange(0, 4 * new + 1, new, dtype=torch.int32, device="cuda")
    return big, tables2, lens2, slots, key, value, query, qsl
