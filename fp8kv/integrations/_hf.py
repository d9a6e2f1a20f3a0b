"""The transformers side of :mod:`fp8kv.integrations.transformers` (imports transformers).

How a forward step flows, for each decoder layer ``l`` of a model whose
``config._attn_implementation`` is ``"fp8kv"`` and whose ``past_key_values`` is an
:class:`FP8PagedCache`:

1. the model's mask builder calls :func:`fp8kv_mask`, which returns the ``[B, q_len]``
   padding flags of the step's columns (or None when there is no padding);
2. the attention module calls ``cache.update(k, v, l)``: the cache counts the columns and
   returns ``k``/``v`` unchanged (the new columns only: nothing is concatenated or
   dequantized), and marks itself as the active cache of layer ``l``;
3. the attention module calls :func:`fp8kv_attention_forward`, which writes the step's
   tokens with :func:`fp8kv.write_kv` (padding columns get slot -1 and are never written)
   and computes attention with :func:`fp8kv.paged_attention` over the FP8 cache (the
   prompt as chunked prefill with ``query_start_loc``, then one-token decode steps).
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..api import paged_attention, write_kv
from ..cache import KVCache
from ..errors import Fp8KVError, bad_argument
from ..metadata import AttentionMetadata
from ..planning import plan_attention
from ..scales import GRANULARITIES, calibrate
from ..transforms import KVTransform
from ._paging import BlockPool, StepPlan
from ._sinks import SinkState
from ._static import StaticState

ATTN_IMPLEMENTATION = "fp8kv"
"""The name registered with transformers' attention and mask interfaces."""

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

_ACTIVE: contextvars.ContextVar[tuple[FP8PagedCache, int] | None] = contextvars.ContextVar(
    "fp8kv_active_cache", default=None)


# ------------------------------------------------------------------------------------ model shape


@dataclass(frozen=True)
class ModelShape:
    """What the cache needs to know about a model: layers, KV heads, head size."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    layer_types: tuple[str, ...]


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def model_shape(config) -> ModelShape:
    """Read layers / heads / head size / layer types from a transformers config.

    Raises :class:`fp8kv.Fp8KVError` naming what is missing or unsupported.
    """
    cfg = _text_config(config)
    name = type(cfg).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise Fp8KVError(f"model: got an encoder-decoder ({name}), expected a decoder-only model "
                         "(fp8kv caches causal self-attention only)")
    if getattr(cfg, "is_causal", True) is False:
        raise Fp8KVError(f"model: got {name} with is_causal=False, expected causal self-attention")
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if getattr(cfg, a, None) is None]
    if missing:
        raise Fp8KVError(f"model: {name} has no {' / '.join(missing)}, expected a decoder config "
                         "with num_hidden_layers, num_attention_heads (and num_key_value_heads, head_dim)")
    for a in ("v_head_dim", "qk_rope_head_dim", "kv_lora_rank"):
        if getattr(cfg, a, None) is not None:
            raise Fp8KVError(f"model: {name} has {a} (multi-head latent attention or K/V head sizes that "
                             "differ), expected one head size for K and V")
    if getattr(cfg, "kv_sharing_modes", None) is not None or getattr(cfg, "num_kv_shared_layers", 0):
        raise Fp8KVError(f"model: {name} shares KV caches between layers, which fp8kv does not support")
    n_layers = int(cfg.num_hidden_layers)
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    layer_types = tuple(getattr(cfg, "layer_types", None) or ("full_attention",) * n_layers)
    bad = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if bad:
        raise Fp8KVError(f"model: {name} has layer types {bad}, expected only {list(SUPPORTED_LAYER_TYPES)} "
                         "(no linear/recurrent, chunked or shared-KV layers)")
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise Fp8KVError(f"model: {name} uses chunked attention (attention_chunk_size), which fp8kv does not "
                         "support (sliding windows and full attention only)")
    return ModelShape(n_layers, hq, hkv, int(head), layer_types)


def check_model(model) -> ModelShape:
    """Check that ``model`` can run with the fp8kv attention; return its :class:`ModelShape`.

    A supported model is a decoder-only transformers model whose attention modules go
    through transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``), carry a
    ``layer_idx`` and use causal full or sliding-window attention with one head size.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise Fp8KVError(f"model: got {type(model).__name__} without a .config, expected a transformers "
                         "PreTrainedModel")
    shape = model_shape(config)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise Fp8KVError(f"model: {type(model).__name__} does not route attention through transformers' "
                         "AttentionInterface (ALL_ATTENTION_FUNCTIONS), so attn_implementation='fp8kv' "
                         "cannot be plugged in")
    attn = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if not attn:
        raise Fp8KVError(f"model: {type(model).__name__} has no attention modules with a layer_idx, "
                         "expected '*Attention' modules carrying layer_idx (transformers' standard layout)")
    idx = sorted(int(m.layer_idx) for m in attn)
    if idx != list(range(shape.num_layers)):
        raise Fp8KVError(f"model: attention modules have layer_idx {idx[:8]}{'...' if len(idx) > 8 else ''}, "
                         f"expected one per layer 0..{shape.num_layers - 1}")
    for m in attn:
        if getattr(m, "is_causal", True) is False:
            raise Fp8KVError(f"model: {type(m).__name__} (layer {m.layer_idx}) is not causal")
        hd = getattr(m, "head_dim", shape.head_size)
        if hd != shape.head_size:
            raise Fp8KVError(f"model: {type(m).__name__} has head_dim {hd}, expected {shape.head_size}")
    return shape


# ------------------------------------------------------------------------------------ scales


def _one_scale(value, name: str):
    if value is None:
        return None
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float32)
    return t.detach().to(torch.float32).cpu()


def _per_layer(value, num_layers: int, name: str) -> list[torch.Tensor | None]:
    """Normalise a scale argument to one entry (or None) per layer.

    ``value``: None, a number or 0-d/``(H,)`` tensor (every layer), a sequence of those
    (one per layer) or a mapping layer -> scale.
    """
    if value is None:
        return [None] * num_layers
    if isinstance(value, Mapping):
        extra = sorted(k for k in value if not (isinstance(k, int) and 0 <= k < num_layers))
        if extra:
            raise bad_argument(name, f"layers {extra}", f"layer indices in [0, {num_layers})")
        return [_one_scale(value.get(i), name) for i in range(num_layers)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != num_layers:
            raise bad_argument(name, f"{len(value)} entries", f"one per layer ({num_layers})")
        return [_one_scale(v, name) for v in value]
    if isinstance(value, (int, float, torch.Tensor)):
        s = _one_scale(value, name)
        return [s] * num_layers
    raise bad_argument(name, type(value).__name__, "None, a number, a tensor, or one per layer (list/dict)")


def _plan_settings(plan, num_layers: int) -> tuple[str, str, str | None, list, list]:
    """(kv_dtype, scale_granularity, layout, k_scales, v_scales) from a duck-typed plan.

    The plan is what :func:`fp8kv.resolve_kv_cache` returns: ``kv_dtype``,
    ``scale_granularity``, optional ``layout``, and per-layer scales through
    ``layer_scales(layer)`` or the ``k_scales`` / ``v_scales`` dicts.
    """
    kv_dtype = getattr(plan, "kv_dtype", None)
    gran = getattr(plan, "scale_granularity", None)
    if kv_dtype is None or kv_dtype == "auto" or gran is None:
        raise bad_argument("plan", f"kv_dtype={kv_dtype!r}, scale_granularity={gran!r}",
                           "an FP8 plan (from fp8kv.resolve_kv_cache with an FP8 kv_cache_dtype)")
    ks: list = [None] * num_layers
    vs: list = [None] * num_layers
    if gran != "token_head":
        layer_scales = getattr(plan, "layer_scales", None)
        for i in range(num_layers):
            if layer_scales is not None:
                k, v = layer_scales(i)
            else:
                k = getattr(plan, "k_scales", {}).get(i)
                v = getattr(plan, "v_scales", {}).get(i)
            ks[i], vs[i] = _one_scale(k, "k_scale"), _one_scale(v, "v_scale")
    return kv_dtype, gran, getattr(plan, "layout", None), ks, vs


# ------------------------------------------------------------------------------------ cache


class FP8PagedLayer(CacheLayerMixin):
    """One layer's entry in :class:`FP8PagedCache`: its :class:`fp8kv.KVCache` and counters.

    ``update`` only counts columns and hands the new K/V back; the attention function
    writes them into the FP8 cache (it alone knows which columns are padding).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: FP8PagedCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.kv: KVCache | None = None
        self.columns = 0
        self.steps = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.columns += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1 if self.owner.max_cache_len is None else self.owner.max_cache_len

    def reset(self) -> None:
        self.columns = 0
        self.steps = 0

    def offload(self):
        raise NotImplementedError("FP8PagedCache does not offload layers")

    def prefetch(self):
        raise NotImplementedError("FP8PagedCache does not offload layers")

    # Batch surgery changes every layer's blocks at once: FP8PagedCache does it (the block pool is
    # shared), so these are reached only when a layer is used on its own.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("reorder_cache: call it on the FP8PagedCache (its layers share one block pool)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop: call it on the FP8PagedCache (its layers share one block pool)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("batch_repeat_interleave: call it on the FP8PagedCache (its layers share one "
                                  "block pool)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("batch_select_indices: call it on the FP8PagedCache (its layers share one "
                                  "block pool)")


class FP8PagedCache(Cache):
    """A transformers ``Cache`` that stores K/V in one paged :class:`fp8kv.KVCache` per layer.

    Use it with a model whose attention implementation is ``"fp8kv"`` (see
    :func:`fp8kv.integrations.transformers.enable`)::

        cache = FP8PagedCache.from_model(model)            # e4m3, per-token-head scales
        out = model.generate(**inputs, past_key_values=cache)

    Args:
        config: the model config (layers, heads and head size are read from it).
        kv_dtype: FP8 storage format (default ``"fp8_e4m3"``, or the plan's).
        scale_granularity: ``"token_head"`` (default: dynamic, one scale per token and KV
            head), ``"head"`` or ``"tensor"`` (static: give ``k_scales`` / ``v_scales``, e.g.
            from :func:`calibrate_kv_scales`, or they default to 1.0 with a warning).
        k_scales / v_scales: static dequant scales: one number/tensor for every layer, a
            list with one per layer, or a dict layer -> scale; shape ``()`` or ``(H,)``.
        plan: an :class:`fp8kv.KVCachePlan` (from :func:`fp8kv.resolve_kv_cache`); supplies
            kv_dtype, granularity, layout and per-layer scales (explicit arguments must agree).
        layout: ``"NHD"`` (default) or ``"HND"``.
        block_size: tokens per page (default 16).
        max_cache_len: tokens per sequence to pre-allocate for (fixed pool; exceeding it is
            an error). None (default): the block pool grows by doubling when it runs out.
        backend: fp8kv backend for write_kv and paged_attention (``"auto"`` or a name).
        sink_tokens: keep the first ``sink_tokens`` tokens of every row unquantized (the model's
            dtype) beside the FP8 cache (:mod:`fp8kv.transforms`; default 0).
        k_centering: None (default), ``"prefill"`` (store ``k - mu``, ``mu`` the mean of each row's
            first written non-sink keys, per layer and KV head) or ``"calibrated"`` (``mu`` from
            ``k_means``: one ``[H, D]`` tensor per layer, e.g. :func:`calibrate_key_means`).
            Exact before rounding (softmax is shift-invariant); refused with a logit soft-cap.
        static: decode steps with fixed shapes and no host synchronisation, capturable in a CUDA
            graph (needs ``max_cache_len``; see :mod:`fp8kv.integrations._static` and
            :meth:`replayed`). Prefill steps and batch surgery stay on the host path.
    """

    @property
    def max_cache_len(self) -> int | None:
        """Tokens per sequence pre-allocated for (None: the pool grows)."""
        return self._max_cache_len

    def __init__(self, config, *, kv_dtype: str | None = None, scale_granularity: str | None = None,
                 k_scales=None, v_scales=None, plan=None, layout: str | None = None, block_size: int = 16,
                 max_cache_len: int | None = None, backend: str = "auto", fp8_attention: bool = False,
                 sink_tokens: int = 0, k_centering: str | None = None, k_means=None, static: bool = False):
        shape = model_shape(config)
        self.shape = shape
        n = shape.num_layers
        if plan is not None:
            p_dtype, p_gran, p_layout, p_k, p_v = _plan_settings(plan, n)
            for name, given, planned in (("kv_dtype", kv_dtype, p_dtype), ("scale_granularity",
                                          scale_granularity, p_gran), ("layout", layout, p_layout)):
                if given is not None and planned is not None and given != planned:
                    raise bad_argument(name, repr(given), f"{planned!r} (from the plan) or None")
            if k_scales is not None or v_scales is not None:
                raise bad_argument("k_scales/v_scales", "scales and a plan", "one of the two (the plan's "
                                   "scales are used)")
            kv_dtype, scale_granularity, layout = p_dtype, p_gran, layout or p_layout
            ks, vs = p_k, p_v
        else:
            ks, vs = _per_layer(k_scales, n, "k_scales"), _per_layer(v_scales, n, "v_scales")
        self.kv_dtype = kv_dtype or "fp8_e4m3"
        self.scale_granularity = scale_granularity or "token_head"
        if self.scale_granularity not in GRANULARITIES:
            raise bad_argument("scale_granularity", repr(self.scale_granularity), f"one of {GRANULARITIES}")
        self.layout = layout or "NHD"
        if self.scale_granularity == "token_head":
            if any(s is not None for s in ks + vs):
                raise bad_argument("k_scales/v_scales", "static scales", "None with scale_granularity="
                                   "'token_head' (scales are computed at write time)")
        else:
            missing = [i for i in range(n) if ks[i] is None or vs[i] is None]
            if missing:
                warnings.warn(f"fp8kv: no {self.scale_granularity} k/v scales for {len(missing)} of {n} "
                              "layers; using 1.0 (uncalibrated). Calibrate them with calibrate_kv_scales() "
                              "or use scale_granularity='token_head'.", UserWarning, stacklevel=2)
        self.k_scales, self.v_scales = ks, vs
        self.backend = backend
        if not isinstance(fp8_attention, bool):
            raise bad_argument("fp8_attention", repr(fp8_attention), "True or False")
        self.fp8_attention = fp8_attention  # the opt-in FP8 attention mode (fp8kv.fp8_attention)
        self.transform = KVTransform.build(sink_tokens, k_centering, k_means, num_layers=n,
                                           num_kv_heads=shape.num_kv_heads, head_size=shape.head_size)
        if self.transform.active and fp8_attention:
            raise bad_argument("sink_tokens/k_centering", self.transform.describe(),
                               "none with fp8_attention=True (the two are not combined)")
        self.sinks = SinkState(self.transform, n) if self.transform.active else None
        if not isinstance(static, bool):
            raise bad_argument("static", repr(static), "True or False")
        if static and max_cache_len is None:
            raise bad_argument("static", "True without max_cache_len", "a max_cache_len (every row owns its blocks "
                               "from the first step on)")
        self._max_cache_len = max_cache_len
        self.pool = BlockPool(block_size, max_cache_len=max_cache_len)
        self.static = StaticState(self.pool) if static else None
        self._static_step = None
        self._step_is_static = False
        self.plan = plan
        self._step_plan: StepPlan | None = None
        self._step_metadata: dict = {}
        super().__init__(layers=[FP8PagedLayer(self, i) for i in range(n)])

    @classmethod
    def from_model(cls, model, **kwargs) -> FP8PagedCache:
        """A cache for ``model`` (its config); kwargs as for the constructor, defaulting to
        the ones given to :func:`enable` for this model."""
        defaults = dict(getattr(model, "_fp8kv_cache_kwargs", {}))
        defaults.update(kwargs)
        return cls(model.config, **defaults)

    # -- transformers Cache API ---------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Count the step's columns for ``layer_idx`` and return ``key_states``/``value_states``
        (``[B, H, q_len, D]``) unchanged; the attention function stores them."""
        pending = _ACTIVE.get()
        if pending is not None and pending[0] is self:
            _ACTIVE.set(None)
            raise Fp8KVError(
                f"attn_implementation: layer {pending[1]}'s new keys went through FP8PagedCache.update but never "
                "reached fp8kv's attention, so the model attended without the cache (wrong outputs). An "
                "FP8PagedCache needs the model's attention to be 'fp8kv': call "
                "fp8kv.integrations.transformers.enable(model) (or model.set_attn_implementation('fp8kv') after "
                "register()); if an earlier forward failed part-way, call cache.reset()")
        out = self.layers[layer_idx].update(key_states, value_states)
        _ACTIVE.set((self, layer_idx))
        return out

    def reset(self) -> None:
        """Empty the cache for a new batch (allocations are kept and reused)."""
        super().reset()
        self.pool.reset()
        if self.sinks is not None:
            self.sinks.reset()
        if self.static is not None:
            self.static.reset()
        self._step_plan, self._step_metadata = None, {}
        if (_ACTIVE.get() or (None,))[0] is self:  # a forward that failed between update and attention
            _ACTIVE.set(None)

    # -- batch surgery: beam search, batch select / repeat, assisted decoding ---------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]`` (``[B]`` ints). A row taken once
        keeps its blocks; each extra copy of a row gets new blocks with its FP8 bytes copied."""
        self._rearrange(_rows("beam_idx", beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (``[B']`` ints, in that order); the others' blocks are freed."""
        self._rearrange(_rows("indices", indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (row ``i`` becomes rows ``i*repeats ...``)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise bad_argument("repeats", repr(repeats), "a positive int")
        if self.pool.batch_size is not None:
            self._rearrange([i for i in range(self.pool.batch_size) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens of every row (assisted / speculative decoding).

        transformers' convention: a count <= 0 (0: nothing). The rows keep their blocks, which
        the next tokens overwrite."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise bad_argument("tokens_to_remove", repr(tokens_to_remove),
                               "a count <= 0 (transformers' crop convention: -n removes n tokens)")
        n = -tokens_to_remove
        if n == 0 or self.pool.batch_size is None:
            return
        self._check_between_steps("crop")
        if self.static is not None:
            self.static.sync_host()
        columns = self.layers[0].columns
        if n > columns:
            raise bad_argument("tokens_to_remove", str(tokens_to_remove), f"at least -{columns} (the cache holds "
                               f"{columns} columns)")
        if self.sinks is not None:
            self.sinks.check_crop(n, self.pool.seq_lens)
        self.pool.crop(n)
        for layer in self.layers:
            layer.columns -= n
        self._step_plan, self._step_metadata = None, {}

    def _check_between_steps(self, what: str) -> None:
        if any(layer.steps != self.pool.steps for layer in self.layers):
            raise Fp8KVError(f"{what}: called in the middle of a forward step (some layers have not run it); "
                             "call it between steps")

    def _rearrange(self, index: list[int]) -> None:
        """Row ``i`` takes old row ``index[i]``'s tokens, in every layer."""
        if self.pool.batch_size is None:
            return  # nothing stored yet: the next forward sets the batch
        self._check_between_steps("reordering the batch")
        if self.static is not None:
            self.static.sync_host()
        src, dst = self.pool.rearrange(index)
        if self.sinks is not None:
            self.sinks.rearrange(index)
        for layer in self.layers:
            kv = layer.kv
            if kv is None:
                continue
            kv = self._layer_kv(layer, kv.num_kv_heads, kv.head_size, kv.key_cache.device)
            if src:
                s = torch.tensor(src, device=kv.key_cache.device)
                d = torch.tensor(dst, device=kv.key_cache.device)
                for t in (kv.key_cache, kv.value_cache):  # block-major in both layouts
                    raw = t.view(torch.uint8)
                    raw[d] = raw[s]
                if kv.scale_granularity == "token_head":
                    for t in (kv.k_scale, kv.v_scale):  # [num_blocks, block_size, H]
                        t[d] = t[s]
        self._step_plan, self._step_metadata = None, {}

    # -- introspection ----------------------------------------------------------------
    @property
    def seq_lens(self) -> list[int]:
        """Tokens stored per row (padding excluded; sink tokens included)."""
        if self.static is not None:
            self.static.sync_host()
        if self.sinks is not None and self.sinks.sink_lens:
            return [f + s for f, s in zip(self.pool.seq_lens, self.sinks.sink_lens, strict=True)]
        return list(self.pool.seq_lens)

    @property
    def block_tables(self) -> list[list[int]]:
        """Block ids of each row."""
        return [list(t) for t in self.pool.tables]

    def layer_cache(self, layer_idx: int) -> KVCache | None:
        """The :class:`fp8kv.KVCache` of one layer (None before its first step)."""
        return self.layers[layer_idx].kv

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token costs over all layers (codes plus dynamic scales)."""
        return sum(kv.bytes_per_token for kv in self._allocated())

    @property
    def bf16_bytes_per_token(self) -> int:
        """What a bf16 cache spends per token over the same layers."""
        return sum(4 * kv.num_kv_heads * kv.head_size for kv in self._allocated())

    @property
    def constant_bytes(self) -> int:
        """Bytes that do not grow with tokens (static scales)."""
        return sum(kv.constant_bytes for kv in self._allocated())

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's cache and scales (allocated capacity)."""
        return sum(kv.nbytes for kv in self._allocated())

    def _allocated(self) -> list[KVCache]:
        return [layer.kv for layer in self.layers if layer.kv is not None]

    # -- the step ---------------------------------------------------------------------
    def _layer_kv(self, layer: FP8PagedLayer, num_kv_heads: int, head_size: int,
                  device: torch.device) -> KVCache:
        """The layer's KVCache with at least the pool's capacity (allocating or growing it)."""
        kv = layer.kv
        want = max(self.pool.capacity, 1)  # a step of sink tokens only may need no block yet
        if kv is not None and kv.num_blocks >= want:
            return kv
        i = layer.layer_idx
        static = self.scale_granularity != "token_head"
        new = KVCache.allocate(
            want, self.pool.block_size, num_kv_heads, head_size, kv_dtype=self.kv_dtype, layout=self.layout,
            scale_granularity=self.scale_granularity,
            k_scale=(1.0 if self.k_scales[i] is None else self.k_scales[i]) if static else None,
            v_scale=(1.0 if self.v_scales[i] is None else self.v_scales[i]) if static else None,
            device=device,
        )
        if kv is not None:  # grow: copy the FP8 bytes (and dynamic scales) of the old blocks
            n = kv.num_blocks
            new.key_cache.view(torch.uint8)[:n].copy_(kv.key_cache.view(torch.uint8))
            new.value_cache.view(torch.uint8)[:n].copy_(kv.value_cache.view(torch.uint8))
            if not static:
                new.k_scale[:n].copy_(kv.k_scale)
                new.v_scale[:n].copy_(kv.v_scale)
        layer.kv = new
        return new

    def _metadata(self, plan, kv: KVCache, num_q_heads: int, dtype: torch.dtype, scaling: float | None,
                  sliding_window: int | None, softcap: float | None, *, static: bool = False) -> AttentionMetadata:
        """The step's attention metadata, planned by the first layer and shared by the others
        (one per distinct set of attention options: models mix windowed and global layers)."""
        if self._step_plan is not plan:
            self._step_plan, self._step_metadata = plan, {}
        key = (kv.spec, num_q_heads, dtype, scaling, sliding_window, softcap)
        meta = self._step_metadata.get(key)
        if meta is None:
            meta = self._step_metadata[key] = plan_attention(
                kv, num_q_heads=num_q_heads, query_dtype=dtype, block_tables=plan.block_tables,
                seq_lens=plan.seq_lens, query_start_loc=plan.query_start_loc, slot_mapping=plan.slot_mapping,
                num_tokens=plan.num_tokens, max_query_len=plan.max_query_len, softmax_scale=scaling,
                sliding_window=sliding_window, logits_soft_cap=softcap, backend=self.backend,
                fp8_attention=self.fp8_attention,
                **({"validate": False, "max_seq_len": self.max_cache_len} if static else {}))
        return meta

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               valid: torch.Tensor | None, *, scaling: float | None, sliding_window: int | None,
               softcap: float | None) -> torch.Tensor:
        """Write the step's tokens of ``layer_idx`` and attend over the FP8 cache.

        Args:
            query: ``[B, Hq, q_len, D]``; key / value: ``[B, H, q_len, D]`` (the new columns).
            valid: ``[B, q_len]`` bool (False = padding, never written) or None.
        Returns:
            ``[B, q_len, Hq, D]`` in the query dtype (zeros at padding columns).
        """
        B, Hq, q_len, D = query.shape
        H = key.shape[1]
        layer = self.layers[layer_idx]
        new_step = layer.steps == self.pool.steps
        if not new_step and layer.steps != self.pool.steps - 1:
            raise Fp8KVError(f"layers out of step: layer {layer_idx} has run {layer.steps} steps, the cache "
                             f"{self.pool.steps}; every layer must run once per forward")
        if new_step:
            self._step_is_static = self._static_decode(valid, B, q_len)
        if self._step_is_static:
            return self._attend_static(layer, query, key, value, valid, new_step, scaling, sliding_window, softcap)
        if new_step and self.static is not None:
            self.static.sync_host()
        sinks, xstep = self.sinks, None
        if sinks is not None:
            if new_step:
                sinks.begin_step(valid, B, q_len, self.pool.seq_lens, query.device)
            xstep = sinks.step
            valid = xstep.fp8_valid  # the FP8 cache holds the non-sink tokens only
        plan: StepPlan = self.pool.step(valid, B, q_len, query.device, new=new_step)
        layer.steps += 1
        kv = self._layer_kv(layer, H, D, query.device)
        k4, v4 = key.transpose(1, 2), value.transpose(1, 2)  # [B, q_len, H, D]
        if xstep is not None:
            k4 = sinks.store(layer_idx, k4, v4, xstep)
        k = k4.reshape(B * q_len, H, D).contiguous()
        v = v4.reshape(B * q_len, H, D).contiguous()
        meta = self._metadata(plan, kv, Hq, query.dtype, scaling, sliding_window, softcap)
        write_kv(kv, k, v, meta)
        q = query.transpose(1, 2).reshape(B * q_len, Hq, D)
        if xstep is not None:
            return self._attend_with_sinks(layer_idx, q, kv, meta, plan, xstep, B, q_len)
        if plan.token_index is not None:
            q = q.index_select(0, plan.token_index)
        out = paged_attention(q.contiguous(), kv, meta)
        if plan.token_index is not None:
            full = out.new_zeros((B * q_len, Hq, D))
            full.index_copy_(0, plan.token_index, out)
            out = full
        return out.view(B, q_len, Hq, D)

    def _static_decode(self, valid: torch.Tensor | None, batch_size: int, q_len: int) -> bool:
        """Whether this step runs the static decode path (:mod:`._static`)."""
        if self.static is None or q_len != 1 or self.pool.batch_size is None:
            return False
        if batch_size != self.pool.batch_size:
            raise bad_argument("input", f"batch size {batch_size}", f"the cache's batch size "
                               f"{self.pool.batch_size} (call cache.reset() for a new batch)")
        if self.sinks is not None:  # the sink bookkeeping must be constant: full sinks, means set, no window
            # (a padding column in a decode step writes nothing and changes no sink or mean)
            s = self.sinks
            return bool(s.sink_lens) and all(n == self.transform.sink_tokens for n in s.sink_lens) \
                and (self.transform.k_centering != "prefill" or all(s.mean_set)) \
                and "sliding_attention" not in self.shape.layer_types
        return True

    def _attend_static(self, layer: FP8PagedLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       valid: torch.Tensor | None, new_step: bool, scaling: float | None, sliding_window: int | None,
                       softcap: float | None) -> torch.Tensor:
        """A decode step without host synchronisation (``static=True``); shapes as :meth:`attend`."""
        B, Hq, _, D = query.shape
        H = key.shape[1]
        if new_step:
            self._static_step = self.static.begin_step(valid, B, query.device)
            if self.sinks is not None:
                self.sinks.step = self.sinks.static_step(B, query.device)
        st = self._static_step
        layer.steps += 1
        kv = self._layer_kv(layer, H, D, query.device)
        k, v = key[:, :, 0], value[:, :, 0]  # [B, H, D]
        if self.sinks is not None:
            k = self.sinks.store(layer.layer_idx, k[:, None], v[:, None], self.sinks.step)[:, 0]
        meta = self._metadata(st, kv, Hq, query.dtype, scaling, sliding_window, softcap, static=True)
        write_kv(kv, k.contiguous(), v.contiguous(), meta)
        q = query[:, :, 0].contiguous()  # [B, Hq, D]
        if self.sinks is not None and self.transform.sink_tokens:
            out_f, lse_f = paged_attention(q, kv, meta, return_lse=True)
            opts = meta.options
            out = self.sinks.attend(layer.layer_idx, q, out_f, lse_f, self.sinks.step,
                                    softmax_scale=opts.softmax_scale, sliding_window=opts.sliding_window,
                                    softcap=opts.logits_soft_cap)
        else:
            out = paged_attention(q, kv, meta)
        if st.valid is not None:  # a padding column: nothing written, output 0
            out = out * st.valid[:, :, None].to(out.dtype)
        return out.view(B, 1, Hq, D)

    def replayed(self, steps: int) -> None:
        """Tell the cache that a captured static decode step was replayed ``steps`` times.

        A CUDA-graph replay advances the cache on the device only; this advances the host's
        counters alike (no transfer), so that ``get_seq_length``, ``crop`` and the
        ``max_cache_len`` check stay right."""
        if self.static is None:
            raise Fp8KVError("replayed: the cache is not static (FP8PagedCache(..., static=True, max_cache_len=N))")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise bad_argument("steps", repr(steps), "an int >= 0")
        self.static.upper += steps
        self.static.device_steps += steps
        self.pool.steps += steps
        for layer in self.layers:
            layer.columns += steps
            layer.steps += steps

    def _attend_with_sinks(self, layer_idx: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
                           plan: StepPlan, xstep, B: int, q_len: int) -> torch.Tensor:
        """The FP8 part (with its lse) merged with the sink part (:mod:`fp8kv.transforms`).

        ``q``: ``[B * q_len, Hq, D]``; returns ``[B, q_len, Hq, D]`` (zeros at padding columns)."""
        Hq, D = q.shape[1], q.shape[2]
        out_f = lse_f = None
        if plan.num_tokens:
            qf = q if plan.token_index is None else q.index_select(0, plan.token_index)
            if self.transform.sink_tokens:
                out_f, lse_f = paged_attention(qf.contiguous(), kv, meta, return_lse=True)
            else:  # centering only: nothing to merge
                out_f = paged_attention(qf.contiguous(), kv, meta)
        qa = q if xstep.query_index is None else q.index_select(0, xstep.query_index)
        opts = meta.options
        out = self.sinks.attend(layer_idx, qa, out_f, lse_f, xstep, softmax_scale=opts.softmax_scale,
                                sliding_window=opts.sliding_window, softcap=opts.logits_soft_cap)
        if xstep.query_index is not None:
            full = out.new_zeros((B * q_len, Hq, D))
            full.index_copy_(0, xstep.query_index, out)
            out = full
        return out.view(B, q_len, Hq, D)


def _rows(name: str, index) -> list[int]:
    """A 1-D integer tensor or sequence of row ids as a list."""
    t = torch.as_tensor(index)
    if t.dim() != 1 or t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise bad_argument(name, f"{t.dtype} of shape {tuple(t.shape)}", "a 1-D tensor of row indices")
    return [int(i) for i in t.tolist()]


# ------------------------------------------------------------------------------------ interfaces


def fp8kv_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=None, attention_mask: torch.Tensor | None = None,
               **kwargs) -> torch.Tensor | None:
    """The mask the fp8kv attention takes: the step's ``[B, q_len]`` padding flags, or None.

    Registered with transformers' ``AttentionMaskInterface``; ``attention_mask`` is the 2D
    padding mask of the whole sequence, whose last ``q_length`` columns are the step's.
    """
    if mask_function is not None and getattr(mask_function, "__name__", "") == "bidirectional_mask_function":
        raise Fp8KVError("attention mask: got a bidirectional mask, expected causal attention "
                         "(fp8kv's paged attention is causal)")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[-1] < q_length:
        raise bad_argument("attention_mask", f"shape {tuple(attention_mask.shape)}",
                           f"a 2D padding mask [batch, >= {q_length}] (past and new columns)")
    valid = attention_mask[:, -q_length:].to(torch.bool)
    if q_length == 1:  # decode: no host read (a static step stays free of syncs; the flags are cheap)
        return valid
    if bool(valid.all()):
        return None
    return valid


def fp8kv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``attn_implementation="fp8kv"``) over an FP8 paged cache.

    Args:
        module: the attention module (its ``layer_idx`` selects the cache layer).
        query: ``[B, Hq, q_len, D]``; key / value: ``[B, H, q_len, D]`` as returned by
            :meth:`FP8PagedCache.update` (the step's columns only).
        attention_mask: what :func:`fp8kv_mask` returned: ``[B, q_len]`` bool or None.
        scaling: softmax scale (default ``D ** -0.5``); sliding_window / softcap: as the model
            passes them (Mistral, Gemma 2...).
    Returns:
        ``([B, q_len, Hq, D], None)``: no attention weights are materialised.
    """
    layer_idx = getattr(module, "layer_idx", None)
    active = _ACTIVE.get()
    if active is None or active[1] != layer_idx:
        raise Fp8KVError(
            "past_key_values: the model uses attn_implementation='fp8kv', which needs an "
            "fp8kv.integrations.transformers.FP8PagedCache passed as past_key_values (e.g. "
            "model.generate(..., past_key_values=FP8PagedCache.from_model(model))); got none for layer "
            f"{layer_idx}. To run without it, switch back with disable(model).")
    _ACTIVE.set(None)
    cache = active[0]
    if key.shape[-2] != query.shape[-2]:
        raise Fp8KVError(f"key: got {key.shape[-2]} positions for {query.shape[-2]} queries, expected the "
                         "step's new columns only (FP8PagedCache.update returns them unchanged)")
    if dropout and module.training:
        raise Fp8KVError(f"dropout: got {dropout} in training mode, expected inference (dropout 0)")
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise Fp8KVError(f"{name}: got attention sinks, which fp8kv's paged attention does not support")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise bad_argument("attention_mask", f"{attention_mask.dim()}D {attention_mask.dtype}",
                           "the [batch, q_len] bool flags that the 'fp8kv' mask function builds "
                           "(4D or custom masks are not supported)")
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    out = cache.attend(layer_idx, query, key, value, attention_mask, scaling=scaling,
                       sliding_window=None if sliding_window is None else int(sliding_window),
                       softcap=None if not softcap else float(softcap))
    return out, None


def register() -> str:
    """Register the ``"fp8kv"`` attention and mask functions with transformers; return the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, fp8kv_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, fp8kv_mask)
    assert ATTN_IMPLEMENTATION in ALL_ATTENTION_FUNCTIONS
    assert ATTN_IMPLEMENTATION in ALL_MASK_ATTENTION_FUNCTIONS
    return ATTN_IMPLEMENTATION


# ------------------------------------------------------------------------------------ helpers


def enable(model, **cache_kwargs) -> FP8PagedCache:
    """Set ``model`` up for FP8 generation in one call; return a fresh :class:`FP8PagedCache`.

    Checks the model (:func:`check_model`), registers the ``"fp8kv"`` attention, switches the
    model to it (remembering the previous implementation for :func:`disable`) and returns
    ``FP8PagedCache.from_model(model, **cache_kwargs)``. The kwargs are remembered, so
    ``FP8PagedCache.from_model(model)`` makes more caches like it (one per generate call,
    or call ``cache.reset()`` between calls).
    """
    check_model(model)
    register()
    cache = FP8PagedCache(model.config, **cache_kwargs)  # validate the kwargs before switching
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model._fp8kv_previous_attn = model.config._attn_implementation
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise Fp8KVError(f"model: {type(model).__name__} refused attn_implementation='fp8kv' "
                         f"(it stays {model.config._attn_implementation!r})")
    model._fp8kv_cache_kwargs = dict(cache_kwargs)
    return cache


def disable(model, attn_implementation: str | None = None) -> None:
    """Switch ``model`` back to its previous attention (or ``attn_implementation``)."""
    target = attn_implementation or getattr(model, "_fp8kv_previous_attn", None) or "sdpa"
    model.set_attn_implementation(target)


@torch.no_grad()
def calibrate_kv_scales(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                        kv_dtype: str = "fp8_e4m3", granularity: str = "tensor", margin: float = 1.0,
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Static per-layer k/v scales from the K/V ``model`` produces on calibration text.

    Runs one unquantized forward (SDPA attention, a transformers ``DynamicCache``) over
    ``input_ids`` ``[B, T]`` and applies :func:`fp8kv.calibrate` to each layer's K and V of
    the non-padding tokens: ``amax * margin`` maps to the format's max.

    Returns:
        ``(k_scales, v_scales)``: one float32 tensor per layer, shape ``()`` (tensor) or
        ``(H,)`` (head); pass them as ``FP8PagedCache(..., k_scales=..., v_scales=...)``.
    """
    from transformers.cache_utils import DynamicCache

    previous = model.config._attn_implementation
    if previous == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(getattr(model, "_fp8kv_previous_attn", None) or "sdpa")
    try:
        cache = DynamicCache(config=model.config)
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    finally:
        if previous == ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
    keep = None if attention_mask is None else attention_mask.to(torch.bool).reshape(-1)
    ks, vs = [], []
    for layer in cache.layers:
        per = []
        for t in (layer.keys, layer.values):  # [B, H, T, D]
            x = t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
            if keep is not None:
                x = x[keep.to(x.device)]
            per.append(calibrate(x, kv_dtype, granularity=granularity, margin=margin))
        ks.append(per[0])
        vs.append(per[1])
    return ks, vs
