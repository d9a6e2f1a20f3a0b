"""Paged attention over the FP8 cache: the general kernel (chunked prefill, and decode on AMD), split-KV.

Steps with one query token per sequence run the decode kernel on NVIDIA
(:mod:`fp8kv_triton.decode`, chosen by :func:`choose_config`, launched by :func:`paged_attention`
with the same arguments) and the split-KV merge ``_reduce_kernel``. Both kernels are built from
the ``@triton.jit`` building blocks of :mod:`fp8kv_triton.tiles` (:func:`~fp8kv_triton.tiles._logits`,
:func:`~fp8kv_triton.tiles._softmax_pv`, the scale and saturation helpers); this module holds the
general kernel, the merge and the launcher.

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

from .codec import codec_args
from .decode import _decode_kernel
from .serial import launching
from .tiles import (
    UNSPECIALIZED,
    _finish,
    _key_loops,
    _key_range,
    _load_codes,
    _load_query,
    _logits,
    _lse,
    _online_state,
    _program_rows,
    _query_span,
    _saturate_out,
    _scale_factors,
    _softmax_pv,
    _tile_at,
    _tile_blocks,
)
from .write import cache_strides, scale_strides

LOG2E = 1.4426950408889634
FLOAT32_MAX = 3.4028234663852886e38
NO_WINDOW = 1 << 30

"""The ``window`` passed when there is no sliding window (no key is that far back)."""


@triton.jit
def _attend(
    q, kc, vc, n, kmask, blk, tib,                       # queries [M, D], K [D, N] / V [N, D] codes, keys [N]
    m_i, l_i, acc, r_i,                                  # online-softmax state
    KS, VS, f1, f2, g_mant, g_exp, soft_cap,             # scales and logit factor
    window, causal, pos, row_valid,                      # visibility of key n to row m
    stride_ksb, stride_kst, stride_vsb, stride_vst,      # per-token-head scale strides
    need_mask,                                           # the tile needs the causal/window/bounds mask
    USE_CAP: tl.constexpr, TOKEN_SCALES: tl.constexpr,
    QK_DT: tl.constexpr, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr,
    DEC_MODE: tl.constexpr, F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
):
    """One tile of online softmax for query rows at positions ``pos``: :func:`_logits`, the
    causal/window/bounds mask where ``need_mask``, then :func:`_softmax_pv`."""
    s = _logits(q, kc, kmask, blk, tib, KS, f1, f2, g_mant, g_exp, soft_cap, stride_ksb, stride_kst,
                USE_CAP, TOKEN_SCALES, QK_DT,
                DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)
    if need_mask:  # tiles inside every row's visible range skip this
        visible = kmask[None, :] & row_valid[:, None] & (n[None, :] > pos[:, None] - window)
        visible = visible & ((n[None, :] <= pos[:, None]) | (causal == 0))
        s = tl.where(visible, s, float("-inf"))
    return _softmax_pv(s, vc, kmask, blk, tib, m_i, l_i, acc, r_i, VS, stride_vsb, stride_vst,
                       TOKEN_SCALES, PV_F32, PV_SPLIT, False,
                       DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS)


@triton.jit
def _attend_range(
    m_i, l_i, acc, r_i, q,                               # online-softmax state, queries [M, D]
    lo, hi, all_lo, all_hi,                              # keys visited, keys visible to every row
    offs_n, bt_row, page, page_shift, num_blocks,        # tile lanes [N], paging
    stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
    KC, VC, KS, VS, f1, f2, g_mant, g_exp, soft_cap,     # caches, scales and logit factor
    window, causal, pos, row_valid, d, dmask,            # rows [M], head-dim lanes [D]
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PAGE_POW2: tl.constexpr, PREFETCH_BT: tl.constexpr,
    USE_CAP: tl.constexpr, TOKEN_SCALES: tl.constexpr,
    QK_DT: tl.constexpr, PV_F32: tl.constexpr, PV_SPLIT: tl.constexpr,
    DEC_MODE: tl.constexpr, F_KIND: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_FNUZ: tl.constexpr, F_HASINF: tl.constexpr, F_MAXMAG: tl.constexpr, F_BIAS: tl.constexpr,
    SPLIT_P: tl.constexpr,
):
    """The loop over the key tiles ``[lo, hi)`` of one program (online softmax state in and out).

    ``KC``/``VC``/``KS``/``VS`` already point at the program's kv_head. ``SPLIT_P``: P as two float16
    matrices in ``p @ v`` (with ``PV_SPLIT``; see :func:`_pv_dot`).
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
            q, kc, vc, n, kmask, blk, tib, m_i, l_i, acc, r_i,
            KS, VS, f1, f2, g_mant, g_exp, soft_cap, window, causal, pos, row_valid,
            stride_ksb, stride_kst, stride_vsb, stride_vst,
            (start < all_lo) | (start + BLOCK_N > all_hi) | (start + BLOCK_N > hi) | hole,
            USE_CAP, TOKEN_SCALES, QK_DT, PV_F32, PV_SPLIT and SPLIT_P,
            DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS,
        )
    return m_i, l_i, acc, r_i


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _attn_kernel(
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
    PREFETCH_BT: tl.constexpr,
):
    """One (query block, KV head, KV split) of paged attention; see the module docstring.

    Tensors: ``Q``/``OUT [T, HQ, D]``; ``KC``/``VC`` the K/V caches as bytes (``[num_blocks, page, H, D]``
    or any layout with the strides below); ``KS``/``VS`` the K/V scales (``[num_blocks, page, H]``,
    ``[H]`` or ``[]``); ``BT [num_seqs, max_blocks]`` int32 block table; ``SEQ_LENS [num_seqs]``,
    ``QSL [num_seqs + 1]`` (``query_start_loc``) int32. Split-KV partials ``PACC [num_splits, T, HQ, D]``,
    ``PM [num_splits, T, HQ]``, ``PL [(1 or 2) * num_splits, T, HQ]`` float32 (see :func:`_finish`);
    ``LSE [T, HQ]`` float32, written only with ``WRITE_LSE`` (split-KV: by ``_reduce_kernel``), gets
    each row's log-sum-exp.

    ``window`` is the sliding window (a huge value when there is none), ``causal`` 0/1.
    Strides in elements: ``stride_k{b,t,h}`` / ``stride_v{b,t,h}`` (block, token, head) of the
    K / V caches, ``stride_ks{b,t,h}`` / ``stride_vs{b,t,h}`` of the K / V scales (static
    scales: ``(0, 0, head stride)``, per-tensor all 0).
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

    m_i, l_i, r_i, acc = _online_state(BLOCK_M, BLOCK_D)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    # the key loop, compiled twice: the P-precision choice is made once, outside it
    m_i, l_i, acc, r_i = _key_loops(
        _attend_range, split_p, m_i, l_i, r_i, acc,
        (q, lo, hi, all_lo, all_hi, offs_n, bt_row, page, page_shift, num_blocks,
         stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
         KC, VC, KS, VS, f1, f2, sm_scale, g_exp, soft_cap, window, causal, pos, row_valid, d, dmask,
         BLOCK_N, EVEN_D, PAGE_POW2, PREFETCH_BT, USE_CAP, TOKEN_SCALES, QK_DT, PV_F32, PV_SPLIT,
         DEC_MODE, F_KIND, F_MANT, F_REBIAS, F_DROP, F_FNUZ, F_HASINF, F_MAXMAG, F_BIAS),
    )

    _finish(acc, m_i, l_i, r_i, OUT, q_off, PACC, PM, PL, LSE, VS, split, T, tok, HQ, qh, D, d, qmask, row_valid,
            pr_off, SPLIT, TOKEN_SCALES, WRITE_LSE)


@triton.jit(do_not_specialize=["T", "HQ", "group", "num_splits", "pr_off"])
def _reduce_kernel(
    PACC, PM, PL, VS, OUT, LSE,
    T, HQ, D, group, num_splits, stride_vsh, pr_off,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, TOKEN_SCALES: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Merge the split-KV partials of one (token, query head): ``sum_s w_s acc_s / sum_s w_s l_s``
    with ``w_s = 2^(m_s - max_s m_s)``; the merged pair is ``(max_s m_s, sum_s w_s l_s)``.
    Per-token-head scales: ``acc_s`` is in units of ``r_s`` (at ``PL + pr_off``), so the sum is formed as
    ``A sum_s (w_s r_s / A) acc_s`` with ``A = max_s w_s r_s`` (no overflow).

    Grid ``(T, HQ)``. ``PACC [num_splits, T, HQ, D]``, ``PM [num_splits, T, HQ]``,
    ``PL [(1 or 2) * num_splits, T, HQ]`` float32 (from :func:`_finish`); ``VS`` the static ``v_scale``
    (``[H]`` or ``[]``, head stride ``stride_vsh``); ``OUT [T, HQ, D]``; ``LSE [T, HQ]`` with ``WRITE_LSE``.
    """
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

    An empty step (no sequence, or no key: ``num_seqs * num_kv_heads == 0`` or ``max_keys == 0``)
    plans as one program over one key tile; :func:`paged_attention` launches nothing for it.
    """
    max_keys = max(max_keys, 1)  # (an empty step: no division by zero keys below)
    block_d = max(16, triton.next_power_of_2(head_size))
    gpad = max(16, triton.next_power_of_2(group))
    wide = block_d > 128
    if max_query_len <= 1:
        return _decode_config(device, gpad=gpad, wide=wide, narrow=block_d <= AMD_SMALL_TILE_HEAD_SIZE,
                              num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_keys=max_keys, interpret=interpret,
                              query_dtype=query_dtype, arch=arch)
    # prefill tiles from a tile sweep on the H100 (benchmarks/prefill.py): 64 query rows,
    # 128 keys, 4 warps; smaller for head sizes above 128. Two stages: since the kernel addresses K
    # and V through their own strides, three stages take 147 KB of shared memory, one program per SM
    # (Nsight Compute: 6.25% occupancy), and 4 x 2048 over 2048 ran at 2944 us on the H100; two
    # stages take 112 KB, two programs per SM, 1951 us
    block_m = max(gpad, 64)
    block_n = 64 if wide or query_dtype == torch.float32 else 128
    num_stages = 2
    if query_dtype == torch.float32 and not is_amd(arch):
        # float32 queries: 32 keys, one stage. On the H100 (4 x 1024 new over 1024 cached, D=128;
        # float32 queries): the 64 x 64 two-stage tile was built with
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
    programs = max(1, num_seqs * q_blocks * num_kv_heads)  # (at least one: an empty step)
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
that every SM holds programs). Measured on the H100 (benchmarks/profiles/triton_decode_tune.py,
B=8 L=32768): 16 pieces of 2048 keys ran at 258 us, 9 of 3641 at 302 us, 3 at 313 us."""

DECODE_PROGRAMS_PER_SM = 2
"""Decode programs one H100 SM holds at once with 128-key tiles, 4 warps and two stages (106 KB
of shared memory each: Nsight Compute, benchmarks/profiles/decode_ncu.sh)."""


def _decode_config(device: torch.device, *, gpad: int, wide: bool, narrow: bool, num_seqs: int, num_kv_heads: int,
                   max_keys: int, interpret: bool, query_dtype: torch.dtype, arch: str | None) -> AttnConfig:
    """Launch configuration of the decode kernel (:mod:`fp8kv_triton.decode`).

    Tiles from the H100 tuning (benchmarks/profiles/triton_decode_tune.py; GQA 32/8, D=128, e4m3, bf16
    queries): 128 keys, 4 warps, 2 stages and V decoded in registers (``v_regs``) beat every
    other combination of 32/64/128/256 keys, 2/4/8 warps and 1-4 stages at all four bench
    shapes (e.g. B=32 L=4096: 135 us; 3 stages 173-195 us, 8 warps 225 us, 64-key tiles 143 us;
    without ``v_regs`` 211 us). Head sizes above 128 halve the key tile (registers, shared memory)
    and float32 queries take 32 keys: with 64, Triton 3.6 built the float32 decode kernel with 32
    registers and 896 spills and it ran 8703 us at B=32 L=4096 on the H100 (bf16 queries: 154 us);
    32 keys: 255 registers, 66 spills, 1565 us, the fastest of 32/64 keys x 4/8 warps x 1-3 stages
    tried; GPUs with 99 KB of shared memory (:data:`SMALL_SHARED_ARCHS`) take
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
    programs = max(1, num_seqs * num_kv_heads)  # (at least one: an empty step)
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
    query: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, max_query_len: int, softmax_scale: float, causal: bool,
    sliding_window: int | None, logits_soft_cap: float | None, out: torch.Tensor, *,
    lse: torch.Tensor | None = None, decode_mode: int, interpret: bool, config: AttnConfig | None = None,
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
        config = choose_config(query.device, group=group, head_size=D, num_seqs=S, num_kv_heads=H,
                               max_query_len=max_query_len, max_keys=block_tables.shape[1] * cache.block_size,
                               interpret=interpret, query_dtype=query.dtype)
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
        kernel = _decode_kernel
        extra["V_REGS"] = config.v_regs and not interpret
    else:
        kernel = _attn_kernel
        extra["PREFETCH_BT"] = config.num_stages > 1
    with launching(kernel):
        kernel[grid](
            q_arg, cache.key_cache.view(torch.uint8), cache.value_cache.view(torch.uint8), cache.k_scale, cache.v_scale,
            block_tables, seq_lens, query_start_loc,
            out_arg, pacc, pm, pl, lse_arg,
            sm_mant, sm_exp, float(logits_soft_cap or 1.0), min(int(sliding_window or NO_WINDOW), NO_WINDOW),
            int(causal),
            block_tables.stride(0), *k_strides, *v_strides, *ks_strides, *vs_strides,
            T, HQ, D, group, block_q, q_blocks, config.keys_per_split,
            page, page.bit_length() - 1, cache.key_cache.shape[0], block_tables.shape[1] * page, pr_off,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d, EVEN_D=block_d == D,
            FULL_P_KEYS=FULL_P_KEYS, PAGE_POW2=pow2, USE_CAP=logits_soft_cap is not None, TOKEN_SCALES=token_scales,
            Q_BITS=q_bits, SPLIT=split, WRITE_LSE=lse is not None and not split,
            QK_DT=qk_dt, PV_F32=query.dtype == torch.float32, PV_SPLIT=config.pv_split,
            DEC_MODE=decode_mode, F_KIND=a.fp8_kind, F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias, F_DROP=a.drop_bits,
            F_FNUZ=a.fnuz, F_HASINF=a.has_inf, F_MAXMAG=a.max_mag, F_BIAS=a.bias,
            num_warps=config.num_warps, num_stages=config.num_stages, **extra,
        )
    if split:
        merge_splits(pacc, pm, pl, cache, out_arg, lse, group=group, num_splits=config.num_splits,
                     token_scales=token_scales, reduce_warps=config.reduce_warps)
    if out_arg is not out:
        hi = torch.finfo(out.dtype).max
        out.copy_(out_arg.clamp_(-hi, hi))


def merge_splits(
    pacc: torch.Tensor, pm: torch.Tensor, pl: torch.Tensor, cache: KVCache, out: torch.Tensor,
    lse: torch.Tensor | None, *, group: int, num_splits: int, token_scales: bool = False, reduce_warps: int = 4,
) -> None:
    """Merge split-KV partials into ``out [T, Hq, D]`` (and ``lse [T, Hq]``), times ``v_scale``.

    ``pacc [num_splits, T, Hq, D]`` holds each split's unnormalised sum, ``pm``/``pl``
    ``[num_splits, T, Hq]`` its base-2 row max and sum of ``2^(s - m)`` (float32, contiguous);
    per-token-head scales: ``pl`` is ``[2 * num_splits, T, Hq]``, its second half each row's value
    unit ``r``. Static ``v_scale`` (the cache's, by KV head) multiplies the merged output.
    Nothing is launched for no row (``T * Hq == 0``).
    """
    _, T, HQ, D = pacc.shape
    if T * HQ == 0:
        return
    with launching(_reduce_kernel):
        _reduce_kernel[(T, HQ)](
            pacc, pm, pl, cache.v_scale, out, out if lse is None else lse,
            T, HQ, D, group, num_splits, scale_strides(cache, "value")[2], num_splits * T * HQ,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=max(16, triton.next_power_of_2(D)),
            TOKEN_SCALES=token_scales, WRITE_LSE=lse is not None, num_warps=reduce_warps,
        )
