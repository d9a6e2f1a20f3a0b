"""CPU compile cells of the CUDA backend: every kernel builds for sm70..sm90 without spills.

NVRTC 12.x from PyPI (``cuda-compile`` extra: ``nvidia-cuda-nvrtc-cu12`` + ``cuda-bindings<13``)
compiles a representative variant per kernel and format class (OCP and fnuz, each I/O dtype,
static and per-token-head scales, the largest tiles: head size 256 with 16 query heads per CTA)
to cubins for sm70, sm75, sm80, sm86, sm89 and sm90 on this CPU, no GPU or driver involved.
A compile error fails, and so does any spill in a hot kernel (ptxas -v; sm90's wgmma prefill is hot,
the mma prefill kernels are compiled and their spills reported: see ``fp8kv_cuda.compile.HOT_KERNELS``).
~60 s on 2 cores.
The full set is ``python -m fp8kv_cuda.compile --set full`` (the CI matrix's compile cells;
results in ci/reports/<cell>/cuda_compile.json).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="needs NVRTC from PyPI: pip install -e '.[cuda-compile]'")


def test_every_kernel_compiles_for_every_architecture_without_spills(tmp_path):
    from fp8kv_cuda import compile as cc

    assert cc.nvrtc_version()[0] == 12, "sm70 needs CUDA 12's NVRTC (CUDA 13 refuses sm_70)"
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "fp8kv_cuda.compile", "--jobs", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["failures"] == [] and all(x["ok"] for x in results)
    prefill = {"fp8kv_prefill_mma", "fp8kv_prefill_mma_exact"}
    wgmma = {"fp8kv_prefill_wgmma", "fp8kv_wgmma16_layout_test"}  # (sm_90a, e4m3 only)
    for arch in cc.ARCHES:
        mine = [x for x in results if x["arch"] == arch]
        volta = {"fp8kv_prefill_wmma_exact"}  # (fp8kv_prefill_wmma is a hot kernel there)
        extra = (prefill if int(arch[2:]) >= 75 else volta) | (wgmma if arch == cc.WGMMA_ARCH else set())
        assert {x["kernel"] for x in mine} == set(cc.hot_kernels(arch)) | extra, arch
        for kernel in (*cc.hot_kernels(arch), *extra):
            fmts = {x["fmt"] for x in mine if x["kernel"] == kernel}
            if kernel in wgmma:
                assert fmts == {"fp8_e4m3"} and len([x for x in mine if x["kernel"] == kernel]) == 2, kernel
                continue
            assert fmts & {"fp8_e4m3", "fp8_e5m2"} and fmts & {"fp8_e4m3fnuz", "fp8_e5m2fnuz"}, (arch, kernel)
        for x in mine:
            assert x["regs"] and x["spill_stores"] is not None, x
            if x["kernel"] in cc.HOT_KERNELS:
                assert x["spill_stores"] == 0 and x["spill_loads"] == 0, x
            assert x["smem"] <= 48 << 10, x  # static shared memory limit of every architecture
    assert "| sm70 | fp8kv_paged_attention |" in r.stdout


def test_a_compile_error_and_a_spill_fail_the_cell(monkeypatch):
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.variants import Variant

    broken = Variant("write", "fp8_e4m3", (("FP8KV_IN", 1),))  # its other macros missing: must not build
    (res,) = cc.compile_one(broken, "sm80")
    assert not res.ok and "error" in res.error
    assert cc.failures([res])
    spilled = cc.Result("sm90", "fp8kv_paged_attention", "fp8_e4m3", "x", True, 255, 8, 8, 16, 0)
    assert cc.failures([spilled]) == ["sm90 fp8kv_paged_attention (x): 8 bytes spill stores, 8 loads"]


def test_ptxas_report_parsing():
    from fp8kv_cuda.compile import parse_ptxas

    log = """ptxas info    : Compiling entry function 'fp8kv_merge' for 'sm_90'
ptxas info    : Function properties for fp8kv_merge
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 8 bytes cumulative stack size
ptxas info    : Compiling entry function 'fp8kv_paged_attention' for 'sm_90'
ptxas info    : Function properties for fp8kv_paged_attention
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 21328 bytes smem
"""
    assert parse_ptxas(log) == {
        "fp8kv_merge": {"smem": 0, "stack": 8, "spill_stores": 4, "spill_loads": 12, "regs": 32},
        "fp8kv_paged_attention": {"smem": 21328, "stack": 0, "spill_stores": 0, "spill_loads": 0, "regs": 168},
    }


def test_the_variant_sets():
    from fp8kv_cuda import compile as cc

    volta = cc.variants("representative", "sm70")
    assert {v.kernel for v in volta} == {"write", "attention", "prefill_wmma"}
    # Volta's prefill: float16 queries (its variants have no query-type macro choice), both format classes
    assert {v.fmt for v in volta if v.kernel == "prefill_wmma"} == {"fp8_e4m3", "fp8_e5m2fnuz"}
    turing = [v for v in cc.variants("representative", "sm75") if "mma" in v.kernel]
    assert {v.kernel for v in turing} == {"attention_mma", "prefill_mma"}
    # Turing: float16 queries only (no bfloat16 tensor cores), synchronous copies: the least ring depth
    assert {dict(v.macros)["FP8KV_QT"] for v in turing} == {1}
    assert {(v.kernel, dict(v.macros)["FP8KV_STAGES"]) for v in turing} == {("attention_mma", 1), ("prefill_mma", 2)}
    rep = cc.variants("representative", "sm80")
    assert {v.kernel for v in rep} == {"write", "attention", "attention_mma", "prefill_mma"}
    assert {v.fmt for v in rep if v.kernel == "attention_mma"} == {"fp8_e4m3", "fp8_e5m2fnuz", "fp8_e4m3fnuz"}
    assert len([v for v in cc.variants("representative", "sm90") if v.kernel == "attention_mma"]) == 5 + 1
    # (+ the FP8 attention mode's decode on sm89+)
    assert len([v for v in cc.variants("representative", "sm86") if v.kernel == "attention_mma"]) == 4
    full = [v for v in cc.variants("full", "sm70") if v.kernel not in ("attention_mma", "prefill_mma", "prefill_wmma")]
    assert len(full) == 4 * 3 * 2 * 3 * (1 + 4)
    assert len([v for v in cc.variants("full", "sm70") if v.kernel == "prefill_wmma"]) == 4
    assert not [v for v in cc.variants("full", "sm70") if v.kernel in ("attention_mma", "prefill_mma")]
    assert {v.fmt for v in full} == set(cc.FORMAT_NAMES)
    # tensor-core kernel: 4 formats x 2 query dtypes x 2 granularities x (D 64, 128; D 256 only for OCP
    # formats on sm89+) x warps per CTA
    w = len(cc.MMA_WARPS)
    assert len([v for v in cc.variants("full", "sm75") if v.kernel == "attention_mma"]) == 4 * 1 * 2 * 2 * w
    assert len([v for v in cc.variants("full", "sm80") if v.kernel == "attention_mma"]) == 4 * 2 * 2 * 2 * w
    # (sm89+: and the FP8 mode's decode, e4m3 with static scales, 2 query dtypes x 3 head sizes)
    fp8 = 2 * 3 * w
    sm90_mma = [v for v in cc.variants("full", "sm90") if v.kernel == "attention_mma"]
    # (sm90: and the wave tiles at head size 128, MMA_WAVE_TILES, in both modes)
    waves = len(set(cc.MMA_WAVE_TILES[128].values())) * (4 * 2 * 2 + 2)
    assert len(sm90_mma) == (4 * 2 * 2 + 2 * 2) * 2 * w + fp8 + waves
    # tensor-core prefill: 4 formats x 2 query dtypes, head size 128, static scales, sm80+
    assert len([v for v in cc.variants("full", "sm86") if v.kernel == "prefill_mma"]) == 4 * 2
    # sm90's wgmma prefill (sm_90a): 2 query dtypes x ping-pong x TMA/cp.async; none elsewhere
    assert len([v for v in cc.variants("full", "sm90") if v.kernel == "prefill_wgmma"]) == 2 * 2 * 2
    assert len([v for v in cc.variants("representative", "sm90") if v.kernel == "prefill_wgmma"]) == 2
    assert not [v for a in ("sm80", "sm86", "sm89") for s in ("representative", "full")
                for v in cc.variants(s, a) if v.kernel == "prefill_wgmma"]
    assert len([v for v in cc.variants("full", "sm75") if v.kernel == "prefill_mma"]) == 4 * 1


def test_turing_code_multiplies_in_k8_halves_and_copies_synchronously():
    """What FP8KV_CUDA_ARCH=sm75 runs on the H100 is Turing's code: the sm75 PTX of the tensor-core
    kernels has m16n8k8 products and no cp.async or m16n8k16 (which need sm80); sm80's has those."""
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.variants import attention_mma_variant, prefill_mma_variant

    for make in (lambda sm: attention_mma_variant("fp8_e4m3", "float16", 128, 4, False, sm),
                 lambda sm: prefill_mma_variant("fp8_e5m2fnuz", "float16", sm=sm)):
        turing, ampere = cc.compile_ptx(make(75), "sm75"), cc.compile_ptx(make(80), "sm80")
        assert ".target sm_75" in turing and "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32" in turing
        assert "cp.async" not in turing and "m16n8k16" not in turing and "cvt.rn.f16x2.f32" not in turing
        assert "cp.async.cg.shared.global" in ampere and "mma.sync.aligned.m16n8k16" in ampere


def test_the_fp8_mode_decode_rounds_query_and_probabilities_to_e4m3():
    """The FP8 attention mode's decode (FP8KV_FP8_MODE, sm89+): its PTX rounds to e4m3 with saturation
    (the query and P) and widens e4m3 pairs to float16 for the products; below sm89 it does not build."""
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.variants import attention_mma_variant

    ptx = cc.compile_ptx(attention_mma_variant("fp8_e4m3", "bfloat16", 128, 6, False, 90, fp8_attention=True), "sm90")
    body = ptx.split(".entry fp8kv_paged_attention_mma", 1)[1].split(".entry", 1)[0]
    assert "cvt.rn.satfinite.e4m3x2.f32" in body and "cvt.rn.f16x2.e4m3x2" in body
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in body and ".bf16" not in body
    default = cc.compile_ptx(attention_mma_variant("fp8_e4m3", "bfloat16", 128, 6, False, 90), "sm90")
    assert "satfinite.e4m3x2" not in default
    with pytest.raises(RuntimeError, match="FP8 mode"):
        cc.compile_ptx(attention_mma_variant("fp8_e4m3", "bfloat16", 128, 6, False, 80, fp8_attention=True), "sm80")


@pytest.mark.parametrize("head_size,warps,token_scales,sm,stages", [
    (64, 4, False, 80, None), (128, 6, False, 90, None), (128, 6, True, 90, None), (256, 4, True, 80, None),
    (128, 4, False, 75, None), (128, 2, False, 90, 3), (128, 4, True, 90, 3), (128, 4, True, 90, (2, 1)),
    (128, 2, False, 90, (3, 1))])
def test_the_decode_kernels_shared_memory_is_the_hosts(head_size, warps, token_scales, sm, stages):
    """The tensor-core decode's ``SMEM_BYTES`` (its copy ring: each warp's K and V rows of a step and
    its lanes' token_head scales, ``stages`` deep; or the epilogue's view, the larger) is what the host
    launches it with (``mma_smem_bytes``; the kernel traps on less)."""
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.attention import mma_smem_bytes
    from fp8kv_cuda.variants import attention_mma_variant, mma_stages, options, source

    io = "float16" if sm < 80 else "bfloat16"
    stages, nsub = stages if isinstance(stages, tuple) else (stages, None)  # (ring stages, 16-key sub-tiles a step)
    v = attention_mma_variant("fp8_e4m3", io, head_size, warps, token_scales, sm, stages=stages, nsub=nsub)
    want = mma_smem_bytes(head_size, warps, token_scales, stages or mma_stages(sm, head_size), nsub)
    probe = f'static_assert(fp8kv::SMEM_BYTES == {want}, "SMEM_BYTES");\n'
    cc.compile_text(source(v.kernel) + probe, "probe.cu", options(v), f"compute_{sm}", ptx=True)


def test_volta_prefill_multiplies_on_tensor_cores_through_wmma():
    """Volta's prefill kernel (csrc/prefill_wmma.cu) reaches sm70's tensor cores through PTX wmma
    m16n16k16 (ptxas lowers it to mma.sync m8n8k4 there): its compute_70 PTX has both products (S = Q K^T
    with K^T column-major, O += P V with V row-major) and none of the sm75+ m16n8 mma shapes."""
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.variants import prefill_wmma_variant

    ptx = cc.compile_ptx(prefill_wmma_variant("fp8_e5m2"), "sm70")
    assert ".target sm_70" in ptx
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in ptx
    assert "wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32" in ptx
    assert "wmma.load.c.sync.aligned.row.m16n16k16.shared.f32" in ptx  # (the accumulator's element table)
    assert "m16n8k" not in ptx and "cp.async" not in ptx


def test_the_merge_waits_for_the_attention_kernel_only_where_launched_dependent():
    """sm90's split merge starts with griddepcontrol.wait (it goes out as a programmatic dependent
    launch there: fp8kv_cuda.runtime.pdl_available); sm80's has none (a plain launch)."""
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.variants import attention_tile, attention_variant

    v = attention_variant("fp8_e4m3", "bfloat16", False, *attention_tile(64, 4), vec=16)
    merge = lambda ptx: ptx.split(".entry fp8kv_merge", 1)[1]  # noqa: E731
    assert "griddepcontrol.wait" in merge(cc.compile_ptx(v, "sm90"))
    assert "griddepcontrol" not in cc.compile_ptx(v, "sm80")


def test_the_tensor_core_decode_lets_the_merge_launch_once_its_keys_are_done():
    """sm90's tensor-core decode triggers the merge's dependent launch (griddepcontrol.launch_dependents)
    once, after its key loop (before the epilogue's shared-memory merge of the warps), and waits for
    nothing itself; sm80's has no griddepcontrol."""
    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.variants import attention_mma_variant

    def decode(sm: int) -> str:
        ptx = cc.compile_ptx(attention_mma_variant("fp8_e4m3", "bfloat16", 128, 4, False, sm), f"sm{sm}")
        return ptx.split(".entry fp8kv_paged_attention_mma", 1)[1].split(".entry", 1)[0]

    hopper = decode(90)
    assert hopper.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in hopper
    trigger = hopper.index("griddepcontrol.launch_dependents")
    assert "mma.sync" in hopper[:trigger] and "mma.sync" not in hopper[trigger:]
    assert "griddepcontrol" not in decode(80)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp.async"])
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("io_dtype", ["bfloat16", "float16"])
def test_the_sm90_wgmma_prefill_compiles_without_spills(io_dtype, pingpong, tma):
    """``csrc/prefill_wgmma.cu`` for sm_90a: no spills, ptxas keeps the wgmma asynchronous (no C7512,
    no ignored setmaxnreg C7508), both products are wgmma in the PTX (16-bit Q K^T from shared memory,
    float16 P V with P from registers), TMA tile loads only in the TMA variant, and the host's
    shared-memory size is the kernel's."""
    import re

    from fp8kv_cuda import compile as cc
    from fp8kv_cuda.attention import wgmma_smem_bytes
    from fp8kv_cuda.variants import arch_target, options, prefill_wgmma_variant, source

    v = prefill_wgmma_variant(io_dtype, pingpong, tma)
    assert arch_target(v.kernel, 90) == "sm_90a"
    _, log = cc.compile_text(source(v.kernel), "prefill_wgmma.cu", options(v), "sm_90a")
    info = cc.parse_ptxas(log)["fp8kv_prefill_wgmma"]
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, info
    # serialized wgmma (C7512, C7514, C7515, C7520), an ignored setmaxnreg (C7508)
    assert not any(c in log for c in ("C7512", "C7508", "C7514", "C7515", "C7520")), log
    ptx, _ = cc.compile_text(source(v.kernel), "prefill_wgmma.cu", options(v), "compute_90a", ptx=True)
    ptx = ptx.decode(errors="replace")
    qk = "bf16.bf16" if io_dtype == "bfloat16" else "f16.f16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.{qk} \{{[^}}]*\}}, %rd\d+, %rd\d+", ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.f16\.f16 \{[^}]*\}, \{%r\d+, %r\d+, %r\d+, "
                     r"%r\d+\}, %rd\d+", ptx)
    assert ("cp.async.bulk.tensor.4d" in ptx) == tma and ("cp.async.cg.shared.global" in ptx) == (not tma)
    probe = f'static_assert(sizeof(fp8kv::WgmmaShared) == {wgmma_smem_bytes(tma=tma)}, "WgmmaShared");\n'
    cc.compile_text(source(v.kernel) + probe, "probe.cu", options(v), "compute_90a", ptx=True)


def test_tma_maps_decline_what_a_box_cannot_cover(monkeypatch):
    """fp8kv_cuda.tma.paged_cache_maps for the sm90 prefill's 64-key tiles: pages that neither divide 64
    keys nor are a multiple of them, K and V with their head and key strides ordered differently, and a
    cache the driver's encoder refuses all go to the cp.async loads (None); the boxes otherwise cover a
    page (or 64 keys of a longer one) of one head, dimensions ordered by stride."""
    import dataclasses

    from fp8kv_cuda import runtime, tma

    import fp8kv
    from fp8kv.errors import InvalidArgument

    calls = []

    def encode(address, dims, strides, box):
        calls.append((dims, strides, box))
        return bytes(runtime.TENSOR_MAP_BYTES)

    monkeypatch.setattr(runtime, "tensor_map_uint8", encode)
    tma._tensor_map.cache_clear()
    for page in (12, 48, 96, 200):
        cache = fp8kv.KVCache.allocate(4, page, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor")
        assert tma.paged_cache_maps(cache, 64) is None, page
    nhd = fp8kv.KVCache.allocate(4, 16, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor")
    hnd = fp8kv.KVCache.allocate(4, 16, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor", layout="HND")
    mixed = dataclasses.replace(nhd, value_cache=hnd.value_cache.permute(0, 2, 1, 3))  # V: HND strides
    assert tma.paged_cache_maps(mixed, 64) is None and not calls
    expected = ((nhd, 1, (128, 2, 16, 4), (128, 1, 16, 1)), (hnd, 0, (128, 16, 2, 4), (128, 16, 1, 1)))
    for cache, inner, dims, box in expected:
        _, _, head_inner, rows = tma.paged_cache_maps(cache, 64)
        assert (head_inner, rows) == (inner, 16) and calls[-1][0] == dims and calls[-1][2] == box
    long_pages = fp8kv.KVCache.allocate(2, 256, 2, 128, kv_dtype="fp8_e4m3", scale_granularity="tensor")
    assert tma.paged_cache_maps(long_pages, 64)[3] == 64 and calls[-1][2] == (128, 1, 64, 1)

    def refuse(*args):
        raise InvalidArgument("cuTensorMapEncodeTiled refused")

    monkeypatch.setattr(runtime, "tensor_map_uint8", refuse)
    tma._tensor_map.cache_clear()
    assert tma.paged_cache_maps(nhd, 64) is None
    tma._tensor_map.cache_clear()


def test_the_wgmma_prefill_producer_maps_cover_each_byte_once():
    """``csrc/prefill_wgmma.cu``'s producer, as the kernel indexes it: the K widening writes every
    (key, 16-byte chunk) of a 64-key tile once, the V transpose every (dim, key) of V^T once with the
    V byte of that key and dim; K-major tiles as wgmma reads them (8-row x 16-byte core matrices). The
    raw tiles' loads are free of bank conflicts in both raw layouts (TMA's 128-byte swizzle, cp.async's
    144-byte rows) and the V^T stores take the minimum two wavefronts a warp."""
    def kmajor(row, kb, sbo):
        return (row >> 3) * sbo + (kb >> 4) * 128 + (row & 7) * 16 + (kb & 15)

    def sw128(row, kb):
        return row * 128 + ((((kb >> 4) ^ row) & 7) << 4) + (kb & 15)

    raw = {"tma": sw128, "cp.async": lambda row, kb: row * 144 + kb}

    def wavefronts(addresses, width):  # shared-memory wavefronts of one warp's accesses of `width` bytes
        banks = {}
        for addr in addresses:
            for b in range(addr // 4, (addr + width) // 4):
                banks.setdefault(b % 32, set()).add(b)
        return max(len(words) for words in banks.values())

    seen = {}
    for pt in range(128):
        kq, ch, kg = pt & 7, (pt >> 3) & 7, pt >> 6
        for i in range(4):
            key = 8 * (2 * i + kg) + kq
            for half in range(2):
                seen.setdefault(kmajor(key, 32 * ch + 16 * half, 2048), []).append((key, ch, half))
    assert len(seen) == 64 * 8 * 2 and all(len(v) == 1 for v in seen.values())
    for layout in raw.values():  # a quarter warp (8 lanes) per 16-byte wavefront: 8 different chunks
        for i in range(4):
            for q0 in range(0, 128, 8):
                lanes = [(pt & 7, (pt >> 3) & 7, pt >> 6) for pt in range(q0, q0 + 8)]
                assert wavefronts([layout(8 * (2 * i + kg) + kq, 16 * ch) for kq, ch, kg in lanes], 16) == 1

    vt = {}
    for warp in range(4):
        for kh in range(2):
            for dh in range(2):
                loads = {name: [] for name in raw}
                stores = {j: [] for j in range(4)}
                for lane in range(32):
                    a, w = lane % 16, lane // 16
                    key0, dim0 = 16 * warp + 8 * kh + 4 * w, 64 * dh + 4 * a
                    swz = 64 * w + 16 * (a >> 2)
                    for i in range(4):  # the kernel's addresses of raw byte (key0 + i, dim0)
                        row_t = (16 * warp + 4 * w) * 128 + 4 * (a & 3) + (8 * kh + i) * 128
                        assert row_t + (swz ^ (64 * dh + 16 * i)) == sw128(key0 + i, dim0)
                        for name, layout in raw.items():
                            loads[name].append((i, layout(key0 + i, dim0)))
                    base = kmajor(4 * a, 32 * warp + 8 * w, 1040)
                    for j in range(4):  # y_j: byte j (dim dim0 + j) of keys key0 .. key0 + 3, widened to 8 bytes
                        addr = base + 8 * dh * 1040 + 128 * kh + 16 * j
                        assert addr == kmajor(dim0 + j, 2 * key0, 1040)
                        stores[j].append(addr)
                        for i in range(4):
                            assert addr + 2 * i not in vt
                            vt[addr + 2 * i] = (key0 + i, dim0 + j)
                for name in raw:
                    for i in range(4):
                        assert wavefronts([x for k, x in loads[name] if k == i], 4) == 1, (name, warp, kh, dh, i)
                assert all(wavefronts(addrs, 8) == 2 for addrs in stores.values())
    assert len(vt) == 64 * 128
    for dim in range(128):
        for key in range(64):
            assert vt[kmajor(dim, 2 * key, 1040)] == (key, dim)
