"""The KV-cache plan: which format, which scales, which backend, and why."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import Fp8KVError, bad_argument
from .tensors import ranges

SCALE_SOURCES = ("checkpoint", "default", "dynamic", "none")


def _same(explicit, planned: torch.Tensor) -> bool:
    try:
        t = torch.as_tensor(explicit, dtype=torch.float32).to("cpu")
    except (TypeError, ValueError, RuntimeError):
        return False
    p = planned.to("cpu")
    if t.numel() == 1 and p.numel() == 1:
        return bool(t.reshape(()) == p.reshape(()))
    return tuple(t.shape) == tuple(p.shape) and bool(torch.equal(t, p))


@dataclass(frozen=True, eq=False)
class KVCachePlan:
    """How to store one model's KV cache on one device; made by :func:`fp8kv.resolve_kv_cache`.

    Attributes:
        requested: the ``kv_cache_dtype`` asked for (``"auto"``, ``"fp8"``, ``"fp8_e5m2"``...).
        kv_dtype: the concrete format (``"fp8_e4m3fnuz"`` for ``fp8`` on gfx942), or ``"auto"``
            when the cache is not FP8.
        scale_granularity: ``"tensor"``, ``"head"``, ``"token_head"`` or None (not FP8).
        scale_source: ``"checkpoint"`` (calibrated scales from the checkpoint), ``"default"``
            (1.0: the checkpoint has none), ``"dynamic"`` (computed at write time) or
            ``"none"`` (not FP8).
        k_scales / v_scales: layer -> float32 dequant scale, shape ``()`` or ``(H,)``, already
            adjusted for the device (doubled for e4m3fnuz). Empty for dynamic plans and for
            checkpoint scales planned from a config alone (``scales_loaded`` False).
        q_scales / prob_scales: layer -> float32 scale, where the checkpoint has them.
        backend: the backend the registry picks for paged attention on ``device``
            (None when not FP8); ``write_backend`` the one for cache writes.
        device: the device planned for (its name and arch).
        checkpoint: one line on the checkpoint (path and quantization).
        calibrated_for: the format the checkpoint's KV scales were calibrated for, if any.
        scale_factor: what the checkpoint's scales were multiplied by (2.0 for OCP e4m3
            scales on e4m3fnuz, else 1.0).
        scales_loaded: whether checkpoint scales were read (False from a config alone).
        loaded_layers: layers whose k and v scales both came from the checkpoint.
        v_from_k_layers: layers with a k scale and no v scale in the checkpoint: v uses the
            k scale (v = k), as vLLM and SGLang do.
        defaulted_layers: layers with neither: k and v are 1.0.
        num_layers / num_kv_heads / head_size: from the config when known.
        reasons: why the plan is what it is, one line each.
        warnings: what the user should know (uncalibrated scales, slow backend...).
    """

    requested: str
    kv_dtype: str
    scale_granularity: str | None
    scale_source: str
    k_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    v_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    q_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    prob_scales: dict[int, torch.Tensor] = field(default_factory=dict)
    backend: str | None = None
    write_backend: str | None = None
    device: str = "cpu"
    checkpoint: str = "none"
    calibrated_for: str | None = None
    scale_factor: float = 1.0
    scales_loaded: bool = False
    loaded_layers: tuple[int, ...] = ()
    defaulted_layers: tuple[int, ...] = ()
    num_layers: int | None = None
    v_from_k_layers: tuple[int, ...] = ()
    num_kv_heads: int | None = None
    head_size: int | None = None
    layout: str = "NHD"
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype != "auto"

    # -- using the plan --------------------------------------------------------------
    def layer_scales(self, layer: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (k, v) scales for ``layer``: None for dynamic plans, 1.0 for default ones.

        For checkpoint scales these are what :meth:`describe` lists per layer: both as stored,
        v = k where the checkpoint has no v scale, or 1.0 where it has neither.
        """
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise bad_argument("layer", repr(layer), "an int layer index or None")
        if self.scale_source == "dynamic":
            return None, None
        if self.scale_source == "default" and (layer is None or layer not in self.k_scales):
            one = torch.tensor(1.0)
            return one, one
        if layer is None:
            raise Fp8KVError("layer: got None, expected the layer index: this plan has per-layer "
                             f"checkpoint scales for layers {ranges(self.k_scales)}")
        if layer not in self.k_scales or layer not in self.v_scales:
            why = ("they were planned from a config alone; plan from the model directory to load them"
                   if not self.scales_loaded else f"it has layers {ranges(self.k_scales)}")
            raise Fp8KVError(f"layer: got {layer!r}, expected a layer this plan has k/v scales for ({why})")
        return self.k_scales[layer], self.v_scales[layer]

    def cache_kwargs(
        self, layer: int | None = None, *, kv_dtype=None, scale_granularity=None, k_scale=None, v_scale=None,
    ) -> dict:
        """The keywords ``kv_dtype``, ``scale_granularity``, ``layout``, ``k_scale``, ``v_scale`` of
        :meth:`fp8kv.KVCache.allocate` for ``layer``:
        ``KVCache.allocate(num_blocks, block_size, num_kv_heads, head_size, **plan.cache_kwargs(layer))``.

        Explicit arguments must agree with the plan; a conflicting one raises Fp8KVError.
        """
        if not self.is_fp8:
            raise Fp8KVError(f"plan: got a plan with kv_dtype 'auto' ({self.requested!r} requested), "
                             "expected an FP8 plan to allocate an FP8 cache")
        ks, vs = self.layer_scales(layer)
        for name, given, planned in (("kv_dtype", kv_dtype, self.kv_dtype),
                                     ("scale_granularity", scale_granularity, self.scale_granularity)):
            if given is not None and given != planned:
                raise Fp8KVError(f"{name}: got {given!r}, expected {planned!r} (from the plan) or None")
        for name, given, planned in (("k_scale", k_scale, ks), ("v_scale", v_scale, vs)):
            if given is not None and (planned is None or not _same(given, planned)):
                want = ("None (dynamic scales)" if planned is None
                        else f"None or the plan's {planned.tolist()}")
                raise Fp8KVError(f"{name}: got {given!r}, expected {want}")
        return {"kv_dtype": self.kv_dtype, "scale_granularity": self.scale_granularity, "layout": self.layout,
                "k_scale": ks, "v_scale": vs}

    def fp8_attention_scales(self, layer: int, device: torch.device | str | None = None) -> dict:
        """``layer``'s checkpoint ``q_scale`` and ``prob_scale`` as keywords of the FP8 attention mode
        (:func:`fp8kv.plan_attention` for a whole step, or :func:`fp8kv.paged_attention` per layer):
        ``{"q_scale": float32 tensor or None (dynamic), "prob_scale": float}``.

        vLLM doubles a checkpoint's q and prob scales (calibrated for OCP e4m3) on e4m3fnuz devices;
        the FP8 mode is defined for ``fp8_e4m3`` caches only, so such a plan raises instead.
        """
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise bad_argument("layer", repr(layer), "an int layer index")
        if self.kv_dtype != "fp8_e4m3":
            raise Fp8KVError(f"fp8_attention: got a plan for {self.kv_dtype!r}, expected an fp8_e4m3 plan (the FP8 "
                             "attention mode is defined for e4m3 caches; vLLM's x2 rule for q/prob scales on "
                             "e4m3fnuz never applies here)")
        q = self.q_scales.get(layer)
        if q is not None:
            q = q.to(dtype=torch.float32, device=device)
        p = self.prob_scales.get(layer)
        if p is not None and p.numel() != 1:  # vLLM refuses these too ("per-tensor ... Q/prob")
            raise bad_argument("prob_scale", f"{p.numel()} values for layer {layer} in the checkpoint",
                               "one per-tensor prob_scale (the softmax output has no heads of its own)")
        return {"q_scale": q, "prob_scale": 1.0 if p is None else float(p.reshape(()))}

    # -- explaining the plan -----------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready: tensors become numbers (per-tensor) or lists (per-head)."""
        def conv(d: dict[int, torch.Tensor]) -> dict[str, float | list[float]]:
            return {str(k): v.tolist() for k, v in sorted(d.items())}

        return {
            "requested": self.requested, "kv_dtype": self.kv_dtype,
            "scale_granularity": self.scale_granularity, "scale_source": self.scale_source,
            "backend": self.backend, "write_backend": self.write_backend, "device": self.device,
            "checkpoint": self.checkpoint, "calibrated_for": self.calibrated_for,
            "scale_factor": self.scale_factor, "scales_loaded": self.scales_loaded,
            "loaded_layers": list(self.loaded_layers), "v_from_k_layers": list(self.v_from_k_layers),
            "defaulted_layers": list(self.defaulted_layers),
            "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_size": self.head_size,
            "layout": self.layout,
            "k_scales": conv(self.k_scales), "v_scales": conv(self.v_scales),
            "q_scales": conv(self.q_scales), "prob_scales": conv(self.prob_scales),
            "reasons": list(self.reasons), "warnings": list(self.warnings),
        }

    def _scales_lines(self) -> list[str]:
        """What :meth:`layer_scales` hands out, per kind of layer (the first line and indented ones)."""
        if self.scale_source == "dynamic":
            return ["dynamic, one per token and KV head, computed at write time"]
        gran = {"tensor": "per-tensor", "head": "per-head"}.get(self.scale_granularity or "", "")
        if gran == "per-head" and self.num_kv_heads:
            gran += f" ({self.num_kv_heads} KV heads)"
        if self.scale_source == "default":
            n = f" for {self.num_layers} layers" if self.num_layers else " for every layer"
            uncalibrated = any(w.startswith("uncalibrated") for w in self.warnings)
            caveat = "; uncalibrated, see the warning" if uncalibrated else ""
            return [f"default 1.0 (k and v), {gran}{n}: the checkpoint has no KV scales{caveat}"]
        if not self.scales_loaded:
            return [f"from the checkpoint, {gran} (config only: not read; plan from the model directory to "
                    "allocate a cache)"]
        factor = f"; x{self.scale_factor:g} for {self.kv_dtype}" if self.scale_factor != 1.0 else ""
        lines = [f"from the checkpoint, {gran}{factor}"]
        for layers, what in ((self.loaded_layers, "k and v as stored"),
                             (self.v_from_k_layers, "k as stored, v = k (no v scale; as vLLM and SGLang do)"),
                             (self.defaulted_layers, "k = v = 1.0 (no scales in the checkpoint; see the warning)")):
            if layers:
                lines.append(f"layers {ranges(layers)}: {what}")
        return lines

    def describe(self) -> str:
        """A few lines for people (``fp8kv plan``)."""
        lines = [f"checkpoint    {self.checkpoint}", f"device        {self.device}",
                 f"requested     {self.requested}"]
        if not self.is_fp8:
            lines.append("kv cache      not FP8 (kv_dtype auto: the model dtype)")
        else:
            lines.append(f"kv_dtype      {self.kv_dtype}  (allowed)")
            first, *rest = self._scales_lines()
            lines.append(f"scales        {first}")
            lines.extend(f"              {line}" for line in rest)
            if self.calibrated_for:
                lines.append(f"calibrated    for {self.calibrated_for}")
            extra = f"; write_kv: {self.write_backend}" if self.write_backend != self.backend else ""
            lines.append(f"backend       {self.backend} (paged_attention, {self.layout}){extra}")
        for r in self.reasons:
            lines.append(f"why           {r}")
        for w in self.warnings:
            lines.append(f"warning       {w}")
        return "\n".join(lines)
