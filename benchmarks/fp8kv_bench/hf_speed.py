"""Decode speed of transformers generation with the fp8kv FP8 cache against transformers' own caches.

Two models, by device (``--model``):

* ``llama-1b`` (the default on a GPU): a 1B-class Llama with random bf16 weights (Llama-3.2-1B's shape:
  16 layers, hidden 2048, 32 query / 8 KV heads of 64, MLP 8192, vocab 128256: throughput does not
  depend on the weights). For each context (``--contexts``: 1k, 8k, 32k tokens) and batch (1, 16) it
  prefills the context in column chunks, then times ``--steps`` greedy decode steps after 3 warm-up
  steps, for the caches ``dynamic`` (transformers' default ``DynamicCache``, bf16, SDPA), ``static``
  (``StaticCache``, eager), ``static+graph`` (the decode step captured in a CUDA graph, transformers'
  static-cache pattern), ``fp8kv`` (``FP8PagedCache``, e4m3 per-token-head scales, the pool allocated with
  ``max_cache_len``, eager, ``FP8KV_CHECK=shapes``), ``fp8kv+graph`` (``static=True``, captured like
  ``static+graph``) and ``fp8kv-sk+graph`` (plus the shipped transform: ``sink_tokens=1``,
  ``k_centering="prefill"``). Contexts run 8k first; rows that would start after ``--budget-s`` seconds
  are recorded as skipped. ``--smoke``: a tiny 2-layer model, any device.
* ``smollm2`` (the default on the CPU): SmolLM2-135M-Instruct ``generate()`` of ``--new-tokens`` tokens
  at batch 1, in ``--rounds`` rounds that each run every cache once in turn (so load changes hit all
  alike): the unquantized ``DynamicCache``, fp8kv e4m3 with per-token-head scales and its variants
  (``--variants``: the shipped transform, ``static=True``, both); ratios are medians of the per-round
  ratios.

Ends with a table and a bar chart.

    python benchmarks/hf_speed.py       # GPU: -> benchmarks/results/hf_speed_<gpu>.json (~5 min on an H100)
    python benchmarks/hf_speed.py --model smollm2 --rounds 7    # CPU: -> benchmarks/results/hf_speed_cpu.json
    python benchmarks/hf_speed.py --model smollm2 --rounds 1 --new-tokens 8 --out /tmp/hf_speed_tiny.json
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback

import torch

from . import hf_eval, hf_kl
from .results import log, markdown, progress, record, title

NAME = "hf_speed"
CACHES = ("dynamic", "static", "static+graph", "fp8kv", "fp8kv+graph", "fp8kv-sk+graph")
GRAPH = ("static+graph", "fp8kv+graph", "fp8kv-sk+graph")
VARIANTS = ("sink1+kcenter", "static", "sink1+kcenter+static")


def add_arguments(p) -> None:
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--model", choices=("auto", "llama-1b", "smollm2"), default="auto",
                   help="auto (default): llama-1b on a GPU, smollm2 on the CPU")
    p.add_argument("--backend", default=None, help="fp8kv backend (default auto on a GPU; torch, else reference, "
                   "on the CPU)")
    g = p.add_argument_group("llama-1b")
    g.add_argument("--contexts", type=int, nargs="+", default=None, help="default 8192 1024 32768 (smoke: 32 64)")
    g.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 16 (smoke: 1 2)")
    g.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; smoke 4)")
    g.add_argument("--chunk", type=int, default=None, help="prefill columns per forward (default 2048; smoke 16)")
    g.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    g.add_argument("--smoke", action="store_true", help="tiny shapes, any device: tests the benchmark")
    g.add_argument("--budget-s", type=float, default=270.0, help="rows that would start later are skipped")
    g = p.add_argument_group("smollm2")
    g.add_argument("--rounds", type=int, default=5, help="timed rounds, each running every cache once (default 5)")
    g.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    g.add_argument("--variants", nargs="*", default=list(VARIANTS),
                   help="fp8kv e4m3 variants beside the plain cache (default %(default)s)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


# ------------------------------------------------------------------------------------ llama-1b


def llama_1b_config(smoke: bool):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                           tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                       rope_theta=500000.0, tie_word_embeddings=True, attn_implementation="sdpa")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_cache(kind: str, model, max_len: int, backend: str):
    """A fresh cache for the row ``kind`` (one of :data:`CACHES`; ``+graph`` rows get static caches)."""
    from transformers.cache_utils import DynamicCache, StaticCache

    from fp8kv.integrations.transformers import FP8PagedCache, enable

    if kind.startswith("fp8kv"):
        enable(model, kv_dtype="fp8_e4m3", scale_granularity="token_head", backend=backend)
        kw = {"static": True} if kind in GRAPH else {}
        if kind.startswith("fp8kv-sk"):
            kw.update(sink_tokens=1, k_centering="prefill")
        return FP8PagedCache.from_model(model, max_cache_len=max_len, **kw)
    model.set_attn_implementation("sdpa")
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    assert kind in ("static", "static+graph"), kind
    return StaticCache(config=model.config, max_cache_len=max_len)


@torch.inference_mode()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids`` ``[B, T]`` in column chunks; return the next tokens ``[B, 1]`` (argmax)."""
    T = ids.shape[1]
    for i in range(0, T, chunk):
        j = min(i + chunk, T)
        pos = torch.arange(i, j, device=ids.device)
        out = model(input_ids=ids[:, i:j], past_key_values=cache, use_cache=True, cache_position=pos,
                    logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.inference_mode()
def time_eager_step(model, cache, tok: torch.Tensor, start: int, steps: int, warmup: int = 3) -> float:
    """Seconds per decode step (mean over ``steps`` after ``warmup``), eager."""
    dev = tok.device
    pos = start
    for n in range(warmup + steps):
        if n == warmup:
            sync(dev)
            t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([pos], device=dev), logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        pos += 1
    sync(dev)
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def time_graph_step(model, cache, tok: torch.Tensor, start: int, steps: int, warmup: int = 3) -> float:
    """Seconds per decode step with the step captured once in a CUDA graph and replayed."""
    dev = tok.device
    B = tok.shape[0]
    static_tok = tok.clone()
    static_pos = torch.tensor([start], device=dev)
    static_ids = static_pos.expand(B, 1).clone()

    def step():
        out = model(input_ids=static_tok, past_key_values=cache, use_cache=True, cache_position=static_pos,
                    position_ids=static_ids, logits_to_keep=1)
        return out.logits[:, -1:].argmax(-1)

    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(warmup):  # warm up on a side stream (cuBLAS handles, lazy inits)
            nxt = step()
            static_tok.copy_(nxt)
            static_pos.add_(1)
            static_ids.add_(1)
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nxt = step()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
        static_tok.copy_(nxt)
        static_pos.add_(1)
        static_ids.add_(1)
    sync(dev)
    return (time.perf_counter() - t0) / steps


def run_one(model, kind: str, ctx: int, batch: int, steps: int, chunk: int, backend: str) -> dict:
    dev = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(ctx * 31 + batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, ctx), generator=g).to(dev)
    row = {"cache": kind, "context": ctx, "batch": batch, "steps": steps}
    cache = None
    try:
        cache = make_cache(kind, model, ctx + steps + 8, backend)
        t0 = time.perf_counter()
        tok = prefill(model, cache, ids, chunk)
        sync(dev)
        row["prefill_s"] = time.perf_counter() - t0
        timer = time_graph_step if kind in GRAPH else time_eager_step
        if kind in GRAPH and dev.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        sec = timer(model, cache, tok, ctx, steps)
        row.update(step_ms=1e3 * sec, tokens_per_s=batch / sec)
    except Exception as exc:  # noqa: BLE001 -- a failed row is reported, the run goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        row["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
    finally:
        del cache
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return row


def selected_backend(model, backend: str) -> str:
    """The backend that serves the model's fp8kv attention (e4m3, per-token-head scales) here."""
    import fp8kv

    from . import kernels

    cfg = model.config
    cache = fp8kv.KVCache.allocate(1, 16, cfg.num_key_value_heads, cfg.head_dim, kv_dtype="fp8_e4m3",
                                   scale_granularity="token_head", device=model.device)
    return kernels._backend(backend, "paged_attention", cache, model.dtype, model.device).name


def targets(rows: list[dict]) -> list[dict]:
    """The targets: the fp8kv caches against ``dynamic`` at an 8k context, batch 1 (>= 1.0x)
    and 16 (>= 1.3x)."""
    out = []
    tps = {(r["cache"], r["context"], r["batch"]): r.get("tokens_per_s") for r in rows}
    for kind in ("fp8kv", "fp8kv+graph", "fp8kv-sk+graph"):
        for b, want in ((1, 1.0), (16, 1.3)):
            a, d = tps.get((kind, 8192, b)), tps.get(("dynamic", 8192, b))
            t = {"cache": kind, "context": 8192, "batch": b, "target": want}
            if a and d:
                t.update(ratio=a / d, met=a / d >= want)
            out.append(t)
    return out




# ------------------------------------------------------------------------------------ smollm2


def smollm2(args, device) -> dict:
    """generate() tokens/s of SmolLM2 with each cache, in rounds (one call of each cache a round)."""
    from transformers.cache_utils import DynamicCache

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, tok = hf_eval.load_smollm2(device, dtype)
    backend = args.backend or hf_kl.default_backend(device)
    makers = [hf_kl.Maker("none", lambda: DynamicCache(config=model.config))]
    makers += [hf_kl.transform_maker(model, f"e4m3 {v}".strip(), backend) for v in ["", *args.variants]]
    rec = record(NAME, device, model="SmolLM2-135M-Instruct (GGUF Q4_1 -> " + str(dtype).removeprefix("torch.") + ")",
                 backend=backend, torch_backend_c_loops=_c_loops(), load_average_start=os.getloadavg())
    per = {m.name: [] for m in makers}
    t0 = time.perf_counter()
    for r in progress(range(args.rounds), "generate rounds"):
        for m in makers:
            res = hf_eval.generate_speed(model, tok, lambda m=m: m(model), max_new_tokens=args.new_tokens, repeats=1)
            per[m.name].append(res["tokens_per_s"])
        log(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in per.items()))
    base, ref = makers[0].name, makers[1].name
    ratio = lambda to: {k: statistics.median(a / b for a, b in zip(v, per[to], strict=True))  # noqa: E731
                        for k, v in per.items()}
    rec["speed"] = {"rounds": args.rounds, "new_tokens": args.new_tokens, "batch": 1, "tokens_per_s": per,
                    "best_tokens_per_s": {k: max(v) for k, v in per.items()},
                    f"median_ratio_vs_{base}": ratio(base), "median_ratio_vs_fp8kv": ratio(ref)}
    rec["environment"]["load_average_end"] = os.getloadavg()
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _c_loops() -> str:
    try:
        from fp8kv_torch import native
    except ImportError:
        return "torch backend not installed"
    return native.status()


# ------------------------------------------------------------------------------------ the benchmark


def run(args) -> dict:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model if args.model != "auto" else ("llama-1b" if dev.type == "cuda" else "smollm2")
    return llama(args, dev) if model == "llama-1b" else smollm2(args, dev)


def llama(args, dev) -> dict:
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        raise SystemExit("hf_speed: transformers is not installed here; it needs the 'hf' extra "
                         "(pip install 'fp8kv[hf]')") from None
    backend = args.backend or ("auto" if dev.type == "cuda" else "reference")
    os.environ.setdefault("FP8KV_CHECK", "shapes")
    contexts = args.contexts or ([32, 64] if args.smoke else [8192, 1024, 32768])
    batches = args.batch or ([1, 2] if args.smoke else [1, 16])
    steps = args.steps or (4 if args.smoke else 32)
    chunk = args.chunk or (16 if args.smoke else 2048)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    t_all = time.perf_counter()
    with torch.device(dev):  # initialise on the device: 1.2B random weights on a CPU take long
        model = LlamaForCausalLM._from_config(llama_1b_config(args.smoke), dtype=dtype).eval()
    rec = record(NAME, dev)
    env = rec["environment"]
    env.update(model="Llama-3.2-1B shape, random weights" if not args.smoke else "tiny Llama (smoke)",
               dtype=str(dtype).removeprefix("torch."), fp8kv_cache="fp8_e4m3 token_head, block 16",
               fp8kv_backend_requested=backend, fp8kv_backend=selected_backend(model, backend),
               fp8kv_check=os.environ.get("FP8KV_CHECK", "full"), smoke=args.smoke,
               params=sum(p.numel() for p in model.parameters()))
    log(f"{env['device']}: {env['model']}, {env['params'] / 1e9:.2f}B params, {env['dtype']}; fp8kv backend "
        f"{env['fp8kv_backend']}")
    # per context, graph captures after the eager rows (a failed capture can leave the CUDA context unusable)
    jobs = [(c, b, k) for c in contexts for graph in (False, True) for b in batches for k in args.caches
            if (k in GRAPH) == graph]
    rows = []
    for ctx, b, kind in progress(jobs, "decode"):
        if time.perf_counter() - t_all > args.budget_s:
            rows.append({"cache": kind, "context": ctx, "batch": b, "steps": steps,
                         "error": f"skipped: time budget of {args.budget_s:.0f}s spent"})
            log(f"  context {ctx:6d} batch {b:3d} {kind:13s} skipped (time budget)")
            continue
        rows.append(run_one(model, kind, ctx, b, steps, chunk, backend))
        r = rows[-1]
        log(f"  context {ctx:6d} batch {b:3d} {kind:13s} " + (
            f"{r['step_ms']:8.2f} ms/step {r['tokens_per_s']:9.1f} tokens/s (prefill {r['prefill_s']:.1f}s)"
            if "tokens_per_s" in r else f"failed: {r['error']}"))
    order = {k: i for i, k in enumerate(CACHES)}
    rows.sort(key=lambda r: (r["context"], r["batch"], order[r["cache"]]))
    rec.update(config={"contexts": contexts, "batches": batches, "steps": steps, "prefill_chunk": chunk,
                       "warmup_steps": 3}, rows=rows, targets=targets(rows), seconds=time.perf_counter() - t_all)
    return rec


# ------------------------------------------------------------------------------------ table and plot


def table(rec: dict) -> str:
    if "speed" in rec:
        sp = rec["speed"]
        base = next(k for k in sp if k.startswith("median_ratio_vs_") and not k.endswith("fp8kv"))
        rows = [[k, f"{sp['best_tokens_per_s'][k]:.2f}", f"{statistics.median(v):.2f}", f"{sp[base][k]:.3f}x",
                 f"{sp['median_ratio_vs_fp8kv'][k]:.3f}x" if "median_ratio_vs_fp8kv" in sp else "-"]
                for k, v in sp["tokens_per_s"].items()]
        return (f"{title(rec)}\ngenerate() of {sp['new_tokens']} tokens at batch {sp['batch']}, {sp['rounds']} rounds\n"
                + markdown(["cache", "best tokens/s", "median tokens/s", "vs unquantized (median of rounds)",
                            "vs fp8kv e4m3"], rows))
    rows = rec["rows"]
    base = {(r["context"], r["batch"]): r for r in rows if r["cache"] == "dynamic" and "tokens_per_s" in r}
    static = {(r["context"], r["batch"]): r for r in rows if r["cache"] == "static+graph" and "tokens_per_s" in r}
    out = []
    for r in rows:
        key = (r["context"], r["batch"])
        if "tokens_per_s" not in r:
            out.append([r["context"], r["batch"], r["cache"], "failed: " + r["error"][:60], "", "", ""])
            continue
        vs = [f"{r['tokens_per_s'] / d[key]['tokens_per_s']:.2f}x" if key in d else "-" for d in (base, static)]
        out.append([r["context"], r["batch"], r["cache"], f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.1f}", *vs])
    lines = [title(rec), markdown(["context", "batch", "cache", "ms/step", "tokens/s", "vs dynamic",
                                   "vs static+graph"], out)]
    for t in rec.get("targets", []):
        lines.append(f"target {t['cache']} vs dynamic at context {t['context']}, batch {t['batch']}: "
                     f"{t.get('ratio', float('nan')):.2f}x (target >= {t['target']}x)")
    return "\n".join(lines)


def plot(rec: dict, plt):
    if "speed" in rec:
        sp = rec["speed"]
        labels = list(sp["tokens_per_s"])
        fig, ax = plt.subplots(figsize=(9, 4))
        for j, (key, name) in enumerate((("best", "best round"), ("median", "median round"))):
            vals = [sp["best_tokens_per_s"][k] if key == "best" else statistics.median(sp["tokens_per_s"][k])
                    for k in labels]
            bars = ax.bar([i + (j - 0.5) * 0.4 for i in range(len(labels))], vals, 0.4, label=name)
            for bar, v in zip(bars, vals, strict=True):
                ax.annotate(f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
        base = next(k for k in sp if k.startswith("median_ratio_vs_") and not k.endswith("fp8kv"))
        ax.set_xticks(range(len(labels)), [f"{k}\n{sp[base][k]:.3f}x" for k in labels], fontsize=7)
        ax.set_ylabel("generate() tokens/s")
        ax.set_title(f"{rec.get('model', 'SmolLM2-135M-Instruct')} generate, batch {sp['batch']}, {sp['new_tokens']} "
                     f"new tokens, {sp['rounds']} rounds (label: median ratio to the unquantized cache)\n{title(rec)}",
                     fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig
    rows = rec["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        ctxs = sorted({r["context"] for r in rows if r["batch"] == b})
        width = 0.8 / len(CACHES)
        for i, kind in enumerate(CACHES):
            vals = [next((r.get("tokens_per_s", 0.0) for r in rows if (r["cache"], r["context"], r["batch"]) ==
                          (kind, c, b)), 0.0) for c in ctxs]
            ax.bar([x + (i - (len(CACHES) - 1) / 2) * width for x in range(len(ctxs))], vals, width, label=kind)
        ax.set_xticks(range(len(ctxs)), [f"{c // 1024}k" if c >= 1024 else str(c) for c in ctxs])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {b}", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"1B-class Llama (random bf16 weights), {title(rec)}", fontsize=9)
    fig.tight_layout()
    return fig
