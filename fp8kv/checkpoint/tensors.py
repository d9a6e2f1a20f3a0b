"""Finding and reading the attention scale tensors of a safetensors checkpoint.

Only the safetensors headers are read to find names; ``get_tensor`` is called for
scale tensors only, never for weights. Recognised names (``L`` = layer index, the
attention module may be called ``self_attn``, ``attn`` or ``attention``):

================================== ======= ============================================
name                               role    producer
================================== ======= ============================================
``layers.L.self_attn.k_scale``     k       compressed-tensors / llm-compressor, FP8
``layers.L.self_attn.v_scale``     v       (also ``...self_attn.attn.{k,v}_scale``)
``layers.L.self_attn.q_scale``     q       compressed-tensors attention quantization
``layers.L.self_attn.prob_scale``  prob    FP8 attention (softmax output)
``layers.L.self_attn.k_proj.k_scale`` k    ModelOpt
``layers.L.self_attn.v_proj.v_scale`` v    ModelOpt
``layers.L.self_attn.k_proj.output_scale`` k  Quark, older AutoFP8 / compressed-tensors
``layers.L.self_attn.v_proj.output_scale`` v
``layers.L.self_attn.kv_scale``    kv      legacy AutoFP8 (one scale for both K and V)
================================== ======= ============================================

When several names give the same layer's scale, the earlier row wins.

Bounds: a layer index in a name must be below the config's ``num_hidden_layers`` (or
:data:`~fp8kv.checkpoint.config.MAX_LAYERS` when the config has none), and a scale tensor
has at most :data:`MAX_SCALE_ELEMENTS` elements (checked from the header, before reading
it). Nothing loops or allocates up to an index read from a name: scales are kept in dicts
keyed by the indices found. Only regular files are opened (:mod:`.files`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import Fp8KVError, InvalidArgument
from .config import MAX_HEADS, MAX_LAYERS, show
from .files import regular_file, safetensors_header

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn|attention)\.(.+)$")

MAX_SCALE_ELEMENTS = MAX_HEADS
"""Most elements a scale tensor may have (per-tensor: 1; per-head: the KV head count)."""

MIN_SCALE = torch.finfo(torch.float32).tiny
"""Smallest scale accepted: 2^-126, the least normal float32. Subnormal scales keep only a few
significant bits, and the reciprocal a writer quantizes with overflows float32 below ~2^-128."""

ROLES: dict[str, tuple[str, int]] = {
    "k_scale": ("k", 0), "attn.k_scale": ("k", 0),
    "v_scale": ("v", 0), "attn.v_scale": ("v", 0),
    "q_scale": ("q", 0), "attn.q_scale": ("q", 0),
    "prob_scale": ("prob", 0), "attn.prob_scale": ("prob", 0),
    "k_proj.k_scale": ("k", 1), "v_proj.v_scale": ("v", 1),
    "k_proj.output_scale": ("k", 2), "v_proj.output_scale": ("v", 2),
    "kv_scale": ("kv", 3),
}
"""Suffix after ``layers.L.<attn>.`` -> (role, rank); a lower rank wins."""

SCALE_LIKE = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")
"""Name endings that look like attention scales; unmatched ones are reported, not silently dropped."""


@dataclass(frozen=True)
class ScaleEntry:
    """One scale tensor found in a checkpoint (not yet read)."""

    name: str
    file: Path
    layer: int
    role: str
    rank: int
    shape: tuple[int, ...] = ()

    @property
    def where(self) -> str:
        return f"{short(self.name)} in {self.file.name}"


@dataclass(frozen=True)
class ScaleScan:
    """What the safetensors files of a directory hold, from their headers.

    Attributes:
        files: every ``*.safetensors`` file looked at.
        entries: the recognised scale tensors.
        unrecognized: scale-looking names that match no known pattern.
    """

    files: tuple[Path, ...]
    entries: tuple[ScaleEntry, ...]
    unrecognized: tuple[str, ...]


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors is a test dependency
        raise Fp8KVError("checkpoint: reading scales from *.safetensors needs the 'safetensors' package "
                         "(pip install safetensors)") from None
    return safe_open


def short(name: str, limit: int = 160) -> str:
    """``name``, shortened in the middle when longer than ``limit`` (for messages)."""
    return name if len(name) <= limit else f"{name[:limit - 40]}...({len(name)} chars)...{name[-24:]}"


def _match(name: str) -> tuple[str, str, int] | None:
    """``(layer digits, role, rank)`` of a recognised scale tensor name, else None."""
    m = _LAYER.search(name)
    if m is None or m.group(2) not in ROLES:
        return None
    return (m.group(1), *ROLES[m.group(2)])


def classify(name: str) -> tuple[int, str, int] | None:
    """``(layer, role, rank)`` of a recognised scale tensor name, else None.

    A layer index of more than 9 digits is returned as :data:`MAX_LAYERS` (out of range for
    every config) rather than parsed.
    """
    hit = _match(name)
    if hit is None:
        return None
    digits, role, rank = hit
    return (int(digits) if len(digits) <= 9 else MAX_LAYERS), role, rank


def _shape(name: str, path: Path, info: object) -> tuple[int, ...]:
    """The shape of a recognised scale tensor from its header entry, bounded."""
    where = f"checkpoint: {short(name)} in {path.name}"
    shape = info.get("shape") if isinstance(info, dict) else None
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 2**40 for d in shape)):
        raise InvalidArgument(f"{where}: got the header entry {show(info)}, expected "
                              "{\"dtype\": ..., \"shape\": [at most 8 ints >= 0], \"data_offsets\": ...}")
    n = math.prod(shape)
    if n > MAX_SCALE_ELEMENTS:
        raise InvalidArgument(f"{where}: got shape {shape} ({n} elements), expected a per-tensor or per-head "
                              f"scale of at most {MAX_SCALE_ELEMENTS} elements; not read")
    return tuple(shape)


def scan(directory: Path, num_layers: int | None = None, layers_field: str = "num_hidden_layers") -> ScaleScan:
    """List the scale tensors of every ``*.safetensors`` file in ``directory`` (headers only).

    Layer indices must be below ``num_layers`` (the config's ``layers_field``), or below
    :data:`MAX_LAYERS` when it is None. Raises :class:`InvalidArgument` naming the file for
    anything but a regular file (or a symlink to one), an unreadable or oversized header,
    and naming the tensor for an out-of-range layer or an oversized scale.
    """
    files = tuple(sorted(directory.glob("*.safetensors")))
    if not files:
        return ScaleScan((), (), ())
    limit = num_layers if num_layers is not None else MAX_LAYERS
    bound = (f"< {layers_field}={num_layers}" if num_layers is not None
             else f"< {MAX_LAYERS} (the config gives no layer count; fp8kv's bound)")
    entries, unknown = [], []
    for path in files:
        header = safetensors_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            hit = _match(name)
            if hit is None:
                if name.rsplit(".", 1)[-1] in SCALE_LIKE:
                    unknown.append(f"{short(name)} in {path.name}")
                continue
            digits, role, rank = hit
            if len(digits) > 9 or int(digits) >= limit:
                shown = digits if len(digits) <= 12 else f"{digits[:12]}... ({len(digits)} digits)"
                raise InvalidArgument(f"checkpoint: {short(name)} in {path.name}: got layer {shown}, "
                                      f"expected {bound}")
            entries.append(ScaleEntry(name, path, int(digits), role, rank, _shape(name, path, info)))
    return ScaleScan(files, tuple(entries), tuple(unknown))


def read(entries: list[ScaleEntry]) -> dict[ScaleEntry, torch.Tensor]:
    """Read just these tensors (each file opened once), as float32 on the CPU.

    Raises :class:`InvalidArgument` naming the tensor and file for a non-float tensor or any
    value that is zero, negative, subnormal (below 2^-126), NaN or inf (also after the cast
    to float32).
    """
    safe_open = _safe_open()
    out: dict[ScaleEntry, torch.Tensor] = {}
    by_file: dict[Path, list[ScaleEntry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for path, group in by_file.items():
        regular_file(path, "a safetensors file")  # checked again: it may have changed since the scan
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise InvalidArgument(f"checkpoint: {path}: cannot open it as safetensors ({exc})") from None
        with f:
            for e in group:
                try:
                    t = f.get_tensor(e.name)
                except Exception as exc:
                    raise InvalidArgument(f"checkpoint: {e.where}: cannot read it ({exc})") from None
                out[e] = check_values(t, e.where)
    return out


def check_values(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` as float32, refusing (naming ``where``) non-float, zero, negative, subnormal, NaN, inf."""
    if not t.is_floating_point():
        raise InvalidArgument(f"checkpoint: {where}: got dtype {t.dtype}, expected a float scale")
    if t.numel() > MAX_SCALE_ELEMENTS:
        raise InvalidArgument(f"checkpoint: {where}: got {t.numel()} elements, expected at most "
                              f"{MAX_SCALE_ELEMENTS}")
    t32 = t.to(torch.float32)
    bad = ~(torch.isfinite(t32) & (t32 >= MIN_SCALE))
    if bool(bad.any()):
        vals = t.flatten()[bad.flatten()][:4].tolist()
        raise InvalidArgument(f"checkpoint: {where}: got {vals}, expected finite scales >= 2^-126 "
                              f"({MIN_SCALE:.6g}; zero, negative, subnormal, NaN and inf scales are refused)")
    return t32


def shape_scale(t: torch.Tensor, entry: ScaleEntry, num_heads: int | None) -> torch.Tensor:
    """Per-tensor ``[]``/``[1]`` (any one-element shape) -> ``()``; per-head ``[H]``/``[H,1,1]`` -> ``(H,)``.

    ``num_heads`` is the config's KV head count (query heads for ``q``); None skips that check.
    """
    shape = tuple(t.shape)
    if t.numel() == 1:
        return t.reshape(())
    if len(shape) == 1 or (len(shape) == 3 and shape[1:] == (1, 1)):
        if num_heads is not None and shape[0] != num_heads:
            raise InvalidArgument(f"checkpoint: {entry.where}: got shape {list(shape)}, expected [] or [1] "
                             f"(per-tensor) or [{num_heads}] / [{num_heads}, 1, 1] (per-head, "
                             f"{num_heads} heads in the config)")
        return t.reshape(shape[0])
    expect = num_heads if num_heads is not None else "H"
    raise InvalidArgument(f"checkpoint: {entry.where}: got shape {list(shape)}, expected [] or [1] (per-tensor) "
                     f"or [{expect}] / [{expect}, 1, 1] (per-head)")


def adjust(t: torch.Tensor, factor: float, entry: ScaleEntry, reason: str) -> torch.Tensor:
    """``t * factor`` in float32, refusing (naming the tensor) when that overflows."""
    if factor == 1.0:
        return t
    out = t * factor
    if not bool(torch.isfinite(out).all()):
        worst = float(t.max())
        raise InvalidArgument(f"checkpoint: {entry.where}: scale {worst:.6g} x {factor:g} overflows float32 "
                         f"(max {torch.finfo(torch.float32).max:.6g}); {reason}; refusing rather than "
                         "producing an infinite scale")
    return out


def ranges(layers) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, run = [], []
    for x in sorted(set(layers)):
        if run and x == run[-1] + 1:
            run.append(x)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [x]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out) if out else "none"
