"""Synthetic checkpoint configs, scale files and fake backends for tests/test_checkpoint.py.

The configs follow the public ``config.json`` formats (field names as the producers
write them): compressed-tensors, FP8, ModelOpt, Quark, AWQ, GPTQ, bitsandbytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fp8kv
from fp8kv.plugins import BackendInfo, Request, hookimpl
from fp8kv.probe import DeviceInfo
from fp8kv.registry import reset_registry

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64
GEOMETRY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "torch_dtype": "bfloat16",
}


def _ct_group(weights: dict, inputs: dict | None = None) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                        "output_activations": None}}


_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
         "dynamic": False}
_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
_FP8_A = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def _kv(strategy: str = "tensor", dynamic: bool = False) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic}


def _ct(groups: dict, kv: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "config_groups": groups, "ignore": ["lm_head"],
            "kv_cache_scheme": kv}


def _quark(kv_dtype: str | None) -> dict:
    fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True,
           "observer_cls": "PerTensorMinMaxObserver", "round_method": "half_even"}
    layer_cfg, group = {}, []
    if kv_dtype is not None:
        out = {**fp8, "dtype": kv_dtype}
        layer_cfg = {"*k_proj": {"weight": fp8, "input_tensors": fp8, "output_tensors": out, "bias": None},
                     "*v_proj": {"weight": fp8, "input_tensors": fp8, "output_tensors": out, "bias": None}}
        group = ["*k_proj", "*v_proj"]
    return {"quant_method": "quark", "quant_mode": "eager_mode", "exclude": ["lm_head"],
            "global_quant_config": {"weight": fp8, "input_tensors": fp8, "output_tensors": None,
                                    "bias": None},
            "layer_quant_config": layer_cfg, "layer_type_quant_config": {},
            "export": {"kv_cache_group": group, "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None}}


QUANT: dict[str, dict | None] = {
    "none": None,
    "ct_w4a16": _ct(_ct_group(_INT4)),
    "ct_w8a16": _ct(_ct_group(_INT8)),
    "ct_fp8_kv": _ct(_ct_group(_FP8_W, _FP8_A), _kv()),
    "ct_kv_head": _ct(_ct_group(_FP8_W, _FP8_A), _kv("attn_head")),
    "ct_kv_dynamic": _ct(_ct_group(_FP8_W, _FP8_A), _kv(dynamic=True)),
    "fp8_static_kv": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
                      "kv_cache_scheme": "static"},
    "fp8_dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "modelopt_kv": {"quant_method": "modelopt", "producer": {"name": "modelopt", "version": "0.29.0"},
                    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                     "exclude_modules": ["lm_head"]}},
    "modelopt_flat_kv": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                         "kv_cache_scheme": _kv()},
    "modelopt_nokv": {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8",
                                                                   "kv_cache_quant_algo": None}},
    "modelopt_nvfp4_kv": {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4",
                                                                       "kv_cache_quant_algo": "NVFP4"}},
    "quark_kv": _quark("fp8_e4m3"),
    "quark_kv_e5m2": _quark("fp8_e5m2"),
    "quark_nokv": _quark(None),
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "damp_percent": 0.01},
    "bnb": {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_use_double_quant": True},
}
"""Each checkpoint kind's ``quantization_config`` (None: unquantized)."""


def config(kind: str, **overrides) -> dict:
    """A full ``config.json`` dict of the tiny test model with ``kind``'s quantization."""
    cfg = {**GEOMETRY, **overrides}
    if QUANT[kind] is not None:
        cfg["quantization_config"] = json.loads(json.dumps(QUANT[kind]))
    return cfg


def write_checkpoint(path: Path, cfg: dict, tensors: dict[str, torch.Tensor] | None = None,
                     shards: int = 1) -> Path:
    """Write ``config.json`` and the tensors (split over ``shards`` safetensors files)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if tensors:
        names = sorted(tensors)
        for i in range(shards):
            part = {n: tensors[n].contiguous() for n in names[i::shards]}
            if part:
                save_file(part, str(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    return path


def kv_scales(values: dict[int, tuple[float, float]], style: str = "ct",
              dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Scale tensors named in ``style`` for {layer: (k, v)} (``kv`` style uses k only)."""
    names = {
        "ct": ("self_attn.k_scale", "self_attn.v_scale"),
        "attn": ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
        "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
        "output": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
        "kv": ("self_attn.kv_scale", None),
    }[style]
    out = {}
    for layer, (k, v) in values.items():
        for name, val in zip(names, (k, v), strict=True):
            if name is not None:
                out[f"model.layers.{layer}.{name}"] = torch.full(shape, val, dtype=dtype)
    return out


# -- fake backends ------------------------------------------------------------------

OCP = ("fp8_e4m3", "fp8_e5m2")
FNUZ = ("fp8_e4m3fnuz", "fp8_e5m2fnuz")


class FakeBackend:
    """A backend that only answers ``fp8kv_supports`` (planning never runs kernels)."""

    def __init__(self, name: str, priority: int, fast: bool,
                 rule: Callable[[DeviceInfo, Request], str | None]) -> None:
        self.info = BackendInfo(name, "0.0-test", priority, f"fake {name}", fast=fast)
        self.rule = rule

    @hookimpl
    def fp8kv_backend_info(self) -> BackendInfo:
        return self.info

    @hookimpl
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        return self.rule(device, request)

    @hookimpl
    def fp8kv_write_kv(self, cache, key, value, slot_mapping) -> None:
        raise NotImplementedError

    @hookimpl
    def fp8kv_paged_attention(self, query, cache, metadata, out, lse) -> None:
        raise NotImplementedError


def any_rule(device: DeviceInfo, request: Request) -> str | None:
    return None


def nv_rule(device: DeviceInfo, request: Request) -> str | None:
    if device.vendor != "nvidia" or (device.sm or 0) < 80:
        return "needs NVIDIA sm80+"
    return None if request.kv_dtype in OCP else f"{request.kv_dtype} is not an OCP format"


def rocm_rule(device: DeviceInfo, request: Request) -> str | None:
    if device.arch != "gfx942":
        return "needs gfx942"
    return None if request.kv_dtype in FNUZ else f"{request.kv_dtype} is not a fnuz format"


def nv_fnuz_rule(device: DeviceInfo, request: Request) -> str | None:
    return None if device.vendor == "nvidia" and request.kv_dtype in FNUZ else "fnuz on NVIDIA only"


def fake_any() -> FakeBackend:
    return FakeBackend("any", 0, False, any_rule)


def fake_nv() -> FakeBackend:
    return FakeBackend("nv", 100, True, nv_rule)


def fake_rocm() -> FakeBackend:
    return FakeBackend("rocm", 100, True, rocm_rule)


def fake_nv_fnuz() -> FakeBackend:
    return FakeBackend("nvfnuz", 50, True, nv_fnuz_rule)


def install(*backends: FakeBackend) -> None:
    """Make ``backends`` the only registered ones (entry points are not loaded)."""
    reg = reset_registry()
    reg.loaded = True
    for b in backends:
        fp8kv.plugins.register_backend(b)


@pytest.fixture(autouse=True)
def _fake_backends(monkeypatch):
    """Autouse in the modules that import it: only the fake backends, no backend forced by the environment."""
    for var in ("FP8KV_BACKEND", "FP8KV_SIMULATE_DEVICE", "FP8KV_STRICT"):
        monkeypatch.delenv(var, raising=False)
    install(fake_any(), fake_nv(), fake_rocm())
    yield
    reset_registry()


# -- hostile inputs ------------------------------------------------------------------

def with_field(cfg: dict, path: str, value) -> dict:
    """A deep copy of ``cfg`` with the dotted ``path`` set to ``value`` (objects made as needed)."""
    out = json.loads(json.dumps(cfg))
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


HOSTILE_FIELDS: list[tuple[str, str, object, str]] = [
    # (quantization kind, dotted field path, value, what the message must say it expected)
    ("none", "num_hidden_layers", "32", "an int in [1, 4096]"),
    ("none", "num_hidden_layers", [32], "an int in [1, 4096]"),
    ("none", "num_hidden_layers", True, "an int in [1, 4096]"),
    ("none", "num_hidden_layers", 32.0, "an int in [1, 4096]"),
    ("none", "num_hidden_layers", 0, "an int in [1, 4096]"),
    ("none", "num_hidden_layers", 10**9, "an int in [1, 4096]"),
    ("none", "num_hidden_layers", {"n": 32}, "an int in [1, 4096]"),
    ("none", "num_key_value_heads", "8", "an int in [1, 4096]"),
    ("none", "num_key_value_heads", 10**6, "an int in [1, 4096]"),
    ("none", "num_attention_heads", False, "an int in [1, 4096]"),
    ("none", "head_dim", [64], "an int in [1, 4096]"),
    ("none", "head_dim", 10**5, "an int in [1, 4096]"),
    ("none", "hidden_size", "256", "an int in [1, 1048576]"),
    ("none", "torch_dtype", 16, "a string of at most 64 characters"),
    ("none", "torch_dtype", ["bfloat16"], "a string of at most 64 characters"),
    ("none", "quantization_config", "fp8", "a JSON object"),
    ("none", "quantization_config", ["fp8"], "a JSON object"),
    ("ct_fp8_kv", "quantization_config.quant_method", 5, "a string of at most 64 characters"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme", 8, "'static', 'dynamic' or an object"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme", ["float"], "'static', 'dynamic' or an object"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme", "sometimes", "'static', 'dynamic' or an object"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme.num_bits", "8", "an int in [1, 64]"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme.type", ["float"], "a string of at most 64 characters"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme.strategy", {"x": 1}, "a string of at most 64 characters"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme.dynamic", "yes", "true, false or 'local'"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme.dynamic", 1, "true, false or 'local'"),
    ("ct_fp8_kv", "quantization_config.kv_cache_scheme.symmetric", "no", "true or false"),
    ("ct_fp8_kv", "quantization_config.config_groups", ["group_0"], "a JSON object"),
    ("ct_fp8_kv", "quantization_config.config_groups.group_0", "Linear", "a JSON object"),
    ("ct_fp8_kv", "quantization_config.config_groups.group_0.weights", [8], "a JSON object"),
    ("ct_fp8_kv", "quantization_config.config_groups.group_0.weights.num_bits", "8", "an int in [1, 64]"),
    ("fp8_static_kv", "quantization_config.activation_scheme", 1, "a string of at most 64 characters"),
    ("modelopt_kv", "quantization_config.quantization", "FP8", "a JSON object"),
    ("modelopt_kv", "quantization_config.quantization.kv_cache_quant_algo", 8, "a string of at most 64 characters"),
    ("modelopt_kv", "quantization_config.quantization.quant_algo", ["FP8"], "a string of at most 64 characters"),
    ("quark_kv", "quantization_config.export", "x", "a JSON object"),
    ("quark_kv", "quantization_config.export.kv_cache_group", "*k_proj", "a list of at most 64 strings"),
    ("quark_kv", "quantization_config.export.kv_cache_group", [1, 2], "a list of at most 64 strings"),
    ("quark_kv", "quantization_config.layer_quant_config", ["*k_proj"], "a JSON object"),
    ("quark_kv", "quantization_config.layer_quant_config.*k_proj", "fp8", "a JSON object"),
    ("quark_kv", "quantization_config.layer_quant_config.*k_proj.output_tensors", [1], "a JSON object"),
    ("quark_kv", "quantization_config.layer_quant_config.*k_proj.output_tensors.is_dynamic", "no",
     "true or false"),
    ("quark_kv", "quantization_config.global_quant_config", 3, "a JSON object"),
    ("bnb", "quantization_config.load_in_4bit", "yes", "true or false"),
    ("gptq", "quantization_config.bits", "4", "a number in [0, 64]"),
]
"""Config fields of the wrong type or out of range; each must raise InvalidArgument naming the field."""


def write_safetensors_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file with exactly this header (and header length), for malformed inputs."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


_UNBLOCKER = """
import os, sys, time
time.sleep(float(sys.argv[1]))
for path in sys.argv[2:]:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
"""


def within(seconds: float, fn: Callable[[], object], fifos: tuple[Path, ...] = ()):
    """``fn()`` in a daemon thread: its result or exception, or a test failure if it takes longer.

    Guards tests of inputs that used to hang (a FIFO, a huge layer count) so that a
    regression fails the suite instead of hanging it. A thread blocked in ``open()`` on a
    FIFO may hold the GIL (safetensors' open does), so for ``fifos`` a separate process
    opens each for writing after ``seconds``, which releases any reader stuck on it.
    """
    import subprocess
    import sys
    import threading
    import time

    import pytest

    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    watchdog = (subprocess.Popen([sys.executable, "-I", "-S", "-c", _UNBLOCKER, str(seconds), *map(str, fifos)])
                if fifos else None)
    start = time.monotonic()
    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(seconds)
        took = time.monotonic() - start
    finally:
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
    if t.is_alive() or took >= seconds:
        pytest.fail(f"took {took:.1f}s (limit {seconds}s): it must refuse or finish, not block")
    if "error" in box:
        raise box["error"]
    return box.get("result")


# -- vLLM/SGLang KV-scales JSON (quantization_param_path) ------------------------------

LEGACY_SCALES: dict[int, dict[int, float]] = {
    0: {0: 0.0123, 1: 0.0201, 2: 0.0187, 3: 0.0342},
    1: {0: 0.0119, 1: 0.0215, 2: 0.0176, 3: 0.0338},
}
"""Per-tensor KV scales of a model with 2 tensor-parallel ranks and 4 layers: rank -> layer -> scale."""


def legacy_kv_scales(scales: dict[int, dict[int, float]] | None = None, dtype: object = "float8_e4m3fn",
                     model_type: object = "llama") -> dict:
    """A KV-scales JSON object shaped as vLLM and SGLang read it (string rank and layer keys)."""
    scales = LEGACY_SCALES if scales is None else scales
    return {"model_type": model_type,
            "kv_cache": {"dtype": dtype,
                         "scaling_factor": {str(rank): {str(layer): value for layer, value in layers.items()}
                                            for rank, layers in scales.items()}}}


def write_json(path: Path, obj: object) -> Path:
    """``obj`` as JSON at ``path`` (NaN and Infinity written as Python's json writes them)."""
    path.write_text(json.dumps(obj))
    return path
