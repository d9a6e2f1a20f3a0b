"""The Hopper backend's CUDA prefill kernel (``fp8kv_hopper/csrc/fp8_prefill.cu``) on the CPU.

* It compiles for sm_90a with NVRTC 12 from PyPI (``cuda-compile`` extra), for every query type, with
  and without the ping-pong schedule, with TMA or cp.async loads (TMA boxes in the PTX or none), without
  spills, without ptxas serializing the wgmma for lack of
  registers, and its PTX has both e4m3 wgmma forms (A from shared memory for ``q8 @ k8^T``, A from
  registers for ``p8 @ v8``).
* The host's mirrors of the kernel's structs (``Params`` passed by value, the shared-memory size) have
  the kernel's sizes (checked by ``static_assert`` in a compile).
* Which caches the TMA loads describe (``wgmma.tma_maps``; the rest take the cp.async loads).
* The index maps: the producer's V transpose (from TMA's 128-byte swizzle) writes every byte of V^T
  once with the right V byte, its loads and stores free of bank conflicts,
  and the consumers' packing of p8 into wgmma A registers agrees with the key order of V^T, both
  evaluated through CUTLASS's documented fragment layouts of an m64nNk32 wgmma
  (``cute/atom/mma_traits_sm90_gmma.hpp``: ``CLayout_64xN`` for the accumulator, ``ALayout_64x32``
  for an 8-bit A operand in registers).

Running it is tests/test_hopper_gpu.py's job (sm90 only).
"""

from __future__ import annotations

import ctypes
import dataclasses
import re

import numpy as np
import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc", reason="needs NVRTC from PyPI: pip install -e '.[cuda-compile]'")

from fp8kv_hopper import wgmma  # noqa: E402

WGMMA_SS = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
MAX_REGS = 65536 // wgmma.THREADS // 8 * 8  # one CTA of 384 threads per SM: 168


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp_async"])
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiles_for_sm90a_without_spills(dtype, pingpong, tma):
    from fp8kv_cuda import compile as cc

    opts = wgmma.options(dtype, pingpong, tma=tma)
    _, log = cc.compile_text(wgmma.source(), "fp8_prefill.cu", opts, "sm_90a")
    info = cc.parse_ptxas(log)
    assert set(info) == {wgmma.ENTRY, wgmma.LAYOUT_TEST}, log[-2000:]
    assert "C7512" not in log, log  # "wgmma.mma_async instructions are serialized" (too few registers)
    assert "C7508" not in log, log  # setmaxnreg ignored
    assert not any(c in log for c in ("C7514", "C7515", "C7520")), log  # wgmma serialized (accumulators read or
    # written mid-stage, divergence)
    for entry, x in info.items():
        assert x["spill_stores"] == 0 and x["spill_loads"] == 0 and x["stack"] == 0, (entry, x)
    assert info[wgmma.ENTRY]["regs"] <= MAX_REGS, info
    ptx, _ = cc.compile_text(wgmma.source(), "fp8_prefill.cu", opts, "compute_90a", ptx=True)
    ptx = ptx.decode(errors="replace")
    body = ptx[ptx.index(f".entry {wgmma.ENTRY}"):]
    ss = len(re.findall(re.escape(WGMMA_SS) + r"[^}]*\}, %rd\d+, %rd\d+", body))
    rs = len(re.findall(re.escape(WGMMA_SS) + r"[^}]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+", body))
    assert ss >= 4 and rs >= 4, (ss, rs)  # the 4 k32 steps of each product (more where paths are unrolled twice)
    tma_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.4d", body))
    assert (tma_loads > 0) == tma, tma_loads  # K and V boxes by TMA, or none (cp.async)


def test_tma_maps_decline_what_a_box_cannot_cover():
    """Pages that neither divide 128 keys nor are a multiple of them, and caches whose head and key strides
    are ordered differently for K and V, go to the cp.async loads (None) before any driver call."""
    import fp8kv

    for page in (12, 48, 96, 200):
        cache = fp8kv.KVCache.allocate(4, page, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor")
        assert wgmma.tma_maps(cache) is None, page
    nhd = fp8kv.KVCache.allocate(4, 16, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor")
    hnd = fp8kv.KVCache.allocate(4, 16, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor", layout="HND")
    mixed = dataclasses.replace(nhd, value_cache=hnd.value_cache.permute(0, 2, 1, 3))  # V: HND strides
    assert wgmma.tma_maps(mixed) is None


def test_too_many_work_items_are_refused_before_any_launch():
    """The kernel indexes work items (sequences x query blocks x KV heads) in int32 up to items + grid:
    launch() refuses a step with more than that, naming max_query_len, before anything is launched (CPU
    tensors: a launch would fail differently) and with the cache unchanged."""
    import fp8kv
    from fp8kv.errors import InvalidArgument

    cache = fp8kv.KVCache.allocate(4, 16, 8, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor")
    before = cache.key_cache.view(torch.uint8).clone()
    S, max_query_len = 8192, 2**20  # 8192 x 32768 query blocks (32 tokens each at group 4) x 8 heads = 2^31
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)  # (launch takes max_query_len as the caller clamped it)
    meta = (torch.zeros(S, 1, dtype=torch.int32), torch.ones(S, dtype=torch.int32),
            torch.zeros(S + 1, dtype=torch.int32))
    for ctas in (0, 132):
        with pytest.raises(InvalidArgument, match=r"^max_query_len: got 1048576 .* expected fewer than 2\^31 - "):
            wgmma.launch(q, cache, *meta, max_query_len, 1.0, 0, True, 2**30, q, None, None, (0, 0), 1.0, ctas=ctas)
    assert torch.equal(cache.key_cache.view(torch.uint8), before)


def test_host_structs_have_the_kernels_sizes():
    from fp8kv_cuda import compile as cc

    checks = f"""
static_assert(sizeof(fp8kv::Params) == {ctypes.sizeof(wgmma.Params)}, "Params");
static_assert(sizeof(fp8kv::Smem) == {wgmma.smem_bytes()}, "Smem");
static_assert(fp8kv::STAGES == {wgmma.STAGES} && fp8kv::BLOCK_M == {wgmma.BLOCK_M}, "stages, rows");
static_assert(fp8kv::BLOCK_N == {wgmma.BLOCK_N} && fp8kv::THREADS == {wgmma.THREADS}, "keys, threads");
"""
    cc.compile_text(wgmma.source() + checks, "probe.cu", wgmma.options(torch.bfloat16), "compute_90a", ptx=True)
    with pytest.raises(RuntimeError, match="static assertion failed"):  # the probe can fail
        cc.compile_text(wgmma.source() + checks.replace("Params) ==", "Params) == 8 +"), "probe.cu",
                        wgmma.options(torch.bfloat16), "compute_90a", ptx=True)


# ---- the index maps, as the kernel computes them (csrc/fp8_prefill.cu) ----

def kmajor(row, kb, sbo):
    return (row >> 3) * sbo + (kb >> 4) * 128 + (row & 7) * 16 + (kb & 15)


def vt_key(kpos):
    i, c = kpos & 3, (kpos >> 2) & 3
    return (kpos & ~15) + 8 * (i >> 1) + 2 * c + (i & 1)


def sw128(row, kb):
    return row * 128 + ((((kb >> 4) ^ row) & 7) << 4) + (kb & 15)


def cta_item(k, b, grid, persistent):
    """fp8_prefill.cu's cta_item: the k-th work item of CTA b of `grid`."""
    return grid * k + (grid - 1 - b if persistent and k & 1 else b)


def item_pair(item, seqs, q_blocks, heads, persistent):
    """cta_of's (KV head, sequence, query block counted from the last) of an item."""
    if persistent:
        return item % heads, item // heads % seqs, item // heads // seqs
    pairs = seqs * q_blocks
    return item // pairs, item % pairs // q_blocks, item % pairs % q_blocks


@pytest.mark.parametrize("seqs,q_blocks,heads", [(4, 64, 8), (1, 3, 2), (3, 19, 8)])
@pytest.mark.parametrize("persistent", [True, False])
def test_the_work_items_are_dealt_once_each(seqs, q_blocks, heads, persistent):
    """Every (KV head, sequence, query block) is one work item and some CTA takes it exactly once, for
    persistent grids of 1, 5 and 132 CTAs (each walking cta_item until an item is past the last) and for
    a CTA per item; on 4 x 2048 over 2048 (2048 items, 17-32 tiles each, 15.5 per CTA) the snake leaves
    the CTAs' tile counts less than the longest item apart (368-392 tiles)."""
    items = seqs * q_blocks * heads
    assert sorted(item_pair(i, seqs, q_blocks, heads, persistent) for i in range(items)) == sorted(
        (h, s, q) for h in range(heads) for s in range(seqs) for q in range(q_blocks))
    for grid in ((1, 5, 132) if persistent else (items,)):
        taken = []
        for b in range(grid):
            k = 0
            while (item := cta_item(k, b, grid, persistent)) < items:
                taken.append(item)
                k += 1
        assert sorted(taken) == list(range(items)), grid
    if persistent and (seqs, q_blocks, heads) == (4, 64, 8):  # 32 tokens a query block, 2048 cached keys
        tiles = [0] * 132
        for b in range(132):
            k = 0
            while (item := cta_item(k, b, 132, True)) < items:
                qb = q_blocks - 1 - item_pair(item, seqs, q_blocks, heads, True)[2]
                tiles[b] += -(-(2048 + 32 * qb + 32) // 128)
                k += 1
        assert max(tiles) - min(tiles) < 32, (min(tiles), max(tiles))


def walk(b, grid, items, sched=None, has_rows=lambda item: True):
    """fp8_prefill.cu's walk of CTA b over its items (first_work / next_work / walk_from, cta_item with a
    schedule [rows, grid] or the snake): the items it runs, in order."""
    def cta_item(k):
        if sched is not None:
            return int(sched[k, b]) if k < sched.shape[0] else items
        return grid * k + (grid - 1 - b if k & 1 else b)

    taken, k, item = [], 0, cta_item(0)
    while True:
        while True:  # walk_from(k, item): skip items without rows; stop at the first >= num_items
            ok = 0 <= item < items and has_rows(item)
            if ok or item >= items:
                break
            k += 1
            item = cta_item(k)
        if not ok:
            return taken
        taken.append(item)
        k, item = k + 1, cta_item(k + 1)  # (then: CTA b's item k + 1, read while item k runs)


@pytest.mark.parametrize("pairs", [[(2048, 2048)] * 4, [(100, 3000)] * 2 + [(700, 20)] * 5, [(0, 50), (300, 0)]])
def test_the_kernels_walk_takes_each_scheduled_item_once(pairs):
    """With the plan's schedule (spare padding rows included), the kernel's walk runs every item with rows
    exactly once over the grid, each CTA its own list in order; items without rows are skipped."""
    from fp8kv_hopper import schedule

    qsl = [0]
    for new, _ in pairs:
        qsl.append(qsl[-1] + new)
    lens = [n + c for n, c in pairs]
    kw = dict(num_kv_heads=8, group=4, num_tokens=qsl[-1], max_query_len=max(n for n, _ in pairs),
              max_keys=max(lens) + 16, causal=True, sliding_window=None)
    sched = schedule.for_step(lens, qsl, ctas=132, device=torch.device("cpu"), **kw).numpy()
    q_blocks = -(-max(1, kw["max_query_len"]) // 32)
    tiles = schedule.item_tiles(lens, qsl, num_kv_heads=8, block_q=32, q_blocks=q_blocks, block_n=128,
                                num_tokens=qsl[-1], max_keys=kw["max_keys"], causal=True, window=2**30)
    items, grid = tiles.shape[0], sched.shape[1]
    taken = [walk(b, grid, items, sched, lambda i: tiles[i] >= 0) for b in range(grid)]
    assert sorted(i for t in taken for i in t) == [i for i in range(items) if tiles[i] >= 0]
    for b, t in enumerate(taken):
        col = sched[:, b]
        assert t == [int(i) for i in col[col < items] if tiles[i] >= 0]
    snake = [walk(b, grid, items) for b in range(grid)]
    assert sorted(i for t in snake for i in t) == list(range(items))
    assert snake == [x.tolist() for x in schedule.snake_lists(items, grid)]  # (the model the benchmark compares)


@pytest.mark.parametrize("tail", [128, 77, 0])
def test_v_transpose_writes_every_byte_of_vt_once(tail):
    """transpose_v as the kernel addresses it: raw V in the 128-byte swizzle (as TMA writes it), V^T
    in the padded no-swizzle layout; every V^T byte written once with V[vt_key(kpos), dim] (zero for
    keys >= tail), and each warp-wide 32-bit load and store touches 32 distinct banks."""
    rng = np.random.default_rng(0)
    v = rng.integers(0, 256, size=(128, 128), dtype=np.uint8)  # [key, dim]
    vr = np.zeros(128 * 128, np.uint8)
    for key in range(128):
        for kb in range(128):
            vr[sw128(key, kb)] = v[key, kb]
    vt = np.zeros(16 * 1040, np.uint8)
    written = np.zeros(16 * 1040, np.int32)
    banks_ok = True
    for unit in range(32):  # (taken by warp unit % WARPS: every lane of a warp in the same unit)
        chunk, dg = unit >> 2, unit & 3
        loads = {i: [] for i in range(4)}
        stores = {j: [] for j in range(4)}
        for lane in range(32):
            a, w = lane & 7, lane >> 3
            x = []
            for i in range(4):  # the kernel's load address: its base + unit offset + key offset + swizzle term
                key_off = 8 * (i >> 1) + (i & 1)
                key = 16 * chunk + 2 * w + key_off
                addr = 2 * w * 128 + 4 * (a & 3) + chunk * 2048 + key_off * 128 + 32 * (dg ^ w) \
                    + 16 * ((a >> 2) ^ (i & 1))
                assert addr == sw128(key, 32 * dg + 4 * a)  # the bytes of dims 32 dg + 4 a ..
                assert key == vt_key(16 * chunk + 4 * w + i)
                loads[i].append(addr)
                x.append(vr[addr: addr + 4] if key < tail else np.zeros(4, np.uint8))
            for j in range(4):  # y_j = byte j of x_0..x_3 (the PRMT pairs)
                addr = kmajor(4 * a, 4 * w, 1040) + 128 * chunk + 4 * dg * 1040 + 16 * j
                assert addr == kmajor(4 * a + 32 * dg + j, 16 * chunk + 4 * w, 1040)
                vt[addr: addr + 4] = [x[i][j] for i in range(4)]
                written[addr: addr + 4] += 1
                stores[j].append(addr)
        for addrs in [*loads.values(), *stores.values()]:  # 32-bit accesses: 32 distinct banks
            banks_ok &= len({(ad // 4) % 32 for ad in addrs}) == 32
    for dim in range(128):
        for kpos in range(128):
            key = vt_key(kpos)
            assert vt[kmajor(dim, kpos, 1040)] == (v[key, dim] if key < tail else 0)
    assert written.sum() == 128 * 128 and written.max() == 1
    assert banks_ok


def test_p8_packing_matches_the_key_order_of_vt():
    """For every thread of a warpgroup and every byte of its p8 A registers, the S accumulator entry
    packed there (CLayout_64xN) is the (row, key) that the A fragment's (row, k) (ALayout_64x32) and
    V^T's key order (vt_key) say it must be."""
    for t in range(128):
        warp, lane = t // 32, t % 32
        r, c = lane // 4, lane % 4
        for kk in range(4):
            for w in range(4):
                j, e = 4 * kk + 2 * (w >> 1), 2 * (w & 1)
                packed = [4 * j + e, 4 * j + e + 1, 4 * j + 4 + e, 4 * j + 4 + e + 1]  # the kernel's pa[kk][w]
                for byte, i in enumerate(packed):
                    v1, v2 = w & 1, w >> 1  # ALayout_64x32: register w = v1 + 2 v2, byte = v0
                    a_row, a_k = 16 * warp + r + 8 * v1, 4 * c + byte + 16 * v2
                    assert accumulator_entry(t, i) == (a_row, 32 * kk + vt_key(a_k)), (t, kk, w, byte)


def accumulator_entry(t: int, i: int) -> tuple[int, int]:
    """CLayout_64xN: (row, column) of register ``i`` of warpgroup thread ``t``."""
    warp, r, c = t // 32, (t % 32) // 4, t % 4
    v0, v1, v2 = i & 1, (i >> 1) & 1, i >> 2
    return 16 * warp + r + 8 * v1, 8 * v2 + 2 * c + v0


def test_an_empty_nvrtc_log_leaves_python_s_cached_bytes_alone():
    """NVRTC writes its log into the buffer it is given; a one-byte log (empty) once went into
    CPython's cached ``b" "`` and turned later printed spaces into NUL bytes."""
    from fp8kv_cuda import compile as cc

    _, log = cc.compile_text('extern "C" __global__ void k() {}', "empty.cu", (), "compute_90", ptx=True)
    assert log == ""
    assert memoryview(b" ")[0] == 32  # (the cached object's content; b" "[0] is folded to 32 at compile time)


def test_the_query_division_through_a_float64_reciprocal_rounds_as_ieee_division():
    """fp8_prefill.cu's div_by_scale: ``(float)((double)x * (1.0 / (double)qs))`` is ``x / qs`` rounded to
    float32 (torch's float32 division, IEEE) for every finite bfloat16 and float16 ``x`` and scales across
    float32's range (random, powers of two, and dynamic ones ``amax / 448``), wherever the quotient is at
    least 2^-126 (below it e4m3 rounds to zero either way); infinities and NaN come out as they do."""
    g = torch.Generator().manual_seed(0)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = torch.cat([bits.view(torch.bfloat16).float(), bits.view(torch.float16).float()])
    x = torch.cat([x[torch.isfinite(x)], torch.tensor([float("inf"), -float("inf"), float("nan")])])
    exps = torch.randint(-120, 120, (300,), generator=g).double()
    scales = [(1 + torch.rand(300, generator=g, dtype=torch.float64)) * 2.0**exps,
              2.0 ** torch.arange(-126, 127, 9, dtype=torch.float64),
              (x[torch.isfinite(x) & (x != 0)][torch.randint(0, 100000, (300,), generator=g)].abs() / 448.0)]
    for qs in torch.cat(scales).float().clamp(min=2.0**-126):
        want = x / qs
        got = (x.double() * (1.0 / qs.double())).float()
        normal = torch.isfinite(want) & (want.abs() >= 2.0**-126)
        assert torch.equal(got[normal].view(torch.int32), want[normal].view(torch.int32)), float(qs)
        special = ~torch.isfinite(want)
        assert torch.equal(got[special].isnan(), want[special].isnan()), float(qs)
        assert torch.equal(got[special & ~want.isnan()], want[special & ~want.isnan()]), float(qs)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fmaf(a, b, c)``: ``a b + c`` rounded once to float32 (a b is exact in float64; TwoSum gives the
    float64 sum's error, which decides the rounding only where the float64 sum is a float32 midpoint)."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.float()
    toward = torch.where(err > 0, torch.tensor(float("inf")), torch.tensor(-float("inf")))
    nb = torch.nextafter(r, toward)
    beyond_midpoint = (err != 0) & (s == (r.double() + nb.double()) / 2)
    return torch.where(beyond_midpoint, nb, r)


def _markstein_division(x: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_prefill.cu's float32 div_by_scale(x, qs, rs), operation for operation, and where it keeps the
    corrected quotient."""
    rs = (1.0 / qs.double()).float()  # __frcp_rn: a float32 reciprocal never rounds at a float32 midpoint
    y0 = (x.double() * rs.double()).float()
    y1 = _fma32(_fma32(-y0, qs.expand_as(x), x), rs.expand_as(x), y0)
    y2 = _fma32(_fma32(-y1, qs.expand_as(x), x), rs.expand_as(x), y1)
    a = y0.abs()
    kept = (a >= 2.0**-12) & (a < 1024.0)
    return torch.where(kept, y2, y0), kept


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """``cvt.rn.satfinite.e4m3x2.f32``: the e4m3 code of v (NaN stays NaN, the rest saturates at 448)."""
    return torch.where(v.isnan(), v, v.clamp(-448.0, 448.0)).to(torch.float8_e4m3fn).view(torch.uint8)


def test_the_query_division_in_float32_gives_the_e4m3_codes_of_ieee_division():
    """fp8_prefill.cu's float32 ``div_by_scale(x, qs, rs)`` (Markstein's division: a product and two
    corrections by FMA residuals), taken for scales in [2^-80, 2^80], gives the e4m3 code of
    ``x / qs`` (torch's float32 division, IEEE) for every bfloat16 and float16 ``x``, 2^18 random float32
    bit patterns, infinities and NaN, at random scales, powers of two, the range's ends and dynamic scales
    ``amax / 448``; wherever it keeps the corrected quotient (2^-12 <= |x rs| < 1024) the float32 bits are
    those of the division, so the rounding, not just e4m3's coarser one, is the IEEE one there."""
    g = torch.Generator().manual_seed(1)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    random32 = torch.randint(-(2**31), 2**31 - 1, (2**18,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.bfloat16).float(), bits.view(torch.float16).float(), random32.view(torch.float32),
                   torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 0.0])])
    exps = torch.randint(-80, 80, (120,), generator=g).double()
    finite = x[torch.isfinite(x) & (x != 0)]
    scales = [(1 + torch.rand(120, generator=g, dtype=torch.float64)) * 2.0**exps,
              2.0 ** torch.arange(-80, 81, 20, dtype=torch.float64), torch.tensor([2.0**-80, 2.0**80]),
              (torch.nextafter(torch.tensor([2.0**-80, 2.0**80]).float(), torch.tensor([1.0, 1.0]))).double(),
              finite[torch.randint(0, finite.numel(), (120,), generator=g)].double().abs() / 448.0]
    qss = torch.cat(scales).float()
    qss = qss[(qss >= 2.0**-80) & (qss <= 2.0**80)]
    assert qss.numel() > 200
    kept_corrected = 0
    for qs in qss:
        want = x / qs
        got, kept = _markstein_division(x, qs)
        assert torch.equal(_e4m3(got), _e4m3(want)), float(qs)
        assert torch.equal(got[kept].view(torch.int32), want[kept].view(torch.int32)), float(qs)
        kept_corrected += int(kept.sum())
    assert kept_corrected > 5 * 10**6
