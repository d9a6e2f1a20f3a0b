"""fp8kv's conformance kit: what a backend must satisfy, usable from any test suite.

One import for a plugin author::

    from fp8kv.testing import check_backend

    def test_my_backend_conforms():
        check_backend("mybackend")          # or the backend object itself

Contents:

* :mod:`fp8kv.testing.tolerance`: the derived attention tolerance
  (:func:`attention_tolerance`, :func:`assert_attention_close`, :func:`paged_attention_bounds`).
* :mod:`fp8kv.testing.fp8_tolerance`: the FP8 attention mode's own derived tolerance
  (``fp8_attention_tolerance``, ``assert_fp8_attention_close``, ``fp8_probability_envelope``;
  ``check_backend(..., fp8_attention="only")`` applies it; its default accumulator bound is
  Hopper's, ``accumulator="steps"`` the 13-bits-a-step model).
* :mod:`fp8kv.testing.fp8_accumulator`: Hopper's e4m3 wgmma accumulation emulated bit for bit
  (:func:`~fp8kv.testing.fp8_accumulator.hopper_e4m3_dot`; measured on an H100).
* :mod:`fp8kv.testing.strategies`: Hypothesis strategies for workloads (:func:`workloads`,
  :class:`Workload`).
* :mod:`fp8kv.testing.conformance`: :func:`check_backend`.
* :mod:`fp8kv.testing.safety`: :func:`check_memory_safety` (hostile indices with the host
  checks off; part of :func:`check_backend` for fast backends).
* :mod:`fp8kv.testing.fuzz`: :func:`api_machine` (random API call sequences, valid and invalid, each
  held to the reference, with canaries around every cache) and its :class:`FuzzConfig`.

The tolerance needs only torch; the strategies and the checker need Hypothesis (a test
dependency), so they are imported on first use.
"""

from __future__ import annotations

import importlib

from .tolerance import (
    assert_attention_close,
    attention_error_bound,
    attention_tolerance,
    logit_bound,
    paged_attention_bounds,
    ulp,
)

_LAZY = {
    "Workload": "strategies",
    "workloads": "strategies",
    "check_backend": "conformance",
    "ConformanceReport": "conformance",
    "check_memory_safety": "safety",
    "FuzzConfig": "fuzz", "api_machine": "fuzz",
}

__all__ = [
    "ConformanceReport", "FuzzConfig", "Workload", "api_machine", "assert_attention_close", "attention_error_bound",
    "attention_tolerance", "check_backend", "check_memory_safety", "logit_bound", "paged_attention_bounds", "ulp",
    "workloads",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
