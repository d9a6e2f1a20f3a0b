"""The derived tolerance of the FP8 attention mode (:mod:`fp8kv.fp8_attention`).

The mode is defined by the reference (float64 apart from the two e4m3 roundings that define
it: the query's and the probabilities'). A kernel computes the same function with FP8 tensor
cores and an online softmax; it cannot match bit for bit, and this module bounds by how much it
may differ, per output element, from the reference's own intermediate values. The bound is
data-dependent (it is evaluated on the reference's probabilities), derived below, and tight
enough that a wrong ``q_scale``, a wrong V scale, a dropped key or unrounded probabilities
violate it (``tests/test_fp8_attention.py``).

Notation (one query row: token ``t``, query head ``h`` of KV head ``g``)
-----------------------------------------------------------------------
``q8``, ``qs``: the e4m3 query and its scale (bit-exact on both sides: tested separately);
``k8_j``, ``v8_j``: the cache's codes of the visible keys ``j`` (``N`` of them);
``c = softmax_scale * qs * k_scale_g``; ``Q_j = sum_i |q8_i k8_ji|``; ``L = c max_j Q_j``;
``S = min(L, cap)`` with a soft-cap, else ``L``; ``ps = prob_scale``; ``u = 2^-24``;
``u8 = fp8_dot_roundoff`` (default :data:`U_FP8_DOT` = ``2^-13``) and ``u8v = pv_dot_roundoff``
(same default): the accumulator model of a tensor-core dot, below.
The reference: ``b_j = s_j log2 e``, ``M = ceil(max_j b_j)``, ``p_j = 2^(b_j - M)``,
``x_j = p_j / ps`` rounded to float32, ``R_j = e4m3(x_j)``, ``l = sum_j p_j``,
``o = ps v_scale_g sum_j R_j v8_j / l``.

1. Logits. Hopper's FP8 ``wgmma`` does not accumulate in full float32. Measured on an H100 and
   emulated bit for bit (:mod:`fp8kv.testing.fp8_accumulator`): each step of (up to) 32 products
   aligns the running sum ``C`` and the products to their largest exponent, truncates each toward
   zero at ``u8`` (``2^-13``) of it, and truncates the exact sum to 14 significant bits. So with
   ``|C| <= |exact running sum| + err`` and ``q = u8 2^floor(log2 max(|C|, max |term|))``, a step adds
   at most ``sum_i min(|term_i|, q) + min(|C|, q)`` plus ``u8`` of the new sum
   (:func:`hopper_dot_error`, evaluated per logit on the exact ``q8 k8`` terms of each 32-dim slice:
   ``err_j``); this is the default (``accumulator="hopper"``). The older model
   (``accumulator="steps"``): each step adds at most ``u8`` times the partial sum's magnitude, so
   ``(ceil(D / 32) + 1) u8 Q_j``; an accumulation that keeps 13 bits of its partial sums in any key
   order is inside it, Hopper's is not (``tests/test_fp8_attention.py``, on recorded H100 products).
   Then the dot error in logit units is ``c err_j`` (or ``(ceil(D / 32) + 1) u8 L``);
   the scale products, the ``log2 e`` product, the running-max shift and ``exp2`` add the
   default mode's ``4 u L + 8 u max(1, S)`` (``fp8kv.testing.tolerance``, step 1), the soft-cap
   ``8 u cap``. Each logit is off by at most

       delta = max_j c err_j + 4 u L + 8 u max(1, S)  [+ 8 u cap]
       ("steps": (ceil(D / 32) + 1) u8 L in place of the first term).

2. What the kernel rounds. A kernel's online softmax works against running maxima ``M_r``; with
   the mode's integer maxima it rounds ``e4m3(2^k y_j)`` and scales the result back by the exact
   power of two ``2^-k`` (``k = M - M_r``), where ``y_j = 2^(b~_j - M) / ps`` is its unrounded
   value in the reference's units. ``y_j`` lies in ``[x_j / g, x_j g]``, ``g = e^(2 delta)
   (1 + max(4u, 2^-22))`` (logit error; ``1 / ps`` applied as a product with a rounded
   reciprocal; both sides' ``x`` rounded to float32).
   ``k >= -shift`` with ``shift = ceil(max_j b_j + delta log2 e) - M`` (0 or 1 unless ``delta`` is
   huge): the kernel's final maximum may exceed the reference's by that much, never more.
   ``2^k y_j <= 1 / ps``: a key's ``p`` is at most 1 against any running maximum that includes it;
   a kernel may also keep a running maximum below a key's logit, as FA4's conditional rescaling
   does, as long as ``p <= 2^t`` with ``2^t <= 448 ps`` (:func:`fp8kv.fp8_attention.lazy_threshold`): then ``2^k y_j <=
   2^t / ps <= 448``, so nothing saturates that the reference does not, and step 3 holds as written
   (its normal case needs ``2^k y`` normal and at most 448, its subnormal case any ``k >= -shift``).

3. P rounding (:func:`fp8_probability_envelope`). Every such ``K_j = 2^-k e4m3(2^k y)``, ``y`` in
   ``[lo, hi]``, lies in an interval ``[lower, upper]`` containing ``R_j``:

   * ``y >= 2^(shift - 6)``: ``2^k y`` is an e4m3 normal for every allowed ``k``, and a power of
     two commutes with rounding there, so ``K_j = e4m3(y)``; rounding is monotone: ``K_j`` is in
     ``[e4m3(lo), e4m3(hi)]``;
   * below that, the kernel may round on a finer or coarser grid: ``|K - y| <= err(y) =
     max(2^-4 y, min(y, 2^(shift - 10)))`` (a normal rounds within half an ulp, ``2^-4``
     relative with 3 mantissa bits; a subnormal of spacing ``2^-9``, scaled by ``2^-k`` with
     ``k >= -shift``, within ``2^(shift - 10)``; a value rounded to 0 loses at most itself), so
     ``K`` is in ``[lo - err(lo), hi + err(hi)]`` (both ends monotone in ``y``);
   * saturation: ``2^k y`` above 448 becomes ``448 >= 448 ps y`` (as ``2^k y <= 1/ps``): where
     ``1/ps`` reaches 464 (below that, saturating gives what rounding would), the lower end
     drops to ``448 ps lo``; above 448 a coarser grid (``k < 0``) may not saturate:
     ``y (1 +- 2^-4)``.

   Per key ``Delta_j = max(upper_j - R_j, R_j - lower_j)`` (0 for keys the row does not see).

4. Output. With ``A_d = ps v_scale sum_j R_j |v8_jd| / l`` and ``B_d = ps v_scale sum_j Delta_j
   |v8_jd| / l`` per element ``d``: the kernel's normaliser (a float32 sum of its unrounded ``p``)
   is ``l`` times a factor within ``rho = e^(2 delta) - 1 + (2N + 2) u`` of 1; its ``p8 @ v8`` is
   a tensor-core reduction over the keys: step 1's bound over the 32-aligned key blocks with terms
   ``K_j |v8_jd|``, ``K_j <= R_j + Delta_j``, and a running sum bounded for an accumulation that
   starts at any 32-aligned key (a split): ``H_d`` (times ``ps v_scale / l``; "steps":
   ``(ceil(N / 32) + 1) u8v (A_d + B_d)``), plus ``gamma (A + B)`` with ``gamma = (N + 22) u`` (a
   float32 accumulation of the tiles, the division by ``l``, two scale products, the output
   rounding to float32 and a split-KV merge: ``16 u``). So

       |o_kernel - o_ref| <= E_d = (1 + rho) B_d + rho A_d + (1 + rho) (gamma (A_d + B_d) + H_d)

   and the tolerance is ``E_d + ulp_out(|ref| + E_d)`` (both sides round to the output dtype;
   ``inf`` where that may overflow, or where the bound is not finite).

5. Log-sum-exp: the kernel's ``(M~ + log2 l~) ln 2`` is the log-sum-exp of its own logits, so it
   moves by at most ``2 (delta + (2N + 2) u + 4 u max(1, log2 N)) + 4 u (|lse| + S + 1)``, as in
   the default mode.

A backend with exact float32 dot products is inside the model (``u8 = u8v = 0`` would be its
own, tighter, setting); one with a coarser accumulator passes its own ``fp8_dot_roundoff`` /
``pv_dot_roundoff`` and documents it.
"""

from __future__ import annotations

import math

import torch

from .fp8_accumulator import exponent
from .units import U32, ulp, worst_violation

U_FP8_DOT = 2.0**-13
"""The quantum of an FP8 tensor-core step relative to its largest term (``accumulator="hopper"``,
measured on an H100: fp8kv.testing.fp8_accumulator), or relative to the step's partial sum
(``"steps"``). A backend with exact float32 dots is inside both."""

E4M3_MAX = 448.0
E4M3_SAT_MIDPOINT = 464.0
"""Halfway between 448 and 480 (the next value of e4m3's grid): values below it round to 448 anyway."""
E4M3_HALF_ULP = 2.0**-4
"""Relative half-ulp of an e4m3 normal (3 mantissa bits)."""

__all__ = ["E4M3_HALF_ULP", "E4M3_MAX", "U_FP8_DOT", "assert_fp8_attention_close", "fp8_attention_tolerance",
           "fp8_probability_envelope"]


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """``e4m3(x)`` (float32 first, saturating, round to nearest even) as float64."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)


def fp8_probability_envelope(lo: torch.Tensor, hi: torch.Tensor, prob_scale: float,
                             shift: torch.Tensor | float, online_softmax: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3 of the derivation: ``(lower, upper)``, float64 like ``lo``/``hi`` (``0 <= lo <= hi``).

    Every ``2^-k e4m3(2^k y)`` with ``y`` in ``[lo, hi]``, an integer ``k >= -shift`` and
    ``2^k y <= 1 / prob_scale`` lies in ``[lower, upper]``; so does ``e4m3(y)`` (``k = 0``).
    ``shift`` (broadcastable, >= 0): how far above the reference's integer maximum a kernel's may
    end up. ``online_softmax=False``: only ``k = 0`` and ``k = -shift`` occur (one pass against the
    row's final maximum, as the reference); where ``shift`` is 0 that is ``[e4m3(lo), e4m3(hi)]``.
    """
    lo, hi = lo.to(torch.float64), hi.to(torch.float64)
    shift = torch.as_tensor(shift, dtype=torch.float64, device=lo.device)
    r_lo, r_hi = _e4m3_round(lo), _e4m3_round(hi)
    cap = torch.exp2(shift - 10.0)

    def err(y: torch.Tensor) -> torch.Tensor:
        return torch.maximum(y * E4M3_HALF_ULP, torch.minimum(y, cap))

    fine = lo < torch.exp2(shift - 6.0)
    upper = torch.where(fine, torch.maximum(r_hi, hi + err(hi)), r_hi)
    lower = torch.where(fine, torch.minimum(r_lo, lo - err(lo)), r_lo)
    big = (hi > E4M3_MAX) & (shift > 0)  # a coarser grid (k < 0) need not saturate
    upper = torch.where(big, torch.maximum(upper, hi * (1 + E4M3_HALF_ULP)), upper)
    lower = torch.where(big, torch.minimum(lower, lo * (1 - E4M3_HALF_ULP)), lower)
    # 2^k y <= (1 + 4u) / ps (a rounded reciprocal); below 464, the midpoint of 448 and the next
    # step of e4m3's grid (480), saturating gives what rounding would: only beyond it does it matter
    if (1 + 4 * U32) / prob_scale >= E4M3_SAT_MIDPOINT:
        lower = torch.minimum(lower, lo * (E4M3_MAX * prob_scale * (1 - 4 * U32)))
    if not online_softmax:
        lower, upper = torch.where(shift == 0, r_lo, lower), torch.where(shift == 0, r_hi, upper)
    return lower, upper


def hopper_dot_error(steps, u8: float) -> torch.Tensor:
    """A bound on ``|kernel - exact|`` for a reduction accumulated as Hopper's e4m3 wgmma does
    (:mod:`fp8kv.testing.fp8_accumulator`: each step aligns the running sum and its terms to their
    largest exponent and keeps ``u8`` = ``2^-13`` of it, truncating). ``steps`` yields, per step,
    ``(prefix, terms, prefix_next)``: a bound on the exact running sum's magnitude before the step,
    the step's term magnitudes (bounds; the last dimension) and the bound after it.

    Step by step: ``|C| <= prefix + err``; the largest exponent is at most that of ``max(|C|, max
    |term|)``, so the quantum is ``q <= u8 2^floor(log2 max(...))``; each term loses less than ``q``
    and at most itself, ``C`` at most ``min(|C|, q)``; the new sum is cut to 14 significant bits
    (``u8`` of ``|C'| <= prefix_next + err + loss``)."""
    err = None
    for prefix, terms, prefix_next in steps:
        err = torch.zeros_like(prefix) if err is None else err
        c = prefix + err
        q = u8 * torch.exp2(exponent(torch.maximum(c, terms.amax(-1))))  # (0 for 0: 2^-inf)
        loss = torch.minimum(terms, q[..., None]).sum(-1) + torch.minimum(c, q)
        err = err + loss * (1 + u8) + u8 * (prefix_next + err)
    return err


def _qk_dot_error(q8: torch.Tensor, k8: torch.Tensor, u8: float, chunk: int = 256) -> torch.Tensor:
    """:func:`hopper_dot_error` of every ``q8 . k8`` (``q8 [ql, Hq, D]``, ``k8 [L, Hq, D]``, float64):
    ``[Hq, ql, L]``, the dims reduced in ascending steps of 32 from 0 (keys ``chunk`` at a time)."""
    D = q8.shape[-1]
    out = []
    for l0 in range(0, k8.shape[0], chunk):
        kc = k8[l0:l0 + chunk]

        def steps(kc=kc):
            prefix = None
            for d0 in range(0, D, 32):
                qs, ks = q8[..., d0:d0 + 32], kc[..., d0:d0 + 32]
                part = torch.einsum("thd,lhd->htl", qs, ks)
                prefix = torch.zeros_like(part) if prefix is None else prefix
                terms = qs.abs().permute(1, 0, 2)[:, :, None] * ks.abs().permute(1, 0, 2)[:, None]  # [Hq, ql, l, 32]
                yield prefix.abs(), terms, (prefix + part).abs()
                prefix = prefix + part
        out.append(hopper_dot_error(steps(), u8))
    return torch.cat(out, -1)


def _pv_dot_error(R: torch.Tensor, dP: torch.Tensor, v8: torch.Tensor, u8: float) -> torch.Tensor:
    """:func:`hopper_dot_error` of ``sum_j K_j v8_jd`` in steps of the 32-aligned key blocks, for a
    kernel's probabilities ``K_j`` within ``R_j +- dP_j`` (``R, dP [Hq, ql, L]``, 0 where a key is not
    seen; ``v8 [L, Hq, D]``): ``[Hq, ql, D]``, in the units of ``sum R v8``. A kernel may start its
    accumulation at any 32-aligned key (a split): its running sum before block ``s`` is bounded by
    ``|P_s| + max_(a <= s) |P_a|`` (``P`` the prefix sums of ``R v8``) plus ``sum_(j < 32 s) dP |v8|``."""
    L = R.shape[-1]
    U = R + dP

    def steps():
        signed = torch.zeros(R.shape[0], R.shape[1], v8.shape[-1], dtype=R.dtype, device=R.device)
        top, dev = signed.abs(), signed.abs()
        for j0 in range(0, L, 32):
            vs = v8[j0:j0 + 32]  # [n, Hq, D]
            nxt = signed + torch.einsum("htl,lhd->htd", R[..., j0:j0 + 32], vs)
            dnxt = dev + torch.einsum("htl,lhd->htd", dP[..., j0:j0 + 32], vs.abs())
            terms = U[..., j0:j0 + 32, None] * vs.abs().permute(1, 0, 2)[:, None]  # [Hq, ql, n, D]
            top_next = torch.maximum(top, nxt.abs())
            yield signed.abs() + top + dev, terms.movedim(2, -1), nxt.abs() + top_next + dnxt
            signed, top, dev = nxt, top_next, dnxt
    return hopper_dot_error(steps(), u8)


def fp8_attention_tolerance(
    query: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None, ref: torch.Tensor, ref_lse: torch.Tensor | None = None, *,
    softmax_scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
    logits_soft_cap: float | None = None, q_scale: torch.Tensor | None = None, prob_scale: float = 1.0,
    unit_roundoff: float = U32, fp8_dot_roundoff: float = U_FP8_DOT, pv_dot_roundoff: float = U_FP8_DOT,
    online_softmax: bool = True, accumulator: str = "hopper",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-element tolerances ``(out [T, Hq, D], lse [T, Hq] or None)`` of the FP8 attention mode.

    ``ref``/``ref_lse``: the reference's output and log-sum-exp for the same call (the cache
    already written); the other arguments are those of :func:`fp8kv.plan_attention` for the step.
    Derived in the module docstring (steps 1-5); float64, on the query's device. The unit roundoffs
    are the implementation's (step 1, 4); ``online_softmax=False`` for one that rounds every
    probability against the row's final maximum (:func:`fp8_probability_envelope`). ``accumulator``:
    ``"hopper"`` (the default: Hopper's e4m3 wgmma as measured, :func:`hopper_dot_error`, for
    reductions in ascending steps of at most 32 terms, key steps aligned to multiples of 32) or
    ``"steps"`` (every step keeps 13 bits of its partial sum: any order of the keys).
    """
    if accumulator not in ("hopper", "steps"):
        raise ValueError(f"accumulator: got {accumulator!r}, expected 'hopper' or 'steps'")
    from ..fp8_attention import fp8_probabilities, quantize_query, round_probabilities
    from ..reference import LOGIT_MAX, visible_mask

    T, Hq, D = query.shape
    H = cache.num_kv_heads
    group = Hq // H
    dev = query.device
    u, u8, u8v, ps = unit_roundoff, fp8_dot_roundoff, pv_dot_roundoff, float(prob_scale)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    if query_start_loc is None:
        query_start_loc = torch.arange(seq_lens.shape[0] + 1, device=dev)
    starts = query_start_loc.tolist()
    q8, qs = quantize_query(query, q_scale, H)
    q8 = q8.to(torch.float64)
    ks = cache.k_scale.to(torch.float64).reshape(-1).expand(H).repeat_interleave(group)  # [Hq]
    vs = cache.v_scale.to(torch.float64).reshape(-1).expand(H).repeat_interleave(group)
    kc, vc = cache.token_view("key").to(torch.float64), cache.token_view("value").to(torch.float64)
    E = torch.zeros(T, Hq, D, dtype=torch.float64, device=dev)
    lse_tol = torch.zeros(T, Hq, dtype=torch.float64, device=dev)
    steps = -(-D // 32) + 1
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        pos = torch.arange(seq_len, device=dev)
        slots = block_tables[i].to(torch.long)[pos // cache.block_size] * cache.block_size + pos % cache.block_size
        k8 = kc[slots].repeat_interleave(group, 1)  # [L, Hq, D]
        v8 = vc[slots].repeat_interleave(group, 1)
        vis = visible_mask(seq_len, hi - lo, causal, sliding_window, dev)[None]  # [1, ql, L]
        c = (qs[lo:hi].to(torch.float64) * ks * scale).T[..., None]  # [Hq, ql, 1]
        logits = torch.einsum("thd,lhd->htl", q8[lo:hi], k8) * c  # [Hq, ql, L]
        if logits_soft_cap is not None:
            logits = torch.tanh(logits / logits_soft_cap) * logits_soft_cap
        logits = logits.clamp(-LOGIT_MAX, LOGIT_MAX)
        # step 1: the logit error
        L = (torch.einsum("thd,lhd->htl", q8[lo:hi].abs(), k8.abs()) * c).masked_fill(~vis, 0.0).amax(-1, True)
        S = L if logits_soft_cap is None else L.clamp(max=float(logits_soft_cap))
        if accumulator == "hopper":
            dot_err = _qk_dot_error(q8[lo:hi], k8, u8) * c  # [Hq, ql, L]
            delta = dot_err.masked_fill(~vis, 0.0).amax(-1, True)
        else:
            delta = steps * u8 * L
        delta = delta + 4 * u * L + 8 * u * S.clamp(min=1.0)
        if logits_soft_cap is not None:
            delta = delta + 8 * u * float(logits_soft_cap)
        # steps 2-3: the reference's probabilities and the envelope of a kernel's rounded ones
        p, l_sum, M = fp8_probabilities(logits, vis)
        R = round_probabilities(p, ps)
        x = (p / ps).to(torch.float32).to(torch.float64)
        g = torch.exp(2 * delta) * (1 + max(4 * u, 2.0**-22))  # x is a float32 on both sides
        b_max = (logits * (1 / math.log(2.0))).masked_fill(~vis, -math.inf).amax(-1, keepdim=True)
        shift = torch.nan_to_num(torch.ceil(b_max + delta * (1 / math.log(2.0))) - M, nan=0.0).clamp(min=0.0)
        lower, upper = fp8_probability_envelope(x / g, x * g, ps, shift, online_softmax)
        dP = torch.maximum(upper - R, R - lower).masked_fill(~vis, 0.0)
        # step 4: the output
        w = (ps * vs)[:, None, None] / l_sum.clamp(min=1e-300)  # [Hq, ql, 1]
        A = torch.einsum("htl,lhd->htd", R, v8.abs()) * w
        B = torch.einsum("htl,lhd->htd", dP, v8.abs()) * w
        n = vis.sum(-1, keepdim=True).to(torch.float64)  # [1, ql, 1]
        rho = torch.expm1(2 * delta) + (2 * n + 2) * u
        if accumulator == "hopper":
            gamma = (n + 22) * u
            pv_err = _pv_dot_error(R, dP, v8, u8v) * w  # [Hq, ql, D]
        else:
            gamma = (torch.ceil(n / 32) + 1) * u8v + (n + 22) * u
            pv_err = 0.0
        e = (1 + rho) * B + rho * A + (1 + rho) * (gamma * (A + B) + pv_err)
        E[lo:hi] = e.permute(1, 0, 2)
        if ref_lse is not None:  # step 5
            log_n = torch.log2(n.clamp(min=2.0))
            lt = 2 * (delta + (2 * n + 2) * u + 4 * u * log_n)[..., 0].T
            lse_tol[lo:hi] = lt + 4 * u * (ref_lse[lo:hi].to(torch.float64).abs() + S[..., 0].T + 1)
    mag = ref.detach().to(torch.float64).abs() + E
    tol = E + ulp(mag, ref.dtype)
    tol = torch.where((mag > torch.finfo(ref.dtype).max) | torch.isnan(tol), torch.full_like(tol, math.inf), tol)
    if ref_lse is None:
        return tol, None
    return tol, torch.where(torch.isnan(lse_tol), torch.full_like(lse_tol, math.inf), lse_tol)


def assert_fp8_attention_close(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, *, lse=None, ref_lse=None,
                               lse_tol=None, context: str = "") -> None:
    """Raise AssertionError unless ``|out - ref| <= tol`` (from :func:`fp8_attention_tolerance`)
    everywhere, and the lse likewise when given; the message names the worst element."""
    for name, a, r, t in (("output", out, ref, tol), ("log-sum-exp", lse, ref_lse, lse_tol)):
        if a is None:
            continue
        a64, r64 = a.detach().to(torch.float64), r.detach().to(torch.float64)
        diff = (a64 - r64).abs()
        ok = (a64 == r64) | (torch.isnan(a64) & torch.isnan(r64)) | (diff <= t)
        if bool(ok.all()):
            continue
        _, idx = worst_violation(ok, diff, t)
        raise AssertionError(f"{context}FP8-mode {name} differs from the reference beyond the derived tolerance at "
                             f"{int((~ok).sum())} of {ok.numel()} elements; worst at {list(idx)}: got "
                             f"{float(a64[idx])!r}, reference {float(r64[idx])!r}, |diff| {float(diff[idx]):.6g} > "
                             f"tol {float(t[idx]):.6g}")
