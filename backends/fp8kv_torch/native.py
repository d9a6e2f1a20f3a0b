"""The torch backend's C loops (``csrc/kernels.c``): built at first use, called through ctypes.

One decode step of one layer is a few dozen small PyTorch operations (gather, dequantize,
scale, SDPA, checks), each costing microseconds of dispatch whatever its size; the C loops do
the same arithmetic in one call. They are an accelerator for the common cases, never the
semantics: :mod:`~fp8kv_torch.attention` checks their result as it checks SDPA's (a non-finite
result goes to the float64 path) and falls back to PyTorch whenever :func:`library` is None
(``FP8KV_TORCH_NATIVE=0``, no C compiler, or a build that failed; the reason is in :func:`status`).

The shared object is built with the system C compiler (the first of ``cc``, ``gcc``, ``clang`` on
``PATH``) at ``-O3`` without fast-math and without FMA contraction (every float32 operation is the IEEE
one the source writes), for the baseline ISA of the machine (no ``-march=native``: the cache
directory may be shared by other CPUs), once per source and compiler, into
``~/.cache/fp8kv``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from fp8kv import settings

SOURCE = Path(__file__).resolve().parent / "csrc" / "kernels.c"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
OPENMP = ("-fopenmp",)
COMPILERS = ("cc", "gcc", "clang")
"""The first of these on ``PATH`` builds the loops."""

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "fp8kv_decode": (_int, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _int,
                            _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                            _f32, _i64, _ptr, _ptr]),
    "fp8kv_prepare_write": (None, [_ptr, _ptr, _i64, _i64, _i64, _int, _ptr, _ptr, _i64, _f32, _ptr, _ptr]),
}

_why_not: list[str] = []


def _compiler() -> str | None:
    return next((p for p in map(shutil.which, COMPILERS) if p), None)


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "fp8kv"


def _build(cc: str) -> Path:
    """The shared object for this source and compiler (built now if not cached)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + version.encode() + " ".join(FLAGS).encode())
    out = _cache_dir() / f"fp8kv_torch_kernels-{key.hexdigest()[:20]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (OPENMP, ()):  # OpenMP where the compiler has it
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
            pass
        r = subprocess.run([cc, *FLAGS, *extra, str(SOURCE), "-o", tmp.name, "-lm"], capture_output=True,
                           text=True, timeout=300)
        if r.returncode == 0:
            os.replace(tmp.name, out)  # atomic: concurrent builders each publish a whole file
            return out
        os.unlink(tmp.name)
        errors.append(r.stderr.strip()[-500:])
    raise RuntimeError(f"{cc} failed: {' | '.join(errors)}")


@functools.cache
def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        _why_not.append(f"no C compiler ({', '.join(COMPILERS)}) on PATH")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _why_not.append(f"building {SOURCE.name} failed: {exc}")
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded C loops, or None (disabled by ``FP8KV_TORCH_NATIVE=0``, or unavailable)."""
    if not settings.torch_native():
        return None
    return _load()


def status() -> str:
    """One line on the C loops: in use, disabled, or why not available."""
    if not settings.torch_native():
        return "disabled (FP8KV_TORCH_NATIVE=0)"
    if library() is not None:
        return "in use"
    return "unavailable: " + "; ".join(_why_not)
