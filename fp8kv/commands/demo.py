"""``fp8kv demo``: a small random paged workload through every format and granularity.

For each (format, granularity) it prints the cache size against a bf16 cache, the
write error (relative RMS of the dequantized K/V against the originals) and the
attention error against float32 attention over the *unquantized* K/V, and times.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..cli import device_arg, positive_int

NAME = "demo"
HELP = "run a small random paged workload through every FP8 format and granularity"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, type=device_arg,
                   help="torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--backend", default="auto", help="backend name or 'auto'")
    p.add_argument("--seqs", type=positive_int, default=4, help="number of sequences (default 4)")
    p.add_argument("--max-len", type=positive_int, default=384,
                   help="longest sequence in tokens; lengths are drawn from [max-len/4, max-len] (default 384)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 attention of one query per sequence. q [Hq, D], k/v [L, H, D] -> [Hq, D]."""
    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", p, v)


class Progress:
    """A one-line progress bar on stderr that appears only once work runs over a second."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start, self.shown = total, 0, time.perf_counter(), False

    def step(self, label: str) -> None:
        self.done += 1
        if time.perf_counter() - self.start > 1.0 and sys.stderr.isatty() or self.shown:
            self.shown = True
            bar = "#" * (20 * self.done // self.total)
            print(f"\r[{bar:<20}] {self.done}/{self.total} {label:<24}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    import fp8kv
    from fp8kv.formats import FORMATS
    from fp8kv.scales import GRANULARITIES, calibrate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(args.seed)
    H, Hq, D, bs = 4, 16, 64, 16
    lens = torch.randint(max(1, args.max_len // 4), args.max_len + 1, (args.seqs,), generator=g)
    blocks_per_seq = -(-args.max_len // bs)
    num_blocks = args.seqs * blocks_per_seq + 3
    perm = torch.randperm(num_blocks, generator=g)[: args.seqs * blocks_per_seq]
    block_tables = perm.view(args.seqs, blocks_per_seq).to(torch.int32)
    # Keys with a few outlier channels (as real models have), values plain normal.
    key = torch.randn(int(lens.sum()), H, D, generator=g) * (1 + 4 * (torch.rand(D, generator=g) > 0.9))
    value = torch.randn(int(lens.sum()), H, D, generator=g)
    query = torch.randn(args.seqs, Hq, D, generator=g)
    slots, starts = [], [0]
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots.append(block_tables[i, pos // bs].long() * bs + pos % bs)
        starts.append(starts[-1] + n)
    slot_mapping = torch.cat(slots)
    scale = D ** -0.5
    exact = torch.stack([dense_attention(query[i], key[starts[i]:starts[i + 1]], value[starts[i]:starts[i + 1]],
                                         scale) for i in range(args.seqs)])
    to = dict(device=device)
    rows = []
    combos = [(f, gr) for f in FORMATS for gr in GRANULARITIES]
    bar = Progress(len(combos))
    for fmt, gran in combos:
        static = {}
        if gran != "token_head":
            static = dict(k_scale=calibrate(key, fmt, granularity=gran),
                          v_scale=calibrate(value, fmt, granularity=gran))
        cache = fp8kv.KVCache.allocate(num_blocks, bs, H, D, kv_dtype=fmt, scale_granularity=gran, device=device,
                                       **static)
        t0 = time.perf_counter()
        fp8kv.write_kv_one_shot(cache, key.to(**to), value.to(**to), slot_mapping.to(**to), backend=args.backend)
        t1 = time.perf_counter()
        out = fp8kv.paged_attention_one_shot(query.to(**to), cache, block_tables.to(**to),
                                             lens.to(torch.int32).to(**to),
                                    backend=args.backend)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        k_back = cache.dequantized("key").cpu()[slot_mapping]
        v_back = cache.dequantized("value").cpu()[slot_mapping]
        rel = lambda a, b: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())
        rows.append((fmt, gran, cache.bf16_ratio, rel(k_back, key), rel(v_back, value),
                     rel(out.float().cpu(), exact), (t1 - t0) * 1e3, (t2 - t1) * 1e3))
        bar.step(f"{fmt} {gran}")
    bar.close()
    sel = fp8kv.plugins.select_backend(fp8kv.plugins.Request.for_attention(cache.spec, torch.float32), device,
                                       args.backend)
    print(f"fp8kv {fp8kv.__version__} demo on {fp8kv.probe(device).name}, backend {sel.backend.name}: "
          f"{args.seqs} seqs, lengths {lens.tolist()}, H={H}, Hq={Hq}, D={D}, block {bs}")
    print("errors are relative RMS vs the unquantized float32 values; attention is one decode step")
    head = f"{'format':<14}{'scales':<12}{'bytes/bf16':>11}{'K err':>10}{'V err':>10}{'attn err':>10}" \
           f"{'write ms':>10}{'attn ms':>10}"
    print(head)
    print("-" * len(head))
    for fmt, gran, ratio, ke, ve, ae, tw, ta in rows:
        print(f"{fmt:<14}{gran:<12}{ratio:>10.1%}{ke:>10.2e}{ve:>10.2e}{ae:>10.2e}{tw:>10.2f}{ta:>10.2f}")
    return 0
