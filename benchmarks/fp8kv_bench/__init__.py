"""fp8kv_bench: the measurement harnesses of fp8kv, kept out of the ``fp8kv`` package.

* :mod:`fp8kv_bench.kernels`: cache write, decode and chunked prefill against bf16 SDPA and
  the copy-bandwidth roofline on a CUDA GPU (``fp8kv bench``, ``benchmarks/bench_triton.py``);
* :mod:`fp8kv_bench.hf_eval`: perplexity, greedy agreement, cache bytes and generate speed of
  KV caches on SmolLM2-135M through transformers, offline (``fp8kv eval``,
  ``benchmarks/hf_generate.py``, ``tests/test_hf_e2e.py``).

Installed as its own top-level package with fp8kv (``pip install -e .`` from the source
tree); the ``fp8kv bench`` / ``fp8kv eval`` commands import it only when they run.
Importing it imports neither CUDA nor transformers.
"""
