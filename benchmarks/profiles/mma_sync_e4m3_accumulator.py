"""Record how ``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` accumulates on this GPU (sm89+),
against fp8kv.testing.fp8_accumulator's model of Hopper's e4m3 ``wgmma`` (measured on an H100).

Each of ``--problems`` warps computes ``D = C + A B^T`` for its own random ``A [16, K]`` and ``B [8, K]``
e4m3 codes (every finite code, exponents spread over the whole range) as a chain of ``K / 32`` mma.sync
instructions, each taking the previous one's D as its C (as a kernel's K loop does), from a random
float32 C (or 0). Prints how many outputs the model reproduces bit for bit, and how many plain float64
products would; ``--out FILE`` saves the inputs and outputs (safetensors) for a CPU test.

    python benchmarks/profiles/mma_sync_e4m3_accumulator.py [--problems 256] [--k 128] [--out FILE]

On the H100 (``--problems 512 --k 128``) the model holds for 18 of 65536 outputs:
ptxas lowers the instruction on sm90 to e4m3 -> float16 widening (``F2FP.F16.E4M3.UNPACK_B``) and
``HMMA.16816.F32``, a float32-like accumulation (at most 3.75 float32 ulps of ``|C| + sum |a b|``). Hopper
reaches its FP8 tensor cores through ``wgmma`` only.
"""

from __future__ import annotations

import argparse

import torch

SOURCE = r"""
extern "C" __global__ void chain(const unsigned* a, const unsigned* b, const float* c, float* d, int k) {
    // a: [P, 16, k] bytes, b: [P, 8, k] bytes, c/d: [P, 16, 8] float32; one warp a problem
    const int p = blockIdx.x, lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const unsigned* A = a + (size_t)p * 16 * k / 4;
    const unsigned* B = b + (size_t)p * 8 * k / 4;
    float acc[4];
    const float* C = c + (size_t)p * 128;
    acc[0] = C[g * 8 + 2 * t]; acc[1] = C[g * 8 + 2 * t + 1];
    acc[2] = C[(g + 8) * 8 + 2 * t]; acc[3] = C[(g + 8) * 8 + 2 * t + 1];
    for (int k0 = 0; k0 < k; k0 += 32) {
        // A: a0 row g, cols k0 + 4t..; a1 row g + 8; a2 row g, cols k0 + 16 + 4t..; a3 row g + 8
        const unsigned a0 = A[(g * k + k0 + 4 * t) / 4], a1 = A[((g + 8) * k + k0 + 4 * t) / 4];
        const unsigned a2 = A[(g * k + k0 + 16 + 4 * t) / 4], a3 = A[((g + 8) * k + k0 + 16 + 4 * t) / 4];
        // B (n = g): b0 k rows k0 + 4t..; b1 k0 + 16 + 4t..
        const unsigned b0 = B[(g * k + k0 + 4 * t) / 4], b1 = B[(g * k + k0 + 16 + 4 * t) / 4];
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    float* O = d + (size_t)p * 128;
    O[g * 8 + 2 * t] = acc[0]; O[g * 8 + 2 * t + 1] = acc[1];
    O[(g + 8) * 8 + 2 * t] = acc[2]; O[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
"""


def random_e4m3(shape, gen) -> torch.Tensor:
    """Random finite e4m3 codes (uniform over the 254 finite codes)."""
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0x80, codes)  # NaN codes -> +-0
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy

    from fp8kv.testing.fp8_accumulator import exponent, hopper_accumulate

    gen = torch.Generator().manual_seed(args.seed)
    P, K = args.problems, args.k
    a, b = random_e4m3((P, 16, K), gen), random_e4m3((P, 8, K), gen)
    c = torch.randn(P, 16, 8, generator=gen) * torch.exp2(torch.randint(-20, 20, (P, 16, 8), generator=gen).float())
    c[: P // 2] = 0.0  # half the problems from C = 0
    dev = torch.device("cuda")
    mod = cupy.RawModule(code=SOURCE, options=("--std=c++17",), backend="nvrtc")
    fn = mod.get_function("chain")
    ga, gb, gc = (cupy.asarray(x.contiguous().view(torch.uint8).to(dev) if x.dtype != torch.float32 else x.to(dev))
                  for x in (a, b, c))
    gd = cupy.zeros((P, 16, 8), dtype=cupy.float32)
    fn((P,), (32,), (ga, gb, gc, gd, cupy.int32(K)))
    cupy.cuda.runtime.deviceSynchronize()
    d = torch.from_numpy(cupy.asnumpy(gd)).double()

    ad, bd = a.double(), b.double()
    terms = ad[:, :, None, :] * bd[:, None, :, :]  # [P, 16, 8, K]
    exps = exponent(ad)[:, :, None, :] + exponent(bd)[:, None, :, :]
    model = hopper_accumulate(terms, exps, c.double())
    exact = (c.double() + terms.sum(-1)).float().double()
    name = torch.cuda.get_device_name(dev)
    print(f"{name}: mma.sync m16n8k32 e4m3, {P} problems x 128 outputs, K={K}")
    print(f"  bit-identical to the Hopper wgmma model: {(model == d).sum().item()} / {d.numel()}")
    print(f"  bit-identical to float64 products summed then rounded: {(exact == d).sum().item()} / {d.numel()}")
    worst = (model - d).abs().argmax()
    print(f"  largest |model - gpu|: {(model - d).abs().max().item():.3e} at {worst.item()}")
    if args.out:
        from safetensors.torch import save_file

        save_file({"a": a.view(torch.uint8), "b": b.view(torch.uint8), "c": c, "d": d.float()}, args.out,
                  metadata={"device": name, "instruction": "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
                            "torch": torch.__version__})


if __name__ == "__main__":
    main()
