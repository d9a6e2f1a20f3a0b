"""Random API call sequences on a CUDA GPU, each call held to the reference (:mod:`fp8kv.testing.fuzz`).

The machine of ``tests/test_fuzz.py`` over CUDA tensors, through the GPU backends (triton, cuda, hopper
where served; a backend that does not serve a request must say so with ``fp8kv.Unsupported``) and the
reference, with larger geometry and more examples: at least 300 sequences of 25 calls, or the active
profile's count (``HYPOTHESIS_PROFILE=thorough``: 2000). Out-of-bounds kernel writes land in the canary
bytes around every cache, out-of-bounds reads in their NaNs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from test_fuzz import BY_DESIGN

from fp8kv.testing.fuzz import FuzzConfig, api_machine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_CONFIG = FuzzConfig(
    backends=("triton", "cuda", "hopper", "reference", "auto"), device="cuda", block_sizes=(1, 4, 16),
    max_blocks=12, kv_heads=(1, 2, 4), gqa_ratios=(1, 2, 4), head_sizes=(16, 64, 128), max_seqs=4,
    max_table_cols=4, leave_out=BY_DESIGN,
)

TestApiFuzzGpu = api_machine(GPU_CONFIG).TestCase
TestApiFuzzGpu.settings = settings(settings.default, max_examples=max(settings.default.max_examples, 300),
                                   stateful_step_count=25)
