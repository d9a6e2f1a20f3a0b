"""Argument checks shared by the planning step and the operations: each raises
:class:`fp8kv.InvalidArgument` naming the argument, what was given and what was expected.

Scalar arguments follow one rule (docs/configuration.md, "Scalar arguments"):

* a **float** argument (``softmax_scale``, ``logits_soft_cap``, ``prob_scale``) takes a Python
  ``int`` or ``float``, a NumPy integer or floating scalar (``np.float16/32/64``, ``np.int64``...) or
  a one-element CPU tensor of an integer or floating dtype (``torch.tensor(0.125)``, read once);
* an **int** argument (``sliding_window``, ``window_left``, ``num_q_heads``, ``num_tokens``,
  ``max_query_len``, ``max_seq_len``, ``max_blocks``) takes a Python ``int``, a NumPy integer scalar
  or a one-element CPU tensor of an integer dtype; never a float, not even an integral one (``4.0``);
* a bool (Python's, NumPy's or a bool tensor) is never a number; a **flag** (``causal``,
  ``fp8_attention``, ``validate``) takes exactly ``True`` or ``False`` (``validate`` also ``None``);
* a tensor on another device than the CPU (CUDA, meta) is refused: reading it would make the host
  wait for the device.

Every accepted scalar becomes a plain Python ``int`` or ``float`` (what the kernels are given).
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol

import torch

from . import settings
from .errors import bad_argument


class SlotSpace(Protocol):
    """What the slot checks read of a cache's :class:`fp8kv.cache.CacheSpec` (this module sits below
    the cache, which takes its scalar checks from here)."""

    @property
    def num_slots(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

FLOAT_KINDS = "a Python int or float, a NumPy scalar or a one-element CPU tensor"
"""What a float argument may be (the scalar rule of the module docstring)."""
INT_KINDS = "a Python int, a NumPy integer or a one-element integer CPU tensor"
"""What an int argument may be (the scalar rule of the module docstring)."""


def _given(x) -> str:
    """How an error message shows a refused scalar ``x``."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x)


def _number(name: str, x, *, integer: bool, expected: str) -> int | float:
    """``x`` as a Python int (``integer``) or number by the scalar rule, else the named error
    (``expected`` says what the argument takes). A one-element CPU tensor is read and its value
    judged as a scalar: a bool, complex or (for an int) floating tensor fails like its value."""
    kinds = INT_KINDS if integer else FLOAT_KINDS
    given = _given(x)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise bad_argument(name, given, f"{expected} ({kinds}: reading a {x.device.type} tensor would "
                                            "make the host wait for the device)")
        if x.numel() != 1:
            raise bad_argument(name, given, f"{expected} ({kinds})")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Integral if integer else numbers.Real):
        raise bad_argument(name, given, f"{expected} ({kinds})")
    if integer:
        return int(x)
    try:
        return float(x)
    except OverflowError:  # a Python int past the float range
        raise bad_argument(name, given, f"{expected} (within the float32 range)") from None


def real_scalar(name: str, x, expected: str = "a number") -> float:
    """A float argument as a Python float (the scalar rule: Python, NumPy or one-element CPU tensor)."""
    return float(_number(name, x, integer=False, expected=expected))


def int_at_least(name: str, x, lo: int, expected: str | None = None) -> int:
    """An int argument as a Python int ``>= lo`` (the scalar rule), else the named error."""
    expected = expected or f"an int >= {lo}"
    v = int(_number(name, x, integer=True, expected=expected))
    if v < lo:
        raise bad_argument(name, repr(v), expected)
    return v


def flag(name: str, x, *, allow_none: bool = False) -> bool | None:
    """A flag: exactly ``True`` or ``False`` (or ``None`` where ``allow_none``); no 0/1, no NumPy bool."""
    if isinstance(x, bool) or (allow_none and x is None):
        return x
    raise bad_argument(name, _given(x), "True or False" + (" or None" if allow_none else ""))


def positive_float32(name: str, x) -> float:
    """A finite float argument in ``(0, FLOAT32_MAX]`` as a Python float (the scalar rule)."""
    v = real_scalar(name, x, "a finite number > 0")
    if not (math.isfinite(v) and 0 < v <= FLOAT32_MAX):
        raise bad_argument(name, _given(x), f"a finite number > 0 and <= {FLOAT32_MAX:.4g} (float32)")
    return v


def nonneg_int(name: str, x) -> int:
    """An int argument ``>= 0`` as a Python int (the scalar rule)."""
    return int_at_least(name, x, 0, "an int >= 0")


def check_tensor(name: str, t, *, dtypes, ndim: int, device: torch.device, contiguous: bool = True) -> torch.Tensor:
    """Type, dtype, rank, device and (optionally) contiguity of one argument."""
    if not isinstance(t, torch.Tensor):
        raise bad_argument(name, type(t).__name__, "a torch.Tensor")
    if t.dtype not in dtypes:
        raise bad_argument(name, f"dtype {t.dtype}", f"one of {[str(d) for d in dtypes]}")
    if t.dim() != ndim:
        raise bad_argument(name, f"shape {tuple(t.shape)}", f"{ndim} dimensions")
    if t.device != device:
        raise bad_argument(name, f"device {t.device}", f"the cache's device {device}")
    if contiguous and not t.is_contiguous():
        raise bad_argument(name, f"a non-contiguous tensor (strides {t.stride()})",
                           "a contiguous tensor (call .contiguous())")
    return t


def owned_index(name: str, t, ndim: int, device: torch.device) -> torch.Tensor:
    """A contiguous int32 copy of an int32/int64 index tensor (owned by the metadata)."""
    check_tensor(name, t, dtypes=INDEX_DTYPES, ndim=ndim, device=device, contiguous=False)
    return t.to(torch.int32, copy=True, memory_format=torch.contiguous_format)


def values_checked(device: torch.device, validate: bool | None) -> bool:
    """Whether to read index values on the host: ``validate``, else ``FP8KV_CHECK``; never while
    a CUDA graph is being captured."""
    flag("validate", validate, allow_none=True)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return settings.check_values() if validate is None else validate


def slot_stats(slot_mapping: torch.Tensor) -> list[torch.Tensor]:
    """Device scalars (no sync): max slot, min slot, and 1 if a valid slot repeats."""
    if slot_mapping.numel() == 0:
        z = torch.zeros((), dtype=torch.int64, device=slot_mapping.device)
        return [z - 1, z, z]
    s = slot_mapping.to(torch.int64)
    srt = torch.sort(s).values
    dup = ((srt[1:] == srt[:-1]) & (srt[1:] >= 0)).any().to(torch.int64) if s.numel() > 1 else s.new_zeros(())
    return [s.max(), s.min(), dup]


def check_slot_values(spec: SlotSpace, slot_mapping: torch.Tensor, hi: int, dup: int) -> None:
    """Raise for a slot past the cache or a slot written twice (values from :func:`slot_stats`)."""
    if hi >= spec.num_slots:
        raise bad_argument("slot_mapping", f"slot {hi}",
                           f"slots < num_blocks * block_size = {spec.num_slots} (negative = padding)")
    if dup:
        valid = slot_mapping[slot_mapping >= 0]
        vals, counts = torch.unique(valid, return_counts=True)
        raise bad_argument("slot_mapping", f"slot {int(vals[counts > 1][0])} more than once",
                           "each slot written at most once")


def check_slot_mapping(spec: SlotSpace, slot_mapping, num_tokens: int, validate: bool | None) -> torch.Tensor:
    """Check a write's ``slot_mapping [num_tokens]`` (values: one host transfer, if checked)."""
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=spec.device)
    if slot_mapping.shape[0] != num_tokens:
        raise bad_argument("slot_mapping", f"{slot_mapping.shape[0]} entries", f"one per token ({num_tokens})")
    if num_tokens and values_checked(spec.device, validate):
        hi, _, dup = torch.stack(slot_stats(slot_mapping)).tolist()
        check_slot_values(spec, slot_mapping, hi, dup)
    return slot_mapping


__all__ = ["FLOAT32_MAX", "FLOAT_KINDS", "INDEX_DTYPES", "INT32_MAX", "INT_KINDS", "IO_DTYPES", "check_slot_mapping",
           "check_slot_values", "check_tensor", "flag", "int_at_least", "nonneg_int", "owned_index",
           "positive_float32", "real_scalar", "slot_stats", "values_checked"]
