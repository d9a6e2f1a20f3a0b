"""transformers integration on tiny randomly initialised models (no download, CPU, seconds).

The oracle is transformers itself: a ``DynamicCache`` whose layers fake-quantize K/V with
fp8kv's own quantize/dequantize (same format, same scales) under SDPA attention. The
fp8kv path (FP8 paged cache + ``fp8kv.paged_attention``, reference backend) must give
the same logits, tokens and samples.
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the optional extra 'hf' (transformers)")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import fp8kv  # noqa: E402
from fp8kv.formats import dequantize, get_format, quantize  # noqa: E402
from fp8kv.integrations import _hf  # noqa: E402
from fp8kv.integrations.transformers import (  # noqa: E402
    FP8PagedCache,
    calibrate_kv_scales,
    check_model,
    disable,
    enable,
    model_shape,
    register,
)
from fp8kv.scales import token_head_scale  # noqa: E402

BACKEND = "reference"
H, D, LAYERS = 2, 16, 2


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=H, head_dim=D, max_position_embeddings=256,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kw)).eval()
    # larger weights than the default init, so logits are spread and greedy is stable
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.generation_config.pad_token_id = 0
    return model


# ------------------------------------------------------------------------------------ oracle


class FakeQuantLayer(DynamicLayer):
    """A DynamicLayer storing quantize->dequantize(K/V): what an FP8 cache would hold."""

    def __init__(self, fmt: str, k_scale=None, v_scale=None):
        super().__init__()
        self.fmt, self.k_scale, self.v_scale = get_format(fmt), k_scale, v_scale

    def _fq(self, x: torch.Tensor, scale) -> torch.Tensor:  # x [B, H, T, D]
        if scale is None:  # token_head
            s = token_head_scale(x.transpose(1, 2), self.fmt).transpose(1, 2)[..., None]
        else:
            s = torch.as_tensor(scale, dtype=torch.float32).reshape(1, -1, 1, 1)
        return dequantize(quantize(x, self.fmt, s), s, x.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(self._fq(key_states, self.k_scale), self._fq(value_states, self.v_scale))


def oracle_cache(fmt: str, k_scales=None, v_scales=None) -> Cache:
    ks = k_scales or [None] * LAYERS
    vs = v_scales or [None] * LAYERS
    return Cache(layers=[FakeQuantLayer(fmt, ks[i], vs[i]) for i in range(LAYERS)])


def run_oracle(model, fn, attn: str = "sdpa"):
    """Run ``fn()`` with the model on ``attn``, then restore the attention it had."""
    prev = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        return fn()
    finally:
        model.set_attn_implementation(prev)


def padded_batch():
    """Two rows: 7 tokens, and 4 tokens left-padded to 7."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def teacher_forced_logits(model, cache, ids, mask, n_decode=4):
    """Logits of a prefill over ``ids`` then ``n_decode`` one-token steps (fixed tokens)."""
    out = [model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits]
    for t in range(n_decode):
        step = torch.full((ids.shape[0], 1), 10 + t)
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        out.append(model(input_ids=step, attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    return out


# ------------------------------------------------------------------------------------ tests


def test_import_does_not_load_transformers():
    code = ("import sys, fp8kv.integrations.transformers as t, fp8kv_bench.hf_eval, fp8kv.cli; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "assert t.ATTN_IMPLEMENTATION == 'fp8kv'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity,layout", [("token_head", "NHD"), ("head", "HND"), ("tensor", "NHD")])
@torch.no_grad()
def test_logits_match_fake_quant_oracle(kv_dtype, granularity, layout):
    model = tiny_llama()
    ids, mask = padded_batch()
    ks = vs = None
    if granularity != "token_head":
        ks, vs = calibrate_kv_scales(model, ids, mask, kv_dtype=kv_dtype, granularity=granularity)
    want = run_oracle(model, lambda: teacher_forced_logits(model, oracle_cache(kv_dtype, ks, vs), ids, mask))
    cache = enable(model, kv_dtype=kv_dtype, scale_granularity=granularity, layout=layout, k_scales=ks,
                   v_scales=vs, block_size=4, backend=BACKEND)
    got = teacher_forced_logits(model, cache, ids, mask)
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        real = mask[:, -w.shape[1]:].bool() if step == 0 else torch.ones(2, 1, dtype=torch.bool)
        torch.testing.assert_close(g[real], w[real], atol=2e-4, rtol=1e-4, msg=f"step {step}")
    assert cache.seq_lens == [7 + 4, 4 + 4]
    kv = cache.layer_cache(0)
    assert (kv.kv_dtype, kv.layout, kv.scale_granularity) == (kv_dtype, layout, granularity)


@torch.no_grad()
def test_padding_is_never_written_and_batched_equals_single(monkeypatch):
    model = tiny_llama()
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    seen = []
    real_write = _hf.write_kv

    def spy(cache, key, value, meta, **kw):  # the step's metadata carries the slots
        seen.append(meta.slot_mapping.clone())
        return real_write(cache, key, value, meta, **kw)

    monkeypatch.setattr(_hf, "write_kv", spy)
    cache = enable(model, block_size=4, backend=BACKEND)
    new = 6
    batched = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, past_key_values=cache)
    prefill = seen[0].view(3, width)
    assert torch.equal(prefill < 0, mask == 0)  # exactly the padding columns get slot -1
    assert all(bool((s >= 0).all()) for s in seen[LAYERS:])  # decode steps write every row
    assert cache.seq_lens == [len(p) + new - 1 for p in prompts]
    for layer in range(LAYERS):  # written slots (scale != init 1.0) = the rows' tokens
        kv = cache.layer_cache(layer)
        assert int((kv.k_scale != 1.0).all(dim=-1).sum()) == sum(cache.seq_lens)
    for i, p in enumerate(prompts):
        single = model.generate(input_ids=p[None], max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                past_key_values=FP8PagedCache.from_model(model))
        assert batched[i, width:].tolist() == single[0, len(p):].tolist(), f"row {i}"


@torch.no_grad()
def test_greedy_and_sampling_match_oracle():
    model = tiny_llama(seed=3)
    ids, mask = padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12)
    g_want = run_oracle(model, lambda: model.generate(**kw, do_sample=False,
                                                      past_key_values=oracle_cache("fp8_e4m3")))
    torch.manual_seed(7)
    s_want = run_oracle(model, lambda: model.generate(**kw, do_sample=True, top_k=0, temperature=1.5,
                                                      past_key_values=oracle_cache("fp8_e4m3")))
    enable(model, backend=BACKEND)
    g_got = model.generate(**kw, do_sample=False, past_key_values=FP8PagedCache.from_model(model))
    torch.manual_seed(7)
    s_got = model.generate(**kw, do_sample=True, top_k=0, temperature=1.5,
                           past_key_values=FP8PagedCache.from_model(model))
    assert torch.equal(g_got, g_want)
    assert torch.equal(s_got, s_want)
    assert not torch.equal(s_got, g_got)  # sampling did sample


@torch.no_grad()
def test_pool_grows_by_doubling_and_keeps_the_bytes():
    model = tiny_llama()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(5))
    kw = dict(input_ids=ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    enable(model, backend=BACKEND)
    grown = FP8PagedCache.from_model(model, block_size=2)
    fixed = FP8PagedCache.from_model(model, block_size=2, max_cache_len=64)
    a = model.generate(**kw, past_key_values=grown)
    b = model.generate(**kw, past_key_values=fixed)
    assert torch.equal(a, b)
    need = 2 * -(-(5 + 39) // 2)  # blocks for two rows of 44 tokens
    assert grown.pool.capacity >= need and grown.pool.growths <= 6  # 2 -> 4 -> ... doubling, not per token
    assert fixed.pool.growths == 0 and fixed.pool.capacity == 2 * 32
    assert grown.layer_cache(0).num_blocks == grown.pool.capacity


@torch.no_grad()
def test_max_cache_len_is_enforced():
    model = tiny_llama()
    cache = enable(model, max_cache_len=8, backend=BACKEND)
    with pytest.raises(fp8kv.Fp8KVError, match="max_cache_len"):
        model.generate(input_ids=torch.randint(3, 128, (1, 6)), max_new_tokens=5, min_new_tokens=5,
                       do_sample=False, past_key_values=cache)
    assert cache.get_max_length() == 8


@torch.no_grad()
def test_chunked_prefill_matches_oracle():
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(2))
    kw = dict(input_ids=ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, prefill_chunk_size=4,
              output_logits=True, return_dict_in_generate=True)
    want = run_oracle(model, lambda: model.generate(**kw, past_key_values=oracle_cache("fp8_e4m3")))
    cache = enable(model, backend=BACKEND)
    got = model.generate(**kw, past_key_values=cache)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=2e-4, rtol=1e-4)
    assert cache.pool.steps == 3 + 4  # 3 prefill chunks, 4 decode steps


@torch.no_grad()
def test_reset_makes_the_cache_reusable_and_batch_changes_need_it():
    model = tiny_llama()
    cache = enable(model, backend=BACKEND)
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(4))
    first = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    cache.reset()
    again = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert torch.equal(first, again)
    with pytest.raises(fp8kv.Fp8KVError, match="batch size"):
        model(input_ids=torch.randint(3, 128, (2, 1)), past_key_values=cache)


def test_sliding_window_model_matches_oracle():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=H, head_dim=D, sliding_window=3,
                        max_position_embeddings=256, pad_token_id=0)
    model = MistralForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = run_oracle(model, lambda: teacher_forced_logits(model, oracle_cache("fp8_e4m3"), ids, mask))
        cache = enable(model, backend=BACKEND)
        got = teacher_forced_logits(model, cache, ids, mask)
        model.config.sliding_window = None  # the same model without its window: logits must differ
        full = run_oracle(model, lambda: teacher_forced_logits(model, oracle_cache("fp8_e4m3"), ids, mask))
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(full[-1], want[-1], atol=1e-3)  # the window matters here


def test_soft_cap_and_alternating_windows_match_oracle():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=H, head_dim=D, sliding_window=3,
                       attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=D,
                       max_position_embeddings=256, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    with torch.no_grad():  # Gemma 2's soft-capping needs eager attention in transformers
        want = run_oracle(model, lambda: teacher_forced_logits(model, oracle_cache("fp8_e4m3"), ids, mask),
                          attn="eager")
        cache = enable(model, backend=BACKEND)
        got = teacher_forced_logits(model, cache, ids, mask)
        for m in model.modules():
            if hasattr(m, "attn_logit_softcapping"):
                m.attn_logit_softcapping = None
        fq = oracle_cache("fp8_e4m3")
        uncapped = run_oracle(model, lambda: teacher_forced_logits(model, fq, ids, mask), attn="eager")
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(uncapped[-1], want[-1], atol=1e-3)  # the cap matters here


def test_bytes_per_token():
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 3))
    per_tok = enable(model, backend=BACKEND)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=per_tok)
    assert per_tok.bf16_bytes_per_token == LAYERS * 2 * H * D * 2
    assert per_tok.bytes_per_token == LAYERS * (2 * H * D + 2 * H * 4)  # + float32 scale per token-head
    assert per_tok.bytes_per_token / per_tok.bf16_bytes_per_token == pytest.approx(0.5 + 2 / D)
    with pytest.warns(UserWarning, match="uncalibrated"):
        static = FP8PagedCache.from_model(model, scale_granularity="tensor")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=static)
    assert static.bytes_per_token / static.bf16_bytes_per_token == 0.5
    assert static.constant_bytes == LAYERS * 2 * 4


@torch.no_grad()
def test_calibrate_kv_scales_matches_amax():
    model = tiny_llama()
    ids, mask = padded_batch()
    ks, vs = calibrate_kv_scales(model, ids, mask, kv_dtype="fp8_e4m3", granularity="head")
    assert len(ks) == len(vs) == LAYERS and all(s.shape == (H,) for s in ks + vs)
    cache = Cache(layers=[DynamicLayer() for _ in range(LAYERS)])
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    real = mask.bool()
    for i in range(LAYERS):
        keys = cache.layers[i].keys.transpose(1, 2)[real]  # [tokens, H, D]
        torch.testing.assert_close(ks[i] * 448.0, keys.abs().amax(dim=(0, 2)))
    assert model.config._attn_implementation == "sdpa"  # left as it was


def test_plan_configures_the_cache():
    model = tiny_llama()
    plan = types.SimpleNamespace(
        kv_dtype="fp8_e5m2", scale_granularity="head", layout="HND",
        layer_scales=lambda i: (torch.full((H,), 0.5 + i), torch.full((H,), 0.25)))
    cache = FP8PagedCache.from_model(model, plan=plan, backend=BACKEND)
    enable(model, backend=BACKEND)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 3)), past_key_values=cache)
    kv = cache.layer_cache(1)
    assert (kv.kv_dtype, kv.scale_granularity, kv.layout) == ("fp8_e5m2", "head", "HND")
    assert kv.k_scale.tolist() == [1.5, 1.5] and kv.v_scale.tolist() == [0.25, 0.25]
    with pytest.raises(fp8kv.Fp8KVError, match="from the plan"):
        FP8PagedCache.from_model(model, plan=plan, kv_dtype="fp8_e4m3")
    with pytest.raises(fp8kv.Fp8KVError, match="FP8 plan"):
        FP8PagedCache.from_model(model, plan=types.SimpleNamespace(kv_dtype="auto", scale_granularity=None))


def test_resolve_kv_cache_plan_if_available():
    resolve = getattr(fp8kv, "resolve_kv_cache", None)
    if resolve is None:
        pytest.skip("fp8kv.resolve_kv_cache is not available in this checkout")
    model = tiny_llama()
    plan = resolve("fp8_e5m2", checkpoint=model.config.to_dict(), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # default 1.0 scales are expected here
        cache = FP8PagedCache.from_model(model, plan=plan, backend=BACKEND)
    enable(model, backend=BACKEND)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 3)), past_key_values=cache)
    assert cache.layer_cache(0).kv_dtype == "fp8_e5m2"
    assert cache.layer_cache(0).scale_granularity == plan.scale_granularity


@torch.no_grad()
def test_without_an_fp8kv_cache_the_error_says_what_to_pass():
    model = tiny_llama()
    enable(model, backend=BACKEND)
    with pytest.raises(fp8kv.Fp8KVError, match="FP8PagedCache"):
        model.generate(input_ids=torch.randint(3, 128, (1, 4)), max_new_tokens=2)
    disable(model)
    assert model.config._attn_implementation == "sdpa"
    model.generate(input_ids=torch.randint(3, 128, (1, 4)), max_new_tokens=2)


def test_a_cache_without_fp8kv_attention_is_an_error_not_wrong_outputs():
    """With another attention (sdpa), FP8PagedCache.update hands the model only the step's new keys:
    it would attend without the cache. The next update says so instead."""
    model = tiny_llama()
    register()
    model.set_attn_implementation("sdpa")
    cache = FP8PagedCache(model.config, backend=BACKEND)
    with pytest.raises(fp8kv.Fp8KVError, match=r"attn_implementation: layer 0's new keys .*\.enable\(model\)"):
        model(input_ids=torch.randint(3, 128, (1, 4)), past_key_values=cache, use_cache=True)
    cache.reset()
    enable(model, backend=BACKEND)
    try:
        model(input_ids=torch.randint(3, 128, (1, 4)), past_key_values=cache, use_cache=True)  # usable again
    finally:
        disable(model)


def test_unsupported_models_are_named():
    ns = types.SimpleNamespace
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                hidden_size=64)
    with pytest.raises(fp8kv.Fp8KVError, match="encoder-decoder"):
        model_shape(ns(**base, is_encoder_decoder=True))
    with pytest.raises(fp8kv.Fp8KVError, match="linear_attention"):
        model_shape(ns(**base, layer_types=["full_attention", "linear_attention"]))
    with pytest.raises(fp8kv.Fp8KVError, match="kv_lora_rank"):
        model_shape(ns(**base, kv_lora_rank=32))
    with pytest.raises(fp8kv.Fp8KVError, match="num_attention_heads"):
        model_shape(ns(num_hidden_layers=2))
    with pytest.raises(fp8kv.Fp8KVError, match="attention_chunk_size"):
        model_shape(ns(**base, attention_chunk_size=8))
    with pytest.raises(fp8kv.Fp8KVError, match="PreTrainedModel"):
        check_model(torch.nn.Linear(2, 2))
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=1,
                                             num_heads=2, decoder_start_token_id=0))
    with pytest.raises(fp8kv.Fp8KVError, match="encoder-decoder"):
        enable(t5)


def test_shape_of_smollm2_like_config():
    shape = model_shape(tiny_config(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                    head_dim=64, hidden_size=576))
    assert (shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_size) == (30, 9, 3, 64)


def test_eval_command_parses_without_loading_a_model():
    from fp8kv.cli import build_parser

    parser, modules = build_parser()
    args = parser.parse_args(["eval", "--caches", "none", "fp8kv-e4m3-token_head", "--tokens", "8"])
    assert args.command == "eval" and args.tokens == 8


def test_one_metadata_per_step_is_shared_by_every_layer(monkeypatch):
    """The step's checks and backend choice happen once (plan_attention), not once per layer."""
    model = tiny_llama()
    planned = []
    real_plan = _hf.plan_attention

    def spy(*args, **kw):
        planned.append(real_plan(*args, **kw))
        return planned[-1]

    monkeypatch.setattr(_hf, "plan_attention", spy)
    cache = enable(model, backend=BACKEND)
    steps = 4
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    model.generate(input_ids=ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, past_key_values=cache)
    assert len(planned) == steps  # one prefill + 3 decode steps, each shared by all LAYERS layers
    assert LAYERS > 1


# ------------------------------------------------------------------------------------ batch surgery


def _fp8kv_and_oracle(model, ids, mask):
    """An fp8kv cache and the oracle cache, both after the prefill of ``ids``; with the logits."""
    oracle = oracle_cache("fp8_e4m3")
    want = run_oracle(model, lambda: model(input_ids=ids, attention_mask=mask, past_key_values=oracle).logits)
    cache = enable(model, block_size=4, backend=BACKEND)
    got = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=1e-4)
    return cache, oracle


def _step_both(model, cache, oracle, tokens, mask):
    """One decode step of ``tokens`` ``[B, 1]`` through both caches; asserts equal logits."""
    want = run_oracle(model, lambda: model(input_ids=tokens, attention_mask=mask, past_key_values=oracle).logits)
    got = model(input_ids=tokens, attention_mask=mask, past_key_values=cache).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_reorder_select_repeat_and_crop_match_the_oracle():
    """Each operation applied to the fp8kv cache and to the oracle (a DynamicCache of
    fake-quantized K/V), then a decode step: the logits agree, rows and lengths follow."""
    model = tiny_llama()
    ids, mask = padded_batch()  # rows of 7 and 4 tokens
    cache, oracle = _fp8kv_and_oracle(model, ids, mask)
    lens = [7, 4]
    for op, arg in (("batch_repeat_interleave", 2), ("reorder_cache", torch.tensor([2, 2, 0, 1])),
                    ("batch_select_indices", torch.tensor([3, 0, 1]))):
        rows = torch.arange(len(lens)).repeat_interleave(2) if op == "batch_repeat_interleave" else arg
        getattr(cache, op)(arg)
        getattr(oracle, op)(arg)
        lens, mask = [lens[i] for i in rows.tolist()], mask[rows]
        assert cache.seq_lens == lens, op
        mask = torch.cat([mask, torch.ones(len(lens), 1, dtype=mask.dtype)], dim=1)
        _step_both(model, cache, oracle, torch.arange(20, 20 + len(lens))[:, None], mask)
        lens = [n + 1 for n in lens]
        assert cache.seq_lens == lens, op
    cache.crop(-1)
    oracle.crop(-1)
    assert cache.seq_lens == [n - 1 for n in lens] and cache.get_seq_length() == mask.shape[1] - 1
    _step_both(model, cache, oracle, torch.full((3, 1), 40), mask)


@torch.no_grad()
def test_freed_blocks_are_reused_and_copies_get_their_own():
    model = tiny_llama()
    ids, mask = padded_batch()
    cache, _ = _fp8kv_and_oracle(model, ids, mask)  # block_size 4: rows hold 2 and 1 blocks
    kv = cache.layer_cache(0)
    before = kv.key_cache.view(torch.uint8).clone()
    assert cache.block_tables == [[0, 1], [2]]
    cache.reorder_cache(torch.tensor([0, 0]))  # row 1 is dropped, row 0 doubled
    assert cache.block_tables == [[0, 1], [2, 3]]  # the copy reuses row 1's freed block, then a new one
    kv = cache.layer_cache(0)
    raw = kv.key_cache.view(torch.uint8)
    assert torch.equal(raw[[2, 3]], before[[0, 1]]) and torch.equal(raw[[0, 1]], before[[0, 1]])
    assert torch.equal(kv.k_scale[[2, 3]], kv.k_scale[[0, 1]])
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.block_tables == [[2, 3]] and cache.pool.free == [0, 1]


@torch.no_grad()
def test_beam_search_matches_the_oracle():
    model = tiny_llama(seed=3)
    ids, mask = padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=3,
              num_return_sequences=2, do_sample=False, output_scores=True, return_dict_in_generate=True)
    want = run_oracle(model, lambda: model.generate(**kw, past_key_values=oracle_cache("fp8_e4m3")))
    cache = enable(model, block_size=4, backend=BACKEND)
    got = model.generate(**kw, past_key_values=cache)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-4, rtol=1e-4)
    assert cache.pool.batch_size == 6 and len(cache.seq_lens) == 6


@pytest.mark.parametrize("how", ["assistant_model", "prompt_lookup"])
@torch.no_grad()
def test_assisted_decoding_crops_and_equals_greedy(how, monkeypatch):
    """Assisted and prompt-lookup decoding verify drafted tokens and crop the rejected ones: the
    result is the plain greedy result of the same FP8 cache."""
    model = tiny_llama(seed=3)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    ids[0, 6:9] = ids[0, 0:3]  # a repeat for prompt lookup to draft from
    kw = dict(input_ids=ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    enable(model, block_size=4, backend=BACKEND)
    plain = model.generate(**kw, past_key_values=FP8PagedCache.from_model(model))
    crops = []
    real_crop = FP8PagedCache.crop
    monkeypatch.setattr(FP8PagedCache, "crop", lambda self, n: (crops.append(n), real_crop(self, n))[1])
    extra = {"assistant_model": tiny_llama(seed=9)} if how == "assistant_model" else {"prompt_lookup_num_tokens": 3}
    cache = FP8PagedCache.from_model(model)
    got = model.generate(**kw, **extra, past_key_values=cache)
    assert torch.equal(got, plain)
    assert any(n < 0 for n in crops), crops  # drafts were rejected and cropped
    assert cache.seq_lens == [ids.shape[1] + 16 - 1]


def test_batch_surgery_errors_are_named():
    model = tiny_llama()
    ids, mask = padded_batch()
    cache, _ = _fp8kv_and_oracle(model, ids, mask)
    with pytest.raises(fp8kv.InvalidArgument, match="tokens_to_remove"):
        cache.crop(3)  # transformers' convention: -n removes n
    with pytest.raises(fp8kv.InvalidArgument, match="tokens_to_remove"):
        cache.crop(-5)  # row 1 holds 4 tokens
    with pytest.raises(fp8kv.InvalidArgument, match="index"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(fp8kv.InvalidArgument, match="indices"):
        cache.batch_select_indices(torch.tensor([True, False]))
    with pytest.raises(fp8kv.InvalidArgument, match="repeats"):
        cache.batch_repeat_interleave(0)
    with pytest.raises(NotImplementedError, match="FP8PagedCache"):
        cache.layers[0].reorder_cache(torch.tensor([0, 1]))
    with pytest.raises(NotImplementedError, match="offload"):
        cache.layers[0].offload()
    assert cache.seq_lens == [7, 4]  # nothing changed
    empty = FP8PagedCache.from_model(model)
    empty.batch_repeat_interleave(3)  # before the first forward: nothing to do, as DynamicCache
    assert empty.seq_lens == []


def test_block_tables_on_the_device_follow_the_rows():
    """The pool keeps its block tables as a tensor between steps and adds only new entries; after
    steps that cross blocks, growth, a rearrange and a crop it still equals the rows' tables."""
    from fp8kv.integrations._paging import BlockPool

    pool = BlockPool(block_size=2)
    valid = torch.tensor([[True, True, True], [False, True, True]])
    pool.step(valid, 2, 3, torch.device("cpu"), new=True)
    for n in range(7):
        plan = pool.step(None, 2, 1, torch.device("cpu"), new=True)
        width = max(len(t) for t in pool.tables)
        want = torch.tensor([t + [0] * (width - len(t)) for t in pool.tables], dtype=torch.int32)
        assert torch.equal(plan.block_tables, want), n
        if n == 3:
            pool.rearrange([1, 1])
        if n == 5:
            pool.crop(2)
    assert pool.seq_lens == [pool.seq_lens[0]] * 2
