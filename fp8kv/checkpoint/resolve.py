"""``resolve_kv_cache``: the KV-cache policy of a checkpoint on a device.

Order of decisions (each refusal raises :class:`fp8kv.Fp8KVError` saying why and
what would work):

1. What the checkpoint stores: a model directory is judged on the scale tensors
   its safetensors actually hold; a config alone on what it declares.
2. The format: ``auto`` selects the checkpoint's FP8 KV scheme if it has one, else
   no FP8; ``fp8`` is the device's e4m3 (``fp8_e4m3fnuz`` on gfx942).
3. The gate: checkpoint scales calibrated for one format are only used with that
   format, or with its fnuz twin on gfx942 (OCP e4m3 scales doubled for e4m3fnuz).
   ``fp8_e5m2`` is refused only when the checkpoint stores e4m3 KV scales:
   weight-only and unquantized checkpoints take it with default scales.
4. The device, through the registry: some backend must store (``write_kv``) and
   read (``paged_attention``) the format there. The fnuz formats are gfx942's: on
   another GPU only a fast backend that claims them counts (a serve-anything
   fallback like the reference does not).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ..cache import CacheSpec, check_layout
from ..errors import Fp8KVError, bad_argument
from ..formats import FNUZ_PLATFORMS, FORMATS, Fp8Format, get_format
from ..probe import SIMULATED, DeviceInfo, probe, simulated
from ..registry import Backend, registry, select_backend
from ..request import Request
from .config import CheckpointConfig
from .plan import KVCachePlan
from .scales_plan import build_scales
from .source import Checkpoint, check_tp_rank

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")
FNUZ_TWIN = {"fp8_e4m3": "fp8_e4m3fnuz", "fp8_e5m2": "fp8_e5m2fnuz"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
          "float32": torch.float32, "float": torch.float32}


def _device(device) -> DeviceInfo:
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, str) and device in SIMULATED:
        return simulated(device)
    try:
        return probe(device)
    except RuntimeError as exc:  # torch's "Invalid device string"
        raise Fp8KVError(f"device: got {device!r}, expected a DeviceInfo, a torch device or a simulated "
                         f"device name ({', '.join(SIMULATED)}): {exc}") from None


def _device_label(dev: DeviceInfo) -> str:
    return f"{dev.name} [{dev.arch}]" if dev.arch else dev.name


def _scale_factor(calibrated: str, fmt: Fp8Format) -> float | None:
    """How scales calibrated for ``calibrated`` convert to ``fmt``; None if they don't."""
    if fmt.name == calibrated:
        return 1.0
    if FNUZ_TWIN.get(calibrated) == fmt.name:
        # Same bits decode to half the value in fnuz (exponent bias +1). For e4m3 the range also
        # shrinks (448 -> 240): doubling the dequant scale maps the calibrated amax to 224.
        return 2.0 if calibrated == "fp8_e4m3" else 1.0
    return None


def _compatible_names(calibrated: str, dev: DeviceInfo) -> str:
    names = [calibrated]
    if calibrated == "fp8_e4m3":
        names.append("fp8" + (f" (= {dev.fp8_alias} here)" if dev.fp8_alias != calibrated else ""))
    if dev.arch in FNUZ_PLATFORMS and calibrated in FNUZ_TWIN:
        names.append(FNUZ_TWIN[calibrated])
    return " or ".join(dict.fromkeys(names))


def _io_dtype(cfg: CheckpointConfig, dev: DeviceInfo, reasons: list[str]) -> torch.dtype:
    dtype = DTYPES.get((cfg.torch_dtype or "bfloat16").lower(), torch.bfloat16)
    if dtype == torch.bfloat16 and dev.sm is not None and dev.sm < 80:
        reasons.append(f"{dev.arch} has no bfloat16: attention runs in float16")
        return torch.float16
    return dtype


def _accepts(backend: Backend, dev: DeviceInfo, req: Request) -> str | None:
    """None if ``backend`` counts as serving ``req`` on ``dev``, else why not."""
    why = backend.supports(dev, req)
    if why is not None:
        return why
    fmt = FORMATS[req.kv_dtype]
    if fmt.fnuz and dev.is_gpu and dev.arch not in FNUZ_PLATFORMS and not backend.info.fast:
        return f"{fmt.name} is the gfx942 format; the {backend.name!r} fallback does not count on {dev.arch}"
    return None


def _requests(fmt: Fp8Format, granularity: str, cfg: CheckpointConfig, dev: DeviceInfo, layout: str,
              io_dtype: torch.dtype) -> tuple[Request, Request]:
    spec = CacheSpec(fmt.name, layout, granularity, 1, 16, cfg.num_kv_heads or 1, cfg.head_size or 128,
                     torch.device("cpu" if dev.torch_device == "cpu" else "cuda"))
    return Request.for_write(spec, io_dtype), Request.for_attention(spec, io_dtype)


def _where_servable(reqs: tuple[Request, Request]) -> str:
    """Which simulated devices some backend serves both requests on, e.g. ``triton on sm80, sm90``."""
    found: dict[str, list[str]] = {}
    for name in SIMULATED:
        dev = simulated(name)
        rs = [dataclasses.replace(r, device_type="cuda" if dev.is_gpu else "cpu") for r in reqs]
        for b in registry().backends.values():
            if all(_accepts(b, dev, r) is None for r in rs):
                found.setdefault(b.name, []).append(name)
    if not found:
        return "no installed backend stores it on any known device"
    return "; ".join(f"{b} on {', '.join(devs)}" for b, devs in sorted(found.items()))


def _select(reqs: tuple[Request, Request], dev: DeviceInfo, warns: list[str]) -> tuple[str, str]:
    """(write backend, attention backend) names, or a refusal naming where the format works."""
    fmt = reqs[0].kv_dtype
    names: list[str] = []
    slow: list[tuple[str, str, str]] = []
    for req in reqs:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # reported in plan.warnings instead
                sel = select_backend(req, device=dev)
        except Fp8KVError as exc:
            raise Fp8KVError(f"kv_cache_dtype: {fmt} cannot be served on {_device_label(dev)} ({exc}); "
                             f"it can be on: {_where_servable(reqs)}") from None
        chosen = sel.backend
        if not sel.forced and _accepts(chosen, dev, req) is not None:
            ranked = sorted(registry().backends.values(), key=lambda b: (-b.info.priority, b.name))
            verdicts = {b.name: _accepts(b, dev, req) for b in ranked}
            able = [b for b in ranked if verdicts[b.name] is None]
            if not able:
                why = "; ".join(f"{n}: {r}" for n, r in verdicts.items())
                raise Fp8KVError(f"kv_cache_dtype: {fmt} is not a format for {_device_label(dev)} ({why}); "
                                 f"use fp8 (= {dev.fp8_alias}) or fp8_e5m2 there. It can be served on: "
                                 f"{_where_servable(reqs)}")
            chosen = able[0]
        if not chosen.info.fast and dev.is_gpu:
            others = "; ".join(f"{n}: {r}" for n, r in sel.reasons.items()) or "no fast backend is installed"
            slow.append((req.op, chosen.name, others))
        names.append(chosen.name)
    if slow:
        ops = " and ".join(op for op, _, _ in slow)
        names_ = sorted({b for _, b, _ in slow})
        why = "; ".join(dict.fromkeys(o for _, _, o in slow))
        warns.append(f"{ops} run{'s' if len(slow) == 1 else ''} on the slow "
                     f"{', '.join(map(repr, names_))} backend on {dev.arch} ({why})")
    return names[0], names[1]


def _no_fp8(requested: str, ck: Checkpoint, dev: DeviceInfo, reasons: list[str],
            warns: list[str]) -> KVCachePlan:
    cfg = ck.config
    return KVCachePlan(requested, "auto", None, "none", device=_device_label(dev),
                       checkpoint=f"{ck.label}: {cfg.summary}", num_layers=cfg.num_layers,
                       num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size,
                       reasons=tuple(reasons), warnings=tuple(warns))


def resolve_kv_cache(kv_cache_dtype: str = "auto", checkpoint=None, device=None, *,
                     layout: str = "NHD", tp_rank: int | None = None) -> KVCachePlan:
    """Plan the KV cache of ``checkpoint`` on ``device``: format, scales, backend.

    Args:
        kv_cache_dtype: ``"auto"`` (the checkpoint's FP8 KV scheme if it declares one,
            else no FP8), ``"fp8"`` (the device's e4m3), ``"fp8_e4m3"``, ``"fp8_e5m2"``,
            ``"fp8_e4m3fnuz"`` or ``"fp8_e5m2fnuz"``.
        checkpoint: a model directory (``config.json`` + ``*.safetensors``), a path to a
            config JSON, a path to a vLLM/SGLang KV-scales JSON (their ``quantization_param_path``
            file: one scale per layer and tensor-parallel rank, used for both K and V), a config
            or KV-scales dict, or None (no checkpoint).
        device: a :class:`fp8kv.plugins.DeviceInfo`, a simulated device name (``"sm80"``), a torch
            device, or None (``fp8kv.probe()``, which honours ``simulate_device``).
        layout: the cache layout the backend is selected for (``"NHD"`` or ``"HND"``).
        tp_rank: the tensor-parallel rank whose scales a KV-scales JSON gives; None loads a
            one-rank file and is refused for a file with several ranks. Other checkpoints
            refuse a ``tp_rank`` (their scales are the same on every rank).
    Returns:
        a :class:`KVCachePlan`; scales are float32 tensors of shape ``()`` or ``(H,)``.
    Raises:
        Fp8KVError: the format is refused for this checkpoint or device (the message
            says why and what would work), or the checkpoint's scales are invalid.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise bad_argument("kv_cache_dtype", repr(kv_cache_dtype), f"one of {', '.join(KV_CACHE_DTYPES)}")
    if not isinstance(layout, str):
        raise bad_argument("layout", repr(layout), "'NHD' or 'HND'")
    check_layout(layout)
    check_tp_rank(tp_rank)
    dev = _device(device)
    ck = Checkpoint(checkpoint, tp_rank)
    cfg, kv = ck.config, ck.config.kv
    reasons: list[str] = []
    if ck.legacy is not None:
        reasons.append(f"a KV-scales JSON: tensor-parallel rank {ck.legacy.tp_rank}'s scaling_factor of each layer "
                       "is both its k and v scale, as vLLM and SGLang use it")
    warns: list[str] = list(ck.warnings)
    if ck.scan is not None and ck.scan.unrecognized:
        names = ", ".join(ck.scan.unrecognized[:6]) + (" ..." if len(ck.scan.unrecognized) > 6 else "")
        warns.append(f"ignored scale-like tensors with unrecognised names: {names}")
    # 1. what the checkpoint stores
    stores = ck.stores_static_scales()
    calibrated = (kv.calibrated_for or "fp8_e4m3") if stores else None

    # 2. the format
    if kv.unsupported is not None:
        what = (f"this checkpoint's KV cache is quantized as {kv.unsupported} ({kv.field}); "
                "fp8kv stores FP8 only")
        if kv_cache_dtype != "auto":
            raise Fp8KVError(f"kv_cache_dtype: got {kv_cache_dtype!r}: {what}; use kv_cache_dtype='auto'")
        warns.append(what + "; the KV cache stays in the model dtype")
        return _no_fp8(kv_cache_dtype, ck, dev, reasons, warns)
    if kv_cache_dtype == "auto":
        if kv.declared and kv.dynamic:
            target = dev.fp8_alias
            reasons.append(f"auto: the checkpoint declares dynamic FP8 KV scales ({kv.field})")
        elif kv.declared and stores:
            target = calibrated if dev.arch not in FNUZ_PLATFORMS else FNUZ_TWIN.get(calibrated, calibrated)
            reasons.append(f"auto: the checkpoint declares an FP8 KV cache ({kv.field}), calibrated for "
                           f"{calibrated}")
        else:
            if kv.explicit and ck.scan is not None:
                warns.append(f"the config declares an FP8 KV cache ({kv.field}) but no KV scale tensors were "
                             f"found in {len(ck.scan.files)} safetensors file(s); not enabling FP8")
            reasons.append("auto: the checkpoint declares no FP8 KV cache, so the cache keeps the "
                           "model dtype")
            return _no_fp8(kv_cache_dtype, ck, dev, reasons, warns)
    else:
        target = dev.fp8_alias if kv_cache_dtype == "fp8" else kv_cache_dtype
        if kv_cache_dtype == "fp8":
            reasons.append(f"fp8 is {target} on {dev.arch or 'cpu'}")
    fmt = get_format(target)
    granularity = kv.granularity if kv.declared else "tensor"

    # 3. the gate: scales calibrated for another format
    factor = 1.0
    if stores and granularity != "token_head":
        f = _scale_factor(calibrated, fmt)
        if f is None:
            seen = (f"{len(ck.kv_entries)} KV scale tensors, e.g. {ck.kv_entries[0].where}"
                    if ck.kv_entries else f"declared by {kv.field}")
            asked = repr(kv_cache_dtype) + (f" (= {fmt.name})" if fmt.name != kv_cache_dtype else "")
            raise Fp8KVError(
                f"kv_cache_dtype: got {asked}, but this checkpoint's KV scales were calibrated for "
                f"{calibrated} ({cfg.summary}; {seen}); reading them as {fmt.name} would mis-scale every "
                f"K and V. Use {_compatible_names(calibrated, dev)}, or a checkpoint without FP8 KV scales")
        factor = f
        reasons.append(f"the checkpoint stores KV scales calibrated for {calibrated}"
                       + (f"; x{factor:g} for {fmt.name}" if factor != 1.0 else ""))
    elif not stores and not (kv.declared and kv.dynamic):
        reasons.append(f"{cfg.summary}: no FP8 KV scales in the checkpoint, so {fmt.name} uses default "
                       "scales 1.0")
        if kv.explicit and ck.scan is not None:
            warns.append(f"the config declares an FP8 KV cache ({kv.field}) but no KV scale tensors were "
                         f"found in {len(ck.scan.files)} safetensors file(s)")
    if dev.arch in FNUZ_PLATFORMS and not fmt.fnuz:
        warns.append(f"{fmt.name} is not native on {dev.arch} (its FP8 is fnuz); fp8 selects {dev.fp8_alias}")

    # 4. the scales (read before the registry: their shapes decide the granularity)
    scales = build_scales(ck, fmt, granularity, stores, factor, warns)

    # 5. the device, through the registry
    io_dtype = _io_dtype(cfg, dev, reasons)
    write_b, attn_b = _select(_requests(fmt, scales.granularity, cfg, dev, layout, io_dtype), dev, warns)
    return KVCachePlan(
        kv_cache_dtype, fmt.name, scales.granularity, scales.source,
        scales.k, scales.v, scales.q, scales.prob,
        backend=attn_b, write_backend=write_b, device=_device_label(dev),
        checkpoint=f"{ck.label}: {cfg.summary}", calibrated_for=calibrated, scale_factor=factor,
        scales_loaded=scales.loaded, loaded_layers=scales.loaded_layers,
        v_from_k_layers=scales.v_from_k_layers, defaulted_layers=scales.defaulted_layers,
        num_layers=cfg.num_layers or scales.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size, layout=layout,
        reasons=tuple(reasons), warnings=tuple(warns),
    )

