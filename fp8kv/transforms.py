"""Exact-at-read-time KV transforms that lower the FP8 error: attention-sink tokens and K centering.

Measured on SmolLM2 (``benchmarks/hf_precision.py``, docs/transformers.md): the FP8 error that
matters is in K, and two near-free changes attack it together:

* **sink tokens** (``sink_tokens = S``): the first ``S`` tokens of every sequence (its first
  ``S`` non-padding positions) are kept unquantized, in the model's dtype, beside the FP8 cache;
  they are never written to the FP8 cache;
* **K centering** (``k_centering``): every other key is stored as ``quant(k - mu)``, with ``mu``
  a per-(KV head, channel) vector fixed per sequence and layer: the mean of the sequence's
  first written non-sink keys (``"prefill"``) or a calibrated per-layer mean (``"calibrated"``).

The semantics (what :func:`effective_keys_values` computes, and what the integration must
match): position ``j`` of a sequence contributes the key/value

* ``k_j`` and ``v_j`` exactly (the model's dtype) for ``j < S``;
* ``k'_j = dq(quant(round(k_j - mu))) + mu`` and ``v'_j = dq(quant(v_j))`` for ``j >= S``,
  with ``round`` the cast back to the key's dtype, ``quant``/``dq`` the cache's FP8 codec;

and attention is the ordinary softmax attention over these (causal, window, soft-cap,
``softmax_scale`` as given). Nothing else changes: V is never centered, the FP8 bytes of a key
are exactly what :func:`fp8kv.write_kv` stores for ``round(k - mu)``.

How it is computed without ever adding ``mu`` back: for a query ``q`` every key ``k'_j`` enters
the softmax as ``s * q.k'_j = s * q.(k'_j - mu) + s * q.mu``; the last term is the same for every
key of the row, so the softmax over the centered keys is unchanged. The FP8 part is therefore
plain paged attention over the stored (centered) keys, returning its log-sum-exp; the sink part
is attention over ``k_j - mu`` (exact); :func:`merge_sink_attention` merges both in one softmax.
A logit soft-cap (``c * tanh(x / c)``) is not shift-invariant: centering with a soft-capped model
is refused (sink tokens alone are fine, ``mu = 0``). The ``+-LOGIT_MAX`` logit clamp of the
reference is applied to the centered logits (it only matters for logits near ``3.4e38 * ln 2``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import bad_argument
from .formats import dequantize, get_format, quantize
from .reference import LOGIT_MAX
from .scales import token_head_scale

CENTERINGS = (None, "prefill", "calibrated")


@dataclass(frozen=True)
class KVTransform:
    """A cache's transform: sink tokens and K centering (see the module docstring).

    Attributes:
        sink_tokens: ``S >= 0``: the first ``S`` tokens of each sequence kept unquantized.
        k_centering: None, ``"prefill"`` (``mu`` per sequence: the mean of its first written
            non-sink keys, fixed from then on) or ``"calibrated"`` (``k_means``, one per layer).
        k_means: ``"calibrated"`` only: one float32 ``[H, D]`` tensor per layer.
    """

    sink_tokens: int = 0
    k_centering: str | None = None
    k_means: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def build(cls, sink_tokens: int = 0, k_centering: str | None = None, k_means=None, *, num_layers: int,
              num_kv_heads: int, head_size: int) -> KVTransform:
        """Check the user's arguments (named errors) and normalise ``k_means`` to a per-layer tuple.

        ``k_means``: a sequence with one ``[H, D]`` tensor per layer or a mapping layer -> tensor
        covering every layer (e.g. from :func:`calibrate_key_means`).
        """
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise bad_argument("sink_tokens", repr(sink_tokens), "an int >= 0 (0: no sink tokens)")
        if k_centering not in CENTERINGS:
            raise bad_argument("k_centering", repr(k_centering), f"one of {list(CENTERINGS)}")
        if k_centering == "calibrated":
            if isinstance(k_means, Mapping):
                missing = [i for i in range(num_layers) if i not in k_means]
                if missing:
                    raise bad_argument("k_means", f"no mean for layers {missing[:4]}", "one per layer")
                k_means = [k_means[i] for i in range(num_layers)]
            if not isinstance(k_means, Sequence) or len(k_means) != num_layers:
                got = f"{len(k_means)} entries" if isinstance(k_means, Sequence) else type(k_means).__name__
                raise bad_argument("k_means", got, f"one float [{num_kv_heads}, {head_size}] tensor per layer "
                                                   f"({num_layers}) with k_centering='calibrated'")
            means = []
            for i, m in enumerate(k_means):
                if not isinstance(m, torch.Tensor) or not m.is_floating_point() or \
                        tuple(m.shape) != (num_kv_heads, head_size) or not bool(torch.isfinite(m).all()):
                    got = f"{m.dtype} {tuple(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
                    raise bad_argument("k_means", f"layer {i}: {got}",
                                       f"a finite float tensor of shape [{num_kv_heads}, {head_size}]")
                means.append(m.detach().to(torch.float32).cpu())
            k_means = tuple(means)
        elif k_means is not None:
            raise bad_argument("k_means", "given", "None unless k_centering='calibrated'")
        return cls(sink_tokens, k_centering, k_means)

    @property
    def active(self) -> bool:
        """Whether the cache stores anything differently from a plain FP8 cache."""
        return self.sink_tokens > 0 or self.k_centering is not None

    def describe(self) -> str:
        parts = [f"{self.sink_tokens} sink token(s)"] if self.sink_tokens else []
        if self.k_centering:
            parts.append(f"K centering ({self.k_centering})")
        return ", ".join(parts) or "none"


# ------------------------------------------------------------------------------------ the write side


def row_key_means(key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Per-row mean of the keys selected by ``mask``: ``mu [B, H, D]`` float32.

    Args:
        key: ``[B, T, H, D]`` (any float dtype).
        mask: ``[B, T]`` bool (True = a key to average) or None (all); a row with no key gets 0.
    """
    k = key.to(torch.float32)
    if mask is None:
        return k.mean(dim=1)
    w = mask.to(torch.float32)
    n = w.sum(dim=1).clamp_min(1.0)  # [B]
    return torch.einsum("bt,bthd->bhd", w, k) / n[:, None, None]


def center_keys(key: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """``round(key - mu)``: ``key [B, T, H, D]`` minus ``means [B, H, D]`` (float32), cast back
    to the key's dtype (what the FP8 cache then quantizes)."""
    return (key.to(torch.float32) - means[:, None]).to(key.dtype)


# ------------------------------------------------------------------------------------ the read side


def sink_visibility(sink_lens: torch.Tensor, positions: torch.Tensor, num_sink: int,
                    sliding_window: int | None) -> torch.Tensor:
    """``[N, S]`` bool: whether query ``n`` (at absolute ``positions[n]``, in a row holding
    ``sink_lens[n]`` sink tokens) sees sink token ``j``: ``j < sink_lens[n]``, ``j <= position``
    and, with a window ``W``, ``position - j < W``."""
    j = torch.arange(num_sink, device=positions.device)
    vis = (j[None, :] < sink_lens[:, None]) & (j[None, :] <= positions[:, None])
    if sliding_window is not None:
        vis &= positions[:, None] - j[None, :] < sliding_window
    return vis


def merge_sink_attention(query: torch.Tensor, out_fp8: torch.Tensor, lse_fp8: torch.Tensor | None,
                         sink_k: torch.Tensor, sink_v: torch.Tensor, visible: torch.Tensor | None,
                         means: torch.Tensor | None, *, softmax_scale: float,
                         logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention over sink keys and the FP8 part together, in one softmax.

    The FP8 part enters as one extra "key" with logit ``lse_fp8`` and value ``out_fp8`` (its
    output is the softmax-weighted mean of its values, its log-sum-exp their total weight).

    Args:
        query: ``[N, Hq, D]`` queries (Hq a multiple of H).
        out_fp8 / lse_fp8: ``[N, Hq, D]`` and float32 ``[N, Hq]`` from ``paged_attention(...,
            return_lse=True)`` over the centered FP8 keys (``lse = -inf``: no FP8 key); ``lse_fp8``
            None: no query has an FP8 key.
        sink_k / sink_v: ``[N, S, H, D]``: each query's row's sink keys and values (unquantized).
        visible: ``[N, S]`` bool from :func:`sink_visibility`, or None (all visible).
        means: ``[N, H, D]`` float32 centering of each query's row, or None (no centering).
    Returns:
        ``[N, Hq, D]`` in the query's dtype. Every query must see at least one key (its own).
    """
    N, Hq, D = query.shape
    S, H = sink_k.shape[1], sink_k.shape[2]
    g = Hq // H
    dt = torch.promote_types(query.dtype, torch.float32)  # float32 math (float64 for float64 input)
    k = sink_k.to(dt)
    if means is not None:
        if logits_soft_cap is not None:
            raise bad_argument("k_centering", "with a logit soft-cap", "no centering (soft-capped logits are "
                               "not shift-invariant)")
        k = k - means.to(dt)[:, None]
    q = query.to(dt).view(N, H, g, D)
    logits = torch.matmul(q, k.permute(0, 2, 3, 1)).mul_(softmax_scale)  # [N, H, g, S]
    if logits_soft_cap is not None:
        logits = torch.tanh(logits.div_(logits_soft_cap)).mul_(logits_soft_cap)
    logits.clamp_(-LOGIT_MAX, LOGIT_MAX)
    if visible is not None:
        logits.masked_fill_(~visible[:, None, None, :], float("-inf"))
    v = sink_v.to(dt).transpose(1, 2)  # [N, H, S, D]
    if lse_fp8 is None:
        o = torch.matmul(torch.softmax(logits, dim=-1), v)
    elif S == 1:  # two "keys": the FP8 part's weight is sigmoid(lse - logit)
        w = torch.sigmoid(lse_fp8.to(dt).view(N, H, g, 1) - logits)
        o = torch.lerp(v.expand(N, H, g, D), out_fp8.to(dt).view(N, H, g, D), w)
    else:
        p = torch.softmax(torch.cat([logits, lse_fp8.to(dt).view(N, H, g, 1)], dim=-1), dim=-1)
        o = torch.matmul(p[..., :S], v) + p[..., S:] * out_fp8.to(dt).view(N, H, g, D)
    return o.reshape(N, Hq, D).to(query.dtype)


# ------------------------------------------------------------------------------------ the definition


def effective_keys_values(key: torch.Tensor, value: torch.Tensor, transform: KVTransform, kv_dtype: str,
                          mean: torch.Tensor | None = None, k_scale=None, v_scale=None, *, start: int = 0,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention sees for one sequence's keys/values under ``transform`` (the definition).

    Args:
        key / value: ``[T, H, D]``: the sequence's K/V in position order, as the model made them.
        mean: ``[H, D]`` float32: the sequence's ``mu`` (None: no centering).
        k_scale / v_scale: static dequant scales (``()`` or ``[H]``), None for per-token-head.
        start: the position of ``key[0]`` in its sequence (for a part of it).
    Returns:
        ``(k', v')`` ``[T, H, D]`` float32: exact below ``sink_tokens``, else
        ``dq(quant(round(k - mu))) + mu`` and ``dq(quant(v))``.
    """
    fmt = get_format(kv_dtype)
    k = key if mean is None else (key.to(torch.float32) - mean).to(key.dtype)

    def fake(x, scale):
        s = token_head_scale(x, fmt)[..., None] if scale is None else \
            torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1)
        return dequantize(quantize(x, fmt, s), s, dtype=torch.float32)

    kq = fake(k, k_scale) + (0.0 if mean is None else mean)
    vq = fake(value, v_scale)
    S = min(max(transform.sink_tokens - start, 0), key.shape[0])
    kq[:S] = key[:S].to(torch.float32)
    vq[:S] = value[:S].to(torch.float32)
    return kq, vq


@torch.no_grad()
def calibrate_key_means(keys: Sequence[torch.Tensor], skip_first: int = 1) -> list[torch.Tensor]:
    """Per-layer K means for ``k_centering="calibrated"`` from calibration keys.

    Args:
        keys: one ``[B, H, T, D]`` (transformers' layout) tensor per layer.
        skip_first: positions at the start of each row left out (the attention sink, whose key is
            far from the others).
    Returns:
        one float32 ``[H, D]`` tensor per layer.
    """
    return [k[:, :, skip_first:].to(torch.float32).mean(dim=(0, 2)) for k in keys]


__all__ = ["CENTERINGS", "KVTransform", "calibrate_key_means", "center_keys", "effective_keys_values",
           "merge_sink_attention", "row_key_means", "sink_visibility"]
