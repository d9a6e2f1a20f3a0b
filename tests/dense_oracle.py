"""An independent float64 oracle: dense softmax attention, one query token at a time.

Written separately from fp8kv.reference (no shared code): it walks the block table
token by token to build each sequence's dequantized K/V, then applies the mask rules
of the design brief literally.
"""

from __future__ import annotations

import math

import torch

import fp8kv


def sequence_kv(cache: fp8kv.KVCache, block_table: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized float64 ``k, v [seq_len, H, D]`` of one sequence, read slot by slot."""
    ks, vs = [], []
    for pos in range(seq_len):
        block, offset = block_table[pos // cache.block_size], pos % cache.block_size
        for which, acc in (("key", ks), ("value", vs)):
            c = cache.key_cache if which == "key" else cache.value_cache
            codes = c[block, offset] if cache.layout == "NHD" else c[block, :, offset]  # [H, D]
            s = cache.k_scale if which == "key" else cache.v_scale
            scale = s[block, offset] if cache.scale_granularity == "token_head" else s.expand(cache.num_kv_heads)
            acc.append(codes.double() * scale.double()[:, None])
    return torch.stack(ks), torch.stack(vs)


def dense_attention(query, cache, block_tables, seq_lens, query_start_loc, softmax_scale, causal=True,
                    sliding_window=None, logits_soft_cap=None, with_lse=False):
    """Float64 ``[num_tokens, Hq, D]`` (and, ``with_lse``, the float64 ``[num_tokens, Hq]``
    natural-log log-sum-exp of each row's logits)."""
    Hq = query.shape[1]
    group = Hq // cache.num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full(query.shape[:2], -math.inf, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = sequence_kv(cache, block_tables[i].tolist(), seq_len)
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            t = starts[i] + j
            position = seq_len - q_len + j
            keys = [p for p in range(seq_len)
                    if (not causal or p <= position) and (sliding_window is None or p > position - sliding_window)]
            for h in range(Hq):
                kv_head = h // group
                q = query[t, h].double()
                logits = (k[keys, kv_head] @ q) * softmax_scale
                if logits_soft_cap is not None:
                    logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
                w = torch.exp(logits - logits.max())
                lse[t, h] = logits.max() + torch.log(w.sum())
                w = w / w.sum()
                out[t, h] = (w[:, None] * v[keys, kv_head]).sum(0)
    return (out, lse) if with_lse else out


def logit_magnitude(query, cache, block_tables, seq_lens, query_start_loc, softmax_scale) -> float:
    """softmax_scale * max over (token, head, key) of sum_i |q_i k_i| (for the tolerance)."""
    best = 0.0
    Hq = query.shape[1]
    group = Hq // cache.num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0 or starts[i + 1] == starts[i]:
            continue
        k, _ = sequence_kv(cache, block_tables[i].tolist(), seq_len)
        q = query[starts[i]:starts[i + 1]].double().abs()  # [ql, Hq, D]
        kk = k.abs().repeat_interleave(group, dim=1)  # [L, Hq, D]
        best = max(best, float(torch.einsum("qhd,lhd->qhl", q, kk).max()))
    return best * softmax_scale if math.isfinite(best) else math.inf
