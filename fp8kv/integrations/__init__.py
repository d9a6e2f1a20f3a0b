"""Integrations of the FP8 paged KV cache with model libraries.

* :mod:`fp8kv.integrations.transformers`: Hugging Face transformers ``generate()`` with an
  FP8 paged cache (optional extra ``hf``; importing the module does not import transformers).

Nothing here is imported by ``import fp8kv``.
"""
