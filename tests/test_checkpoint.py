"""KV-cache policy from checkpoints: fp8kv.resolve_kv_cache, KVCachePlan, ``fp8kv plan``.

Backends are fakes registered per test (``any``: slow, serves everything everywhere,
like the reference; ``nv``: NVIDIA sm80+ OCP formats; ``rocm``: gfx942 fnuz formats),
so the expected ``backend`` does not depend on which real backends are installed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import (
    KV_HEADS,
    LAYERS,
    QUANT,
    config,
    fake_any,
    fake_nv,
    fake_nv_fnuz,
    fake_rocm,
    install,
    kv_scales,
    write_checkpoint,
)

import fp8kv
from fp8kv.checkpoint import tensors as tensors_mod
from fp8kv.cli import main as cli_main
from fp8kv.registry import reset_registry

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "checkpoints"


@pytest.fixture(autouse=True)
def _fake_backends(monkeypatch):
    for var in ("FP8KV_BACKEND", "FP8KV_SIMULATE_DEVICE", "FP8KV_STRICT"):
        monkeypatch.delenv(var, raising=False)
    install(fake_any(), fake_nv(), fake_rocm())
    yield
    reset_registry()


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
    with fp8kv.simulate_device("gfx942"):
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
    with pytest.raises(fp8kv.Fp8KVError, match="kv_cache_scheme.strategy is 'channel'"):
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


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_bad_scale_values_name_tensor_and_file(tmp_path, value):
    t = {**kv_scales(SCALES), "model.layers.2.self_attn.k_scale": torch.tensor(value, dtype=torch.bfloat16)}
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    with pytest.raises(fp8kv.Fp8KVError) as exc:
        fp8kv.resolve_kv_cache("fp8", d, "sm80")
    msg = str(exc.value)
    assert "model.layers.2.self_attn.k_scale in model-00001-of-00001.safetensors" in msg
    assert "expected finite scales > 0" in msg


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
    with pytest.raises(fp8kv.Fp8KVError, match="k_scale in .*expected finite scales > 0"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80")


def test_missing_layers_default_with_one_warning(tmp_path):
    t = kv_scales({0: (0.5, 0.5), 2: (0.25, 0.25)})
    del t["model.layers.2.self_attn.v_scale"]
    d = write_checkpoint(tmp_path / "m", config("ct_fp8_kv"), t)
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert plan.loaded_layers == (0,) and plan.defaulted_layers == (1, 2, 3)
    assert float(plan.k_scales[2]) == 0.25 and float(plan.v_scales[2]) == 1.0
    assert float(plan.k_scales[3]) == 1.0
    assert len(plan.warnings) == 1
    assert plan.warnings[0].startswith("no KV scales in the checkpoint for layers 1-3 (k missing: 1, 3; "
                                       "v missing: 1-3); those use 1.0 - uncalibrated KV scales (1.0) with "
                                       "fp8_e4m3: |K|, |V| above 448 saturate")
    e5 = write_checkpoint(tmp_path / "e5", config("quark_kv_e5m2"), t)
    assert fp8kv.resolve_kv_cache("fp8_e5m2", e5, "sm80").warnings == (
        "no KV scales in the checkpoint for layers 1-3 (k missing: 1, 3; v missing: 1-3); those use 1.0",)
    assert "defaulted (1.0) layers 1-3" in plan.describe()


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
    cache = fp8kv.KVCache.allocate(4, 16, KV_HEADS, 64, plan=plan, layer=1)
    assert cache.kv_dtype == "fp8_e4m3fnuz" and cache.scale_granularity == "tensor"
    assert float(cache.k_scale) == 0.25 and float(cache.v_scale) == 4.0
    same = fp8kv.KVCache.allocate(4, 16, KV_HEADS, 64, plan=plan, layer=1, kv_dtype="fp8_e4m3fnuz",
                                  k_scale=0.25)
    assert float(same.k_scale) == 0.25
    for kwargs, match in (({"kv_dtype": "fp8_e4m3"}, "kv_dtype: got 'fp8_e4m3', expected 'fp8_e4m3fnuz'"),
                          ({"scale_granularity": "head"}, "scale_granularity: got 'head'"),
                          ({"k_scale": 0.5}, r"k_scale: got 0.5, expected None or the plan's 0.25"),
                          ({"layer": None}, "layer: got None, expected the layer index"),
                          ({"layer": 9}, "layer: got 9")):
        with pytest.raises(fp8kv.Fp8KVError, match=match):
            fp8kv.KVCache.allocate(4, 16, KV_HEADS, 64, plan=plan, **{"layer": 1, **kwargs})


def test_allocate_from_default_dynamic_and_refusing_plans():
    default = fp8kv.resolve_kv_cache("fp8_e5m2", config("awq"), "sm80")
    cache = fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, plan=default)
    assert cache.kv_dtype == "fp8_e5m2" and float(cache.k_scale) == 1.0
    dyn = fp8kv.resolve_kv_cache("auto", config("ct_kv_dynamic"), "sm80")
    cache = fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, plan=dyn, layer=0)
    assert cache.scale_granularity == "token_head" and cache.k_scale.shape == (2, 8, KV_HEADS)
    with pytest.raises(fp8kv.Fp8KVError, match="expected None"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, plan=dyn, k_scale=1.0)
    with pytest.raises(fp8kv.Fp8KVError, match="plan: got a plan with kv_dtype 'auto'"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, plan=fp8kv.resolve_kv_cache("auto", None, "sm80"))
    config_only = fp8kv.resolve_kv_cache("fp8", config("ct_fp8_kv"), "sm80")
    with pytest.raises(fp8kv.Fp8KVError, match="planned from a config alone"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, plan=config_only, layer=0)
    plain = fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64)  # defaults unchanged without a plan
    assert plain.kv_dtype == "fp8_e4m3" and plain.scale_granularity == "tensor"
    with pytest.raises(fp8kv.Fp8KVError, match="layer: got 0, expected None without a plan"):
        fp8kv.KVCache.allocate(2, 8, KV_HEADS, 64, layer=0)


def test_plan_scales_drive_the_reference_write(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("ct_kv_head"), {
        **{f"model.layers.{i}.self_attn.k_scale": torch.tensor([0.5, 0.25]) for i in range(LAYERS)},
        **{f"model.layers.{i}.self_attn.v_scale": torch.tensor([2.0, 4.0]) for i in range(LAYERS)}})
    plan = fp8kv.resolve_kv_cache("fp8", d, "cpu")
    reset_registry()  # the real registry (the reference) runs the write
    cache = fp8kv.KVCache.allocate(2, 4, KV_HEADS, 8, plan=plan, layer=2)
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, KV_HEADS, 8, generator=g), torch.randn(3, KV_HEADS, 8, generator=g)
    fp8kv.write_kv(cache, key, value, torch.tensor([0, 1, 5]), backend="reference")
    want = fp8kv.quantize(key, "fp8_e4m3", torch.tensor([0.5, 0.25])[:, None])
    assert torch.equal(cache.key_cache.view(torch.uint8)[0, :2], want[:2].view(torch.uint8))


# -- describe / to_dict / the CLI -----------------------------------------------------------------------

def test_describe_and_json():
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", config("ct_w4a16"), "sm80")
    text = plan.describe()
    assert "kv_dtype      fp8_e5m2  (allowed)" in text
    assert "compressed-tensors W4A16 (weight-only, no kv_cache_scheme)" in text
    assert "default 1.0, per-tensor for 4 layers" in text and "backend       nv" in text
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
    assert rc == 2 and "REFUSED" in out and "calibrated for fp8_e4m3" in out and "Use fp8_e4m3 or fp8" in out
    rc = cli_main(["plan", str(EXAMPLES / "llama-fp8-kv"), "--kv-cache-dtype", "fp8", "--simulate", "gfx942",
                   "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["kv_dtype"] == "fp8_e4m3fnuz" and data["scale_factor"] == 2.0
    assert data["loaded_layers"] == list(range(32)) and data["backend"] == "rocm"
    rc = cli_main(["plan", str(EXAMPLES / "llama-fp8-kv" / "config.json"), "--kv-cache-dtype", "fp8_e5m2",
                   "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 2 and data["refused"] and "calibrated for fp8_e4m3" in data["reason"]


def test_real_registry_plans_the_examples():
    reset_registry()  # whatever backends are installed; the reference serves everything
    plan = fp8kv.resolve_kv_cache("fp8_e5m2", EXAMPLES / "llama-w4a16", "sm80")
    assert plan.kv_dtype == "fp8_e5m2" and plan.backend in fp8kv.available_backends()
    with pytest.raises(fp8kv.Fp8KVError, match="calibrated for fp8_e4m3"):
        fp8kv.resolve_kv_cache("fp8_e5m2", EXAMPLES / "llama-fp8-kv", "sm80")
