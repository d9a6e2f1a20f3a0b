"""What a checkpoint's ``config.json`` declares about its KV cache.

Understands the public ``quantization_config`` formats of compressed-tensors
(``config_groups`` + ``kv_cache_scheme``), FP8 (``quant_method: fp8``, optional
``kv_cache_scheme``), NVIDIA ModelOpt (``quant_method: modelopt`` or an
``hf_quant_config.json`` with ``quantization.kv_cache_quant_algo``), AMD Quark
(``export.kv_cache_group`` + ``layer_quant_config[...].output_tensors``) and the
weight-only methods (AWQ, GPTQ, bitsandbytes, ...), plus unquantized configs.

Nothing here reads tensors; :mod:`fp8kv.checkpoint.tensors` does that.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from ..errors import Fp8KVError

WEIGHT_ONLY_METHODS = ("awq", "gptq", "bitsandbytes", "awq_marlin", "gptq_marlin", "marlin", "hqq",
                       "eetq", "aqlm", "torchao", "bitnet", "gguf", "exl2", "higgs", "vptq")
"""quant_methods that quantize weights only and never carry KV-cache scales."""

QUARK_DTYPES = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
"""Quark ``output_tensors.dtype`` values that are FP8 KV formats -> fp8kv format names."""


@dataclass(frozen=True)
class KVScheme:
    """The checkpoint's own KV-cache quantization, as its config declares it.

    Attributes:
        declared: the config says the checkpoint stores FP8 KV scales (or computes
            them dynamically): compressed-tensors ``kv_cache_scheme``, ModelOpt
            ``kv_cache_quant_algo: FP8``, Quark ``kv_cache_group``, or any FP8
            (``quant_method: fp8``) config.
        explicit: declared by a KV field (not only implied by ``quant_method: fp8``).
        calibrated_for: the format the scales were calibrated for (``fp8_e4m3``
            unless the config says otherwise).
        granularity: ``"tensor"``, ``"head"`` (compressed-tensors ``attn_head``) or
            ``"token_head"`` (dynamic).
        unsupported: a declared KV scheme that is not FP8 (``"NVFP4"``, ``"int8"``).
        field: where it was declared, for messages.
    """

    declared: bool = False
    explicit: bool = False
    calibrated_for: str | None = None
    granularity: str = "tensor"
    unsupported: str | None = None
    field: str | None = None

    @property
    def dynamic(self) -> bool:
        return self.granularity == "token_head"


@dataclass(frozen=True)
class CheckpointConfig:
    """A checkpoint config reduced to what KV planning needs.

    Attributes:
        quant_method: ``quantization_config.quant_method`` (lower case) or None.
        summary: one human line, e.g. ``"compressed-tensors W4A16 (weight-only)"``.
        kv: what it declares about the KV cache.
        num_layers / num_kv_heads / head_size: model geometry (None if absent).
        torch_dtype: the activation dtype name (``"bfloat16"``...), None if absent.
    """

    quant_method: str | None
    summary: str
    kv: KVScheme
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    torch_dtype: str | None = None


def quantization_config(config: dict) -> dict | None:
    """The quantization section of a full config, a bare quantization config, or an
    ``hf_quant_config.json`` (ModelOpt), normalised to a dict with ``quant_method``."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if qc is None and "quant_method" in config:
        qc = config
    if qc is None and isinstance(config.get("quantization"), dict):
        qc = {"quant_method": "modelopt", **config}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise Fp8KVError(f"checkpoint: quantization_config is {type(qc).__name__}, expected a JSON object")
    return qc


def _int(cfg: dict, *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def geometry(config: dict) -> tuple[int | None, int | None, int | None, str | None]:
    """``(num_layers, num_kv_heads, head_size, torch_dtype)`` of the language model."""
    text = config
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
    layers = _int(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(text, "num_attention_heads", "n_head")
    kv_heads = _int(text, "num_key_value_heads", "num_kv_heads", "n_head_kv") or heads
    head_size = _int(text, "head_dim")
    hidden = _int(text, "hidden_size", "n_embd")
    if head_size is None and hidden and heads and hidden % heads == 0:
        head_size = hidden // heads
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    return layers, kv_heads, head_size, dtype if isinstance(dtype, str) else None


def _float8_scheme(scheme: Any, field: str) -> KVScheme:
    """A compressed-tensors style ``kv_cache_scheme`` (dict) or ``"static"``/``"dynamic"``."""
    if isinstance(scheme, str):
        if scheme.lower() not in ("static", "dynamic"):
            raise Fp8KVError(f"checkpoint: {field} is {scheme!r}, expected 'static', 'dynamic' or an object")
        return KVScheme(True, True, "fp8_e4m3", "token_head" if scheme.lower() == "dynamic" else "tensor",
                        field=f"{field}={scheme!r}")
    if not isinstance(scheme, dict):
        raise Fp8KVError(f"checkpoint: {field} is {type(scheme).__name__}, expected an object")
    kind, bits = scheme.get("type", "float"), scheme.get("num_bits", 8)
    if kind != "float" or bits != 8:
        return KVScheme(True, True, None, unsupported=f"{kind}{bits}", field=field)
    strategy = scheme.get("strategy", "tensor")
    if scheme.get("dynamic") in (True, "local"):
        granularity = "token_head"
    elif strategy == "tensor":
        granularity = "tensor"
    elif strategy == "attn_head":
        granularity = "head"
    else:
        raise Fp8KVError(f"checkpoint: {field}.strategy is {strategy!r}, expected 'tensor' or 'attn_head'")
    if scheme.get("symmetric") is False:
        raise Fp8KVError(f"checkpoint: {field}.symmetric is false, expected symmetric FP8 KV scales")
    return KVScheme(True, True, "fp8_e4m3", granularity, field=f"{field} (float8, {strategy}"
                    + (", dynamic)" if granularity == "token_head" else ")"))


def _compressed_tensors(qc: dict) -> tuple[str, KVScheme]:
    names = []
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        if w:
            wt = "FP8" if w.get("type") == "float" and w.get("num_bits") == 8 else ""
            name = f"W{w.get('num_bits', '?')}A{a.get('num_bits', 16) if a else 16}"
            names.append(f"{name}-{wt}" if wt else name)
    kind = "/".join(sorted(set(names))) or "(no config_groups)"
    weight_only = bool(names) and all(n.split("A")[1].startswith("16") for n in names)
    scheme = qc.get("kv_cache_scheme")
    if scheme is None:
        tail = " (weight-only, no kv_cache_scheme)" if weight_only else " (no kv_cache_scheme)"
        return f"compressed-tensors {kind}{tail}", KVScheme()
    return f"compressed-tensors {kind}", _float8_scheme(scheme, "kv_cache_scheme")


def _fp8(qc: dict) -> tuple[str, KVScheme]:
    act = qc.get("activation_scheme", "dynamic")
    scheme = qc.get("kv_cache_scheme")
    summary = f"FP8 (activation_scheme={act})"
    if scheme is not None:
        return summary, _float8_scheme(scheme, "kv_cache_scheme")
    # An FP8 checkpoint is where k_scale/v_scale tensors come from (AutoFP8, llm-compressor's
    # fp8 export); engines load them whenever present, so the config alone declares them.
    return summary, KVScheme(True, False, "fp8_e4m3", field="quant_method='fp8'")


def _modelopt(qc: dict) -> tuple[str, KVScheme]:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "?").upper()
    kv_algo = inner.get("kv_cache_quant_algo")
    summary = f"ModelOpt {algo}"
    if kv_algo is not None:
        if str(kv_algo).upper() == "FP8":
            return summary, KVScheme(True, True, "fp8_e4m3", field="kv_cache_quant_algo='FP8'")
        return summary, KVScheme(True, True, None, unsupported=str(kv_algo).upper(),
                                 field=f"kv_cache_quant_algo={kv_algo!r}")
    if qc.get("kv_cache_scheme") is not None:
        return summary, _float8_scheme(qc["kv_cache_scheme"], "kv_cache_scheme")
    return summary + " (no kv_cache_quant_algo)", KVScheme()


def _quark(qc: dict) -> tuple[str, KVScheme]:
    export = qc.get("export") if isinstance(qc.get("export"), dict) else {}
    group = export.get("kv_cache_group") or qc.get("kv_cache_group") or []
    glob = (qc.get("global_quant_config") or {}).get("weight") or {}
    summary = f"Quark {glob.get('dtype', '?')} weights" if isinstance(glob, dict) else "Quark"
    if not group:
        return summary + " (empty kv_cache_group)", KVScheme()
    layer_cfg = qc.get("layer_quant_config") or {}
    outputs = [cfg.get("output_tensors") for name, cfg in layer_cfg.items()
               if isinstance(cfg, dict) and any(fnmatch.fnmatchcase(name, p) or name == p for p in group)]
    outputs = [o for o in outputs if isinstance(o, dict)]
    if not outputs:
        raise Fp8KVError(f"checkpoint: Quark kv_cache_group {group} has no output_tensors in "
                         "layer_quant_config, expected the KV quantization spec there")
    if any(o != outputs[0] for o in outputs[1:]):
        raise Fp8KVError(f"checkpoint: Quark kv_cache_group {group} layers have different output_tensors "
                         "specs, expected one KV quantization spec")
    spec = outputs[0]
    dtype = str(spec.get("dtype"))
    field = f"kv_cache_group {group} (output_tensors dtype={dtype})"
    if dtype not in QUARK_DTYPES:
        return summary, KVScheme(True, True, None, unsupported=dtype, field=field)
    granularity = "token_head" if spec.get("is_dynamic") else "tensor"
    return summary, KVScheme(True, True, QUARK_DTYPES[dtype], granularity, field=field)


def _weight_only(method: str, qc: dict) -> tuple[str, KVScheme]:
    if method == "bitsandbytes":
        bits = "4-bit" if qc.get("load_in_4bit") else "8-bit" if qc.get("load_in_8bit") else "?"
        kind = qc.get("bnb_4bit_quant_type", "") if qc.get("load_in_4bit") else ""
        return f"bitsandbytes {bits}{' ' + kind if kind else ''} (weight-only)", KVScheme()
    bits = qc.get("bits") or qc.get("w_bit") or "?"
    return f"{method.upper()} {bits}-bit (weight-only)", KVScheme()


def parse_config(config: dict, extra_quant: dict | None = None) -> CheckpointConfig:
    """Reduce a model ``config.json`` (as a dict) to a :class:`CheckpointConfig`.

    ``extra_quant`` is an ``hf_quant_config.json`` found beside it, used when the
    config itself has no quantization section (older ModelOpt exports).
    """
    if not isinstance(config, dict):
        raise Fp8KVError(f"checkpoint: got a {type(config).__name__}, expected a config dict")
    layers, kv_heads, head_size, dtype = geometry(config)
    qc = quantization_config(config)
    if qc is None and extra_quant is not None:
        qc = quantization_config(extra_quant)
    if qc is None:
        summary, kv, method = "unquantized", KVScheme(), None
    else:
        method = str(qc.get("quant_method", "")).lower() or None
        if method == "compressed-tensors":
            summary, kv = _compressed_tensors(qc)
        elif method == "fp8":
            summary, kv = _fp8(qc)
        elif method is not None and method.startswith("modelopt"):
            summary, kv = _modelopt(qc)
        elif method == "quark":
            summary, kv = _quark(qc)
        elif method in WEIGHT_ONLY_METHODS:
            summary, kv = _weight_only(method, qc)
        elif qc.get("kv_cache_scheme") is not None:
            summary, kv = f"{method}", _float8_scheme(qc["kv_cache_scheme"], "kv_cache_scheme")
        else:
            summary, kv = f"{method} (no KV cache scheme)", KVScheme()
    return CheckpointConfig(method, summary, kv, layers, kv_heads, head_size, dtype)
