"""Shared pytest configuration: Hypothesis settings profiles.

Select one with ``HYPOTHESIS_PROFILE`` (default ``ci``):

* ``ci``: derandomized (reproducible in CI), 60 examples, no deadline, prints the
  reproduction blob of a failure.
* ``thorough``: 2000 examples, no deadline, for a local soak.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
