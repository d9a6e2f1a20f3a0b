"""Precision rules that the kernels of every backend follow, stated once in the core.

The conformance kit (:mod:`fp8kv.testing.tolerance`) derives its bounds from these rules; the
kernels import them from here, never from the test kit.
"""

from __future__ import annotations

FULL_P_KEYS = 1024
"""Rows that see at least this many keys may enter ``p @ v`` with the weights ``p`` in one float16:
the error, at most ``2^-12 V`` (``V = max |v'|``), is then within ``4 N u V`` (``u = 2^-24``), half
the accumulation term ``(8N + 8) u V`` of the float32 attention bound. Rows with fewer keys keep
~22 bits of ``p`` (two float16 halves). The kernels of the Triton and CUDA backends follow this rule."""

__all__ = ["FULL_P_KEYS"]
