"""The contract a backend plugin implements (pluggy project name ``fp8kv``).

A backend is any object with ``@hookimpl``-decorated methods named below, found
through the ``fp8kv.backends`` entry-point group (the value may be a class, which
is instantiated without arguments, a module, or an instance) or passed to
:func:`fp8kv.plugins.register_backend`. The built-in reference backend registers itself
exactly this way. ``docs/plugins.md`` walks through writing, packaging and testing one.

Lifecycle:

1. **Registration.** :func:`fp8kv_backend_info` is called once; the name must be unique
   among installed backends and not one of ``fp8kv.registry.RESERVED_NAMES`` (``reference``,
   ``triton``: fp8kv's own), or the plugin is refused and reported; of two distributions
   providing one name the first registered is kept and the second refused (a fault naming
   both). A plugin that fails to import, to instantiate or to validate against these specs,
   or raises anything while doing so (``SystemExit`` included; a ``KeyboardInterrupt``
   propagates but leaves the registry consistent), is skipped and reported (``fp8kv probe``,
   a ``RuntimeWarning``); it never breaks the other backends.
2. **Selection.** For each (device, request) the registry asks every backend
   :func:`fp8kv_supports` once and caches the answer; the highest ``priority`` backend
   answering ``None`` serves the call unless the caller forces one by name. An exception
   raised by ``fp8kv_supports`` counts as a refusal (and is reported as a fault;
   ``SystemExit`` included, only ``KeyboardInterrupt`` propagates). Hooks are called without
   any registry lock held, possibly from several threads at once. ``backend="auto"`` only
   considers the backends ``FP8KV_AUTO_BACKENDS`` allows.
3. **Plan.** When a backend is chosen for a step's attention (:func:`fp8kv.plan_attention`),
   its optional :func:`fp8kv_plan_attention` may return anything it wants to keep per step
   (launch configuration, workspace buffers); it comes back as ``metadata.backend_plan``.
   After :meth:`~fp8kv.AttentionMetadata.update` (CUDA-graph replays) its optional
   :func:`fp8kv_update_plan` brings that plan up to date in place.
4. **Dispatch.** :func:`fp8kv_write_kv` / :func:`fp8kv_paged_attention` run the op, once per
   layer, with no host sync expected (the metadata carries every host-side number).

Required hooks: ``fp8kv_backend_info``, ``fp8kv_supports`` and at least one op hook; a
missing op hook means that op is refused (``"does not implement fp8kv_write_kv"``).
Hooks are called with keyword arguments; as everywhere in pluggy an implementation may
declare only the arguments it uses.

The core validates every argument before a backend sees it: shapes, dtypes,
devices, ranges and scales are already checked, contiguity is as documented, and
``out`` is allocated. A backend only decides whether it can serve a request and
then serves it exactly (writes bit-exact with :mod:`fp8kv.reference`, attention
within the derived tolerance of :mod:`fp8kv.testing.tolerance`). An exception in an op
hook (``SystemExit`` included; only ``KeyboardInterrupt`` propagates as it is) is re-raised
as :class:`fp8kv.errors.BackendFailure` naming the backend: claiming support and then
failing is a bug, never a silent fallback. Check a backend with
``fp8kv.testing.check_backend``.

Each hook is called on one backend at a time (the registry keeps each backend's
implementations apart), so every hook is ``firstresult``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy
import torch

from .request import BackendInfo, Request

if TYPE_CHECKING:
    from .cache import KVCache
    from .metadata import AttentionMetadata
    from .probe import DeviceInfo

PROJECT = "fp8kv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendSpec:
    """Hook specifications. Implement them on your backend object with ``@hookimpl``."""

    @hookspec(firstresult=True)
    def fp8kv_backend_info(self) -> BackendInfo:
        """Return this backend's :class:`BackendInfo` (name, version, priority).

        Called once when the backend is registered. The name is what ``backend=`` and
        ``FP8KV_BACKEND`` name (not ``"auto"``); ``fast=False`` marks a backend that
        ``auto`` should not silently land on when a GPU is present.
        """

    @hookspec(firstresult=True)
    def fp8kv_supports(self, device: DeviceInfo, request: Request) -> str | None:
        """Return ``None`` if this backend serves ``request`` on ``device``, else a
        short human-readable reason it does not (shown by ``fp8kv probe`` and in
        errors), e.g. ``"fp8_e4m3 needs sm89+ for native casts"``.

        ``device`` may be simulated: decide from its fields (``arch``, ``native_fp8``,
        ``triton``...), not by touching hardware; ``request.device_type`` says where the
        tensors live (e.g. ``"cpu"`` tensors need ``TRITON_INTERPRET=1`` for a Triton
        backend). Called once per (device, request); the answer is cached, so it must be a
        pure function of its arguments. Claim exactly what you serve: the conformance kit
        checks every claimed request against the reference and every refused one for a
        clean error when forced.
        """

    @hookspec(firstresult=True)
    def fp8kv_priority(self, device: DeviceInfo, request: Request) -> int | None:
        """Optional: this backend's priority for ``request`` on ``device`` where it differs from
        :attr:`BackendInfo.priority` (a kernel measured faster only for some requests, e.g.
        decode-only attention on one architecture); ``None`` keeps ``BackendInfo.priority``.

        Asked only for requests this backend serves; like :meth:`fp8kv_supports`, a pure
        function of its arguments (cached), deciding from the device's fields, not hardware.
        """

    @hookspec(firstresult=True)
    def fp8kv_write_kv(
        self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Quantize and scatter ``key``/``value`` into ``cache``, in place.

        Args:
            cache: the layer's cache; for ``token_head`` granularity also write the
                new scales into ``cache.k_scale``/``v_scale[block, offset, head]``.
            key, value: ``[num_tokens, H, D]`` fp32/fp16/bf16, contiguous.
            slot_mapping: ``[num_tokens]`` int32/int64; negative = padding, skip it.
                Valid slots are distinct and < ``cache.num_slots``.
        Must be bit-exact with :func:`fp8kv.reference.write_kv` (codes and, for
        token_head, scales); must not touch any byte outside the mapped slots (codes or
        scales) nor modify its inputs. Padding slots may appear anywhere in the mapping.
        Slots outside ``[0, num_slots)`` may arrive when the caller turned the host checks
        off: treat them as padding (never written), decided inside the kernel.
        """

    @hookspec(firstresult=True)
    def fp8kv_plan_attention(self, device: DeviceInfo, metadata: AttentionMetadata) -> object:
        """Optional: prepare this backend's per-step state for ``metadata`` (called once per step,
        after this backend was selected for its attention); the return value is kept as
        ``metadata.backend_plan``. Decide from host-side numbers only (``metadata.max_query_len``,
        ``num_seqs``, ``block_tables.shape``...): never read tensor values (no host sync). A backend
        without this hook gets ``backend_plan = None``.
        """

    @hookspec(firstresult=True)
    def fp8kv_update_plan(self, device: DeviceInfo, metadata: AttentionMetadata) -> None:
        """Optional: :meth:`~fp8kv.AttentionMetadata.update` refilled the step's tensors in place
        (and replaced ``metadata.host_seq_lens`` / ``host_query_start_loc``, where known); bring
        ``metadata.backend_plan`` up to date with them. Write its tensors in place, never replace
        them (CUDA graphs hold their addresses), and never read tensor values (no host sync). A
        backend without this hook keeps its plan as planned.
        """

    @hookspec(firstresult=True)
    def fp8kv_paged_attention(
        self,
        query: torch.Tensor,
        cache: KVCache,
        metadata: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """Paged attention over the FP8 cache, written into ``out`` (and ``lse``).

        Args:
            query: ``[num_tokens, Hq, D]``, contiguous, Hq a multiple of H.
            cache: a cache with ``metadata.spec``.
            metadata: the step (:class:`fp8kv.AttentionMetadata`): ``block_tables
                [num_seqs, max_blocks]`` int32, ``seq_lens [num_seqs]`` int32 (cached tokens
                per sequence incl. new ones), ``query_start_loc [num_seqs + 1]`` int32
                (monotone, last = num_tokens; decode: ``arange``), ``max_query_len``,
                ``max_seq_len``, ``options`` (``softmax_scale`` multiplies q·k before the
                soft-cap; ``causal``: the i-th of a sequence's q_len queries sits at position
                ``seq_len - q_len + i`` and sees keys up to it; ``sliding_window`` W: only the
                last W visible keys, its own included; ``logits_soft_cap`` c: logits become
                ``c * tanh(logits / c)``) and ``backend_plan`` (this backend's plan).
            out: ``[num_tokens, Hq, D]`` in the query dtype, contiguous.
            lse: None, or ``[num_tokens, Hq]`` float32 to receive each row's log-sum-exp
                (natural log) of its scaled, soft-capped logits over its visible keys.

        Write every element of ``out`` (and ``lse``); do not modify the cache. Do not read
        tensor values on the host (no sync). Only the first ``seq_lens[i]`` positions of
        sequence ``i`` hold data: other slots of its blocks, and blocks it does not list, may
        hold any bytes (NaN codes and NaN token_head scales included) and must not affect the
        output; ``block_tables`` entries past ``ceil(seq_lens[i] / block_size)`` may hold any
        value (0, -1) and must not be dereferenced. Sequences with no query tokens are skipped.
        Compute from the dequantized values in float32 (see :mod:`fp8kv.testing.tolerance`
        for what "matches the reference" means).

        Memory safety does not rest on the host checks (an engine may skip them, or replay a
        CUDA graph over refilled buffers): clamp query ranges to ``[0, num_tokens]`` and
        sequence lengths to ``[0, max_blocks * block_size]``, and mask block ids outside
        ``[0, num_blocks)`` (their keys are not visible); a row that sees no key gets 0 and an
        ``lse`` of ``-inf``. Finite input never gives NaN or inf: logits saturate at
        ``±fp8kv.reference.LOGIT_MAX``, outputs at their dtype's largest finite value.
        """
