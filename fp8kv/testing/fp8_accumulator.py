"""The accumulation of Hopper's e4m3 ``wgmma``, emulated bit for bit (float64 on the host).

Measured on an H100 (``tests/data/h100_e4m3_wgmma.safetensors``: both products of
``fp8kv_hopper``'s layout test on random e4m3 codes, every one of 8192 + 8192 outputs reproduced):
a reduction of ``K`` products runs in steps of 32 (one ``k32`` instruction). Each step takes the
running sum ``C`` and the step's 32 products ``a_i b_i``, aligns all of them to the largest
exponent ``E`` among ``C``'s and the products' (a product's exponent is the sum of its factors'
exponents, not that of its value), truncates each toward zero to a multiple of ``2^(E - 13)``,
adds them exactly and truncates the sum toward zero to 14 significant bits.

So a small product next to a large one loses up to ``2^-13`` of the large one, and a product below
``2^-13`` of the step's largest term is dropped: the error of one step is at most
``(n + 1) 2^(E - 13)`` plus ``2^-13`` of the new sum (``n`` nonzero products), which can be about
``2^-8`` of the step's ``sum |a b|``, not ``2^-13`` of it (docs/fp8_attention.md).
"""

from __future__ import annotations

import torch

STEP = 32
"""Products per accumulation step (the ``k`` of an e4m3 ``wgmma``)."""
KEPT_BITS = 13
"""Fractional bits kept below the step's largest exponent."""


def exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) exactly (from frexp, not a rounded log2; float64, -inf for 0)."""
    return (torch.frexp(x).exponent - 1).double().masked_fill(x == 0, -torch.inf)


def _truncate(x: torch.Tensor, quantum: torch.Tensor) -> torch.Tensor:
    return torch.trunc(x / quantum) * quantum


def hopper_accumulate(terms: torch.Tensor, exponents: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """The running sum ``c`` (default 0) plus ``terms [..., K]`` (exact products of e4m3 values,
    float64) as Hopper's e4m3 wgmma adds them, 32 at a time; ``exponents`` the products' exponents
    (the sums of their factors' :func:`exponent`). Returns ``[...]`` float64."""
    c = torch.zeros(terms.shape[:-1], dtype=torch.float64, device=terms.device) if c is None else c.double()
    terms = terms.double()
    exponents = exponents.double().masked_fill(terms == 0, -torch.inf)
    for k0 in range(0, terms.shape[-1], STEP):
        p, pe = terms[..., k0:k0 + STEP], exponents[..., k0:k0 + STEP]
        top = torch.maximum(pe.amax(-1), exponent(c))
        q = torch.where(torch.isfinite(top), torch.exp2(top - KEPT_BITS), torch.ones_like(top))
        s = _truncate(c, q) + _truncate(p, q[..., None]).sum(-1)
        c = torch.where(s != 0, _truncate(s, torch.exp2(exponent(s) - KEPT_BITS).nan_to_num(1.0)),
                        torch.zeros_like(s))
    return c


def hopper_e4m3_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` as Hopper's e4m3 wgmma accumulates it: ``a [M, K]`` and ``b [N, K]`` hold e4m3
    values (any float dtype, finite); returns ``[M, N]`` float64 (every value a float32)."""
    a, b = a.double(), b.double()
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"hopper_e4m3_dot: K must match, got {a.shape} and {b.shape}")
    ea, eb = exponent(a), exponent(b)
    return hopper_accumulate(a[:, None, :] * b[None, :, :], ea[:, None, :] + eb[None, :, :])
