"""Paged attention over the FP8 cache: the general kernel (chunked prefill, and decode on AMD), split-KV.

Steps with one query token per sequence run the decode kernel on NVIDIA
(:mod:`fp8kv_triton.decode`, chosen by :func:`choose_config`, launched by :func:`paged_attention`
with the same arguments); it reuses this module's building blocks (:func:`_logits`,
:func:`_softmax_pv`, the scale and saturation helpers) and the split-KV merge ``_reduce_kernel``.

Kernel structure (``_attn_kernel``), grid ``(num_seqs * q_blocks, H, num_splits)``:

* **GQA packing.** A program owns one KV head and ``BLOCK_M`` query rows; row ``r`` is query
  token ``r // GROUP`` of its block and query head ``kv_head * GROUP + r % GROUP``, so every
  query head sharing the KV head is served by one pass over the K/V tiles (decode: the
  ``GROUP`` heads of one token; prefill: ``BLOCK_M // GROUP`` tokens times ``GROUP`` heads).
* **Paging and strides.** Each tile of ``BLOCK_N`` keys is gathered through the block table
  (one block-table entry per key, cached). K and V are addressed through their own
  (block, token-in-block, head) strides (:func:`fp8kv_triton.write.cache_strides`), so the
  layouts NHD/HND and views (``t[:, 0]``/``t[:, 1]`` of one ``[num_blocks, 2, ...]`` tensor,
  head slices, padded allocations) need no copy; only head_size must have stride 1.
  ``token_head`` scales ``[num_blocks, block_size, H]`` are read through their own three
  strides, static ``(H,)``/``()`` scales through their head stride (0 per-tensor; see
  :func:`fp8kv_triton.write.scale_strides`). Offsets are int64.
* **FP8 decode in registers.** Codes are decoded exactly to the query dtype (float16 or
  bfloat16: every FP8 value is exact in both) for ``q @ k^T``, and to float16 for
  ``p @ v``; float32 queries use float32 products in IEEE precision (never TF32).
* **Scales folded, nothing overflows.** The logit factor ``k_scale * softmax_scale * log2(e)``
  (per program for static scales, per key for token_head ones) is never formed as one float32:
  ``softmax_scale * log2(e)`` arrives from the host as a mantissa in [1, 2) and a power-of-two
  exponent (:func:`_logit_factor`), ``k_scale`` is split the same way in the kernel, and the
  product becomes two float32 factors ``f1 * f2`` on the same side of 1 (``|exponent| <= 125``
  each), applied as ``(q.c * f1) * f2``: an intermediate overflows (underflows) only when the
  logit itself does. Queries of float32/bfloat16 are first scaled by a power of two per program
  so that ``|q| <= 2^101`` (``q . c`` then stays below ``2^126``; float16 queries cannot overflow
  it). The base-2 logits are then saturated to ``+-FLOAT32_MAX`` (natural logits to
  ``+-FLOAT32_MAX ln 2``, :data:`fp8kv.reference.LOGIT_MAX`): never ``inf - inf`` or ``0 * inf``.
  Static ``v_scale`` multiplies the normalised output once; per-token-head ``v_scale`` of each key
  multiplies its probability column, tile-normalised (see below) and accumulated in units of a
  running per-row maximum ``R`` (``acc * R`` is the true sum), so the unnormalised sum cannot
  overflow either. The output is clamped to its dtype's finite range before the store. All are
  exact rewrites of ``softmax(q . (c_k s_k)) (c_v s_v)``; with finite input and finite positive
  scales no NaN or inf comes out, matching :func:`fp8kv.reference.paged_attention`.
* **Memory safety without the host.** Every bound comes from what the tensors hold, not from
  the metadata's values (``FP8KV_CHECK=shapes``, ``validate=False`` and CUDA-graph replays skip
  the host checks): ``query_start_loc`` entries are clamped to ``[0, num_tokens]`` (a decreasing
  pair is an empty query), ``seq_lens`` to ``[0, max_blocks * block_size]`` (so the block table
  row is never read past its end), the grid's query blocks come from ``min(max_query_len,
  num_tokens)`` (a host int), and a key whose block id is outside ``[0, num_blocks)`` is masked
  out (its K/V never loaded; a tile holding one takes the masked path). Rows whose keys are all
  masked give ``out = 0`` and ``lse = -inf``.
* **P in float16.** ``p @ v`` runs on tensor cores with ``p`` in float16 (relative error
  2^-12). For rows that see fewer than :data:`FULL_P_KEYS` keys that is more than the float32
  error model of :mod:`fp8kv.testing.tolerance` allows, so there ``p = hi + lo`` is split into
  two float16 matrices (``hi = fp16(p)``, ``lo = fp16(p - hi)``, ~22 bits); the choice is made
  per program, outside the key loop (two copies of the loop). Per-token-head weights are first
  divided by their row maximum (and the product multiplied back), so no row is lost to
  float16 underflow.
* **Masks only where needed.** Tiles inside every row's visible range skip the causal, window
  and bounds masks.
* **Online softmax** in base 2 (``log2(e)`` folded into the logit scale), causal, sliding
  window and ``cap * tanh(x / cap)`` soft-capping applied per element.
* **Split-KV.** With few sequences and long contexts the key range is cut into
  ``num_splits`` pieces of ``keys_per_split`` keys; each piece writes its unnormalised
  ``acc``, row max ``m`` and sum ``l`` and ``_reduce_kernel`` merges them.
* **Log-sum-exp (optional).** With an ``lse [T, Hq]`` float32 output (constexpr
  ``WRITE_LSE``; nothing extra is done without it) each row also gets the natural-log
  ``logsumexp`` of its scaled, soft-capped logits over its visible keys, the softmax
  normaliser. The logits the kernel holds are those times ``log2(e)`` in every case (the
  factor is folded into the logit factor ``f1 * f2``, or applied after the soft-cap; per-token-head
  ``k_scale`` multiplies each column before), so ``lse = (m + log2(l)) * ln(2)`` from the final
  online state (finite: ``|m| <= FLOAT32_MAX``); split-KV: from the merged
  ``(max_s m_s, sum_s 2^(m_s - max) l_s)`` in ``_reduce_kernel``. Rows with no visible key get ``-inf``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp8kv.cache import KVCache
from fp8kv.precision import FULL_P_KEYS

from .codec import codec_args, decode, in_registers
from .write import cache_strides, scale_strides

LOG2E = 1.4426950408889634
FLOAT32_MAX = 3.4028234663852886e38
NO_WINDOW = 1 << 30

"""The ``window`` passed when there is no sliding window (no key is that far back)."""


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
def _tile_blocks(start, offs_n, hi, bt_row, page, page_shift, PAGE_POW2: tl.constexpr):
    """Block ids (int32, from the block table; 0 past ``hi``) of the keys of the tile at ``start``."""
    n = start + offs_n
    if PAGE_POW2:
        page_idx = n >> page_shift
    else:
        page_idx = n // page
    return tl.load(bt_row + page_idx, mask=n < hi, other=0)


@triton.jit
def _tile_at(
    start, blk, offs_n, hi, page, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_POW2: tl.constexpr
):
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
def _tile(
    start, offs_n, hi, bt_row, page, page_shift, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt,
    PAGE_POW2: tl.constexpr
):
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
def _finish(acc, m_i, l_i, r_i, OUT, q_off, PACC, PM, PL, LSE, VS, split, T, tok, HQ, qh, D, d, qmask, row_valid,
            pr_off, SPLIT: tl.constexpr, TOKEN_SCALES: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Store a program's result: split-KV partials ``(acc, m, l[, r])`` for ``_reduce_kernel``, or
    the normalised output (saturated to its dtype, never inf) and, with ``WRITE_LSE``, the lse.
    ``VS`` points at the kv_head's ``v_scale`` (static scales multiply the normalised output)."""
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
def _logits(
    q, kc, kmask, blk, tib, KS, f1, f2, g_mant, g_exp, soft_cap, stride_ksb, stride_kst,
    USE_CAP: tl.constexpr, TOKEN_SCALES: tl.constexpr, QK_DT: tl.constexpr, DEC_MODE: tl.constexpr,
    F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
    F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
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
def _softmax_pv(
    s, vc, kmask, blk, tib, m_i, l_i, acc, r_i, VS, stride_vsb, stride_vst,
    TOKEN_SCALES: tl.constexpr, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr, V_REGS: tl.constexpr,
    DEC_MODE: tl.constexpr,
    F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
    F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
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


@triton.jit
def _attend(
    q,
    kc,
    vc,
    n,
    kmask,
    blk,
    tib,
    m_i,
    l_i,
    acc,
    r_i,
    KS,
    VS,
    f1,
    f2,
    g_mant,
    g_exp,
    soft_cap,
    window,
    causal,
    pos,
    row_valid,
    stride_ksb,
    stride_kst,
    stride_vsb,
    stride_vst,
    need_mask,
    USE_CAP: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    QK_DT: tl.constexpr,
    PV_F32: tl.constexpr,
    PV_SPLIT: tl.constexpr,
    DEC_MODE: tl.constexpr,
    F_KIND: tl.constexpr,
    F_MANT: tl.constexpr,
    F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr,
    F_FNUZ: tl.constexpr,
    F_HASINF: tl.constexpr,
    F_MAXMAG: tl.constexpr,
    F_BIAS: tl.constexpr,
):
    """One tile of online softmax for query rows at positions ``pos``: :func:`_logits`, the
    causal/window/bounds mask where ``need_mask``, then :func:`_softmax_pv`."""
    s = _logits(q, kc, kmask, blk, tib, KS, f1, f2, g_mant, g_exp, soft_cap, stride_ksb, stride_kst,
                USE_CAP, TOKEN_SCALES, QK_DT, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF,
                F_MAXMAG, F_BIAS)
    if need_mask:  # tiles inside every row's visible range skip this
        visible = kmask[None, :] & row_valid[:, None] & (n[None, :] > pos[:, None] - window)
        visible = visible & ((n[None, :] <= pos[:, None]) | (causal == 0))
        s = tl.where(visible, s, float("-inf"))
    return _softmax_pv(s, vc, kmask, blk, tib, m_i, l_i, acc, r_i, VS, stride_vsb, stride_vst, TOKEN_SCALES,
                       PV_F32, PV_SPLIT, False, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG,
                       F_BIAS)


@triton.jit
def _attend_range(
    q,
    m_i,
    l_i,
    acc,
    r_i,
    lo,
    hi,
    all_lo,
    all_hi,
    offs_n,
    bt_row,
    page,
    page_shift,
    num_blocks,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    stride_ksb,
    stride_kst,
    stride_vsb,
    stride_vst,
    KC,
    VC,
    KS,
    VS,
    f1,
    f2,
    g_mant,
    g_exp,
    soft_cap,
    window,
    causal,
    pos,
    row_valid,
    d,
    dmask,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    PAGE_POW2: tl.constexpr,
    SPLIT_P: tl.constexpr,
    USE_CAP: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    QK_DT: tl.constexpr,
    PV_F32: tl.constexpr,
    PV_SPLIT: tl.constexpr,
    DEC_MODE: tl.constexpr,
    F_KIND: tl.constexpr,
    F_MANT: tl.constexpr,
    F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr,
    F_FNUZ: tl.constexpr,
    F_HASINF: tl.constexpr,
    F_MAXMAG: tl.constexpr,
    F_BIAS: tl.constexpr,
    PREFETCH_BT: tl.constexpr,
):
    """The loop over the key tiles ``[lo, hi)`` of one program (online softmax state in and out).

    ``KC``/``VC``/``KS``/``VS`` already point at the program's kv_head.
    """
    # PREFETCH_BT: the next tile's block ids are gathered while this one is computed, so that K/V
    # addresses and the hole test never wait on a block-table load of the same iteration and the
    # software pipeline keeps its stages (in-iteration, the H100 prefill ran 1.8x slower: 2925 vs
    # 1593 us before the hole test existed). Without stages (AMD) nothing is gained.
    next_blk = _tile_blocks(lo, offs_n, hi, bt_row, page, page_shift, PAGE_POW2)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH_BT:
            blk_ids = next_blk
            next_blk = _tile_blocks(start + BLOCK_N, offs_n, hi, bt_row, page, page_shift, PAGE_POW2)
        else:
            blk_ids = _tile_blocks(start, offs_n, hi, bt_row, page, page_shift, PAGE_POW2)
        n, kmask, blk, tib, k_off, v_off, hole = _tile_at(
            start, blk_ids, offs_n, hi, page, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_POW2
        )
        kc, vc = _load_codes(KC, VC, k_off, v_off, kmask, d, dmask, EVEN_D)
        m_i, l_i, acc, r_i = _attend(
            q,
            kc,
            vc,
            n,
            kmask,
            blk,
            tib,
            m_i,
            l_i,
            acc,
            r_i,
            KS,
            VS,
            f1,
            f2,
            g_mant,
            g_exp,
            soft_cap,
            window,
            causal,
            pos,
            row_valid,
            stride_ksb,
            stride_kst,
            stride_vsb,
            stride_vst,
            (start < all_lo) | (start + BLOCK_N > all_hi) | (start + BLOCK_N > hi) | hole,
            USE_CAP,
            TOKEN_SCALES,
            QK_DT,
            PV_F32,
            PV_SPLIT and SPLIT_P,
            DEC_MODE,
            F_KIND,
            F_MANT,
            F_REBIAS,
            F_DROP,
            F_FNUZ,
            F_HASINF,
            F_MAXMAG,
            F_BIAS,
        )
    return m_i, l_i, acc, r_i


@triton.jit(
    do_not_specialize=[
        "sm_scale",
        "sm_exp",
        "soft_cap",
        "window",
        "T",
        "num_blocks",
        "max_keys",
        "pr_off",
        "HQ",
        "group",
        "block_q",
        "max_q_blocks",
        "keys_per_split",
        "page",
    ]
)
def _attn_kernel(
    Q,
    KC,
    VC,
    KS,
    VS,
    BT,
    SEQ_LENS,
    QSL,
    OUT,
    PACC,
    PM,
    PL,
    LSE,
    sm_scale,
    sm_exp,
    soft_cap,
    window,
    causal,
    stride_bt,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    T,
    HQ,
    D,
    group,
    block_q,
    max_q_blocks,
    keys_per_split,
    page,
    page_shift,
    num_blocks,
    max_keys,
    pr_off,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    FULL_P_KEYS: tl.constexpr,
    PAGE_POW2: tl.constexpr,
    USE_CAP: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    Q_BITS: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    QK_DT: tl.constexpr,
    PV_F32: tl.constexpr,
    PV_SPLIT: tl.constexpr,
    DEC_MODE: tl.constexpr,
    F_KIND: tl.constexpr,
    F_MANT: tl.constexpr,
    F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr,
    F_FNUZ: tl.constexpr,
    F_HASINF: tl.constexpr,
    F_MAXMAG: tl.constexpr,
    F_BIAS: tl.constexpr,
    PREFETCH_BT: tl.constexpr,
):
    """One (query block, KV head, KV split) of paged attention; see the module docstring.

    ``window`` is the sliding window (a huge value when there is none), ``causal`` 0/1.
    Strides in elements: ``stride_k{b,t,h}`` / ``stride_v{b,t,h}`` (block, token, head) of the
    K / V caches, ``stride_ks{b,t,h}`` / ``stride_vs{b,t,h}`` of the K / V scales (static
    scales: ``(0, 0, head stride)``, per-tensor all 0). ``LSE`` (``[T, HQ]`` float32, written
    only with ``WRITE_LSE``; split-KV: by ``_reduce_kernel``) gets each row's log-sum-exp.
    ``sm_scale * 2^sm_exp`` is ``softmax_scale`` (times ``log2(e)`` without soft-cap), ``sm_scale``
    in [1, 2). ``num_blocks`` bounds the block ids, ``max_keys = max_blocks * page`` the lengths,
    ``T`` the query offsets (memory safety without host checks: see the module docstring).
    Split-KV with per-token-head scales also stores each row's value scale at ``PL + pr_off``.
    """
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid_q // max_q_blocks
    qb = pid_q % max_q_blocks
    # ---- query rows: (token in block, head in group); metadata clamped to what the tensors hold
    q_start, q_len = _query_span(QSL, seq, T)
    if qb * block_q >= q_len:
        return
    seq_len, row_valid, tok, qh, pos = _program_rows(SEQ_LENS, seq, qb, q_start, q_len, max_keys, block_q, group, kvh,
                                                     BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = d < BLOCK_D
    else:
        dmask = d < D
    q_off = (tok * HQ + qh)[:, None] * D + d[None, :]
    qmask = row_valid[:, None] & dmask[None, :]
    q, q_shift = _load_query(Q, q_off, qmask, Q_BITS, QK_DT)

    # ---- the keys this program visits, and those visible to every row
    lo, hi, all_lo, all_hi, first_pos, last_pos = _key_range(seq_len, q_len, qb, block_q, window, causal, split,
                                                             keys_per_split, SPLIT, BLOCK_N)

    # ---- this program's kv_head in the caches and scales (int64: large caches)
    kvh64 = kvh.to(tl.int64)
    KC = KC + kvh64 * stride_kh
    VC = VC + kvh64 * stride_vh
    KS = KS + kvh64 * stride_ksh
    VS = VS + kvh64 * stride_vsh

    # ---- scales folded into the logits (never as one float32 product: see _scale_factors)
    g_exp = sm_exp + q_shift
    if TOKEN_SCALES:
        f1 = 1.0
        f2 = 1.0
    else:
        f1, f2 = _scale_factors(tl.load(KS), sm_scale, g_exp)

    # fewest keys any row sees: below FULL_P_KEYS of them P keeps ~22 bits (see _pv_dot)
    min_keys = tl.where(
        causal != 0, tl.minimum(first_pos + 1, window), seq_len - tl.maximum(last_pos - window + 1, 0)
    )
    split_p = min_keys < FULL_P_KEYS

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    r_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    # the P-precision choice is hoisted out of the loop (two copies of the loop): a runtime
    # branch around a tl.dot inside the loop is avoided
    if split_p:
        m_i, l_i, acc, r_i = _attend_range(
            q,
            m_i,
            l_i,
            acc,
            r_i,
            lo,
            hi,
            all_lo,
            all_hi,
            offs_n,
            bt_row,
            page,
            page_shift,
            num_blocks,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            stride_ksb,
            stride_kst,
            stride_vsb,
            stride_vst,
            KC,
            VC,
            KS,
            VS,
            f1,
            f2,
            sm_scale,
            g_exp,
            soft_cap,
            window,
            causal,
            pos,
            row_valid,
            d,
            dmask,
            BLOCK_N,
            EVEN_D,
            PAGE_POW2,
            True,
            USE_CAP,
            TOKEN_SCALES,
            QK_DT,
            PV_F32,
            PV_SPLIT,
            DEC_MODE,
            F_KIND,
            F_MANT,
            F_REBIAS,
            F_DROP,
            F_FNUZ,
            F_HASINF,
            F_MAXMAG,
            F_BIAS,
            PREFETCH_BT,
        )
    else:
        m_i, l_i, acc, r_i = _attend_range(
            q,
            m_i,
            l_i,
            acc,
            r_i,
            lo,
            hi,
            all_lo,
            all_hi,
            offs_n,
            bt_row,
            page,
            page_shift,
            num_blocks,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            stride_ksb,
            stride_kst,
            stride_vsb,
            stride_vst,
            KC,
            VC,
            KS,
            VS,
            f1,
            f2,
            sm_scale,
            g_exp,
            soft_cap,
            window,
            causal,
            pos,
            row_valid,
            d,
            dmask,
            BLOCK_N,
            EVEN_D,
            PAGE_POW2,
            False,
            USE_CAP,
            TOKEN_SCALES,
            QK_DT,
            PV_F32,
            PV_SPLIT,
            DEC_MODE,
            F_KIND,
            F_MANT,
            F_REBIAS,
            F_DROP,
            F_FNUZ,
            F_HASINF,
            F_MAXMAG,
            F_BIAS,
            PREFETCH_BT,
        )

    _finish(acc, m_i, l_i, r_i, OUT, q_off, PACC, PM, PL, LSE, VS, split, T, tok, HQ, qh, D, d, qmask, row_valid,
            pr_off, SPLIT, TOKEN_SCALES, WRITE_LSE)


@triton.jit(do_not_specialize=["T", "HQ", "group", "num_splits", "pr_off"])
def _reduce_kernel(
    PACC,
    PM,
    PL,
    VS,
    OUT,
    LSE,
    T,
    HQ,
    D,
    group,
    num_splits,
    stride_vsh,
    pr_off,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge the split-KV partials of one (token, query head): ``sum_s w_s acc_s / sum_s w_s l_s``
    with ``w_s = 2^(m_s - max_s m_s)``; the merged pair is ``(max_s m_s, sum_s w_s l_s)``.
    Per-token-head scales: ``acc_s`` is in units of ``r_s`` (at ``PL + pr_off``), so the sum is formed as
    ``A sum_s (w_s r_s / A) acc_s`` with ``A = max_s w_s r_s`` (no overflow)."""
    tok = tl.program_id(0).to(tl.int64)
    qh = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    part = (s * T + tok) * HQ + qh
    m = tl.load(PM + part, mask=smask, other=float("-inf"))
    l_s = tl.load(PL + part, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.load(PACC + part[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    if TOKEN_SCALES:
        a = w * tl.load(PL + pr_off + part, mask=smask, other=0.0)
        a_max = tl.max(a, axis=0)
        a_div = tl.where(a_max > 0, a_max, 1.0)
        num = tl.sum(acc * tl.math.div_rn(a, a_div + tl.zeros_like(a))[:, None], axis=0)
    else:
        num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_s * w, axis=0)
    if WRITE_LSE:
        tl.store(LSE + tok * HQ + qh, _lse(m_max, den))
    den = tl.where(den > 0, den, 1.0)
    o = tl.math.div_rn(num, den + tl.zeros_like(num))
    if TOKEN_SCALES:
        o = o * a_max
    else:
        o = o * tl.load(VS + (qh // group) * stride_vsh)
    o = _saturate_out(o, OUT.dtype.element_ty)
    tl.store(OUT + (tok * HQ + qh) * D + d, o.to(OUT.dtype.element_ty), mask=dmask)


# ------------------------------------------------------------------------------- launch


def is_amd(arch: str | None) -> bool:
    """Whether ``arch`` is an AMD GPU (``gfx...``: 64-wide wavefronts)."""
    return arch is not None and arch.startswith("gfx")


SMALL_SHARED_ARCHS = frozenset({"sm86", "sm89", "sm120", "sm121"})
"""NVIDIA architectures with 99 KB of shared memory per block (sm80/sm87: 163 KB, sm90/sm100: 227 KB):
RTX 30/40/50, A10/A40, L4/L40. The H100-tuned tiles need more (the decode kernel's 128-key, two-stage
tile 104 KB), and a launch that asks for more than the GPU has fails; compiled for sm89
(``python -m fp8kv_triton.aot --target sm89``) the tiles of :func:`choose_config` fit."""


def small_shared(arch: str | None) -> bool:
    """Whether ``arch`` has only 99 KB of shared memory per block (see :data:`SMALL_SHARED_ARCHS`)."""
    return arch in SMALL_SHARED_ARCHS


def reduce_warps(arch: str | None) -> int:
    """Warps of the split-KV reduce: 4 (on AMD 4 wavefronts of 64: with 2, gfx942 spills SGPRs)."""
    return 4


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of one call (chosen by :func:`choose_config`; benchmarks override)."""

    block_m: int
    block_n: int
    num_splits: int
    keys_per_split: int
    num_warps: int
    num_stages: int
    pv_split: bool = True
    reduce_warps: int = 4
    decode: bool = False
    """Use the decode kernel (:mod:`fp8kv_triton.decode`): only for steps with ``max_query_len <= 1``."""
    v_regs: bool = False
    """Decode kernel: V decoded to 16 bits in registers before ``p @ v`` (NVIDIA GPUs only)."""


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(
    device: torch.device,
    *,
    group: int,
    head_size: int,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_keys: int,
    interpret: bool,
    query_dtype: torch.dtype = torch.bfloat16,
    arch: str | None = None,
) -> AttnConfig:
    """Pick tile sizes and the KV split from host-known sizes only (no device sync).

    ``max_keys`` is ``block_tables.shape[1] * block_size``, an upper bound of every sequence.
    float32 queries (IEEE float32 products, whose operands take twice the shared memory) use
    half the key tile and two stages: a 64 x 128 float32 prefill tile with 128 keys and three
    stages needs 266 KB of shared memory on the H100 (limit 227 KB).

    ``arch`` (``"gfx942"``...; None or ``"sm.."`` = NVIDIA): on AMD a warp is a 64-wide
    wavefront. The warp count stays 4 (8 above 64 rows), i.e. 256 lanes per program, and one
    stage (no software pipelining). Compiled for gfx942/gfx950 (``python -m fp8kv_triton.aot``,
    ci/reports/compile/): 2 wavefronts need ~420 VGPRs for a 16 x 128 decode tile and spill
    to scratch for the 64-row prefill tile; two stages spill VGPRs to scratch in the prefill
    tile (and take 128 KiB of LDS on gfx950); 8 wavefronts cap VGPRs at 256 and spill. 4
    wavefronts, 1 stage: no VGPR spill, 16 KiB of LDS.
    """
    block_d = max(16, triton.next_power_of_2(head_size))
    gpad = max(16, triton.next_power_of_2(group))
    wide = block_d > 128
    if max_query_len <= 1:
        return _decode_config(device, gpad=gpad, wide=wide, narrow=block_d <= AMD_SMALL_TILE_HEAD_SIZE,
                              num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_keys=max_keys, interpret=interpret,
                              query_dtype=query_dtype, arch=arch)
    # prefill tiles from the H100 sweep (benchmarks/bench_triton.py run --sweep): 64 query rows,
    # 128 keys, 4 warps; smaller for head sizes above 128. Two stages: since the kernel addresses K
    # and V through their own strides, three stages take 147 KB of shared memory, one program per SM
    # (Nsight Compute: 6.25% occupancy), and 4 x 2048 over 2048 ran at 2944 us on the H100; two
    # stages take 112 KB, two programs per SM, 1951 us (benchmarks/results/prefill_regression_h100.md)
    block_m = max(gpad, 64)
    block_n = 64 if wide or query_dtype == torch.float32 else 128
    num_stages = 2
    if query_dtype == torch.float32 and not is_amd(arch):
        # float32 queries: 32 keys, one stage. On the H100 (4 x 1024 new over 1024 cached, D=128;
        # benchmarks/results/fp32_decode/prefill_probe*): the 64 x 64 two-stage tile was built with
        # 32 registers and 2302 spills and ran 142 ms (bf16 queries: 1.3 ms); every two-stage tile
        # tried and every 64-key one did the same (70-108 ms); 32 keys in one stage: 255 registers,
        # 74 spills, 10.5 ms. It also fits the A100 at D=256 (64 keys in two stages took 213 KB of
        # shared memory, beyond its 163 KB: a launch failure), and 99 KB GPUs (compiled for sm89:
        # 56 KB and no spill at D=128), where D=256 needs 32 query rows as well
        block_n, num_stages = 32, 1
        if small_shared(arch) and wide:
            block_m = max(gpad, 32)
    elif query_dtype == torch.float32 and block_d <= AMD_SMALL_TILE_HEAD_SIZE:  # AMD
        block_n = 32
    if interpret:
        block_m, block_n = (gpad, 32)
    block_q = max(1, block_m // group)
    q_blocks = triton.cdiv(max(max_query_len, 1), block_q)
    programs = num_seqs * q_blocks * num_kv_heads
    if interpret or device.type != "cuda":
        target = 1
    else:
        target = 4 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    num_splits = 1
    if programs < target and max_keys > 4 * block_n:
        num_splits = min(triton.cdiv(target, programs), triton.cdiv(max_keys, 4 * block_n), 128)
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_keys, keys_per_split)
    num_warps = 4 if block_m <= 64 else 8
    if is_amd(arch):
        num_stages = 1
    return AttnConfig(block_m, block_n, num_splits, keys_per_split, num_warps, num_stages=num_stages,
                      reduce_warps=reduce_warps(arch))


AMD_SMALL_TILE_HEAD_SIZE = 64
"""On AMD, head sizes up to this take smaller key tiles: 64 keys in decode, 32 in float32 prefill.
Compiled for gfx942/gfx950 (the CI matrix's compile cells, Triton 3.9), three D=64 variants with
the usual tiles put 20-36 B per lane in scratch memory at only 142-318 VGPRs (e4m3 decode, 128 keys,
float16 queries on gfx942; e5m2fnuz on gfx950: split decode, 128 keys, bfloat16, and prefill, 64
keys, float32); with those tiles none does. Halving every tile instead moved the scratch to the
float32 split decode (32 keys) of both fnuz formats on gfx950."""

DECODE_KEYS_PER_SPLIT = 2048
"""Decode: the key range is cut into pieces of about this many keys (and at least enough pieces
that every SM holds programs). Measured on the H100 (benchmarks/results/decode_tune_h100.json,
B=8 L=32768): 16 pieces of 2048 keys ran at 258 us, 9 of 3641 at 302 us, 3 at 313 us."""

DECODE_PROGRAMS_PER_SM = 2
"""Decode programs one H100 SM holds at once with 128-key tiles, 4 warps and two stages (106 KB
of shared memory each: Nsight Compute, benchmarks/results/decode_ncu_h100.txt)."""


def _decode_config(device: torch.device, *, gpad: int, wide: bool, narrow: bool, num_seqs: int, num_kv_heads: int,
                   max_keys: int, interpret: bool, query_dtype: torch.dtype, arch: str | None) -> AttnConfig:
    """Launch configuration of the decode kernel (:mod:`fp8kv_triton.decode`).

    Tiles from the H100 tuning (benchmarks/decode_tune.py; GQA 32/8, D=128, e4m3, bf16
    queries): 128 keys, 4 warps, 2 stages and V decoded in registers (``v_regs``) beat every
    other combination of 32/64/128/256 keys, 2/4/8 warps and 1-4 stages at all four bench
    shapes (e.g. B=32 L=4096: 135 us; 3 stages 173-195 us, 8 warps 225 us, 64-key tiles 143 us;
    without ``v_regs`` 211 us). Head sizes above 128 halve the key tile (registers, shared memory)
    and float32 queries take 32 keys: with 64, Triton 3.6 built the float32 decode kernel with 32
    registers and 896 spills and it ran 8703 us at B=32 L=4096 on the H100 (bf16 queries: 154 us);
    32 keys: 255 registers, 66 spills, 1565 us, the fastest of 32/64 keys x 4/8 warps x 1-3 stages
    tried (benchmarks/results/fp32_decode/); GPUs with 99 KB of shared memory (:data:`SMALL_SHARED_ARCHS`) take
    32-key tiles (compiled, not run or timed on such a GPU). Splits: enough for
    ``DECODE_PROGRAMS_PER_SM`` programs on every SM, and pieces of at most
    :data:`DECODE_KEYS_PER_SPLIT` keys. AMD: the general kernel (``decode=False``: compiled for
    gfx950 the decode kernel spills VGPRs to scratch), 4 wavefronts,
    one stage (see :func:`choose_config`), no ``v_regs`` (its barrier is PTX).
    """
    f32 = query_dtype == torch.float32
    block_n = 64 if wide or f32 else 128
    if f32 and not is_amd(arch):
        block_n = 32  # see the docstring (AMD keeps 64: with 32, gfx950's fnuz split decode uses scratch)
    num_warps, num_stages = 4, 2
    if is_amd(arch):
        num_stages = 1
    if small_shared(arch):
        # 99 KB GPUs, compiled for sm89: the 128-key two-stage tile takes 104 KB (bf16, D=128);
        # 32 keys, two stages: 29 KB and no spill (D=256 token_head: 58 KB)
        block_n = 32
    if is_amd(arch) and narrow:  # AMD_SMALL_TILE_HEAD_SIZE
        block_n = min(block_n, 64)
    if interpret:
        block_n, num_stages = 32, 1
    programs = num_seqs * num_kv_heads
    if interpret or device.type != "cuda":
        slots = 1
    else:
        slots = DECODE_PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None
                                                  else torch.cuda.current_device())
    num_splits = max(triton.cdiv(slots, programs), triton.cdiv(max_keys, DECODE_KEYS_PER_SPLIT))
    num_splits = max(1, min(num_splits, triton.cdiv(max_keys, block_n), 256))
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_keys, keys_per_split)
    # AMD keeps the general kernel: compiled for gfx950, the decode kernel spills VGPRs to scratch
    return AttnConfig(gpad, block_n, num_splits, keys_per_split, num_warps, num_stages=num_stages,
                      reduce_warps=reduce_warps(arch), decode=not is_amd(arch), v_regs=not is_amd(arch))


def paged_attention(
    query: torch.Tensor,
    cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    softmax_scale: float,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    out: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    decode_mode: int,
    interpret: bool,
    config: AttnConfig | None = None,
) -> None:
    """Paged attention of ``query [T, Hq, D]`` over ``cache``, into ``out [T, Hq, D]``.

    Arguments as in :meth:`fp8kv.hookspecs.BackendSpec.fp8kv_paged_attention`, plus the
    decoder ``decode_mode`` (from the codec policy) and an optional launch ``config``.
    ``cache.key_cache``/``value_cache`` and the scales may be strided views with their own
    strides (see :func:`fp8kv_triton.write.cache_strides` and ``scale_strides``).

    ``lse``: optional contiguous float32 ``[T, Hq]``, filled with each row's natural-log
    log-sum-exp ``logsumexp_k(softmax_scale * q . k'_k)`` (soft-capped if asked) over its
    visible keys ``k'`` (dequantized), the normaliser of the softmax; ``-inf`` for a row that
    sees no key. As in ``out``, rows of tokens outside every sequence (``t >= query_start_loc[-1]``)
    are left unspecified (untouched, or garbage from the split-KV merge).

    Memory-safe whatever the index values (see the module docstring): ``query_start_loc`` is
    clamped to ``[0, T]``, ``seq_lens`` to ``[0, max_blocks * block_size]``, block ids outside
    ``[0, num_blocks)`` are masked out, and the grid covers ``min(max_query_len, T)`` queries per
    sequence (a ``max_query_len`` below the longest query leaves the rows past it unspecified).
    ``softmax_scale`` and ``logits_soft_cap`` must be finite, > 0 and within the float32 range.
    """
    T, HQ, D = query.shape
    H = cache.num_kv_heads
    group = HQ // H
    S = seq_lens.shape[0]
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (T, HQ) or not lse.is_contiguous()):
        raise ValueError(f"lse: got {lse.dtype} {tuple(lse.shape)} strides {lse.stride()}, "
                         f"expected a contiguous float32 [{T}, {HQ}]")
    for name, x in (("softmax_scale", softmax_scale), ("logits_soft_cap", logits_soft_cap)):
        if x is not None and not (math.isfinite(x) and 0 < x <= FLOAT32_MAX):
            raise ValueError(f"{name}: got {x!r}, expected a finite number in (0, {FLOAT32_MAX:.4g}]")
    max_query_len = min(max(int(max_query_len), 1), max(T, 1))  # a host int: no sync
    if T == 0 or S == 0:
        return
    if config is None:
        config = choose_config(
            query.device,
            group=group,
            head_size=D,
            num_seqs=S,
            num_kv_heads=H,
            max_query_len=max_query_len,
            max_keys=block_tables.shape[1] * cache.block_size,
            interpret=interpret,
            query_dtype=query.dtype,
        )
    block_d = max(16, triton.next_power_of_2(D))
    block_q = max(1, config.block_m // group)
    q_blocks = triton.cdiv(max_query_len, block_q)
    # softmax_scale (times log2(e) unless soft-capped: then log2(e) comes after the cap) as a
    # mantissa in [1, 2) and an exponent, so that it never overflows float32 (see _scale_factors)
    sm_mant, sm_exp = math.frexp(float(softmax_scale) * (1.0 if logits_soft_cap is not None else LOG2E))
    sm_mant, sm_exp = 2.0 * sm_mant, sm_exp - 1
    a = codec_args(cache.fmt)
    k_strides, v_strides = cache_strides(cache, "key"), cache_strides(cache, "value")
    ks_strides, vs_strides = scale_strides(cache, "key"), scale_strides(cache, "value")
    split = config.num_splits > 1
    qk_dt = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[query.dtype]
    q_arg, q_bits = query, False
    if interpret and qk_dt == tl.bfloat16:
        # Triton's CPU interpreter holds bfloat16 as raw uint16 and tl.dot multiplies those
        # integers, and it widens bfloat16 subnormals wrongly: pass the bits, widen them in
        # the kernel, and multiply in float32 (bf16 x fp8 products are exact either way).
        qk_dt = tl.float32
        q_arg, q_bits = query.view(torch.int16), True
    out_arg = out
    if interpret and out.dtype == torch.bfloat16:
        # the interpreter converts float32 below 2^-126 to bfloat16 wrongly: store float32, convert here
        out_arg = out.float()
    token_scales = cache.scale_granularity == "token_head"
    if split:
        pacc = torch.empty((config.num_splits, T, HQ, D), dtype=torch.float32, device=query.device)
        pm = torch.empty((config.num_splits, T, HQ), dtype=torch.float32, device=query.device)
        # l, then (per-token-head scales) each row's value scale r at pl + pr_off
        pl = torch.empty(((2 if token_scales else 1) * config.num_splits, T, HQ), dtype=torch.float32,
                         device=query.device)
    else:
        pacc = pm = pl = out  # unused
    pr_off = config.num_splits * T * HQ
    lse_arg = out if lse is None else lse  # unused without WRITE_LSE
    page = cache.block_size
    pow2 = page & (page - 1) == 0
    grid = (S * q_blocks, H, config.num_splits)
    extra = {}
    if config.decode and max_query_len == 1:
        from .decode import _decode_kernel as kernel

        extra["V_REGS"] = config.v_regs and not interpret
    else:
        kernel = _attn_kernel
        extra["PREFETCH_BT"] = config.num_stages > 1
    kernel[grid](
        q_arg,
        cache.key_cache.view(torch.uint8),
        cache.value_cache.view(torch.uint8),
        cache.k_scale,
        cache.v_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        out_arg,
        pacc,
        pm,
        pl,
        lse_arg,
        sm_mant,
        sm_exp,
        float(logits_soft_cap or 1.0),
        min(int(sliding_window or NO_WINDOW), NO_WINDOW),
        int(causal),
        block_tables.stride(0),
        *k_strides,
        *v_strides,
        *ks_strides,
        *vs_strides,
        T,
        HQ,
        D,
        group,
        block_q,
        q_blocks,
        config.keys_per_split,
        page,
        page.bit_length() - 1,
        cache.key_cache.shape[0],
        block_tables.shape[1] * page,
        pr_off,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == D,
        FULL_P_KEYS=FULL_P_KEYS,
        PAGE_POW2=pow2,
        USE_CAP=logits_soft_cap is not None,
        TOKEN_SCALES=token_scales,
        Q_BITS=q_bits,
        SPLIT=split,
        WRITE_LSE=lse is not None and not split,
        QK_DT=qk_dt,
        PV_F32=query.dtype == torch.float32,
        PV_SPLIT=config.pv_split,
        DEC_MODE=decode_mode,
        F_KIND=a.fp8_kind,
        F_MANT=a.mant_bits,
        F_REBIAS=a.exp_rebias,
        F_DROP=a.drop_bits,
        F_FNUZ=a.fnuz,
        F_HASINF=a.has_inf,
        F_MAXMAG=a.max_mag,
        F_BIAS=a.bias,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **extra,
    )
    if split:
        merge_splits(pacc, pm, pl, cache, out_arg, lse, group=group, num_splits=config.num_splits,
                     token_scales=token_scales, reduce_warps=config.reduce_warps)
    if out_arg is not out:
        hi = torch.finfo(out.dtype).max
        out.copy_(out_arg.clamp_(-hi, hi))


def merge_splits(
    pacc: torch.Tensor,
    pm: torch.Tensor,
    pl: torch.Tensor,
    cache: KVCache,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    group: int,
    num_splits: int,
    token_scales: bool = False,
    reduce_warps: int = 4,
) -> None:
    """Merge split-KV partials into ``out [T, Hq, D]`` (and ``lse [T, Hq]``), times ``v_scale``.

    ``pacc [num_splits, T, Hq, D]`` holds each split's unnormalised sum, ``pm``/``pl``
    ``[num_splits, T, Hq]`` its base-2 row max and sum of ``2^(s - m)`` (float32, contiguous);
    per-token-head scales: ``pl`` is ``[2 * num_splits, T, Hq]``, its second half each row's value
    unit ``r``. Static ``v_scale`` (the cache's, by KV head) multiplies the merged output.
    """
    _, T, HQ, D = pacc.shape
    _reduce_kernel[(T, HQ)](
        pacc,
        pm,
        pl,
        cache.v_scale,
        out,
        out if lse is None else lse,
        T,
        HQ,
        D,
        group,
        num_splits,
        scale_strides(cache, "value")[2],
        num_splits * T * HQ,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        TOKEN_SCALES=token_scales,
        WRITE_LSE=lse is not None,
        num_warps=reduce_warps,
    )
