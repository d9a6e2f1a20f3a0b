"""What the device can do: vendor, arch, native FP8 conversions, available toolchains.

``probe(device)`` is cached per device; ``FP8KV_SIMULATE_DEVICE`` or
``simulate_device("sm80")`` replace the answer with a simulated device so selection
can be checked without the hardware.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import torch

from .errors import bad_argument


@dataclass(frozen=True)
class DeviceInfo:
    """A device as backends see it.

    Attributes:
        vendor: ``"cpu"``, ``"nvidia"`` or ``"amd"``.
        name: marketing name (``"NVIDIA H100 80GB HBM3"``) or ``"cpu"``.
        arch: ``"sm80"``… for NVIDIA, ``"gfx942"``… for AMD, ``None`` for the CPU.
        torch_device: ``"cpu"`` or ``"cuda:0"`` (ROCm devices are ``cuda`` in torch).
        native_fp8: formats the hardware converts to/from natively.
        triton: whether Triton imports and can run here (the CPU only through
            ``TRITON_INTERPRET=1``).
        cupy: whether CuPy imports and sees a CUDA device.
        flash_attn3: whether ``flash_attn_interface`` (FlashAttention-3) imports.
        memory_bytes: total device memory (0 when unknown).
        simulated: True for a simulated device.
    """

    vendor: str
    name: str
    arch: str | None
    torch_device: str = "cpu"
    native_fp8: frozenset[str] = field(default_factory=frozenset)
    triton: bool = False
    cupy: bool = False
    flash_attn3: bool = False
    memory_bytes: int = 0
    simulated: bool = False

    @property
    def sm(self) -> int | None:
        """Compute capability as an int (``90`` for sm90), None off NVIDIA."""
        if self.arch and self.arch.startswith("sm"):
            return int(self.arch[2:])
        return None

    @property
    def fp8_alias(self) -> str:
        """What the alias ``fp8`` means here: the platform's e4m3."""
        return "fp8_e4m3fnuz" if self.arch == "gfx942" else "fp8_e4m3"

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"


OCP = frozenset({"fp8_e4m3", "fp8_e5m2"})
FNUZ = frozenset({"fp8_e4m3fnuz", "fp8_e5m2fnuz"})


def native_fp8_formats(arch: str | None) -> frozenset[str]:
    """Formats with hardware conversions: sm89+ OCP, gfx942 fnuz, gfx950 OCP."""
    if arch is None:
        return frozenset()
    if arch.startswith("sm"):
        return OCP if int(arch[2:]) >= 89 else frozenset()
    if arch == "gfx942":
        return FNUZ
    if arch.startswith("gfx95"):
        return OCP
    return frozenset()


SIMULATED = {
    "cpu": ("cpu", "cpu (simulated)", None, 0),
    "sm70": ("nvidia", "Tesla V100 (simulated)", "sm70", 32 << 30),
    "sm75": ("nvidia", "Tesla T4 (simulated)", "sm75", 16 << 30),
    "sm80": ("nvidia", "A100 (simulated)", "sm80", 80 << 30),
    "sm86": ("nvidia", "RTX 3090 (simulated)", "sm86", 24 << 30),
    "sm89": ("nvidia", "L40S (simulated)", "sm89", 48 << 30),
    "sm90": ("nvidia", "H100 (simulated)", "sm90", 80 << 30),
    "gfx942": ("amd", "MI300X (simulated)", "gfx942", 192 << 30),
    "gfx950": ("amd", "MI355X (simulated)", "gfx950", 288 << 30),
}
"""Devices that ``FP8KV_SIMULATE_DEVICE`` / :func:`simulate_device` can stand in for."""

_simulated_override: list[str] = []


def simulated(name: str) -> DeviceInfo:
    """The DeviceInfo of a simulated device (toolchains assumed present on GPUs)."""
    if name not in SIMULATED:
        raise bad_argument("device", repr(name), f"one of {sorted(SIMULATED)}")
    vendor, label, arch, mem = SIMULATED[name]
    gpu = vendor != "cpu"
    return DeviceInfo(
        vendor=vendor, name=label, arch=arch, torch_device="cuda:0" if gpu else "cpu",
        native_fp8=native_fp8_formats(arch),
        triton=gpu and (arch not in ("sm70", "sm75")),
        cupy=vendor == "nvidia", flash_attn3=False, memory_bytes=mem, simulated=True,
    )


@contextlib.contextmanager
def simulate_device(name: str) -> Iterator[DeviceInfo]:
    """Within the block, ``probe()`` answers with the simulated device ``name``."""
    info = simulated(name)
    _simulated_override.append(name)
    try:
        yield info
    finally:
        _simulated_override.pop()


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def triton_interpreter() -> bool:
    """True when Triton kernels run through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _probe_real(device_str: str, interpret: bool) -> DeviceInfo:
    dev = torch.device(device_str)
    if dev.type != "cuda":
        return DeviceInfo(vendor="cpu", name="cpu", arch=None, torch_device="cpu",
                          triton=interpret and _importable("triton"))
    props = torch.cuda.get_device_properties(dev)
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]
        vendor = "amd"
    else:
        arch = f"sm{props.major}{props.minor}"
        vendor = "nvidia"
    return DeviceInfo(
        vendor=vendor, name=props.name, arch=arch, torch_device=str(dev),
        native_fp8=native_fp8_formats(arch),
        triton=_importable("triton"), cupy=vendor == "nvidia" and _importable("cupy"),
        flash_attn3=_importable("flash_attn_interface"), memory_bytes=int(props.total_memory),
    )


def probe(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe ``device`` (default: the current CUDA device if any, else the CPU).

    Simulation (``simulate_device`` or ``FP8KV_SIMULATE_DEVICE``) takes precedence.
    Cached: cheap enough for the hot path.
    """
    if _simulated_override:
        return simulated(_simulated_override[-1])
    env = os.environ.get("FP8KV_SIMULATE_DEVICE")
    if env:
        return simulated(env)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _probe_real(str(dev), dev.type == "cpu" and triton_interpreter())
