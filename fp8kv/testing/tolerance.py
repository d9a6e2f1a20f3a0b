"""The derived tolerance for comparing a backend's paged attention with the reference.

Attention over an FP8 cache cannot be bit-exact across backends (operation order,
online softmax, approximate ``exp``/``tanh``), but it can be held to a bound that
follows from the arithmetic, rather than to a loose number picked to pass. The bound
below is per output element and is tight enough to catch real bugs (a wrong V scale,
a dropped key, an off-by-one window: see ``tests/test_conformance.py``).

Setting
-------
Both sides compute, from the *same* dequantized ``k' = float(code) * k_scale`` and
``v'``, in float32 (unit roundoff ``u = 2^-24``), the exact function

    o = sum_j p_j v'_j,   p = softmax(s),   s_j = cap(softmax_scale * q . k'_j)

over the keys ``j`` visible to the query, and differ only in the order of the
operations and in approximate ``exp``/``exp2``/``tanh``. Let, per query row and head,

* ``L = softmax_scale * max_j sum_i |q_i k'_ji|`` (``logit_bound``; :func:`logit_bound`),
  which bounds ``|s_j|``; with soft-cap ``c`` the capped logits obey ``|s_j| <= S = min(L, c)``,
  without it ``S = L``;
* ``V = max_j max_i |v'_ji|`` (``v_absmax``) and ``N`` the number of visible keys.

Derivation (per side, against the exact ``o``)
----------------------------------------------
1. Logits. A length-``D`` dot product in any order is off by at most ``gamma_D * sum|q_i k'_i|``
   (``gamma_n = n u / (1 - n u)``); dequantizing ``k'`` (or folding ``k_scale`` into the
   logits instead), the ``softmax_scale`` product and a pre-scaled query add at most four
   more roundings. The shift by the running max, the ``log2(e)`` product and an
   approximate ``exp2`` (relative error <= 4u) act like a logit error of at most
   ``8 u max(1, |s|)``; soft-capping (division by ``c``, approximate ``tanh``, product by
   ``c``; ``tanh`` is 1-Lipschitz) adds ``8 u c``. So each logit is off by at most

       delta = (D + 4) u L + 8 u max(1, S)  [+ 8 u c with soft-cap].

2. Weights. Perturbing every logit by at most ``delta`` multiplies each softmax weight by
   a factor in ``[e^-2delta, e^2delta]``, so the weights move by at most ``e^(2 delta) - 1``
   in L1 norm; the two sides' weights differ by at most ``2 (e^(2 delta) - 1)`` (triangle
   inequality through the exact weights), hence their outputs by ``V`` times that.
3. Weighted sum. The numerator ``sum_j e_j v'_j`` and the normalizer ``sum_j e_j`` each see
   at most ``N`` additions, ``N`` products and ``N`` online-softmax rescalings; the final
   division one rounding more. Relative to ``V`` this is at most ``(2N + 2) u`` for the
   numerator and as much for the normalizer (``|o| <= V``), per side; both sides:
   ``2 * (4N + 4) u``; a further ``16 u`` covers a split-KV merge of partial results.

So, in float32,

    |o_kernel - o_ref| <= E := V * (2 (e^(2 delta) - 1) + (8 N + 8) u + 16 u).

This counts the reference's own rounding as well as the kernel's (the reference is float32
too, not exact), which is why the accumulation term is ``8N + 8`` and not ``N + 2``: worst
cases are rare, but a derived bound must cover them.

4. Output rounding. Each side finally rounds its float32 value to ``out_dtype`` (half an
   ulp each), so per element

       tol = E + ulp_out(|ref| + E)

   where ``ulp_out(x)`` is the unit in the last place of ``out_dtype`` at magnitude ``x``:
   ``2^(floor(log2 x) - p)`` with ``p`` = 23 (float32), 10 (float16), 7 (bfloat16), never
   below the dtype's smallest subnormal (``2^-149``, ``2^-24``, ``2^-133``). Where
   ``|ref| + E`` exceeds the largest finite value of ``out_dtype`` either side may round to
   infinity, so the tolerance there is ``inf``; a non-finite bound (non-finite K/V) is
   ``inf`` too, and NaN outputs must match NaN references.

5. Log-sum-exp (``return_lse``). ``lse = log sum_j e^{s_j}`` is 1-Lipschitz in the max norm of
   the logits, so each side's logit errors move it by at most ``delta``; the normalizer's
   ``(2N + 2) u`` relative error moves its logarithm by at most as much; an approximate
   ``log``/``log2`` adds ``4 u max(1, log2 N)``; forming ``m + log(l)`` (and the base change)
   rounds relative to ``|lse|`` and ``|m| <= S``: ``4 u (|lse| + S + 1)``. Both sides:

       |lse_kernel - lse_ref| <= 2 (delta + (2N + 2) u + 4 u max(1, log2 N)) + 4 u (|lse_ref| + S + 1).

A backend that deliberately computes in lower precision (TF32 or bf16 matrix products)
is outside the setting; it may pass its own ``unit_roundoff`` and must document it.

Typical use (``bounds`` are computed from the cache the kernel read)::

    bounds = paged_attention_bounds(query, cache, block_tables, seq_lens, query_start_loc,
                                    softmax_scale=..., sliding_window=..., logits_soft_cap=...)
    assert_attention_close(out, ref, **bounds)
"""

from __future__ import annotations

import math

import torch

from ..precision import FULL_P_KEYS
from .fp8_tolerance import U_FP8_DOT, assert_fp8_attention_close, fp8_attention_tolerance, fp8_probability_envelope
from .units import U32, ulp, worst_violation

__all__ = [
    "FULL_P_KEYS",
    "U32",
    "U_FP8_DOT",
    "assert_attention_close",
    "assert_fp8_attention_close",
    "assert_lse_close",
    "attention_error_bound",
    "attention_tolerance",
    "fp8_attention_tolerance",
    "fp8_probability_envelope",
    "lse_tolerance",
    "logit_bound",
    "paged_attention_bounds",
    "ulp",
]

Scalar = float | int | torch.Tensor


def _as64(x: Scalar, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64, device=like.device)


def attention_error_bound(
    *, head_size: int, num_keys: Scalar, logit_bound: Scalar, v_absmax: Scalar,
    soft_cap: float | None = None, unit_roundoff: float = U32, like: torch.Tensor | None = None,
) -> torch.Tensor:
    """``E``: the bound on ``|o_kernel - o_ref|`` before rounding to the output dtype.

    ``num_keys``, ``logit_bound`` and ``v_absmax`` are numbers or tensors broadcastable
    against the output ``[num_tokens, Hq, D]`` (e.g. ``[num_tokens, Hq, 1]``). Float64.
    """
    like = like if like is not None else torch.empty(())
    u = unit_roundoff
    L = _as64(logit_bound, like)
    V = _as64(v_absmax, like)
    N = _as64(num_keys, like)
    delta, _ = _logit_error(head_size, L, soft_cap, u)
    weights = 2 * torch.expm1(2 * delta)
    accumulation = (8 * N + 8) * u + 16 * u
    E = V * (weights + accumulation)
    return torch.where(torch.isfinite(E), E, torch.full_like(E, math.inf))


def attention_tolerance(
    ref: torch.Tensor, *, out_dtype: torch.dtype, head_size: int, num_keys: Scalar, logit_bound: Scalar,
    v_absmax: Scalar, soft_cap: float | None = None, unit_roundoff: float = U32,
) -> torch.Tensor:
    """Per-element absolute tolerance ``E + ulp_out(|ref| + E)`` (see the module docstring).

    Args:
        ref: the reference output ``[num_tokens, Hq, D]`` (any float dtype).
        out_dtype: the dtype both outputs are rounded to (the query dtype).
        head_size: D.
        num_keys: visible keys per query row (number or tensor broadcastable to ``ref``).
        logit_bound: ``softmax_scale * max_j sum_i |q_i k'_ji|`` per row/head (before soft-cap).
        v_absmax: ``max |v'|`` over the visible keys per row/head.
        soft_cap: the logit soft-cap ``c``, or None.
        unit_roundoff: of the kernel's arithmetic (float32: ``2^-24``).
    Returns:
        float64 tensor shaped like ``ref``.
    """
    E = attention_error_bound(head_size=head_size, num_keys=num_keys, logit_bound=logit_bound,
                              v_absmax=v_absmax, soft_cap=soft_cap, unit_roundoff=unit_roundoff, like=ref)
    mag = ref.detach().to(torch.float64).abs() + E
    tol = E + ulp(mag, out_dtype)
    overflow = mag > torch.finfo(out_dtype).max
    return torch.where(overflow | torch.isnan(tol), torch.full_like(tol, math.inf), tol)


def assert_attention_close(
    out: torch.Tensor, ref: torch.Tensor, *, out_dtype: torch.dtype | None = None, head_size: int,
    num_keys: Scalar, logit_bound: Scalar, v_absmax: Scalar, soft_cap: float | None = None,
    unit_roundoff: float = U32, context: str = "",
) -> None:
    """Raise AssertionError unless ``|out - ref| <= attention_tolerance(ref, ...)`` everywhere.

    Equal values (infinities included) and NaN where the reference is NaN pass. The message
    names how many elements violate, the worst one (``[token, head, dim]``, both values, the
    difference, the tolerance and the bounds there) and ``context``.
    """
    out_dtype = out.dtype if out_dtype is None else out_dtype
    if out.shape != ref.shape:
        raise AssertionError(f"{context}output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    tol = attention_tolerance(ref, out_dtype=out_dtype, head_size=head_size, num_keys=num_keys,
                              logit_bound=logit_bound, v_absmax=v_absmax, soft_cap=soft_cap,
                              unit_roundoff=unit_roundoff)
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    diff = (o - r).abs()
    ok = (o == r) | (torch.isnan(o) & torch.isnan(r)) | (diff <= tol)
    if bool(ok.all()):
        return
    bad = ~ok
    worst_ratio, idx = worst_violation(ok, diff, tol)

    def at(x: Scalar) -> float:
        t = _as64(x, ref)
        return float(t.expand(ref.shape)[idx]) if t.dim() else float(t)

    raise AssertionError(
        f"{context}attention output differs from the reference beyond the derived tolerance at "
        f"{int(bad.sum())} of {bad.numel()} elements; worst at [token, head, dim] = {list(idx)}: "
        f"got {float(o[idx])!r}, reference {float(r[idx])!r}, |diff| = {float(diff[idx]):.6g} > "
        f"tol = {float(tol[idx]):.6g} ({worst_ratio:.3g}x); bounds there: "
        f"num_keys={at(num_keys):g}, logit_bound={at(logit_bound):.6g}, v_absmax={at(v_absmax):.6g}, "
        f"head_size={head_size}, soft_cap={soft_cap}, out_dtype={out_dtype}"
    )


def _logit_error(head_size: int, L: torch.Tensor, soft_cap: float | None, u: float) -> tuple[torch.Tensor, ...]:
    """``(delta, S)`` of step 1 of the derivation."""
    S = L if soft_cap is None else torch.clamp(L, max=float(soft_cap))
    delta = (head_size + 4) * u * L + 8 * u * torch.clamp(S, min=1.0)
    if soft_cap is not None:
        delta = delta + 8 * u * float(soft_cap)
    return delta, S


def lse_tolerance(ref_lse: torch.Tensor, *, head_size: int, num_keys: Scalar, logit_bound: Scalar,
                  soft_cap: float | None = None, unit_roundoff: float = U32) -> torch.Tensor:
    """Per-row absolute tolerance of the log-sum-exp (step 5 of the derivation), float64 ``[T, Hq]``.

    ``num_keys`` and ``logit_bound`` as returned by :func:`paged_attention_bounds`
    (``[T, 1, 1]`` and ``[T, Hq, 1]``).
    """
    u = unit_roundoff
    L = _as64(logit_bound, ref_lse)
    N = _as64(num_keys, ref_lse)
    L, N = (x.squeeze(-1) if x.dim() == 3 else x for x in (L, N))
    delta, S = _logit_error(head_size, L, soft_cap, u)
    log_n = torch.log2(torch.clamp(N, min=2.0))
    tol = 2 * (delta + (2 * N + 2) * u + 4 * u * log_n) + 4 * u * (ref_lse.detach().to(torch.float64).abs() + S + 1)
    return torch.where(torch.isfinite(tol), tol, torch.full_like(tol, math.inf))


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, *, head_size: int, num_keys: Scalar,
                     logit_bound: Scalar, soft_cap: float | None = None, unit_roundoff: float = U32,
                     context: str = "", **_unused) -> None:
    """Raise AssertionError unless ``|lse - ref_lse| <= lse_tolerance(...)`` for every row.

    Accepts the dict of :func:`paged_attention_bounds` as keywords (extra keys are ignored).
    """
    if lse.shape != ref_lse.shape or lse.dtype != torch.float32:
        raise AssertionError(f"{context}lse is {lse.dtype} {tuple(lse.shape)}, expected float32 "
                             f"{tuple(ref_lse.shape)}")
    tol = lse_tolerance(ref_lse, head_size=head_size, num_keys=num_keys, logit_bound=logit_bound,
                        soft_cap=soft_cap, unit_roundoff=unit_roundoff)
    a, r = lse.detach().to(torch.float64), ref_lse.detach().to(torch.float64)
    diff = (a - r).abs()
    ok = (a == r) | (diff <= tol)
    if bool(ok.all()):
        return
    _, idx = worst_violation(ok, diff, tol)
    raise AssertionError(f"{context}log-sum-exp differs from the reference beyond the derived tolerance at "
                         f"{int((~ok).sum())} of {ok.numel()} rows; worst at [token, head] = {list(idx)}: got "
                         f"{float(a[idx])!r}, reference {float(r[idx])!r}, tol {float(tol[idx]):.6g}")


def logit_bound(query: torch.Tensor, keys: torch.Tensor, softmax_scale: float,
                visible: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax_scale * max_j sum_i |q_i k_ji|`` over the visible keys, per query row and head.

    Args:
        query: ``[T, Hq, D]`` (any float dtype; the kernel's float32 view of it).
        keys: ``[L, H, D]`` dequantized float32 keys of one sequence, ``Hq`` a multiple of ``H``.
        softmax_scale: the scale the kernel applies.
        visible: optional ``[T, L]`` bool: which keys each query row sees (default all).
    Returns:
        ``[T, Hq, 1]`` float64 (0 for rows that see no key).
    """
    group = query.shape[1] // keys.shape[1]
    q = query.detach().to(torch.float64).abs()
    k = keys.detach().to(torch.float64).abs().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,lhd->thl", q, k)  # [T, Hq, L]
    if visible is not None:
        s = s.masked_fill(~visible[:, None, :], 0.0)
    return (s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.sum(-1, keepdim=True)) * softmax_scale


def paged_attention_bounds(
    query: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None, *, softmax_scale: float | None = None,
    causal: bool = True, sliding_window: int | None = None, logits_soft_cap: float | None = None,
) -> dict:
    """Everything :func:`assert_attention_close` needs for one paged-attention call.

    Reads the (already written) ``cache`` the way the reference does and returns a dict
    with ``out_dtype``, ``head_size``, ``soft_cap`` and, per query row, ``num_keys``
    ``[T, 1, 1]``, ``logit_bound`` and ``v_absmax`` ``[T, Hq, 1]`` over the keys that row sees.
    Arguments are those of :func:`fp8kv.paged_attention`.
    """
    from ..reference import visible_mask

    T, Hq, D = query.shape
    dev = query.device
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    if query_start_loc is None:
        query_start_loc = torch.arange(seq_lens.shape[0] + 1, device=dev)
    starts = query_start_loc.tolist()
    num_keys = torch.zeros(T, 1, 1, dtype=torch.float64, device=dev)
    lbound = torch.zeros(T, Hq, 1, dtype=torch.float64, device=dev)
    vmax = torch.zeros(T, Hq, 1, dtype=torch.float64, device=dev)
    group = Hq // cache.num_kv_heads
    # dequantized in float64: at extreme scales float32 would overflow and leave only inf bounds
    keys64, values64 = ((cache.token_view(w).to(torch.float64) * cache.scale_per_slot(w).to(torch.float64)[..., None])
                        for w in ("key", "value"))
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        pos = torch.arange(seq_len, device=dev)
        slots = block_tables[i].to(torch.long)[pos // cache.block_size] * cache.block_size \
            + pos % cache.block_size
        k = keys64[slots]  # [L, H, D]
        v = values64[slots]
        vis = visible_mask(seq_len, hi - lo, causal, sliding_window, dev)  # [ql, L]
        num_keys[lo:hi, 0, 0] = vis.sum(-1).to(torch.float64)
        lbound[lo:hi] = logit_bound(query[lo:hi], k, scale, vis)
        va = v.to(torch.float64).abs().amax(dim=-1).repeat_interleave(group, dim=1)  # [L, Hq]
        va = va.T[None].expand(hi - lo, Hq, seq_len).masked_fill(~vis[:, None, :], 0.0)
        vmax[lo:hi, :, 0] = va.amax(dim=-1) if seq_len else 0.0
    return {"out_dtype": query.dtype, "head_size": D, "num_keys": num_keys, "logit_bound": lbound,
            "v_absmax": vmax, "soft_cap": logits_soft_cap}
