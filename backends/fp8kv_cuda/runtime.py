"""Compile-and-cache through CuPy's NVRTC and launch on torch's current stream.

A variant (:class:`fp8kv_cuda.variants.Variant`) is compiled the first time it is launched on
a device, for that device's architecture (``--gpu-architecture=sm_XY``), with exactly the
options of :func:`fp8kv_cuda.variants.options` (the CPU compile cells use the same), through
CuPy's NVRTC bindings (``cupy.cuda.nvrtc``), and the cubin is loaded as a CuPy module.
``cupy.RawModule`` is *not* used: it appends ``-ftz=true`` to the caller's options (NVRTC honours
the last), which flushes float32 subnormals and would break the write's bit-exact ``x / scale``.
Modules are cached per (variant, device) in this process, behind a lock (no on-disk cache yet:
a variant compiles in well under a second).

``FP8KV_CUDA_ARCH=sm75`` (any architecture from sm70 up to the GPU's own) makes the backend compile
and plan for that older architecture on a newer GPU: the kernels are compiled to its PTX
(``--gpu-architecture=compute_75``), which the driver JIT-compiles for the GPU, so the code paths
of the older architecture (``__CUDA_ARCH__`` 750: Turing's m16n8k8 products, synchronous copies)
run, with its shared-memory limits in the plan. This is how the Turing paths are tested on an
H100; it changes nothing else (the probe still reports the real GPU).

Launches go to torch's current stream of the tensors' device (``cupy.cuda.ExternalStream``),
so CUDA-graph capture and stream semantics are torch's. Arguments are packed with explicit
NumPy types (pointers and int64 as ``numpy.int64``/``uint64``, ``int`` as ``numpy.int32``,
``float`` as ``numpy.float32``): nothing is read back, no host sync.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
import warnings

import numpy as np
import torch

from fp8kv import settings
from fp8kv.errors import InvalidArgument

from .variants import Variant, arch_target, options, source

_lock = threading.Lock()
_modules: dict[tuple[object, int], object] = {}


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


ARCH_ENV = "FP8KV_CUDA_ARCH"


def device_sm(index: int) -> int:
    """The architecture the backend compiles and plans for on CUDA device ``index`` (75 for sm75):
    the device's own, or the older one ``FP8KV_CUDA_ARCH`` names (see the module docstring)."""
    return _device_sm(index, settings.cuda_arch())


@functools.cache
def _device_sm(index: int, wanted: str) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    real = 10 * major + minor
    if not wanted:  # (settings.cuda_arch() strips the value)
        return real
    m = re.fullmatch(r"sm_?(\d{2,3})", wanted.lower())
    sm = int(m.group(1)) if m else -1
    if not 70 <= sm <= real:
        raise InvalidArgument(f"{ARCH_ENV}: got {wanted!r}, expected an architecture from sm70 to this GPU's "
                              f"sm{real} (an older architecture's code runs on a newer GPU, not the reverse)")
    return sm


def function(variant: Variant, entry: str, device: torch.device):
    """The compiled kernel ``entry`` of ``variant`` on ``device`` (compiled on first use)."""
    index = device_index(device)
    sm = device_sm(index)
    major, minor = torch.cuda.get_device_capability(index)
    if sm == 10 * major + minor:
        def build():
            return compile_cubin(variant, arch_target(variant.kernel, sm))
    else:  # an older architecture's PTX, JIT-compiled by the driver for this GPU
        def build():
            return compile_ptx(variant, f"compute_{sm}")
    return module((variant, sm), build, variant.entry_points, index).get_function(entry)


def module(key, build, entry_points: tuple[str, ...], index: int):
    """The CuPy module cached under ``(key, index)``, built on first use by ``build()`` (a cubin or
    NUL-terminated PTX); its ``entry_points`` are resolved at once (not inside a graph capture)."""
    mod = _modules.get((key, index))
    if mod is None:
        with _lock:
            mod = _modules.get((key, index))
            if mod is None:
                image = build()
                cp = cupy()
                with cp.cuda.Device(index):
                    mod = cp.cuda.function.Module()
                    mod.load(image)
                    for name in entry_points:
                        mod.get_function(name)
                _modules[(key, index)] = mod
    return mod


def compile_cubin(variant: Variant, arch: str) -> bytes:
    """A cubin of ``variant`` for ``arch`` (``"sm_90"``) through CuPy's NVRTC (RuntimeError with
    NVRTC's log on failure)."""
    return compile_source(source(variant.kernel), f"{variant.kernel}.cu", options(variant), arch, variant.label)


def compile_ptx(variant: Variant, arch: str) -> bytes:
    """PTX of ``variant`` for a virtual architecture (``"compute_75"``), NUL-terminated for the
    driver's JIT."""
    ptx = compile_source(source(variant.kernel), f"{variant.kernel}.cu", options(variant), arch, variant.label,
                         ptx=True)
    ptx = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    return ptx if ptx.endswith(b"\0") else ptx + b"\0"


def compile_source(text: str, name: str, opts, arch: str, label: str = "", ptx: bool = False):
    """Compile CUDA source ``text`` with NVRTC options ``opts`` for ``arch`` (``"sm_90a"``,
    ``"compute_75"``) through CuPy's NVRTC: the cubin, or PTX with ``ptx`` (RuntimeError with
    NVRTC's log on failure). Public: other in-tree backends compile their sources through it."""
    nvrtc = cupy().cuda.nvrtc
    prog = nvrtc.createProgram(text, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*opts, f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC could not compile {label or name} for {arch}: {exc}\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getPTX(prog) if ptx else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


@functools.cache
def _external_stream(ptr: int, index: int):
    with warnings.catch_warnings():  # CuPy 14 deprecates it for Stream.from_external (not in CuPy 12/13)
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy().cuda.ExternalStream(ptr, index)


_opted_in: set[tuple[int, int]] = set()  # (function handle, bytes)


def launch(variant: Variant, entry: str, device: torch.device, grid: tuple[int, int, int], block: int,
           args: list, shared_mem: int = 0, dependent: bool = False) -> None:
    """Launch ``entry`` of ``variant`` on torch's current stream of ``device`` with ``shared_mem``
    bytes of dynamic shared memory (above 48 KiB the kernel is opted in once).

    ``args``: :func:`ptr`, :func:`i64`, :func:`i32`, :func:`f32` values, or ``bytes`` for a struct
    passed by value (a ``CUtensorMap`` from :func:`tensor_map_uint8`).

    ``dependent``: the kernel starts with ``griddepcontrol.wait`` when built for sm90+ (it reads
    nothing the previous kernel on the stream writes before that), so there it goes out as a
    programmatic dependent launch (:func:`pdl_launch`): its CTAs are scheduled as the previous
    kernel's CTAs finish, without the gap between two launches.

    A grid without a CTA (a dimension 0: an empty step) launches nothing (the driver refuses it)."""
    if 0 in grid:
        return
    fn = function(variant, entry, device)
    index = device_index(device)
    stream = torch.cuda.current_stream(index)
    cp = cupy()
    with cp.cuda.Device(index):
        _allow_shared_memory(fn.ptr, shared_mem)
        if dependent and pdl_available(index):
            pdl_launch(fn.ptr, grid, block, shared_mem, stream.cuda_stream, args)
            return
        if any(isinstance(a, bytes) for a in args):  # a struct by value (a TMA descriptor): CuPy takes none
            _launch_args(fn.ptr, grid, block, shared_mem, stream.cuda_stream, args, None, "struct arguments")
            return
        fn(grid, (block, 1, 1), tuple(args), stream=_external_stream(stream.cuda_stream, index), shared_mem=shared_mem)


def _allow_shared_memory(function_ptr: int, shared_mem: int) -> None:
    """Opt ``function_ptr`` in to ``shared_mem`` bytes of dynamic shared memory (once; needed where the
    kernel's static and dynamic shared memory together pass 48 KiB, so every size is opted in: 48 KiB
    of dynamic memory beside the FP8 mode decode's static 2 KiB failed to launch on the H100 with
    CUDA_ERROR_INVALID_VALUE). Call inside the device's context."""
    if shared_mem > 0 and (function_ptr, shared_mem) not in _opted_in:
        drv = cupy().cuda.driver
        attr = getattr(drv, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
        drv.funcSetAttribute(function_ptr, attr, shared_mem)
        _opted_in.add((function_ptr, shared_mem))


def launch_struct(function, index: int, grid: tuple[int, int, int], block: int, params: ctypes.Structure,
                  shared_mem: int = 0) -> None:
    """Launch ``function`` (a CuPy kernel function) whose one parameter is a struct passed by value,
    ``params`` (a ``ctypes.Structure`` laid out as the kernel's C struct), on torch's current stream
    of CUDA device ``index`` (captured into CUDA graphs like any launch). Public: other in-tree
    backends launch their kernels through it. A grid without a CTA launches nothing."""
    if 0 in grid:
        return
    stream = torch.cuda.current_stream(index)
    with cupy().cuda.Device(index):
        _allow_shared_memory(function.ptr, shared_mem)
        struct_launch(function.ptr, grid, block, shared_mem, stream.cuda_stream, params)


def struct_launch(function_ptr: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream_ptr: int,
                  params: ctypes.Structure) -> None:
    """``cuLaunchKernelEx`` without attributes, the kernel's one parameter being ``params`` (by value)."""
    _launch_ex(function_ptr, grid, block, shared_mem, stream_ptr, (ctypes.c_void_p * 1)(ctypes.addressof(params)),
               None, "struct parameter")


def _launch_ex(function_ptr: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream_ptr: int,
               params, attribute: ctypes.Structure | None, what: str) -> None:
    """The driver's ``cuLaunchKernelEx`` (the one entry point both ctypes launches use): ``params``
    an array of pointers to the kernel's arguments, ``attribute`` one launch attribute or None."""
    launch_ex = _launch_kernel_ex()
    if launch_ex is None:
        raise RuntimeError(f"cuLaunchKernelEx ({what}) needs a CUDA 12+ driver")
    cfg = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, shared_mem, stream_ptr,
                        None if attribute is None else ctypes.pointer(attribute), 0 if attribute is None else 1)
    err = launch_ex(ctypes.byref(cfg), function_ptr, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx ({what}) failed: CUresult {err}")


PDL_MIN_SM = 90
"""Programmatic dependent launch and ``griddepcontrol`` need compute capability 9.0."""
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def pdl_available(index: int) -> bool:
    """Whether kernels on device ``index`` are built with ``griddepcontrol.wait`` (sm90+, not an
    older ``FP8KV_CUDA_ARCH``) and the driver has ``cuLaunchKernelEx``."""
    return device_sm(index) >= PDL_MIN_SM and _launch_kernel_ex() is not None


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, then an 8-aligned 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _pdl_attribute() -> _LaunchAttribute:
    """The one launch attribute of every dependent launch (programmatic stream serialization
    allowed), built once: the launch only reads it."""
    attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    ctypes.c_int.from_address(ctypes.addressof(attr) + _LaunchAttribute.value.offset).value = 1  # (allowed)
    return attr


@functools.cache
def _launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx`` (CUDA 12+), or None."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


TENSOR_MAP_BYTES = 128
"""``sizeof(CUtensorMap)`` (64-byte aligned in a kernel's parameters)."""
_CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3


def tensor_map_uint8(address: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
                     swizzle_128b: bool = True) -> bytes:
    """A TMA descriptor (``CUtensorMap``, 128 bytes, from the driver's ``cuTensorMapEncodeTiled``) of a
    uint8 tensor at ``address``: ``dims`` innermost first, ``strides`` in bytes of dims 1.. (the
    innermost is contiguous), ``box`` the tile one copy moves; coordinates outside ``dims`` read as
    zeros. A host call that touches no device memory (no sync; graph-safe: the bytes travel in the
    kernel's parameters). Raises ``InvalidArgument`` where the driver refuses (alignment: address and
    strides multiples of 16; box sides 1..256; the inner box side at most 128 bytes with the swizzle).
    Public: the Hopper backend's TMA loads use it."""
    rank = len(dims)
    out = (ctypes.c_uint8 * TENSOR_MAP_BYTES)()
    err = _tensor_map_encode_tiled()(
        out, _CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, ctypes.c_void_p(address), (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*[1] * rank),
        0, _CU_TENSOR_MAP_SWIZZLE_128B if swizzle_128b else 0, _CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 0)
    if err != 0:
        raise InvalidArgument(f"cuTensorMapEncodeTiled refused dims {dims}, strides {strides}, box {box} at "
                              f"{address:#x}: CUresult {err}")
    return bytes(out)


@functools.cache
def _tensor_map_encode_tiled():
    """The driver's ``cuTensorMapEncodeTiled`` (CUDA 12+)."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


_C_TYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}


def _c_values(args: list) -> list:
    """Kernel arguments as ctypes values (the driver reads each through a pointer): numpy scalars by
    type, ``bytes`` as a byte array of the struct."""
    return [(ctypes.c_uint8 * len(a)).from_buffer_copy(a) if isinstance(a, bytes) else _C_TYPES[type(a)](a.item())
            for a in args]


def _launch_args(function_ptr: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream_ptr: int,
                 args: list, attribute: ctypes.Structure | None, what: str) -> None:
    """:func:`_launch_ex` with :func:`launch`'s arguments, each passed through a pointer to its C value."""
    values = _c_values(args)  # (alive until the driver has copied them)
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    _launch_ex(function_ptr, grid, block, shared_mem, stream_ptr, params, attribute, what)


def pdl_launch(function_ptr: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream_ptr: int,
               args: list) -> None:
    """``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: a launch
    that may start before the previous kernel on the stream has finished; the kernel must wait for
    it (``griddepcontrol.wait``) before reading its results. Arguments typed as :func:`launch`'s
    (``ptr``, ``i64``, ``i32``, ``f32``). Captured into CUDA graphs as a programmatic edge."""
    _launch_args(function_ptr, grid, block, shared_mem, stream_ptr, args, _pdl_attribute(),
                 "programmatic dependent launch")


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
