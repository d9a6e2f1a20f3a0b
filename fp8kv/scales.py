"""Scale granularities, the dynamic per-token-head scale, and calibration.

Granularities (the shape of ``KVCache.k_scale`` / ``v_scale``, float32):

========== ====================================== =====================================
name       shape                                  meaning
========== ====================================== =====================================
tensor     ``()``                                 one k and one v scale
head       ``(H,)``                               one per KV head (llm-compressor
                                                  ``attn_head``, FA3 descales)
token_head ``(num_blocks, block_size, H)``        dynamic: one per written token and KV
                                                  head, computed at write time
========== ====================================== =====================================
"""

from __future__ import annotations

import torch

from .errors import bad_argument
from .formats import Fp8Format, check_scale, get_format

GRANULARITIES = ("tensor", "head", "token_head")

MIN_DYNAMIC_SCALE = 2.0**-126
"""Floor of a dynamic scale: the smallest normal float32. An all-zero (or all-NaN)
vector gets exactly this scale; it is positive, finite and never subnormal."""

FLOAT32_MAX = torch.finfo(torch.float32).max


def check_granularity(scale_granularity: str) -> str:
    if scale_granularity not in GRANULARITIES:
        raise bad_argument("scale_granularity", repr(scale_granularity), f"one of {GRANULARITIES}")
    return scale_granularity


def token_head_scale(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The dynamic scale of each ``[..., D]`` vector: ``max(amax(|x|) / fmt.max, 2^-126)``.

    NaN elements are ignored (count as 0) and infinities count as the float32 max, so
    the scale is always finite and > 0. Math in float32, one IEEE division.

    Args:
        x: ``[num_tokens, H, D]`` float tensor.
    Returns:
        ``[num_tokens, H]`` float32.
    """
    a = torch.nan_to_num(x.to(torch.float32).abs(), nan=0.0, posinf=FLOAT32_MAX)
    amax = a.amax(dim=-1)
    # divide by a tensor: on CUDA torch turns "tensor / Python number" into a product with
    # the reciprocal, which is not the one correctly rounded division this promises
    s = amax / torch.full_like(amax, fmt.max)
    return s.clamp_min(MIN_DYNAMIC_SCALE)


def calibrate(
    samples: torch.Tensor,
    kv_dtype: str | Fp8Format = "fp8_e4m3",
    *,
    granularity: str = "tensor",
    margin: float = 1.0,
) -> torch.Tensor:
    """Static scale from sample K or V so that ``amax * margin`` maps to the format's max.

    Args:
        samples: ``[num_tokens, H, D]`` (any float dtype) taken from real activations.
        kv_dtype: the storage format the scale is for.
        granularity: ``"tensor"`` (returns shape ``()``) or ``"head"`` (shape ``(H,)``).
        margin: >= 1 head-room factor for values larger than the samples showed.
    Returns:
        float32 scale(s), finite and > 0 (zero samples give ``MIN_DYNAMIC_SCALE``).
    """
    fmt = get_format(kv_dtype)
    if not isinstance(samples, torch.Tensor) or not samples.is_floating_point():
        raise bad_argument("samples", type(samples).__name__ if not isinstance(samples, torch.Tensor)
                           else f"dtype {samples.dtype}", "a float tensor [num_tokens, H, D]")
    if samples.dim() != 3:
        raise bad_argument("samples", tuple(samples.shape), "[num_tokens, H, D]")
    if samples.shape[0] == 0 or samples.shape[2] == 0:
        raise bad_argument("samples", f"shape {tuple(samples.shape)}", "at least one token with head_size > 0")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not (1.0 <= margin < float("inf")):
        raise bad_argument("margin", repr(margin), "a finite number >= 1")
    if granularity not in ("tensor", "head"):
        raise bad_argument("granularity", repr(granularity), "'tensor' or 'head' (token_head is dynamic)")
    a = torch.nan_to_num(samples.to(torch.float32).abs(), nan=0.0, posinf=FLOAT32_MAX)
    amax = a.amax() if granularity == "tensor" else a.amax(dim=(0, 2))
    # in float64: amax * margin may exceed the float32 range while the scale does not
    scale = (amax.to(torch.float64) * float(margin) / fmt.max).clamp(MIN_DYNAMIC_SCALE, FLOAT32_MAX)
    return check_scale(scale.to(torch.float32), "scale")
