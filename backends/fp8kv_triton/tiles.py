"""The ``@triton.jit`` building blocks of the attention kernels.

Both attention kernels are assembled from these pieces: the general kernel
(``_attn_kernel``, :mod:`fp8kv_triton.attention`: chunked prefill, and decode on AMD) and the
decode kernel (``_decode_kernel``, :mod:`fp8kv_triton.decode`); the public ones are also
exported by :mod:`fp8kv_triton.kernels` for kernels of other backends. The decode kernel's module
imports only this one; :mod:`fp8kv_triton.attention` imports both, its launcher
(:func:`~fp8kv_triton.attention.paged_attention`) picking the kernel.

Shapes below: ``M`` query rows of a program (``BLOCK_M``), ``N`` keys of a tile (``BLOCK_N``),
``D`` the padded head size (``BLOCK_D``). Pointers ``KC``/``VC``/``KS``/``VS`` already point at the
program's KV head.

* numerics: :func:`_tanh`, :func:`_pow2`, :func:`_saturate`, :func:`_saturate_out`,
  :func:`_scale_factors` (a scale times ``softmax_scale`` as two float32 factors), :func:`_lse`;
* a program's rows and keys: :func:`_query_span`, :func:`_program_rows`, :func:`_key_range`,
  :func:`_load_query`, :func:`_online_state`, :func:`_key_loops` (the key loop, compiled twice);
* a tile of keys through the block table: :func:`_tile_blocks`, :func:`_tile_at`, :func:`_tile`,
  :func:`_load_codes`;
* one online-softmax step: :func:`_logits`, then :func:`_softmax_pv` (with :func:`_pv_dot`);
* the program's result: :func:`_finish`.

The kernels' prologues (query tile, KV-head pointers, static logit factors) are written out in
each kernel: every inlined helper adds a debug-info scope, whose boundary labels in the PTX
(``-lineinfo``) are block boundaries to ``ptxas``, so moving those few lines into a helper changes
the register allocation and scheduling of some compiled variants.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codec import decode, in_registers

UNSPECIALIZED = [
    "sm_scale", "sm_exp", "soft_cap", "window", "T", "num_blocks", "max_keys", "pr_off", "HQ", "group", "block_q",
    "max_q_blocks", "keys_per_split", "page",
]
"""Scalar arguments of ``_attn_kernel`` and ``_decode_kernel`` (one argument list, one launcher) that
Triton must not specialise on their value: they change from call to call (``do_not_specialize``)."""


# ------------------------------------------------------------------------------- numerics


@triton.jit
def _tanh(x):
    """float32 tanh to a few ulps: an odd Taylor polynomial below 0.55, else from exp."""
    ax = tl.abs(x)
    x2 = x * x
    # tanh x = x + x^3 P(x^2), P the Taylor series' first 8 terms: ~1.2 ulp for |x| < 0.55
    p = 0.0005900274263694882
    p = p * x2 - 0.0014558343682438135
    p = p * x2 + 0.0035921279340982437
    p = p * x2 - 0.0088632358238101
    p = p * x2 + 0.021869488060474396
    p = p * x2 - 0.05396825447678566
    p = p * x2 + 0.13333334028720856
    p = p * x2 - 0.3333333432674408
    small = x + x * x2 * p
    e = tl.exp(-2.0 * ax)
    big = tl.math.div_rn(1.0 - e, 1.0 + e)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.55, small, big)


@triton.jit
def _pow2(e):
    """``2^e`` as a float32, for integer ``e`` in [-126, 127] (built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _saturate(x, hi: tl.constexpr):
    """``x`` clamped to ``[-hi, hi]``; NaN stays NaN."""
    return tl.minimum(tl.maximum(x, -hi, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _saturate_out(o, OUT_TY: tl.constexpr):
    """``o`` clamped to the finite range of the output dtype ``OUT_TY`` (NaN stays NaN)."""
    if OUT_TY == tl.float16:
        o = _saturate(o, 65504.0)
    elif OUT_TY == tl.bfloat16:
        o = _saturate(o, 3.3895313892515355e38)
    else:
        o = _saturate(o, 3.4028234663852886e38)
    return o


@triton.jit
def _scale_factors(x, g_mant, g_exp):
    """Two float32 factors ``(f1, f2)`` with ``f1 * f2 = x * g_mant * 2^g_exp`` (``x`` a float32
    scale of any magnitude, subnormal included; ``g_mant`` in [1, 2)), on the same side of 1, each
    a normal float32: ``(s * f1) * f2`` overflows or underflows only if ``s * x * g`` does.

    ``x`` is split with integer operations only (no subnormal arithmetic, which a GPU may flush).
    The total exponent is clamped to [-250, 250]: beyond it every logit ``s * f`` (``|s|`` in
    [2^-149, 2^126]) saturates or is far below any logit that matters. Zero, inf and NaN scales
    keep their own value in ``f1``.
    """
    bits = x.to(tl.int32, bitcast=True)
    eb = (bits >> 23) & 0xFF
    sub = eb == 0
    # a subnormal scale is (its 23 mantissa bits, an exact integer) * 2^-149
    m_int = (bits & 0x007FFFFF).to(tl.float32)
    xn = tl.where(sub, tl.where(bits < 0, -m_int, m_int), x)
    nbits = xn.to(tl.int32, bitcast=True)
    mant = ((nbits & -2139095041) | 0x3F800000).to(tl.float32, bitcast=True) * g_mant  # sign kept; [1, 4)
    e = ((nbits >> 23) & 0xFF) - 127 + tl.where(sub, -149, 0) + g_exp
    e = tl.minimum(tl.maximum(e, -250), 250)
    e1 = tl.minimum(tl.maximum(e, -125), 125)
    f1 = mant * _pow2(e1)
    f2 = _pow2(e - e1)
    special = (eb == 255) | (x == 0)
    f1 = tl.where(special, x * g_mant, f1)
    f2 = tl.where(special, 1.0, f2)
    return f1, f2


@triton.jit
def _lse(m, l_sum):
    """Natural-log log-sum-exp from the base-2 online-softmax state: ``(m + log2 l) ln 2``.

    ``m`` is the row max of the logits the kernel holds, which are the (scaled, soft-capped)
    logits times ``log2(e)`` whatever the scale granularity or soft-cap, and ``l`` the sum of
    ``2^(s - m)``; rows without a visible key (``l == 0``) get ``-inf``.
    """
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    return tl.where(l_sum > 0, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))


# ------------------------------------------------------------------------------- a program's rows and keys


@triton.jit
def _query_span(QSL, seq, T):
    """``(q_start, q_len)`` of sequence ``seq``'s queries, ``query_start_loc`` clamped to ``[0, T]``
    (garbage never becomes an address). A program whose block starts at or past ``q_len`` has no rows
    and returns before anything else is loaded."""
    q_start = tl.minimum(tl.maximum(tl.load(QSL + seq), 0), T)
    q_end = tl.minimum(tl.maximum(tl.load(QSL + seq + 1), 0), T)
    return q_start, tl.maximum(q_end - q_start, 0)


@triton.jit
def _program_rows(SEQ_LENS, seq, qb, q_start, q_len, max_keys, block_q, group, kvh, BLOCK_M: tl.constexpr):
    """The query rows of the program at query block ``qb`` of sequence ``seq`` (GQA packing: row ``r``
    is token ``r // group`` of the block and query head ``kvh * group + r % group``).

    Returns ``(seq_len, row_valid, tok, qh, pos)``: the key count clamped to ``[0, max_keys]``, each
    row's validity, token (int64), query head and position. (Loaded after the caller's early return:
    hoisting this load above it costs gfx942/gfx950 20 bytes of scratch per lane in the decode tile.)
    """
    seq_len = tl.minimum(tl.maximum(tl.load(SEQ_LENS + seq), 0), max_keys)
    rows = tl.arange(0, BLOCK_M)
    qi = rows // group
    tok_in_seq = qb * block_q + qi
    row_valid = (qi < block_q) & (tok_in_seq < q_len)
    tok = (q_start + tok_in_seq).to(tl.int64)
    qh = kvh * group + rows % group
    pos = seq_len - q_len + tok_in_seq  # position of each row's query token
    return seq_len, row_valid, tok, qh, pos


@triton.jit
def _key_range(seq_len, q_len, qb, block_q, window, causal, split, keys_per_split, SPLIT: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The keys the program visits, ``[lo, hi)`` (``lo`` tile-aligned; its split's share with ``SPLIT``),
    and ``[all_lo, all_hi)``, the keys visible to every row of the block (tiles inside need no mask),
    with ``first_pos``/``last_pos`` the block's first and last query positions."""
    first_pos = seq_len - q_len + qb * block_q
    last_pos = seq_len - q_len + tl.minimum(qb * block_q + block_q, q_len) - 1
    hi = tl.where(causal != 0, last_pos + 1, seq_len)
    lo = tl.maximum(first_pos - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * keys_per_split)
        hi = tl.minimum(hi, (split + 1) * keys_per_split)
    lo = (lo // BLOCK_N) * BLOCK_N
    # [last_pos - window + 1, first_pos] (causal) or [last_pos - window + 1, seq_len) (not causal)
    all_lo = last_pos - window + 1
    all_hi = tl.where(causal != 0, first_pos + 1, seq_len)
    return lo, hi, all_lo, all_hi, first_pos, last_pos


@triton.jit
def _load_query(Q, q_off, qmask, Q_BITS: tl.constexpr, QK_DT: tl.constexpr):
    """The query rows ``[M, BLOCK_D]`` at ``Q + q_off`` in the product dtype ``QK_DT``, and the
    power-of-two exponent ``q_shift`` they were scaled down by (0 for float16 queries).

    float32/bfloat16 queries are scaled by ``2^-q_shift`` so that ``|q| <= 2^101`` and ``q . c``
    cannot overflow (``|c| < 2^16``, ``D <= 512``); the exponent goes back into the logit factor.
    ``Q_BITS``: bfloat16 passed as int16 bits and widened exactly (the interpreter: see the launcher).
    """
    if Q_BITS:
        q = (tl.load(Q + q_off, mask=qmask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        q = tl.load(Q + q_off, mask=qmask, other=0.0)
    if QK_DT != tl.float16:
        qf = q.to(tl.float32)
        q_amax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
        q_shift = tl.maximum(((q_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 227, 0)
        q = (qf * _pow2(-q_shift)).to(QK_DT)
    else:
        q_shift = 0
        q = q.to(QK_DT)
    return q, q_shift


@triton.jit
def _online_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The empty online-softmax state ``(m_i, l_i, r_i, acc)``: row max ``-inf``, row sum, value unit
    (per-token-head scales) ``[BLOCK_M]`` and accumulator ``[BLOCK_M, BLOCK_D]``, all float32 zeros."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    r_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    return m_i, l_i, r_i, acc


@triton.jit
def _key_loops(loop: tl.constexpr, split_p, m_i, l_i, r_i, acc, args):
    """The online-softmax state ``(m_i, l_i, acc, r_i)`` after the key loop ``loop`` of a program
    (:func:`~fp8kv_triton.attention._attend_range`, :func:`~fp8kv_triton.decode._decode_range`), called as
    ``loop(m_i, l_i, acc, r_i, *args, SPLIT_P=split_p)``.

    ``split_p``: the program's rows see fewer than ``FULL_P_KEYS`` keys, so P is kept in two float16
    matrices (:func:`_pv_dot`). The runtime choice is made here, outside the loop, which is compiled
    twice with a constexpr ``SPLIT_P``: no runtime branch surrounds a ``tl.dot`` inside the loop.
    """
    if split_p:
        m_i, l_i, acc, r_i = loop(m_i, l_i, acc, r_i, *args, SPLIT_P=True)
    else:
        m_i, l_i, acc, r_i = loop(m_i, l_i, acc, r_i, *args, SPLIT_P=False)
    return m_i, l_i, acc, r_i


# ------------------------------------------------------------------------------- a tile of keys


@triton.jit
def _tile_blocks(start, offs_n, hi, bt_row, page, page_shift, PAGE_POW2: tl.constexpr):
    """Block ids (int32, from the block table; 0 past ``hi``) of the keys of the tile at ``start``."""
    n = start + offs_n
    if PAGE_POW2:
        page_idx = n >> page_shift
    else:
        page_idx = n // page
    return tl.load(bt_row + page_idx, mask=n < hi, other=0)


@triton.jit
def _tile_at(start, blk, offs_n, hi, page, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt,
             PAGE_POW2: tl.constexpr):
    """Key positions ``n`` of the tile at ``start`` with block ids ``blk`` (:func:`_tile_blocks`),
    their mask, block ids and offsets in block (int64), the byte offsets of their rows in the K and V
    caches (from the kv_head's row), and whether the tile has a hole: a key below ``hi`` whose block
    id is outside ``[0, num_blocks)`` (masked out of ``kmask``: never loaded, never visible)."""
    n = start + offs_n
    inside = n < hi
    if PAGE_POW2:
        tib = n & (page - 1)
    else:
        tib = n % page
    present = (blk >= 0) & (blk < num_blocks)
    kmask = inside & present
    hole = tl.max((inside & ~present).to(tl.int32), axis=0) != 0
    blk = blk.to(tl.int64)
    tib = tib.to(tl.int64)
    k_off = blk * stride_kb + tib * stride_kt
    v_off = blk * stride_vb + tib * stride_vt
    return n, kmask, blk, tib, k_off, v_off, hole


@triton.jit
def _tile(start, offs_n, hi, bt_row, page, page_shift, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt,
          PAGE_POW2: tl.constexpr):
    """:func:`_tile_at` of the tile at ``start``, its block ids gathered here."""
    blk = _tile_blocks(start, offs_n, hi, bt_row, page, page_shift, PAGE_POW2)
    return _tile_at(start, blk, offs_n, hi, page, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_POW2)


@triton.jit
def _load_codes(KC, VC, k_off, v_off, kmask, d, dmask, EVEN_D: tl.constexpr):
    """FP8 codes of a tile: K as ``[BLOCK_D, BLOCK_N]`` (``q @ k`` operand), V as ``[BLOCK_N, BLOCK_D]``."""
    if EVEN_D:
        mask_t = kmask[None, :] & (d[:, None] >= 0)
        mask = kmask[:, None] & (d[None, :] >= 0)
    else:
        mask_t = kmask[None, :] & dmask[:, None]
        mask = kmask[:, None] & dmask[None, :]
    kc = tl.load(KC + k_off[None, :] + d[:, None], mask=mask_t, other=0)
    vc = tl.load(VC + v_off[:, None] + d[None, :], mask=mask, other=0)
    return kc, vc


# ------------------------------------------------------------------------------- one online-softmax step


@triton.jit
def _logits(
    q, kc, kmask, blk, tib,                              # queries [M, D], K codes [D, N], keys [N]
    KS, f1, f2, g_mant, g_exp, soft_cap,                 # logit factor and soft-cap
    stride_ksb, stride_kst,                              # per-token-head k_scale strides
    USE_CAP: tl.constexpr, TOKEN_SCALES: tl.constexpr, QK_DT: tl.constexpr,
    DEC_MODE: tl.constexpr, F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
):
    """Base-2 logits ``s [M, N]`` of queries ``q [M, D]`` against the FP8 codes ``kc [D, N]``:
    scaled (``k_scale * softmax_scale * log2 e``, never as one float32: see :func:`_scale_factors`),
    soft-capped if asked, and saturated to ``+-FLOAT32_MAX`` (unmasked).

    ``KS`` points at the kv_head's ``k_scale``; per-token-head scales of key (``blk``, ``tib``)
    are read at ``KS + blk * stride_ksb + tib * stride_kst``. Static scales: the factor is
    ``f1 * f2``; per-token-head: built per key from its ``k_scale`` and ``g_mant * 2^g_exp``.
    """
    k = decode(kc, QK_DT, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    if QK_DT == tl.float32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if TOKEN_SCALES:
        ks = tl.load(KS + blk * stride_ksb + tib * stride_kst, mask=kmask, other=1.0)
        kf1, kf2 = _scale_factors(ks, g_mant, g_exp)
        s = s * kf1[None, :] * kf2[None, :]
    else:
        s = s * f1 * f2
    if USE_CAP:
        s = soft_cap * _tanh(s / soft_cap) * 1.4426950408889634
    return _saturate(s, 3.4028234663852886e38)  # base-2 logits: finite (s - m never inf - inf)


@triton.jit
def _pv_dot(w, v, acc, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr):
    """``acc + w @ v`` for float32 ``w [M, N]`` (entries in [0, 1]) and exact ``v [N, D]``.

    float16 ``w`` has a relative error of at most 2^-12 (2^-25 absolute below 2^-14);
    ``PV_SPLIT`` adds the product with the rounding remainder ``w - fp16(w)`` (~2^-22).
    """
    if PV_F32:
        acc = tl.dot(w, v, acc, input_precision="ieee")
    else:
        hi = w.to(tl.float16)
        acc = tl.dot(hi, v, acc)
        if PV_SPLIT:
            lo = (w - hi.to(tl.float32)).to(tl.float16)
            acc = tl.dot(lo, v, acc)
    return acc


@triton.jit
def _softmax_pv(
    s, vc, kmask, blk, tib,                              # logits [M, N], V codes [N, D], keys [N]
    m_i, l_i, acc, r_i,                                  # online-softmax state
    VS, stride_vsb, stride_vst,                          # v_scale and its per-token-head strides
    TOKEN_SCALES: tl.constexpr, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr, V_REGS: tl.constexpr,
    DEC_MODE: tl.constexpr, F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
):
    """One online-softmax step with the masked logits ``s [M, N]`` (invisible keys at ``-inf``)
    and the value codes ``vc [N, D]``: returns the updated row max ``m_i``, sum ``l_i``, ``acc``
    and, for per-token-head scales, the running value scale ``r_i`` (``acc * r_i`` is the true sum).

    ``VS`` points at the kv_head's ``v_scale``; per-token-head ones are read like the key scales.
    ``V_REGS``: decode V to float16 in registers before ``p @ v`` (see :func:`in_registers`).
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if PV_F32:
        v_dt: tl.constexpr = tl.float32
    else:
        v_dt: tl.constexpr = tl.float16
    v = decode(vc, v_dt, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    if V_REGS and not PV_F32:
        v = in_registers(v)
    if TOKEN_SCALES:
        vs = tl.load(VS + blk * stride_vsb + tib * stride_vst, mask=kmask, other=0.0)
        w = p * vs[None, :]  # p <= 1: finite
        # the tile's unit r = 2^e <= max_j w_j (e from the exponent bits, in [-126, 126]): w / r is
        # exact (a power of two) and in [0, 4), so no per-element division and no overflow
        r_exp = ((tl.max(w, axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        r_exp = tl.minimum(tl.maximum(r_exp, -126), 126)
        w = w * _pow2(-r_exp)[:, None]
        r = _pow2(r_exp)
        # acc is kept in units of r_i, the running max of the tiles' r (rescaled by alpha like acc),
        # so it stays <= 4 l max|code| whatever v_scale is
        r_old = r_i * alpha
        r_new = tl.maximum(r_old, r)
        r_div = tl.where(r_new > 0, r_new, 1.0)
        c_old = tl.math.div_rn(r_old, r_div)
        c_new = tl.math.div_rn(r, r_div)
        acc = acc * c_old[:, None] + c_new[:, None] * _pv_dot(w, v, tl.zeros_like(acc), PV_F32, PV_SPLIT)
        r_i = r_new
    else:
        acc = acc * alpha[:, None]
        acc = _pv_dot(p, v, acc, PV_F32, PV_SPLIT)
    return m_new, l_i, acc, r_i


# ------------------------------------------------------------------------------- the program's result


@triton.jit
def _finish(
    acc, m_i, l_i, r_i,                                  # final online-softmax state
    OUT, q_off, PACC, PM, PL, LSE, VS,                   # outputs, and the kv_head's v_scale
    split, T, tok, HQ, qh, D, d, qmask, row_valid, pr_off,
    SPLIT: tl.constexpr, TOKEN_SCALES: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Store a program's result: split-KV partials ``(acc, m, l[, r])`` for ``_reduce_kernel``
    (``PACC [num_splits, T, HQ, D]``, ``PM [num_splits, T, HQ]``, ``PL [(1 or 2) * num_splits, T, HQ]``,
    ``r`` at ``PL + pr_off``), or the normalised output ``OUT [T, HQ, D]`` (saturated to its dtype,
    never inf) and, with ``WRITE_LSE``, the lse ``LSE [T, HQ]``. ``VS`` points at the kv_head's
    ``v_scale`` (static scales multiply the normalised output)."""
    if SPLIT:
        part = (split * T + tok) * HQ + qh
        tl.store(PACC + part[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(PM + part, m_i, mask=row_valid)
        tl.store(PL + part, l_i, mask=row_valid)
        if TOKEN_SCALES:
            tl.store(PL + pr_off + part, r_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # rows without a visible key
        o = tl.math.div_rn(acc, l_safe[:, None] + tl.zeros_like(acc))
        if TOKEN_SCALES:
            o = o * r_i[:, None]
        else:
            o = o * tl.load(VS)
        o = _saturate_out(o, OUT.dtype.element_ty)
        tl.store(OUT + q_off, o.to(OUT.dtype.element_ty), mask=qmask)
        if WRITE_LSE:
            tl.store(LSE + tok * HQ + qh, _lse(m_i, l_i), mask=row_valid)
