"""Test set-up: Hypothesis profiles and the Triton interpreter on CPU-only machines.

Profiles (``HYPOTHESIS_PROFILE``, default ``ci``):

* ``ci``: derandomized (reproducible in CI), 60 examples, no deadline, prints the
  reproduction blob of a failure.
* ``thorough``: 2000 examples, no deadline, for GPU runs and soaks.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run through its CPU interpreter when no GPU is present; the
    # variable must be set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def isolated(monkeypatch):
    """A registry holding only the reference (whatever else is installed), restored afterwards."""
    from fp8kv import reference
    from fp8kv import registry as registry_mod

    reg = registry_mod.Registry(loaded=True)
    reg.add(reference.ReferenceBackend(), distribution="fp8kv")
    monkeypatch.setattr(registry_mod, "_REGISTRY", reg)
    for var in ("FP8KV_BACKEND", "FP8KV_AUTO_BACKENDS", "FP8KV_STRICT", "FP8KV_SIMULATE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    return reg

