"""The opt-in FP8 attention mode: what it computes (the definition every backend meets).

In the default mode fp8kv decodes the cache exactly and computes attention in 16/32-bit
arithmetic. The FP8 mode (``plan_attention(..., fp8_attention=True)``) lets FP8 tensor cores
do both products, as FlashAttention-3's FP8 path does, at a documented precision cost
(docs/fp8_attention.md). Per query row (token ``t``, query head ``h`` of KV head ``g``):

1. **Query.** ``q8 = e4m3(q / q_scale)``, quantized bit for bit as the cache is
   (:func:`fp8kv.formats.divide_by_scale`, one IEEE float32 division, then
   :func:`fp8kv.formats.quantize_scaled`: saturate to +-448, round to nearest even). ``q_scale``
   is per tensor (``[]``), per KV head (``[H]``), per query head (``[Hq]``), or, when not
   given, dynamic per (token, head): ``max(amax|q| / 448, 2^-126)``, the cache's own
   per-token-head rule (:func:`fp8kv.scales.token_head_scale`).
2. **Logits.** ``s_j = softmax_scale * q_scale * k_scale_g * (q8 . k8_j)`` over the e4m3 codes of
   the cache, soft-capped and saturated exactly as in the default mode.
3. **Probabilities.** In base 2 (``b_j = s_j log2 e``) relative to ``M = ceil(max_j b_j)``, the
   row maximum rounded *up to an integer*: ``p_j = 2^(b_j - M)`` in ``(0, 1]``, the largest in
   ``(1/2, 1]``; ``l = sum_j p_j`` of the unrounded ``p`` (FA3 too sums before rounding).
4. **P rounding.** ``p8_j = e4m3(p_j / prob_scale)`` (round to nearest even, from float32).
5. **Output.** ``o = prob_scale * v_scale_g * sum_j p8_j v8_j / l``, then the output dtype
   (saturated); ``lse = (M + log2 l) ln 2``, the natural log-sum-exp of the logits as in the
   default mode.

Why ``M`` is a power of two and not the exact maximum (FA3 rounds ``exp(s - m_running)``): a
kernel's online softmax works against a running maximum that depends on its tile order. With
integer running maxima every rescaling is an exact power of two, and a power of two commutes with
e4m3 rounding wherever both values are normal (``>= 2^-6``), so any tiling rounds exactly the
reference's ``p8`` there. What remains between two implementations is bounded in
:func:`fp8kv.testing.tolerance.fp8_attention_tolerance`. The error against the default mode is
the same order as FA3's: a relative ``2^-4`` per probability at most, and the e4m3 query.

Scope: an ``fp8_e4m3`` cache with per-tensor or per-head scales (FA3's descales are one K and one
V scale per head; per-token-head V scales would have to enter ``p`` before its rounding). The
reference serves the mode everywhere; ``fp8kv probe`` shows which fast backends do.
"""

from __future__ import annotations

import math

import torch

from .checks import flag, real_scalar
from .errors import bad_argument
from .formats import FORMATS, divide_by_scale, quantize_scaled
from .scales import token_head_scale

E4M3 = FORMATS["fp8_e4m3"]
FP8_KV_DTYPES = ("fp8_e4m3",)
FP8_GRANULARITIES = ("tensor", "head")
FLOAT32_MAX = 3.4028234663852886e38
PROB_SCALES = "a finite number in [2^-126, FLOAT32_MAX]"
"""What ``prob_scale`` may be (a Python, NumPy or one-element CPU tensor scalar: :mod:`fp8kv.checks`)."""

__all__ = [
    "FP8_GRANULARITIES", "FP8_KV_DTYPES", "LAZY_MAX_T", "check_fp8_options", "check_prob_scale", "fp8_probabilities",
    "lazy_threshold", "query_scales", "quantize_query", "round_probabilities",
]

LAZY_MAX_T = 8
"""The largest threshold :func:`lazy_threshold` gives (FA4's: ``p`` up to 256)."""


def lazy_threshold(prob_scale: float) -> int:
    """How far (in base-2 logits) a kernel's running maximum may stay below a row's logits, as FA4's
    conditional rescaling lets it: the largest integer ``t <= LAZY_MAX_T`` with ``2^t <= 448
    prob_scale`` (0 below ``prob_scale = 1/448``), so that ``p <= 2^t`` divided by ``prob_scale`` never
    exceeds e4m3's largest value. The mode's tolerance covers such kernels
    (:mod:`fp8kv.testing.fp8_tolerance`, step 2 of its derivation)."""
    t = 0
    while t < LAZY_MAX_T and 2.0 ** (t + 1) <= 448.0 * prob_scale:
        t += 1
    return t


def check_fp8_options(spec, num_q_heads: int, fp8_attention, q_scale, prob_scale) -> tuple[bool, object, float]:
    """Validate the FP8-mode arguments of :func:`fp8kv.plan_attention` against a cache ``spec``.

    Returns ``(fp8_attention, q_scale, prob_scale)`` normalised (``q_scale`` a float32 tensor on
    the cache's device, or None; ``prob_scale`` a float). Shapes, dtypes and devices are always
    checked; ``q_scale``'s values (finite, > 0) too, which costs one host sync at plan time.
    """
    fp8_attention = flag("fp8_attention", fp8_attention)
    if prob_scale is not None:
        prob_scale = real_scalar("prob_scale", prob_scale, PROB_SCALES)
    if not fp8_attention:
        if q_scale is not None:
            raise bad_argument("q_scale", "a tensor", "None unless fp8_attention=True (the query is only "
                                                      "quantized in the FP8 attention mode)")
        if prob_scale is not None and prob_scale != 1.0:
            raise bad_argument("prob_scale", repr(prob_scale), "1.0 (or None) unless fp8_attention=True")
        return False, None, 1.0
    if spec.kv_dtype not in FP8_KV_DTYPES:
        raise bad_argument("fp8_attention", f"True with a {spec.kv_dtype} cache",
                           f"a cache of {' or '.join(FP8_KV_DTYPES)} (e4m3 x e4m3 tensor cores)")
    if spec.scale_granularity not in FP8_GRANULARITIES:
        raise bad_argument("fp8_attention", f"True with {spec.scale_granularity} scales",
                           f"{' or '.join(FP8_GRANULARITIES)} scales (one K and one V descale per head, as FA3)")
    H = spec.num_kv_heads
    if q_scale is not None:
        if not isinstance(q_scale, torch.Tensor):
            raise bad_argument("q_scale", type(q_scale).__name__, "a float32 tensor of shape [], "
                                                                  f"[{H}] (per KV head) or [{num_q_heads}], or None")
        if q_scale.dtype != torch.float32 or tuple(q_scale.shape) not in ((), (H,), (num_q_heads,)):
            raise bad_argument("q_scale", f"{q_scale.dtype} {tuple(q_scale.shape)}",
                               f"float32 of shape [], [{H}] (per KV head) or [{num_q_heads}] (per query head)")
        if q_scale.device != spec.device:
            raise bad_argument("q_scale", f"on {q_scale.device}", f"on the cache's device {spec.device}")
        if q_scale.requires_grad:
            raise bad_argument("q_scale", "a tensor that requires grad", "a plain scale tensor")
        bad = ~(torch.isfinite(q_scale) & (q_scale > 0))
        if bool(bad.any()):
            raise bad_argument("q_scale", f"{q_scale.flatten()[bad.flatten()][:4].tolist()}",
                               "finite values > 0")
        q_scale = q_scale.contiguous()
    return True, q_scale, 1.0 if prob_scale is None else check_prob_scale(prob_scale)


def check_prob_scale(prob_scale, name: str = "prob_scale") -> float:
    """``prob_scale`` (the scalar rule of :mod:`fp8kv.checks`) as a Python float in
    ``[2^-126, FLOAT32_MAX]``, else the error naming ``name``."""
    v = real_scalar(name, prob_scale, PROB_SCALES)
    if not (math.isfinite(v) and 2.0**-126 <= v <= FLOAT32_MAX):
        raise bad_argument(name, repr(v), PROB_SCALES)
    return v


def query_scales(query: torch.Tensor, q_scale: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """The scale of every query row, float32 ``[T, Hq]`` (see step 1 of the module docstring)."""
    T, Hq, _ = query.shape
    if q_scale is None:
        return token_head_scale(query, E4M3)
    qs = q_scale.to(device=query.device, dtype=torch.float32)
    if qs.dim() == 1 and qs.shape[0] == num_kv_heads and num_kv_heads != Hq:
        qs = qs.repeat_interleave(Hq // num_kv_heads)
    return qs.expand(T, Hq)


def quantize_query(query: torch.Tensor, q_scale: torch.Tensor | None, num_kv_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q8, qs)``: the e4m3 query ``[T, Hq, D]`` (``torch.float8_e4m3fn``) and its row scales ``[T, Hq]``.

    Bit for bit the cache's quantization: ``quantize_scaled(divide_by_scale(float32(q), qs))``.
    """
    qs = query_scales(query, q_scale, num_kv_heads)
    return quantize_scaled(divide_by_scale(query.to(torch.float32), qs[..., None]), E4M3), qs


def fp8_probabilities(logits: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p, l, M)`` of step 3 for natural-log ``logits [..., N]`` (float64, saturated) and a ``visible``
    mask broadcastable to them: ``p = 2^(b - M)`` (0 where not visible), ``l = sum p``, and ``M`` the
    row maximum of ``b = logits log2 e`` rounded up to an integer (``-inf`` for rows with no key)."""
    b = (logits * (1.0 / math.log(2.0))).masked_fill(~visible, float("-inf"))
    M = torch.ceil(b.amax(dim=-1, keepdim=True))
    safe = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    p = torch.exp2(b - safe)
    return p, p.sum(dim=-1, keepdim=True), M


def round_probabilities(p: torch.Tensor, prob_scale: float) -> torch.Tensor:
    """Step 4: ``e4m3(p / prob_scale)`` from float32, as float64 values."""
    x = (p / prob_scale).to(torch.float32)
    return quantize_scaled(x, E4M3).to(p.dtype)
