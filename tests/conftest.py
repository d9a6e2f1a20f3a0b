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

from hypothesis import HealthCheck, settings  # noqa: E402

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
