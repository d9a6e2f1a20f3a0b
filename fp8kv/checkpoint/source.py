"""A checkpoint as fp8kv reads it: its parsed config, and its scale tensors if it is a directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InvalidArgument, bad_argument
from .config import CheckpointConfig, parse_config, show
from .files import read_json
from .tensors import ScaleEntry, ScaleScan, scan


class Checkpoint:
    """A loaded checkpoint: its parsed config, and its scale tensors if it is a directory."""

    def __init__(self, checkpoint) -> None:
        self.directory: Path | None = None
        self.scan: ScaleScan | None = None
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
                raise InvalidArgument(f"checkpoint: got {str(path)!r}, expected a model directory, a config.json "
                                      "path or a config dict (no such file or directory)") from None
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
                raise InvalidArgument(f"checkpoint: got {str(path)!r}, expected a model directory, a config.json "
                                      f"path or a config dict ({exc})") from None
            if stat.S_ISDIR(st.st_mode):
                self.directory, self.label = path, str(path)
                source = str(path / "config.json")
                config = read_json(path / "config.json", "the config.json of the model directory")
                hf_quant = path / "hf_quant_config.json"
                if os.path.lexists(hf_quant):
                    extra_source = str(hf_quant)
                    extra = read_json(hf_quant, "hf_quant_config.json")
            else:
                source = str(path)
                config, self.label = read_json(path, "a config JSON"), f"{path} (config only)"
        else:
            raise bad_argument("checkpoint", show(checkpoint),
                               "a model directory, a config JSON path, a config dict or None")
        self.config: CheckpointConfig = parse_config(config, extra, source=source, extra_source=extra_source)
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
        if self.scan is not None:
            return bool(self.kv_entries)
        kv = self.config.kv
        return kv.declared and not kv.dynamic and kv.unsupported is None


__all__ = ["Checkpoint"]
