"""Time the Triton general kernel's chunked prefill from the fp8kv tree at ROOT: a regression check
across commits (benchmarks/results/prefill_regression_h100.md).

    python benchmarks/prefill_regress.py ROOT [tensor|token_head] [STAGES]

ROOT is a checkout of any commit (``.`` for this one); its ``fp8kv`` and ``backends/`` are imported
first. Shape: 4 x 2048 new tokens over 2048 cached, GQA 32/8, D=128, block 16, e4m3, bf16 queries,
random block table. Prints the median of 20 CUDA-graph replays of 3 calls.
"""

import dataclasses
import sys


def main() -> None:
    root = sys.argv[1]
    gran = sys.argv[2] if len(sys.argv) > 2 else "tensor"
    stages = int(sys.argv[3]) if len(sys.argv) > 3 else None
    sys.path[:0] = [root, root + "/backends"]
    import torch
    from fp8kv_triton.attention import choose_config, paged_attention

    import fp8kv
    import fp8kv.reference

    print("fp8kv from", fp8kv.__file__)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(2)
    seqs, new, cached, HQ, H, D, page = 4, 2048, 2048, 32, 8, 128, 16
    L = new + cached
    nb = seqs * L // page
    tables = torch.randperm(nb, generator=gen).to(torch.int32).view(seqs, -1).to(dev)
    scales = {"k_scale": 0.05, "v_scale": 0.05} if gran == "tensor" else {"scale_granularity": gran}
    cache = fp8kv.KVCache.allocate(nb, page, H, D, kv_dtype="fp8_e4m3", device=dev, **scales)
    k = torch.randn(nb * page, H, D, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(nb * page, H, D, generator=gen).to(dev, torch.bfloat16)
    fp8kv.reference.write_kv(cache, k, v, torch.arange(nb * page, device=dev))
    q = torch.randn(seqs * new, HQ, D, generator=gen).to(dev, torch.bfloat16)
    lens = torch.full((seqs,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    cfg = None
    if stages is not None:
        cfg = choose_config(dev, group=HQ // H, head_size=D, num_seqs=seqs, num_kv_heads=H, max_query_len=new,
                            max_keys=tables.shape[1] * page, interpret=False)
        cfg = dataclasses.replace(cfg, num_stages=stages)

    def call() -> None:
        paged_attention(q, cache, tables, lens, qsl, new, D**-0.5, True, None, None, out, decode_mode=0,
                        interpret=False, config=cfg)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            call()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 3)
    times.sort()
    print(f"REGRESS {root} {gran} stages={stages or 'default'}: prefill kernel {times[10] * 1e3:.1f} us")


if __name__ == "__main__":
    main()
