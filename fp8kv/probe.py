"""What the device can do: vendor, arch, native FP8 conversions, available toolchains.

``probe(device)`` is cached per device; ``FP8KV_SIMULATE_DEVICE`` or
``simulate_device("sm80")`` replace the answer with a simulated device so selection
can be checked without the hardware.

Toolchain fields follow one rule on real and simulated devices alike:

* ``triton``: Triton imports and supports the device (NVIDIA sm80+, AMD GPUs; the CPU
  only through its interpreter, ``TRITON_INTERPRET=1``);
* ``cupy``: CuPy imports (NVIDIA only).

A simulated GPU assumes every toolchain it could run is installed; override single
fields with ``simulate_device("sm90", cupy=False)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import torch

from . import settings
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

    @property
    def device_type(self) -> str:
        """The torch device type tensors of this device have (``"cpu"`` or ``"cuda"``)."""
        return self.torch_device.split(":")[0]

    def describe(self) -> str:
        """One line: name, arch, native FP8, toolchains, memory (for ``fp8kv probe``)."""
        tools = [t for t, ok in (("triton" + (" (interpreter)" if self.triton and not self.is_gpu else ""),
                                  self.triton), ("cupy", self.cupy)) if ok]
        mem = f"{self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else "unknown"
        return (f"{self.name} [{self.vendor}{', ' + self.arch if self.arch else ''}]"
                f"{' (simulated)' if self.simulated and 'simulated' not in self.name else ''}; "
                f"native FP8 conversions: {', '.join(sorted(self.native_fp8)) or 'none'}; "
                f"toolchains: {', '.join(tools) or 'none'}; memory: {mem}")

    def as_dict(self) -> dict:
        """JSON-friendly fields (``native_fp8`` sorted)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["native_fp8"] = sorted(self.native_fp8)
        return d


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

_simulated_override: list[DeviceInfo] = []


def triton_supports(vendor: str, arch: str | None) -> bool:
    """Whether Triton (3.x) compiles for this GPU: NVIDIA sm80+ and AMD GPUs."""
    if vendor == "amd":
        return True
    return vendor == "nvidia" and arch is not None and int(arch[2:]) >= 80


@cache
def simulated(name: str) -> DeviceInfo:
    """The DeviceInfo of a simulated device (toolchains it could run assumed installed)."""
    if name not in SIMULATED:
        raise bad_argument("FP8KV_SIMULATE_DEVICE / simulate_device", repr(name), f"one of {list(SIMULATED)}")
    vendor, label, arch, mem = SIMULATED[name]
    gpu = vendor != "cpu"
    return DeviceInfo(
        vendor=vendor, name=label, arch=arch, torch_device="cuda:0" if gpu else "cpu",
        native_fp8=native_fp8_formats(arch), triton=triton_supports(vendor, arch),
        cupy=vendor == "nvidia", memory_bytes=mem, simulated=True,
    )


@contextlib.contextmanager
def simulate_device(name: str, **overrides) -> Iterator[DeviceInfo]:
    """Within the block, ``probe()`` (any device) answers with the simulated device ``name``.

    ``overrides`` replace single :class:`DeviceInfo` fields, e.g. ``triton=False`` to
    see what happens on an sm80 without Triton. Nests; thread-global.
    """
    info = simulated(name)
    if overrides:
        bad = sorted(set(overrides) - set(DeviceInfo.__dataclass_fields__))
        if bad:
            raise bad_argument("simulate_device", f"unknown fields {bad}",
                               f"DeviceInfo fields {sorted(DeviceInfo.__dataclass_fields__)}")
        info = dataclasses.replace(info, **overrides)
    _simulated_override.append(info)
    try:
        yield info
    finally:
        _simulated_override.remove(info)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_INTERPRETER_IGNORED: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8kv_interpreter_ignored",
                                                                             default=False)


def triton_interpreter() -> bool:
    """True when Triton kernels run through its CPU interpreter (``TRITON_INTERPRET``), unless
    inside :func:`interpreter_ignored`."""
    return not _INTERPRETER_IGNORED.get() and settings.triton_interpreter()


@contextlib.contextmanager
def interpreter_ignored() -> Iterator[None]:
    """Backends answer as on a machine without Triton's CPU interpreter, while the environment Triton
    itself reads stays as it is (a kernel module imported meanwhile is still built for the interpreter):
    how the CI matrix asks backends about devices that are not this one."""
    token = _INTERPRETER_IGNORED.set(True)
    try:
        yield
    finally:
        _INTERPRETER_IGNORED.reset(token)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@cache
def _probe_real(device_str: str, interpret: bool) -> DeviceInfo:
    dev = torch.device(device_str)
    if dev.type != "cuda":
        return DeviceInfo(vendor="cpu", name=_cpu_name(), arch=None, torch_device="cpu",
                          triton=interpret and _importable("triton"), memory_bytes=_cpu_memory())
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
        triton=triton_supports(vendor, arch) and _importable("triton"),
        cupy=vendor == "nvidia" and _importable("cupy"),
        memory_bytes=int(props.total_memory),
    )


def probe(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe ``device`` (default: the current CUDA device if any, else the CPU).

    Simulation (``simulate_device``, then ``FP8KV_SIMULATE_DEVICE``) takes precedence
    over ``device``. Cached per device (and interpreter setting): cheap enough for the
    hot path. A real probe never initialises more than ``torch.cuda`` already has.
    """
    if _simulated_override:
        return _simulated_override[-1]
    env = settings.simulated_device()
    if env:
        return simulated(env)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _probe_real(str(dev), dev.type == "cpu" and triton_interpreter())
