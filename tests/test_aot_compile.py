"""Ahead-of-time compile of the Triton kernels for AMD gfx942/gfx950 and NVIDIA sm80/sm86/sm89/sm90, on the CPU.

``python -m fp8kv_triton.aot`` (Triton's real compiler in a subprocess without TRITON_INTERPRET,
a fresh Triton cache) compiles one variant per kernel and format class (OCP, fnuz) with the
codec policy and launch sizes of each target: an hsaco for gfx942/gfx950, a cubin for
sm80/sm90. A compile error fails; so does any VGPR spill, scratch or LDS above the limit on
AMD, and on NVIDIA a spill above the committed baseline (ci/reports/compile/). ~40 s on 2 cores.
The full set (every format x I/O dtype x granularity x head size x shape) is the CI matrix's
compile cells: ``python -m fp8kv_triton.aot --set full``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "ci" / "reports" / "compile" / "nvidia_spill_baseline.json"


def test_every_kernel_compiles_for_amd_and_nvidia_without_spills(tmp_path):
    import triton.backends

    missing = [b for b in ("amd", "nvidia") if b not in triton.backends.backends]
    if missing:
        pytest.skip(f"the installed Triton lacks its {' and '.join(missing)} backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # really compile, never a cache hit
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "fp8kv_triton.aot", "--jobs", "2", "--baseline", str(BASELINE),
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert all(x["ok"] for x in results)
    for target in ("gfx942", "gfx950", "sm80", "sm86", "sm89", "sm90"):
        kernels = {(x["kernel"], x["fmt"]) for x in results if x["target"] == target}
        # NVIDIA decodes with the decode kernel; AMD keeps the general kernel for decode
        expected = {"_attn_kernel", "_reduce_kernel", "_write_kv_kernel"}
        assert {k for k, _ in kernels} == (expected if target.startswith("gfx") else expected | {"_decode_kernel"})
        fmts = {f for _, f in kernels}
        assert fmts & {"fp8_e4m3", "fp8_e5m2"} and fmts & {"fp8_e4m3fnuz", "fp8_e5m2fnuz"}, target
    for x in results:
        if x["target"].startswith("gfx"):
            assert x["vgpr"] and x["spills"] == 0 and x["scratch"] == 0, x
            assert x["num_warps"] == 4 and x["shared"] <= 64 << 10, x  # gfx942's LDS per workgroup
        else:
            assert x["regs"], x
    assert "| gfx942 |" in r.stdout and "VGPR" in r.stdout
    for x in results:  # 99 KB GPUs (RTX 30/40, A10, L4): every tile fits, and the decode kernel spills nothing
        if x["target"] in ("sm86", "sm89"):
            assert x["shared"] <= 99 << 10, x
            assert x["kernel"] != "_decode_kernel" or x["spills"] == 0, x


def test_tiles_fit_the_shared_memory_of_99_kb_gpus():
    """The H100-tuned decode tile (128 keys, two stages: 104 KB) does not launch on sm86/sm89;
    there the decode kernel takes 32-key tiles and float32 prefill one stage of 32 keys."""
    import torch
    from fp8kv_triton.attention import choose_config

    def cfg(arch, q_len, dtype=torch.bfloat16, D=128):
        return choose_config(torch.device("cpu"), group=4, head_size=D, num_seqs=8, num_kv_heads=8,
                             max_query_len=q_len, max_keys=4096, interpret=False, query_dtype=dtype, arch=arch)

    assert cfg("sm90", 1).block_n == 128 and cfg("sm80", 1).block_n == 128
    for arch in ("sm86", "sm89", "sm120"):
        assert cfg(arch, 1).block_n == 32 and cfg(arch, 1).decode
        assert cfg(arch, 64).block_n == 128  # bf16 prefill: 82 KB, fits
        assert (cfg(arch, 64, torch.float32).block_n, cfg(arch, 64, torch.float32).num_stages) == (32, 1)
        assert cfg(arch, 64, torch.float32, D=256).block_m == 32


def test_the_variant_sets():
    from fp8kv_triton import aot

    rep = aot.variants("gfx942")
    assert len(rep) == 6 and all("integer bits" in v.label for v in rep if v.kernel != "_reduce_kernel")
    full = aot.variants("gfx950", "full")
    assert len(full) == 4 * 3 * 2 * 2 * 4 + 4  # head sizes 64 and 128 on AMD
    assert len(aot.variants("sm90", "full")) == 4 * 3 * 2 * 3 * 4 + 6
    assert {v.fmt for v in full} - {"-"} == set(aot.FORMATS)
    assert any("native cvt" in v.label for v in aot.variants("sm90"))  # NVIDIA keeps its proven casts
