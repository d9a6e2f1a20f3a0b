"""The Triton kernels on strided caches and their optional log-sum-exp output (CPU interpreter).

Kernel-level calls (:func:`fp8kv_triton.write.write_kv`, :func:`fp8kv_triton.attention.paged_attention`)
on caches whose K, V and scales are views with their own strides, as engines hand them over:

* ``kv_pair``: K and V are ``t[:, 0]`` / ``t[:, 1]`` of one ``[num_blocks, 2, ...]`` tensor whose
  head_size rows are padded;
* ``separate``: two allocations with different paddings (and a storage offset);
* ``head_slice``: a slice of the heads of bigger caches;
* ``permuted``: the other layout's storage seen through a permutation (V in a flat padded block);

with ``token_head`` scales that are strided views (a column of a bigger tensor, a transposed
padded tensor) and static scales that are a strided slice / a scalar inside a bigger tensor.

Checked: (a) written bytes equal :func:`fp8kv.reference.write_kv` into a contiguous cache, and
every byte of the parent tensors outside the views (poisoned beforehand) is untouched; (b)
attention over the strided cache equals attention over a contiguous copy bit for bit (same
kernel and launch config) and a float64 dense computation within a derived bound; (c) ``lse``
equals the float64 ``logsumexp`` of the logits within a derived bound (decode, chunked prefill,
split-KV, token_head scales, soft-cap, sliding window, rows without keys); (d) passing ``lse``
leaves ``out`` bit-identical; and (e) the kernels still compile ahead of time for sm90.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace

import pytest
import torch

import fp8kv.reference
from fp8kv.cache import KVCache
from fp8kv.formats import FORMATS

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")

U = 2.0**-24  # float32 unit roundoff
KINDS = ["kv_pair", "separate", "head_slice", "permuted"]


# ------------------------------------------------------------------------------ caches


def _make_cache(k, v, ks, vs, fmt, layout, gran):
    return KVCache(k, v, ks, vs, fmt, layout, gran)  # the validating constructor accepts every view here


@dataclass
class Strided:
    """A cache made of views, the parent tensors they live in, and the parents' bytes before any write."""

    cache: object
    views: list  # (view, parent) for key_cache, value_cache, k_scale, v_scale
    before: dict  # id(parent) -> clone

    def check_parents(self, want) -> None:
        """Each parent must now hold its old bytes except in the views, which must hold ``want``'s."""
        expected = {i: t.clone() for i, t in self.before.items()}
        for (view, parent), src in zip(self.views, _tensors(want), strict=True):
            exp = expected[id(parent)]
            exp.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(src.view(view.dtype))
        for name, (_, parent) in zip(("key_cache", "value_cache", "k_scale", "v_scale"), self.views, strict=True):
            got, ref = _raw(parent), _raw(expected[id(parent)])
            assert torch.equal(got, ref), f"{name}'s parent: {int((got != ref).sum())} bytes differ"


def _tensors(cache) -> list[torch.Tensor]:
    return [cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a code tensor (uint8) or bits of a float32 tensor (int32), for exact compares."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _code_views(kind: str, layout: str, nb: int, bs: int, H: int, D: int, g: torch.Generator):
    """(view, parent) for K and V, as uint8, in the logical ``layout`` order."""
    s1, s2 = (bs, H) if layout == "NHD" else (H, bs)

    def rnd(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    if kind == "kv_pair":
        p = rnd(nb, 2, s1, s2, D + 8)
        return [(p[:, 0, :, :, :D], p), (p[:, 1, :, :, :D], p)]
    if kind == "separate":
        pk = rnd(nb, s1 + 1, s2, D)
        pv = rnd(nb + 2, s1, s2 + 3, D + 16)
        return [(pk[:, 1:], pk), (pv[2:, :, 1:s2 + 1, 4:4 + D], pv)]
    if kind == "head_slice":
        hd = 2 if layout == "NHD" else 1
        pk = rnd(nb, *((s1, 2 * H + 3) if layout == "NHD" else (2 * H + 3, s2)), D)
        pv = rnd(nb, *((s1, H + 1) if layout == "NHD" else (H + 1, s2)), D)
        return [(pk.narrow(hd, 2, H), pk), (pv.narrow(hd, 1, H), pv)]
    if kind == "permuted":
        pk = rnd(nb, s2, s1, D)  # the other layout's storage order
        pv = rnd(nb, s1 * s2 * D + 32)  # blocks padded by 32 bytes, starting at byte 32
        return [(pk.permute(0, 2, 1, 3), pk), (pv[:, 32:].view(nb, s1, s2, D), pv)]
    raise AssertionError(kind)


def _scale_views(gran: str, nb: int, bs: int, H: int, g: torch.Generator):
    """(view, parent) for k_scale and v_scale: strided views of bigger float32 tensors."""
    if gran == "token_head":
        pk = torch.full((nb, bs, H, 3), -7.0)
        pv = torch.full((nb, H + 2, bs + 1), -5.0)
        ks, vs = pk[..., 1], pv.permute(0, 2, 1)[:, 1:, 1:H + 1]  # strides (3bsH, 3H, 3) / (., 1, bs+1)
        ks.uniform_(0.5, 2.0, generator=g)
        vs.uniform_(0.5, 2.0, generator=g)
    elif gran == "head":
        pk, pv = torch.full((2 * H + 1,), -7.0), torch.full((H + 3,), -5.0)
        ks, vs = pk[1::2], pv[3:]  # strides 2 and 1
        ks.copy_(torch.rand(H, generator=g) * 0.02 + 0.01)
        vs.copy_(torch.rand(H, generator=g) * 0.2 + 0.05)
    else:
        pk, pv = torch.full((4,), -7.0), torch.full((3,), -5.0)
        ks, vs = pk[2], pv[1]  # shape (), storage offsets 2 and 1
        ks.fill_(0.02)
        vs.fill_(0.1)
    return [(ks, pk), (vs, pv)]


def _strided_cache(kind, fmt, layout, gran, nb, bs, H, D, seed=0) -> Strided:
    g = torch.Generator().manual_seed(seed)
    views = _code_views(kind, layout, nb, bs, H, D, g) + _scale_views(gran, nb, bs, H, g)
    (k, _), (v, _), (ks, _), (vs, _) = views
    cache = _make_cache(k.view(fmt.torch_dtype), v.view(fmt.torch_dtype), ks, vs, fmt, layout, gran)
    return Strided(cache, views, {id(p): p.clone() for _, p in views})


def _contiguous_copy(src) -> KVCache:
    """A freshly allocated (contiguous) cache with the same contents as ``src``."""
    static = {} if src.scale_granularity == "token_head" else {
        "k_scale": src.k_scale.clone(), "v_scale": src.v_scale.clone()}
    c = KVCache.allocate(src.num_blocks, src.block_size, src.num_kv_heads, src.head_size, kv_dtype=src.fmt.name,
                         layout=src.layout, scale_granularity=src.scale_granularity, **static)
    for a, b in zip(_tensors(c), _tensors(src), strict=True):
        _raw(a).copy_(_raw(b))
    return c


def _codec(fmt):
    from fp8kv_triton.capabilities import codec_for

    return codec_for(None, fmt, interpret=True)


def _write_both(s: Strided, key, value, slots) -> KVCache:
    """Triton write into the strided cache, reference write into a contiguous copy of it."""
    from fp8kv_triton.write import write_kv

    want = _contiguous_copy(s.cache)
    fp8kv.reference.write_kv(want, key, value, slots)
    write_kv(s.cache, key, value, slots.to(torch.int32), encoder=_codec(s.cache.fmt).encoder)
    return want


# ------------------------------------------------------------------------------- writes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("gran", ["tensor", "head", "token_head"])
def test_strided_write_is_byte_identical_and_touches_nothing_else(kind, layout, gran):
    fmt = FORMATS["fp8_e4m3" if gran != "head" else "fp8_e5m2"]
    nb, bs, H, D, T = 5, 4, 2, 24, 11
    s = _strided_cache(kind, fmt, layout, gran, nb, bs, H, D, seed=1)
    g = torch.Generator().manual_seed(2)
    key = (torch.randn(T, H, D, generator=g) * torch.logspace(-2, 1, D)).to(torch.float16)
    value = (torch.randn(T, H, D, generator=g) * 3).to(torch.float16)
    key[1, 0, 3] = math.nan
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[2, 7]] = -1
    want = _write_both(s, key, value, slots)
    s.check_parents(want)
    # the cache seen through the views equals the reference's contiguous cache
    for a, b in zip(_tensors(s.cache), _tensors(want), strict=True):
        assert torch.equal(_raw(a), _raw(b))


def test_cache_strides_per_tensor():
    from fp8kv_triton.write import cache_strides, scale_strides

    s = _strided_cache("separate", FORMATS["fp8_e4m3"], "HND", "token_head", nb=3, bs=4, H=2, D=16)
    k, v = s.cache.key_cache, s.cache.value_cache  # [nb, H, bs, D]
    assert cache_strides(s.cache, "key") == (k.stride(0), k.stride(2), k.stride(1))
    assert cache_strides(s.cache, "value") == (v.stride(0), v.stride(2), v.stride(1))
    assert cache_strides(s.cache, "key") != cache_strides(s.cache, "value")
    assert scale_strides(s.cache, "key") == (24, 6, 3)
    assert scale_strides(s.cache, "value") == s.cache.v_scale.stride() == (20, 1, 5)
    h = _strided_cache("kv_pair", FORMATS["fp8_e4m3"], "NHD", "head", nb=3, bs=4, H=2, D=16)
    assert scale_strides(h.cache, "key") == (0, 0, 2) and scale_strides(h.cache, "value") == (0, 0, 1)
    t = _strided_cache("kv_pair", FORMATS["fp8_e4m3"], "NHD", "tensor", nb=3, bs=4, H=2, D=16)
    assert scale_strides(t.cache, "key") == (0, 0, 0)


# ---------------------------------------------------------------------------- attention


def _attention_case(kind="kv_pair", *, fmt="fp8_e4m3", gran="tensor", layout="NHD", dtype=torch.float16, H=2,
                    group=2, D=16, bs=4, seq_lens=(37, 5), q_lens=(1, 1), seed=0):
    """A strided cache filled by the Triton write, its contiguous reference twin, and a batch."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g)
    tables = torch.full((len(seq_lens), max(need) + 1), 0, dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at:at + k]
        at += k
    s = _strided_cache(kind, FORMATS[fmt], layout, gran, nb, bs, H, D, seed=seed + 1)
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(seq_lens)])
    mag = torch.logspace(-1, 0.5, len(slots))[torch.randperm(len(slots), generator=g)][:, None, None]
    key = torch.randn(len(slots), H, D, generator=g) * 2 * mag
    value = torch.randn(len(slots), H, D, generator=g) * mag
    contiguous = _write_both(s, key, value, slots)
    for a, b in zip(_tensors(s.cache), _tensors(contiguous), strict=True):
        assert torch.equal(_raw(a), _raw(b))
    query = torch.randn(sum(q_lens), H * group, D, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return s.cache, contiguous, query, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def _run(cache, query, tables, lens, qsl, *, causal, window, cap, config, lse: bool):
    from fp8kv_triton.attention import paged_attention

    max_q = int((qsl[1:] - qsl[:-1]).max())
    out = torch.full_like(query, math.nan)
    lse_t = torch.full(query.shape[:2], math.nan) if lse else None
    paged_attention(query, cache, tables, lens, qsl, max_q, query.shape[-1] ** -0.5, causal, window, cap, out,
                    lse=lse_t, decode_mode=_codec(cache.fmt).decoder, interpret=True, config=config)
    return out, lse_t


def _config(cache, query, tables, lens, qsl, keys_per_split):
    """The default interpreter config, with the key range cut into pieces of ``keys_per_split``."""
    from fp8kv_triton.attention import choose_config

    if keys_per_split is None:
        return None
    max_keys = tables.shape[1] * cache.block_size
    base = choose_config(query.device, group=query.shape[1] // cache.num_kv_heads, head_size=query.shape[2],
                         num_seqs=len(lens), num_kv_heads=cache.num_kv_heads,
                         max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_keys=max_keys, interpret=True)
    assert keys_per_split % base.block_n == 0
    cfg = replace(base, num_splits=-(-max_keys // keys_per_split), keys_per_split=keys_per_split)
    assert cfg.num_splits > 1
    return cfg


def _dequantized(cache, which, blk, off):
    """float64 ``[n, H, D]`` of the keys/values at (block, offset) pairs, read through the views."""
    c = cache.key_cache if which == "key" else cache.value_cache
    codes = c[blk, off] if cache.layout == "NHD" else c[blk, :, off]
    s = cache.k_scale if which == "key" else cache.v_scale
    if cache.scale_granularity == "token_head":
        scale = s[blk, off]
    else:
        scale = s.reshape(1, -1).expand(len(blk), cache.num_kv_heads)
    return codes.float().double() * scale.double()[..., None]


def _dense64(cache, query, tables, lens, qsl, *, causal, window, cap):
    """float64 ``out [T, Hq, D]``, ``lse [T, Hq]`` and, per row, the bound's inputs: ``L`` (logit
    magnitude ``softmax_scale * max_k sum_i |q_i k'_ki|``), ``V`` (``max |v'|``), ``N`` (keys)."""
    T, HQ, D = query.shape
    group = HQ // cache.num_kv_heads
    scale = D**-0.5
    out = torch.zeros(T, HQ, D, dtype=torch.float64)
    lse = torch.full((T, HQ), -math.inf, dtype=torch.float64)
    L, V, N = (torch.zeros(T, HQ, dtype=torch.float64) for _ in range(3))
    starts = qsl.tolist()
    for i, n in enumerate(lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0 or n == 0:
            continue
        pos = torch.arange(n)
        blk, off = tables[i].long()[pos // cache.block_size], pos % cache.block_size
        k = _dequantized(cache, "key", blk, off).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = _dequantized(cache, "value", blk, off).repeat_interleave(group, dim=1)
        q = query[q0:q1].double()  # [ql, Hq, D]
        logits = torch.einsum("qhd,nhd->qhn", q, k) * scale
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        qpos = (n - (q1 - q0) + torch.arange(q1 - q0))[:, None, None]
        vis = (pos <= qpos) | (not causal)
        if window is not None:
            vis = vis & (pos > qpos - window)
        vis = vis.expand_as(logits)
        logits = logits.masked_fill(~vis, -math.inf)
        lse[q0:q1] = torch.logsumexp(logits, dim=-1)
        out[q0:q1] = torch.einsum("qhn,nhd->qhd", torch.softmax(logits, dim=-1), v)
        mag = torch.einsum("qhd,nhd->qhn", q.abs(), k.abs()) * scale
        L[q0:q1] = mag.masked_fill(~vis, 0).amax(-1)
        V[q0:q1] = (v.abs().amax(-1).t()[None] * vis).amax(-1)
        N[q0:q1] = vis.sum(-1).double()
    return out, lse, L, V, N


def _logit_error(L, D, cap):
    """Bound on one kernel logit's error, natural units (see fp8kv.testing.tolerance, step 1):
    the float32 dot of D exact products (q and the FP8 code are exact in float16) is off by at most
    ``(D - 1) u sum|q k'|``; the scale products (``softmax_scale * k_scale * log2 e``, or per-key
    ``k_scale``) add 5 roundings, ``exp2`` of the shifted logit acts like ``8 u max(1, |s|)``, and
    the soft-cap (division, tanh to a few ulps, product) ``8 u cap``."""
    S = L if cap is None else torch.clamp(L, max=cap)
    return (D + 4) * U * L + 8 * U * torch.clamp(S, min=1.0) + (0.0 if cap is None else 8 * U * cap)


def _check(case, *, causal=True, window=None, cap=None, keys_per_split=None):
    cache, contiguous, query, tables, lens, qsl = case
    cfg = _config(cache, query, tables, lens, qsl, keys_per_split)
    kw = dict(causal=causal, window=window, cap=cap, config=cfg)
    out, lse = _run(cache, query, tables, lens, qsl, lse=True, **kw)
    # (b) the strided cache gives exactly what its contiguous copy gives, lse included
    out_c, lse_c = _run(contiguous, query, tables, lens, qsl, lse=True, **kw)
    assert torch.equal(out.view(torch.int16), out_c.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), lse_c.view(torch.int32))
    # (d) asking for lse changes nothing in out
    out_n, _ = _run(cache, query, tables, lens, qsl, lse=False, **kw)
    assert torch.equal(out.view(torch.int16), out_n.view(torch.int16))

    want, want_lse, L, V, N = _dense64(cache, query, tables, lens, qsl, causal=causal, window=window, cap=cap)
    rows = N > 0
    assert bool(rows.all()), "every row of these cases sees a key"
    delta = _logit_error(L, query.shape[-1], cap)
    # (c) lse = logsumexp_k s_k is 1-Lipschitz in max_k |ds_k| (its gradient is the softmax), so
    # the logit errors move it by at most delta; the normaliser l = sum_k 2^(s_k - m) has N
    # additions and N online rescalings in float32 (relative (2N + 2) u, i.e. that much in lse);
    # log2(l), the sum m + log2(l) and the product by ln 2 are three roundings of |lse|-sized values.
    lse_tol = delta + (2 * N + 2) * U + 4 * U * (want_lse.abs() + 1)
    lse_err = (lse.double() - want_lse).abs()
    assert bool((lse_err <= lse_tol).all()), f"lse error {lse_err.max():.3g} > {lse_tol[lse_err.argmax()]:.3g}"
    # the bound reaches ~6e-5 for the largest logits here; the errors seen are below 1.5e-6, so
    # hold them to 1e-5 (relative above |lse| = 1) as well: a sloppier formula would show
    assert bool((lse_err <= 1e-5 * want_lse.abs().clamp(min=1)).all())
    # out: weights move by at most e^(2 delta) - 1 (L1), the float32 numerator and normaliser by
    # (4N + 4) u, p @ v with p in two float16 halves by 2^-22 relative plus 2^-25 per key (the low
    # half's underflow), the token_head row normalisation and the split merge by 16 u; then the
    # rounding to the output dtype: a whole ulp (2^-10 relative for float16, 2^-7 for bfloat16), as
    # the interpreter truncates float32 to bfloat16 (a GPU rounds to nearest, half an ulp).
    E = V * (torch.expm1(2 * delta) + (4 * N + 4) * U + 2.0**-22 + N * 2.0**-25 + 16 * U)
    p_out = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}[query.dtype]
    out_tol = E[..., None] + (want.abs() + E[..., None]) * 2.0**-p_out + 2.0**-24
    out_err = (out.double() - want).abs()
    assert bool((out_err <= out_tol).all()), f"out error {out_err.max():.3g}"
    return lse_err.max().item()


@pytest.mark.parametrize(("kwargs", "opts"), [
    (dict(kind="kv_pair"), dict()),
    (dict(kind="separate", gran="head", layout="HND", seq_lens=(20, 9), q_lens=(20, 3)), dict()),
    (dict(kind="permuted", gran="token_head", seq_lens=(70, 9), q_lens=(9, 2), bs=16), dict(window=7, cap=5.0)),
    (dict(kind="head_slice", gran="token_head", layout="HND", dtype=torch.bfloat16, group=3, D=24,
          seq_lens=(30, 6), q_lens=(4, 6), bs=3), dict(causal=False, window=9, cap=30.0)),
    (dict(kind="kv_pair", gran="tensor", fmt="fp8_e5m2", seq_lens=(150, 40, 1), q_lens=(1, 1, 1), bs=16),
     dict(keys_per_split=64)),
    (dict(kind="separate", gran="token_head", layout="HND", seq_lens=(150, 40, 1), q_lens=(1, 1, 1), bs=16),
     dict(keys_per_split=32, window=50)),
    (dict(kind="head_slice", gran="token_head", seq_lens=(90, 12), q_lens=(5, 12), bs=8),
     dict(keys_per_split=32, cap=4.0)),
], ids=["decode", "prefill-head-HND", "token_head-window-cap", "bf16-noncausal-gqa3-bs3",
        "split-e5m2", "split-token_head-window", "split-prefill-cap"])
def test_attention_and_lse_on_strided_caches(kwargs, opts):
    _check(_attention_case(**kwargs), **opts)


@pytest.mark.parametrize("keys_per_split", [None, 32])
def test_rows_without_keys_get_minus_inf(keys_per_split):
    """A sequence with no cached key (seq_len 0): its rows get lse = -inf, the others are unaffected."""
    cache, contiguous, query, tables, lens, qsl = _attention_case(seq_lens=(40, 0), q_lens=(1, 2), bs=8)
    cfg = _config(cache, query, tables, lens, qsl, keys_per_split)
    out, lse = _run(cache, query, tables, lens, qsl, causal=True, window=None, cap=None, config=cfg, lse=True)
    assert bool((lse[1:] == -math.inf).all()) and bool(lse[0].isfinite().all())
    _, want_lse, *_ = _dense64(cache, query[:1], tables[:1], lens[:1], qsl[:2], causal=True, window=None, cap=None)
    assert torch.allclose(lse[:1].double(), want_lse, rtol=0, atol=1e-5)


def test_lse_must_be_contiguous_float32():
    cache, _, query, tables, lens, qsl = _attention_case()
    from fp8kv_triton.attention import paged_attention

    for bad in (torch.empty(query.shape[1], query.shape[0]).t(), torch.empty(query.shape[:2], dtype=torch.float16)):
        with pytest.raises(ValueError, match="lse"):
            paged_attention(query, cache, tables, lens, qsl, 1, 0.25, True, None, None, torch.empty_like(query),
                            lse=bad, decode_mode=_codec(cache.fmt).decoder, interpret=True)


# ------------------------------------------------------------------- ahead-of-time compile

_AOT = textwrap.dedent("""
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from fp8kv_triton.attention import _attn_kernel, _reduce_kernel
    from fp8kv_triton.write import _write_kv_kernel
    from fp8kv_triton.codec import codec_args
    from fp8kv.formats import FORMATS

    a = codec_args(FORMATS["fp8_e4m3"])
    target = GPUTarget("cuda", 90, 32)
    fmt = dict(F_KIND=a.fp8_kind, F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias, F_DROP=a.drop_bits,
               F_FNUZ=a.fnuz, F_HASINF=a.has_inf, F_MAXMAG=a.max_mag, F_BIAS=a.bias)

    def compile(fn, sig, consts):
        names = fn.arg_names
        signature = {n: sig.get(n, "constexpr" if n in consts else "i32") for n in names}
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v
                                        for k, v in consts.items()})
        return triton.compile(src, target=target, options=dict(num_warps=4, num_stages=3))

    ptrs = {"Q": "*fp16", "KC": "*u8", "VC": "*u8", "KS": "*fp32", "VS": "*fp32", "BT": "*i32",
            "SEQ_LENS": "*i32", "QSL": "*i32", "OUT": "*fp16", "PACC": "*fp32", "PM": "*fp32", "PL": "*fp32",
            "LSE": "*fp32", "sm_scale": "fp32", "soft_cap": "fp32", "stride_kb": "i64", "stride_vb": "i64",
            "stride_ksb": "i64"}
    for token, split, lse in ((False, False, False), (True, True, True), (True, False, True)):
        k = compile(_attn_kernel, ptrs, dict(
            BLOCK_M=16, BLOCK_N=128, BLOCK_D=128, EVEN_D=True, FULL_P_KEYS=1024, PAGE_POW2=True, USE_CAP=True,
            TOKEN_SCALES=token, Q_BITS=False, SPLIT=split, WRITE_LSE=lse, QK_DT=tl.bfloat16, PV_F32=False,
            PV_SPLIT=True, DEC_MODE=0, **fmt))
        assert "ld.global" in k.asm["ptx"]
    compile(_reduce_kernel, {"PACC": "*fp32", "PM": "*fp32", "PL": "*fp32", "VS": "*fp32", "OUT": "*fp16",
                             "LSE": "*fp32"},
            dict(BLOCK_S=8, BLOCK_D=128, TOKEN_SCALES=False, WRITE_LSE=True))
    compile(_write_kv_kernel, {n: "*u8" if n[1] == "c" else "*fp32" for n in
                               ("kc_ptr", "vc_ptr", "ks_ptr", "vs_ptr")} | {
                "key_ptr": "*i16", "value_ptr": "*i16", "slot_ptr": "*i64", "k_sb": "i64", "v_sb": "i64"},
            dict(PAGE_POW2=True, BLOCK_R=32, BLOCK_D=128, SRC_KIND=2, TOKEN_SCALES=True, ENC=1,
                 F_MANT=a.mant_bits, F_REBIAS=a.exp_rebias, F_DROP=a.drop_bits, F_MAXBITS=a.max_f32_bits,
                 F_MAXSHIFT=a.max_shift, F_NANBYTE=a.nan_byte, F_FNUZ=a.fnuz, F_KIND=a.fp8_kind, F_MAX=a.fmt_max))
    print("ok")
""")


def test_kernels_compile_for_sm90():
    """The kernels still compile for sm90 (PTX and cubin, no GPU needed: Triton's compiler, not the
    interpreter, in a subprocess without TRITON_INTERPRET); ~10 s, then Triton's cache."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
