"""Turning a checkpoint's scale tensors into per-layer k/v/q/prob scales for a plan.

Each layer gets one of four treatments, which :meth:`fp8kv.KVCachePlan.describe` lists
and :meth:`fp8kv.KVCachePlan.layer_scales` hands out:

* **loaded**: the checkpoint has both a k and a v scale (or a legacy ``kv_scale``): used
  as stored (times the format's factor).
* **v from k**: the checkpoint has a k scale and no v scale: v uses the k scale, as vLLM
  and SGLang do (``BaseKVCacheMethod.process_weights_after_loading`` duplicates the one
  scale it finds), with a warning naming the layers.
* **v only**: a v scale and no k scale: refused (:class:`fp8kv.errors.InvalidArgument`
  naming the tensor); the engines assert on it too.
* **defaulted**: neither: k = v = 1.0, with a warning naming the layers (and, for e4m3,
  the saturation caveat). Only layers the config counts can default; a config without a
  layer count gives a plan with exactly the layers the checkpoint has scales for.

A vLLM/SGLang KV-scales JSON (:mod:`.legacy_scales`) has one per-tensor scale per layer for
every layer: each layer is **loaded**, with that scale as both k and v, as the engines do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidArgument
from ..formats import Fp8Format
from .legacy_scales import LegacyKVScales
from .tensors import ScaleEntry, adjust, ranges, read, shape_scale

if TYPE_CHECKING:
    from .source import Checkpoint


@dataclass
class Scales:
    """The scale part of a plan (see :class:`fp8kv.KVCachePlan` for the fields)."""

    source: str
    granularity: str
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    prob: dict[int, torch.Tensor] = field(default_factory=dict)
    loaded: bool = False
    loaded_layers: tuple[int, ...] = ()
    v_from_k_layers: tuple[int, ...] = ()
    defaulted_layers: tuple[int, ...] = ()
    num_layers: int | None = None


def _uncalibrated(fmt: Fp8Format) -> str:
    """The e4m3 caveat of 1.0 scales ('' for e5m2, whose range makes 1.0 a fair default)."""
    if fmt.exponent_bits != 4:
        return ""
    return (f"uncalibrated KV scales (1.0) with {fmt.name}: |K|, |V| above {fmt.max:g} saturate; calibrate "
            "scales (fp8kv.calibrate), use a checkpoint with KV scales, or dynamic per-token-head scales "
            "(scale_granularity='token_head')")


def _defaults(n: int | None, granularity: str, heads: int | None) -> dict[int, torch.Tensor]:
    if n is None:
        return {}
    one = torch.ones(heads) if granularity == "head" and heads else torch.tensor(1.0)
    return {layer: one.clone() for layer in range(n)}


def _pick(entries: list[ScaleEntry], values: dict[ScaleEntry, torch.Tensor], warns: list[str]
          ) -> dict[tuple[int, str], ScaleEntry]:
    """The winning entry per (layer, role); legacy ``kv_scale`` stands for both k and v."""
    best: dict[tuple[int, str], ScaleEntry] = {}
    legacy = []
    for e in sorted(entries, key=lambda e: (e.layer, e.rank, e.name)):
        roles = ("k", "v") if e.role == "kv" else (e.role,)
        if e.role == "kv":
            legacy.append(e.layer)
        for role in roles:
            key = (e.layer, role)
            if key not in best:
                best[key] = e
            elif not torch.equal(values[best[key]].flatten(), values[e].flatten()):
                warns.append(f"{e.where} differs from {best[key].where}; using {best[key].name}")
    used = [layer for layer in legacy if best[(layer, "k")].role == "kv"]
    if used:
        warns.append(f"deprecated kv_scale tensors (layers {ranges(used)}) used for both K and V; "
                     "re-export the checkpoint with separate k_scale and v_scale")
    return best


def build_scales(ck: Checkpoint, fmt: Fp8Format, granularity: str, stores: bool, factor: float,
                 warns: list[str]) -> Scales:
    """Per-layer scales for a plan in ``fmt`` (checkpoint scales multiplied by ``factor``)."""
    cfg = ck.config
    if granularity == "token_head":
        return Scales("dynamic", "token_head", num_layers=cfg.num_layers)
    if not stores:
        k = _defaults(cfg.num_layers, granularity, cfg.num_kv_heads)
        if _uncalibrated(fmt):
            warns.append(_uncalibrated(fmt))
        return Scales("default", granularity, k, _defaults(cfg.num_layers, granularity, cfg.num_kv_heads),
                      defaulted_layers=tuple(k), num_layers=cfg.num_layers)
    if ck.legacy is not None:
        return _legacy(ck.legacy, fmt, factor)
    if ck.scan is None:
        return Scales("checkpoint", granularity, num_layers=cfg.num_layers)
    return _load(ck, fmt, granularity, factor, warns)


def _legacy(legacy: LegacyKVScales, fmt: Fp8Format, factor: float) -> Scales:
    """Per-tensor k = v = the layer's ``scaling_factor`` (times ``factor``), for every layer."""
    k: dict[int, torch.Tensor] = {}
    for layer, scale in legacy.scales.items():
        out = scale * factor
        if not bool(torch.isfinite(out)):
            raise InvalidArgument(f"checkpoint: {legacy.where(layer)}: scale {float(scale):.6g} x {factor:g} "
                                  f"overflows float32; {fmt.name} needs the checkpoint's scales x{factor:g}, "
                                  "refusing rather than producing an infinite scale")
        k[layer] = out
    v = {layer: t.clone() for layer, t in k.items()}
    return Scales("checkpoint", "tensor", k, v, loaded=True, loaded_layers=tuple(k), num_layers=legacy.num_layers)


def _load(ck: Checkpoint, fmt: Fp8Format, granularity: str, factor: float, warns: list[str]) -> Scales:
    cfg = ck.config
    entries = list(ck.scan.entries)  # layer indices already bounded by the scan
    values = read(entries)
    why = f"{fmt.name} needs the checkpoint's scales x{factor:g}"
    heads_of = {"k": cfg.num_kv_heads, "v": cfg.num_kv_heads, "kv": cfg.num_kv_heads}
    shaped = {e: adjust(shape_scale(values[e], e, heads_of.get(e.role)), factor, e, why) for e in entries}
    best = _pick(entries, shaped, warns)
    kv = {key: shaped[e] for key, e in best.items() if key[1] in ("k", "v")}
    v_only = sorted(layer for layer, role in kv if role == "v" and (layer, "k") not in kv)
    if v_only:
        e = best[(v_only[0], "v")]
        raise InvalidArgument(
            f"checkpoint: {e.where}: got a v scale without a k scale (layers {ranges(v_only)}), expected k and v "
            "scales, or a k scale alone (then v = k, as vLLM and SGLang do; they refuse a lone v scale too)")
    heads = {t.shape[0] for t in kv.values() if t.dim() == 1}
    if len(heads) > 1:
        raise InvalidArgument(f"checkpoint: per-head KV scales with different head counts {sorted(heads)}, "
                              "expected one KV head count")
    gran = "head" if heads else "tensor"
    h = next(iter(heads)) if heads else cfg.num_kv_heads
    # The config's layer count (bounded by parse_config), else just the layers found: never a
    # range up to an index read from a tensor name.
    layers = range(cfg.num_layers) if cfg.num_layers is not None else sorted({layer for layer, _ in kv})
    k, v, loaded, v_from_k, defaulted = {}, {}, [], [], []
    for layer in layers:
        ks, vs = kv.get((layer, "k")), kv.get((layer, "v"))
        if ks is None:
            defaulted.append(layer)
            ks, vs = torch.tensor(1.0), torch.tensor(1.0)
        elif vs is None:
            v_from_k.append(layer)
            vs = ks.clone()
        else:
            loaded.append(layer)
        if gran == "head":
            ks, vs = (t.expand(h).clone() if t.dim() == 0 else t for t in (ks, vs))
        k[layer], v[layer] = ks, vs
    if v_from_k:
        warns.append(f"no v scale in the checkpoint for layers {ranges(v_from_k)}: those use their k scale "
                     "for v (v = k), as vLLM and SGLang do")
    if defaulted:
        caveat = _uncalibrated(fmt)
        warns.append(f"no KV scales in the checkpoint for layers {ranges(defaulted)}; those use 1.0 for k and v"
                     + (f" - {caveat}" if caveat else ""))
    q = {layer: shaped[e] for (layer, role), e in best.items() if role == "q"}
    prob = {layer: shaped[e] for (layer, role), e in best.items() if role == "prob"}
    source = "checkpoint" if loaded or v_from_k else "default"
    return Scales(source, gran, k, v, q, prob, loaded=bool(loaded or v_from_k), loaded_layers=tuple(loaded),
                  v_from_k_layers=tuple(v_from_k), defaulted_layers=tuple(defaulted), num_layers=cfg.num_layers)
