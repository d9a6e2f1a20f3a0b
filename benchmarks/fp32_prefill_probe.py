"""Chunked prefill with float32 queries on a GPU: time, registers and spills of the shipped launch
configuration and of variants (``python benchmarks/fp32_prefill_probe.py OUT.json``).

4 sequences x 1024 new tokens over 1024 cached, 32 query / 8 KV heads, D=128, block 16, e4m3
token_head; medians of ``triton.testing.do_bench``. Results: ``benchmarks/results/fp32_decode/``
(``prefill_probe1``: bf16 and the two-stage variants; ``prefill_probe2``: one-stage variants)."""
import dataclasses
import json
import sys

import torch
import triton
from fp8kv_bench.kernel_probe import compiled_kernels, time_config
from fp8kv_triton import attention as A
from fp8kv_triton.capabilities import codec_for

import fp8kv
from fp8kv.formats import FORMATS


def main() -> None:
    dev = torch.device("cuda")
    S, new, old, HQ, H, D, bs = 4, 1024, 1024, 32, 8, 128, 16
    L = new + old
    nbps = L // bs
    nb = S * nbps
    cache = fp8kv.KVCache.allocate(nb, bs, H, D, kv_dtype="fp8_e4m3", scale_granularity="token_head", device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    n = nb * bs
    fp8kv.write_kv(cache, torch.randn(n, H, D, device=dev, generator=g, dtype=torch.bfloat16),
                   torch.randn(n, H, D, device=dev, generator=g, dtype=torch.bfloat16), torch.arange(n, device=dev))
    tables = torch.arange(nb, dtype=torch.int32, device=dev).view(S, nbps)
    lens = torch.full((S,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (S + 1) * new, new, dtype=torch.int32, device=dev)
    choice = codec_for("sm90", FORMATS["fp8_e4m3"], interpret=False)

    def kernels():
        return compiled_kernels(A._attn_kernel, A._reduce_kernel)

    rows = []
    for qdt in (torch.bfloat16, torch.float32):
        q = torch.randn(S * new, HQ, D, device=dev, dtype=qdt)
        out = torch.empty_like(q)
        base = A.choose_config(dev, group=HQ // H, head_size=D, num_seqs=S, num_kv_heads=H, max_query_len=new,
                               max_keys=L, interpret=False, query_dtype=qdt, arch="sm90")
        R = dataclasses.replace
        variants = [("shipped", base)]
        if qdt == torch.float32:
            variants += [(f"m{m} n{bn} w{w} st{st}", R(base, block_m=m, block_n=bn, num_warps=w, num_stages=st))
                         for m, bn, w, st in ((64, 32, 4, 2), (64, 64, 4, 1), (128, 32, 8, 1), (32, 32, 4, 1),
                                              (64, 16, 4, 1), (128, 64, 8, 1), (32, 64, 4, 1))]
        for name, cfg in variants:
            def f(q=q, out=out, cfg=cfg):
                A.paged_attention(q, cache, tables, lens, qsl, new, D ** -0.5, True, None, None, out,
                                  decode_mode=choice.decoder, interpret=False, config=cfg)
            time_config(rows, str(qdt), name, cfg, f, kernels, lambda run: triton.testing.do_bench(run, rep=100))
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "shape": dict(seqs=S, new=new, cached=old, HQ=HQ, H=H, D=D, block_size=bs), "rows": rows},
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
