"""The CUDA backend's plugin surface, on any machine: registration, what it claims where (simulated
devices), its reasons and probe notes, the launch plan and the kernel variants. The kernels
themselves run in tests/test_cuda_gpu.py (GPU) and compile in tests/test_cuda_compile.py (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp8kv
from fp8kv.plugins import Request
from fp8kv.probe import simulate_device, simulated
from fp8kv.registry import available_backends, get_backend, select_backend

FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")


def _req(op="paged_attention", kv="fp8_e4m3", layout="NHD", gran="tensor", D=128, dtype=torch.bfloat16,
         dev="cuda", features=frozenset()):
    return Request(op, kv, layout, gran, D, dtype, dev, frozenset(features) if op == "paged_attention" else frozenset())


def test_registered_through_the_entry_point_below_triton():
    assert "cuda" in available_backends()
    info = get_backend("cuda").info
    assert info.fast and 0 < info.priority < get_backend("triton").info.priority


@pytest.mark.parametrize("arch", ["sm70", "sm75"])
def test_auto_picks_cuda_on_volta_and_turing_for_everything(arch):
    with simulate_device(arch):
        for kv in FORMATS:
            for layout in ("NHD", "HND"):
                for gran in ("tensor", "head", "token_head"):
                    for op, feats in (("write_kv", ()), ("paged_attention", ()),
                                      ("paged_attention", ("chunked_prefill", "sliding_window", "soft_cap")),
                                      ("paged_attention", ("non_causal",))):
                        req = _req(op, kv, layout, gran, features=feats)
                        assert select_backend(req, torch.device("cuda")).backend.name == "cuda", (kv, layout, op)


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89", "sm90"])
def test_triton_keeps_ampere_and_newer_but_cuda_serves_there_too(arch):
    info = simulated(arch)
    assert get_backend("cuda").check_supports(info, _req()) is None
    triton_serves = get_backend("triton").check_supports(info, _req()) is None  # not under TRITON_INTERPRET=1
    with simulate_device(arch):
        sel = select_backend(_req(), torch.device("cuda"))
        assert sel.backend.name == ("triton" if triton_serves else "cuda")


@pytest.mark.parametrize(("device", "request_kw", "reason"), [
    ("sm70", dict(D=512), "head_size 512 is outside 1..256"),
    ("sm70", dict(dev="cpu"), "cpu tensors: the CUDA backend runs on NVIDIA GPUs only"),
    ("gfx942", {}, "gfx942: the CUDA backend runs on NVIDIA GPUs only"),
    ("cpu", {}, "cpu: the CUDA backend runs on NVIDIA GPUs only"),
])
def test_refusals_say_why(device, request_kw, reason):
    got = get_backend("cuda").check_supports(simulated(device), _req(**request_kw))
    assert got is not None and reason in got


def test_old_gpus_and_missing_cupy_are_refused():
    old = dataclasses.replace(simulated("sm70"), arch="sm61", name="P100")
    assert get_backend("cuda").check_supports(old, _req()) == "sm61: needs sm70+ (Volta or newer)"
    no_cupy = dataclasses.replace(simulated("sm75"), cupy=False)
    assert "cupy is not installed" in get_backend("cuda").check_supports(no_cupy, _req())


def test_a_real_volta_with_a_cuda13_cupy_is_refused(monkeypatch):
    from fp8kv_cuda import capabilities

    real_v100 = dataclasses.replace(simulated("sm70"), simulated=False)
    monkeypatch.setattr(capabilities, "cupy_cuda_major", lambda: 13)
    reason = capabilities.supports(real_v100, _req())
    assert reason and "CUDA 13's NVRTC cannot compile for sm70" in reason and "cupy-cuda12x" in reason
    assert capabilities.supports(dataclasses.replace(real_v100, arch="sm75"), _req()) is None
    monkeypatch.setattr(capabilities, "cupy_cuda_major", lambda: 12)
    assert capabilities.supports(real_v100, _req()) is None


def test_probe_notes_explain_toolkit_and_codec():
    from fp8kv_cuda.capabilities import device_notes

    v100 = "\n".join(device_notes(simulated("sm70")))
    assert "needs CUDA 12" in v100 and "refuses sm_70" in v100 and "not run on sm70 hardware" in v100
    for fmt in FORMATS:
        assert f"{fmt}: write encodes through the software codec" in v100
    assert "decode on CUDA cores" in v100
    h100 = "\n".join(device_notes(simulated("sm90")))
    assert "CUDA 12 or 13" in h100 and "not yet proven bit-exact" in h100 and "no fnuz conversions" in h100
    t4 = "\n".join(device_notes(simulated("sm75")))
    assert "run on sm90" in h100 and "not run on sm75 hardware" in t4 and "FP8KV_CUDA_ARCH=sm75" in t4
    assert "decode on tensor cores for float16 queries" in t4 and "FP8KV_CUDA_ARCH" not in v100
    assert "decode on tensor cores" in h100 and "ranked above triton for decode-only steps on sm90" in h100
    assert "ranked above" not in "\n".join(device_notes(simulated("sm80")))
    assert device_notes(simulated("gfx942")) == [] and device_notes(simulated("cpu")) == []


def test_priority_only_where_measured_faster():
    """cuda ranks above triton (110 > 100) only on sm90 for decode-only attention its tensor-core kernel
    serves and chunked prefill its wgmma kernel serves (e4m3, static scales, D=128, no soft-cap); other
    prefill, float32 queries, fnuz at D=256, sm80 keep None."""
    import torch
    from fp8kv_cuda.capabilities import DECODE_PRIORITY, PREFILL_PRIORITY, priority

    from fp8kv.plugins import Request

    def r(fmt="fp8_e4m3", gran="tensor", D=128, io=torch.bfloat16, features=(), op="paged_attention"):
        return Request(op, fmt, "NHD", gran, D, io, "cuda", frozenset(features))

    h100 = simulated("sm90")
    assert priority(h100, r()) == DECODE_PRIORITY > 100
    assert priority(h100, r(io=torch.float16, D=64, features=("sliding_window",))) == DECODE_PRIORITY
    assert priority(h100, r("fp8_e5m2", D=256)) == DECODE_PRIORITY
    assert priority(h100, r(gran="token_head")) == DECODE_PRIORITY
    prefill = ("chunked_prefill",)
    assert priority(h100, r(features=prefill)) == PREFILL_PRIORITY > 100
    assert priority(h100, r(io=torch.float16, gran="head", features=(*prefill, "sliding_window"))) == PREFILL_PRIORITY
    for no in (r(io=torch.float32), r(D=40), r("fp8_e4m3fnuz", D=256), r(op="write_kv"),
               r(features=("fp8_attention",)), r("fp8_e5m2", features=prefill), r(D=64, features=prefill),
               r(gran="token_head", features=prefill), r(features=(*prefill, "soft_cap")),
               r(io=torch.float32, features=prefill), r(features=(*prefill, "fp8_attention"))):
        assert priority(h100, no) is None, no
    for arch in ("sm80", "sm75"):
        assert priority(simulated(arch), r()) is None and priority(simulated(arch), r(features=prefill)) is None


def test_probe_command_shows_cuda_serving_on_sm70(capsys):
    from fp8kv.cli import main

    assert main(["probe", "--simulate", "sm75"]) == 0
    out = capsys.readouterr().out
    assert "cuda on this device:" in out and "sm75: CUDA 12 or 13" in out
    picks = out.split("auto picks:", 1)[1].split("\n\n", 1)[0]
    assert picks.count("cuda") == 8  # 2 ops x 4 formats


def test_forcing_cuda_on_cpu_tensors_raises_the_reason():
    cache = fp8kv.KVCache.allocate(4, 4, 2, 16)
    k = torch.randn(3, 2, 16)
    with pytest.raises(fp8kv.Fp8KVError, match="cpu tensors: the CUDA backend runs on NVIDIA GPUs only"):
        fp8kv.write_kv_one_shot(cache, k, k, torch.arange(3), backend="cuda")


def test_plan_splits_only_when_the_gpu_would_idle(monkeypatch):
    from fp8kv_cuda import attention

    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    # B=32 x 8 KV heads = 256 CTAs < 4 x 132: split 4096 keys in pieces of whole tiles
    p = attention.plan(dev, num_tokens=32, num_kv_heads=8, group=4, head_size=128, max_keys=4096)
    assert (p.d_pad, p.gpad, p.block_n, p.head_chunks) == (128, 4, 128, 1)
    assert p.num_splits == 3 and p.keys_per_split % p.block_n == 0
    assert p.num_splits * p.keys_per_split >= 4096 > (p.num_splits - 1) * p.keys_per_split
    # one long sequence: many splits (capped), every key covered
    p = attention.plan(dev, num_tokens=1, num_kv_heads=8, group=4, head_size=128, max_keys=131072)
    assert p.num_splits == 64 and p.num_splits * p.keys_per_split >= 131072
    # a prefill step with many tokens, or short contexts: no split
    assert attention.plan(dev, num_tokens=4096, num_kv_heads=8, group=4, head_size=128, max_keys=8192).num_splits == 1
    assert attention.plan(dev, num_tokens=1, num_kv_heads=1, group=1, head_size=64, max_keys=200).num_splits == 1
    # 32 query heads per KV head: two chunks of 16; head size 256: 32-key tiles
    p = attention.plan(dev, num_tokens=4, num_kv_heads=1, group=32, head_size=256, max_keys=64)
    assert (p.d_pad, p.gpad, p.block_n, p.head_chunks) == (256, 16, 32, 2)


def test_tensor_core_decode_splits_for_the_fewest_keys_per_sm(monkeypatch):
    from fp8kv_cuda import attention

    # (CTAs per split, SMs, most splits) -> splits; measured best on the H100 (see mma_splits)
    assert attention.mma_splits(8, 132, 128) == 16    # B=1 x 8 KV heads: 128 CTAs, one per SM
    assert attention.mma_splits(64, 132, 128) == 2    # B=8
    assert attention.mma_splits(32, 132, 128) == 4    # B=4
    assert attention.mma_splits(16, 132, 128) == 8    # B=2
    assert attention.mma_splits(256, 132, 128) == 1   # B=32: the GPU is full
    assert attention.mma_splits(8, 132, 4) == 4       # short context: capped by keys
    assert attention.mma_splits(80, 132, 128) == 3    # 240 CTAs: two per SM on most SMs, not 80 lone ones
    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    monkeypatch.setattr(attention, "_sm", lambda device: 90)
    monkeypatch.setattr(attention, "mma_warps", lambda *a, **k: 6)
    p = attention.plan_mma(torch.device("cuda", 0), num_tokens=1, num_kv_heads=8, group=4, head_size=128,
                           max_keys=131072)
    assert (p.num_splits, p.keys_per_split, p.warps) == (16, 8192, 6)
    p = attention.plan_mma(torch.device("cuda", 0), num_tokens=1, num_kv_heads=8, group=4, head_size=128,
                           max_keys=1000)
    assert p.num_splits * p.keys_per_split >= 1000 > (p.num_splits - 1) * p.keys_per_split
    assert p.keys_per_split % attention.MMA_SPLIT_KEYS == 0
    # a short context splits down to MMA_SPLIT_KEYS keys per CTA
    p = attention.plan_mma(torch.device("cuda", 0), num_tokens=1, num_kv_heads=8, group=4, head_size=128,
                           max_keys=1024)
    assert (p.num_splits, p.keys_per_split) == (8, attention.MMA_SPLIT_KEYS)


@pytest.mark.parametrize("num_tokens,expected", [(32, (4, 2, 1)), (48, (3, 2, 1)), (64, (2, 3, 1)),
                                                 (128, None), (24, (4, 2, 1)), (16, None), (8, None)])
@pytest.mark.parametrize("token_scales,fp8_attention", [(False, False), (True, False), (False, True)])
def test_decode_grids_of_more_ctas_than_sms_take_the_wave_tiles_on_sm90(monkeypatch, num_tokens, expected,
                                                                         token_scales, fp8_attention):
    """mma_wave_config (H100: 132 SMs, 228 KiB an SM), GQA 32/8 at head size 128, one split: 192 or 256
    CTAs (B=24, 32) are two an SM, 4 warps x 2 stages x 1 sub-tile; 384 (B=48) three, 3 x 2 x 1; 512
    (B=64) four, 2 x 3 x 1; 1024 (B=128, eight an SM) and at most one CTA an SM (B=16, B=8) keep the
    default (None). Each SM can hold the CTAs its tile is for; the plan takes it; given tiles win;
    other head sizes and architectures keep theirs."""
    from fp8kv_cuda import attention, runtime

    monkeypatch.setattr(runtime, "device_index", lambda device: 0)
    monkeypatch.setattr(runtime, "device_sm", lambda index: 90)
    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    monkeypatch.setattr(attention, "_sm", lambda device: 90)
    monkeypatch.setattr(attention, "_smem_limits", lambda index: attention.ARCH_SMEM[90])
    dev = torch.device("cuda", 0)
    ctas = num_tokens * 8
    assert attention.mma_wave_config(dev, 128, ctas, token_scales, fp8_attention) == expected
    if expected is not None:
        warps, stages, nsub = expected
        smem = attention.mma_cta_smem(128, warps, token_scales, stages, nsub, fp8_attention)
        per_sm = min(attention.ARCH_SMEM[90][1] // (smem + attention.CTA_RESERVED_SMEM),
                     attention.MMA_TILES[128][1] // warps)
        assert per_sm * 132 >= ctas
    p = attention.plan_mma(dev, num_tokens=num_tokens, num_kv_heads=8, group=4, head_size=128, max_keys=4096,
                           num_splits=1, token_scales=token_scales, fp8_attention=fp8_attention)
    if expected is not None:
        assert (p.warps, p.stages, p.nsub) == expected
    else:
        assert (p.warps, p.stages, p.nsub) == (6, 0, 0)  # (0: the architecture's ring depth, the kernel's sub-tiles)
    assert attention.plan_mma(dev, num_tokens=num_tokens, num_kv_heads=8, group=4, head_size=128, max_keys=4096,
                              num_splits=1, warps=6).warps == 6
    assert attention.mma_wave_config(dev, 64, ctas) is None
    # the fnuz formats' bit-level conversion budgets registers for 8 warps an SM: two 4-warp CTAs, not 3 x 3
    # (B=48's three 3-warp CTAs an SM do not fit it)
    fnuz = attention.mma_wave_config(dev, 128, ctas, fmt="fp8_e4m3fnuz")
    assert fnuz == (None if num_tokens == 48 else expected)
    monkeypatch.setattr(attention, "_sm", lambda device: 89)
    assert attention.mma_wave_config(dev, 128, ctas) is None


def test_plan_prefill_tiles_rows_and_splits_short_chunks(monkeypatch):
    from fp8kv_cuda import attention

    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    monkeypatch.setattr(attention, "_sm", lambda device: 90)
    dev = torch.device("cuda", 0)
    # 4 x 2048 new tokens, GQA 4: 2048 * 4 rows in tiles of 128 per (sequence, KV head); no split
    p = attention.plan_prefill(dev, num_seqs=4, num_kv_heads=8, group=4, head_size=128, max_keys=4096,
                               max_query_len=2048)
    assert p.prefill and p.mma and p.row_tiles == 2048 * 4 // attention.PREFILL_ROWS and p.num_splits == 1
    # one short chunk over a long context: 2 row tiles x 8 heads would idle the GPU, so the keys split
    p = attention.plan_prefill(dev, num_seqs=1, num_kv_heads=8, group=4, head_size=128, max_keys=32768,
                               max_query_len=64)
    assert p.row_tiles == 2 and p.num_splits > 1
    assert p.keys_per_split % attention.PREFILL_SPLIT_KEYS == 0
    assert p.num_splits * p.keys_per_split >= 32768 > (p.num_splits - 1) * p.keys_per_split
    # the grid's z is num_seqs * num_splits (the kernel divides it back)
    assert attention.plan_prefill(dev, num_seqs=3, num_kv_heads=2, group=8, head_size=128, max_keys=100,
                                  max_query_len=5).num_splits == 1


def test_plan_prefill_for_the_wgmma_kernel_fills_one_wave(monkeypatch):
    """A step planned for sm90's wgmma prefill (one CTA an SM) splits into as many pieces as fit one
    wave, never spilling into a second (measured on the H100)."""
    from fp8kv_cuda import attention

    monkeypatch.setattr(attention, "_num_sms", lambda index: 132)
    monkeypatch.setattr(attention, "_sm", lambda device: 90)
    dev = torch.device("cuda", 0)
    kw = dict(num_kv_heads=8, group=4, head_size=128, ctas_per_sm=1)
    # 8 x 128 new over 8192: 4 row tiles x 8 heads x 8 sequences = 256 CTAs fill the GPU: no split
    assert attention.plan_prefill(dev, num_seqs=8, max_keys=8320, max_query_len=128, **kw).num_splits == 1
    # 1 x 64 over 32768: 16 CTAs, 8 splits (128 CTAs; 9 would spill 12 into a second wave)
    assert attention.plan_prefill(dev, num_seqs=1, max_keys=32832, max_query_len=64, **kw).num_splits == 8
    # 2 x 128 over 16384: 64 CTAs, 2 splits
    assert attention.plan_prefill(dev, num_seqs=2, max_keys=16512, max_query_len=128, **kw).num_splits == 2
    # the mma kernel's rule (two CTAs an SM) for the same step: 17 splits
    mma = attention.plan_prefill(dev, num_seqs=1, num_kv_heads=8, group=4, head_size=128, max_keys=32832,
                                 max_query_len=64)
    assert mma.num_splits == 17
    monkeypatch.setattr(attention, "WGMMA_PREFILL", True)
    assert attention.wgmma_prefill_planned(90, "fp8_e4m3", 128, torch.bfloat16)
    assert not attention.wgmma_prefill_planned(90, "fp8_e5m2", 128, torch.bfloat16)
    assert not attention.wgmma_prefill_planned(80, "fp8_e4m3", 128, torch.float16)
    assert not attention.wgmma_prefill_planned(90, "fp8_e4m3", 128, torch.float32)
    monkeypatch.setattr(attention, "WGMMA_PREFILL", False)
    assert not attention.wgmma_prefill_planned(90, "fp8_e4m3", 128, torch.bfloat16)


def test_turing_plans_float16_queries_on_tensor_cores(monkeypatch):
    """sm75 (a real Turing, or FP8KV_CUDA_ARCH=sm75 on a newer GPU): float16 queries take the
    tensor-core kernels, decode with a one-stage ring in 4-warp CTAs (two share Turing's 64 KiB)
    and prefill with a two-stage ring; bfloat16 queries (no bfloat16 tensor cores before sm80) and
    float32 ones take the CUDA-core kernel. The variable accepts only sm70 up to the GPU's own."""
    from fp8kv_cuda import attention, runtime
    from fp8kv_cuda.variants import attention_mma_variant, prefill_mma_variant

    runtime._device_sm.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(attention, "_num_sms", lambda index: 40)
    monkeypatch.setattr(attention, "_smem_limits_for", lambda index, sm: attention.ARCH_SMEM[sm])
    monkeypatch.setenv(runtime.ARCH_ENV, "sm75")
    try:
        assert runtime.device_sm(0) == 75
        dev = torch.device("cuda", 0)
        kw = dict(num_kv_heads=8, group=4, head_size=128, max_keys=4096, fmt="fp8_e4m3")
        p = attention.plan(dev, num_tokens=8, query_dtype=torch.float16, **kw)
        assert p.mma and not p.prefill and (p.warps, p.sm) == (4, 75)
        assert 2 * attention.mma_smem_bytes(128, 4, False, 1) <= attention.ARCH_SMEM[75][1]
        macros = dict(attention_mma_variant("fp8_e4m3", "float16", 64, 4, False, p.sm).macros)
        assert (macros["FP8KV_STAGES"], macros["FP8KV_SM_WARPS_BITS"]) == (1, 8)  # (registers for 8 warps per SM)
        for dtype in (torch.bfloat16, torch.float32):
            assert not attention.plan(dev, num_tokens=8, query_dtype=dtype, **kw).mma
        p = attention.plan(dev, num_tokens=1024, query_dtype=torch.float16, max_query_len=512, num_seqs=2, **kw)
        assert p.prefill and p.sm == 75
        assert dict(prefill_mma_variant("fp8_e4m3", "float16", sm=p.sm).macros)["FP8KV_STAGES"] == 2
        assert not attention.plan(dev, num_tokens=1024, query_dtype=torch.bfloat16, max_query_len=512, num_seqs=2,
                                  **kw).prefill
        for bad in ("sm100", "sm60", "turing"):
            monkeypatch.setenv(runtime.ARCH_ENV, bad)
            with pytest.raises(fp8kv.InvalidArgument, match=r"FP8KV_CUDA_ARCH: got .* expected an architecture"):
                runtime.device_sm(0)
        monkeypatch.delenv(runtime.ARCH_ENV)
        assert runtime.device_sm(0) == 90
    finally:
        runtime._device_sm.cache_clear()


def test_variants_take_every_constant_from_the_codec():
    from fp8kv_cuda.variants import attention_variant, options, source, write_variant

    from fp8kv.codec import codec_constants
    from fp8kv.formats import FORMATS as ALL

    for name in FORMATS:
        c = codec_constants(ALL[name])
        opts = options(write_variant(name, "bfloat16", True, 128, True, True))
        assert f"-DFP8KV_MAXBITS=0x{c.max_f32_bits:08X}u" in opts and f"-DFP8KV_BIAS={c.bias}" in opts
        assert "-ftz=false" in opts and "-prec-div=true" in opts
    for kernel in ("write", "attention", "codec"):
        src = source(kernel)
        assert "#include" not in src.split("namespace fp8kv", 1)[1] and "encode_bits" in src
    v = attention_variant("fp8_e5m2", "float16", True, 128, 8, 64, 16)
    assert v.entry_points == ("fp8kv_paged_attention", "fp8kv_merge") and "gpad=8" in v.label


def test_programmatic_dependent_launch_packs_the_driver_call(monkeypatch):
    """The split merge goes out through cuLaunchKernelEx with the programmatic-stream-serialization
    attribute (its C layout: the attribute's value at byte 8 of 72, the stream at byte 32 of the
    56-byte config), with every argument in its kernel type; only where the kernels are built for
    sm90+ (they wait with griddepcontrol.wait there), never for an older FP8KV_CUDA_ARCH."""
    import ctypes

    import numpy as np
    from fp8kv_cuda import runtime

    assert (ctypes.sizeof(runtime._LaunchAttribute), runtime._LaunchAttribute.value.offset) == (72, 8)
    assert (ctypes.sizeof(runtime._LaunchConfig), runtime._LaunchConfig.hStream.offset) == (56, 32)
    seen = {}

    def fake(cfg, fn, params, extra):
        c = cfg._obj
        attr = c.attrs[0]
        seen.update(grid=(c.gridDimX, c.gridDimY, c.gridDimZ), block=c.blockDimX, smem=c.sharedMemBytes,
                    stream=c.hStream, n=c.numAttrs, attr=(attr.id, int.from_bytes(attr.value[:4], "little")), fn=fn,
                    args=[ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0],
                          ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32))[0],
                          ctypes.cast(params[2], ctypes.POINTER(ctypes.c_float))[0],
                          ctypes.cast(params[3], ctypes.POINTER(ctypes.c_int64))[0]])
        return 0

    monkeypatch.setattr(runtime, "_launch_kernel_ex", lambda: fake)
    runtime.pdl_launch(1234, (3, 32, 1), 128, 0, 99, [np.uint64(2**40 + 8), np.int32(-7), np.float32(0.5),
                                                      np.int64(-2**40)])
    assert seen == {"grid": (3, 32, 1), "block": 128, "smem": 0, "stream": 99, "n": 1, "attr": (6, 1), "fn": 1234,
                    "args": [2**40 + 8, -7, 0.5, -2**40]}
    monkeypatch.setattr(runtime, "_launch_kernel_ex", lambda: None)
    monkeypatch.setattr(runtime, "device_sm", lambda index: 90)
    assert not runtime.pdl_available(0)  # (no driver entry point)
    monkeypatch.setattr(runtime, "_launch_kernel_ex", lambda: fake)
    assert runtime.pdl_available(0)
    monkeypatch.setattr(runtime, "device_sm", lambda index: 75)
    assert not runtime.pdl_available(0)


def test_kernel_arguments_with_tensor_maps_pass_by_value():
    """runtime.launch's arguments as the driver reads them (the sm90 prefill passes two TMA descriptors
    by value among its scalars): numpy scalars in their C types, ``bytes`` as a byte array of the
    struct, each through its own pointer."""
    import ctypes

    import numpy as np
    from fp8kv_cuda import runtime

    tmap = bytes(range(128))
    values = runtime._c_values([np.uint64(2**40 + 8), tmap, np.int32(-7), np.float32(0.5), np.int64(-2**40)])
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0] == 2**40 + 8
    assert ctypes.string_at(params[1], 128) == tmap and ctypes.sizeof(values[1]) == runtime.TENSOR_MAP_BYTES
    assert ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int32))[0] == -7
    assert ctypes.cast(params[3], ctypes.POINTER(ctypes.c_float))[0] == 0.5
    assert ctypes.cast(params[4], ctypes.POINTER(ctypes.c_int64))[0] == -2**40


def test_a_struct_parameter_launch_packs_the_driver_call(monkeypatch):
    """launch_struct's driver call (the Hopper backend's CUDA kernel takes its ~50 arguments as one
    struct by value): cuLaunchKernelEx with no attribute and one parameter pointing at the struct."""
    import ctypes

    from fp8kv_cuda import runtime

    class Args(ctypes.Structure):
        _fields_ = [("p", ctypes.c_void_p), ("x", ctypes.c_float), ("n", ctypes.c_int64)]

    args = Args(2**40 + 16, 0.25, -3)
    seen = {}

    def fake(cfg, fn, params, extra):
        c = cfg._obj
        got = ctypes.cast(params[0], ctypes.POINTER(Args))[0]
        seen.update(grid=(c.gridDimX, c.gridDimY, c.gridDimZ), block=c.blockDimX, smem=c.sharedMemBytes,
                    stream=c.hStream, n=c.numAttrs, attrs=bool(c.attrs), fn=fn, args=(got.p, got.x, got.n))
        return 0

    monkeypatch.setattr(runtime, "_launch_kernel_ex", lambda: fake)
    runtime.struct_launch(77, (5, 8, 1), 384, 187392, 99, args)
    assert seen == {"grid": (5, 8, 1), "block": 384, "smem": 187392, "stream": 99, "n": 0, "attrs": False, "fn": 77,
                    "args": (2**40 + 16, 0.25, -3)}
    monkeypatch.setattr(runtime, "_launch_kernel_ex", lambda: lambda *a: 1)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        runtime.struct_launch(77, (1, 1, 1), 128, 0, 0, args)


@pytest.mark.parametrize("change, serves", [
    ({}, True), ({"on": False}, False), ({"sm": 80}, False), ({"sm": 75}, False), ({"fmt": "fp8_e5m2"}, False),
    ({"dtype": torch.float32}, False), ({"D": 64}, False), ({"cap": 30.0}, False), ({"misaligned": True}, False),
])
def test_the_wgmma_prefill_takes_only_what_it_serves(change, serves, monkeypatch):
    """The sm90 wgmma prefill replaces the mma kernel unless switched off, on sm90 itself (not an
    older FP8KV_CUDA_ARCH), for e4m3 caches, head size 128,
    16-bit queries stored 16-byte aligned, no soft-cap (a KV split included)."""
    from fp8kv_cuda import attention

    c = {"on": True, "sm": 90, "fmt": "fp8_e4m3", "dtype": torch.bfloat16, "D": 128, "cap": None,
         "misaligned": False, **change}
    monkeypatch.setattr(attention, "WGMMA_PREFILL", c["on"])
    storage = torch.zeros(4 * 8 * c["D"] + 8, dtype=c["dtype"])
    query = storage[1:1 + 4 * 8 * c["D"]] if c["misaligned"] else storage[: 4 * 8 * c["D"]]
    query = query.view(4, 8, c["D"])
    assert attention.wgmma_prefill_serves(c["sm"], c["fmt"], query, c["cap"]) is serves
    assert attention.WGMMA_PREFILL is c["on"]


def test_the_sm90_wgmma_kernels_are_the_prefill_defaults():
    """Both sm90 wgmma prefill kernels passed their GPU tests on an H100 and beat the kernels they
    replace there (docs/cuda.md, docs/fp8_attention.md): they are the defaults where they serve."""
    from fp8kv_cuda import attention
    from fp8kv_hopper.attention import choose_config

    assert attention.WGMMA_PREFILL is True
    assert choose_config(group=4, num_seqs=4, num_kv_heads=8, max_query_len=2048, max_keys=4096,
                         num_sms=132).kernel == "auto"


def test_the_fp8_mode_decode_refuses_what_it_cannot_run_before_any_launch():
    """fp8kv_cuda.attention.paged_attention(fp8_attention=...): a plan that is not a plan_mma one, or a cache whose K/V
    rows are not 16-byte aligned (head size 40), raises InvalidArgument naming the argument, launching nothing
    (CPU tensors: a launch would fail differently) and leaving the cache unchanged."""
    from fp8kv_cuda.attention import AttnPlan, Fp8Attention, paged_attention

    from fp8kv.errors import InvalidArgument

    fp8 = Fp8Attention(None, (0, 0), 1.0)
    for D, plan_, name in ((128, AttnPlan(128, 4, 32, 1, 1, 64, mma=True, prefill=True, row_tiles=1), "plan_"),
                           (40, AttnPlan(40, 8, 16, 1, 1, 64, mma=True), "fp8_attention")):
        cache = fp8kv.KVCache.allocate(4, 16, 2, D, kv_dtype="fp8_e4m3", scale_granularity="tensor")
        fp8kv.write_kv_one_shot(cache, torch.randn(64, 2, D), torch.randn(64, 2, D), torch.arange(64))
        before = cache.key_cache.view(torch.uint8).clone(), cache.value_cache.view(torch.uint8).clone()
        q = torch.randn(2, 8, D, dtype=torch.bfloat16)
        one = torch.ones(2, dtype=torch.int32)
        with pytest.raises(InvalidArgument, match=f"^{name}: got "):
            paged_attention(q, cache, torch.arange(8, dtype=torch.int32).view(2, 4), one * 20,
                            torch.arange(3, dtype=torch.int32), D**-0.5, True, None, None, torch.empty_like(q), None,
                            plan_=plan_, fp8_attention=fp8)
        assert torch.equal(cache.key_cache.view(torch.uint8), before[0])
        assert torch.equal(cache.value_cache.view(torch.uint8), before[1])


@pytest.mark.parametrize("sm,head_size,default,fp8", [(90, 64, 6, 6), (90, 128, 6, 6), (90, 256, 4, 4),
                                                      (89, 128, 6, 6), (89, 256, 4, None)])
def test_the_fp8_modes_static_shared_memory_counts_when_planning_warps(monkeypatch, sm, head_size, default, fp8):
    """mma_warps counts the FP8 mode's static query fragment (fp8_attention_static_smem: 16 bytes a dimension)
    on top of the ring: on sm90 it changes no choice; with an sm89's 99 KiB a block, the FP8 mode's head
    size 256 (96 KiB of ring and 4 KiB of fragment) does not fit (the Triton kernel would take it)."""
    from fp8kv_cuda import attention, runtime

    monkeypatch.setattr(runtime, "device_index", lambda device: 0)
    monkeypatch.setattr(runtime, "device_sm", lambda index: sm)
    monkeypatch.setattr(attention, "_smem_limits", lambda index: attention.ARCH_SMEM[sm])
    dev = torch.device("cuda", 0)
    assert attention.mma_warps(dev, head_size) == default
    assert attention.mma_warps(dev, head_size, fp8_attention=True) == fp8
    assert attention.fp8_attention_static_smem(head_size) == head_size // 16 * 32 * 8
