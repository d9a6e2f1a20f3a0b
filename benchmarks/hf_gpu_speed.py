"""generate() tokens/s on a GPU: bf16 transformers cache (SDPA) vs the fp8kv FP8 paged cache.

The model is SmolLM2-135M's architecture (Llama: 30 layers, hidden 576, 9 query / 3 KV heads,
head size 64) with random weights: throughput does not depend on the weights, and the real
GGUF (98 MB) does not travel to the GPU machine. Quality is measured on the real model by
``benchmarks/hf_generate.py``. Usage::

    FP8KV_CHECK=shapes python benchmarks/hf_gpu_speed.py --out benchmarks/results/hf_speed_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

import fp8kv
from fp8kv.integrations.transformers import FP8PagedCache, enable


def smollm2_shaped_model(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int, make_cache, repeats: int = 3) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=model.device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up (and compiles the kernels)
        sync(model.device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, past_key_values=make_cache(), pad_token_id=0)
        sync(model.device)
        best = min(best, time.perf_counter() - t0)
    return batch * new_tokens / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    import transformers

    model = smollm2_shaped_model(args.device, torch.bfloat16)
    rows = []
    for batch in args.batch:
        base = tokens_per_s(model, batch, args.prompt_len, args.new_tokens, lambda: None)  # transformers' own
        enable(model, kv_dtype="fp8_e4m3", scale_granularity="token_head", backend="auto")
        fp8 = tokens_per_s(model, batch, args.prompt_len, args.new_tokens, lambda: FP8PagedCache.from_model(model))
        model.set_attn_implementation("sdpa")
        spec = fp8kv.KVCache.allocate(1, 16, 3, 64, kv_dtype="fp8_e4m3", scale_granularity="token_head",
                                      device=model.device).spec  # SmolLM2's: 3 KV heads of 64
        sel = fp8kv.select_backend(fp8kv.Request.for_attention(spec, torch.bfloat16), model.device)
        rows.append(dict(batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                         bf16_sdpa_tokens_per_s=base, fp8kv_tokens_per_s=fp8, ratio=fp8 / base,
                         fp8kv_backend=sel.backend.name))
        print(rows[-1], flush=True)
    gpu = model.device.type == "cuda"
    env = dict(device=torch.cuda.get_device_name() if gpu else "cpu", torch=torch.__version__,
               transformers=transformers.__version__,
               fp8kv=fp8kv.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               value_checks=os.environ.get("FP8KV_CHECK", "full"),
               model="SmolLM2-135M architecture, random weights, bfloat16", cache="fp8_e4m3 token_head")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
