"""The Triton soft-cap's tanh is accurate to a few float32 ulps over the whole range.

Its small-|x| branch (a Taylor polynomial) matters: from ``(1 - e^-2x) / (1 + e^-2x)`` alone
the relative error near 0 grows like ``u / x`` (cancellation), which the conformance kit's
absolute soft-cap tolerance (``8 u c``) cannot see. This test can: removing the branch fails it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from fp8kv_triton.tiles import _tanh  # noqa: E402  (the kernels' own helper, tested directly)

U = 2.0**-24


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, _tanh(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


def test_tanh_relative_error_is_a_few_ulps():
    mags = np.concatenate([np.logspace(-30, np.log10(0.55), 200), np.linspace(0.5, 0.6, 101),
                           np.linspace(0.6, 12.0, 150), [20.0, 50.0, 3e38]])
    x = torch.tensor(np.concatenate([mags, -mags]), dtype=torch.float32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty_like(x, device=dev)
    block = triton.next_power_of_2(x.numel())
    _tanh_kernel[(1,)](x.to(dev), out, x.numel(), BLOCK=block)
    exact = torch.tanh(x.to(torch.float64))
    rel = ((out.cpu().to(torch.float64) - exact).abs() / exact.abs().clamp_min(1e-300))
    worst = int(rel.argmax())
    assert float(rel.max()) <= 8 * U, f"tanh({float(x[worst])!r}): relative error {float(rel.max()) / U:.1f} ulps"
