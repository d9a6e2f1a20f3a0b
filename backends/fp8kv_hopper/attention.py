"""FP8 tensor-core paged attention for Hopper (sm90): ``q @ k^T`` and ``p @ v`` on e4m3 wgmma.

The opt-in FP8 attention mode (``fp8_attention=True``, docs/fp8_attention.md) of an e4m3fn cache
with per-tensor or per-head scales. Per query row (token, head) the kernel computes exactly the
function :func:`fp8kv.reference.paged_attention` defines for the mode, up to the online-softmax
order and the FP8 accumulator (the derived tolerance of the mode covers both):

* the query is quantized once per program, bit for bit as the cache is: ``q8 = e4m3(q / q_scale)``
  (one IEEE division, clamp to +-448, round to nearest even: Triton's native cast, proven
  bit-exact on sm90), with ``q_scale`` per tensor, per KV head, per query head, or dynamic per
  (token, head): ``max(amax|q| / 448, 2^-126)`` as :func:`fp8kv.scales.token_head_scale`;
* ``s = (q8 . k8) * q_scale * k_scale * softmax_scale`` with the FP8 codes fed to the tensor cores
  as they are (no decode: the bytes of an e4m3fn cache are Triton's ``float8e4nv``); the scale
  product is never formed as one float32 (two per-row factors on the same side of 1, see
  :func:`_logit_factors`), soft-cap as in the default mode, base-2 logits saturated;
* online softmax in base 2 against a running maximum rounded up to an integer (every rescaling is
  an exact power of two, so the e4m3 rounding of ``p`` does not depend on the tile order where
  ``p`` is normal); the row sum ``l`` adds the float32 ``p`` (before rounding), and
  ``p / prob_scale`` is rounded to e4m3 (FA3's scheme) for ``p8 @ v8``;
* ``o = acc / l * v_scale * prob_scale``, saturated to the output dtype; split-KV partials go to
  the Triton backend's merge kernel (``acc * prob_scale``, ``m``, ``l``), which applies ``v_scale``.

Grid ``(num_seqs * q_blocks, num_kv_heads, num_splits)``; a program owns one KV head and
``BLOCK_M`` rows = ``BLOCK_M // group`` query tokens times the ``group`` query heads sharing it
(GQA packing), like the Triton backend's kernel. Every bound comes from the tensors (query
offsets clamped to ``[0, T]``, lengths to the block table's width, block ids outside
``[0, num_blocks)`` masked out): memory-safe with host checks off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from fp8kv_triton.kernels import (
    codec_args,
    encode_f32_bits,
    key_range,
    launching,
    lse_from_state,
    merge_splits,
    program_rows,
    query_span,
    saturate,
    saturate_out,
    scale_factors,
    softcap_tanh,
    tile_keys,
)

from fp8kv.errors import InvalidArgument
from fp8kv.formats import FORMATS

from . import wgmma

E4M3_MAX = tl.constexpr(448.0)
MIN_DYNAMIC_SCALE = tl.constexpr(2.0**-126)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30

if TYPE_CHECKING:
    from fp8kv_cuda.kernels import AttnPlan


@triton.jit
def _to_e4m3(x, NATIVE: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
             F_MAXBITS: tl.constexpr, F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr):
    """float32 -> ``tl.float8e4nv``, rounded to nearest even after a clamp to +-448: Triton's cast on
    sm90 (proven bit-exact there), else the integer-bit encoder (the CPU interpreter's cast drops the
    carry when rounding crosses a power of two)."""
    if NATIVE:
        return tl.clamp(x, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
    q = encode_f32_bits(x, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, False)
    return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _mant_exp(f1, f2):
    """``(mant in [1, 2), exp)`` of the positive product ``f1 * f2`` of two normal float32 factors
    (``f2`` a power of two), without forming it."""
    b1 = f1.to(tl.int32, bitcast=True)
    e = ((b1 >> 23) & 0xFF) - 127 + ((f2.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    mant = ((b1 & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return mant, e


@triton.jit
def _logit_factors(qs, k_scale, sm_mant, sm_exp):
    """Per-row float32 factors ``(f1, f2)``, ``f1 * f2 = qs * k_scale * sm_mant * 2^sm_exp``, on the
    same side of 1: ``(dot * f1) * f2`` overflows only if the logit does (``qs [M]``, ``k_scale`` a
    positive scalar of any magnitude, ``sm_mant`` in [1, 2))."""
    kf1, kf2 = scale_factors(k_scale, sm_mant, sm_exp)  # k_scale * softmax part, as a split product
    km, ke = _mant_exp(kf1, kf2)  # km in [1, 2): one rounding of k_scale's mantissa times sm_mant
    return scale_factors(qs, km, ke)


@triton.jit
def _quantize_query(Q, QS, q_off, qmask, kvh, qh, stride_qs_kv, stride_qs_q, Q_DYNAMIC: tl.constexpr,
                    NATIVE: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
                    F_MAXBITS: tl.constexpr, F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr):
    """The query rows as e4m3 ``[M, D]`` and their scales ``[M]`` (dynamic: per row)."""
    q = tl.load(Q + q_off, mask=qmask, other=0.0).to(tl.float32)
    if Q_DYNAMIC:
        a = tl.where(q != q, 0.0, tl.minimum(tl.abs(q), FLOAT32_MAX))  # NaN as 0, inf as the max
        qs = tl.maximum(tl.math.div_rn(tl.max(a, axis=1), tl.full([1], E4M3_MAX, tl.float32)), MIN_DYNAMIC_SCALE)
    else:
        qs = tl.load(QS + kvh * stride_qs_kv + qh * stride_qs_q)
    x = tl.math.div_rn(q, qs[:, None] + tl.zeros_like(q))
    return _to_e4m3(x, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE), qs


@triton.jit
def _attend_tiles(
    q8, m_i, l_i, acc, f1, f2, soft_cap, inv_prob_scale, lo, hi, bt_row, page, page_shift,
    num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, KC, VC, window, causal, pos, row_valid, d,
    BLOCK_N: tl.constexpr, PAGE_POW2: tl.constexpr, USE_CAP: tl.constexpr, FAST: tl.constexpr, MASK: tl.constexpr,
    V_MODE: tl.constexpr, NATIVE: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
    F_MAXBITS: tl.constexpr, F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr, SCALE_P: tl.constexpr,
):
    """The online softmax over the key tiles ``[lo, hi)`` of one program (state in and out).

    ``FAST``: ``f1`` is the whole per-row logit factor (``< 2^96``: no logit can overflow), applied
    inside the ``exp2`` argument (one FFMA per element) and to the raw row max; otherwise logits are
    ``(dot * f1) * f2``, soft-capped if asked, and saturated, as in the Triton backend's kernel.
    ``MASK``: apply the causal, window and bounds masks (edge tiles); without it every key of
    ``[lo, hi)`` is visible to every row (interior tiles), and a key whose block id is outside the
    cache is still never loaded (it reads as code 0; host checks reject such a table).
    """
    offs_n = tl.arange(0, BLOCK_N)
    # the first tile's block ids and offsets; in the loop, the next tile's are gathered while this
    # one is computed (its K/V addresses then never wait on a block-table load of the same iteration)
    nn, nkmask, _, _, nk_off, nv_off, _ = tile_keys(
        lo, offs_n, hi, bt_row, page, page_shift, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, PAGE_POW2)
    for start in range(lo, hi, BLOCK_N):
        n, kmask, k_off, v_off = nn, nkmask, nk_off, nv_off
        nn, nkmask, _, _, nk_off, nv_off, _ = tile_keys(
            start + BLOCK_N, offs_n, hi, bt_row, page, page_shift, num_blocks, stride_kb, stride_kt, stride_vb,
            stride_vt, PAGE_POW2)
        kt = tl.load(KC + k_off[None, :] + d[:, None], mask=kmask[None, :], other=0)  # [D, N] codes
        s = tl.dot(q8, kt.to(tl.float8e4nv, bitcast=True))  # FP8 wgmma, float32 accumulator
        if not FAST:
            s = (s * f1[:, None]) * f2[:, None]
            if USE_CAP:
                s = soft_cap * softcap_tanh(s / soft_cap) * 1.4426950408889634
            s = saturate(s, 3.4028234663852886e38)
        if MASK:
            visible = kmask[None, :] & row_valid[:, None] & (n[None, :] > pos[:, None] - window)
            visible = visible & ((n[None, :] <= pos[:, None]) | (causal == 0))
            s = tl.where(visible, s, float("-inf"))
        if FAST:
            m_new = tl.maximum(m_i, tl.ceil(tl.max(s, axis=1) * f1))  # an integer: see fp8kv.fp8_attention
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s * f1[:, None] - m_safe[:, None])
        else:
            m_new = tl.maximum(m_i, tl.ceil(tl.max(s, axis=1)))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCALE_P:  # FA3: P rounded to e4m3 (p <= 1: no clamp needed without a prob_scale)
            p8 = _to_e4m3(p * inv_prob_scale, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE)
        elif NATIVE:
            p8 = p.to(tl.float8e4nv)
        else:
            p8 = _to_e4m3(p, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE)
        vc = tl.load(VC + v_off[:, None] + d[None, :], mask=kmask[:, None], other=0)  # [N, D] codes
        if V_MODE == 0:  # e4m3 x e4m3 wgmma: Triton transposes the V codes through shared memory
            acc = tl.dot(p8, vc.to(tl.float8e4nv, bitcast=True), acc * alpha[:, None])
        else:  # the same products in float16 (every e4m3 value is exact there; MN-major B is native)
            v16 = vc.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            acc = tl.dot(p8.to(tl.float16), v16, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc



@triton.jit(do_not_specialize=["sm_mant", "sm_exp", "prob_scale", "inv_prob_scale", "soft_cap", "window", "T",
                               "num_blocks", "max_keys", "HQ", "group", "block_q", "max_q_blocks", "keys_per_split",
                               "page"])
def fp8_attention_kernel(
    Q, QS, KC, VC, KS, VS, BT, SEQ_LENS, QSL, OUT, PACC, PM, PL, LSE,
    sm_mant, sm_exp, prob_scale, inv_prob_scale, soft_cap, window, causal,
    stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_qs_kv, stride_qs_q, stride_ksh, stride_vsh,
    T, HQ, group, block_q, max_q_blocks, keys_per_split, page, page_shift, num_blocks, max_keys,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_POW2: tl.constexpr,
    USE_CAP: tl.constexpr, Q_DYNAMIC: tl.constexpr, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr,
    V_MODE: tl.constexpr, NATIVE: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr,
    F_DROP: tl.constexpr, F_MAXBITS: tl.constexpr, F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr,
    SCALE_P: tl.constexpr,
):
    """One (query block, KV head, KV split); see the module docstring. ``D`` is the head size (a
    power of two, 32..256), strides are in elements, ``sm_mant * 2^sm_exp`` is ``softmax_scale``
    (times ``log2 e`` unless soft-capped), ``QS``/``KS``/``VS`` the q/k/v scales with head strides
    (0: per tensor)."""
    pid_q = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid_q // max_q_blocks
    qb = pid_q % max_q_blocks
    q_start, q_len = query_span(QSL, seq, T)
    if qb * block_q >= q_len:
        return
    seq_len, row_valid, tok, qh, pos = program_rows(SEQ_LENS, seq, qb, q_start, q_len, max_keys, block_q, group, kvh,
                                                    BLOCK_M)
    d = tl.arange(0, D)
    q_off = (tok * HQ + qh)[:, None] * D + d[None, :]
    qmask = row_valid[:, None]
    q8, qs = _quantize_query(Q, QS, q_off, qmask, kvh, qh, stride_qs_kv, stride_qs_q, Q_DYNAMIC, NATIVE, F_MANT,
                             F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE)

    lo, hi, all_lo, all_hi, _, _ = key_range(seq_len, q_len, qb, block_q, window, causal, split, keys_per_split,
                                             SPLIT, BLOCK_N)

    kvh64 = kvh.to(tl.int64)
    KC = KC + kvh64 * stride_kh
    VC = VC + kvh64 * stride_vh
    f1, f2 = _logit_factors(qs, tl.load(KS + kvh * stride_ksh), sm_mant, sm_exp)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = BT + seq.to(tl.int64) * stride_bt
    # fast path: one float32 factor per row that cannot overflow a logit (|q8 . k8| <= 448^2 D < 2^26),
    # folded into the exp2 argument; else (huge or tiny scales) the two-factor, saturating path
    f = f1 * f2
    f_rows = tl.where(row_valid, f, 1.0)
    fast = (tl.max(f_rows, axis=0) < 2.0**96) & (tl.min(f_rows, axis=0) > 2.0**-96)
    if fast and not USE_CAP:
        # interior tiles, visible to every row, need no mask: [in_lo, in_hi); the edges are masked
        in_lo = tl.minimum(tl.maximum(lo, tl.cdiv(all_lo, BLOCK_N) * BLOCK_N), hi)
        in_hi = tl.maximum(in_lo + (tl.minimum(all_hi, hi) - in_lo) // BLOCK_N * BLOCK_N, in_lo)
        m_i, l_i, acc = _attend_tiles(
            q8, m_i, l_i, acc, f, f2, soft_cap, inv_prob_scale, lo, in_lo, bt_row, page, page_shift,
            num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, KC, VC, window, causal, pos, row_valid, d,
            BLOCK_N, PAGE_POW2, False, True, True, V_MODE, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS,
            F_MAXSHIFT, F_NANBYTE, SCALE_P)
        m_i, l_i, acc = _attend_tiles(
            q8, m_i, l_i, acc, f, f2, soft_cap, inv_prob_scale, in_lo, in_hi, bt_row, page, page_shift,
            num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, KC, VC, window, causal, pos, row_valid, d,
            BLOCK_N, PAGE_POW2, False, True, False, V_MODE, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS,
            F_MAXSHIFT, F_NANBYTE, SCALE_P)
        m_i, l_i, acc = _attend_tiles(
            q8, m_i, l_i, acc, f, f2, soft_cap, inv_prob_scale, in_hi, hi, bt_row, page, page_shift,
            num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, KC, VC, window, causal, pos, row_valid, d,
            BLOCK_N, PAGE_POW2, False, True, True, V_MODE, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS,
            F_MAXSHIFT, F_NANBYTE, SCALE_P)
    else:
        m_i, l_i, acc = _attend_tiles(
            q8, m_i, l_i, acc, f1, f2, soft_cap, inv_prob_scale, lo, hi, bt_row, page, page_shift,
            num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, KC, VC, window, causal, pos, row_valid, d,
            BLOCK_N, PAGE_POW2, USE_CAP, False, True, V_MODE, NATIVE, F_MANT, F_REBIAS, F_DROP, F_MAXBITS,
            F_MAXSHIFT, F_NANBYTE, SCALE_P)

    if SPLIT:
        part = (split * T + tok) * HQ + qh
        tl.store(PACC + part[:, None] * D + d[None, :], acc * prob_scale, mask=qmask)
        tl.store(PM + part, m_i, mask=row_valid)
        tl.store(PL + part, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.math.div_rn(acc, l_safe[:, None] + tl.zeros_like(acc))
        o = (o * tl.load(VS + kvh * stride_vsh)) * prob_scale
        o = saturate_out(o, OUT.dtype.element_ty)
        tl.store(OUT + q_off, o.to(OUT.dtype.element_ty), mask=qmask)
        if WRITE_LSE:
            tl.store(LSE + tok * HQ + qh, lse_from_state(m_i, l_i), mask=row_valid)


@dataclass(frozen=True)
class Fp8AttnConfig:
    """Launch parameters of one call (chosen by :func:`choose_config`; benchmarks override)."""

    block_m: int
    block_n: int
    num_splits: int
    keys_per_split: int
    num_warps: int
    num_stages: int
    v_mode: int = 2
    """``p @ v`` operands: 0 = e4m3 codes (FP8 wgmma), 2 = P8 and V widened exactly to float16."""
    kernel: str = "auto"
    """``"wgmma"``: the warp-specialized CUDA kernel of :mod:`fp8kv_hopper.wgmma` (prefill on sm90;
    InvalidArgument where it does not serve); ``"cuda"``: the CUDA backend's tensor-core decode built
    for the mode (:class:`fp8kv_cuda.kernels.Fp8Attention`; decode steps; InvalidArgument where
    :func:`fp8kv_cuda.kernels.fp8_decode_why_not` finds a reason); ``"triton"``: this module's
    kernel; ``"auto"`` (the default): the CUDA kernel of the step's kind (prefill: ``"wgmma"``,
    decode: ``"cuda"``) where it serves (host facts only), else Triton."""
    wgmma_pingpong: bool = False
    """``"wgmma"`` only: the two consumer warpgroups take turns issuing their products (FA3's schedule). Off
    by default: with the conditional rescaling the softmax is short enough that taking turns gains nothing
    (on the H100 it was slower or equal at 4 x 2048 over 2048 and at 1 x 16384 causal)."""
    wgmma_ctas: int = 0
    """``"wgmma"`` only: 0 launches a CTA per work item (query block, KV head); ``n > 0`` a persistent grid of
    at most ``n`` CTAs (one per SM: :func:`choose_config` gives the SM count), each taking items in turn, its
    producer loading the next item's tiles while the consumers finish the last."""


def choose_config(*, group: int, num_seqs: int, num_kv_heads: int, max_query_len: int, max_keys: int,
                  num_sms: int, interpret: bool = False) -> Fp8AttnConfig:
    """Tiles from host-known sizes (no sync).

    Prefill, from a tile sweep on the H100 (4 x 2048 over 2048,
    GQA 32/8, D=128): 128 rows x 128 keys, 8 warps (two warpgroups of wgmma), 3 stages, ``v_mode=2``
    (P and V widened exactly to float16 for ``p @ v``: 1410-1486 us against 2112-2221 us for the
    e4m3 ``p @ v``, whose V operand Triton transposes through shared memory byte by byte, and
    1607-3760 us for the other tiles). Decode (one query token): ``max(16, group)`` rows and split-KV
    so that every SM holds two programs, pieces of at most 2048 keys.

    An empty step (no sequence, or no key) plans as one program over one key tile; :func:`paged_attention_fp8`
    launches nothing for it.
    """
    max_keys = max(max_keys, 1)  # (an empty step: no division by zero keys below)
    if max_query_len > 1:  # (a GQA group of more than 128 query heads takes a block of its own size)
        block_m, block_n, warps, stages = max(128, triton.next_power_of_2(group)), 128, 8, 3
    else:
        block_m, block_n, warps, stages = max(16, triton.next_power_of_2(group)), 128, 4, 2
    if interpret:  # Triton's CPU interpreter: small tiles
        block_m, block_n, stages = max(16, triton.next_power_of_2(group)), 32, 1
    block_q = max(1, block_m // group)
    programs = max(1, num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads)  # (empty step: 1)
    num_splits = 1
    if max_query_len <= 1:
        num_splits = max(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_keys, 2048))
        num_splits = max(1, min(num_splits, triton.cdiv(max_keys, block_n), 256))
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_keys, keys_per_split)
    return Fp8AttnConfig(block_m, block_n, num_splits, keys_per_split, warps, stages, v_mode=2,
                         wgmma_ctas=num_sms if max_query_len > 1 else 0)


def query_scale_strides(q_scale: torch.Tensor | None, num_kv_heads: int, num_q_heads: int) -> tuple[int, int]:
    """``(per KV head, per query head)`` element strides of ``q_scale`` (``[]``, ``[H_kv]`` or ``[H_q]``)."""
    if q_scale is None or q_scale.dim() == 0 or q_scale.numel() == 1:
        return 0, 0
    if q_scale.numel() == num_kv_heads and num_kv_heads != num_q_heads:
        return q_scale.stride(0), 0
    return 0, q_scale.stride(0)


def paged_attention_fp8(
    query: torch.Tensor,
    cache,
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
    q_scale: torch.Tensor | None,
    prob_scale: float,
    lse: torch.Tensor | None = None,
    config: Fp8AttnConfig | None = None,
    interpret: bool = False,
    decode_plan: AttnPlan | None = None,
    schedule: torch.Tensor | None = None,
) -> None:
    """FP8-mode paged attention of ``query [T, Hq, D]`` (float16/bfloat16/float32) over an e4m3fn
    ``cache`` with per-tensor or per-head scales, into ``out [T, Hq, D]`` (and ``lse [T, Hq]``).

    ``q_scale``: float32 ``[]``, ``[H_kv]`` or ``[Hq]``, or None for the dynamic per-(token, head)
    scale; ``prob_scale`` a finite positive float. ``interpret``: Triton's CPU interpreter (FP8 roundings
    through the integer-bit encoder). ``decode_plan``: fp8kv_cuda's ``plan_mma`` plan for a decode step
    (made once per step by the plugin's ``fp8kv_plan_attention``; None: planned here). ``schedule``: the
    persistent wgmma kernel's item lists (:func:`fp8kv_hopper.schedule.for_step`, made by the plan from
    host lengths; None: its snake deal). Other arguments as the Triton backend's launcher.
    """
    from fp8kv_triton.kernels import cache_strides, scale_strides

    T, HQ, D = query.shape
    H = cache.num_kv_heads
    group = HQ // H
    S = seq_lens.shape[0]
    max_query_len = min(max(int(max_query_len), 1), max(T, 1))
    if T == 0 or S == 0:
        return
    if config is None:
        config = choose_config(group=group, num_seqs=S, num_kv_heads=H, max_query_len=max_query_len,
                               max_keys=block_tables.shape[1] * cache.block_size,
                               num_sms=torch.cuda.get_device_properties(query.device).multi_processor_count)
    block_q = max(1, config.block_m // group)
    q_blocks = triton.cdiv(max_query_len, block_q)
    sm_mant, sm_exp = _mantissa_exponent(float(softmax_scale) * (1.0 if logits_soft_cap is not None else LOG2E))
    qs_kv, qs_q = query_scale_strides(q_scale, H, HQ)
    if config.kernel not in ("auto", "triton", "wgmma", "cuda"):
        raise InvalidArgument(f"config.kernel: got {config.kernel!r}, expected 'auto', 'triton', 'wgmma' or 'cuda'")
    if config.kernel in ("auto", "cuda") and (config.kernel == "cuda" or max_query_len <= 1):
        from fp8kv_cuda import kernels as cuda_kernels

        why = "Triton's CPU interpreter" if interpret else cuda_kernels.fp8_decode_why_not(
            query, cache, out, lse, max_query_len, block_tables, seq_lens, query_start_loc, q_scale)
        if why and config.kernel == "cuda":
            raise InvalidArgument(f"config.kernel: 'cuda' does not serve this call ({why})")
        if why is None:
            cuda_kernels.paged_attention(
                query, cache, block_tables, seq_lens, query_start_loc, softmax_scale, causal, sliding_window,
                logits_soft_cap, out, lse, plan_=decode_plan,
                fp8_attention=cuda_kernels.Fp8Attention(q_scale, (qs_kv, qs_q), float(prob_scale)))
            return
    use_wgmma = False
    if config.kernel != "triton":
        scales = (cache.k_scale, cache.v_scale) + (() if q_scale is None else (q_scale,))
        why = "Triton's CPU interpreter" if interpret else wgmma.why_not(
            query, out, max_query_len, logits_soft_cap, config.num_splits, lse,
            (block_tables, seq_lens, query_start_loc), scales, group)
        if why and config.kernel == "wgmma":
            raise InvalidArgument(f"config.kernel: 'wgmma' does not serve this call ({why})")
        use_wgmma = why is None
    if use_wgmma:
        wgmma.launch(query, cache, block_tables, seq_lens, query_start_loc, max_query_len, sm_mant, sm_exp, causal,
                     min(int(sliding_window or NO_WINDOW), NO_WINDOW), out, lse, q_scale, (qs_kv, qs_q),
                     float(prob_scale), pingpong=config.wgmma_pingpong, ctas=config.wgmma_ctas, schedule=schedule)
        return
    k_strides, v_strides = cache_strides(cache, "key"), cache_strides(cache, "value")
    split = config.num_splits > 1
    if split:
        pacc = torch.empty((config.num_splits, T, HQ, D), dtype=torch.float32, device=query.device)
        pm = torch.empty((config.num_splits, T, HQ), dtype=torch.float32, device=query.device)
        pl = torch.empty((config.num_splits, T, HQ), dtype=torch.float32, device=query.device)
    else:
        pacc = pm = pl = out
    e4 = codec_args(FORMATS["fp8_e4m3"])
    q_arg, out_arg = query, out
    if interpret:  # Triton's interpreter mishandles bfloat16 loads and stores: float32 copies
        q_arg = query.float()
        out_arg = out if out.dtype == torch.float32 else torch.empty_like(q_arg)
    qs_arg = cache.k_scale if q_scale is None else q_scale  # unused when dynamic
    page = cache.block_size
    with launching(fp8_attention_kernel):
        fp8_attention_kernel[(S * q_blocks, H, config.num_splits)](
            q_arg, qs_arg, cache.key_cache.view(torch.uint8), cache.value_cache.view(torch.uint8),
            cache.k_scale, cache.v_scale, block_tables, seq_lens, query_start_loc, out_arg, pacc, pm, pl,
            out_arg if lse is None else lse,
            sm_mant, sm_exp, float(prob_scale), 1.0 / float(prob_scale), float(logits_soft_cap or 1.0),
            min(int(sliding_window or NO_WINDOW), NO_WINDOW), int(causal),
            block_tables.stride(0), *k_strides, *v_strides, qs_kv, qs_q,
            scale_strides(cache, "key")[2], scale_strides(cache, "value")[2],
            T, HQ, group, block_q, q_blocks, config.keys_per_split, page, page.bit_length() - 1,
            cache.key_cache.shape[0], block_tables.shape[1] * page,
            D=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAGE_POW2=page & (page - 1) == 0,
            USE_CAP=logits_soft_cap is not None, Q_DYNAMIC=q_scale is None, SPLIT=split,
            WRITE_LSE=lse is not None and not split, V_MODE=config.v_mode, NATIVE=not interpret,
            F_MANT=e4.mant_bits, F_REBIAS=e4.exp_rebias, F_DROP=e4.drop_bits, F_MAXBITS=e4.max_f32_bits,
            F_MAXSHIFT=e4.max_shift, F_NANBYTE=e4.nan_byte, SCALE_P=float(prob_scale) != 1.0,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if split:
        merge_splits(pacc, pm, pl, cache, out_arg, lse, group=group, num_splits=config.num_splits)
    if out_arg is not out:
        hi = torch.finfo(out.dtype).max
        out.copy_(out_arg.clamp_(-hi, hi))


def _mantissa_exponent(x: float) -> tuple[float, int]:
    """``x = mant * 2^exp`` with ``mant`` in [1, 2) (``x`` positive, finite)."""
    import math

    m, e = math.frexp(x)
    return 2.0 * m, e - 1


__all__ = ["Fp8AttnConfig", "choose_config", "fp8_attention_kernel", "paged_attention_fp8"]
