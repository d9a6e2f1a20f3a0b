"""Paged attention over the FP8 cache: one kernel for decode and chunked prefill, split-KV.

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
* **Scales folded.** Per-tensor/per-head: ``k_scale`` multiplies ``softmax_scale`` once
  per program, ``v_scale`` multiplies the output once. Per-token-head: ``k_scale`` of each
  key multiplies its logit column, ``v_scale`` of each key multiplies its probability
  column. Both are exact rewrites of ``softmax(q . (c_k s_k)) (c_v s_v)``.
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
  factor is folded into ``qk_scale``, or applied after the soft-cap; per-token-head ``k_scale``
  multiplies each column before), so ``lse = (m + log2(l)) * ln(2)`` from the final online
  state; split-KV: from the merged ``(max_s m_s, sum_s 2^(m_s - max) l_s)`` in
  ``_reduce_kernel``. Rows with no visible key get ``-inf``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp8kv.cache import KVCache

from .codec import codec_args, decode
from .write import cache_strides, scale_strides

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30
FULL_P_KEYS = 1024
"""Rows that see at least this many keys use one float16 ``p @ v`` product: its error, at most
``2^-12 V`` (``V = max |v'|``), is then within ``4 N u V`` (``u = 2^-24``), half the accumulation
term ``(8N + 8) u V`` of the derived tolerance (:mod:`fp8kv.testing.tolerance`). Rows with fewer
keys keep ~22 bits of ``p`` (two float16 halves)."""
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
def _tile(
    start, offs_n, hi, bt_row, page, page_shift, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_POW2: tl.constexpr
):
    """Key positions ``n`` of the tile at ``start``, their mask, block ids and offsets in block
    (int64), and the byte offsets of their rows in the K and V caches (from the kv_head's row)."""
    n = start + offs_n
    kmask = n < hi
    if PAGE_POW2:
        page_idx = n >> page_shift
        tib = n & (page - 1)
    else:
        page_idx = n // page
        tib = n % page
    blk = tl.load(bt_row + page_idx, mask=kmask, other=0).to(tl.int64)
    tib = tib.to(tl.int64)
    k_off = blk * stride_kb + tib * stride_kt
    v_off = blk * stride_vb + tib * stride_vt
    return n, kmask, blk, tib, k_off, v_off


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
    KS,
    VS,
    qk_scale,
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
    """One tile of online softmax: returns the updated row max ``m_i``, sum ``l_i`` and ``acc``.

    ``KS``/``VS`` point at the kv_head's scale; per-token-head scales of key (``blk``, ``tib``)
    are read at ``KS + blk * stride_ksb + tib * stride_kst`` (and likewise for V).
    """
    k = decode(kc, QK_DT, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    if QK_DT == tl.float32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if TOKEN_SCALES:
        ks = tl.load(KS + blk * stride_ksb + tib * stride_kst, mask=kmask, other=1.0)
        s = s * (ks * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if USE_CAP:
        s = soft_cap * _tanh(s / soft_cap) * 1.4426950408889634
    if need_mask:  # tiles inside every row's visible range skip this
        visible = kmask[None, :] & row_valid[:, None] & (n[None, :] > pos[:, None] - window)
        visible = visible & ((n[None, :] <= pos[:, None]) | (causal == 0))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if PV_F32:
        v_dt: tl.constexpr = tl.float32
    else:
        v_dt: tl.constexpr = tl.float16
    v = decode(vc, v_dt, DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    if TOKEN_SCALES:
        vs = tl.load(VS + blk * stride_vsb + tib * stride_vst, mask=kmask, other=0.0)
        w = p * vs[None, :]
        r = tl.max(w, axis=1)
        r = tl.where(r > 0, r, 1.0)
        w = tl.math.div_rn(w, r[:, None] + tl.zeros_like(w))  # in [0, 1]; 1 / r may overflow
        acc = acc + r[:, None] * _pv_dot(w, v, tl.zeros_like(acc), PV_F32, PV_SPLIT)
    else:
        acc = _pv_dot(p, v, acc, PV_F32, PV_SPLIT)
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    all_lo,
    all_hi,
    offs_n,
    bt_row,
    page,
    page_shift,
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
    qk_scale,
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
):
    """The loop over the key tiles ``[lo, hi)`` of one program (online softmax state in and out).

    ``KC``/``VC``/``KS``/``VS`` already point at the program's kv_head.
    """
    for start in range(lo, hi, BLOCK_N):
        n, kmask, blk, tib, k_off, v_off = _tile(
            start, offs_n, hi, bt_row, page, page_shift, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_POW2
        )
        kc, vc = _load_codes(KC, VC, k_off, v_off, kmask, d, dmask, EVEN_D)
        m_i, l_i, acc = _attend(
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
            KS,
            VS,
            qk_scale,
            soft_cap,
            window,
            causal,
            pos,
            row_valid,
            stride_ksb,
            stride_kst,
            stride_vsb,
            stride_vst,
            (start < all_lo) | (start + BLOCK_N > all_hi) | (start + BLOCK_N > hi),
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
    return m_i, l_i, acc


@triton.jit(
    do_not_specialize=[
        "sm_scale",
        "soft_cap",
        "window",
        "T",
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
):
    """One (query block, KV head, KV split) of paged attention; see the module docstring.

    ``window`` is the sliding window (a huge value when there is none), ``causal`` 0/1.
    Strides in elements: ``stride_k{b,t,h}`` / ``stride_v{b,t,h}`` (block, token, head) of the
    K / V caches, ``stride_ks{b,t,h}`` / ``stride_vs{b,t,h}`` of the K / V scales (static
    scales: ``(0, 0, head stride)``, per-tensor all 0). ``LSE`` (``[T, HQ]`` float32, written
    only with ``WRITE_LSE``; split-KV: by ``_reduce_kernel``) gets each row's log-sum-exp.
    """
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid_q // max_q_blocks
    qb = pid_q % max_q_blocks
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    if qb * block_q >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + seq)

    # ---- query rows: (token in block, head in group)
    rows = tl.arange(0, BLOCK_M)
    qi = rows // group
    tok_in_seq = qb * block_q + qi
    row_valid = (qi < block_q) & (tok_in_seq < q_len)
    tok = (q_start + tok_in_seq).to(tl.int64)
    qh = kvh * group + rows % group
    pos = seq_len - q_len + tok_in_seq  # position of each row's query token
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = d < BLOCK_D
    else:
        dmask = d < D
    q_off = (tok * HQ + qh)[:, None] * D + d[None, :]
    if Q_BITS:  # bfloat16 as int16 bits, widened exactly (interpreter: see the launcher)
        q_raw = tl.load(Q + q_off, mask=row_valid[:, None] & dmask[None, :], other=0)
        q = (q_raw.to(tl.int32) << 16).to(tl.float32, bitcast=True).to(QK_DT)
    else:
        q = tl.load(Q + q_off, mask=row_valid[:, None] & dmask[None, :], other=0.0).to(QK_DT)

    # ---- the keys this program visits
    first_pos = seq_len - q_len + qb * block_q
    last_pos = seq_len - q_len + tl.minimum(qb * block_q + block_q, q_len) - 1
    hi = tl.where(causal != 0, last_pos + 1, seq_len)
    lo = tl.maximum(first_pos - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * keys_per_split)
        hi = tl.minimum(hi, (split + 1) * keys_per_split)
    lo = (lo // BLOCK_N) * BLOCK_N

    # ---- this program's kv_head in the caches and scales (int64: large caches)
    kvh64 = kvh.to(tl.int64)
    KC = KC + kvh64 * stride_kh
    VC = VC + kvh64 * stride_vh
    KS = KS + kvh64 * stride_ksh
    VS = VS + kvh64 * stride_vsh

    # ---- scales folded into the logits / output
    if TOKEN_SCALES:
        qk_scale = sm_scale
    else:
        qk_scale = sm_scale * tl.load(KS)
    if not USE_CAP:
        qk_scale = qk_scale * 1.4426950408889634

    # keys visible to every row of the block: [last_pos - window + 1, first_pos] (causal) or
    # [last_pos - window + 1, seq_len) (not causal); tiles inside need no mask
    all_lo = last_pos - window + 1
    all_hi = tl.where(causal != 0, first_pos + 1, seq_len)
    # fewest keys any row sees: below FULL_P_KEYS of them P keeps ~22 bits (see _pv_dot)
    min_keys = tl.where(
        causal != 0, tl.minimum(first_pos + 1, window), seq_len - tl.maximum(last_pos - window + 1, 0)
    )
    split_p = min_keys < FULL_P_KEYS

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    # the P-precision choice is hoisted out of the loop (two copies of the loop): a runtime
    # branch around a tl.dot inside the loop is avoided
    if split_p:
        m_i, l_i, acc = _attend_range(
            q,
            m_i,
            l_i,
            acc,
            lo,
            hi,
            all_lo,
            all_hi,
            offs_n,
            bt_row,
            page,
            page_shift,
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
            qk_scale,
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
        )
    else:
        m_i, l_i, acc = _attend_range(
            q,
            m_i,
            l_i,
            acc,
            lo,
            hi,
            all_lo,
            all_hi,
            offs_n,
            bt_row,
            page,
            page_shift,
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
            qk_scale,
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
        )

    if SPLIT:
        part = (split * T + tok) * HQ + qh
        tl.store(PACC + part[:, None] * D + d[None, :], acc, mask=row_valid[:, None] & dmask[None, :])
        tl.store(PM + part, m_i, mask=row_valid)
        tl.store(PL + part, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # padding rows only
        o = tl.math.div_rn(acc, l_safe[:, None] + tl.zeros_like(acc))
        if not TOKEN_SCALES:
            o = o * tl.load(VS)
        tl.store(OUT + q_off, o.to(OUT.dtype.element_ty), mask=row_valid[:, None] & dmask[None, :])
        if WRITE_LSE:
            tl.store(LSE + tok * HQ + qh, _lse(m_i, l_i), mask=row_valid)


@triton.jit(do_not_specialize=["T", "HQ", "group", "num_splits"])
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
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKEN_SCALES: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge the split-KV partials of one (token, query head): ``sum_s w_s acc_s / sum_s w_s l_s``
    with ``w_s = 2^(m_s - max_s m_s)``; the merged pair is ``(max_s m_s, sum_s w_s l_s)``."""
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
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_s * w, axis=0)
    if WRITE_LSE:
        tl.store(LSE + tok * HQ + qh, _lse(m_max, den))
    den = tl.where(den > 0, den, 1.0)
    o = tl.math.div_rn(num, den + tl.zeros_like(num))
    if not TOKEN_SCALES:
        o = o * tl.load(VS + (qh // group) * stride_vsh)
    tl.store(OUT + (tok * HQ + qh) * D + d, o.to(OUT.dtype.element_ty), mask=dmask)


# ------------------------------------------------------------------------------- launch


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
) -> AttnConfig:
    """Pick tile sizes and the KV split from host-known sizes only (no device sync).

    ``max_keys`` is ``block_tables.shape[1] * block_size``, an upper bound of every sequence.
    """
    block_d = max(16, triton.next_power_of_2(head_size))
    gpad = max(16, triton.next_power_of_2(group))
    # tiles from the H100 sweep (benchmarks/bench_triton.py run --sweep): 128 keys, 4 warps,
    # 3 stages for decode; 64 query rows for prefill; smaller for head sizes above 128
    wide = block_d > 128
    if max_query_len <= 1:
        block_m = gpad
    else:
        block_m = max(gpad, 64)
    block_n = 64 if wide else 128
    num_stages = 2 if wide else 3
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
    return AttnConfig(block_m, block_n, num_splits, keys_per_split, num_warps, num_stages=num_stages)


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
    """
    T, HQ, D = query.shape
    H = cache.num_kv_heads
    group = HQ // H
    S = seq_lens.shape[0]
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (T, HQ) or not lse.is_contiguous()):
        raise ValueError(f"lse: got {lse.dtype} {tuple(lse.shape)} strides {lse.stride()}, "
                         f"expected a contiguous float32 [{T}, {HQ}]")
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
        )
    block_d = max(16, triton.next_power_of_2(D))
    block_q = max(1, config.block_m // group)
    q_blocks = triton.cdiv(max(max_query_len, 1), block_q)
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
    if split:
        pacc = torch.empty((config.num_splits, T, HQ, D), dtype=torch.float32, device=query.device)
        pm = torch.empty((config.num_splits, T, HQ), dtype=torch.float32, device=query.device)
        pl = torch.empty_like(pm)
    else:
        pacc = pm = pl = out  # unused
    token_scales = cache.scale_granularity == "token_head"
    lse_arg = out if lse is None else lse  # unused without WRITE_LSE
    page = cache.block_size
    pow2 = page & (page - 1) == 0
    grid = (S * q_blocks, H, config.num_splits)
    _attn_kernel[grid](
        q_arg,
        cache.key_cache.view(torch.uint8),
        cache.value_cache.view(torch.uint8),
        cache.k_scale,
        cache.v_scale,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        pacc,
        pm,
        pl,
        lse_arg,
        float(softmax_scale),
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
    )
    if split:
        _reduce_kernel[(T, HQ)](
            pacc,
            pm,
            pl,
            cache.v_scale,
            out,
            lse_arg,
            T,
            HQ,
            D,
            group,
            config.num_splits,
            vs_strides[2],
            BLOCK_S=max(2, triton.next_power_of_2(config.num_splits)),
            BLOCK_D=block_d,
            TOKEN_SCALES=token_scales,
            WRITE_LSE=lse is not None,
            num_warps=4,
        )
