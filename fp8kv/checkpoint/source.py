"""A checkpoint as fp8kv reads it: its parsed config, and its scale tensors if it is a directory
(or the scales of a vLLM/SGLang KV-scales JSON, :mod:`.legacy_scales`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InvalidArgument, bad_argument
from .config import CheckpointConfig, parse_config, show
from .files import read_json
from .legacy_scales import LegacyKVScales, is_legacy, parse_legacy, scale_like_keys
from .tensors import ScaleEntry, ScaleScan, scan

LEGACY_FILE_NAME = "kv_cache_scales.json"
"""The name vLLM's scale-extraction example gives a KV-scales JSON; reported when found in a directory."""

_FORMS = ("a model directory, a config JSON path, a KV-scales JSON path (vLLM's quantization_param_path), "
          "a config dict or None")


def check_tp_rank(tp_rank: object) -> int | None:
    """``tp_rank`` as given: None or an int >= 0 (not a bool)."""
    if tp_rank is not None and (not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or tp_rank < 0):
        raise bad_argument("tp_rank", show(tp_rank), "None or a tensor-parallel rank (an int >= 0)")
    return tp_rank


class Checkpoint:
    """A loaded checkpoint: its parsed config, and its scale tensors if it is a directory.

    ``tp_rank`` picks the rank of a KV-scales JSON (:attr:`legacy`); any other checkpoint
    refuses a ``tp_rank``, since its scales are the same on every rank.
    """

    def __init__(self, checkpoint, tp_rank: int | None = None) -> None:
        tp_rank = check_tp_rank(tp_rank)
        self.directory: Path | None = None
        self.scan: ScaleScan | None = None
        self.legacy: LegacyKVScales | None = None
        self.label = "none"
        self.warnings: list[str] = []
        extra, source, extra_source = None, "config", "hf_quant_config.json"
        if checkpoint is None:
            config: dict = {}
        elif isinstance(checkpoint, dict):
            config, self.label = checkpoint, "config dict"
        elif isinstance(checkpoint, str | os.PathLike):
            path = Path(checkpoint)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise InvalidArgument(f"checkpoint: got {str(path)!r}, expected {_FORMS} "
                                      "(no such file or directory)") from None
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
                raise InvalidArgument(f"checkpoint: got {str(path)!r}, expected {_FORMS} ({exc})") from None
            if stat.S_ISDIR(st.st_mode):
                self.directory, self.label = path, str(path)
                source = str(path / "config.json")
                config = read_json(path / "config.json", "the config.json of the model directory")
                if is_legacy(config):
                    raise bad_argument(f"checkpoint: {source}", "a KV-scales JSON (it has a kv_cache key)",
                                       "the model's config; pass the KV-scales JSON's own path as the checkpoint")
                if os.path.lexists(path / LEGACY_FILE_NAME):
                    self.warnings.append(f"{LEGACY_FILE_NAME} in the directory was not read: fp8kv reads a "
                                         "KV-scales JSON only when its path is the checkpoint (as vLLM reads it "
                                         "only from quantization_param_path)")
                hf_quant = path / "hf_quant_config.json"
                if os.path.lexists(hf_quant):
                    extra_source = str(hf_quant)
                    extra = read_json(hf_quant, "hf_quant_config.json")
            else:
                source = str(path)
                config, self.label = read_json(path, "a config JSON"), f"{path} (config only)"
        else:
            raise bad_argument("checkpoint", show(checkpoint), _FORMS)
        if self.directory is None and is_legacy(config):
            self.legacy = parse_legacy(config, source, tp_rank)
            self.config = self.legacy.config()
            self.label = source if isinstance(checkpoint, str | os.PathLike) else self.label
            return
        if tp_rank is not None:
            raise bad_argument("tp_rank", repr(tp_rank), "None: only a KV-scales JSON (vLLM's quantization_param_path) "
                               "has per-rank scales; this checkpoint's scales are the same on every rank")
        self.config: CheckpointConfig = parse_config(config, extra, source=source, extra_source=extra_source)
        kv = self.config.kv
        if self.directory is None and not kv.declared and kv.unsupported is None:
            keys = scale_like_keys(config)
            if keys:
                raise bad_argument(f"checkpoint: {source}", f"a JSON with KV-scale-like keys ({', '.join(keys)}) "
                                   f"that is no known format ({self.config.summary})",
                                   "a model config, a model directory, or a KV-scales JSON "
                                   '({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {rank: {layer: '
                                   'scale}}}}); not planned as unquantized, which would drop these scales')
        if self.directory is not None:
            self.scan = scan(self.directory, self.config.num_layers)
            if not self.scan.files:
                self.label += " (config only: no *.safetensors)"
                self.scan = None
                # listed by name only: fp8kv never unpickles
                others = sorted(p.name for p in self.directory.glob("*.bin")) + sorted(
                    p.name for p in self.directory.glob("*.pt"))
                if others:
                    self.warnings.append(f"only *.safetensors are read for scales; {', '.join(others[:3])} "
                                         "not inspected, so the config alone decides")

    @property
    def kv_entries(self) -> list[ScaleEntry]:
        return [e for e in self.scan.entries if e.role in ("k", "v", "kv")] if self.scan else []

    def stores_static_scales(self) -> bool:
        """Whether the checkpoint stores static FP8 KV scales (tensors if inspected, else declared)."""
        if self.legacy is not None:
            return True
        if self.scan is not None:
            return bool(self.kv_entries)
        kv = self.config.kv
        return kv.declared and not kv.dynamic and kv.unsupported is None


__all__ = ["Checkpoint"]
