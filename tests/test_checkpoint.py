"""KV-cache policy from checkpoints: fp8kv.resolve_kv_cache, KVCachePlan, ``fp8kv plan``.

Backends are fakes registered per test (``any``: slow, serves everything everywhere,
like the reference; ``nv``: NVIDIA sm80+ OCP formats; ``rocm``: gfx942 fnuz formats),
so the expected ``backend`` does not depend on which real backends are installed.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import (  # _fake_backends: autouse, every test here sees only the fake backends
    HOSTILE_FIELDS,
    KV_HEADS,
    LAYERS,
    QUANT,
    _fake_backends,  # noqa: F401
    config,
    fake_any,
    fake_nv,
    fake_nv_fnuz,
    fake_rocm,
    install,
    kv_scales,
    with_field,
    within,
    write_checkpoint,
    write_safetensors_raw,
)

import fp8kv
from fp8kv.checkpoint import tensors as tensors_mod
from fp8kv.cli import EXIT_FAILURE
from fp8kv.cli import main as cli_main
from fp8kv.errors import InvalidArgument
from fp8kv.registry import reset_registry

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "checkpoints"
REFUSED = EXIT_FAILURE  # fp8kv plan's exit status for a refusal



# -- the table: checkpoint config x kv dtype x simulated device ---------------------------------------
#
# Each cell: "<kv_dtype> <granularity> <scale_source> <backend>[ x2]" (x2: the checkpoint's scales
# are doubled), "auto" (no FP8), or "!<text>" (refused; the message contains <text>).
# Configs alone: a config that declares FP8 KV scales counts as storing them.

E5 = "!calibrated for fp8_e4m3"
NV4 = "!quantized as NVFP4"
DEVICES = ("sm70", "sm80", "sm90", "gfx942")
WEIGHT_ONLY = {
    "auto":     ("auto", "auto", "auto", "auto"),
    "fp8":      ("fp8_e4m3 tensor default any", "fp8_e4m3 tensor default nv", "fp8_e4m3 tensor default nv",
                 "fp8_e4m3fnuz tensor default rocm"),
    "fp8_e4m3": ("fp8_e4m3 tensor default any", "fp8_e4m3 tensor default nv", "fp8_e4m3 tensor default nv",
                 "fp8_e4m3 tensor default any"),
    "fp8_e5m2": ("fp8_e5m2 tensor default any", "fp8_e5m2 tensor default nv", "fp8_e5m2 tensor default nv",
                 "fp8_e5m2 tensor default any"),
}
FP8_KV = {
    "auto":     ("fp8_e4m3 tensor checkpoint any", "fp8_e4m3 tensor checkpoint nv",
                 "fp8_e4m3 tensor checkpoint nv", "fp8_e4m3fnuz tensor checkpoint rocm x2"),
    "fp8":      ("fp8_e4m3 tensor checkpoint any", "fp8_e4m3 tensor checkpoint nv",
                 "fp8_e4m3 tensor checkpoint nv", "fp8_e4m3fnuz tensor checkpoint rocm x2"),
    "fp8_e4m3": ("fp8_e4m3 tensor checkpoint any", "fp8_e4m3 tensor checkpoint nv",
                 "fp8_e4m3 tensor checkpoint nv", "fp8_e4m3 tensor checkpoint any"),
    "fp8_e5m2": (E5, E5, E5, E5),
}
TABLE: dict[str, dict[str, tuple[str, str, str, str]]] = {
    #                 dtype        sm70 / sm80 / sm90 / gfx942
    "none": WEIGHT_ONLY,
    "ct_w4a16": WEIGHT_ONLY,
    "ct_w8a16": WEIGHT_ONLY,
    "awq": WEIGHT_ONLY,
    "gptq": WEIGHT_ONLY,
    "bnb": WEIGHT_ONLY,
    "modelopt_nokv": WEIGHT_ONLY,
    "quark_nokv": WEIGHT_ONLY,
    "ct_fp8_kv": FP8_KV,
    "fp8_static_kv": FP8_KV,
    "fp8_dynamic": FP8_KV,
    "modelopt_kv": FP8_KV,
    "modelopt_flat_kv": FP8_KV,
    "quark_kv": FP8_KV,
    "ct_kv_head": {
        "auto":     ("fp8_e4m3 head checkpoint any", "fp8_e4m3 head checkpoint nv",
                     "fp8_e4m3 head checkpoint nv", "fp8_e4m3fnuz head checkpoint rocm x2"),
        "fp8":      ("fp8_e4m3 head checkpoint any", "fp8_e4m3 head checkpoint nv",
                     "fp8_e4m3 head checkpoint nv", "fp8_e4m3fnuz head checkpoint rocm x2"),
        "fp8_e4m3": ("fp8_e4m3 head checkpoint any", "fp8_e4m3 head checkpoint nv",
                     "fp8_e4m3 head checkpoint nv", "fp8_e4m3 head checkpoint any"),
        "fp8_e5m2": (E5, E5, E5, E5),
    },
    "ct_kv_dynamic": {
        "auto":     ("fp8_e4m3 token_head dynamic any", "fp8_e4m3 token_head dynamic nv",
                     "fp8_e4m3 token_head dynamic nv", "fp8_e4m3fnuz token_head dynamic rocm"),
        "fp8":      ("fp8_e4m3 token_head dynamic any", "fp8_e4m3 token_head dynamic nv",
                     "fp8_e4m3 token_head dynamic nv", "fp8_e4m3fnuz token_head dynamic rocm"),
        "fp8_e4m3": ("fp8_e4m3 token_head dynamic any", "fp8_e4m3 token_head dynamic nv",
                     "fp8_e4m3 token_head dynamic nv", "fp8_e4m3 token_head dynamic any"),
        "fp8_e5m2": ("fp8_e5m2 token_head dynamic any", "fp8_e5m2 token_head dynamic nv",
                     "fp8_e5m2 token_head dynamic nv", "fp8_e5m2 token_head dynamic any"),
    },
    "quark_kv_e5m2": {
        "auto":     ("fp8_e5m2 tensor checkpoint any", "fp8_e5m2 tensor checkpoint nv",
                     "fp8_e5m2 tensor checkpoint nv", "fp8_e5m2fnuz tensor checkpoint rocm"),
        "fp8":      ("!calibrated for fp8_e5m2",) * 4,
        "fp8_e4m3": ("!calibrated for fp8_e5m2",) * 4,
        "fp8_e5m2": ("fp8_e5m2 tensor checkpoint any", "fp8_e5m2 tensor checkpoint nv",
                     "fp8_e5m2 tensor checkpoint nv", "fp8_e5m2 tensor checkpoint any"),
    },
    "modelopt_nvfp4_kv": {
        "auto": ("auto", "auto", "auto", "auto"),
        "fp8": (NV4,) * 4, "fp8_e4m3": (NV4,) * 4, "fp8_e5m2": (NV4,) * 4,
    },
}
CASES = [(kind, dtype, dev, TABLE[kind][dtype][i])
         for kind in TABLE for dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
         for i, dev in enumerate(DEVICES)]


def test_table_covers_every_config_and_dtype():
    assert set(TABLE) == set(QUANT)
    assert all(set(rows) == {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"} for rows in TABLE.values())
    assert len(CASES) == len(QUANT) * 4 * 4


def _summary(plan: fp8kv.KVCachePlan) -> str:
    if not plan.is_fp8:
        return "auto"
    s = f"{plan.kv_dtype} {plan.scale_granularity} {plan.scale_source} {plan.backend}"
    return s + (f" x{plan.scale_factor:g}" if plan.scale_factor != 1.0 else "")


@pytest.mark.parametrize("kind,dtype,device,expected", CASES,
                         ids=[f"{k}-{d}-{v}" for k, d, v, _ in CASES])
def test_table(kind, dtype, device, expected):
    cfg = config(kind)
    if expected.startswith("!"):
        with pytest.raises(fp8kv.Fp8KVError, match=expected[1:]):
            fp8kv.resolve_kv_cache(dtype, cfg, device)
        return
    plan = fp8kv.resolve_kv_cache(dtype, cfg, device)
    assert _summary(plan) == expected
    assert plan.requested == dtype
    assert plan.write_backend == plan.backend
    if plan.scale_source == "default":
        assert sorted(plan.k_scales) == list(range(LAYERS)) == list(plan.defaulted_layers)
        assert all(float(s) == 1.0 for s in plan.k_scales.values())
    if plan.scale_source == "checkpoint":  # from a config alone: declared, not read
        assert not plan.scales_loaded and plan.k_scales == {} and plan.calibrated_for is not None


def test_e5m2_refusal_says_why_and_what_works():
    with pytest.raises(fp8kv.Fp8KVError) as exc:
        fp8kv.resolve_kv_cache("fp8_e5m2", config("ct_fp8_kv"), "sm80")
    msg = str(exc.value)
    assert "calibrated for fp8_e4m3" in msg and "kv_cache_scheme" in msg
    assert "Use fp8_e4m3 or fp8" in msg
    with pytest.raises(fp8kv.Fp8KVError, match=r"fp8_e4m3 or fp8 \(= fp8_e4m3fnuz here\) or fp8_e4m3fnuz"):
        fp8kv.resolve_kv_cache("fp8_e5m2", config("modelopt_kv"), "gfx942")


def test_uncalibrated_e4m3_warns_and_e5m2_does_not():
    e4 = fp8kv.resolve_kv_cache("fp8_e4m3", config("awq"), "sm90")
    assert any("uncalibrated KV scales (1.0) with fp8_e4m3" in w for w in e4.warnings)
    e5 = fp8kv.resolve_kv_cache("fp8_e5m2", config("awq"), "sm90")
    assert not any("uncalibrated" in w for w in e5.warnings)
    assert e5.warnings == ()


def test_slow_fallback_and_non_native_are_warnings():
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", config("none"), "gfx942")
    assert plan.backend == "any"
    assert any("not native on gfx942" in w for w in plan.warnings)
    assert any("slow 'any' backend" in w for w in plan.warnings)
    assert fp8kv.resolve_kv_cache("fp8_e5m2", config("none"), "sm90").warnings == ()


# -- device rules through the registry ------------------------------------------------------------------

def test_format_no_backend_can_store_is_refused_naming_where_it_can():
    install(fake_nv(), fake_rocm())
    with pytest.raises(fp8kv.Fp8KVError) as exc:
        fp8kv.resolve_kv_cache("fp8_e5m2", config("ct_w4a16"), "sm70")
    msg = str(exc.value)
    assert "fp8_e5m2 cannot be served on Tesla V100 (simulated) [sm70]" in msg
    assert "needs NVIDIA sm80+" in msg
    assert "nv on sm80, sm86, sm89, sm90" in msg
    with pytest.raises(fp8kv.Fp8KVError, match="nv on sm80, sm86, sm89, sm90"):
        fp8kv.resolve_kv_cache("fp8_e5m2", config("ct_w4a16"), "gfx942")
    assert fp8kv.resolve_kv_cache("fp8", None, "gfx942").backend == "rocm"


def test_fnuz_is_the_gfx942_format():
    with pytest.raises(fp8kv.Fp8KVError) as exc:
        fp8kv.resolve_kv_cache("fp8_e4m3fnuz", config("none"), "sm90")
    msg = str(exc.value)
    assert "fp8_e4m3fnuz is not a format for H100 (simulated) [sm90]" in msg
    assert "use fp8 (= fp8_e4m3) or fp8_e5m2" in msg and "rocm on gfx942" in msg
    # the serve-anything fallback does not make fnuz an NVIDIA format; a fast backend claiming it does
    install(fake_any(), fake_nv(), fake_rocm(), fake_nv_fnuz())
    plan = fp8kv.resolve_kv_cache("fp8_e4m3fnuz", config("none"), "sm90")
    assert plan.kv_dtype == "fp8_e4m3fnuz" and plan.backend == "nvfnuz"
    # on the CPU (the reference's home) fnuz is allowed
    assert fp8kv.resolve_kv_cache("fp8_e5m2fnuz", None, "cpu").backend == "any"
    assert fp8kv.resolve_kv_cache("fp8_e4m3fnuz", None, "gfx942").backend == "rocm"


def test_device_none_uses_probe_and_simulation():
    with fp8kv.plugins.simulate_device("gfx942"):
        plan = fp8kv.resolve_kv_cache("fp8", config("ct_w4a16"))
    assert plan.kv_dtype == "fp8_e4m3fnuz" and "gfx942" in plan.device
    assert fp8kv.resolve_kv_cache("fp8", None, fp8kv.probe("cpu")).kv_dtype == "fp8_e4m3"


def test_bad_arguments():
    with pytest.raises(fp8kv.Fp8KVError, match="kv_cache_dtype: got 'fp16', expected one of auto, fp8"):
        fp8kv.resolve_kv_cache("fp16", None, "sm80")
    with pytest.raises(fp8kv.Fp8KVError, match="no such file or directory"):
        fp8kv.resolve_kv_cache("fp8", "/nonexistent/model", "sm80")
    with pytest.raises(fp8kv.Fp8KVError, match="device"):
        fp8kv.resolve_kv_cache("fp8", None, "sm99")
    bad = config("ct_fp8_kv")
    bad["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
    with pytest.raises(fp8kv.errors.InvalidArgument, match=r"config: quantization_config\.kv_cache_scheme\.strategy: "
                       r"got 'channel' \(str\), expected 'tensor' or 'attn_head'"):
        fp8kv.resolve_kv_cache("fp8", bad, "sm80")


# -- model directories: scale tensors -------------------------------------------------------------------

SCALES = {0: (0.5, 0.25), 1: (0.125, 2.0), 2: (1.5, 0.75), 3: (0.0625, 3.0)}


@pytest.mark.parametrize("style", ["ct", "attn", "modelopt", "output"])
def test_every_naming_style_loads(tmp_path, style):
    d = write_checkpoint(tmp_path / style, config("ct_fp8_kv"), kv_scales(SCALES, style), shards=2)
    plan = fp8kv.resolve_kv_cache("fp8_e4m3", d, "sm90")
    assert plan.scale_source == "checkpoint" and plan.scales_loaded
    assert plan.loaded_layers == (0, 1, 2, 3) and plan.defaulted_layers == ()
    for layer, (k, v) in SCALES.items():
        assert plan.k_scales[layer].dtype == torch.float32 and plan.k_scales[layer].shape == ()
        assert float(plan.k_scales[layer]) == k and float(plan.v_scales[layer]) == v
    assert plan.warnings == ()


def test_legacy_kv_scale_duplicates_with_deprecation_warning(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("fp8_static_kv"), kv_scales(SCALES, "kv", shape=(1,)))
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert [float(plan.v_scales[i]) for i in range(LAYERS)] == [k for k, _ in SCALES.values()]
    assert plan.k_scales[1].shape == ()
    assert any("deprecated kv_scale" in w and "0-3" in w for w in plan.warnings)


def test_precedence_and_disagreeing_duplicates(tmp_path):
    t = {**kv_scales({0: (0.5, 0.25)}, "ct"), **kv_scales({0: (9.0, 0.25)}, "output"),
         **kv_scales({1: (4.0, 4.0)}, "kv"), **kv_scales({1: (2.0, 3.0)}, "modelopt")}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv", num_hidden_layers=2), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert float(plan.k_scales[0]) == 0.5
    assert float(plan.k_scales[1]) == 2.0 and float(plan.v_scales[1]) == 3.0
    assert any("k_proj.output_scale" in w and "differs" in w for w in plan.warnings)
    assert not any("deprecated" in w for w in plan.warnings)  # the kv_scale lost to ModelOpt's


def test_q_and_prob_scales(tmp_path):
    t = {**kv_scales(SCALES), "model.layers.0.self_attn.q_scale": torch.tensor(0.25),
         "model.layers.2.self_attn.prob_scale": torch.tensor([0.5])}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert set(plan.q_scales) == {0} and float(plan.q_scales[0]) == 0.25
    assert set(plan.prob_scales) == {2} and float(plan.prob_scales[2]) == 0.5
    fnuz = fp8kv.resolve_kv_cache("fp8", d, "gfx942")
    assert float(fnuz.q_scales[0]) == 0.5 and float(fnuz.prob_scales[2]) == 1.0


def test_q_and_prob_scales_reach_the_fp8_mode(tmp_path):
    """Per layer: a per-tensor prob_scale and a per-query-head q_scale, as plan_attention takes them;
    the x2 of e4m3fnuz devices (vLLM's BaseKVCacheMethod rule for q and prob) is applied at load, and
    an fnuz plan refuses the mode (it is defined for e4m3fn caches)."""
    heads = torch.linspace(0.1, 0.8, 4)  # num_attention_heads
    t = {**kv_scales(SCALES), "model.layers.0.self_attn.q_scale": heads,
         "model.layers.0.self_attn.prob_scale": torch.tensor(1 / 448),
         "model.layers.1.self_attn.prob_scale": torch.tensor([0.5, 0.25])}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm90")
    got = plan.fp8_attention_scales(0)
    assert torch.equal(got["q_scale"], heads) and got["prob_scale"] == float(torch.tensor(1 / 448))
    assert plan.fp8_attention_scales(2) == {"q_scale": None, "prob_scale": 1.0}  # dynamic q, p unscaled
    with pytest.raises(InvalidArgument, match="^prob_scale: got 2 values for layer 1"):
        plan.fp8_attention_scales(1)
    fnuz = fp8kv.resolve_kv_cache("fp8", d, "gfx942")
    assert torch.equal(fnuz.q_scales[0], heads * 2) and float(fnuz.prob_scales[0]) == float(torch.tensor(2 / 448))
    with pytest.raises(fp8kv.Fp8KVError, match="fp8_e4m3 plan"):
        fnuz.fp8_attention_scales(0)


@pytest.mark.parametrize("shape", [(KV_HEADS,), (KV_HEADS, 1, 1)])
def test_per_head_scales(tmp_path, shape):
    t = {}
    for layer in range(LAYERS):
        for role in ("k", "v"):
            t[f"model.layers.{layer}.self_attn.{role}_scale"] = torch.arange(1, KV_HEADS + 1,
                                                                             dtype=torch.bfloat16).reshape(shape)
    d = write_checkpoint(tmp_path / "m", config("ct_kv_head"), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "gfx942")
    assert plan.scale_granularity == "head" and plan.kv_dtype == "fp8_e4m3fnuz"
    assert plan.k_scales[3].tolist() == [2.0, 4.0]  # doubled for e4m3fnuz


def test_per_head_with_a_per_tensor_layer_expands(tmp_path):
    t = {"model.layers.0.self_attn.k_scale": torch.tensor([1.0, 2.0]),
         "model.layers.0.self_attn.v_scale": torch.tensor(3.0)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv", num_hidden_layers=1), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert plan.scale_granularity == "head" and plan.v_scales[0].tolist() == [3.0, 3.0]


@pytest.mark.parametrize("shape,match", [
    ((3,), r"got shape \[3\], expected \[\] or \[1\] \(per-tensor\) or \[2\] / \[2, 1, 1\]"),
    ((2, 2), r"got shape \[2, 2\]"),
    ((2, 1), r"got shape \[2, 1\]"),
])
def test_bad_scale_shapes(tmp_path, shape, match):
    t = {**kv_scales(SCALES), "model.layers.1.self_attn.v_scale": torch.ones(shape)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError, match=r"model\.layers\.1\.self_attn\.v_scale in model-00001"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    with pytest.raises(fp8kv.Fp8KVError, match=match):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


@pytest.mark.parametrize("value,dtype", [
    (0.0, torch.bfloat16), (-1.0, torch.bfloat16), (math.nan, torch.bfloat16), (math.inf, torch.bfloat16),
    (-math.inf, torch.bfloat16), (1e-40, torch.float32), (1e-40, torch.bfloat16), (-0.0, torch.float32),
    (2.0**-127, torch.float32),
])
def test_bad_scale_values_name_tensor_and_file(tmp_path, value, dtype):
    t = {**kv_scales(SCALES), "model.layers.2.self_attn.k_scale": torch.tensor(value, dtype=dtype)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(InvalidArgument) as exc:
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    msg = str(exc.value)
    assert "model.layers.2.self_attn.k_scale in model-00001-of-00001.safetensors" in msg
    assert "expected finite scales >= 2^-126" in msg and "subnormal" in msg


def test_smallest_normal_scale_is_accepted(tmp_path):
    tiny = torch.finfo(torch.float32).tiny  # 2^-126: 1 / tiny = 2^126 is finite
    t = {**kv_scales(SCALES), "model.layers.2.self_attn.k_scale": torch.tensor(tiny)}
    plan = fp8kv.resolve_kv_cache("fp8", write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t), "sm80")
    assert float(plan.k_scales[2]) == tiny and math.isfinite(1 / float(plan.k_scales[2]))


def test_integer_scale_refused(tmp_path):
    t = {**kv_scales(SCALES), "model.layers.0.self_attn.v_scale": torch.tensor(2, dtype=torch.int32)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError, match="v_scale in .*dtype torch.int32, expected a float scale"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_fnuz_doubling_is_exact_and_overflow_refused(tmp_path):
    d = write_checkpoint(tmp_path / "ok", config("ct_fp8_kv"), kv_scales(SCALES))
    plan = fp8kv.resolve_kv_cache("fp8", d, "gfx942")
    assert plan.kv_dtype == "fp8_e4m3fnuz" and plan.scale_factor == 2.0
    assert [float(plan.k_scales[i]) for i in range(LAYERS)] == [2 * k for k, _ in SCALES.values()]
    huge = 2.0e38  # finite in float32, but twice it is not
    t = {**kv_scales(SCALES), "model.layers.3.self_attn.v_scale": torch.tensor(huge)}
    d = write_checkpoint(tmp_path / "huge", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError) as exc:
        fp8kv.resolve_kv_cache("fp8", d, "gfx942")
    assert "model.layers.3.self_attn.v_scale in" in str(exc.value) and "overflows float32" in str(exc.value)
    ocp = fp8kv.resolve_kv_cache("fp8_e4m3", d, "gfx942")  # OCP e4m3 keeps the scale as calibrated
    assert float(ocp.v_scales[3]) == torch.tensor(huge).item() and ocp.scale_factor == 1.0


def test_float64_scale_that_overflows_float32_is_refused(tmp_path):
    t = {**kv_scales(SCALES), "model.layers.0.self_attn.k_scale": torch.tensor(1e300, dtype=torch.float64)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError, match=r"k_scale in .*expected finite scales >= 2\^-126"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_missing_layers_default_and_lone_k_scales_take_v_from_k(tmp_path):
    t = kv_scales({0: (0.5, 0.5), 2: (0.25, 0.25)})
    del t["model.layers.2.self_attn.v_scale"]
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert (plan.loaded_layers, plan.v_from_k_layers, plan.defaulted_layers) == ((0,), (2,), (1, 3))
    assert float(plan.k_scales[2]) == 0.25 and float(plan.v_scales[2]) == 0.25  # v = k, as the engines do
    assert float(plan.k_scales[3]) == 1.0 == float(plan.v_scales[3])
    assert plan.warnings == (
        "no v scale in the checkpoint for layers 2: those use their k scale for v (v = k), as vLLM and SGLang do",
        "no KV scales in the checkpoint for layers 1, 3; those use 1.0 for k and v - uncalibrated KV scales (1.0) "
        "with fp8_e4m3: |K|, |V| above 448 saturate; calibrate scales (fp8kv.calibrate), use a checkpoint with "
        "KV scales, or dynamic per-token-head scales (scale_granularity='token_head')")
    e5 = write_checkpoint(tmp_path / "e5", config("quark_kv_e5m2"), t)
    assert fp8kv.resolve_kv_cache("fp8_e5m2", e5, "sm80").warnings[1] == (
        "no KV scales in the checkpoint for layers 1, 3; those use 1.0 for k and v")
    text = plan.describe()
    assert "  layers 2: k as stored, v = k (no v scale; as vLLM and SGLang do)" in text
    assert "  layers 1, 3: k = v = 1.0 (no scales in the checkpoint; see the warning)" in text


def test_lone_v_scale_is_refused_naming_it(tmp_path):
    t = kv_scales(SCALES)
    del t["model.layers.1.self_attn.k_scale"], t["model.layers.3.self_attn.k_scale"]
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(InvalidArgument, match=r"model\.layers\.1\.self_attn\.v_scale in model-00001-of-00001"
                       r"\.safetensors: got a v scale without a k scale \(layers 1, 3\)"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_one_element_shapes_are_per_tensor_and_bin_files_are_named(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), kv_scales(SCALES, shape=(1, 1, 1)))
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert plan.scale_granularity == "tensor" and plan.k_scales[0].shape == ()
    assert plan.loaded_layers == (0, 1, 2, 3)
    pt = write_checkpoint(tmp_path / "pt", config("ct_w4a16"))
    (pt / "pytorch_model.bin").write_bytes(b"not read")
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", pt, "sm80")
    assert plan.warnings == ("only *.safetensors are read for scales; pytorch_model.bin not inspected, "
                             "so the config alone decides",)


def test_layer_beyond_config_refused(tmp_path):
    t = {**kv_scales(SCALES), **kv_scales({7: (1.0, 1.0)})}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError, match=r"layers\.7\.self_attn\.k_scale in .*layer 7, expected < "):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_only_scale_tensors_are_read(tmp_path, monkeypatch):
    t = {**kv_scales(SCALES), "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
         "model.layers.0.self_attn.k_proj.input_scale": torch.tensor(1.0),
         "lm_head.weight": torch.zeros(4, 4)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    real = tensors_mod._safe_open()
    read: list[str] = []

    class Spy:
        def __init__(self, path, framework):
            assert framework == "pt"
            self.f = real(path, framework=framework)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(tensors_mod, "_safe_open", lambda: Spy)
    fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert sorted(read) == sorted(kv_scales(SCALES))


def test_unrecognised_scale_names_are_reported(tmp_path):
    t = {**kv_scales(SCALES), "model.decoder.block.0.attn.k_scale": torch.tensor(1.0)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert any("unrecognised names: model.decoder.block.0.attn.k_scale" in w for w in plan.warnings)


def test_directory_decides_on_tensors_present(tmp_path):
    weights = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4)}
    # a weight-only checkpoint takes e5m2 with default scales
    w4 = write_checkpoint(tmp_path / "w4", config("ct_w4a16"), weights)
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", w4, "sm80")
    assert (plan.kv_dtype, plan.scale_source, plan.backend) == ("fp8_e5m2", "default", "nv")
    # an FP8 checkpoint without KV scale tensors too (its config alone would refuse)
    fp8 = write_checkpoint(tmp_path / "fp8", config("fp8_dynamic"), weights)
    assert fp8kv.resolve_kv_cache("fp8_e5m2", fp8, "sm80").scale_source == "default"
    assert not fp8kv.resolve_kv_cache("auto", fp8, "sm80").is_fp8
    # a declared kv_cache_scheme without tensors: allowed, with a warning
    ct = write_checkpoint(tmp_path / "ct", config("ct_fp8_kv"), weights)
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", ct, "sm80")
    assert plan.scale_source == "default"
    assert any("declares an FP8 KV cache" in w and "no KV scale tensors" in w for w in plan.warnings)
    auto = fp8kv.resolve_kv_cache("auto", ct, "sm80")
    assert not auto.is_fp8 and any("not enabling FP8" in w for w in auto.warnings)
    # scale tensors present: e5m2 refused, naming one
    kv = write_checkpoint(tmp_path / "kv", config("ct_fp8_kv"), {**weights, **kv_scales(SCALES)})
    with pytest.raises(fp8kv.Fp8KVError,
                       match=r"8 KV scale tensors, e\.g\. model\.layers\.0\.self_attn\.k_scale"):
        fp8kv.resolve_kv_cache("fp8_e5m2", kv, "sm80")


def test_e5m2_refusal_does_not_need_valid_values(tmp_path):
    t = {**kv_scales(SCALES), "model.layers.0.self_attn.k_scale": torch.tensor(math.nan)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError, match="calibrated for fp8_e4m3"):
        fp8kv.resolve_kv_cache("fp8_e5m2", d, "sm80")


def test_hf_quant_config_beside_config(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("none"), kv_scales(SCALES, "modelopt"))
    (d / "hf_quant_config.json").write_text(json.dumps(QUANT["modelopt_kv"]))
    plan = fp8kv.resolve_kv_cache("auto", d, "sm90")
    assert plan.kv_dtype == "fp8_e4m3" and plan.loaded_layers == (0, 1, 2, 3)
    assert "ModelOpt FP8" in plan.checkpoint


def test_config_json_path_and_config_only_directory(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), kv_scales(SCALES))
    from_file = fp8kv.resolve_kv_cache("fp8", d / "config.json", "sm80")
    assert from_file.scale_source == "checkpoint" and not from_file.scales_loaded
    bare = write_checkpoint(tmp_path / "bare", config("ct_fp8_kv"))
    with pytest.raises(fp8kv.Fp8KVError, match="calibrated for fp8_e4m3"):
        fp8kv.resolve_kv_cache("fp8_e5m2", bare, "sm80")


# -- KVCache.allocate with a plan ---------------------------------------------------------------------

def test_allocate_from_plan(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), kv_scales(SCALES))
    plan = fp8kv.resolve_kv_cache("fp8", d, "gfx942")
    cache = fp8kv.KVCache.allocate(4, 16, KV_HEADS, 64, **plan.cache_kwargs(1))
    assert cache.kv_dtype == "fp8_e4m3fnuz" and cache.scale_granularity == "tensor"
    assert float(cache.k_scale) == 0.25 and float(cache.v_scale) == 4.0
    same = fp8kv.KVCache.allocate(4, 16, KV_HEADS, 64, **plan.cache_kwargs(1, kv_dtype="fp8_e4m3fnuz",
                                                                           k_scale=0.25))
    assert float(same.k_scale) == 0.25
    for kwargs, match in (({"kv_dtype": "fp8_e4m3"}, "kv_dtype: got 'fp8_e4m3', expected 'fp8_e4m3fnuz'"),
                          ({"scale_granularity": "head"}, "scale_granularity: got 'head'"),
                          ({"k_scale": 0.5}, r"k_scale: got 0.5, expected None or the plan's 0.25"),
                          ({"layer": None}, "layer: got None, expected the layer index"),
                          ({"layer": True}, "layer: got True, expected an int layer index"),
                          ({"layer": "1"}, "layer: got '1', expected an int layer index"),
                          ({"layer": 9}, "layer: got 9")):
        with pytest.raises(fp8kv.Fp8KVError, match=match):
            fp8kv.KVCache.allocate(4, 16, KV_HEADS, 64, **plan.cache_kwargs(**{"layer": 1, **kwargs}))


def test_allocate_from_default_dynamic_and_refusing_plans():
    default = fp8kv.resolve_kv_cache("fp8_e5m2", config("awq"), "sm80")
    cache = fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, **default.cache_kwargs())
    assert cache.kv_dtype == "fp8_e5m2" and float(cache.k_scale) == 1.0
    dyn = fp8kv.resolve_kv_cache("auto", config("ct_kv_dynamic"), "sm80")
    cache = fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, **dyn.cache_kwargs(0))
    assert cache.scale_granularity == "token_head" and cache.k_scale.shape == (2, 8, KV_HEADS)
    with pytest.raises(fp8kv.Fp8KVError, match="expected None"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, **dyn.cache_kwargs(k_scale=1.0))
    with pytest.raises(fp8kv.Fp8KVError, match="plan: got a plan with kv_dtype 'auto'"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, **fp8kv.resolve_kv_cache("auto", None, "sm80").cache_kwargs())
    config_only = fp8kv.resolve_kv_cache("fp8", config("ct_fp8_kv"), "sm80")
    with pytest.raises(fp8kv.Fp8KVError, match="planned from a config alone"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, **config_only.cache_kwargs(0))
    hnd = fp8kv.resolve_kv_cache("fp8_e5m2", config("awq"), "sm80", layout="HND")
    assert fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, **hnd.cache_kwargs()).layout == "HND"  # the planned layout
    plain = fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64)  # defaults unchanged without a plan
    assert plain.kv_dtype == "fp8_e4m3" and plain.scale_granularity == "tensor"
    with pytest.raises(TypeError, match="layer"):  # a layer's scales come from a plan's cache_kwargs only
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, layer=0)


def test_plan_scales_drive_the_reference_write(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_kv_head"), {
        **{f"model.layers.{i}.self_attn.k_scale": torch.tensor([0.5, 0.25]) for i in range(LAYERS)},
        **{f"model.layers.{i}.self_attn.v_scale": torch.tensor([2.0, 4.0]) for i in range(LAYERS)}})
    plan = fp8kv.resolve_kv_cache("fp8", d, "cpu")
    reset_registry()  # the real registry (the reference) runs the write
    cache = fp8kv.KVCache.allocate(2, 4, KV_HEADS, 8, **plan.cache_kwargs(2))
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, KV_HEADS, 8, generator=g), torch.randn(3, KV_HEADS, 8, generator=g)
    fp8kv.write_kv_one_shot(cache, key, value, torch.tensor([0, 1, 5]), backend="reference")
    want = fp8kv.quantize(key, "fp8_e4m3", torch.tensor([0.5, 0.25])[:, None])
    assert torch.equal(cache.key_cache.view(torch.uint8)[0, :2], want[:2].view(torch.uint8))


# -- describe / to_dict / the CLI -----------------------------------------------------------------------

def test_describe_and_json():
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", config("ct_w4a16"), "sm80")
    text = plan.describe()
    assert "kv_dtype      fp8_e5m2  (allowed)" in text
    assert "compressed-tensors W4A16 (weight-only, no kv_cache_scheme)" in text
    assert "default 1.0 (k and v), per-tensor for 4 layers: the checkpoint has no KV scales" in text
    assert "backend       nv" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["kv_dtype"] == "fp8_e5m2" and data["k_scales"]["3"] == 1.0
    assert data["defaulted_layers"] == [0, 1, 2, 3]


def test_cli_examples(capsys):
    rc = cli_main(["plan", str(EXAMPLES / "llama-w4a16"), "--kv-cache-dtype", "fp8_e5m2",
                   "--simulate", "sm80"])
    out = capsys.readouterr().out
    assert rc == 0 and "fp8_e5m2  (allowed)" in out and "A100 (simulated) [sm80]" in out
    rc = cli_main(["plan", str(EXAMPLES / "llama-fp8-kv"), "--kv-cache-dtype", "fp8_e5m2",
                   "--simulate", "sm80"])
    out = capsys.readouterr().out
    assert rc == REFUSED and "REFUSED" in out and "calibrated for fp8_e4m3" in out and "Use fp8_e4m3 or fp8" in out
    rc = cli_main(["plan", str(EXAMPLES / "llama-fp8-kv"), "--kv-cache-dtype", "fp8", "--simulate", "gfx942",
                   "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["kv_dtype"] == "fp8_e4m3fnuz" and data["scale_factor"] == 2.0
    assert data["loaded_layers"] == list(range(32)) and data["backend"] == "rocm"
    rc = cli_main(["plan", str(EXAMPLES / "llama-fp8-kv" / "config.json"), "--kv-cache-dtype", "fp8_e5m2",
                   "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == REFUSED and data["refused"] and "calibrated for fp8_e4m3" in data["reason"]


def test_real_registry_plans_the_examples():
    reset_registry()  # whatever backends are installed; the reference serves everything
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", EXAMPLES / "llama-w4a16", "sm80")
    assert plan.kv_dtype == "fp8_e5m2" and plan.backend in fp8kv.available_backends()
    with pytest.raises(fp8kv.Fp8KVError, match="calibrated for fp8_e4m3"):
        fp8kv.resolve_kv_cache("fp8_e5m2", EXAMPLES / "llama-fp8-kv", "sm80")



# -- what describe() says is what a cache gets (issue item 8) --------------------------------------------

def _described(plan: fp8kv.KVCachePlan) -> dict[str, list[int]]:
    """describe()'s per-layer lines: ``{"stored": [...], "v=k": [...], "1.0": [...]}``."""
    out: dict[str, list[int]] = {"stored": [], "v=k": [], "1.0": []}
    for line in plan.describe().splitlines():
        body = line.strip()
        if not body.startswith("layers ") or line.startswith("layers"):
            continue
        spans, what = body[len("layers "):].split(": ", 1)
        kind = "stored" if what == "k and v as stored" else "v=k" if what.startswith("k as stored, v = k") else "1.0"
        for span in spans.split(", "):
            lo, _, hi = span.partition("-")
            out[kind] += range(int(lo), int(hi or lo) + 1)
    return out


def _scales_of(plan, layer):
    cache = fp8kv.KVCache.allocate(2, 4, KV_HEADS, 8, **plan.cache_kwargs(layer))
    return cache.k_scale.tolist(), cache.v_scale.tolist()


@pytest.mark.parametrize("case", ["both", "only_k", "mixed", "mixed_fnuz", "per_head_only_k", "kv_legacy"])
def test_describe_matches_what_allocate_gets(tmp_path, case):
    kind, device, factor = "ct_fp8_kv", "sm80", 1.0
    if case == "both":
        t, want = kv_scales(SCALES), {i: (k, v) for i, (k, v) in SCALES.items()}
        described = {"stored": [0, 1, 2, 3], "v=k": [], "1.0": []}
    elif case == "only_k":  # the case: a k_scale stored alone (0.375: exact in float32)
        t = {n: v for n, v in kv_scales({i: (0.375, 9.0) for i in range(LAYERS)}).items() if "k_scale" in n}
        want = {i: (0.375, 0.375) for i in range(LAYERS)}
        described = {"stored": [], "v=k": [0, 1, 2, 3], "1.0": []}
    elif case in ("mixed", "mixed_fnuz"):
        t = {**kv_scales({0: (0.5, 0.25)}), "model.layers.1.self_attn.k_scale": torch.tensor(0.125)}
        want = {0: (0.5, 0.25), 1: (0.125, 0.125), 2: (1.0, 1.0), 3: (1.0, 1.0)}
        described = {"stored": [0], "v=k": [1], "1.0": [2, 3]}
        if case == "mixed_fnuz":
            device, factor = "gfx942", 2.0
    elif case == "per_head_only_k":
        kind = "ct_kv_head"
        t = {**{f"model.layers.{i}.self_attn.k_scale": torch.tensor([0.5, 0.25]) for i in range(LAYERS)},
             **{f"model.layers.{i}.self_attn.v_scale": torch.tensor([2.0, 4.0]) for i in (0, 2)}}
        want = {i: ([0.5, 0.25], [2.0, 4.0] if i in (0, 2) else [0.5, 0.25]) for i in range(LAYERS)}
        described = {"stored": [0, 2], "v=k": [1, 3], "1.0": []}
    else:  # legacy kv_scale: one stored scale for both, which is not "v = k" by fp8kv's choice
        t, want = kv_scales(SCALES, "kv"), {i: (k, k) for i, (k, _) in SCALES.items()}
        described = {"stored": [0, 1, 2, 3], "v=k": [], "1.0": []}
    plan = fp8kv.resolve_kv_cache("fp8", write_checkpoint(tmp_path / case, config(kind), t), device)
    assert plan.scale_source == "checkpoint" and "default 1.0" not in plan.describe()
    assert _described(plan) == described
    assert (list(plan.loaded_layers), list(plan.v_from_k_layers), list(plan.defaulted_layers)) == (
        described["stored"], described["v=k"], described["1.0"])
    for layer, (k, v) in want.items():
        scale = (lambda x: [factor * y for y in x]) if isinstance(k, list) else (lambda x: factor * x)
        got_k, got_v = _scales_of(plan, layer)
        if layer in described["1.0"]:
            assert (got_k, got_v) == (1.0, 1.0)  # defaults are not multiplied
        else:
            assert (got_k, got_v) == (scale(k), scale(v)), layer
    assert plan.to_dict()["v_from_k_layers"] == described["v=k"]


def test_describe_matches_allocate_for_default_and_dynamic_plans(tmp_path):
    weights = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4)}
    default = fp8kv.resolve_kv_cache("fp8", write_checkpoint(tmp_path / "w", config("awq"), weights), "sm80")
    text = default.describe()
    assert ("default 1.0 (k and v), per-tensor for 4 layers: the checkpoint has no KV scales; uncalibrated, "
            "see the warning") in text
    assert any(w.startswith("uncalibrated KV scales (1.0) with fp8_e4m3") for w in default.warnings)
    assert all(_scales_of(default, i) == (1.0, 1.0) for i in range(LAYERS))
    e5 = fp8kv.resolve_kv_cache("fp8_e5m2", config("awq"), "sm80")
    assert "see the warning" not in e5.describe() and e5.warnings == ()
    dyn = fp8kv.resolve_kv_cache("auto", config("ct_kv_dynamic"), "sm80")
    assert "dynamic, one per token and KV head, computed at write time" in dyn.describe()
    cache = fp8kv.KVCache.allocate(2, 4, KV_HEADS, 8, **dyn.cache_kwargs(0))
    assert cache.k_scale.shape == (2, 4, KV_HEADS) and dyn.layer_scales(0) == (None, None)


def test_plan_without_config_layer_count_has_the_layers_found(tmp_path):
    cfg = config("ct_fp8_kv")
    del cfg["num_hidden_layers"]
    d = write_checkpoint(tmp_path / "m", cfg, kv_scales({0: (0.5, 0.5), 7: (0.25, 0.125)}))
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert sorted(plan.k_scales) == [0, 7] and plan.loaded_layers == (0, 7) and plan.num_layers is None
    assert _described(plan) == {"stored": [0, 7], "v=k": [], "1.0": []}
    with pytest.raises(fp8kv.Fp8KVError, match="layer: got 3, expected a layer this plan has"):
        fp8kv.KVCache.allocate(2, 4, KV_HEADS, 8, **plan.cache_kwargs(3))


# -- hostile checkpoints: typed, bounded, never hanging (issue item 6) ----------------------------------

@pytest.mark.parametrize("kind,field,value,expected", HOSTILE_FIELDS, ids=[f"{f}={v!r}"[:60] for _, f, v, _ in
                                                                          HOSTILE_FIELDS])
def test_config_fields_are_type_checked_naming_the_field(tmp_path, kind, field, value, expected):
    cfg = with_field(config(kind), field, value)
    with pytest.raises(InvalidArgument) as exc:
        within(10, lambda: fp8kv.resolve_kv_cache("fp8", cfg, "sm80"))
    msg = str(exc.value)
    assert msg.startswith(f"config: {field}: got ") and f"expected {expected}" in msg, msg
    assert f"({type(value).__name__})" in msg
    d = write_checkpoint(tmp_path / "m", cfg)  # the same from a file names the file
    with pytest.raises(InvalidArgument) as exc:
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert str(exc.value) == msg.replace("config: ", f"{d / 'config.json'}: ", 1)


def test_config_field_message_is_the_standard_one(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("none", num_hidden_layers="32"))
    with pytest.raises(InvalidArgument) as exc:
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert str(exc.value) == f"{d / 'config.json'}: num_hidden_layers: got '32' (str), expected an int in [1, 4096]"
    nested = {"architectures": ["LlavaForConditionalGeneration"], "text_config": {**config("none"),
                                                                                  "num_hidden_layers": [1]}}
    with pytest.raises(InvalidArgument, match=r"^config: text_config\.num_hidden_layers: got \[1\] \(list\)"):
        fp8kv.resolve_kv_cache("fp8", nested, "sm80")
    with pytest.raises(InvalidArgument, match=r"^config: text_config: got 'x' \(str\), expected a JSON object"):
        fp8kv.resolve_kv_cache("fp8", {"text_config": "x"}, "sm80")
    ok = {"text_config": config("none")}  # multimodal configs keep working
    assert fp8kv.resolve_kv_cache("fp8", ok, "sm80").num_layers == LAYERS
    nulls = config("none", head_dim=None, torch_dtype=None)  # null counts as absent
    assert fp8kv.resolve_kv_cache("fp8", nulls, "sm80").head_size == 256 // 4
    with pytest.raises(InvalidArgument, match=r"hidden_size / num_attention_heads: got 1048576 / 1 = 1048576"):
        fp8kv.resolve_kv_cache("fp8", config("none", head_dim=None, hidden_size=2**20, num_attention_heads=1,
                                             num_key_value_heads=1), "sm80")
    with pytest.raises(InvalidArgument, match=r"^checkpoint: got 123 \(int\), expected a model directory"):
        fp8kv.resolve_kv_cache("fp8", 123, "sm80")
    with pytest.raises(InvalidArgument, match=r"^kv_cache_dtype: got \['fp8'\]"):
        fp8kv.resolve_kv_cache(["fp8"], None, "sm80")
    with pytest.raises(InvalidArgument, match=r"^checkpoint: got 'a\\x00b', expected a model directory"):
        fp8kv.resolve_kv_cache("fp8", "a\x00b", "sm80")


def test_huge_layer_count_is_refused_at_once(tmp_path):
    start = time.perf_counter()
    for dtype in ("fp8", "fp8_e5m2", "auto"):
        with pytest.raises(InvalidArgument, match=r"num_hidden_layers: got 1000000000 \(int\), expected an int in"):
            within(10, lambda dtype=dtype: fp8kv.resolve_kv_cache(dtype, config("awq", num_hidden_layers=10**9),
                                                                  "sm80"))
    assert time.perf_counter() - start < 5
    big = config("none", num_hidden_layers=4096)  # the cap itself is fine
    assert len(fp8kv.resolve_kv_cache("fp8_e5m2", big, "sm80").k_scales) == 4096


@pytest.mark.parametrize("digits", ["1000000000", "7" * 5000, "4096"])
def test_layer_index_from_a_tensor_name_is_bounded(tmp_path, digits):
    cfg = config("ct_fp8_kv")
    del cfg["num_hidden_layers"]  # no layer count: the bound is fp8kv's cap
    t = {**kv_scales({0: (0.5, 0.5)}), f"model.layers.{digits}.self_attn.k_scale": torch.tensor(0.5)}
    d = write_checkpoint(tmp_path / "m", cfg, t)
    with pytest.raises(InvalidArgument) as exc:
        within(10, lambda: fp8kv.resolve_kv_cache("fp8", d, "sm80"))
    msg = str(exc.value)
    assert f"model.layers.{digits[:12]}" in msg and "in model-00001-of-00001.safetensors: got layer" in msg
    assert "expected < 4096 (the config gives no layer count" in msg and len(msg) < 400
    # the e5m2 refusal path scans too
    with pytest.raises(InvalidArgument, match="got layer"):
        within(10, lambda: fp8kv.resolve_kv_cache("fp8_e5m2", d, "sm80"))


def test_layer_beyond_config_refused_even_for_q_scales(tmp_path):
    t = {**kv_scales(SCALES), "model.layers.4.self_attn.q_scale": torch.tensor(1.0)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(InvalidArgument, match=r"layers\.4\.self_attn\.q_scale in .*got layer 4, expected < "
                                              r"num_hidden_layers=4"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_oversized_scale_tensor_is_refused_from_the_header(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"))
    header = {"model.layers.0.self_attn.k_scale": {"dtype": "F32", "shape": [10**9], "data_offsets": [0, 4]}}
    write_safetensors_raw(d / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(InvalidArgument, match=r"k_scale in model\.safetensors: got shape \[1000000000\] "
                                              r"\(1000000000 elements\), expected .* at most 4096 elements; not read"):
        within(10, lambda: fp8kv.resolve_kv_cache("fp8", d, "sm80"))
    write_safetensors_raw(d / "model.safetensors", {"model.layers.0.self_attn.k_scale": {"shape": "x"}})
    with pytest.raises(InvalidArgument, match=r"k_scale in model\.safetensors: got the header entry"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


@pytest.mark.parametrize("what", ["length_huge", "length_past_end", "short", "not_object", "deep", "not_json"])
def test_malformed_safetensors_headers_are_refused(tmp_path, what):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"))
    f = d / "model.safetensors"
    match = {"length_huge": "header length of 18446744073709551615 bytes, expected at most 67108864",
             "length_past_end": "header length of 1000 bytes, expected .* within the file's",
             "short": "got 3 bytes, expected a safetensors file",
             "not_object": "header that is a JSON list",
             "deep": "got JSON nested 100000 levels deep, expected at most 64",
             "not_json": "cannot read it as JSON"}[what]
    if what == "length_huge":
        write_safetensors_raw(f, b"{}", length=2**64 - 1)
    elif what == "length_past_end":
        write_safetensors_raw(f, b"{}", length=1000)
    elif what == "short":
        f.write_bytes(b"abc")
    elif what == "not_object":
        write_safetensors_raw(f, b"[]")
    elif what == "deep":
        write_safetensors_raw(f, b"[" * 100000 + b"]" * 100000)
    else:
        write_safetensors_raw(f, b"{not json")
    with pytest.raises(InvalidArgument, match=match) as exc:
        within(10, lambda: fp8kv.resolve_kv_cache("fp8", d, "sm80"))
    assert str(f) in str(exc.value)


def test_deeply_nested_or_huge_config_json_is_refused(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("none"))
    (d / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(InvalidArgument, match=r"config\.json: got JSON nested 100000 levels deep, expected at most 64"):
        within(10, lambda: fp8kv.resolve_kv_cache("fp8", d, "sm80"))
    deep: dict = {}
    node = deep
    for _ in range(62):  # 64 levels with the outer object and 'extra': accepted
        node["x"] = {}
        node = node["x"]
    (d / "config.json").write_text(json.dumps({**config("none"), "extra": deep}))
    assert fp8kv.resolve_kv_cache("fp8", d, "sm80").num_layers == LAYERS
    node["x"] = {}  # 65
    (d / "config.json").write_text(json.dumps({**config("none"), "extra": deep}))
    with pytest.raises(InvalidArgument, match="nested 65 levels deep"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    # escapes and unterminated strings: refused in linear time, not a quadratic scan
    for text in ('{"a": "' + '\\"' * 2_000_000, '"' + "\\\\" * 2_000_000 + "\\", '["' + '\\"[' * 2_000_000):
        (d / "config.json").write_text(text)
        with pytest.raises(InvalidArgument, match=r"config\.json: cannot read it as JSON"):
            within(10, lambda: fp8kv.resolve_kv_cache("fp8", d, "sm80"))
    # brackets inside strings do not count
    (d / "config.json").write_text(json.dumps({**config("none"), "note": "[{" * 1000 + '\\"]'}))
    assert fp8kv.resolve_kv_cache("fp8", d, "sm80").num_layers == LAYERS
    with open(d / "config.json", "wb") as f:  # sparse: 16 MiB + 1 without writing it
        f.truncate(16 * 2**20 + 1)
    with pytest.raises(InvalidArgument, match=r"config\.json: got 16777217 bytes, expected .* at most 16777216 bytes"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match=r"config\.json: got a JSON list, expected"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")


@needs_fifo
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "hf_quant_config.json"])
def test_fifo_in_a_model_directory_is_refused_without_opening_it(tmp_path, name):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), kv_scales(SCALES))
    target = d / name
    if target.exists():
        target.unlink()
    if name == "model.safetensors":
        target = d / "model-00001-of-00001.safetensors"
        target.unlink()
    os.mkfifo(target)
    with pytest.raises(InvalidArgument) as exc:
        within(5, lambda: fp8kv.resolve_kv_cache("fp8", d, "sm80"), fifos=(target,))
    assert f"{target}: got a FIFO, expected" in str(exc.value) and "not opened" in str(exc.value)


@needs_fifo
def test_fifo_as_the_checkpoint_and_in_fp8kv_plan(tmp_path, capsys):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"))
    os.mkfifo(d / "model.safetensors")
    with pytest.raises(InvalidArgument, match="got a FIFO"):
        within(5, lambda: fp8kv.resolve_kv_cache("fp8", fifo, "sm80"), fifos=(fifo,))
    rc = within(5, lambda: cli_main(["plan", str(d), "--kv-cache-dtype", "fp8", "--simulate", "sm80"]),
                fifos=(d / "model.safetensors",))
    out = capsys.readouterr().out
    assert rc == REFUSED and "REFUSED" in out and f"{d / 'model.safetensors'}: got a FIFO" in out


def test_directory_or_dangling_link_named_safetensors_is_refused(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"))
    (d / "model.safetensors").mkdir()
    with pytest.raises(InvalidArgument, match=r"model\.safetensors: got a directory, expected a safetensors file"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    (d / "model.safetensors").rmdir()
    (d / "model.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(InvalidArgument, match=r"model\.safetensors: not found \(a dangling symlink\)"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    (d / "model.safetensors").unlink()
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(InvalidArgument, match=r"config\.json: got a directory"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_hub_cache_symlinks_are_followed(tmp_path):
    src = write_checkpoint(tmp_path / "src", config("ct_fp8_kv"), kv_scales(SCALES))
    blobs = tmp_path / "hub" / "blobs"
    snap = tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        (src / f.name).rename(blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    plan = fp8kv.resolve_kv_cache("fp8", snap, "sm80")
    assert plan.loaded_layers == (0, 1, 2, 3) and float(plan.v_scales[1]) == 2.0
    assert fp8kv.resolve_kv_cache("fp8", snap / "config.json", "sm80").scale_source == "checkpoint"


# -- no pickle, ever ------------------------------------------------------------------------------------

CHECKPOINT_SOURCES = sorted((Path(fp8kv.__file__).parent / "checkpoint").glob("*.py"))
UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


@pytest.mark.parametrize("path", CHECKPOINT_SOURCES, ids=lambda p: p.name)
def test_checkpoint_modules_never_unpickle(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & UNPICKLERS, (path.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in UNPICKLERS, (path.name, node.lineno)
            assert not (node.module == "torch" and any(a.name == "load" for a in node.names)), path.name
        elif isinstance(node, ast.Attribute) and node.attr in ("load", "loads", "Unpickler"):
            base = node.value
            assert not (isinstance(base, ast.Name) and base.id in {"torch", "np", "numpy"} | UNPICKLERS), (
                path.name, node.lineno, ast.unparse(node))


def test_pickles_beside_the_config_are_never_loaded(tmp_path, monkeypatch):
    class Boom:
        def __reduce__(self):
            return (os.system, ("false",))

    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"))
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    torch.save({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, d / "scales.pt")

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    with pytest.raises(fp8kv.Fp8KVError, match="calibrated for fp8_e4m3"):  # judged on the config alone
        fp8kv.resolve_kv_cache("fp8_e5m2", d, "sm80")
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert not plan.scales_loaded
    assert any("pytorch_model.bin, scales.pt not inspected" in w for w in plan.warnings)
