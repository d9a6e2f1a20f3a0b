"""Where an eager decode step's host time goes, per transformers cache, on a CUDA GPU.

Why ``benchmarks/hf_speed.py``'s ``dynamic`` baseline (transformers' default ``DynamicCache``, SDPA) is
so slow in eager mode: it profiles decode steps 6-8 after a 1k-token prefill at batch 1 of the
same 1B-class Llama (random bf16 weights) with ``dynamic``, ``static`` and ``fp8kv`` caches, and
prints each one's top operators by CPU time and its synchronising calls. On the H100 SDPA dispatches
``DynamicCache`` steps to cuDNN attention, whose plan is rebuilt for every new key length: about
3.9 ms of host time per layer.

    python benchmarks/profiles/hf_dynamic_profile.py > dyn_prof.txt
"""

from __future__ import annotations

import sys
import time

import torch
from fp8kv_bench import hf_speed as speed
from torch.profiler import ProfilerActivity, profile


def main() -> int:
    from transformers import LlamaForCausalLM

    if not torch.cuda.is_available():
        print("hf_dynamic_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(speed.llama_1b_config(False), dtype=torch.bfloat16).eval()
    for kind in ("dynamic", "static", "fp8kv"):
        cache = speed.make_cache(kind, model, 1024 + 40, "auto")
        tok = speed.prefill(model, cache, torch.randint(0, 1000, (1, 1024), device="cuda"), 1024)
        pos = 1024
        with torch.inference_mode():
            for i in range(8):
                if i == 5:
                    prof = profile(activities=[ProfilerActivity.CPU])
                    prof.__enter__()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                            cache_position=torch.tensor([pos], device="cuda"), logits_to_keep=1)
                tok = out.logits[:, -1:].argmax(-1)
                pos += 1
            torch.cuda.synchronize()
            per_step = (time.perf_counter() - t0) / 3
            prof.__exit__(None, None, None)
        ops = prof.key_averages()
        print(f"== {kind}: {per_step * 1e3:.2f} ms/step (profiled)")
        print(ops.table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=50))
        syncs = {e.key: e.count for e in ops if "ynchronize" in e.key or e.key in (
            "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaMemcpyAsync")}
        print("sync-like ops (3 steps):", syncs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
