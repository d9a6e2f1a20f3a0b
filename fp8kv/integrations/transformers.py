"""Hugging Face transformers drop-in: ``generate()`` with an FP8 paged KV cache.

Importing this module is cheap and does not import transformers (the optional extra
``hf``); the names below load it on first use. Quick start::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from fp8kv.integrations.transformers import enable, FP8PagedCache

    model = AutoModelForCausalLM.from_pretrained(path)
    cache = enable(model)                     # e4m3, per-token-head scales, backend "auto"
    out = model.generate(**tok(prompt, return_tensors="pt"), past_key_values=cache)
    out = model.generate(..., past_key_values=FP8PagedCache.from_model(model))  # next call

What it does: each decoder layer's K/V of a step are quantized into one paged
:class:`fp8kv.KVCache` per layer with :func:`fp8kv.write_kv` (padding columns of a
left-padded batch are never written) and attention runs with
:func:`fp8kv.paged_attention` directly over the FP8 cache (the prompt as chunked prefill,
then decode); no dequantized copy of the cache is ever made.

Public names (loaded lazily from :mod:`fp8kv.integrations._hf`):

* :class:`FP8PagedCache`: the transformers ``Cache``;
* :func:`enable` / :func:`disable`: switch a loaded model to / from ``attn_implementation="fp8kv"``;
* :func:`register`: register the attention and mask functions only;
* :func:`check_model`: raise a clear :class:`fp8kv.Fp8KVError` if a model is unsupported;
* :func:`calibrate_kv_scales`: static per-tensor / per-head scales from calibration text;
* :func:`fp8kv_attention_forward`, :func:`fp8kv_mask`: the registered functions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

ATTN_IMPLEMENTATION = "fp8kv"
"""The ``attn_implementation`` name the integration registers."""

_LAZY = ("FP8PagedCache", "FP8PagedLayer", "ModelShape", "calibrate_kv_scales", "check_model", "disable",
         "enable", "fp8kv_attention_forward", "fp8kv_mask", "model_shape", "register")

__all__ = ["ATTN_IMPLEMENTATION", *_LAZY, "require_transformers"]

if TYPE_CHECKING:  # pragma: no cover
    from ._hf import (  # noqa: F401
        FP8PagedCache,
        FP8PagedLayer,
        ModelShape,
        calibrate_kv_scales,
        check_model,
        disable,
        enable,
        fp8kv_attention_forward,
        fp8kv_mask,
        model_shape,
        register,
    )


def require_transformers():
    """Import and return the ``transformers`` module, or raise ImportError saying how to get it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError("fp8kv.integrations.transformers needs Hugging Face transformers: "
                          "pip install 'fp8kv[hf]' (or pip install transformers)") from exc


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        require_transformers()
        mod = importlib.import_module("._hf", __package__)
        value = getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
