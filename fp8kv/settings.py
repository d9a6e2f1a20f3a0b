"""Every environment variable fp8kv reads: one place, typed, documented.

Each accessor reads ``os.environ`` when called (so a test or a launcher may change a
variable at run time) and refuses a malformed value with an error naming the variable.

One rule for fp8kv's own variables (:func:`_read`): surrounding whitespace is stripped and a
value that is empty (or only whitespace) is the same as an unset variable; keywords (``full``,
``auto``, flags such as ``1``/``true``/``off``, device and architecture names) compare
case-insensitively; backend names are kept as written, since backend names are case-sensitive
(as in ``backend="..."``). Flags (``FP8KV_STRICT``, ``FP8KV_TORCH_NATIVE``) take ``1``, ``true``,
``yes``, ``on`` or ``0``, ``false``, ``no``, ``off``. ``TRITON_INTERPRET`` is Triton's own: it is
read exactly as Triton (3.3+) reads it (:func:`triton_interpreter`), so that fp8kv and Triton agree.

==========================  =========================================================
variable                    meaning
==========================  =========================================================
``FP8KV_BACKEND``           force this backend wherever ``backend="auto"`` (``auto``
                            or empty: choose). A name that cannot serve raises.
``FP8KV_AUTO_BACKENDS``     comma-separated backend names ``backend="auto"`` may pick
                            (unset or empty: any installed one). Forced names are not
                            affected; a listed name that is not installed is ignored
                            (and named if then no backend can serve a request).
``FP8KV_STRICT``            ``1``: landing on the slow reference backend on a GPU is an
                            error instead of a warning. Default ``0``.
``FP8KV_CHECK``             ``full`` (default): value checks (slot, block-table and
                            length ranges) in :func:`fp8kv.plan_attention` and the
                            one-shot calls; ``shapes``: skip them (no host sync;
                            still memory-safe: kernels skip bad slots, mask bad
                            block ids and clamp lengths).
``FP8KV_SIMULATE_DEVICE``   pretend the device is this one (``sm70``, ``sm90``,
                            ``gfx942``...) for selection and ``fp8kv probe``.
``FP8KV_TRITON_CODEC``      Triton backend codec: ``auto`` (default), ``integer``
                            (force the integer-bit encoder/decoders), ``native``
                            (native casts on sm89+ even where not yet proven).
``FP8KV_TORCH_NATIVE``      torch (CPU) backend: ``1`` (default) builds its fused C
                            loops at first use with the system C compiler (cached in
                            ``~/.cache/fp8kv``) where one helps; ``0``: PyTorch
                            operations only.
``FP8KV_CUDA_ARCH``         CUDA backend: compile and plan for this older architecture
                            (``sm70``... up to the GPU's own) on a newer GPU: its PTX,
                            JIT-compiled by the driver, with its shared-memory limits
                            (how Turing's code runs on an H100). Unset: the GPU's own.
``TRITON_INTERPRET``        Triton's own: ``1`` runs Triton kernels on the CPU; fp8kv
                            reads it as Triton does to decide whether the Triton
                            backend serves CPU tensors.
==========================  =========================================================
"""

from __future__ import annotations

import functools
import os

from .errors import InvalidArgument

CHECK_MODES = ("full", "shapes")
TRITON_CODECS = ("auto", "integer", "native")


FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("0", "false", "no", "off")
TRITON_TRUE = ("1", "true", "on", "yes", "y")
"""The values Triton (3.3+) reads as on for its boolean variables (any other value is off)."""


def _read(var: str) -> str:
    """The variable's value, stripped of surrounding whitespace (``""`` when unset)."""
    return os.environ.get(var, "").strip()


def _keyword(var: str, default: str) -> str:
    """The variable as a lower-case keyword (``default`` when unset or empty)."""
    return _read(var).lower() or default


def _choice(var: str, default: str, choices: tuple[str, ...]) -> str:
    value = _keyword(var, default)
    if value not in choices:
        raise InvalidArgument(f"{var}: got {os.environ.get(var)!r}, expected one of {choices} "
                              "(case-insensitive)")
    return value


def _flag(var: str, default: bool) -> bool:
    value = _keyword(var, "1" if default else "0")
    if value in FLAG_ON:
        return True
    if value in FLAG_OFF:
        return False
    raise InvalidArgument(f"{var}: got {os.environ.get(var)!r}, expected 0 or 1 (or one of {FLAG_OFF + FLAG_ON})")


def forced_backend() -> str | None:
    """``FP8KV_BACKEND``: the backend to force for ``backend="auto"``, or None."""
    value = _read("FP8KV_BACKEND")
    return None if value.lower() in ("", "auto") else value


def auto_backends() -> frozenset[str] | None:
    """``FP8KV_AUTO_BACKENDS``: the backends ``auto`` may pick, or None (any of them)."""
    return _names("FP8KV_AUTO_BACKENDS", os.environ.get("FP8KV_AUTO_BACKENDS", ""))


@functools.lru_cache(maxsize=16)
def _names(var: str, value: str) -> frozenset[str] | None:
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    if any(n.lower() == "auto" for n in names):
        raise InvalidArgument(f"{var}: got {value!r}, expected comma-separated backend names (not 'auto')")
    return names or None


def strict() -> bool:
    """``FP8KV_STRICT``: a fall-back to a slow backend on a GPU raises instead of warning."""
    return _flag("FP8KV_STRICT", False)


def check_values() -> bool:
    """``FP8KV_CHECK``: whether value checks (one host sync on a GPU) run by default."""
    return _choice("FP8KV_CHECK", "full", CHECK_MODES) == "full"


def simulated_device() -> str | None:
    """``FP8KV_SIMULATE_DEVICE``: the simulated device name (lower case), or None."""
    return _keyword("FP8KV_SIMULATE_DEVICE", "") or None


def triton_codec() -> str:
    """``FP8KV_TRITON_CODEC``: ``auto``, ``integer`` or ``native``."""
    return _choice("FP8KV_TRITON_CODEC", "auto", TRITON_CODECS)


def cuda_arch() -> str:
    """``FP8KV_CUDA_ARCH``: the architecture the CUDA backend builds for (``"sm75"``), or ``""`` for the
    GPU's own (the backend checks the value against the GPU: ``fp8kv_cuda.runtime.device_sm``)."""
    return _keyword("FP8KV_CUDA_ARCH", "")


def triton_interpreter() -> bool:
    """``TRITON_INTERPRET``: Triton kernels run on the CPU. Read as Triton (3.3+) reads it: on for
    ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case, exactly (no stripping); anything else is off."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_TRUE


def torch_native() -> bool:
    """``FP8KV_TORCH_NATIVE``: the torch backend may build and use its C loops (default 1)."""
    return _flag("FP8KV_TORCH_NATIVE", True)


VARIABLES = ("FP8KV_BACKEND", "FP8KV_AUTO_BACKENDS", "FP8KV_STRICT", "FP8KV_CHECK", "FP8KV_SIMULATE_DEVICE",
             "FP8KV_TRITON_CODEC", "FP8KV_TORCH_NATIVE", "FP8KV_CUDA_ARCH", "TRITON_INTERPRET")
"""Every variable read (docs/configuration.md lists them; tests check the two agree)."""
