"""The transformers cache with sink tokens and K centering (fp8kv.transforms) on tiny models.

The oracle is a transformers cache storing the defined effective K/V
(:func:`fp8kv.transforms.effective_keys_values`) under SDPA (eager for soft-capped models):
equal logits with padding, sink columns in decode steps, windows, soft-caps, calibrated means,
batch surgery; bad arguments are named errors.
"""

from __future__ import annotations

import pytest
import torch

import fp8kv
from fp8kv.transforms import KVTransform, effective_keys_values

transformers = pytest.importorskip("transformers", reason="needs the optional extra 'hf' (transformers)")

from test_hf_integration import LAYERS, padded_batch, run_oracle, teacher_forced_logits, tiny_llama  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

from fp8kv.integrations.transformers import FP8PagedCache, enable  # noqa: E402

BACKEND = "torch" if "torch" in fp8kv.available_backends() else "reference"


class TransformOracleLayer(DynamicLayer):
    """Stores the defined effective K/V of every real column (``columns [B, all columns]``: 1 = token,
    0 = padding, whose K/V are stored as they come and masked by SDPA)."""

    def __init__(self, transform: KVTransform, kv_dtype: str, columns: torch.Tensor, mean=None):
        super().__init__()
        self.transform, self.kv_dtype, self.columns, self.count = transform, kv_dtype, columns.bool(), 0
        self.means = [mean] * columns.shape[0]
        self.stored = [0] * columns.shape[0]

    def update(self, key_states, value_states, *args, **kwargs):  # [B, H, T, D]
        T = key_states.shape[2]
        ks, vs = key_states.clone(), value_states.clone()
        S = self.transform.sink_tokens
        for b in range(ks.shape[0]):
            real = self.columns[b, self.count:self.count + T]
            k, v = key_states[b].transpose(0, 1)[real], value_states[b].transpose(0, 1)[real]  # [n, H, D]
            if not k.shape[0]:
                continue
            if self.transform.k_centering == "prefill" and self.means[b] is None and self.stored[b] + k.shape[0] > S:
                self.means[b] = k[max(S - self.stored[b], 0):].float().mean(0)
            ke, ve = effective_keys_values(k, v, self.transform, self.kv_dtype, self.means[b], start=self.stored[b])
            self.stored[b] += k.shape[0]
            ks[b].transpose(0, 1)[real] = ke.to(ks.dtype)
            vs[b].transpose(0, 1)[real] = ve.to(vs.dtype)
        self.count += T
        return super().update(ks, vs)


def compare(model, cache, ids, mask, transform, n_decode=4, means=None, kv_dtype="fp8_e4m3", attn="sdpa"):
    columns = torch.cat([mask, torch.ones(mask.shape[0], n_decode, dtype=mask.dtype)], 1)
    ref = Cache(layers=[TransformOracleLayer(transform, kv_dtype, columns, None if means is None else means[i])
                        for i in range(LAYERS)])
    want = run_oracle(model, lambda: teacher_forced_logits(model, ref, ids, mask, n_decode), attn=attn)
    got = teacher_forced_logits(model, cache, ids, mask, n_decode)
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        real = mask[:, -w.shape[1]:].bool() if step == 0 else torch.ones(mask.shape[0], 1, dtype=torch.bool)
        torch.testing.assert_close(g[real], w[real], atol=3e-4, rtol=1e-4, msg=f"step {step}")
    return cache


@pytest.mark.parametrize("sink,centering", [(1, "prefill"), (1, None), (0, "prefill"), (3, "prefill")])
@torch.no_grad()
def test_logits_match_the_defined_semantics(sink, centering):
    model = tiny_llama()
    ids, mask = padded_batch()  # rows of 7 and 4 tokens (the second left-padded)
    t = KVTransform(sink, centering)
    cache = enable(model, block_size=4, backend=BACKEND, sink_tokens=sink, k_centering=centering)
    compare(model, cache, ids, mask, t)
    assert cache.seq_lens == [7 + 4, 4 + 4]
    assert cache.pool.seq_lens == [7 + 4 - sink, 4 + 4 - sink]  # sink tokens never reach the FP8 cache


@torch.no_grad()
def test_sink_columns_in_decode_steps_and_a_one_token_prompt():
    model = tiny_llama()
    ids = torch.tensor([[5, 9], [0, 7]])
    mask = torch.tensor([[1, 1], [0, 1]])  # the second row: one token, then its sinks fill during decode
    cache = enable(model, block_size=4, backend=BACKEND, sink_tokens=3, k_centering="prefill")
    compare(model, cache, ids, mask, KVTransform(3, "prefill"), n_decode=4)


@torch.no_grad()
def test_calibrated_means_and_e5m2():
    model = tiny_llama()
    ids, mask = padded_batch()
    g = torch.Generator().manual_seed(5)
    means = [torch.randn(2, 16, generator=g) for _ in range(LAYERS)]
    cache = enable(model, kv_dtype="fp8_e5m2", block_size=4, backend=BACKEND, sink_tokens=1,
                   k_centering="calibrated", k_means=means)
    compare(model, cache, ids, mask, KVTransform(1, "calibrated"), means=means, kv_dtype="fp8_e5m2")


@torch.no_grad()
def test_sliding_window_with_sinks():
    model = tiny_llama(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    ids, mask = padded_batch()
    cache = enable(model, block_size=4, backend=BACKEND, sink_tokens=2, k_centering="prefill")
    compare(model, cache, ids, mask, KVTransform(2, "prefill"))


@torch.no_grad()
def test_reorder_and_crop_carry_sinks_and_means():
    model = tiny_llama()
    ids, mask = padded_batch()
    a = enable(model, block_size=4, backend=BACKEND, sink_tokens=2, k_centering="prefill")
    b = FP8PagedCache.from_model(model)
    ids_b, mask_b = ids.flip(0), mask.flip(0)
    teacher_forced_logits(model, a, ids, mask, 2)
    teacher_forced_logits(model, b, ids_b, mask_b, 2)
    a.reorder_cache(torch.tensor([1, 0]))
    a.crop(-1)
    b.crop(-1)
    mask_a = torch.cat([mask_b, torch.ones(2, 1, dtype=mask.dtype)], 1)
    step = torch.tensor([[11], [12]])
    got = model(input_ids=step, attention_mask=torch.cat([mask_a, torch.ones_like(step)], 1), past_key_values=a,
                use_cache=True).logits
    want = model(input_ids=step, attention_mask=torch.cat([mask_a, torch.ones_like(step)], 1), past_key_values=b,
                 use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(fp8kv.InvalidArgument, match="sink tokens"):
        a.crop(-(a.pool.seq_lens[1] + 1))


def test_cache_arguments_are_named():
    model = tiny_llama(attn_logit_softcapping=None)
    for kw, name in [(dict(sink_tokens=-2), "sink_tokens"), (dict(k_centering="x"), "k_centering"),
                     (dict(sink_tokens=1, fp8_attention=True), "sink_tokens")]:
        with pytest.raises(fp8kv.InvalidArgument, match=name):
            FP8PagedCache(model.config, **kw)


@torch.no_grad()
def test_soft_cap_sinks_match_the_oracle_and_centering_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=3,
                       attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=16,
                       max_position_embeddings=256, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).eval()
    for p in model.parameters():
        if p.dim() == 2:
            p.mul_(4.0)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(8))
    cache = enable(model, backend=BACKEND, block_size=4, sink_tokens=2, k_centering="prefill")
    with pytest.raises(fp8kv.InvalidArgument, match="soft-cap"):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache = enable(model, backend=BACKEND, block_size=4, sink_tokens=2)  # sinks alone: fine with a soft-cap
    compare(model, cache, ids, torch.ones_like(ids), KVTransform(2), attn="eager")  # transformers: eager for caps
