"""The CUDA backend on a real NVIDIA GPU: codec proofs, bit-exact writes, attention, safety, graphs.

Skipped, with the reason, unless there is an NVIDIA GPU of sm70+ and CuPy imports (and, on
sm70, CuPy is built for CUDA 12: CUDA 13's NVRTC refuses sm_70). What each test proves:

* the device build of the software codec (``csrc/codec.cuh``) is bit-exact on the GPU, for
  every fp16/bf16 value, every rounding tie and 2^22 random float32 patterns, in all four
  formats, and decodes all 256 bytes exactly (no flush of subnormals);
* writes through the API are byte-identical to the reference computed on the CPU, for every
  format, layout, granularity and input dtype (specials, subnormals, -NaN, padding), through
  strided views of one engine tensor and with int32 slots;
* attention matches the reference within the derived tolerance at real sizes (split-KV, long
  contexts, window, soft-cap, GQA up to 32 query heads per KV head, head sizes 40..256,
  per-token prefill), and on Hypothesis-drawn workloads through the conformance kit, which
  also checks the log-sum-exp and memory safety with the host checks off;
* the write and attention captured in a CUDA graph give the same bytes and outputs as eager,
  and the per-layer calls never sync the host.

Run: ``python -m pytest -m gpu tests/test_cuda_gpu.py -x -q`` (``HYPOTHESIS_PROFILE=thorough`` for
many examples; ``FP8KV_GPU_EXAMPLES=n`` sets the kit's examples per test).
"""

from __future__ import annotations

import importlib.util
import math
import os
import zlib

import pytest
import torch
import write_checks as checks

import fp8kv
from fp8kv.formats import FORMATS, quantize_scaled
from fp8kv.testing import assert_attention_close, paged_attention_bounds
from fp8kv.testing.tolerance import assert_lse_close


def _skip_reason() -> str | None:
    if not torch.cuda.is_available() or torch.version.hip:
        return "needs an NVIDIA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor < 70:
        return f"needs sm70+ (this GPU is sm{major}{minor})"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install cupy-cuda12x or cupy-cuda13x)"
    from fp8kv_cuda.capabilities import supports

    from fp8kv.plugins import Request
    from fp8kv.probe import probe

    req = Request("write_kv", "fp8_e4m3", "NHD", "tensor", 128, torch.bfloat16, "cuda")
    return supports(probe(torch.device("cuda")), req)


SKIP = _skip_reason()


def _built_sm() -> int:
    """The architecture the backend builds for: the GPU's, or FP8KV_CUDA_ARCH's (e.g. sm75: Turing's
    code paths, JIT-compiled from its PTX; see fp8kv_cuda.runtime)."""
    from fp8kv_cuda.runtime import device_sm

    return device_sm(torch.cuda.current_device()) if SKIP is None else 0


BUILT_SM = _built_sm()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

ALL = list(FORMATS.values())


# ------------------------------------------------------------------------------------ codec


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_device_encoder_is_bit_exact(fmt):
    from fp8kv_cuda.codec import encode_f32

    x = checks.codec_inputs(fmt)
    got = encode_f32(x.cuda(), fmt).cpu()
    want = quantize_scaled(x, fmt).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    first = int(x.view(torch.int32)[bad[0]]) & 0xFFFFFFFF if bad.numel() else 0
    assert bad.numel() == 0, (f"{bad.numel()} mismatches, first x bits 0x{first:08x}: "
                              f"got 0x{int(got[bad[0]]):02x}, want 0x{int(want[bad[0]]):02x}")


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_device_decoder_is_exact(fmt):
    from fp8kv_cuda.codec import decode_f32

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_f32(codes.cuda(), fmt).cpu()
    want = codes.view(fmt.torch_dtype).float()
    ok = (got == want) | (got.isnan() & want.isnan())
    assert bool(ok.all()), f"bytes {(~ok).nonzero().flatten().tolist()[:8]} -> {got[~ok][:4].tolist()}"
    assert torch.equal(torch.signbit(got[~want.isnan()]), torch.signbit(want[~want.isnan()]))


def test_device_float16_widening_is_exact():
    from fp8kv_cuda.codec import widen_f16

    h = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    got = widen_f16(h.cuda()).cpu()
    want = h.view(torch.float16).float()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want.view(torch.int32)[finite])
    assert torch.equal(torch.signbit(got.view(torch.float32)[~finite]), torch.signbit(want[~finite]))


@pytest.mark.skipif(SKIP is not None or BUILT_SM < 89,
                    reason=SKIP or f"the native FP8 widening (cvt.rn.f16x2.e4m3x2/e5m2x2) needs sm89+ (sm{BUILT_SM})")
@pytest.mark.parametrize("fmt", [FORMATS["fp8_e4m3"], FORMATS["fp8_e5m2"]], ids=["fp8_e4m3", "fp8_e5m2"])
def test_device_native_widening_is_exact(fmt):
    """Every FP8 byte pair -> the float16 pair torch's conversion gives (NaN for NaN, signs kept)."""
    from fp8kv_cuda.codec import widen_native

    pairs = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    got = widen_native(pairs.cuda(), fmt).cpu().view(torch.int16).view(-1, 2)
    want = pairs.view(torch.uint8).view(fmt.torch_dtype).to(torch.float16).view(-1, 2).view(torch.int16)
    g, w = got.view(torch.float16), want.view(torch.float16)
    nan = w.isnan()
    assert torch.equal(g.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])


# ------------------------------------------------------------------------------------ write


@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
@pytest.mark.parametrize("gran", ["tensor", "head", "token_head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [128, 40])
def test_write_is_bit_exact_with_the_cpu_reference(fmt, gran, layout, dtype, D):
    T, H, bs = 512, 4, 16
    seed = zlib.crc32(f"{fmt.name}{gran}{layout}{dtype}{D}".encode())
    key, value, slots = checks.extreme_write_inputs(T, H, D, dtype, seed=seed)
    ref = checks.poisoned_cache(T, H, D, bs, fmt.name, gran, layout)
    gpu = checks.cache_to(ref.clone(), "cuda")
    fp8kv.write_kv_one_shot(ref, key, value, slots, backend="reference")
    fp8kv.write_kv_one_shot(gpu, key.cuda(), value.cuda(), slots.cuda(), backend="cuda")
    checks.assert_same_bytes(gpu, ref)


@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_write_through_strided_views_with_int32_slots(gran):
    """K and V as t[:, 0] / t[:, 1] of one [num_blocks, 2, H, bs, D] tensor (HND), token_head scales as a
    view with padding, int32 slots: same bytes as the reference, nothing else touched."""
    nb, H, bs, D, T = 64, 4, 16, 128, 300
    g = torch.Generator().manual_seed(5)
    both = torch.randint(0, 256, (nb, 2, H, bs, D), generator=g, dtype=torch.uint8)
    kw = dict(k_scale=0.05, v_scale=0.02)
    if gran == "token_head":
        pad = torch.full((nb, bs, H + 3, 2), math.nan)
        kw = dict(k_scale=pad[:, :, :H, 0], v_scale=pad[:, :, :H, 1])
    ref = fp8kv.KVCache.from_tensors(both[:, 0], both[:, 1], kv_dtype="fp8_e4m3", layout="HND",
                                     scale_granularity=gran, **kw)
    both_gpu = both.clone().cuda()
    kw_gpu = kw
    if gran == "token_head":
        pad_gpu = pad.clone().cuda()
        kw_gpu = dict(k_scale=pad_gpu[:, :, :H, 0], v_scale=pad_gpu[:, :, :H, 1])
    gpu = fp8kv.KVCache.from_tensors(both_gpu[:, 0], both_gpu[:, 1], kv_dtype="fp8_e4m3", layout="HND",
                                     scale_granularity=gran, **kw_gpu)
    key = torch.randn(T, H, D, generator=g).bfloat16()
    value = torch.randn(T, H, D, generator=g).bfloat16() * 3
    slots = torch.randperm(nb * bs, generator=g)[:T].int()
    fp8kv.write_kv_one_shot(ref, key, value, slots, backend="reference")
    fp8kv.write_kv_one_shot(gpu, key.cuda(), value.cuda(), slots.cuda(), backend="cuda")
    assert torch.equal(both_gpu.cpu(), both)
    if gran == "token_head":
        assert torch.equal(pad_gpu.cpu().view(torch.int32), pad.view(torch.int32))


# -------------------------------------------------------------------------------- attention


def _paged(B: int, L, H: int, D: int, bs: int, fmt: str, gran: str, layout: str, seed: int):
    """A cache with B sequences of lengths L (int or list), written through the cuda backend."""
    return checks.paged_gpu_cache(B, L, H, D, bs, fmt, gran, layout, seed, backend="cuda", spread_head_scales=True)


CASES = {
    # (B, L, Hq, H, D, q_len, dtype, fmt, gran, layout, window, cap)
    "decode-32x4k": (32, 4096, 32, 8, 128, 1, torch.bfloat16, "fp8_e4m3", "tensor", "NHD", None, None),
    "decode-1x128k-split": (1, 131072, 32, 8, 128, 1, torch.bfloat16, "fp8_e4m3", "tensor", "NHD", None, None),
    "decode-mixed-token-head-cap": (3, [70000, 5, 20000], 32, 8, 128, 1, torch.float16, "fp8_e5m2", "token_head",
                                    "HND", None, 30.0),
    "decode-mqa-d256-window": (4, [3000, 1, 77, 4096], 32, 1, 256, 1, torch.bfloat16, "fp8_e4m3fnuz", "head",
                               "NHD", 1000, None),
    "decode-d40-f32": (5, [900, 1000, 3, 64, 65], 6, 2, 40, 1, torch.float32, "fp8_e5m2fnuz", "token_head", "HND",
                       None, None),
    "decode-d64-gqa1": (8, 2048, 8, 8, 64, 1, torch.float16, "fp8_e4m3", "head", "NHD", 300, 50.0),
    "prefill-window": (2, [3000, 2500], 16, 2, 128, 300, torch.bfloat16, "fp8_e4m3", "head", "NHD", 1024, None),
    "prefill-f32-fnuz": (2, 5000, 8, 8, 128, 77, torch.float32, "fp8_e4m3fnuz", "token_head", "HND", 333, 10.0),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_attention_at_real_sizes(case):
    B, L, Hq, H, D, q_len, dtype, fmt, gran, layout, window, cap = case
    cache, tables, lens = _paged(B, L, H, D, 16, fmt, gran, layout, seed=5)
    qsl, query, out = checks.gpu_queries(lens, q_len, Hq, D, dtype)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    _, lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens, query_start_loc=qsl, out=out, backend="cuda",
                                   return_lse=True, **kw)
    ref, ref_lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens, query_start_loc=qsl, backend="reference",
                                         return_lse=True, **kw)
    bounds = paged_attention_bounds(query, cache, tables, lens, qsl, sliding_window=window, logits_soft_cap=cap)
    assert_attention_close(out, ref, **bounds)
    assert_lse_close(lse, ref_lse, **bounds)


def _fill_finite_codes(cache, fmt, g: torch.Generator) -> None:
    """K and V of every slot set to random bytes, every finite code of ``fmt`` (subnormals included):
    a NaN/inf code becomes its low nibble (a finite code)."""
    bad = torch.tensor(fmt.nan_encodings + fmt.inf_encodings, dtype=torch.uint8)
    for c in (cache.key_cache, cache.value_cache):
        b = torch.randint(0, 256, c.shape, generator=g, dtype=torch.uint8)
        b = torch.where(torch.isin(b, bad), b & 0x0F, b)
        c.view(torch.uint8).copy_(b.cuda())


def _mma_capable() -> bool:
    return SKIP is None and BUILT_SM >= 75


@pytest.mark.skipif(not _mma_capable(), reason=SKIP or "the tensor-core kernel needs sm75+ (mma.sync, movmatrix)")
@pytest.mark.parametrize("gran", ["head", "token_head"])
@pytest.mark.parametrize("specials", [False, True], ids=["finite-codes", "nan-inf-codes"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_tensor_core_kernel_on_every_code(fmt, dtype, D, specials, gran):
    """The tensor-core kernel (``csrc/attention_mma.cu``) on caches of raw random bytes: every finite
    code (subnormals included) through its bit-level FP8 -> 16-bit conversion, and, with
    ``specials``, NaN/inf codes in chosen keys (NaN must reach exactly the reference's outputs);
    token_head scales drawn over 2^-40..2^40 (the weights' power-of-two running maximum)."""
    from fp8kv_cuda.attention import plan
    from fp8kv_cuda.variants import mma_arch_serves

    if not mma_arch_serves(BUILT_SM, fmt.name, D, str(dtype).removeprefix("torch.")):
        pytest.skip(f"the tensor-core kernel does not serve {fmt.name} D={D} {dtype} on sm{BUILT_SM}")

    g = torch.Generator().manual_seed(D + 7 * int(specials))
    B, H, Hq, bs = 4, 2, 12, 16
    lens = [37, 1100, 1, 1300]  # rows 1 and 3 see >= FULL_P_KEYS keys: P as one float16
    nblocks = 4 * 82 + 8
    tables = torch.randperm(nblocks, generator=g)[: B * 82].view(B, 82).int()
    kw = dict(k_scale=torch.tensor([0.004, 0.02]), v_scale=torch.tensor([0.03, 0.0007])) if gran == "head" else {}
    cache = fp8kv.KVCache.allocate(nblocks, bs, H, D, kv_dtype=fmt.name, scale_granularity=gran, device="cuda", **kw)
    if gran == "token_head":
        for sc in (cache.k_scale, cache.v_scale):
            sc.copy_(torch.exp2(torch.rand(sc.shape, generator=g) * 80 - 40).cuda())
    _fill_finite_codes(cache, fmt, g)
    if specials:  # seq 1 key 200: a NaN in K (its row is NaN); seq 3 key 5: NaN/inf in V (those dims)
        k_slot = (int(tables[1, 200 // bs]), 200 % bs)
        v_slot = (int(tables[3, 5 // bs]), 5 % bs)
        cache.key_cache[k_slot[0], k_slot[1], 0, 3].view(torch.uint8).fill_(fmt.nan_encodings[0])
        for d, code in zip((1, D - 1), (fmt.nan_encodings + fmt.inf_encodings) * 2, strict=False):
            cache.value_cache[v_slot[0], v_slot[1], 1, d].view(torch.uint8).fill_(code)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    tables = tables.cuda()
    query = (torch.randn(B, Hq, D, generator=g) * 2).to(dtype).cuda()
    p = plan(query.device, num_tokens=B, num_kv_heads=H, group=Hq // H, head_size=D, max_keys=82 * bs,
             query_dtype=dtype, token_scales=gran == "token_head", fmt=fmt.name)
    assert p.mma
    out, lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens_t, out=torch.full_like(query, math.nan),
                                     backend="cuda", return_lse=True)
    ref, ref_lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens_t, backend="reference", return_lse=True)
    if specials:
        assert out[1, 0:6].isnan().all() and not out[1, 6:].isnan().any()
        assert out[3, 6:, [1, D - 1]].isnan().all() and not out[3, :, 2:D - 1].isnan().any()
    qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    bounds = paged_attention_bounds(query, cache, tables, lens_t, qsl)
    assert_attention_close(out, ref, **bounds)
    if not specials:
        assert_lse_close(lse, ref_lse, **bounds)
    if dtype == torch.bfloat16 and not specials:  # a range beyond 2^31: the exact bfloat16-K path
        wide = query.clone()
        wide[..., ::2] *= 2.0**-40
        out = fp8kv.paged_attention_one_shot(wide, cache, tables, lens_t, backend="cuda")
        ref = fp8kv.paged_attention_one_shot(wide, cache, tables, lens_t, backend="reference")
        assert_attention_close(out, ref, **paged_attention_bounds(wide, cache, tables, lens_t, qsl))


@pytest.mark.skipif(not _mma_capable(), reason=SKIP or "the tensor-core kernel needs sm75+ (mma.sync, movmatrix)")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("bs", [8, 16, 48, 64])
def test_tensor_core_decode_block_sizes_and_hostile_tables(bs, layout):
    """The tensor-core decode's two copy paths: block sizes that are a multiple of 16 (one block-table
    entry per 16-key sub-tile, offsets planned once per thread) and others (every key located on its
    own), with windows that start mid-block, against the reference; then block tables holding ids
    outside the cache, which must be skipped: the cache sits between guard blocks of NaN codes, so a
    read outside it would make outputs NaN."""
    g = torch.Generator().manual_seed(bs)
    H, Hq, D, NB, GUARD = 2, 8, 64, 40, 2
    nan = FORMATS["fp8_e4m3"].nan_encodings[0]
    shape = (NB + 2 * GUARD, bs, H, D) if layout == "NHD" else (NB + 2 * GUARD, H, bs, D)
    parents = [torch.full(shape, nan, dtype=torch.uint8, device="cuda") for _ in range(2)]
    inner = slice(GUARD, GUARD + NB)
    cache = fp8kv.KVCache.from_tensors(parents[0][inner], parents[1][inner], kv_dtype="fp8_e4m3", layout=layout,
                                       k_scale=0.02, v_scale=0.03)
    slots = torch.arange(NB * bs)
    key, value = torch.randn(NB * bs, H, D, generator=g) * 3, torch.randn(NB * bs, H, D, generator=g)
    fp8kv.write_kv_one_shot(cache, key.cuda(), value.cuda(), slots.cuda(), backend="cuda")
    lens_l = [NB * bs - 3, 37, 1, 17 * bs + 5]
    per = NB // 2
    tables = torch.stack([torch.randperm(NB, generator=g)[:per] for _ in lens_l]).int()
    lens_l = [min(n, per * bs) for n in lens_l]
    lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
    qdtype = torch.bfloat16 if BUILT_SM >= 80 else torch.float16  # (Turing: float16 on tensor cores)
    query = torch.randn(len(lens_l), Hq, D, generator=g).to(qdtype).cuda()
    qsl = torch.arange(len(lens_l) + 1, dtype=torch.int32, device="cuda")
    for window in (None, 3 * bs // 2 + 5):
        out = fp8kv.paged_attention_one_shot(query, cache, tables.cuda(), lens, sliding_window=window, backend="cuda")
        ref = fp8kv.paged_attention_one_shot(query, cache, tables.cuda(), lens, sliding_window=window,
                                             backend="reference")
        assert_attention_close(out, ref, **paged_attention_bounds(query, cache, tables.cuda(), lens, qsl,
                                                                  sliding_window=window))
    snapshot = [p.clone() for p in parents]
    hostile = tables.clone()
    hostile[0, ::3] = NB
    hostile[1, 0] = -5
    hostile[3, 1::2] = 2**31 - 1
    meta = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=qdtype, block_tables=hostile.cuda(),
                                seq_lens=lens, max_seq_len=per * bs, validate=False, backend="cuda")
    out = fp8kv.paged_attention(query, cache, meta)
    torch.cuda.synchronize()
    assert meta.attention.backend.name == "cuda"
    assert bool(torch.isfinite(out).all()), "a block id outside the cache was read (guard NaN codes reached out)"
    assert all(torch.equal(a, b) for a, b in zip(parents, snapshot, strict=True))


@pytest.mark.skipif(not _mma_capable(), reason=SKIP or "the tensor-core kernel needs sm75+ (mma.sync, movmatrix)")
@pytest.mark.parametrize("granularity", ["tensor", "token_head"])
@pytest.mark.parametrize("seqs", [20, 40, 64, 150])
def test_tensor_core_decode_wave_tiles(seqs, granularity):
    """Decode grids of more CTAs than SMs (GQA 32/8, head size 128: 160, 320, 512 and 1200 CTAs), which
    on sm90 take mma_wave_config's warps, stages and 16-key sub-tiles (4 x 2 x 1, 3 x 2 x 1, 2 x 3 x 1;
    1200 keep the default 6 x 2 x 2), against the reference."""
    from fp8kv_cuda import attention as cuda_attention

    g = torch.Generator().manual_seed(seqs)
    H, Hq, D, bs, L = 8, 32, 128, 16, 100
    nblk = -(-L // bs)
    cache = fp8kv.KVCache.allocate(seqs * nblk, bs, H, D, kv_dtype="fp8_e4m3", scale_granularity=granularity,
                                   device="cuda")
    n = seqs * nblk * bs
    fp8kv.write_kv_one_shot(cache, (torch.randn(n, H, D, generator=g) * 3).cuda(), torch.randn(n, H, D,
                                                                                               generator=g).cuda(),
                   torch.arange(n, device="cuda"), backend="cuda")
    tables = torch.randperm(seqs * nblk, generator=g).int().view(seqs, nblk).cuda()
    lens = torch.full((seqs,), L, dtype=torch.int32, device="cuda")
    qdtype = torch.bfloat16 if BUILT_SM >= 80 else torch.float16
    query = torch.randn(seqs, Hq, D, generator=g).to(qdtype).cuda()
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
    if BUILT_SM == 90:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        wave = cuda_attention.mma_wave_config(torch.device("cuda"), D, seqs * H,
                                              token_scales=granularity == "token_head")
        assert (wave is not None) == (sms < seqs * H <= 4 * sms)
    out = fp8kv.paged_attention_one_shot(query, cache, tables, lens, backend="cuda")
    ref = fp8kv.paged_attention_one_shot(query, cache, tables, lens, backend="reference")
    assert_attention_close(out, ref, **paged_attention_bounds(query, cache, tables, lens, qsl))


@pytest.mark.skipif(not _mma_capable(), reason=SKIP or "the tensor-core kernel needs sm75+ (mma.sync, movmatrix)")
@pytest.mark.parametrize("L", [100, 4096], ids=["unsplit", "split"])
def test_tensor_core_decode_writes_outputs_at_any_alignment(L):
    """The decode's epilogue stores four consecutive outputs as one vector where ``out`` is aligned to four
    elements, one by one where it is not: an ``out`` one element past an aligned address gets the same bits
    (a short context writes ``out`` from the decode kernel, a long one from the split merge)."""
    g = torch.Generator().manual_seed(L)
    H, Hq, D, bs, seqs = 8, 32, 128, 16, 3
    nblk = -(-L // bs)
    cache = fp8kv.KVCache.allocate(seqs * nblk, bs, H, D, kv_dtype="fp8_e4m3", device="cuda")
    n = seqs * nblk * bs
    fp8kv.write_kv_one_shot(cache, torch.randn(n, H, D, generator=g).cuda(), torch.randn(n, H, D, generator=g).cuda(),
                   torch.arange(n, device="cuda"), backend="cuda")
    tables = torch.randperm(seqs * nblk, generator=g).int().view(seqs, nblk).cuda()
    lens = torch.full((seqs,), L, dtype=torch.int32, device="cuda")
    qdtype = torch.bfloat16 if BUILT_SM >= 80 else torch.float16
    query = torch.randn(seqs, Hq, D, generator=g).to(qdtype).cuda()
    aligned = torch.full_like(query, float("nan"))
    shifted = torch.full((query.numel() + 1,), float("nan"), dtype=qdtype, device="cuda")[1:].view_as(query)
    assert shifted.data_ptr() % (4 * shifted.element_size()) != 0
    meta = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=qdtype, block_tables=tables, seq_lens=lens,
                                max_seq_len=L, backend="cuda")
    fp8kv.paged_attention(query, cache, meta, out=aligned)
    fp8kv.paged_attention(query, cache, meta, out=shifted)
    assert meta.attention.backend.name == "cuda"
    assert torch.equal(aligned, shifted)
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
    ref = fp8kv.paged_attention_one_shot(query, cache, tables, lens, backend="reference")
    assert_attention_close(aligned, ref, **paged_attention_bounds(query, cache, tables, lens, qsl))


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", sorted(FORMATS))
def test_conformance_kit_on_the_gpu(kv_dtype, io_dtype):
    """The kit's Hypothesis workloads (writes bit-exact, attention and lse within the derived
    tolerance, refusals, and the memory-safety pass with hostile indices and host checks off)."""
    from fp8kv.testing import check_backend

    n = os.environ.get("FP8KV_GPU_EXAMPLES")
    report = check_backend("cuda", device="cuda", examples=int(n) if n else None, kv_dtypes=(kv_dtype,),
                           io_dtypes=(io_dtype,), max_seqs=4, max_seq_len=300, head_sizes=(16, 40, 64, 128, 256))
    print(report.summary())
    assert report.served["write_kv"] and report.served["paged_attention"]
    assert report.memory_safe == ["tensor", "token_head"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16])
def test_memory_safety_with_host_checks_off(layout, io_dtype):
    from fp8kv.testing import check_memory_safety

    for gran in ("tensor", "head", "token_head"):
        check_memory_safety("cuda", "cuda", layout=layout, granularity=gran, io_dtype=io_dtype)


# ------------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("gran", ["tensor", "token_head"])
@pytest.mark.parametrize("new", [1, 8])
def test_cuda_graph_capture_matches_eager(gran, new):
    """Write + attention (decode: new=1, split-KV over a 1000-token sequence; prefill: new=8)
    captured in a CUDA graph: the same bytes and outputs as eager."""
    H, Hq, D, bs = 8, 32, 128, 16
    cache, tables, lens = _paged(4, [1000, 17, 513, 64], H, D, bs, "fp8_e4m3", gran, "NHD", seed=9)
    g = torch.Generator(device="cuda").manual_seed(1)
    big, tables2, lens2, slots, key, value, query, qsl = checks.grown_step(cache, tables, lens, new, Hq, gran, g)

    def step(c, out, lse):
        fp8kv.write_kv_one_shot(c, key, value, slots, backend="cuda")
        _, got = fp8kv.paged_attention_one_shot(query, c, tables2, lens2, query_start_loc=qsl, max_query_len=new,
                                                out=out,
                                       return_lse=True, backend="cuda")
        lse.copy_(got)

    eager, out_eager, lse_eager = big.clone(), torch.empty_like(query), torch.empty(4 * new, Hq, device="cuda")
    step(eager, out_eager, lse_eager)
    graphed, out_graph = big.clone(), torch.full_like(query, math.nan)
    lse_graph = torch.full((4 * new, Hq), math.nan, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(big.clone(), torch.empty_like(query), torch.empty_like(lse_graph))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, out_graph, lse_graph)
    graph.replay()
    torch.cuda.synchronize()
    assert graphed.same_bytes(eager)
    assert torch.equal(out_graph.view(torch.int16), out_eager.view(torch.int16))
    assert torch.equal(lse_graph.view(torch.int32), lse_eager.view(torch.int32))


def test_per_layer_calls_never_sync_the_host():
    cache, meta, key, query, _ = checks.planned_gpu_step("cuda", prefill=False)
    checks.assert_per_layer_calls_never_sync(cache, meta, key, query)


def test_auto_picks_cuda_where_triton_cannot_or_is_slower():
    from fp8kv.plugins import Request
    from fp8kv.registry import select_backend

    decode = Request("paged_attention", "fp8_e4m3", "NHD", "tensor", 128, torch.bfloat16, "cuda")
    prefill = Request("paged_attention", "fp8_e4m3", "NHD", "tensor", 128, torch.bfloat16, "cuda",
                      frozenset({"chunked_prefill"}))
    picks = [select_backend(r, torch.device("cuda")).backend.name for r in (decode, prefill)]
    major, minor = torch.cuda.get_device_capability()
    if major >= 8 and importlib.util.find_spec("triton") is not None:  # cuda where measured faster (sm90)
        assert picks == (["cuda", "cuda"] if (major, minor) == (9, 0) else ["triton", "triton"])
    else:
        assert picks == ["cuda", "cuda"]


PREFILL_CASES = {
    # (lens, q_lens, Hq, H, causal, window, cap, hole): seq s has q_lens[s] new tokens at its end
    "short-rows-hi-lo-p": ([700, 1500, 64], [300, 129, 64], 16, 2, True, None, None, False),
    "long-rows-one-p-hole": ([3000, 2500], [200, 131], 16, 4, True, None, None, True),
    "window-cap": ([2600, 1800], [170, 300], 8, 2, True, 1100, 30.0, False),
    "non-causal-split": ([20000], [64], 8, 2, False, None, None, False),
}


@pytest.mark.parametrize("kernel", ["mma", "wgmma", "wmma"])
@pytest.mark.parametrize("specials", [False, True], ids=["finite-codes", "nan-codes"])
@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=list(PREFILL_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ALL, ids=[f.name for f in ALL])
def test_tensor_core_prefill(fmt, dtype, case, specials, kernel, monkeypatch):
    """The tensor-core prefill kernel (``csrc/prefill_mma.cu``) on caches of raw random bytes (every
    finite code), GQA rows packed, causal/non-causal, window, soft-cap, a block-table hole, a split
    plan; with ``specials``, a NaN code in K (the rows that see it are NaN) and NaN/inf codes in V
    (those dims of the rows that see it), which send the CTAs on the bit-level path to the exact
    kernel. bfloat16 queries beyond a 2^31 range take the exact kernel's bfloat16-K path. ``wgmma``:
    the same with the sm90 kernel (``csrc/prefill_wgmma.cu``) as the fast kernel (e4m3 only; the
    soft-capped and split cases keep ``fp8kv_prefill_mma``), a V NaN code in an edge tile handed back.
    ``wmma``: Volta's kernel (``csrc/prefill_wmma.cu``, float16 queries) on whatever GPU this is (no
    sm70 has run it), the exact kernel's NaN/inf V fix-up included."""
    from fp8kv_cuda import attention as cuda_attention
    from fp8kv_cuda.attention import plan
    from fp8kv_cuda.variants import MMA_MIN_SM, WGMMA_PREFILL_FORMATS, prefill_arch_serves

    if not prefill_arch_serves(BUILT_SM, fmt.name, 128, str(dtype).removeprefix("torch.")):
        pytest.skip(f"the tensor-core prefill kernel does not serve {dtype} queries on sm{BUILT_SM}")
    if kernel == "mma" and BUILT_SM < MMA_MIN_SM:
        pytest.skip(f"the mma prefill kernel needs sm75+ (here sm{BUILT_SM}: the wmma kernel serves)")
    if kernel == "wgmma" and (BUILT_SM != 90 or fmt.name not in WGMMA_PREFILL_FORMATS):
        pytest.skip(f"the wgmma prefill kernel needs sm90 (here sm{BUILT_SM}) and an e4m3 cache")
    if kernel == "wmma" and dtype != torch.float16:
        pytest.skip("Volta's wmma prefill kernel takes float16 queries only")
    monkeypatch.setattr(cuda_attention, "WGMMA_PREFILL", kernel == "wgmma")
    monkeypatch.setattr(cuda_attention, "WMMA_PREFILL_BELOW_SM", 1000 if kernel == "wmma" else MMA_MIN_SM)
    if kernel == "wmma" and not cuda_attention.prefill_serves(torch.device("cuda"), dtype, 128, False, fmt.name):
        pytest.skip(f"Volta's wmma prefill kernel needs {cuda_attention.wmma_smem_bytes(128)} bytes of shared memory, "
                    f"more than sm{BUILT_SM} gives a block (FP8KV_CUDA_ARCH=sm75: Turing's 64 KiB)")
    lens, q_lens, Hq, H, causal, window, cap, hole = PREFILL_CASES[case]
    D, bs, B = 128, 16, len(lens)
    g = torch.Generator().manual_seed(sum(lens) + int(specials))
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 5
    perm = torch.randperm(nblocks, generator=g).int()
    tables = torch.full((B, max(need) + 2), 10**6, dtype=torch.int32)  # (past the lengths: never read)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    if hole:  # keys 32..47 of sequence 0 sit in an invalid block: masked out
        tables[0, 2] = -1
    kw = dict(k_scale=torch.linspace(0.004, 0.02, H), v_scale=torch.linspace(0.03, 0.001, H))
    cache = fp8kv.KVCache.allocate(nblocks, bs, H, D, kv_dtype=fmt.name, scale_granularity="head", device="cuda", **kw)
    _fill_finite_codes(cache, fmt, g)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = int(qsl[-1])
    if specials:  # seq 0: K NaN at the last cached key (kv head 0); NaN/inf V at the one before (kv head
        # H - 1), both seen by every row of the sequence (in a tile that is not interior for the CTA)
        kpos = lens[0] - q_lens[0] - 1
        blk = int(tables[0, kpos // bs])
        cache.key_cache[blk, kpos % bs, 0, 3].view(torch.uint8).fill_(fmt.nan_encodings[0])
        blk = int(tables[0, (kpos - 1) // bs])
        for d, code in zip((1, D - 1), (fmt.nan_encodings + fmt.inf_encodings) * 2, strict=False):
            cache.value_cache[blk, (kpos - 1) % bs, H - 1, d].view(torch.uint8).fill_(code)
    tables = tables.cuda()
    query = (torch.randn(T, Hq, D, generator=g) * 2).to(dtype).cuda()
    p = plan(query.device, num_tokens=T, num_kv_heads=H, group=Hq // H, head_size=D,
             max_keys=tables.shape[1] * bs, query_dtype=dtype, fmt=fmt.name, max_query_len=max(q_lens), num_seqs=B)
    assert p.prefill
    if case == "non-causal-split":
        assert p.num_splits > 1
    # (host checks off: the table holds an invalid block and ids past the lengths)
    kw = dict(query_start_loc=qsl, causal=causal, sliding_window=window, logits_soft_cap=cap, validate=False,
              max_query_len=max(q_lens))
    out, lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens_t, out=torch.full_like(query, math.nan),
                                     backend="cuda", return_lse=True, **kw)
    ref, ref_lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens_t, backend="reference", return_lse=True,
                                                  **kw)
    assert torch.equal(out.isnan(), ref.isnan())
    if specials:
        assert ref[: q_lens[0], : Hq // H].isnan().all()  # every row of seq 0 sees the K NaN (head group 0)
        assert ref[: q_lens[0], -(Hq // H):, [1, D - 1]].isnan().all()
    bounds = paged_attention_bounds(query, cache, tables, lens_t, qsl, causal=causal, sliding_window=window,
                                    logits_soft_cap=cap)
    assert_attention_close(out, ref, **bounds)
    if not specials:
        assert_lse_close(lse, ref_lse, **bounds)
    if dtype == torch.bfloat16 and not specials:  # a range beyond 2^31: the exact kernel's bfloat16-K path
        wide = query.clone()
        wide[..., ::2] *= 2.0**-40
        out = fp8kv.paged_attention_one_shot(wide, cache, tables, lens_t, backend="cuda", **kw)
        ref = fp8kv.paged_attention_one_shot(wide, cache, tables, lens_t, backend="reference", **kw)
        assert_attention_close(out, ref, **paged_attention_bounds(wide, cache, tables, lens_t, qsl, causal=causal,
                                                                   sliding_window=window, logits_soft_cap=cap))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma prefill kernel needs sm90 (sm_90a code)")
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("query_scale", [1.0, 1e30, 1e-30], ids=["normal", "huge", "tiny"])
def test_wgmma_prefill_against_the_reference(query_scale, pingpong, monkeypatch):
    """The sm90 wgmma prefill (opt-in) at a real size: causal chunks over cached keys, GQA 4, bfloat16;
    huge queries (a logit could overflow float32) are handed back to the exact kernel; tiny ones stay;
    CUDA-graph replay gives the same bits."""
    from fp8kv_cuda import attention as cuda_attention

    monkeypatch.setattr(cuda_attention, "WGMMA_PREFILL", True)
    monkeypatch.setattr(cuda_attention, "WGMMA_PINGPONG", pingpong)
    g = torch.Generator().manual_seed(11)
    H, Hq, D, bs = 8, 32, 128, 16
    lens, q_lens = [2048 + 512, 1300, 700], [512, 300, 700]
    need = [-(-n // bs) for n in lens]
    tables = torch.randperm(sum(need), generator=g).int()
    table = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = tables[at:at + k]
        at += k
    cache = fp8kv.KVCache.allocate(sum(need), bs, H, D, kv_dtype="fp8_e4m3", scale_granularity="head",
                                   k_scale=torch.linspace(0.01, 0.03, H), v_scale=torch.linspace(0.03, 0.01, H),
                                   device="cuda")
    n = sum(need) * bs
    fp8kv.write_kv_one_shot(cache, torch.randn(n, H, D, generator=g).cuda(), torch.randn(n, H, D, generator=g).cuda(),
                   torch.arange(n, device="cuda"))
    T = sum(q_lens)
    query = ((torch.randn(T, Hq, D, generator=g) * 2) * query_scale).to(torch.bfloat16).cuda()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    table = table.cuda()
    kw = dict(query_start_loc=qsl, max_query_len=max(q_lens))
    meta = fp8kv.plan_attention(cache, num_q_heads=Hq, query_dtype=query.dtype, block_tables=table, seq_lens=lens_t,
                                backend="cuda", **kw)
    out, lse = fp8kv.paged_attention(query, cache, meta, return_lse=True)
    ref, ref_lse = fp8kv.paged_attention_one_shot(query, cache, table, lens_t, backend="reference", return_lse=True,
                                                  **kw)
    bounds = paged_attention_bounds(query, cache, table, lens_t, qsl, causal=True, sliding_window=None,
                                    logits_soft_cap=None)
    assert_attention_close(out, ref, **bounds)
    assert_lse_close(lse, ref_lse, **bounds)
    from fp8kv.testing.graphs import capture_and_replay

    graph_out = torch.empty_like(out)
    capture_and_replay(lambda: fp8kv.paged_attention(query, cache, meta, out=graph_out), graph_out)
    assert torch.equal(graph_out.view(torch.int16), out.view(torch.int16))


WGMMA_CACHE_LAYOUTS = {  # name: (page, layout); TMA loads unless the page neither divides nor is a multiple of 64
    "page16": (16, "NHD"), "page1": (1, "NHD"), "page32": (32, "NHD"), "page128": (128, "NHD"),
    "page256": (256, "NHD"), "hnd": (16, "HND"), "hnd_page64": (64, "HND"), "page12": (12, "NHD"),
    "page48": (48, "NHD"),
}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma prefill kernel needs sm90 (sm_90a code)")
@pytest.mark.parametrize("layout", list(WGMMA_CACHE_LAYOUTS))
def test_wgmma_prefill_cache_layouts_with_nan_codes_past_the_sequence(layout, monkeypatch):
    """The sm90 wgmma prefill on pages of 1..256 keys and both cache layouts: TMA loads (one box per page,
    per 64 keys of a longer page) except for pages of 12 and 48 keys (cp.async). Every cache slot past a
    sequence's length holds NaN codes in K and V: TMA loads whole pages, so they reach shared memory,
    and must not reach the output; the causal chunk starts mid-page, a window cuts the first keys."""
    from fp8kv_cuda import attention as cuda_attention
    from fp8kv_cuda.attention import plan
    from fp8kv_cuda.tma import paged_cache_maps

    monkeypatch.setattr(cuda_attention, "WGMMA_PREFILL", True)
    page, lay = WGMMA_CACHE_LAYOUTS[layout]
    g = torch.Generator().manual_seed(page)
    H, Hq, D = 4, 16, 128
    lens, q_lens = [333, 231], [150, 131]
    need = [-(-n // page) for n in lens]
    nblocks = sum(need) + 1
    cache = fp8kv.KVCache.allocate(nblocks, page, H, D, kv_dtype="fp8_e4m3", layout=lay, scale_granularity="head",
                                   k_scale=torch.linspace(0.01, 0.03, H), v_scale=torch.linspace(0.03, 0.01, H),
                                   device="cuda")
    assert (paged_cache_maps(cache, 64) is None) == (layout in ("page12", "page48"))
    n = nblocks * page
    fp8kv.write_kv_one_shot(cache, torch.randn(n, H, D, generator=g).cuda(), torch.randn(n, H, D, generator=g).cuda(),
                   torch.arange(n, device="cuda"))
    perm = torch.randperm(nblocks, generator=g).int()
    tables = torch.full((len(lens), max(need)), nblocks, dtype=torch.int32)  # (past the lengths: outside)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
        for pos in range(lens[i], k * page):  # NaN codes (0x7F) in every slot past the length
            blk = int(tables[i, pos // page])
            for t in (cache.key_cache.view(torch.uint8), cache.value_cache.view(torch.uint8)):
                (t[blk, pos % page] if lay == "NHD" else t[blk, :, pos % page]).fill_(0x7F)
    tables = tables.cuda()
    T = sum(q_lens)
    query = (torch.randn(T, Hq, D, generator=g) * 2).to(torch.bfloat16).cuda()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    p = plan(query.device, num_tokens=T, num_kv_heads=H, group=Hq // H, head_size=D, max_keys=tables.shape[1] * page,
             query_dtype=query.dtype, fmt="fp8_e4m3", max_query_len=max(q_lens), num_seqs=len(lens))
    assert p.prefill and p.num_splits == 1
    for window in (None, 250):
        kw = dict(query_start_loc=qsl, causal=True, sliding_window=window, max_query_len=max(q_lens), validate=False)
        out, lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens_t, backend="cuda", return_lse=True, **kw)
        ref, ref_lse = fp8kv.paged_attention_one_shot(query, cache, tables, lens_t, backend="reference",
                                                      return_lse=True, **kw)
        assert torch.isfinite(out).all() and torch.isfinite(ref).all()
        bounds = paged_attention_bounds(query, cache, tables, lens_t, qsl, causal=True, sliding_window=window,
                                        logits_soft_cap=None)
        assert_attention_close(out, ref, **bounds)
        assert_lse_close(lse, ref_lse, **bounds)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma prefill kernel needs sm90 (sm_90a code)")
@pytest.mark.parametrize("layout", ["NHD", "HND", "NHD-page12"])
def test_wgmma_prefill_with_hostile_metadata_stays_in_its_cache(layout, monkeypatch):
    """fp8kv.testing.safety's hostile metadata at head size 128 (its own check runs at 16, which the wgmma
    prefill does not serve): block ids num_blocks, 2^31 - 1 and -5, lengths past the table and negative,
    query offsets past the step, host checks off. The cache is the middle of larger tensors filled with
    NaN codes: the TMA boxes (a block coordinate outside the tensor map) and the cp.async loads (page
    12) read none of them, nothing outside the cache is written, and the covered rows stay finite."""
    from fp8kv_cuda import attention as cuda_attention

    monkeypatch.setattr(cuda_attention, "WGMMA_PREFILL", True)
    _prefill_with_hostile_metadata(layout, torch.bfloat16, tma=True)


@pytest.mark.parametrize("layout", ["NHD", "HND", "NHD-page12"])
def test_volta_prefill_with_hostile_metadata_stays_in_its_cache(layout, monkeypatch):
    """The same for Volta's wmma prefill kernel (float16 queries), run on whatever GPU this is."""
    from fp8kv_cuda import attention as cuda_attention

    monkeypatch.setattr(cuda_attention, "WMMA_PREFILL_BELOW_SM", 1000)
    _prefill_with_hostile_metadata(layout, torch.float16, tma=False)


def _prefill_with_hostile_metadata(layout: str, dtype: torch.dtype, tma: bool) -> None:
    from fp8kv_cuda import attention as cuda_attention
    from fp8kv_cuda.attention import plan_prefill
    from fp8kv_cuda.tma import paged_cache_maps

    page = 12 if layout.endswith("page12") else 16
    lay = layout.split("-")[0]
    H, HQ, D, NB, G = 2, 8, 128, 6, 2
    shape = (NB + 2 * G, page, H, D) if lay == "NHD" else (NB + 2 * G, H, page, D)
    parents = [torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda") for _ in range(2)]
    cache = fp8kv.KVCache.from_tensors(parents[0][G:G + NB], parents[1][G:G + NB], kv_dtype="fp8_e4m3",
                                       layout=lay, scale_granularity="head",
                                       k_scale=torch.tensor([0.05, 0.02], device="cuda"),
                                       v_scale=torch.tensor([0.07, 0.03], device="cuda"))
    if tma:
        assert (paged_cache_maps(cache, 64) is None) == (page == 12)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(NB * page, H, D, generator=g).cuda()
    fp8kv.write_kv_one_shot(cache, k, -k, torch.arange(NB * page, device="cuda"))
    snapshot = [p.clone() for p in parents]
    tables = torch.tensor([[0, NB, 2**31 - 1], [-5, 1, 2]], dtype=torch.int32, device="cuda")
    for lens, qsl, T in (([100, -3], [0, 1, 2], 2), ([30, 36], [0, 7, 3], 4), ([36, 36], [0, 150, 300], 300)):
        q = torch.randn(T, HQ, D, generator=g).to("cuda", dtype)
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")
        p = plan_prefill(q.device, num_seqs=2, num_kv_heads=H, group=HQ // H, head_size=D, max_keys=3 * page,
                         max_query_len=T, num_splits=1)
        out = torch.full_like(q, float("nan"))
        cuda_attention.paged_attention(q, cache, tables, lens_t, qsl_t, D**-0.5, True, None, None, out, None,
                                       plan_=p)
        torch.cuda.synchronize()
        rows = torch.zeros(T, dtype=torch.bool, device="cuda")  # the rows some sequence's query range covers
        for a, b in zip(qsl[:-1], qsl[1:], strict=True):
            rows[max(a, 0):min(max(b, a), T)] = True
        assert torch.isfinite(out[rows]).all(), (lens, qsl)
    for a, b in zip(parents, snapshot, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma prefill kernel needs sm90 (sm_90a code)")
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp.async"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma16_layouts(dtype, tma):
    """The wgmma prefill's operand layouts, K widening, V transpose (from either raw layout: TMA's
    128-byte swizzle, cp.async's padded rows) and both wgmma forms on raw codes
    (``fp8kv_wgmma16_layout_test``): S = Q K^T, P = float16(S / 16) through the A-register packing,
    O = P V. Products are exact and accumulate in float32 (K = 128 and 64 terms)."""
    from fp8kv_cuda import runtime as r
    from fp8kv_cuda.attention import wgmma_smem_bytes
    from fp8kv_cuda.variants import prefill_wgmma_variant

    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 128, generator=g).to(dtype).cuda()
    k, v = (torch.randint(0, 256, (64, 128), generator=g, dtype=torch.uint8) for _ in range(2))
    for x in (k, v):
        x[(x & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    k, v = k.cuda(), v.cuda()
    s = torch.empty(64, 64, dtype=torch.float32, device="cuda")
    p = torch.empty(64, 64, dtype=torch.float16, device="cuda")
    o = torch.empty(64, 128, dtype=torch.float32, device="cuda")
    variant = prefill_wgmma_variant(str(dtype).removeprefix("torch."), tma=tma)
    r.launch(variant, "fp8kv_wgmma16_layout_test", q.device, (1, 1, 1), 128,
             [r.ptr(q), r.ptr(k), r.ptr(v), r.ptr(s), r.ptr(p), r.ptr(o), r.f32(2.0**-4)],
             shared_mem=wgmma_smem_bytes(tma=tma))
    torch.cuda.synchronize()
    e4 = torch.float8_e4m3fn
    qf, kf, vf = q.double(), k.view(e4).double(), v.view(e4).double()
    u = 2.0**-16  # float32 accumulation of exact products: (terms + 1) 2^-24 of sum |a b|, terms <= 128
    assert ((s.double() - qf @ kf.T).abs() <= u * (qf.abs() @ kf.abs().T) + 1e-30).all()
    assert torch.equal(p.view(torch.int16), (s * 2.0**-4).to(torch.float16).view(torch.int16))
    pf = p.double()
    assert ((o.double() - pf @ vf).abs() <= u * (pf.abs() @ vf.abs()) + 1e-30).all()
