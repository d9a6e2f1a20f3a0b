"""Compile-and-cache through CuPy (NVRTC) and launch on torch's current stream.

A variant (:class:`fp8kv_cuda.variants.Variant`) is compiled the first time it is launched on
a device, for that device's architecture, by ``cupy.RawModule`` (CuPy also keeps the cubin
in its on-disk kernel cache, keyed on the source text, which has ``codec.cuh`` inlined, and
the options). Modules are cached per (variant, device) in this process, behind a lock.

Launches go to torch's current stream of the tensors' device (``cupy.cuda.ExternalStream``),
so CUDA-graph capture and stream semantics are torch's. Arguments are packed with explicit
NumPy types (pointers and int64 as ``numpy.int64``/``uint64``, ``int`` as ``numpy.int32``,
``float`` as ``numpy.float32``): nothing is read back, no host sync.
"""

from __future__ import annotations

import functools
import threading

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


def function(variant: Variant, entry: str, device: torch.device):
    """The compiled kernel ``entry`` of ``variant`` on ``device`` (compiled on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (variant, index)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                cp = cupy()
                with cp.cuda.Device(index):
                    mod = cp.RawModule(code=source(variant.kernel), options=options(variant), backend="nvrtc")
                    for name in variant.entry_points:
                        mod.get_function(name)  # compile and load now, not inside a graph capture
                _modules[key] = mod
    return mod.get_function(entry)


@functools.cache
def _external_stream(ptr: int, index: int):
    return cupy().cuda.ExternalStream(ptr, index)


def launch(variant: Variant, entry: str, device: torch.device, grid: tuple[int, int, int], block: int,
           args: list) -> None:
    """Launch ``entry`` of ``variant`` on torch's current stream of ``device``."""
    fn = function(variant, entry, device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    cp = cupy()
    with cp.cuda.Device(index):
        fn(grid, (block, 1, 1), tuple(args), stream=_external_stream(stream.cuda_stream, index))


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
