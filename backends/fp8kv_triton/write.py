"""The fused cache write: quantize ``key``/``value`` and scatter them into the paged cache.

One kernel launch writes K and V. Program ``i`` takes ``BLOCK_R`` consecutive rows of the
flattened ``[num_tokens * H, D]`` input (row ``r`` is token ``r // H``, head ``r % H``), so
its loads are contiguous, and stores each row's ``D`` bytes at its slot:

* ``slot = slot_mapping[token]``; a slot is written only if ``0 <= slot < num_slots``
  (``num_blocks * block_size``, compared in int64 so ``2^40`` is refused too): negative
  slots (padding) and out-of-range slots are masked out entirely, so nothing outside the
  cache is ever touched, whether or not the host checked the values (``FP8KV_CHECK=shapes``,
  ``validate=False``, a CUDA graph replayed with new slots). An out-of-range slot is not
  written; it behaves like padding;
* K and V each have their own (block, token-in-block, head) strides (:func:`cache_strides`):
  NHD ``[num_blocks, block_size, H, D]`` and HND ``[num_blocks, H, block_size, D]`` differ only
  in them, and so do views (``t[:, 0]`` / ``t[:, 1]`` of one ``[num_blocks, 2, ...]``
  allocation, head slices, padded rows); only the head_size dimension must have stride 1;
* ``token_head``: ``scale = max(amax(|x|) / fmt.max, 2^-126)`` per row (NaN ignored, inf
  as the float32 max), one correctly rounded division, stored at ``k_scale[block, offset, h]``
  through that tensor's own strides (:func:`scale_strides`);
* ``x / scale`` is a correctly rounded division (Triton's ``/`` is an approximate division on
  NVIDIA GPUs), NaN inputs kept with their sign (as :func:`fp8kv.formats.divide_by_scale`), then
  the encoder of the codec policy. Rows of finite values whose scale lies in ``[2^-80, 2^125]``
  (nearly all) divide with one multiplication by ``RN(1 / scale)`` and two FMAs
  (:func:`_divide_fast`); the others are loaded again and divided by ``tl.math.div_rn``
  (:func:`_slow_pass`). Same bits; ``tests/write_checks.py`` puts every finite 16-bit pattern
  through both.

Offsets are computed in int64 (block ids and strides of large caches overflow int32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kv.cache import KVCache
from fp8kv.probe import triton_interpreter

from .capabilities import codec_for, device_arch
from .codec import ENC_NATIVE, codec_args, encode_f32_bits, encode_native, encode_native_finite
from .serial import launching


@triton.jit
def _load_rows(src_ptr, rows, m2, d, D, SRC_KIND: tl.constexpr):
    """``BLOCK_R`` rows of one input tensor: ``(x, sbits)``, ``x`` as float32 and ``sbits`` int32
    whose bit 31 is each element's sign (NaN included).

    16-bit inputs arrive as int16 bits: bfloat16 is widened by a shift (Triton's CPU interpreter
    converts bfloat16 subnormals wrongly), and the sign of a float16 NaN is read from the bits
    (a GPU float16 -> float32 conversion returns the positive NaN).
    """
    if SRC_KIND == 0:  # float32
        x = tl.load(src_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0)
        sbits = x.to(tl.int32, bitcast=True)
    else:
        raw = tl.load(src_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0).to(tl.int32) << 16
        if SRC_KIND == 2:
            x = raw.to(tl.float32, bitcast=True)
        else:
            x = (raw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sbits = raw
    return x, sbits


@triton.jit
def _abs_max_bits(x):
    """Each row's largest ``|x|`` as float32 bits (int32): exact for rows of finite values (their
    magnitudes order as their bits); ``>= 0x7F800000`` where the row holds NaN or inf."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _dynamic_scale(amax, F_MAX: tl.constexpr):
    """``token_head``: ``max(amax / fmt.max, 2^-126)``, one correctly rounded division per row."""
    return tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + F_MAX), 1.1754943508222875e-38)


@triton.jit
def _fast_rows(x, valid, scale_ptr, blk, off, h, sc_b, sc_t, sc_h, TOKEN_SCALES: tl.constexpr,
               F_MAX: tl.constexpr):
    """Each row's scale, its reciprocal ``RN(1 / scale)``, and whether the row takes the fast
    division (:func:`_divide_fast`); ``token_head`` scales of those rows are stored.

    The fast division is exact when the row's values are finite, its quotients stay below
    ``2^126`` and the scale lies in ``[2^-80, 2^125]`` (or the row is all zeros): the reciprocal
    is then a normal number, and every quotient whose FP8 code depends on its last bits
    (``|q| >= 2^-20``; smaller ones encode as zero) has an exact residual. Rows not written
    count as fast (nothing of theirs is stored).
    """
    amax_bits = _abs_max_bits(x)
    amax = amax_bits.to(tl.float32, bitcast=True)
    if TOKEN_SCALES:
        scale = _dynamic_scale(amax, F_MAX)
    else:
        scale = tl.load(scale_ptr + h * sc_h, mask=valid, other=1.0)  # stride 0: per-tensor
    recip = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    fast = ((amax_bits < 0x7F800000) & ((scale >= 2.0**-80) | (amax_bits == 0)) & (scale <= 2.0**125)
            & (amax * recip < 2.0**126)) | (valid == 0)
    if TOKEN_SCALES:
        tl.store(scale_ptr + blk * sc_b + off * sc_t + h * sc_h, scale, mask=valid & fast)
    return scale, recip, fast


@triton.jit
def _divide_fast(x, scale, recip):
    """``x / scale`` correctly rounded, for the rows :func:`_fast_rows` clears, in one
    multiplication and two FMAs (Markstein: with ``y = recip = RN(1 / scale)``, ``q = RN(x y)`` is
    within an ulp of the quotient, the residual ``q scale - x`` is exact, and ``RN(q - residual y)``
    is the correctly rounded quotient). The residual ``q scale - x`` is multiplied by ``-y``, never
    negated itself: Triton may negate as ``0 - r``, which turns ``-0`` into ``+0``, and ``x = -0``
    (residual ``+0``) must give ``-0``."""
    y = recip[:, None] + tl.zeros_like(x)
    s = scale[:, None] + tl.zeros_like(x)
    q = x * y
    r = tl.fma(q, s, -x)
    return tl.fma(r, -y, q)


@triton.jit
def _quantize_exact(x, sbits, valid, scale_ptr, blk, off, h, sc_b, sc_t, sc_h,
                    TOKEN_SCALES: tl.constexpr, ENC: tl.constexpr, F_MANT: tl.constexpr,
                    F_REBIAS: tl.constexpr, F_DROP: tl.constexpr, F_MAXBITS: tl.constexpr,
                    F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr, F_FNUZ: tl.constexpr,
                    F_KIND: tl.constexpr, F_MAX: tl.constexpr):
    """FP8 codes of any rows: NaN/inf inputs, any scale (``token_head``: NaN counted as 0 and inf
    as the float32 max in the row's maximum; the scale is stored), ``tl.math.div_rn``, and NaN
    kept with its sign (read from ``sbits``)."""
    if TOKEN_SCALES:
        a = tl.abs(x)
        a = tl.where(a != a, 0.0, a)  # NaN counts as 0
        a = tl.minimum(a, 3.4028234663852886e38)  # inf counts as the float32 max
        scale = _dynamic_scale(tl.max(a, axis=1), F_MAX)
        tl.store(scale_ptr + blk * sc_b + off * sc_t + h * sc_h, scale, mask=valid)
    else:
        scale = tl.load(scale_ptr + h * sc_h, mask=valid, other=1.0)
    y = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
    if ENC == 1:
        q = encode_native(y, F_KIND, F_MAX, F_NANBYTE)
    else:
        q = encode_f32_bits(y, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ)
    if not F_FNUZ:
        # NaN keeps the sign of the input (a GPU division returns the positive canonical NaN,
        # and a float select on it may be folded away by the compiler: patch the integer code)
        q = tl.where(x != x, (((sbits >> 31) & 1) << 7) | F_NANBYTE, q)
    return q


@triton.jit
def _fast_pass(x, dst, valid, dmask, scale_ptr, blk, off, h, sc_b, sc_t, sc_h, TOKEN_SCALES: tl.constexpr,
               ENC: tl.constexpr, F_MANT: tl.constexpr, F_REBIAS: tl.constexpr, F_DROP: tl.constexpr,
               F_MAXBITS: tl.constexpr, F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr, F_FNUZ: tl.constexpr,
               F_KIND: tl.constexpr, F_MAX: tl.constexpr):
    """Store the codes of the rows of ``x`` (one tensor, K or V) that take the fast division
    (:func:`_fast_rows`) at ``dst`` (``[BLOCK_R, BLOCK_D]`` pointers); returns the written rows that
    do not (``[BLOCK_R]`` bool), for :func:`_slow_pass`."""
    scale, recip, fast = _fast_rows(x, valid, scale_ptr, blk, off, h, sc_b, sc_t, sc_h, TOKEN_SCALES, F_MAX)
    y = _divide_fast(x, scale, recip)
    if ENC == 1:
        q = encode_native_finite(y, F_KIND, F_MAX)
    else:
        q = encode_f32_bits(y, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ)
    tl.store(dst, q.to(tl.uint8), mask=(valid & fast)[:, None] & dmask[None, :])
    return valid & (fast == 0)


@triton.jit
def _slow_pass(slow, src_ptr, dst, rows, d, dmask, D, scale_ptr, blk, off, h, sc_b, sc_t, sc_h,
               SRC_KIND: tl.constexpr, TOKEN_SCALES: tl.constexpr, ENC: tl.constexpr, F_MANT: tl.constexpr,
               F_REBIAS: tl.constexpr, F_DROP: tl.constexpr, F_MAXBITS: tl.constexpr,
               F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr, F_FNUZ: tl.constexpr,
               F_KIND: tl.constexpr, F_MAX: tl.constexpr):
    """The ``slow`` rows of one tensor, loaded again and quantized exactly (:func:`_quantize_exact`),
    only where the program holds one (a branch uniform over the program: rows with NaN or inf, or
    a scale outside the fast division's range). Loading them again, rather than keeping the tile,
    keeps this rare pass's registers off the fast one's (one kernel holding both tiles live across
    the branch took 213 registers on sm90)."""
    if tl.max(slow.to(tl.int32), axis=0) != 0:
        m2 = slow[:, None] & dmask[None, :]
        x, sbits = _load_rows(src_ptr, rows, m2, d, D, SRC_KIND)
        q = _quantize_exact(x, sbits, slow, scale_ptr, blk, off, h, sc_b, sc_t, sc_h, TOKEN_SCALES, ENC, F_MANT,
                            F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ, F_KIND, F_MAX)
        tl.store(dst, q.to(tl.uint8), mask=m2)


@triton.jit(do_not_specialize=["num_rows", "H", "page", "num_slots"])
def _write_kv_kernel(key_ptr, value_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                     num_rows, H, D, num_slots,
                     k_sb, k_st, k_sh, v_sb, v_st, v_sh,
                     ks_sb, ks_st, ks_sh, vs_sb, vs_st, vs_sh,
                     page, page_shift,
                     PAGE_POW2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     SRC_KIND: tl.constexpr, TOKEN_SCALES: tl.constexpr, ENC: tl.constexpr,
                     F_MANT: tl.constexpr,
                     F_REBIAS: tl.constexpr, F_DROP: tl.constexpr, F_MAXBITS: tl.constexpr,
                     F_MAXSHIFT: tl.constexpr, F_NANBYTE: tl.constexpr, F_FNUZ: tl.constexpr,
                     F_KIND: tl.constexpr, F_MAX: tl.constexpr):
    """``BLOCK_R`` rows of ``key``/``value`` (flattened ``[T * H, D]``) into both caches.

    ``k_s*`` / ``v_s*``: (block, token, head) strides of the K / V cache; ``ks_s*`` / ``vs_s*``:
    those of the K / V scale tensors (see :func:`scale_strides`). A row is written only if its
    slot is in ``[0, num_slots)`` (int64 compare). K and V are both loaded before any store (the
    compiler may not move a load above a store that could alias it), then each takes the fast
    pass, then, where needed, the exact one.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < num_rows
    t = rows // H
    h = rows % H
    slot = tl.load(slot_ptr + t, mask=rmask, other=-1).to(tl.int64)
    valid = rmask & (slot >= 0) & (slot < num_slots)  # padding and out-of-range slots: not written
    if PAGE_POW2:
        blk = slot >> page_shift
        off = slot & (page - 1)
    else:
        blk = slot // page
        off = slot % page
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    m2 = valid[:, None] & dmask[None, :]
    kdst = kc_ptr + (blk * k_sb + off * k_st + h * k_sh)[:, None] + d[None, :]
    vdst = vc_ptr + (blk * v_sb + off * v_st + h * v_sh)[:, None] + d[None, :]
    xk, _ = _load_rows(key_ptr, rows, m2, d, D, SRC_KIND)
    xv, _ = _load_rows(value_ptr, rows, m2, d, D, SRC_KIND)
    k_slow = _fast_pass(xk, kdst, valid, dmask, ks_ptr, blk, off, h, ks_sb, ks_st, ks_sh, TOKEN_SCALES, ENC, F_MANT,
                        F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ, F_KIND, F_MAX)
    v_slow = _fast_pass(xv, vdst, valid, dmask, vs_ptr, blk, off, h, vs_sb, vs_st, vs_sh, TOKEN_SCALES, ENC, F_MANT,
                        F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ, F_KIND, F_MAX)
    _slow_pass(k_slow, key_ptr, kdst, rows, d, dmask, D, ks_ptr, blk, off, h, ks_sb, ks_st, ks_sh, SRC_KIND,
               TOKEN_SCALES, ENC, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ, F_KIND, F_MAX)
    _slow_pass(v_slow, value_ptr, vdst, rows, d, dmask, D, vs_ptr, blk, off, h, vs_sb, vs_st, vs_sh, SRC_KIND,
               TOKEN_SCALES, ENC, F_MANT, F_REBIAS, F_DROP, F_MAXBITS, F_MAXSHIFT, F_NANBYTE, F_FNUZ, F_KIND, F_MAX)


def cache_strides(cache: KVCache, which: str = "key") -> tuple[int, int, int]:
    """(block, token-in-block, head) strides of ``cache.key_cache`` (``which="key"``) or
    ``cache.value_cache`` (``"value"``), in elements (= bytes).

    NHD is ``[num_blocks, block_size, H, D]``, HND ``[num_blocks, H, block_size, D]``; the two
    tensors may be arbitrary views with different strides, but head_size must have stride 1.
    """
    if which not in ("key", "value"):
        raise ValueError(f"which: got {which!r}, expected 'key' or 'value'")
    t = cache.key_cache if which == "key" else cache.value_cache
    s = t.stride()
    if t.dim() != 4 or (t.shape[3] > 1 and s[3] != 1):
        raise ValueError(f"{which} cache: got shape {tuple(t.shape)} strides {s}, "
                         "expected 4 dims with a unit stride on head_size")
    if cache.layout == "NHD":
        return s[0], s[1], s[2]
    return s[0], s[2], s[1]


def scale_strides(cache: KVCache, which: str = "key") -> tuple[int, int, int]:
    """(block, token-in-block, head) strides of ``cache.k_scale`` / ``cache.v_scale``, in elements.

    ``token_head``: the three strides of the ``[num_blocks, block_size, H]`` tensor; per-head
    ``(H,)``: ``(0, 0, stride)``; per-tensor ``()``: ``(0, 0, 0)``. The kernels read the scale
    of (block, offset, head) at ``blk * sb + off * st + head * sh``.
    """
    s = cache.k_scale if which == "key" else cache.v_scale
    if cache.scale_granularity == "token_head":
        if s.dim() != 3:
            raise ValueError(f"{which} scale: got shape {tuple(s.shape)}, expected [num_blocks, block_size, H]")
        return s.stride(0), s.stride(1), s.stride(2)
    if s.dim() == 0 or s.numel() == 1:
        return 0, 0, 0
    return 0, 0, s.stride(-1)


def write_launch(head_size: int, arch: str | None = None, token_scales: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_D, BLOCK_R, num_warps)`` of the write kernel.

    NVIDIA: 2 warps over at most 8 rows and 1024 elements per program (16 rows of float32 at head
    size 64 spill 8 bytes on sm86-sm90, 8 do not). Measured on the H100
    (benchmarks/results/write_h100.json, 16k tokens x 8 x 128, bf16 in, e4m3): per-tensor
    8 rows x 2 warps 36.6 us (91.5% of copy) against 37.0 for 16 x 4 and 38.7 for 16 x 2;
    token_head 8 x 2 41.0 us (82.5%) against 41.9 for 16 x 4 and 43.0 for 16 x 2.

    AMD (``arch`` ``"gfx..."``): about 4096 elements and 4 wavefronts of 64 lanes (compiled for
    gfx942, 2 wavefronts need 80 VGPRs and ~600 SGPR spills to VGPR lanes, 4 need 45 and ~200).
    The CPU interpreter (``arch`` ``"cpu"``) takes the same: fewer programs to interpret.
    ``token_scales`` no longer changes the launch (kept for callers that pass it).
    """
    block_d = max(16, triton.next_power_of_2(head_size))
    if arch is not None and not arch.startswith("sm"):
        return block_d, max(1, min(64, 4096 // block_d)), 4
    return block_d, max(1, min(8, 1024 // block_d)), 2


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, *,
             encoder: int, block_rows: int | None = None, num_warps: int | None = None,
             arch: str | None = None) -> None:
    """Quantize and scatter ``key``/``value [T, H, D]`` into ``cache`` at ``slot_mapping [T]``.

    Args:
        cache: the layer's cache (K/V codes and, for ``token_head``, scales written in place).
            ``key_cache``/``value_cache`` (and the scale tensors) may be strided views with
            different strides (see :func:`cache_strides`, :func:`scale_strides`).
        key, value: contiguous ``[T, H, D]`` float32/float16/bfloat16 on the cache's device.
        slot_mapping: ``[T]`` int32/int64; negative entries are skipped, and so are entries
            ``>= cache.num_blocks * block_size`` (never written: the kernel's own bound).
        encoder: :data:`fp8kv_triton.codec.ENC_INTEGER` or ``ENC_NATIVE`` (the policy's choice).
        block_rows / num_warps: launch overrides (benchmarks).
        arch: the GPU architecture (``"sm90"``, ``"gfx942"``...) for the launch defaults
            (:func:`write_launch`); None = NVIDIA defaults (the interpreter's for CPU tensors).
    """
    T, H, D = key.shape
    rows = T * H
    if rows == 0:
        return
    if arch is None and key.device.type == "cpu":
        arch = "cpu"
    block_d, default_rows, default_warps = write_launch(D, arch, cache.scale_granularity == "token_head")
    if block_rows is None:
        block_rows = default_rows
    if num_warps is None:
        num_warps = default_warps
    a = codec_args(cache.fmt)
    k_strides, v_strides = cache_strides(cache, "key"), cache_strides(cache, "value")
    ks_strides, vs_strides = scale_strides(cache, "key"), scale_strides(cache, "value")
    page = cache.block_size
    grid = (triton.cdiv(rows, block_rows),)
    src_kind = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[key.dtype]
    if src_kind:
        key, value = key.view(torch.int16), value.view(torch.int16)
    with launching(_write_kv_kernel):
        _write_kv_kernel[grid](
            key, value, slot_mapping, cache.key_cache.view(torch.uint8), cache.value_cache.view(torch.uint8),
            cache.k_scale, cache.v_scale, rows, H, D, cache.num_blocks * page,
            *k_strides, *v_strides, *ks_strides, *vs_strides,
            page, page.bit_length() - 1,
            PAGE_POW2=page & (page - 1) == 0, BLOCK_R=block_rows, BLOCK_D=block_d, SRC_KIND=src_kind,
            TOKEN_SCALES=cache.scale_granularity == "token_head", ENC=int(encoder == ENC_NATIVE),
            F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias, F_DROP=a.drop_bits, F_MAXBITS=a.max_f32_bits,
            F_MAXSHIFT=a.max_shift, F_NANBYTE=a.nan_byte, F_FNUZ=a.fnuz, F_KIND=a.fp8_kind, F_MAX=a.fmt_max,
            num_warps=num_warps,
        )


def write_kv_for_device(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv` with the encoder the cache's device and format use
    (:func:`~fp8kv_triton.capabilities.codec_for` of the GPU the kernel runs on, or the interpreter's)."""
    arch = device_arch(cache.device)
    choice = codec_for(arch, cache.fmt, interpret=triton_interpreter())
    write_kv(cache, key, value, slot_mapping, encoder=choice.encoder, arch=arch)
