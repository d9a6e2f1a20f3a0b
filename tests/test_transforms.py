"""fp8kv.transforms (sink tokens, K centering): what changes and what does not.

* the merge is exact: sink part + FP8 part through one softmax equals dense attention over all
  keys, and centering the keys (by any vector) changes nothing before rounding;
* the write: the FP8 bytes are exactly those of ``round(k - mu)``; V's bytes are untouched;
* the integration (tests/test_hf_transforms.py): logits equal an oracle cache holding the defined
  effective K/V (:func:`fp8kv.transforms.effective_keys_values`).
"""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.transforms import (
    KVTransform,
    calibrate_key_means,
    center_keys,
    effective_keys_values,
    merge_sink_attention,
    row_key_means,
    sink_visibility,
)


def dense_attention(q, k, v, scale, visible=None):
    """``q [N, Hq, D]`` over ``k, v [N, L, H, D]`` (per query), float64; visible ``[N, L]``."""
    N, Hq, D = q.shape
    H = k.shape[2]
    logits = torch.einsum("nhgd,nlhd->nhgl", q.double().view(N, H, Hq // H, D), k.double()) * scale
    if visible is not None:
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("nhgl,nlhd->nhgd", p, v.double()).reshape(N, Hq, D), torch.logsumexp(logits, -1)


@pytest.mark.parametrize("centered", [False, True])
def test_merge_equals_dense_attention_over_all_keys(centered):
    g = torch.Generator().manual_seed(0)
    N, Hq, H, D, S, L = 5, 4, 2, 8, 3, 7
    q = torch.randn(N, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(N, S + L, H, D, generator=g, dtype=torch.float64) + 3.0  # a large common bias
    v = torch.randn(N, S + L, H, D, generator=g, dtype=torch.float64)
    vis = torch.rand(N, S, generator=g) > 0.3
    vis[:, 0] = True
    want, _ = dense_attention(q, k, v, 0.3, torch.cat([vis, torch.ones(N, L, dtype=torch.bool)], 1))
    mu = torch.randn(N, H, D, generator=g, dtype=torch.float64) + 3.0 if centered else None
    rest_k = k[:, S:] - (mu[:, None] if centered else 0.0)  # the FP8 part sees centered keys
    out_f, lse_f = dense_attention(q, rest_k, v[:, S:], 0.3)
    got = merge_sink_attention(q, out_f, lse_f.reshape(N, Hq).float(), k[:, :S], v[:, :S], vis, mu,
                               softmax_scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # lse passes through float32


def test_merge_without_fp8_part_and_soft_cap_rules():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, 1, 4, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 1, 4, generator=g, dtype=torch.float64)
    want, _ = dense_attention(q, k, v, 0.5)
    torch.testing.assert_close(merge_sink_attention(q, None, None, k, v, None, None, softmax_scale=0.5), want)
    with pytest.raises(fp8kv.InvalidArgument, match="k_centering"):
        merge_sink_attention(q, None, None, k, v, None, torch.zeros(3, 1, 4), softmax_scale=0.5, logits_soft_cap=5.0)


def test_sink_visibility_is_causal_windowed_and_bounded_by_the_row():
    vis = sink_visibility(torch.tensor([2, 3, 3]), torch.tensor([1, 5, 9]), 3, sliding_window=8)
    assert vis.tolist() == [[True, True, False], [True, True, True], [False, False, True]]


def test_centering_changes_only_k_and_stores_the_codes_of_k_minus_mu():
    g = torch.Generator().manual_seed(2)
    B, T, H, D = 2, 5, 2, 16
    k = torch.randn(B, T, H, D, generator=g) * 2 + 4
    v = torch.randn(B, T, H, D, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :2] = False
    mu = row_key_means(k, mask)
    torch.testing.assert_close(mu[1], k[1, 2:].mean(0))
    assert row_key_means(k, torch.zeros(B, T, dtype=torch.bool)).abs().max() == 0  # no key: no shift
    kc = center_keys(k, mu)
    assert kc.dtype == k.dtype and torch.equal(kc, (k - mu[:, None]))
    a = fp8kv.KVCache.allocate(4, 4, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    b = fp8kv.KVCache.allocate(4, 4, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    slots = torch.arange(B * T)
    fp8kv.write_kv_one_shot(a, kc.reshape(-1, H, D), v.reshape(-1, H, D), slots, backend="reference")
    fp8kv.write_kv_one_shot(b, (k - mu[:, None]).reshape(-1, H, D), v.reshape(-1, H, D), slots, backend="reference")
    assert torch.equal(a.key_cache.view(torch.uint8), b.key_cache.view(torch.uint8))
    c = fp8kv.KVCache.allocate(4, 4, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head")
    fp8kv.write_kv_one_shot(c, k.reshape(-1, H, D), v.reshape(-1, H, D), slots, backend="reference")
    assert torch.equal(a.value_cache.view(torch.uint8), c.value_cache.view(torch.uint8))  # V untouched
    assert torch.equal(a.v_scale, c.v_scale)
    assert not torch.equal(a.key_cache.view(torch.uint8), c.key_cache.view(torch.uint8))


def test_effective_keys_values_definition():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(6, 2, 8, generator=g) + 2
    v = torch.randn(6, 2, 8, generator=g)
    mu = k[2:].mean(0)
    plain_k, plain_v = effective_keys_values(k, v, KVTransform(), "fp8_e4m3")
    ke, ve = effective_keys_values(k, v, KVTransform(2, "prefill"), "fp8_e4m3", mu)
    assert torch.equal(ke[:2], k[:2]) and torch.equal(ve[:2], v[:2])  # sinks exact
    assert torch.equal(ve[2:], plain_v[2:])  # V is quantized as without the transform
    from fp8kv.formats import dequantize, get_format, quantize
    from fp8kv.scales import token_head_scale

    fmt = get_format("fp8_e4m3")
    s = token_head_scale(k - mu, fmt)[..., None]
    assert torch.equal(ke[2:], (dequantize(quantize(k - mu, fmt, s), s, dtype=torch.float32) + mu)[2:])
    assert not torch.equal(ke[2:], plain_k[2:])
    tail_k, _ = effective_keys_values(k[3:], v[3:], KVTransform(2, "prefill"), "fp8_e4m3", mu, start=3)
    assert torch.equal(tail_k, ke[3:])  # a part of the sequence: same values


def test_transform_arguments_are_named():
    kw = dict(num_layers=2, num_kv_heads=2, head_size=4)
    for bad, name in [(dict(sink_tokens=-1), "sink_tokens"), (dict(sink_tokens=True), "sink_tokens"),
                      (dict(k_centering="mean"), "k_centering"), (dict(k_centering="calibrated"), "k_means"),
                      (dict(k_centering="calibrated", k_means=[torch.zeros(2, 4)]), "k_means"),
                      (dict(k_centering="calibrated", k_means=[torch.zeros(2, 4), torch.zeros(2, 5)]), "k_means"),
                      (dict(k_centering="prefill", k_means=[torch.zeros(2, 4)] * 2), "k_means")]:
        with pytest.raises(fp8kv.InvalidArgument, match=name):
            KVTransform.build(**bad, **kw)
    t = KVTransform.build(1, "calibrated", {0: torch.ones(2, 4), 1: torch.zeros(2, 4)}, **kw)
    assert t.active and t.k_means[0].dtype == torch.float32
    assert not KVTransform.build(**kw).active
    means = calibrate_key_means([torch.ones(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)])
    assert [tuple(m.shape) for m in means] == [(2, 4), (2, 4)]
