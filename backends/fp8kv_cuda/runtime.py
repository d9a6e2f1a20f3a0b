"""Compile-and-cache through CuPy's NVRTC and launch on torch's current stream.

A variant (:class:`fp8kv_cuda.variants.Variant`) is compiled the first time it is launched on
a device, for that device's architecture (``--gpu-architecture=sm_XY``), with exactly the
options of :func:`fp8kv_cuda.variants.options` (the CPU compile cells use the same), through
CuPy's NVRTC bindings (``cupy.cuda.nvrtc``), and the cubin is loaded as a CuPy module.
``cupy.RawModule`` is *not* used: it appends ``-ftz=true`` to the caller's options (NVRTC honours
the last), which flushes float32 subnormals and would break the write's bit-exact ``x / scale``.
Modules are cached per (variant, device) in this process, behind a lock (no on-disk cache yet:
a variant compiles in well under a second).

Launches go to torch's current stream of the tensors' device (``cupy.cuda.ExternalStream``),
so CUDA-graph capture and stream semantics are torch's. Arguments are packed with explicit
NumPy types (pointers and int64 as ``numpy.int64``/``uint64``, ``int`` as ``numpy.int32``,
``float`` as ``numpy.float32``): nothing is read back, no host sync.
"""

from __future__ import annotations

import functools
import threading
import warnings

import numpy as np
import torch

from .variants import Variant, options, source

_lock = threading.Lock()
_modules: dict[tuple[Variant, int], object] = {}


@functools.cache
def cupy():
    """CuPy, imported on first use (a clear error where it is missing)."""
    try:
        import cupy as cp
    except ImportError as exc:  # pragma: no cover - the plugin refuses before this
        raise RuntimeError("fp8kv_cuda needs CuPy: pip install cupy-cuda12x (or cupy-cuda13x on sm75+)") from exc
    return cp


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare ``"cuda"``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def function(variant: Variant, entry: str, device: torch.device):
    """The compiled kernel ``entry`` of ``variant`` on ``device`` (compiled on first use)."""
    index = device_index(device)
    key = (variant, index)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                major, minor = torch.cuda.get_device_capability(index)
                cubin = compile_cubin(variant, f"sm_{major}{minor}")
                cp = cupy()
                with cp.cuda.Device(index):
                    mod = cp.cuda.function.Module()
                    mod.load(cubin)
                    for name in variant.entry_points:
                        mod.get_function(name)  # resolve now, not inside a graph capture
                _modules[key] = mod
    return mod.get_function(entry)


def compile_cubin(variant: Variant, arch: str) -> bytes:
    """A cubin of ``variant`` for ``arch`` (``"sm_90"``) through CuPy's NVRTC (RuntimeError with
    NVRTC's log on failure)."""
    nvrtc = cupy().cuda.nvrtc
    prog = nvrtc.createProgram(source(variant.kernel), f"{variant.kernel}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*options(variant), f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC could not compile {variant.label} for {arch}: {exc}\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


@functools.cache
def _external_stream(ptr: int, index: int):
    with warnings.catch_warnings():  # CuPy 14 deprecates it for Stream.from_external (not in CuPy 12/13)
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy().cuda.ExternalStream(ptr, index)


_STATIC_SMEM_LIMIT = 48 << 10
_opted_in: set[tuple[Variant, str, int, int]] = set()


def launch(variant: Variant, entry: str, device: torch.device, grid: tuple[int, int, int], block: int,
           args: list, shared_mem: int = 0) -> None:
    """Launch ``entry`` of ``variant`` on torch's current stream of ``device`` with ``shared_mem``
    bytes of dynamic shared memory (above 48 KiB the kernel is opted in once)."""
    fn = function(variant, entry, device)
    index = device_index(device)
    stream = torch.cuda.current_stream(index)
    cp = cupy()
    with cp.cuda.Device(index):
        if shared_mem > _STATIC_SMEM_LIMIT and (variant, entry, index, shared_mem) not in _opted_in:
            drv = cp.cuda.driver
            attr = getattr(drv, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
            drv.funcSetAttribute(fn.ptr, attr, shared_mem)
            _opted_in.add((variant, entry, index, shared_mem))
        fn(grid, (block, 1, 1), tuple(args), stream=_external_stream(stream.cuda_stream, index), shared_mem=shared_mem)


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's data pointer as a kernel pointer argument."""
    return np.uint64(t.data_ptr())


def i64(x: int) -> np.int64:
    return np.int64(x)


def i32(x: int) -> np.int32:
    if not -(2**31) <= x < 2**31:
        raise ValueError(f"{x} does not fit a 32-bit kernel argument")
    return np.int32(x)


def f32(x: float) -> np.float32:
    return np.float32(x)
