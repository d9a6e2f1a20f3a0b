"""Precision statistics that hold: teacher-forced KL, top-1, perplexity change, greedy agreement.

Shared by ``fp8kv eval``, ``benchmarks/hf_precision.py``, ``benchmarks/hf_speed.py`` and the e2e
test. Importing it does not import transformers.

Why these statistics: the perplexity change of an FP8 cache over a few hundred tokens is mostly
float noise (the same code lands anywhere from +0.2% to +1% on one text), and greedy agreement
on 20 prompts flips with single near-ties. The mean KL divergence of the next-token
distributions from the unquantized run, and top-1 agreement, pooled over >= 2048 tokens, are
stable. What is measured:

* the text: the Python Language Reference as shipped with CPython (``pydoc_data.topics``: 79
  topics, ~465k characters), topics in sorted order, reflowed into prose paragraphs (code
  samples dropped). ``eval_text()`` returns it and names its SHA-256 and Python version;
* ``windows``: consecutive windows of ``prompt + predict`` tokens, run as one batch;
* teacher forcing: each window's prompt is one prefill, the rest of the window is fed as one
  further chunk, so every prediction reads the cache. For fp8kv (a token is quantized at write
  time, before any query reads it, with its own or a static scale), for transformers'
  ``QuantizedCache(backend="fp8")`` (scale frozen at the first update) and for the fake-quantized
  caches of this module that is the same as one token per forward: ``step=1`` runs it that way
  and the e2e test checks that both agree;
* per token: ``KL(unquantized || cache)``, whether the argmax agrees, the NLL of the true next
  token under both. Means pooled over all windows. Standard errors by batch means (blocks of
  ``BLOCK`` consecutive predictions inside a window), which accounts for the correlation of
  neighbouring tokens; the perplexity change and KL differences between two caches are paired
  (per-token differences, then batch means).
"""

from __future__ import annotations

import hashlib
import math
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

BLOCK = 32
"""Consecutive predictions per batch-means block for standard errors."""


# ------------------------------------------------------------------------------------ the text


def eval_text() -> tuple[str, str]:
    """``(text, source)``: the Python Language Reference shipped with CPython, reflowed.

    ``pydoc_data.topics.topics`` (the text ``help('assignment')`` prints), every topic in sorted
    key order, reflowed by :func:`fp8kv_bench.hf_eval._reflow` (prose paragraphs of >= 12 words;
    grammar and code blocks dropped). ``source`` names the Python version and the text's SHA-256.
    """
    from pydoc_data.topics import topics

    from .hf_eval import _reflow

    text = "\n\n".join(p for p in (_reflow(topics[k]) for k in sorted(topics)) if p)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return text, f"pydoc_data.topics of Python {platform.python_version()} (sorted topics, reflowed; " \
                 f"sha256 {digest})"


def windows(tokenizer, n_windows: int, length: int) -> torch.Tensor:
    """``[n_windows, length]`` token ids: consecutive windows from the start of :func:`eval_text`."""
    text, _ = eval_text()
    ids = torch.tensor(tokenizer(text).input_ids)
    if n_windows * length > ids.numel():
        raise ValueError(f"windows: {n_windows} x {length} tokens do not fit the text's {ids.numel()}")
    return ids[: n_windows * length].view(n_windows, length)


# ------------------------------------------------------------------------------------ fake-quantized caches

Transform = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(k, v, layer_idx, start) -> (k', v')``: what a cache stores for the new columns.

``k``/``v``: ``[B, H, T, D]``, the step's new columns, which sit at positions ``start ..
start + T - 1``; returns tensors of the same shape and dtype."""


def _transformed_layer_class():
    from transformers.cache_utils import DynamicLayer

    class TransformedLayer(DynamicLayer):
        """A ``DynamicLayer`` that stores ``transform(k, v)`` instead of ``k, v`` (fake quantization)."""

        def __init__(self, transform: Transform, layer_idx: int):
            super().__init__()
            self.transform, self.layer_idx, self.count = transform, layer_idx, 0

        def update(self, key_states, value_states, *args, **kwargs):
            k, v = self.transform(key_states, value_states, self.layer_idx, self.count)
            self.count += key_states.shape[-2]
            return super().update(k, v)

    return TransformedLayer


_LAYER_CLASS = None


def transformed_cache(config, transform: Transform):
    """A transformers ``Cache`` (SDPA attention) whose layers store ``transform(k, v)``."""
    global _LAYER_CLASS
    from transformers.cache_utils import Cache

    from fp8kv.integrations.transformers import model_shape

    if _LAYER_CLASS is None:
        _LAYER_CLASS = _transformed_layer_class()
    n = model_shape(config).num_layers
    return Cache(layers=[_LAYER_CLASS(transform, i) for i in range(n)])


def bf16_round(k: torch.Tensor, v: torch.Tensor, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a bf16 cache stores: K/V rounded to bf16 (returned in their own dtype)."""
    return k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)


def fake_fp8(x: torch.Tensor, kv_dtype: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` with fp8kv's own codec: ``x`` ``[B, H, T, D]``.

    ``scale``: None for per-token-head scales (:func:`fp8kv.scales.token_head_scale`), else a
    static dequant scale broadcastable to ``[B, H, T, 1]`` (``()`` or ``[1, H, 1, 1]``).
    """
    from fp8kv.formats import dequantize, get_format, quantize
    from fp8kv.scales import token_head_scale

    fmt = get_format(kv_dtype)
    s = token_head_scale(x, fmt)[..., None] if scale is None else scale
    return dequantize(quantize(x, fmt, s), s, dtype=x.dtype)


def fake_fp8_transform(kv_dtype: str) -> Transform:
    """Per-token-head fake quantization of K and V (the semantics of fp8kv's token_head cache)."""
    def transform(k, v, layer, start):
        return fake_fp8(k, kv_dtype), fake_fp8(v, kv_dtype)
    return transform


# ------------------------------------------------------------------------------------ cache makers


def default_backend(device) -> str:
    """The fp8kv backend the harness uses by default: on the CPU the batched ``torch`` backend when
    installed (the reference's semantics, much faster on batches), else the reference; elsewhere
    ``auto``."""
    from fp8kv.registry import available_backends

    if torch.device(device).type != "cpu":
        return "auto"
    return "torch" if "torch" in available_backends() else "reference"


@dataclass
class Maker:
    """A named maker of fresh caches; sets the model's attention implementation for them."""

    name: str
    new_cache: Callable[[], object]
    attn: str = "sdpa"

    def __call__(self, model):
        if model.config._attn_implementation != self.attn:
            model.set_attn_implementation(self.attn)
        return self.new_cache()


def standard_makers(model, names: Iterable[str], backend: str, calibration_ids: torch.Tensor,
                    margin: float = 1.0) -> list[Maker]:
    """Makers for ``none``, ``bf16-kv``, ``hf-fp8`` and ``fp8kv-<fmt>-<granularity>`` caches.

    ``bf16-kv``: a cache holding K/V rounded to bf16 (the noise floor of any 16-bit cache);
    static fp8kv scales are calibrated on ``calibration_ids`` (never on the evaluated text).
    """
    from .hf_eval import CacheMaker, CacheSpec

    out = []
    for name in names:
        if name == "bf16-kv":
            out.append(Maker(name, lambda: transformed_cache(model.config, bf16_round)))
            continue
        spec = CacheSpec.parse(name)
        # the FP8 attention mode: the backends that serve it (hopper on sm90, else the reference)
        cm = CacheMaker(model, spec, backend="auto" if spec.fp8_attention else backend,
                        calibration_ids=calibration_ids, margin=margin)
        attn = "fp8kv" if spec.kind == "fp8kv" else "sdpa"
        out.append(Maker(name, cm, attn))
    return out


TRANSFORMS = {  # name -> FP8PagedCache arguments beyond the format (the shipped transforms, fp8kv.transforms)
    "": {},
    "sink1": {"sink_tokens": 1},
    "kcenter": {"k_centering": "prefill"},
    "sink1+kcenter": {"sink_tokens": 1, "k_centering": "prefill"},
    "sink1+kcenter(calibrated)": {"sink_tokens": 1, "k_centering": "calibrated"},
    "sink4+kcenter": {"sink_tokens": 4, "k_centering": "prefill"},
    "static": {"static": True, "max_cache_len": 1024},
    "sink1+kcenter+static": {"sink_tokens": 1, "k_centering": "prefill", "static": True, "max_cache_len": 1024},
}
"""``FP8PagedCache(sink_tokens=, k_centering=, static=)`` variants: ``sink1`` keeps each row's first token
unquantized, ``kcenter`` stores K minus a per-row, per-channel mean (from the prefill, or ``calibrated``
on another text), ``static`` the CUDA-graph-ready cache."""


def transform_maker(model, name: str, backend: str, k_means=None) -> Maker:
    """A maker of fp8kv caches ``"<e4m3|e5m2>[ <variant of TRANSFORMS>]"`` with per-token-head scales;
    ``k_means``: :func:`calibrated_key_means` for the ``(calibrated)`` variants."""
    from fp8kv.integrations.transformers import FP8PagedCache, register

    register()
    fmt, _, variant = name.partition(" ")
    kw = dict(TRANSFORMS[variant])
    if kw.get("k_centering") == "calibrated":
        kw["k_means"] = k_means
    return Maker(name, lambda: FP8PagedCache(model.config, kv_dtype="fp8_" + fmt, backend=backend, **kw), "fp8kv")


@torch.inference_mode()
def calibrated_key_means(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer key means of the unquantized model over ``ids [1, T]`` (position 0, the sink, left out)."""
    from transformers.cache_utils import DynamicCache

    from fp8kv.transforms import calibrate_key_means

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return calibrate_key_means([layer.keys for layer in cache.layers], skip_first=1)


# ------------------------------------------------------------------------------------ teacher forcing


@torch.inference_mode()
def teacher_forced_logprobs(model, ids: torch.Tensor, prompt_len: int, maker: Maker, *,
                            step: int | None = None) -> torch.Tensor:
    """Log-probabilities of each window's next tokens after its prompt, reading the cache.

    Args:
        ids: ``[B, T]`` token ids (B windows of T tokens, no padding).
        prompt_len: tokens of each window's prefill (>= 1).
        step: tokens per forward after the prefill (None: the rest of the window in one chunk;
            1: one token per forward, like decoding).
    Returns:
        ``[B, T - prompt_len, vocab]`` float32 on the CPU: row ``j`` predicts ``ids[:, prompt_len + j]``.
    """
    B, T = ids.shape
    if not 1 <= prompt_len < T:
        raise ValueError(f"prompt_len: got {prompt_len}, expected 1 <= prompt_len < {T}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = maker(model)
    out = model(input_ids=ids[:, :prompt_len], past_key_values=cache, use_cache=True)
    parts = [torch.log_softmax(out.logits[:, -1:].float(), dim=-1).cpu()]
    step = step or T
    for i in range(prompt_len, T - 1, step):
        j = min(i + step, T - 1)
        out = model(input_ids=ids[:, i:j], past_key_values=cache, use_cache=True)
        parts.append(torch.log_softmax(out.logits.float(), dim=-1).cpu())
        del out
    return torch.cat(parts, dim=1)


def batch_means_se(x: torch.Tensor, block: int = BLOCK) -> float:
    """Standard error of ``x.mean()`` for ``x`` ``[B, n]`` (B windows) by batch means.

    Each window is cut into blocks of ``block`` consecutive values (a last partial block is
    dropped from the error estimate only); the error is ``std(block means) / sqrt(blocks)``.
    """
    B, n = x.shape
    nb = n // block
    if nb == 0 or B * nb < 2:
        return float("nan")
    means = x[:, : nb * block].reshape(B * nb, block).double().mean(dim=1)
    return float(means.std() / math.sqrt(means.numel()))


@dataclass
class Reference:
    """The unquantized run: log-probabilities ``[B, n, V]``, argmax and NLL of the true tokens."""

    logprobs: torch.Tensor
    targets: torch.Tensor

    @property
    def nll(self) -> torch.Tensor:
        return -self.logprobs.gather(-1, self.targets[..., None])[..., 0].double()

    @property
    def top1(self) -> torch.Tensor:
        return self.logprobs.argmax(dim=-1)


def per_token(ref: Reference, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token ``kl``, ``agree`` (top-1) and ``dnll`` (NLL change), each ``[B, n]`` float64."""
    p = ref.logprobs.exp()
    kl = (p * (ref.logprobs - logprobs)).sum(dim=-1).double().clamp_min(0.0)
    agree = (logprobs.argmax(dim=-1) == ref.top1).double()
    nll = -logprobs.gather(-1, ref.targets[..., None])[..., 0].double()
    return {"kl": kl, "agree": agree, "dnll": nll - ref.nll}


def summarize(ref: Reference, tok: dict[str, torch.Tensor]) -> dict:
    """Pooled means and batch-means standard errors of :func:`per_token`'s values."""
    ref_nll = float(ref.nll.mean())
    dnll = float(tok["dnll"].mean())
    return {
        "n": int(tok["kl"].numel()),
        "kl": float(tok["kl"].mean()), "kl_se": batch_means_se(tok["kl"]),
        "top1": float(tok["agree"].mean()), "top1_se": batch_means_se(tok["agree"]),
        "ppl": math.exp(ref_nll + dnll), "ppl_ref": math.exp(ref_nll),
        "ppl_change_pct": 100.0 * math.expm1(dnll), "ppl_change_se_pct": 100.0 * batch_means_se(tok["dnll"]),
    }


def paired_kl_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """``KL(a) - KL(b)`` per token, pooled: mean, paired standard error and ratio ``KL(a) / KL(b)``."""
    d = a["kl"] - b["kl"]
    return {"diff": float(d.mean()), "diff_se": batch_means_se(d),
            "ratio": float(a["kl"].mean() / b["kl"].mean())}


def kl_rows(model, ids: torch.Tensor, prompt_len: int, makers: list[Maker], *, step: int | None = None,
            log=print, keep: bool = False) -> tuple[list[dict], dict]:
    """Teacher-forced statistics of every cache against the first maker (the unquantized one).

    Returns ``(rows, per_token_values)``: one summary row per maker (the first has only
    ``ppl_ref``) and, when ``keep``, each maker's :func:`per_token` tensors by name (for paired
    comparisons).
    """
    targets = ids[:, prompt_len:]
    t0 = time.perf_counter()
    ref = Reference(teacher_forced_logprobs(model, ids, prompt_len, makers[0], step=step), targets)
    base = {"cache": makers[0].name, "prompt_len": prompt_len, "n": int(targets.numel()),
            "ppl": math.exp(float(ref.nll.mean())), "seconds": time.perf_counter() - t0}
    log(f"  {makers[0].name:28s} prompt {prompt_len:4d}: ppl {base['ppl']:.4f} over {base['n']} tokens "
        f"[{base['seconds']:.0f}s]")
    rows, kept = [base], {}
    for m in makers[1:]:
        t0 = time.perf_counter()
        lp = teacher_forced_logprobs(model, ids, prompt_len, m, step=step)
        tok = per_token(ref, lp)
        del lp
        row = {"cache": m.name, "prompt_len": prompt_len, **summarize(ref, tok),
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        if keep:
            kept[m.name] = tok
        log(f"  {m.name:28s} prompt {prompt_len:4d}: KL {row['kl']:.5f} +- {row['kl_se']:.5f}, top-1 "
            f"{100 * row['top1']:.2f}% +- {100 * row['top1_se']:.2f}, ppl {row['ppl_change_pct']:+.3f}% +- "
            f"{row['ppl_change_se_pct']:.3f} [{row['seconds']:.0f}s]")
    return rows, kept


# ------------------------------------------------------------------------------------ greedy agreement


@torch.inference_mode()
def greedy_batch(model, tokenizer, prompts: list[str], max_new_tokens: int, maker: Maker) -> list[list[int]]:
    """Greedy continuations of all ``prompts`` in one left-padded ``generate`` call."""
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True).to(device)
    finally:
        tokenizer.padding_side = side
    cache = maker(model)
    seq = model.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         past_key_values=cache, pad_token_id=tokenizer.pad_token_id)
    return seq[:, enc.input_ids.shape[1]:].tolist()


def greedy_rows(model, tokenizer, prompts: list[str], max_new_tokens: int, makers: list[Maker],
                log=print) -> list[dict]:
    """Greedy agreement of every maker with the first (unquantized): identical continuations and
    the mean length of the common prefix. Include ``bf16-kv`` to see the noise floor."""
    rows, conts = [], []
    for m in makers:
        t0 = time.perf_counter()
        c = greedy_batch(model, tokenizer, prompts, max_new_tokens, m)
        conts.append(c)
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
                  for a, b in zip(c, conts[0], strict=True)]
        row = {"cache": m.name, "prompts": len(prompts), "new_tokens": max_new_tokens,
               "identical": sum(p == max_new_tokens for p in prefix),
               "mean_matching_prefix": sum(prefix) / len(prefix), "continuations": c}
        rows.append(row)
        log(f"  greedy {m.name:28s} identical {row['identical']}/{len(prompts)}, mean matching prefix "
            f"{row['mean_matching_prefix']:.1f}/{max_new_tokens} [{time.perf_counter() - t0:.0f}s]")
    return rows
