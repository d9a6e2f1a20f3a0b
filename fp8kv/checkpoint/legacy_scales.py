"""vLLM's and SGLang's legacy KV-scales JSON (their ``quantization_param_path`` file).

The file holds one per-tensor FP8 KV scale per layer and tensor-parallel rank; the engines use
each layer's scale for both K and V::

    {"model_type": "llama",
     "kv_cache": {"dtype": "float8_e4m3fn",
                  "scaling_factor": {"0": {"0": 0.0123, "1": 0.02, ...},    # rank 0: layer -> scale
                                     "1": {"0": 0.0119, "1": 0.021, ...}}}}  # rank 1

The rules are the engines' (``KVCacheQuantSchema`` / ``QuantParamSchema`` in vLLM's
``vllm/model_executor/layers/quantization/schema.py``, copied into SGLang's
``python/sglang/srt/model_loader/weight_utils.py``), made into named refusals: ``dtype`` is
exactly ``"float8_e4m3fn"``; the ranks are ``0 .. R-1``; every rank has a scale for every layer
``0 .. N-1``. Where the engines log the error and fall back to 1.0 scales, fp8kv raises
:class:`fp8kv.InvalidArgument` naming the field, the rank and the layer. On top of theirs:
a scale must be a finite number >= 2^-126 (as for scale tensors), and the rank to load is named
(``tp_rank``) unless the file has exactly one.

Bounds: at most :data:`MAX_TP_RANKS` ranks and :data:`~fp8kv.checkpoint.config.MAX_LAYERS`
layers per rank, counted before anything is iterated; keys are decimal integers of at most 9
digits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import bad_argument
from .config import MAX_LAYERS, MAX_NAME_CHARS, CheckpointConfig, Fields, KVScheme, show
from .tensors import MIN_SCALE, ranges

LEGACY_DTYPE = "float8_e4m3fn"
"""The only ``kv_cache.dtype`` vLLM and SGLang accept in this file (``check_is_fp8``)."""

MAX_TP_RANKS = 4096
"""Most tensor-parallel ranks accepted in ``kv_cache.scaling_factor``."""

SCALE_LIKE_KEYS = frozenset({
    "k_scale", "v_scale", "kv_scale", "k_scales", "v_scales", "kv_scales", "kv_cache_scale",
    "kv_cache_scales", "kv_cache_scaling_factor", "kv_cache_scaling_factors", "kv_scaling_factor",
    "kv_scaling_factors",
})
"""Keys (or last dotted parts of keys, ``model.layers.0.self_attn.k_scale``) that carry KV scales."""

GENERIC_SCALE_KEYS = frozenset({"scaling_factor", "scaling_factors"})
"""KV scales only at the top level or under a key that mentions ``kv`` or ``cache``."""

MAX_KEYS_INSPECTED = 100_000
"""Most JSON values :func:`scale_like_keys` visits (a caller's dict is not bounded like a file)."""

_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")
_SHAPE = '{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<rank>": {"<layer>": <scale>}}}}'


@dataclass(frozen=True)
class LegacyKVScales:
    """One rank's scales from a KV-scales JSON.

    Attributes:
        model_type: the file's ``model_type`` (None if absent or null).
        tp_rank: the tensor-parallel rank loaded; ``tp_size`` how many ranks the file has.
        scales: layer -> float32 scale of shape ``()``, for every layer ``0 .. N-1``; it is
            both the k and the v scale.
        source: the file (or ``"config"`` for a dict), for messages.
    """

    model_type: str | None
    tp_rank: int
    tp_size: int
    scales: dict[int, torch.Tensor]
    source: str

    @property
    def num_layers(self) -> int:
        return len(self.scales)

    def where(self, layer: int) -> str:
        """``<source>: kv_cache.scaling_factor."1"."3" (tp rank 1, layer 3)``, for messages."""
        return f"{self.source}: {_scale_path(self.tp_rank, layer)}"

    def config(self) -> CheckpointConfig:
        """What planning needs from the file: an e4m3, per-tensor KV scheme and the layer count."""
        kind = f"model_type {self.model_type!r}" if self.model_type is not None else "no model_type"
        summary = (f"vLLM/SGLang KV-scales JSON ({kind}, {LEGACY_DTYPE}, tensor-parallel rank {self.tp_rank} "
                   f"of {self.tp_size})")
        kv = KVScheme(True, True, "fp8_e4m3", "tensor", field=f"kv_cache.dtype={LEGACY_DTYPE!r}")
        return CheckpointConfig(None, summary, kv, num_layers=self.num_layers)


def is_legacy(obj: object) -> bool:
    """Whether a parsed JSON object is meant as a KV-scales JSON (it has a ``kv_cache`` key)."""
    return isinstance(obj, dict) and "kv_cache" in obj


def _scale_path(rank: int, layer: int | None = None) -> str:
    tail = f'."{layer}" (tp rank {rank}, layer {layer})' if layer is not None else f" (tp rank {rank})"
    return f'kv_cache.scaling_factor."{rank}"{tail}'


def _index(key: object, name: str, what: str) -> int:
    """A rank or layer key: a decimal string (``"0"``, ``"12"``) or, in a caller's dict, an int."""
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < 10**9:
        return key
    if isinstance(key, str) and _INDEX.fullmatch(key):
        return int(key)
    raise bad_argument(name, f"the key {show(key)}",
                       f"{what} keys that are decimal integers ('0', '1', ...; at most 9 digits)")


def _indexed(data: dict, name: str, what: str, limit: int) -> dict[int, object]:
    """``data`` with its keys read as indices (bounded count, no duplicates such as ``"1"`` and ``1``)."""
    if len(data) > limit:
        raise bad_argument(name, f"{len(data)} {what}s", f"at most {limit}")
    out: dict[int, object] = {}
    for key, value in data.items():
        i = _index(key, name, what)
        if i in out:
            raise bad_argument(name, f"{what} {i} twice (keys {show(key)} and another)", f"one entry per {what}")
        out[i] = value
    return out


def _number(value: object, name: str) -> float:
    """One scale as a Python float (not yet range-checked): a JSON number, not a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_argument(name, show(value), "a number (the layer's per-tensor KV scale)")
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return math.inf


def _number_text(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _check_values(values: dict[tuple[int, int], float], given: dict[int, dict[int, object]],
                  source: str) -> torch.Tensor:
    """All scales as one float32 tensor (in ``values``' order), refusing the first that is not a
    finite number >= 2^-126 after the cast to float32, naming its rank and layer (and the value
    as ``given``)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64).to(torch.float32)
    bad = ~(torch.isfinite(t) & (t >= MIN_SCALE))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        rank, layer = list(values)[i]
        raise bad_argument(f"{source}: {_scale_path(rank, layer)}", _number_text(given[rank][layer]),
                           f"a finite scale >= 2^-126 ({MIN_SCALE:.6g}; zero, negative, subnormal, NaN and inf "
                           "scales are refused, also after the cast to float32)")
    return t


def _ranks(kv: Fields) -> dict[int, dict[int, object]]:
    """``scaling_factor`` as ``{rank: {layer: value}}``, its keys checked and bounded."""
    name = kv.name("scaling_factor")
    if kv.raw("scaling_factor") is None:
        raise bad_argument(name, "nothing (missing or null)", f"an object of ranks to layer scales, {_SHAPE}")
    sf = kv.obj("scaling_factor")  # type-checked: a JSON object
    if not sf.data:
        raise bad_argument(name, "an empty object", f"at least one tensor-parallel rank, {_SHAPE}")
    out: dict[int, dict[int, object]] = {}
    for rank, layers in _indexed(sf.data, name, "rank", MAX_TP_RANKS).items():
        where = f"{kv.source}: {_scale_path(rank)}"
        if not isinstance(layers, dict):
            raise bad_argument(where, show(layers), 'an object of layer scales ({"0": 0.0123, "1": ...})')
        if not layers:
            raise bad_argument(where, "an empty object", "a scale for every layer")
        out[rank] = _indexed(layers, where, "layer", MAX_LAYERS)
    return out


def _check_complete(ranks: dict[int, dict[int, object]], kv: Fields) -> int:
    """The layer count N, after checking ranks ``0 .. R-1`` each with layers ``0 .. N-1``."""
    missing_ranks = sorted(set(range(len(ranks))) - set(ranks))
    if missing_ranks:
        raise bad_argument(kv.name("scaling_factor"), f"ranks {ranges(ranks)}",
                           f"ranks 0-{len(ranks) - 1} (0 to the number of ranks - 1, as vLLM and SGLang require): "
                           f"rank {ranges(missing_ranks)} missing")
    n = 1 + max(max(layers) for layers in ranks.values())
    if n > MAX_LAYERS:
        raise bad_argument(kv.name("scaling_factor"), f"layer {n - 1}", f"layers below {MAX_LAYERS}")
    for rank in sorted(ranks):
        missing = sorted(set(range(n)) - set(ranks[rank]))
        if missing:
            raise bad_argument(f"{kv.source}: {_scale_path(rank)}", f"layers {ranges(ranks[rank])}",
                               f"a scale for every layer 0-{n - 1} (the file's layers): "
                               f"layer{'s' if len(missing) > 1 else ''} {ranges(missing)} missing in tp rank {rank}")
    return n


def _pick_rank(tp_rank: int | None, tp_size: int, source: str) -> int:
    source = "the KV-scales dict" if source == "config" else source
    if tp_rank is None:
        if tp_size == 1:
            return 0
        raise bad_argument("tp_rank", "None", f"the tensor-parallel rank whose scales to load: {source} has "
                           f"scales for {tp_size} ranks (0-{tp_size - 1}); pass tp_rank=")
    if tp_rank >= tp_size:
        raise bad_argument("tp_rank", repr(tp_rank), f"a rank in {source}: 0-{tp_size - 1}" if tp_size > 1
                           else f"0 or None ({source} has scales for one rank)")
    return tp_rank


def parse_legacy(obj: dict, source: str, tp_rank: int | None) -> LegacyKVScales:
    """Check a KV-scales JSON (see the module doc) and return the scales of ``tp_rank``.

    ``tp_rank`` None loads rank 0 of a one-rank file and is refused for a file with more
    ranks. Every rank's values are checked, not only the one loaded: a broken file is refused
    whichever rank asks.

    Raises:
        InvalidArgument: naming the field (``kv_cache.dtype``, ``kv_cache.scaling_factor."1"."3"``
            with its rank and layer) or ``tp_rank``.
    """
    top = Fields(obj, source)
    model_type = top.string("model_type", MAX_NAME_CHARS)
    if not isinstance(obj.get("kv_cache"), dict):
        raise top.bad("kv_cache", f"an object with dtype and scaling_factor, {_SHAPE}")
    kv = top.obj("kv_cache")
    dtype = kv.raw("dtype")
    if dtype != LEGACY_DTYPE:
        given = "nothing (missing or null)" if dtype is None else show(dtype)
        raise bad_argument(kv.name("dtype"), given, f"{LEGACY_DTYPE!r} (the only dtype vLLM and SGLang accept in "
                           "this file; their scales are per-tensor e4m3)")
    ranks = _ranks(kv)
    n = _check_complete(ranks, kv)
    numbers = {(rank, layer): _number(layers[layer], f"{source}: {_scale_path(rank, layer)}")
               for rank, layers in sorted(ranks.items()) for layer in range(n)}
    checked = _check_values(numbers, ranks, source)
    rank = _pick_rank(tp_rank, len(ranks), source)
    scales = {layer: checked[rank * n + layer].clone() for layer in range(n)}
    return LegacyKVScales(model_type, rank, len(ranks), scales, source)


def scale_like_keys(obj: object, limit: int = 3) -> list[str]:
    """Up to ``limit`` paths of keys in ``obj`` that carry KV scales: :data:`SCALE_LIKE_KEYS`, or
    :data:`GENERIC_SCALE_KEYS` at the top level or under a key that mentions ``kv`` or ``cache``
    (not, say, ``rope_scaling.scaling_factor``). Visits at most :data:`MAX_KEYS_INSPECTED` values,
    each once (a caller's dict may be cyclic); paths are cut at ``MAX_NAME_CHARS``.
    """
    found: list[str] = []
    stack: list[tuple[object, str, bool]] = [(obj, "", True)]
    seen: set[int] = set()
    visited = 0
    while stack and len(found) < limit and visited < MAX_KEYS_INSPECTED:
        node, path, kv_context = stack.pop()
        visited += 1
        if id(node) in seen or not isinstance(node, dict | list):
            continue
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for n, (key, value) in enumerate(items):
            if n >= MAX_KEYS_INSPECTED or len(found) >= limit:
                break
            key = str(key)[:MAX_NAME_CHARS] if isinstance(key, str | int) else "?"
            low = key.lower()
            where = (f"{path}.{key}" if path else key)[:MAX_NAME_CHARS]
            if low.rsplit(".", 1)[-1] in SCALE_LIKE_KEYS or (low in GENERIC_SCALE_KEYS and kv_context):
                found.append(where)
            stack.append((value, where, "kv" in low or "cache" in low))
    return found


__all__ = ["LEGACY_DTYPE", "MAX_TP_RANKS", "LegacyKVScales", "is_legacy", "parse_legacy", "scale_like_keys"]
