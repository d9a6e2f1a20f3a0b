"""Argument checks shared by the planning step and the operations: each raises
:class:`fp8kv.InvalidArgument` naming the argument, what was given and what was expected."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import settings
from .errors import bad_argument

if TYPE_CHECKING:
    from .cache import CacheSpec

IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def positive_float32(name: str, x) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.device.type == "cpu":
        x = x.item()
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise bad_argument(name, repr(x), "a finite number > 0 (a Python int or float)")
    if not (math.isfinite(x) and 0 < x <= FLOAT32_MAX):
        raise bad_argument(name, repr(x), f"a finite number > 0 and <= {FLOAT32_MAX:.4g} (float32)")
    return float(x)


def nonneg_int(name: str, x) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise bad_argument(name, repr(x), "an int >= 0")
    return x


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
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return settings.check_values() if validate is None else bool(validate)


def slot_stats(slot_mapping: torch.Tensor) -> list[torch.Tensor]:
    """Device scalars (no sync): max slot, min slot, and 1 if a valid slot repeats."""
    if slot_mapping.numel() == 0:
        z = torch.zeros((), dtype=torch.int64, device=slot_mapping.device)
        return [z - 1, z, z]
    s = slot_mapping.to(torch.int64)
    srt = torch.sort(s).values
    dup = ((srt[1:] == srt[:-1]) & (srt[1:] >= 0)).any().to(torch.int64) if s.numel() > 1 else s.new_zeros(())
    return [s.max(), s.min(), dup]


def check_slot_values(spec: CacheSpec, slot_mapping: torch.Tensor, hi: int, dup: int) -> None:
    """Raise for a slot past the cache or a slot written twice (values from :func:`slot_stats`)."""
    if hi >= spec.num_slots:
        raise bad_argument("slot_mapping", f"slot {hi}",
                           f"slots < num_blocks * block_size = {spec.num_slots} (negative = padding)")
    if dup:
        valid = slot_mapping[slot_mapping >= 0]
        vals, counts = torch.unique(valid, return_counts=True)
        raise bad_argument("slot_mapping", f"slot {int(vals[counts > 1][0])} more than once",
                           "each slot written at most once")


def check_slot_mapping(spec: CacheSpec, slot_mapping, num_tokens: int, validate: bool | None) -> torch.Tensor:
    """Check a write's ``slot_mapping [num_tokens]`` (values: one host transfer, if checked)."""
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=spec.device)
    if slot_mapping.shape[0] != num_tokens:
        raise bad_argument("slot_mapping", f"{slot_mapping.shape[0]} entries", f"one per token ({num_tokens})")
    if num_tokens and values_checked(spec.device, validate):
        hi, _, dup = torch.stack(slot_stats(slot_mapping)).tolist()
        check_slot_values(spec, slot_mapping, hi, dup)
    return slot_mapping


__all__ = ["FLOAT32_MAX", "INDEX_DTYPES", "INT32_MAX", "IO_DTYPES", "check_slot_mapping", "check_slot_values",
           "check_tensor", "nonneg_int", "owned_index", "positive_float32", "slot_stats", "values_checked"]
