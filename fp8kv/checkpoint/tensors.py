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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import Fp8KVError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn|attention)\.(.+)$")

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

    @property
    def where(self) -> str:
        return f"{self.name} in {self.file.name}"


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


def classify(name: str) -> tuple[int, str, int] | None:
    """``(layer, role, rank)`` of a recognised scale tensor name, else None."""
    m = _LAYER.search(name)
    if m is None or m.group(2) not in ROLES:
        return None
    role, rank = ROLES[m.group(2)]
    return int(m.group(1)), role, rank


def scan(directory: Path) -> ScaleScan:
    """List the scale tensors of every ``*.safetensors`` file in ``directory`` (headers only)."""
    files = tuple(sorted(directory.glob("*.safetensors")))
    if not files:
        return ScaleScan((), (), ())
    safe_open = _safe_open()
    entries, unknown = [], []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except Exception as exc:
            raise Fp8KVError(f"checkpoint: cannot read the safetensors header of {path}: {exc}") from None
        for name in names:
            hit = classify(name)
            if hit is not None:
                entries.append(ScaleEntry(name, path, *hit))
            elif name.rsplit(".", 1)[-1] in SCALE_LIKE:
                unknown.append(f"{name} in {path.name}")
    return ScaleScan(files, tuple(entries), tuple(unknown))


def read(entries: list[ScaleEntry]) -> dict[ScaleEntry, torch.Tensor]:
    """Read just these tensors (each file opened once), as float32 on the CPU.

    Raises :class:`Fp8KVError` naming the tensor and file for a non-float tensor or any
    value that is zero, negative, NaN or inf (also after the cast to float32).
    """
    safe_open = _safe_open()
    out: dict[ScaleEntry, torch.Tensor] = {}
    by_file: dict[Path, list[ScaleEntry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for path, group in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for e in group:
                t = f.get_tensor(e.name)
                if not t.is_floating_point():
                    raise Fp8KVError(f"checkpoint: {e.where}: got dtype {t.dtype}, expected a float scale")
                t32 = t.to(torch.float32)
                bad = ~(torch.isfinite(t32) & (t32 > 0))
                if bool(bad.any()):
                    vals = t.flatten()[bad.flatten()][:4].tolist()
                    raise Fp8KVError(f"checkpoint: {e.where}: got {vals}, expected finite scales > 0 "
                                     f"(zero, negative, NaN and inf scales are refused)")
                out[e] = t32
    return out


def shape_scale(t: torch.Tensor, entry: ScaleEntry, num_heads: int | None) -> torch.Tensor:
    """Per-tensor ``[]``/``[1]`` (any one-element shape) -> ``()``; per-head ``[H]``/``[H,1,1]`` -> ``(H,)``.

    ``num_heads`` is the config's KV head count (query heads for ``q``); None skips that check.
    """
    shape = tuple(t.shape)
    if t.numel() == 1:
        return t.reshape(())
    if len(shape) == 1 or (len(shape) == 3 and shape[1:] == (1, 1)):
        if num_heads is not None and shape[0] != num_heads:
            raise Fp8KVError(f"checkpoint: {entry.where}: got shape {list(shape)}, expected [] or [1] "
                             f"(per-tensor) or [{num_heads}] / [{num_heads}, 1, 1] (per-head, "
                             f"{num_heads} heads in the config)")
        return t.reshape(shape[0])
    expect = num_heads if num_heads is not None else "H"
    raise Fp8KVError(f"checkpoint: {entry.where}: got shape {list(shape)}, expected [] or [1] (per-tensor) "
                     f"or [{expect}] / [{expect}, 1, 1] (per-head)")


def adjust(t: torch.Tensor, factor: float, entry: ScaleEntry, reason: str) -> torch.Tensor:
    """``t * factor`` in float32, refusing (naming the tensor) when that overflows."""
    if factor == 1.0:
        return t
    out = t * factor
    if not bool(torch.isfinite(out).all()):
        worst = float(t.max())
        raise Fp8KVError(f"checkpoint: {entry.where}: scale {worst:.6g} x {factor:g} overflows float32 "
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
