"""Decode with float32 vs 16-bit queries on a GPU: time, registers and spills of the shipped launch
configuration and of variants (``python benchmarks/fp32_decode_probe.py OUT.json [more]``).

The AOT compile (Triton 3.9's ptxas, on the CPU) reported 32 registers and ~27 KB of spill traffic for
the float32 decode variants; this checks what the JIT on the GPU builds and how fast it runs.
B=32, 32 query / 8 KV heads, D=128, L=4096, block 16, e4m3 token_head; times are medians of CUDA-graph
replays (``triton.testing.do_bench_cudagraph``). ``more``: eight further float32 configurations.
Results: ``benchmarks/results/fp32_decode/``."""
import dataclasses
import json
import sys

import torch
import triton
from fp8kv_bench.kernel_probe import compiled_kernels, time_config
from fp8kv_triton import attention as A
from fp8kv_triton import decode as Dk
from fp8kv_triton.capabilities import codec_for

import fp8kv
from fp8kv.formats import FORMATS


def main() -> None:
    dev = torch.device("cuda")
    B, HQ, H, D, L, bs = 32, 32, 8, 128, 4096, 16
    nb = B * L // bs
    cache = fp8kv.KVCache.allocate(nb, bs, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head", device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    n = nb * bs
    for i in range(0, n, 1 << 20):
        m = min(1 << 20, n - i)
        fp8kv.write_kv(cache, torch.randn(m, H, D, device=dev, generator=g, dtype=torch.bfloat16),
                       torch.randn(m, H, D, device=dev, generator=g, dtype=torch.bfloat16),
                       torch.arange(i, i + m, device=dev))
    tables = torch.arange(nb, dtype=torch.int32, device=dev).view(B, L // bs)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    choice = codec_for("sm90", FORMATS["fp8_e4m3"], interpret=False)
    rows = []

    def kernels():
        return compiled_kernels(Dk._decode_kernel, A._attn_kernel, A._reduce_kernel)

    dtypes = (torch.bfloat16, torch.float32) if len(sys.argv) > 2 else (torch.bfloat16, torch.float16, torch.float32)
    for qdt in dtypes:
        q = torch.randn(B, HQ, D, device=dev, dtype=qdt)
        out = torch.empty_like(q)
        base = A.choose_config(dev, group=HQ // H, head_size=D, num_seqs=B, num_kv_heads=H, max_query_len=1,
                               max_keys=L, interpret=False, query_dtype=qdt, arch="sm90")
        variants = [("shipped", base)]
        if qdt == torch.float32 and len(sys.argv) > 2:
            R = dataclasses.replace
            variants += [(f"bn{bn} w{w} st{st}", R(base, block_n=bn, num_warps=w, num_stages=st))
                         for bn, w, st in ((32, 4, 2), (32, 8, 2), (16, 4, 2), (32, 4, 3), (32, 4, 1), (16, 8, 2),
                                           (64, 8, 1), (32, 8, 3))]
        elif qdt == torch.float32:
            variants += [("n32", dataclasses.replace(base, block_n=32, keys_per_split=base.keys_per_split)),
                         ("w8", dataclasses.replace(base, num_warps=8)),
                         ("1stage", dataclasses.replace(base, num_stages=1)),
                         ("no v_regs", dataclasses.replace(base, v_regs=False))]
        for name, cfg in variants:
            def f(q=q, out=out, cfg=cfg):
                A.paged_attention(q, cache, tables, lens, qsl, 1, D ** -0.5, True, None, None, out,
                                  decode_mode=choice.decoder, interpret=False, config=cfg)

            time_config(rows, str(qdt), name, cfg, f, kernels,
                        lambda run: triton.testing.do_bench_cudagraph(run, rep=200))
    print("kernels (name, n_regs, n_spills):")
    for k in sorted(kernels(), key=str):
        print("  ", k)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "shape": dict(B=B, HQ=HQ, H=H, D=D, L=L, block_size=bs), "rows": rows,
               "kernels": sorted(map(str, kernels()))}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
