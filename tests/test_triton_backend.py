"""The Triton backend through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by conftest).

The same kernels as on the GPU, with the codec paths the GPU uses where native casts are not
proven (the integer-bit encoder and the integer decoders); tiny shapes. What is checked:

* the ``@triton.jit`` integer encoder equals torch's casts on every fp16/bf16 pattern, on the
  rounding ties (127.8 -> 128 in e4m3) and on Hypothesis-drawn float32 patterns, in all four
  formats; every integer decoder gives the exact value of all 256 bytes;
* writes are byte-identical to the reference (layouts, granularities, input dtypes, NaN signs,
  subnormal inputs, padding, non-power-of-two block sizes) and touch nothing else;
* attention matches the reference within the derived tolerance on the cases that exercise each
  kernel path (split-KV and its merge, the one-half P product above 1024 keys, windows,
  soft-cap, non-causal, GQA groups that are not powers of two, float32 queries), and the kit;
* the plugin's capability answers and codec policy, per (simulated) device.

GPU runs of the same kernels: tests/test_triton_gpu.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from write_checks import FAST_SCALES, SLOW_SCALES, assert_same_bytes, stress_case

import fp8kv
from fp8kv.formats import FORMATS, quantize_scaled
from fp8kv.plugins import Request
from fp8kv.probe import simulated, triton_interpreter
from fp8kv.testing import assert_attention_close, paged_attention_bounds

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreter(),
                                reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")

ALL = list(FORMATS.values())
IDS = [f.name for f in ALL]
fmt_param = pytest.mark.parametrize("fmt", ALL, ids=IDS)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


# ---------------------------------------------------------------------------------- codec


def _all_halves() -> torch.Tensor:
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    return torch.cat([bits.view(torch.float16).float(), bits.view(torch.bfloat16).float()])


@fmt_param
def test_integer_encoder_matches_torch_on_every_half_pattern(fmt):
    from fp8kv_triton.codec import ENC_INTEGER, encode_tensor

    x = _all_halves()
    got = encode_tensor(x, fmt, ENC_INTEGER)
    want = quantize_scaled(x, fmt).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, first x={x[bad[0]].item()!r}"


@pytest.mark.parametrize(("fmt_name", "x", "byte"), [
    ("fp8_e4m3", 127.8, 0x70),        # the rounding carries into the exponent: 128 (interpreter cast: 64)
    ("fp8_e4m3", 464.0, 0x7E),        # tie at the top saturates to 448
    ("fp8_e4m3", -0.0, 0x80),
    ("fp8_e4m3fnuz", -0.0, 0x00),     # fnuz has no -0
    ("fp8_e4m3fnuz", -1e-30, 0x00),
    ("fp8_e5m2", 57344.0 * 1.25, 0x7B),  # saturating, never inf
    ("fp8_e5m2", -math.inf, 0xFB),
    ("fp8_e5m2fnuz", math.nan, 0x80),
    ("fp8_e4m3", 2.0**-10, 0x00),     # exactly half the smallest subnormal: ties to even (0)
    ("fp8_e4m3", 3 * 2.0**-10, 0x02),  # 1.5 subnormal steps: ties to even (2)
])
def test_integer_encoder_edge_values(fmt_name, x, byte):
    from fp8kv_triton.codec import ENC_INTEGER, encode_tensor

    fmt = FORMATS[fmt_name]
    t = torch.tensor([x], dtype=torch.float32)
    got = int(encode_tensor(t, fmt, ENC_INTEGER)[0])
    assert got == byte == int(quantize_scaled(t, fmt).view(torch.uint8)[0])


@given(bits=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64),
       fmt=st.sampled_from(ALL))
@example(bits=[0x42FF999A, -0x3D00666A, 0x7FC00001, -0x00400000, 0x00000001], fmt=FORMATS["fp8_e4m3"])
def test_integer_encoder_matches_torch_on_float32_patterns(bits, fmt):
    from fp8kv_triton.codec import ENC_INTEGER, encode_tensor

    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert torch.equal(encode_tensor(x, fmt, ENC_INTEGER), quantize_scaled(x, fmt).view(torch.uint8))


@fmt_param
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_integer_decoders_are_exact(fmt, out_dtype):
    from fp8kv_triton.codec import decode_tensor
    from fp8kv_triton.modes import DEC_GENERIC, integer_decoder

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(fmt.torch_dtype).double()
    for mode in sorted({DEC_GENERIC, integer_decoder(fmt.name)}):
        got = decode_tensor(codes, fmt, out_dtype, mode).double()
        ok = (got == want) | (got.isnan() & want.isnan())
        assert bool(ok.all()), f"mode {mode}: bytes {(~ok).nonzero().flatten().tolist()[:4]}"


# ---------------------------------------------------------------------------------- write


def _write_case(fmt: str, gran: str, layout: str, dtype: torch.dtype, bs: int = 4, seed: int = 0):
    """A poisoned cache, inputs with specials (NaN of both signs, inf, zero and subnormal rows)."""
    g = torch.Generator().manual_seed(seed)
    T, H, D, nb = 13, 2, 24, 6
    kw = {}
    if gran == "tensor":
        kw = dict(k_scale=0.37, v_scale=1e-3)
    elif gran == "head":
        kw = dict(k_scale=torch.tensor([0.05, 3.0]), v_scale=torch.tensor([2.0**-10, 0.7]))
    cache = fp8kv.KVCache.allocate(nb, bs, H, D, kv_dtype=fmt, layout=layout, scale_granularity=gran, **kw)
    for t in (cache.key_cache, cache.value_cache):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    if gran == "token_head":
        cache.k_scale.uniform_(0.5, 2.0, generator=g)
        cache.v_scale.uniform_(0.5, 2.0, generator=g)
    key = torch.randn(T, H, D, generator=g) * torch.logspace(-3, 5, D)
    value = torch.randn(T, H, D, generator=g) * 30
    key[0, 0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    key[1] = 0.0
    value[2, 1] = -0.0
    key[3, 0] = torch.randn(D, generator=g) * 1e-39  # float32 (and bfloat16) subnormals
    key, value = key.to(dtype), value.to(dtype)
    neg_nan = {torch.float32: -0x400000, torch.float16: -0x200, torch.bfloat16: -0x40}[dtype]
    key.view(torch.int32 if dtype == torch.float32 else torch.int16)[4, 1, 5] = neg_nan
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[5, 9]] = -1
    return cache, key, value, slots


@fmt_param
@pytest.mark.parametrize("gran", ["tensor", "head", "token_head"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_write_is_byte_identical_with_the_reference(fmt, gran, layout, dtype):
    cache, key, value, slots = _write_case(fmt.name, gran, layout, dtype)
    want = cache.clone()
    fp8kv.write_kv_one_shot(want, key, value, slots, backend="reference")
    fp8kv.write_kv_one_shot(cache, key, value, slots.to(torch.int32), backend="triton")
    assert_same_bytes(cache, want)


@pytest.mark.parametrize("fmt,gran,dtype,scales", [
    ("fp8_e4m3", "head", torch.bfloat16, "fast"), ("fp8_e5m2fnuz", "head", torch.bfloat16, "fast"),
    ("fp8_e4m3", "head", torch.float16, "slow"), ("fp8_e5m2", "tensor", torch.float32, "fast"),
    ("fp8_e4m3", "token_head", torch.bfloat16, "-"), ("fp8_e5m2fnuz", "token_head", torch.float16, "-"),
])
def test_write_division_is_exact_on_every_half_pattern(fmt, gran, dtype, scales):
    """Every finite float16/bfloat16 pattern through the write's division, at scales whose
    reciprocals round badly and at both sides of the fast division's range (``tests/write_checks.py``);
    ``token_head`` rows span every binade, so their scales cross that range's lower edge."""
    cache, key, value, slots = stress_case(fmt, gran, dtype, FAST_SCALES if scales == "fast" else SLOW_SCALES)
    want = cache.clone()
    fp8kv.write_kv_one_shot(want, key, value, slots, backend="reference")
    fp8kv.write_kv_one_shot(cache, key, value, slots, backend="triton")
    assert_same_bytes(cache, want)


def test_markstein_division_is_correctly_rounded():
    """The identity the write's fast division rests on (``fp8kv_triton.write._divide_fast``), in
    float32 with a fused multiply-add (Triton's interpreter's own): with ``y = RN(1 / s)``,
    ``q = RN(x y)``, ``r = fma(q, s, -x)``, ``fma(r, -y, q)`` equals ``RN(x / s)`` bit for bit
    wherever the FP8 code can depend on it (``|x / s| >= 2^-20``, no overflow), keeps the sign of
    zero, and stays below ``2^-19`` elsewhere. Scales over the fast range ``[2^-80, 2^125]``
    (random mantissas, and ones whose reciprocals round badly); dividends every finite bfloat16
    and random float32 bit patterns."""
    import numpy as np

    fma = pytest.importorskip("triton._C.libtriton").interpreter.fma_fp32
    rng = np.random.default_rng(7)
    half = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    rand = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([half, rand])
    x = x[np.isfinite(x)]
    mants = [0, 1, 0x7FFFFF, 0x2AAAAB, 0x555555] + list(rng.integers(0, 1 << 23, 35))
    exps = [-80, 125, 0, -1] + list(rng.integers(-80, 126, 36))
    for e, m in zip(exps, mants, strict=True):
        s = np.array([(int(e) + 127) << 23 | int(m)], dtype=np.uint32).view(np.float32)[0]
        y = np.float32(1) / s
        with np.errstate(over="ignore", under="ignore"):
            q = x * y
            got = fma(fma(q, np.full_like(x, s), -x), np.full_like(x, -y), q)
            want = x / s
            fast = np.abs(q) < np.float32(2.0**126)
        big = fast & (np.abs(want) >= np.float32(2.0**-20))
        assert np.array_equal(got[big].view(np.uint32), want[big].view(np.uint32)), f"scale {s!r}"
        assert np.all(np.abs(got[fast & ~big]) < np.float32(2.0**-19)), f"scale {s!r}"
        assert np.array_equal(np.signbit(got[fast]), np.signbit(want[fast])), f"scale {s!r}"


def test_write_with_a_block_size_that_is_not_a_power_of_two():
    cache, key, value, slots = _write_case("fp8_e4m3", "token_head", "HND", torch.bfloat16, bs=3)
    want = cache.clone()
    fp8kv.write_kv_one_shot(want, key, value, slots, backend="reference")
    fp8kv.write_kv_one_shot(cache, key, value, slots, backend="triton")
    assert cache.same_bytes(want)


def test_negative_nan_keeps_its_sign():
    """torch turns NaN into 0xFFFF (-NaN) when converting float32 to bfloat16; the byte must be 0xFF."""
    x = torch.full((300, 1, 16), math.nan).to(torch.bfloat16)
    assert int(x.view(torch.int16)[0, 0, 0]) == -1
    cache = fp8kv.KVCache.allocate(20, 16, 1, 16)
    fp8kv.write_kv_one_shot(cache, x, x, torch.arange(300), backend="triton")
    assert bool((cache.key_cache.view(torch.uint8)[:18, :12] == 0xFF).all())


# ------------------------------------------------------------------------------ attention


def _attention_case(*, fmt="fp8_e4m3", gran="tensor", layout="NHD", dtype=torch.float16, H=2, group=2, D=16,
                    bs=4, seq_lens=(37, 5), q_lens=(1, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g)
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    kw = {}
    if gran == "tensor":
        kw = dict(k_scale=0.03, v_scale=0.2)
    elif gran == "head":
        kw = dict(k_scale=torch.rand(H, generator=g) * 0.05 + 0.01, v_scale=torch.rand(H, generator=g) + 0.1)
    cache = fp8kv.KVCache.allocate(nb, bs, H, D, kv_dtype=fmt, layout=layout, scale_granularity=gran, **kw)
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)])
    mag = torch.logspace(-2, 1, len(slots))[torch.randperm(len(slots), generator=g)][:, None, None]
    key = torch.randn(len(slots), H, D, generator=g) * 3 * mag
    value = torch.randn(len(slots), H, D, generator=g) * mag
    fp8kv.write_kv_one_shot(cache, key, value, slots, backend="reference")
    query = torch.randn(sum(q_lens), H * group, D, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cache, query, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def _check_attention(case, *, causal=True, window=None, cap=None, config=None):
    """Run the kernel (optionally with a launch ``config``) and compare with the reference."""
    from fp8kv_triton.attention import choose_config, paged_attention
    from fp8kv_triton.modes import integer_decoder

    cache, query, tables, lens, qsl = case
    max_q = int((qsl[1:] - qsl[:-1]).max())
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, math.nan)
    cfg = None
    if config is not None:
        base = choose_config(query.device, group=query.shape[1] // cache.num_kv_heads,
                             head_size=cache.head_size, num_seqs=len(lens), num_kv_heads=cache.num_kv_heads,
                             max_query_len=max_q, max_keys=tables.shape[1] * cache.block_size, interpret=True)
        cfg = replace(base, **config)
    paged_attention(query, cache, tables, lens, qsl, max_q, scale, causal, window, cap, out,
                    decode_mode=integer_decoder(cache.kv_dtype), interpret=True, config=cfg)
    ref = fp8kv.paged_attention_one_shot(query, cache, tables, lens, query_start_loc=qsl, causal=causal,
                                sliding_window=window, logits_soft_cap=cap, backend="reference")
    bounds = paged_attention_bounds(query, cache, tables, lens, qsl, causal=causal, sliding_window=window,
                                    logits_soft_cap=cap)
    assert_attention_close(out, ref, **bounds)
    return out


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(fmt="fp8_e5m2", gran="token_head", layout="HND", dtype=torch.bfloat16, group=3, D=40),
    dict(fmt="fp8_e4m3fnuz", gran="head", dtype=torch.float32, H=1, group=4, bs=3, seq_lens=(20, 9),
         q_lens=(20, 3)),
    dict(fmt="fp8_e5m2fnuz", gran="token_head", dtype=torch.float16, H=1, group=1, bs=1, seq_lens=(11,),
         q_lens=(6,)),
], ids=["decode", "e5m2-token_head-gqa3-d40", "fnuz-prefill-f32-bs3", "e5m2fnuz-bs1"])
def test_attention_paths(kwargs):
    _check_attention(_attention_case(**kwargs))


@pytest.mark.parametrize(("causal", "window", "cap"), [
    (True, 7, None), (True, None, 5.0), (False, None, None), (False, 1, 30.0), (True, 1, 0.5)])
def test_attention_options(causal, window, cap):
    case = _attention_case(gran="token_head", dtype=torch.bfloat16, seq_lens=(70, 9), q_lens=(9, 2), bs=16)
    _check_attention(case, causal=causal, window=window, cap=cap)


@pytest.mark.parametrize("gran", ["tensor", "token_head"])
def test_split_kv_partials_merge(gran):
    case = _attention_case(gran=gran, seq_lens=(300, 40, 1), q_lens=(1, 1, 1), bs=16)
    _check_attention(case, config=dict(num_splits=1, keys_per_split=320))
    _check_attention(case, config=dict(num_splits=5, keys_per_split=64))
    _check_attention(case, window=50, config=dict(num_splits=5, keys_per_split=64))


def test_rows_with_over_1024_keys_use_a_single_float16_p():
    """Above FULL_P_KEYS keys per row the P @ V product has one float16 half; still within the bound."""
    from fp8kv_triton.attention import FULL_P_KEYS

    case = _attention_case(H=1, group=2, D=16, bs=16, seq_lens=(FULL_P_KEYS + 40,), q_lens=(3,))
    _check_attention(case)


def test_token_head_tiles_of_zero_vectors_far_below_the_max_stay_finite():
    """Regression: a tile whose weights p * v_scale were all subnormal made 1 / rowmax overflow (NaN)."""
    H, D = 1, 16
    cache = fp8kv.KVCache.allocate(32, 4, H, D, scale_granularity="token_head")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(100, H, D, generator=g), torch.randn(100, H, D, generator=g) * 1e-3
    k[:50] *= -3
    k[0] = 5
    v[60:] = 0  # zero vectors: scale 2^-126
    fp8kv.write_kv_one_shot(cache, k, v, torch.arange(100), backend="reference")
    q = torch.randn(1, 4, D, generator=g) * 3
    tables = torch.arange(25, dtype=torch.int32)[None]
    lens = torch.tensor([100], dtype=torch.int32)
    out = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="triton")
    assert not bool(out.isnan().any())
    ref = fp8kv.paged_attention_one_shot(q, cache, tables, lens, backend="reference")
    assert_attention_close(out, ref, **paged_attention_bounds(q, cache, tables, lens))


def test_bfloat16_subnormal_queries():
    cache, query, tables, lens, qsl = _attention_case(dtype=torch.bfloat16)
    query = (query.float() * 1e-38).to(torch.bfloat16)
    _check_attention((cache, query, tables, lens, qsl))


def test_conformance_kit():
    from fp8kv.testing import check_backend

    report = check_backend("triton", max_seqs=2, max_seq_len=32, head_sizes=(16, 32))
    assert report.served["write_kv"] and report.served["paged_attention"]


# ------------------------------------------------------------------------- plugin, policy


def _req(op="paged_attention", fmt="fp8_e4m3", D=128, device_type="cuda", features=frozenset()):
    return Request(op, fmt, "NHD", "tensor", D, torch.bfloat16, device_type, frozenset(features))


def test_supports_on_simulated_devices():
    from fp8kv_triton.capabilities import supports

    assert supports(simulated("sm70"), _req()) == "sm70: needs sm80+ (bf16 tensor-core dots)"
    # AMD: served (integer-bit codec), but not while TRITON_INTERPRET is set (as in this test run)
    assert "TRITON_INTERPRET" in supports(simulated("gfx942"), _req())
    assert "head_size 512" in supports(simulated("sm90"), _req(D=512))
    # a GPU request while TRITON_INTERPRET is set (as in this test run) is refused with the reason
    assert "TRITON_INTERPRET" in supports(simulated("sm90"), _req())
    for fmt in FORMATS:
        assert supports(simulated("cpu"), _req(fmt=fmt, device_type="cpu")) is None


def test_supports_cpu_without_the_interpreter(monkeypatch):
    from fp8kv_triton.capabilities import supports

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in supports(simulated("cpu"), _req(device_type="cpu"))
    assert supports(simulated("sm80"), _req(fmt="fp8_e4m3")) is None  # e4m3 on Ampere: integer encoder


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_amd_is_served_for_every_format(arch, monkeypatch):
    from fp8kv_triton.capabilities import supports

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for fmt in FORMATS:
        for op in ("write_kv", "paged_attention"):
            assert supports(simulated(arch), _req(op=op, fmt=fmt)) is None, (arch, fmt, op)
    assert "head_size 512" in supports(simulated(arch), _req(D=512))
    assert "AMD is served up to 128" in supports(simulated(arch), _req(D=256))  # prefill tile spills there
    assert supports(simulated(arch), _req(D=96)) is None
    other = replace(simulated("gfx942"), arch="gfx90a", native_fp8=frozenset())
    assert "gfx942, gfx950" in supports(other, _req())
    assert "triton is not installed" in supports(replace(simulated(arch), triton=False), _req())


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_selection_on_simulated_amd_picks_triton_with_reasons(arch, monkeypatch):
    """Auto selection on a simulated MI300/MI350 lands on the Triton backend for every format,
    and the probe notes say what was compiled and what was not run."""
    from fp8kv.commands.probe import build_report, render
    from fp8kv.registry import Registry

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reg = Registry()  # fresh: answers are cached per (backend, device, request), not per environment
    reg.load_entry_points()
    device = simulated(arch)
    for fmt in FORMATS:
        for op in ("write_kv", "paged_attention"):
            sel = reg.select(_req(op=op, fmt=fmt), device, None)
            assert sel.backend.name == "triton", (fmt, op, sel.explain())
    report = build_report(device, reg)
    assert {a["backend"] for a in report["auto"]} == {"triton"}
    notes = report["device_notes"]["triton"]
    assert notes[0].startswith(f"compiled for {arch}, not run on AMD hardware")
    assert all("encode integer bits, decode integer bits" in n for n in notes[1:]) and len(notes) == 5
    assert f"compiled for {arch}, not run on AMD hardware" in render(report)


def test_amd_codec_policy_is_integer_everywhere(monkeypatch):
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.modes import ENC_INTEGER, integer_decoder

    for override in ("auto", "native"):  # FP8KV_TRITON_CODEC=native is about NVIDIA cvt: not on AMD
        monkeypatch.setenv("FP8KV_TRITON_CODEC", override)
        for arch in ("gfx942", "gfx950"):
            for fmt in ALL:
                c = codec_for(arch, fmt, interpret=False)
                assert (c.encoder, c.decoder) == (ENC_INTEGER, integer_decoder(fmt.name)), (arch, fmt.name)
                assert f"compiled for {arch}, not run on AMD hardware" in c.why
    assert "no native OCP" in codec_for("gfx942", FORMATS["fp8_e4m3"], interpret=False).why
    assert "no native fnuz" in codec_for("gfx950", FORMATS["fp8_e4m3fnuz"], interpret=False).why


def test_amd_launch_choices_fit_64_wide_wavefronts():
    from fp8kv_triton.attention import choose_config
    from fp8kv_triton.write import write_launch

    cpu = torch.device("cpu")
    for arch in ("gfx942", "gfx950"):
        for q_len, dtype in ((1, torch.bfloat16), (512, torch.bfloat16), (512, torch.float32)):
            c = choose_config(cpu, group=8, head_size=128, num_seqs=4, num_kv_heads=8, max_query_len=q_len,
                              max_keys=4096, interpret=False, query_dtype=dtype, arch=arch)
            # 4 wavefronts of 64 lanes, one stage: no VGPR spill, 16 KiB of LDS (ci/reports/compile/)
            assert (c.num_warps, c.num_stages, c.reduce_warps) == (4, 1, 4)
            # AMD keeps the general kernel for decode (the decode kernel spills on gfx950), no PTX barrier
            assert (c.decode, c.v_regs) == (False, False)
        assert write_launch(128, arch) == (128, 32, 4)
    nv = choose_config(cpu, group=8, head_size=128, num_seqs=4, num_kv_heads=8, max_query_len=1, max_keys=4096,
                       interpret=False, arch="sm90")
    # NVIDIA decode: 128 keys, 4 warps, 2 stages, V in registers (H100: benchmarks/profiles/triton_decode_tune.py)
    assert (nv.block_n, nv.num_warps, nv.num_stages, nv.decode, nv.v_regs) == (128, 4, 2, True, True)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"])
def test_kernels_in_the_interpreter_with_the_amd_codec_policy(fmt):
    """The write and attention kernels, with the codec and launch sizes chosen for gfx942/gfx950,
    run in the interpreter: writes byte-identical to the reference, attention within bounds."""
    from fp8kv_triton.attention import choose_config, paged_attention
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.write import write_kv

    for arch, gran in (("gfx942", "token_head"), ("gfx950", "tensor")):
        choice = codec_for(arch, FORMATS[fmt], interpret=False)
        cache, key, value, slots = _write_case(fmt, gran, "NHD", torch.bfloat16)
        want = cache.clone()
        fp8kv.write_kv_one_shot(want, key, value, slots, backend="reference")
        write_kv(cache, key, value, slots, encoder=choice.encoder, arch=arch)
        for a, b in ((cache.key_cache, want.key_cache), (cache.value_cache, want.value_cache),
                     (cache.k_scale, want.k_scale), (cache.v_scale, want.v_scale)):
            assert torch.equal(_bytes(a), _bytes(b)), (arch, fmt)
        cache, query, tables, lens, qsl = _attention_case(fmt=fmt, gran=gran, dtype=torch.float16, group=2,
                                                          seq_lens=(20, 9), q_lens=(5, 1))
        max_q = int((qsl[1:] - qsl[:-1]).max())
        cfg = choose_config(query.device, group=2, head_size=cache.head_size, num_seqs=2,
                            num_kv_heads=cache.num_kv_heads, max_query_len=max_q,
                            max_keys=tables.shape[1] * cache.block_size, interpret=True, arch=arch)
        out = torch.full_like(query, math.nan)
        scale = query.shape[-1] ** -0.5
        paged_attention(query, cache, tables, lens, qsl, max_q, scale, True, None, None, out,
                        decode_mode=choice.decoder, interpret=True, config=cfg)
        ref = fp8kv.paged_attention_one_shot(query, cache, tables, lens, query_start_loc=qsl, backend="reference")
        assert_attention_close(out, ref, **paged_attention_bounds(query, cache, tables, lens, qsl))


def test_codec_policy():
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.modes import DEC_E4M3, DEC_E5M2, DEC_GENERIC, DEC_NATIVE, ENC_INTEGER, ENC_NATIVE

    e4, e5, e4z, e5z = (FORMATS[n] for n in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"))
    c = codec_for("sm80", e4, interpret=False)
    assert (c.encoder, c.decoder) == (ENC_INTEGER, DEC_E4M3) and "no e4m3 cast" in c.why
    c = codec_for("sm86", e5, interpret=False)
    assert (c.encoder, c.decoder) == (ENC_INTEGER, DEC_E5M2) and "#5925" in c.why
    c = codec_for("sm90", e4, interpret=False)
    assert (c.encoder, c.decoder) == (ENC_NATIVE, DEC_NATIVE)
    c = codec_for("sm90", e5, interpret=False)
    assert (c.encoder, c.decoder) == (ENC_NATIVE, DEC_E5M2)
    assert codec_for("sm90", e5z, interpret=False).decoder == DEC_GENERIC
    assert codec_for("sm90", e4z, interpret=False).encoder == ENC_INTEGER
    assert codec_for("sm89", e4, interpret=False).encoder == ENC_INTEGER  # not proven there yet
    c = codec_for("sm90", e4, interpret=True)
    assert c.encoder == ENC_INTEGER and "#8322" in c.why


def test_codec_override(monkeypatch):
    from fp8kv_triton.capabilities import codec_for
    from fp8kv_triton.modes import ENC_INTEGER

    monkeypatch.setenv("FP8KV_TRITON_CODEC", "integer")
    assert codec_for("sm90", FORMATS["fp8_e4m3"], interpret=False).encoder == ENC_INTEGER


def test_registered_and_selected_on_the_cpu():
    info = fp8kv.available_backends()["triton"].info
    assert (info.name, info.priority, info.fast) == ("triton", 100, True)
    sel = fp8kv.plugins.select_backend(_req(device_type="cpu"), "cpu")
    assert sel.backend.name == "triton"
    from fp8kv_triton.capabilities import describe

    lines = describe(simulated("sm80"))
    assert lines[0].startswith("fp8_e4m3: encode integer bits") and len(lines) == 4


def test_the_public_kernel_module_exposes_the_reusable_pieces():
    """Other in-tree backends import fp8kv_triton.kernels only: every name it exports is public."""
    import fp8kv_triton.kernels as kernels

    assert all(not name.startswith("_") for name in kernels.__all__)
    for name in ("write_kv", "paged_attention", "codec_for", "encode_f32_bits", "decode", "cache_strides"):
        assert callable(getattr(kernels, name)), name
