"""vLLM's and SGLang's KV-scales JSON (``quantization_param_path``) as a checkpoint.

``{"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {rank: {layer: s}}}}``
is loaded per layer for the named tensor-parallel rank (k = v = s, per-tensor, e4m3) or refused
naming the field; it is never planned as an unquantized model with 1.0 scales.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from checkpoint_fixtures import (  # _fake_backends: autouse, every test here sees only the fake backends
    LEGACY_SCALES,
    _fake_backends,  # noqa: F401
    config,
    legacy_kv_scales,
    within,
    write_checkpoint,
    write_json,
)

import fp8kv
from fp8kv.checkpoint.config import MAX_LAYERS
from fp8kv.checkpoint.legacy_scales import MAX_TP_RANKS
from fp8kv.errors import InvalidArgument

N_LAYERS = len(LEGACY_SCALES[0])



def f32(value: float) -> float:
    """``value`` as the float32 a scale tensor holds."""
    return float(torch.tensor(value, dtype=torch.float32))


def scaling_factor(obj: dict) -> dict:
    return obj["kv_cache"]["scaling_factor"]


# -- loaded --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_a_two_rank_file_loads_its_exact_scales(tmp_path, rank):
    path = write_json(tmp_path / "kv_cache_scales.json", legacy_kv_scales())
    plan = fp8kv.resolve_kv_cache("fp8", path, "sm90", tp_rank=rank)
    assert (plan.kv_dtype, plan.scale_granularity, plan.scale_source) == ("fp8_e4m3", "tensor", "checkpoint")
    assert plan.scales_loaded and plan.loaded_layers == tuple(range(N_LAYERS)) and plan.num_layers == N_LAYERS
    assert plan.calibrated_for == "fp8_e4m3" and plan.scale_factor == 1.0 and plan.backend == "nv"
    assert f"tensor-parallel rank {rank} of 2" in plan.checkpoint
    for layer, value in LEGACY_SCALES[rank].items():
        kwargs = plan.cache_kwargs(layer)
        assert set(kwargs) == {"kv_dtype", "scale_granularity", "layout", "k_scale", "v_scale"}
        assert (kwargs["kv_dtype"], kwargs["scale_granularity"], kwargs["layout"]) == ("fp8_e4m3", "tensor", "NHD")
        for scale in (kwargs["k_scale"], kwargs["v_scale"]):
            assert scale.dtype == torch.float32 and scale.shape == ()
            assert float(scale) == f32(value)
    assert plan.to_dict()["k_scales"] == {str(layer): f32(v) for layer, v in LEGACY_SCALES[rank].items()}


def test_the_plan_allocates_a_cache_per_layer_with_the_files_scales(tmp_path):
    path = write_json(tmp_path / "scales.json", legacy_kv_scales())
    plan = fp8kv.resolve_kv_cache("auto", path, "cpu", tp_rank=1)
    for layer, value in LEGACY_SCALES[1].items():
        cache = fp8kv.KVCache.allocate(2, 8, 2, 64, **plan.cache_kwargs(layer))
        assert cache.kv_dtype == "fp8_e4m3" and cache.scale_granularity == "tensor"
        assert float(cache.k_scale) == float(cache.v_scale) == f32(value)


def test_a_one_rank_file_loads_without_a_rank_and_a_dict_plans_as_the_file(tmp_path):
    one = legacy_kv_scales({0: LEGACY_SCALES[0]})
    from_file = fp8kv.resolve_kv_cache("fp8", write_json(tmp_path / "one.json", one), "sm80")
    from_dict = fp8kv.resolve_kv_cache("fp8", one, "sm80", tp_rank=0)
    for plan in (from_file, from_dict):
        assert plan.scale_source == "checkpoint"
        assert {layer: float(s) for layer, s in plan.k_scales.items()} == {
            layer: f32(v) for layer, v in LEGACY_SCALES[0].items()}
        assert {layer: float(s) for layer, s in plan.v_scales.items()} == {
            layer: f32(v) for layer, v in LEGACY_SCALES[0].items()}
    with pytest.raises(InvalidArgument, match=r"tp_rank: got 1, expected 0 or None"):
        fp8kv.resolve_kv_cache("fp8", one, "sm80", tp_rank=1)


def test_auto_picks_e4m3_and_gfx942_doubles_the_scales_as_vllm_does_on_rocm(tmp_path):
    path = write_json(tmp_path / "scales.json", legacy_kv_scales())
    plan = fp8kv.resolve_kv_cache("auto", path, "gfx942", tp_rank=0)
    assert plan.kv_dtype == "fp8_e4m3fnuz" and plan.scale_factor == 2.0
    assert float(plan.cache_kwargs(3)["k_scale"]) == f32(LEGACY_SCALES[0][3]) * 2
    assert float(plan.cache_kwargs(3)["v_scale"]) == f32(LEGACY_SCALES[0][3]) * 2
    auto = fp8kv.resolve_kv_cache("auto", path, "sm90", tp_rank=0)
    assert auto.kv_dtype == "fp8_e4m3" and auto.scale_source == "checkpoint"


def test_e5m2_is_refused_for_scales_calibrated_for_e4m3(tmp_path):
    path = write_json(tmp_path / "scales.json", legacy_kv_scales())
    with pytest.raises(fp8kv.Fp8KVError, match="calibrated for fp8_e4m3"):
        fp8kv.resolve_kv_cache("fp8_e5m2", path, "sm80", tp_rank=0)


# -- the rank ------------------------------------------------------------------------------------------

def test_a_file_with_several_ranks_requires_the_rank_by_name(tmp_path):
    path = write_json(tmp_path / "scales.json", legacy_kv_scales())
    with pytest.raises(InvalidArgument, match=r"tp_rank: got None, expected the tensor-parallel rank .* ranks \(0-1\)"):
        fp8kv.resolve_kv_cache("fp8", path, "sm80")
    with pytest.raises(InvalidArgument, match=r"tp_rank: got 2, expected a rank in .*: 0-1"):
        fp8kv.resolve_kv_cache("fp8", path, "sm80", tp_rank=2)


@pytest.mark.parametrize("bad", [-1, True, 1.0, "0"])
def test_tp_rank_of_the_wrong_type_is_refused(bad):
    with pytest.raises(InvalidArgument, match=r"tp_rank: got .*, expected None or a tensor-parallel rank"):
        fp8kv.resolve_kv_cache("fp8", legacy_kv_scales(), "sm80", tp_rank=bad)


def test_tp_rank_is_refused_for_checkpoints_without_per_rank_scales(tmp_path):
    with pytest.raises(InvalidArgument, match=r"tp_rank: got 0, expected None: only a KV-scales JSON"):
        fp8kv.resolve_kv_cache("fp8", config("ct_fp8_kv"), "sm80", tp_rank=0)


# -- refused, naming the field ---------------------------------------------------------------------------

def _missing_layer() -> dict:
    obj = legacy_kv_scales()
    del scaling_factor(obj)["1"]["2"]
    return obj


def _missing_last_layer() -> dict:
    obj = legacy_kv_scales()
    del scaling_factor(obj)["0"]["3"]
    return obj


def _missing_rank() -> dict:
    obj = legacy_kv_scales({0: LEGACY_SCALES[0], 1: LEGACY_SCALES[1], 2: LEGACY_SCALES[1]})
    del scaling_factor(obj)["1"]
    return obj


def _value(rank: int, layer: int, value: object) -> dict:
    obj = legacy_kv_scales()
    scaling_factor(obj)[str(rank)][str(layer)] = value
    return obj


def _kv_cache(value: object) -> dict:
    obj = legacy_kv_scales()
    obj["kv_cache"] = value
    return obj


def _scaling_factor(value: object) -> dict:
    obj = legacy_kv_scales()
    obj["kv_cache"]["scaling_factor"] = value
    return obj


def _no_dtype() -> dict:
    obj = legacy_kv_scales()
    del obj["kv_cache"]["dtype"]
    return obj


RANK_LAYER = r'kv_cache\.scaling_factor\."{}"\."{}" \(tp rank {}, layer {}\)'
NOT_A_SCALE = r"expected a finite scale >= 2\^-126"
REFUSED: list[tuple[str, dict, str]] = [
    ("missing layer", _missing_layer(),
     r'kv_cache\.scaling_factor\."1" \(tp rank 1\): got layers 0-1, 3, .*layer 2 missing in tp rank 1'),
    ("missing last layer", _missing_last_layer(),
     r'kv_cache\.scaling_factor\."0" \(tp rank 0\): got layers 0-2, .*layer 3 missing in tp rank 0'),
    ("missing rank", _missing_rank(), r"kv_cache\.scaling_factor: got ranks 0, 2, expected ranks 0-1 .*rank 1 missing"),
    ("e5m2 dtype", legacy_kv_scales(dtype="float8_e5m2"),
     r"kv_cache\.dtype: got 'float8_e5m2' \(str\), expected 'float8_e4m3fn'"),
    ("fnuz dtype", legacy_kv_scales(dtype="float8_e4m3fnuz"),
     r"kv_cache\.dtype: got 'float8_e4m3fnuz' \(str\), expected 'float8_e4m3fn'"),
    ("no dtype", _no_dtype(), r"kv_cache\.dtype: got nothing \(missing or null\), expected 'float8_e4m3fn'"),
    ("nan", _value(1, 3, math.nan), RANK_LAYER.format(1, 3, 1, 3) + r": got nan, " + NOT_A_SCALE),
    ("inf", _value(0, 2, math.inf), RANK_LAYER.format(0, 2, 0, 2) + r": got inf, " + NOT_A_SCALE),
    ("float32 overflow", _value(1, 0, 1e39), RANK_LAYER.format(1, 0, 1, 0) + r": got 1e\+39, " + NOT_A_SCALE),
    ("huge int", _value(1, 0, 10**400), RANK_LAYER.format(1, 0, 1, 0) + r": got 1000.*, " + NOT_A_SCALE),
    ("negative", _value(1, 1, -0.02), RANK_LAYER.format(1, 1, 1, 1) + r": got -0\.02, " + NOT_A_SCALE),
    ("zero", _value(0, 0, 0), RANK_LAYER.format(0, 0, 0, 0) + r": got 0, " + NOT_A_SCALE),
    ("subnormal", _value(0, 1, 1e-40), RANK_LAYER.format(0, 1, 0, 1) + r": got 1e-40, " + NOT_A_SCALE),
    ("string scale", _value(0, 1, "0.02"), RANK_LAYER.format(0, 1, 0, 1) + r": got '0\.02' \(str\), expected a number"),
    ("bool scale", _value(0, 1, True), RANK_LAYER.format(0, 1, 0, 1) + r": got True \(bool\), expected a number"),
    ("kv_cache a list", _kv_cache([0.02]), r"kv_cache: got \[0\.02\] \(list\), expected an object with dtype and "),
    ("kv_cache null", _kv_cache(None), r"kv_cache: got None \(NoneType\), expected an object with dtype and "),
    ("no scaling_factor", _scaling_factor(None),
     r"kv_cache\.scaling_factor: got nothing \(missing or null\), expected an object of ranks"),
    ("scaling_factor a list", _scaling_factor([{"0": 0.1}]),
     r"kv_cache\.scaling_factor: got \[\{'0': 0\.1\}\] \(list\), expected a JSON object"),
    ("empty scaling_factor", _scaling_factor({}), r"kv_cache\.scaling_factor: got an empty object"),
    ("no rank level", _scaling_factor({"0": 0.02, "1": 0.03}),
     r'kv_cache\.scaling_factor\."0" \(tp rank 0\): got 0\.02 \(float\), expected an object of layer scales'),
    ("empty rank", _scaling_factor({"0": {}}), r'kv_cache\.scaling_factor\."0" \(tp rank 0\): got an empty object'),
    ("rank key", _scaling_factor({"rank0": {"0": 0.1}}),
     r"kv_cache\.scaling_factor: got the key 'rank0' \(str\), expected rank keys that are decimal integers"),
    ("layer key", _scaling_factor({"0": {"layers.0": 0.1}}),
     r"kv_cache\.scaling_factor\.\"0\" \(tp rank 0\): got the key 'layers\.0' \(str\), expected layer keys"),
    ("padded layer key", _scaling_factor({"0": {"0": 0.1, "01": 0.2}}),
     r"got the key '01' \(str\), expected layer keys that are decimal integers"),
    ("model_type", legacy_kv_scales(model_type=["llama"]),
     r"model_type: got \['llama'\] \(list\), expected a string"),
]


@pytest.mark.parametrize(("label", "obj", "match"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_malformed_file_is_refused_naming_the_field(tmp_path, label, obj, match):
    path = write_json(tmp_path / "scales.json", obj)
    for checkpoint in (path, obj):
        for rank in (0, 1):
            with pytest.raises(InvalidArgument, match=match):
                fp8kv.resolve_kv_cache("fp8", checkpoint, "sm80", tp_rank=rank)


def test_the_file_is_named_in_the_message(tmp_path):
    path = write_json(tmp_path / "scales.json", _value(1, 3, -1.0))
    with pytest.raises(InvalidArgument, match=f"{path}: " + RANK_LAYER.format(1, 3, 1, 3)):
        fp8kv.resolve_kv_cache("fp8", path, "sm80", tp_rank=0)


def test_a_double_that_overflows_on_gfx942_is_refused_naming_rank_and_layer(tmp_path):
    obj = _value(1, 2, 3e38)
    assert fp8kv.resolve_kv_cache("fp8", obj, "sm90", tp_rank=1).scale_source == "checkpoint"
    with pytest.raises(InvalidArgument, match=RANK_LAYER.format(1, 2, 1, 2) + r": scale 3e\+38 x 2 overflows"):
        fp8kv.resolve_kv_cache("fp8", obj, "gfx942", tp_rank=1)


def test_a_huge_rank_or_layer_index_is_refused_without_looping_up_to_it():
    with pytest.raises(InvalidArgument, match=r"got ranks 999999999, expected ranks 0-0 .*rank 0 missing"):
        fp8kv.resolve_kv_cache("fp8", _scaling_factor({"999999999": {"0": 0.1}}), "sm80")
    with pytest.raises(InvalidArgument, match=r"kv_cache\.scaling_factor: got layer 999999999, expected layers below"):
        fp8kv.resolve_kv_cache("fp8", _scaling_factor({"0": {"999999999": 0.1}}), "sm80")


def test_a_caller_dict_with_int_keys_loads_but_a_key_given_twice_is_refused():
    ints = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {0: {0: 0.5, 1: 0.25}}}}
    plan = fp8kv.resolve_kv_cache("fp8", ints, "sm80")
    assert [float(plan.k_scales[i]) for i in (0, 1)] == [0.5, 0.25]
    twice = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {0: {0: 0.5, "0": 0.25}}}}
    with pytest.raises(InvalidArgument, match=r"got layer 0 twice .*, expected one entry per layer"):
        fp8kv.resolve_kv_cache("fp8", twice, "sm80")


def test_more_ranks_or_layers_than_the_bounds_are_refused_by_count(tmp_path):
    ranks = _scaling_factor({str(r): {"0": 0.1} for r in range(MAX_TP_RANKS + 1)})
    with pytest.raises(InvalidArgument, match=rf"scaling_factor: got {MAX_TP_RANKS + 1} ranks, expected at most"):
        fp8kv.resolve_kv_cache("fp8", write_json(tmp_path / "ranks.json", ranks), "sm80", tp_rank=0)
    layers = _scaling_factor({"0": {str(i): 0.1 for i in range(MAX_LAYERS + 1)}})
    with pytest.raises(InvalidArgument, match=rf"got {MAX_LAYERS + 1} layers, expected at most {MAX_LAYERS}"):
        fp8kv.resolve_kv_cache("fp8", layers, "sm80")


# -- other JSON that carries KV scales -----------------------------------------------------------------

@pytest.mark.parametrize(("obj", "key"), [
    ({"scaling_factor": {"0": {"0": 0.0123}}}, "scaling_factor"),
    ({"model.layers.0.self_attn.k_scale": 0.1, "model.layers.0.self_attn.v_scale": 0.2},
     "model.layers.0.self_attn.k_scale"),
    ({"kv": {"scaling_factor": [0.1, 0.2]}}, "kv.scaling_factor"),
    ({"layers": [{"kv_cache_scale": 0.1}]}, "layers.0.kv_cache_scale"),
    ({**config("none"), "kv_scales": {"0": 0.1}}, "kv_scales"),
], ids=["scaling_factor", "k_scale", "kv.scaling_factor", "kv_cache_scale", "config with kv_scales"])
def test_an_unknown_json_with_kv_scales_is_refused_not_planned_unquantized(tmp_path, obj, key):
    path = write_json(tmp_path / "other.json", obj)
    for checkpoint in (path, obj):
        with pytest.raises(InvalidArgument, match=rf"KV-scale-like keys \({key}.*not planned as unquantized"):
            fp8kv.resolve_kv_cache("fp8", checkpoint, "sm80")


def test_configs_without_kv_scales_still_plan_default_scales(tmp_path):
    rope = {**config("none"), "rope_scaling": {"type": "yarn", "factor": 4.0, "scaling_factor": 4.0}}
    vision = {**config("none"), "vision_config": {"scaling_factor": 0.5}}
    for obj in (config("none"), config("awq"), rope, vision):
        plan = fp8kv.resolve_kv_cache("fp8", write_json(tmp_path / "config.json", obj), "sm80")
        assert plan.scale_source == "default" and plan.num_layers == 4


def test_a_cyclic_or_deep_dict_is_inspected_quickly():
    cyclic: dict = {"num_hidden_layers": 2}
    cyclic["self"] = {"again": cyclic}
    deep: dict = {"num_hidden_layers": 2}
    node = deep
    for _ in range(50_000):
        node["next"] = {}
        node = node["next"]
    for obj in (cyclic, deep):
        plan = within(5.0, lambda obj=obj: fp8kv.resolve_kv_cache("fp8", obj, "sm80"))
        assert plan.scale_source == "default"


# -- in a model directory ----------------------------------------------------------------------------

def test_a_directory_says_it_did_not_read_a_kv_scales_json_beside_the_config(tmp_path):
    d = write_checkpoint(tmp_path / "m", config("none"))
    write_json(d / "kv_cache_scales.json", legacy_kv_scales())
    plan = fp8kv.resolve_kv_cache("fp8", d, "sm80")
    assert any("kv_cache_scales.json in the directory was not read" in w for w in plan.warnings)
    loaded = fp8kv.resolve_kv_cache("fp8", d / "kv_cache_scales.json", "sm80", tp_rank=1)
    assert float(loaded.k_scales[0]) == f32(LEGACY_SCALES[1][0])


def test_a_kv_scales_json_as_a_directorys_config_is_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(legacy_kv_scales()))
    with pytest.raises(InvalidArgument, match=r"config\.json: got a KV-scales JSON .*expected the model's config"):
        fp8kv.resolve_kv_cache("fp8", d, "sm80", tp_rank=0)


def test_the_plan_describes_where_the_scales_came_from(tmp_path):
    path = write_json(tmp_path / "scales.json", legacy_kv_scales())
    text = fp8kv.resolve_kv_cache("fp8", path, "sm80", tp_rank=1).describe()
    assert "vLLM/SGLang KV-scales JSON (model_type 'llama', float8_e4m3fn, tensor-parallel rank 1 of 2)" in text
    assert "tensor-parallel rank 1's scaling_factor of each layer is both its k and v scale" in text
    assert "layers 0-3: k and v as stored" in text and "default 1.0" not in text


def test_the_original_object_is_not_modified():
    obj = legacy_kv_scales()
    before = copy.deepcopy(obj)
    fp8kv.resolve_kv_cache("fp8", obj, "sm80", tp_rank=1)
    assert obj == before
