"""Paged decode attention over the FP8 cache: one query token per sequence, built to be bandwidth-bound.

``_decode_kernel``, grid ``(num_seqs, H, num_splits)``, serves every step whose queries are
one token per sequence (``max_query_len <= 1``). It computes what ``_attn_kernel``
(:mod:`fp8kv_triton.attention`) computes for those rows, with the same building blocks
(:mod:`fp8kv_triton.tiles`: :func:`~fp8kv_triton.tiles._logits`, :func:`~fp8kv_triton.tiles._softmax_pv`),
the same arguments and the same split-KV merge, but a loop shaped for streaming the cache:

* **Rows are the GQA group.** A program owns one sequence, one KV head and one slice of the
  key range; its ``BLOCK_H`` rows are the ``group`` query heads of that KV head (padded to 16
  for the tensor-core product).
* **One visible range, one mask.** A single query token sees the keys ``[lo, hi)`` (``hi`` its
  position + 1 when causal, else the sequence length; ``lo`` from the sliding window), so the
  mask of a tile is ``lo <= n < hi`` and the block id in ``[0, num_blocks)``, applied per
  element on every tile: no per-tile reduction and no branch in the key loop.
* **Memory safety** as in ``_attn_kernel``: offsets and lengths are clamped to what the
  tensors hold, and a key whose block id is outside ``[0, num_blocks)`` is never loaded and
  never visible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    UNSPECIALIZED,
    _finish,
    _key_loops,
    _load_codes,
    _load_query,
    _logits,
    _online_state,
    _scale_factors,
    _softmax_pv,
)


@triton.jit
def _decode_range(
    m_i, l_i, acc, r_i, q,                               # online-softmax state, queries [M, D]
    lo, hi, offs_n, bt_row, page, page_shift, num_blocks,  # visible keys, tile lanes [N], paging
    stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
    KC, VC, KS, VS, f1, f2, g_mant, g_exp, soft_cap, d, dmask,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PAGE_POW2: tl.constexpr,
    USE_CAP: tl.constexpr, TOKEN_SCALES: tl.constexpr,
    QK_DT: tl.constexpr, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr, V_REGS: tl.constexpr,
    DEC_MODE: tl.constexpr, F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
    SPLIT_P: tl.constexpr,
):
    """The key loop of one program over ``[lo, hi)`` (tiles aligned to ``BLOCK_N``); ``SPLIT_P``: P as two
    float16 matrices in ``p @ v`` (with ``PV_SPLIT``; see :func:`~fp8kv_triton.tiles._pv_dot`)."""
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        n = start + offs_n
        inside = (n >= lo) & (n < hi)
        page_idx = n >> page_shift if PAGE_POW2 else n // page  # block-table column
        tib = n & (page - 1) if PAGE_POW2 else n % page  # offset in the block
        blk = tl.load(bt_row + page_idx, mask=inside, other=0)
        kmask = inside & (blk >= 0) & (blk < num_blocks)
        blk = blk.to(tl.int64)
        tib = tib.to(tl.int64)
        kc, vc = _load_codes(KC, VC, blk * stride_kb + tib * stride_kt, blk * stride_vb + tib * stride_vt,
                             kmask, d, dmask, EVEN_D)
        s = _logits(q, kc, kmask, blk, tib, KS, f1, f2, g_mant, g_exp, soft_cap, stride_ksb, stride_kst,
                    USE_CAP, TOKEN_SCALES, QK_DT,
                    DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_i, l_i, acc, r_i = _softmax_pv(s, vc, kmask, blk, tib, m_i, l_i, acc, r_i, VS, stride_vsb, stride_vst,
                                         TOKEN_SCALES, PV_F32, PV_SPLIT and SPLIT_P, V_REGS,
                                         DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    return m_i, l_i, acc, r_i


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _decode_kernel(
    # tensors
    Q, KC, VC, KS, VS, BT, SEQ_LENS, QSL, OUT, PACC, PM, PL, LSE,
    # scalars
    sm_scale, sm_exp, soft_cap, window, causal,
    # strides, in elements: the block table's row; (block, token, head) of the K/V caches and of their scales
    stride_bt,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    # sizes and bounds
    T, HQ, D, group, block_q, max_q_blocks, keys_per_split, page, page_shift, num_blocks, max_keys, pr_off,
    # constexpr: tiles, features, product precisions, FP8 format
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    FULL_P_KEYS: tl.constexpr, PAGE_POW2: tl.constexpr, USE_CAP: tl.constexpr, TOKEN_SCALES: tl.constexpr,
    Q_BITS: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    QK_DT: tl.constexpr, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr,
    DEC_MODE: tl.constexpr, F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
    V_REGS: tl.constexpr = False,
):
    """One (sequence, KV head, KV split) of decode attention.

    Arguments are ``_attn_kernel``'s (one launcher serves both; see its docstring for the tensors'
    shapes; ``block_q`` and ``max_q_blocks`` are unused, ``BLOCK_M`` is the padded group). The query
    of sequence ``seq`` is token ``query_start_loc[seq]``; a sequence with no query token is skipped,
    and one whose query is longer than one token (``max_query_len`` given too small, host checks off)
    gets its first token attended at that token's position. ``V_REGS``: V decoded to 16 bits in
    registers before ``p @ v`` (NVIDIA GPUs only).
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.minimum(tl.maximum(tl.load(QSL + seq), 0), T)
    q_end = tl.minimum(tl.maximum(tl.load(QSL + seq + 1), 0), T)
    if q_end <= q_start:
        return
    seq_len = tl.minimum(tl.maximum(tl.load(SEQ_LENS + seq), 0), max_keys)
    pos = seq_len - (q_end - q_start)  # the query token's position
    hi = tl.where(causal != 0, pos + 1, seq_len)
    lo = tl.maximum(pos - window + 1, 0)
    # fewest keys any row sees: below FULL_P_KEYS of them P keeps ~22 bits (see _pv_dot)
    split_p = hi - lo < FULL_P_KEYS
    if SPLIT:
        lo = tl.maximum(lo, split * keys_per_split)
        hi = tl.minimum(hi, (split + 1) * keys_per_split)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < group
    qh = kvh * group + rows
    tok = q_start.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = d < BLOCK_D
    else:
        dmask = d < D
    q_off = (tok * HQ + qh)[:, None] * D + d[None, :]
    qmask = row_valid[:, None] & dmask[None, :]
    q, q_shift = _load_query(Q, q_off, qmask, Q_BITS, QK_DT)

    kvh64 = kvh.to(tl.int64)
    KC = KC + kvh64 * stride_kh
    VC = VC + kvh64 * stride_vh
    KS = KS + kvh64 * stride_ksh
    VS = VS + kvh64 * stride_vsh
    g_exp = sm_exp + q_shift
    if TOKEN_SCALES:
        f1 = 1.0
        f2 = 1.0
    else:
        f1, f2 = _scale_factors(tl.load(KS), sm_scale, g_exp)

    m_i, l_i, r_i, acc = _online_state(BLOCK_M, BLOCK_D)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    # the key loop, compiled twice: the P-precision choice is made once, outside it
    m_i, l_i, acc, r_i = _key_loops(
        _decode_range, split_p, m_i, l_i, r_i, acc,
        (q, lo, hi, offs_n, bt_row, page, page_shift, num_blocks,
         stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
         KC, VC, KS, VS, f1, f2, sm_scale, g_exp, soft_cap, d, dmask,
         BLOCK_N, EVEN_D, PAGE_POW2, USE_CAP, TOKEN_SCALES, QK_DT, PV_F32, PV_SPLIT, V_REGS,
         DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS),
    )

    _finish(acc, m_i, l_i, r_i, OUT, q_off, PACC, PM, PL, LSE, VS, split, T, tok, HQ, qh, D, d, qmask, row_valid,
            pr_off, SPLIT, TOKEN_SCALES, WRITE_LSE)
