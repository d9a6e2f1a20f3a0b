"""What a checkpoint's ``config.json`` declares about its KV cache.

Understands the public ``quantization_config`` formats of compressed-tensors
(``config_groups`` + ``kv_cache_scheme``), FP8 (``quant_method: fp8``, optional
``kv_cache_scheme``), NVIDIA ModelOpt (``quant_method: modelopt`` or an
``hf_quant_config.json`` with ``quantization.kv_cache_quant_algo``), AMD Quark
(``export.kv_cache_group`` + ``layer_quant_config[...].output_tensors``) and the
weight-only methods (AWQ, GPTQ, bitsandbytes, ...), plus unquantized configs.

Nothing here reads tensors; :mod:`fp8kv.checkpoint.tensors` does that.

Every field read is type-checked (``bool`` is not an ``int``; a list, string or object
where a number is expected is refused), and the geometry is bounded, so a hostile
config cannot make planning loop or allocate without bound. A bad field raises
:class:`fp8kv.errors.InvalidArgument` naming the file and the field path, e.g.
``config.json: num_hidden_layers: got '32' (str), expected an int in [1, 4096]``.
A missing or ``null`` field counts as absent.

Bounds: :data:`MAX_LAYERS` layers, :data:`MAX_HEADS` attention and KV heads,
:data:`MAX_HEAD_SIZE` head size, :data:`MAX_HIDDEN_SIZE` hidden size (the largest
public models have 126 layers, 128 heads, head size 256 and hidden size 16384).
"""

from __future__ import annotations

import fnmatch
import reprlib
from dataclasses import dataclass

from ..errors import InvalidArgument, bad_argument

MAX_LAYERS = 4096
"""Most ``num_hidden_layers`` accepted (also bounds layer indices in scale tensor names)."""
MAX_HEADS = 4096
"""Most attention / KV heads accepted (also bounds the length of a per-head scale)."""
MAX_HEAD_SIZE = 4096
"""Largest ``head_dim`` (given, or ``hidden_size / num_attention_heads``) accepted."""
MAX_HIDDEN_SIZE = 2**20
"""Largest ``hidden_size`` accepted."""
MAX_QUARK_PATTERNS = 64
"""Most Quark ``kv_cache_group`` patterns accepted (each at most :data:`MAX_NAME_CHARS`)."""
MAX_QUARK_LAYER_CONFIGS = 4096
"""Most Quark ``layer_quant_config`` entries accepted (each is matched against every pattern)."""
MAX_NAME_CHARS = 1024
"""Longest string accepted where a name or a pattern is expected."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 4, 4


def show(value: object) -> str:
    """``'32' (str)``: a short repr and the type, for error messages."""
    return f"{_REPR.repr(value)} ({type(value).__name__})"


class Fields:
    """Typed, bounded access to one JSON object of a config.

    ``source`` names the file (or ``"config"`` for a dict), ``path`` the object's place in it
    (``"quantization_config."``); errors name ``<source>: <path><key>``.
    """

    def __init__(self, data: dict, source: str, path: str = "") -> None:
        self.data, self.source, self.path = data, source, path

    def name(self, key: object) -> str:
        return f"{self.source}: {self.path}{key}"

    def raw(self, key: str) -> object:
        return self.data.get(key)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def bad(self, key: object, expected: str) -> InvalidArgument:
        return bad_argument(self.name(key), show(self.data.get(key)), expected)

    def _checked(self, key: object, ok, expected: str):
        """The value at ``key`` (None if absent) when ``ok(value)``, else a named error."""
        v = self.data.get(key)
        if v is not None and not ok(v):
            raise self.bad(key, expected)
        return v

    def integer(self, key: str, lo: int, hi: int) -> int | None:
        return self._checked(key, lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
                             f"an int in [{lo}, {hi}]")

    def number(self, key: str, lo: float, hi: float) -> int | float | None:
        return self._checked(key, lambda v: isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi,
                             f"a number in [{lo:g}, {hi:g}]")

    def string(self, key: str, max_chars: int = MAX_NAME_CHARS) -> str | None:
        return self._checked(key, lambda v: isinstance(v, str) and len(v) <= max_chars,
                             f"a string of at most {max_chars} characters")

    def flag(self, key: str) -> bool | None:
        return self._checked(key, lambda v: isinstance(v, bool), "true or false")

    def obj(self, key: object) -> Fields | None:
        v = self._checked(key, lambda v: isinstance(v, dict), "a JSON object")
        return None if v is None else Fields(v, self.source, f"{self.path}{key}.")

    def strings(self, key: str, max_items: int, max_chars: int = MAX_NAME_CHARS) -> list[str] | None:
        return self._checked(key, lambda v: isinstance(v, list) and len(v) <= max_items
                             and all(isinstance(x, str) and len(x) <= max_chars for x in v),
                             f"a list of at most {max_items} strings of at most {max_chars} characters")


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


def quantization_config(cfg: Fields) -> Fields | None:
    """The quantization section of a full config, a bare quantization config, or an
    ``hf_quant_config.json`` (ModelOpt, normalised to carry ``quant_method: modelopt``)."""
    for key in ("quantization_config", "compression_config"):
        qc = cfg.obj(key)
        if qc is not None and qc.data:
            return qc
    if cfg.has("quant_method"):
        return cfg
    if cfg.obj("quantization") is not None:
        return Fields({"quant_method": "modelopt", **cfg.data}, cfg.source, cfg.path)
    return None


def _first_int(f: Fields, keys: tuple[str, ...], hi: int) -> int | None:
    """The first of ``keys`` present (not null) in ``f``, type- and range-checked."""
    for key in keys:
        if f.has(key):
            return f.integer(key, 1, hi)
    return None


def geometry(cfg: Fields) -> tuple[int | None, int | None, int | None, str | None]:
    """``(num_layers, num_kv_heads, head_size, torch_dtype)`` of the language model."""
    text = cfg
    if not cfg.has("num_hidden_layers"):
        text = cfg.obj("text_config") or cfg
    layers = _first_int(text, ("num_hidden_layers", "n_layer", "num_layers"), MAX_LAYERS)
    heads = _first_int(text, ("num_attention_heads", "n_head"), MAX_HEADS)
    kv_heads = _first_int(text, ("num_key_value_heads", "num_kv_heads", "n_head_kv"), MAX_HEADS) or heads
    head_size = text.integer("head_dim", 1, MAX_HEAD_SIZE)
    hidden = _first_int(text, ("hidden_size", "n_embd"), MAX_HIDDEN_SIZE)
    if head_size is None and hidden and heads and hidden % heads == 0:
        head_size = hidden // heads
        if head_size > MAX_HEAD_SIZE:
            raise bad_argument(text.name("hidden_size / num_attention_heads"), f"{hidden} / {heads} = {head_size}",
                               f"a head size of at most {MAX_HEAD_SIZE}")
    dtype = None
    for f in dict.fromkeys((text, cfg)):
        for key in ("torch_dtype", "dtype"):
            if dtype is None and f.has(key):
                dtype = f.string(key, 64)
    return layers, kv_heads, head_size, dtype


def _float8_scheme(parent: Fields, key: str) -> KVScheme:
    """A compressed-tensors style ``kv_cache_scheme`` (object) or ``"static"``/``"dynamic"``."""
    scheme = parent.raw(key)
    if isinstance(scheme, str):
        if scheme.lower() not in ("static", "dynamic"):
            raise parent.bad(key, "'static', 'dynamic' or an object")
        return KVScheme(True, True, "fp8_e4m3", "token_head" if scheme.lower() == "dynamic" else "tensor",
                        field=f"{key}={scheme!r}")
    if not isinstance(scheme, dict):
        raise parent.bad(key, "'static', 'dynamic' or an object")
    s = parent.obj(key)
    kind = s.string("type", 64) or "float"
    bits = s.integer("num_bits", 1, 64) or 8
    strategy = s.string("strategy", 64) or "tensor"
    dynamic = s.raw("dynamic")
    if not (dynamic is None or isinstance(dynamic, bool) or dynamic == "local"):
        raise s.bad("dynamic", "true, false or 'local'")
    symmetric = s.flag("symmetric")
    if kind != "float" or bits != 8:
        return KVScheme(True, True, None, unsupported=f"{kind}{bits}", field=key)
    if dynamic is True or dynamic == "local":
        granularity = "token_head"
    elif strategy == "tensor":
        granularity = "tensor"
    elif strategy == "attn_head":
        granularity = "head"
    else:
        raise s.bad("strategy", "'tensor' or 'attn_head'")
    if symmetric is False:
        raise s.bad("symmetric", "true (symmetric FP8 KV scales)")
    return KVScheme(True, True, "fp8_e4m3", granularity, field=f"{key} (float8, {strategy}"
                    + (", dynamic)" if granularity == "token_head" else ")"))


def _compressed_tensors(qc: Fields) -> tuple[str, KVScheme]:
    names = set()
    groups = qc.obj("config_groups")
    for gname in groups.data if groups is not None else ():
        group = groups.obj(gname)
        if group is None:
            continue
        w, a = group.obj("weights"), group.obj("input_activations")
        if w is not None and w.data:
            wbits, wtype = w.integer("num_bits", 1, 64), w.string("type", 64)
            abits = a.integer("num_bits", 1, 64) if a is not None else None
            name = f"W{wbits if wbits is not None else '?'}A{abits if abits is not None else 16}"
            names.add(f"{name}-FP8" if wtype == "float" and wbits == 8 else name)
    kind = "/".join(sorted(names)) or "(no config_groups)"
    weight_only = bool(names) and all(n.split("A")[1].startswith("16") for n in names)
    if not qc.has("kv_cache_scheme"):
        tail = " (weight-only, no kv_cache_scheme)" if weight_only else " (no kv_cache_scheme)"
        return f"compressed-tensors {kind}{tail}", KVScheme()
    return f"compressed-tensors {kind}", _float8_scheme(qc, "kv_cache_scheme")


def _fp8(qc: Fields) -> tuple[str, KVScheme]:
    summary = f"FP8 (activation_scheme={qc.string('activation_scheme', 64) or 'dynamic'})"
    if qc.has("kv_cache_scheme"):
        return summary, _float8_scheme(qc, "kv_cache_scheme")
    # An FP8 checkpoint is where k_scale/v_scale tensors come from (AutoFP8, llm-compressor's
    # fp8 export); engines load them whenever present, so the config alone declares them.
    return summary, KVScheme(True, False, "fp8_e4m3", field="quant_method='fp8'")


def _modelopt(qc: Fields) -> tuple[str, KVScheme]:
    inner = qc.obj("quantization") or qc
    algo = (inner.string("quant_algo", 64) or "?").upper()
    kv_algo = inner.string("kv_cache_quant_algo", 64)
    summary = f"ModelOpt {algo}"
    if kv_algo is not None:
        if kv_algo.upper() == "FP8":
            return summary, KVScheme(True, True, "fp8_e4m3", field="kv_cache_quant_algo='FP8'")
        return summary, KVScheme(True, True, None, unsupported=kv_algo.upper(),
                                 field=f"kv_cache_quant_algo={kv_algo!r}")
    if qc.has("kv_cache_scheme"):
        return summary, _float8_scheme(qc, "kv_cache_scheme")
    return summary + " (no kv_cache_quant_algo)", KVScheme()


def _quark(qc: Fields) -> tuple[str, KVScheme]:
    export = qc.obj("export")
    group = ((export.strings("kv_cache_group", MAX_QUARK_PATTERNS) if export is not None else None)
             or qc.strings("kv_cache_group", MAX_QUARK_PATTERNS) or [])
    glob = qc.obj("global_quant_config")
    weight = glob.obj("weight") if glob is not None else None
    summary = f"Quark {(weight.string('dtype', 64) if weight is not None else None) or '?'} weights"
    if not group:
        return summary + " (empty kv_cache_group)", KVScheme()
    layer_cfg = qc.obj("layer_quant_config")
    entries = layer_cfg.data if layer_cfg is not None else {}
    if len(entries) > MAX_QUARK_LAYER_CONFIGS:
        raise bad_argument(layer_cfg.name(""), f"{len(entries)} entries",
                           f"at most {MAX_QUARK_LAYER_CONFIGS} (each is matched against the kv_cache_group)")
    outputs: list[Fields] = []
    for name in entries:
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
            raise bad_argument(layer_cfg.name(""), f"the key {show(name)}",
                               f"string keys of at most {MAX_NAME_CHARS} characters")
        if any(name == p or fnmatch.fnmatchcase(name, p) for p in group):
            spec = layer_cfg.obj(name)
            out = spec.obj("output_tensors") if spec is not None else None
            if out is not None:
                outputs.append(out)
    if not outputs:
        raise InvalidArgument(f"{qc.source}: Quark kv_cache_group {group} has no output_tensors in "
                              "layer_quant_config, expected the KV quantization spec there")
    specs = [(str(o.string("dtype", 64)), o.flag("is_dynamic")) for o in outputs]  # each type-checked
    if any(o.data != outputs[0].data for o in outputs[1:]):
        raise InvalidArgument(f"{qc.source}: Quark kv_cache_group {group} layers have different output_tensors "
                              "specs, expected one KV quantization spec")
    dtype, dynamic = specs[0]
    field = f"kv_cache_group {group} (output_tensors dtype={dtype})"
    if dtype not in QUARK_DTYPES:
        return summary, KVScheme(True, True, None, unsupported=dtype, field=field)
    return summary, KVScheme(True, True, QUARK_DTYPES[dtype], "token_head" if dynamic else "tensor", field=field)


def _weight_only(method: str, qc: Fields) -> tuple[str, KVScheme]:
    if method == "bitsandbytes":
        four, eight = qc.flag("load_in_4bit"), qc.flag("load_in_8bit")
        bits = "4-bit" if four else "8-bit" if eight else "?"
        kind = (qc.string("bnb_4bit_quant_type", 64) or "") if four else ""
        return f"bitsandbytes {bits}{' ' + kind if kind else ''} (weight-only)", KVScheme()
    bits = qc.number("bits", 0, 64) or qc.number("w_bit", 0, 64) or "?"
    return f"{method.upper()} {bits}-bit (weight-only)", KVScheme()


def parse_config(config: dict, extra_quant: dict | None = None, *, source: str = "config",
                 extra_source: str = "hf_quant_config.json") -> CheckpointConfig:
    """Reduce a model ``config.json`` (as a dict) to a :class:`CheckpointConfig`.

    ``extra_quant`` is an ``hf_quant_config.json`` found beside it, used when the
    config itself has no quantization section (older ModelOpt exports). ``source`` and
    ``extra_source`` name them in errors.

    Raises:
        InvalidArgument: a field of the wrong type or out of range, naming it.
    """
    if not isinstance(config, dict):
        raise bad_argument(source, show(config), "a config dict (a JSON object)")
    cfg = Fields(config, source)
    layers, kv_heads, head_size, dtype = geometry(cfg)
    qc = quantization_config(cfg)
    if qc is None and extra_quant is not None:
        if not isinstance(extra_quant, dict):
            raise bad_argument(extra_source, show(extra_quant), "a JSON object")
        qc = quantization_config(Fields(extra_quant, extra_source))
    if qc is None:
        summary, kv, method = "unquantized", KVScheme(), None
    else:
        name = qc.string("quant_method", 64)
        method = name.lower() if name else None
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
        elif qc.has("kv_cache_scheme"):
            summary, kv = f"{method}", _float8_scheme(qc, "kv_cache_scheme")
        else:
            summary, kv = f"{method} (no KV cache scheme)", KVScheme()
    return CheckpointConfig(method, summary, kv, layers, kv_heads, head_size, dtype)
