"""Backend plugins: loading, capability matching, selection with reasons.

Backends come from the entry-point group ``fp8kv.backends`` (the reference too,
exactly like an out-of-tree plugin) and from :func:`register_backend`. For each
(device, request) the registry asks every backend ``fp8kv_supports`` and picks the
highest priority one that answers None; everybody passed over keeps its reason.

Faults never take the others down: a plugin that fails to import, to instantiate, to
validate against the hookspec or to describe itself is skipped and recorded (see
:func:`faults`, ``fp8kv probe``) with a ``RuntimeWarning``; one whose ``fp8kv_supports``
raises is treated as refusing (the exception is its reason) and recorded the same way.
Two backends with one name are an error (:class:`DuplicateBackendError`, naming both
distributions) raised by every selection until one is removed. A backend that claims
support and then fails raises :class:`BackendFailure` (or :class:`Fp8KVError`) naming it.

Selections are cached per (device, request, forced name), and so is every
``fp8kv_supports`` answer, so dispatch costs microseconds
(``benchmarks/dispatch_overhead.py``).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from . import settings
from .errors import BackendFailure, Fp8KVError, InvalidArgument, PluginError, Unsupported
from .hookspecs import OPS, PROJECT, BackendInfo, BackendSpec, Request
from .probe import DeviceInfo, probe

if TYPE_CHECKING:
    from .cache import KVCache
    from .metadata import AttentionMetadata

ENTRY_POINT_GROUP = "fp8kv.backends"

_OP_HOOKS = {"write_kv": "fp8kv_write_kv", "paged_attention": "fp8kv_paged_attention"}
_REQUIRED_HOOKS = ("fp8kv_backend_info", "fp8kv_supports")
_OPTIONAL_HOOKS = ("fp8kv_plan_attention",)


class DuplicateBackendError(PluginError):
    """Two installed backends share one name (the message names both distributions)."""


@dataclass(frozen=True)
class Fault:
    """A plugin that could not be loaded, or raised in a hook.

    Attributes:
        name: the entry-point name (load faults) or backend name (hook faults).
        distribution: the distribution that provides it (``"<runtime>"`` for
            :func:`register_backend`).
        error: ``"ExceptionType: message"``.
        where: ``"load"`` or the hook that raised (``"fp8kv_supports"``).
    """

    name: str
    distribution: str
    error: str
    where: str = "load"

    def describe(self) -> str:
        what = "failed to load" if self.where == "load" else f"raised in {self.where}"
        return f"{self.name} ({self.distribution}) {what}: {self.error}"




@dataclass
class Backend:
    """One registered backend: its info and its hook implementations, called through typed methods.

    Attributes:
        info: what it says about itself.
        plugin: the registered object.
        distribution: the distribution it came from (``"<runtime>"`` if registered in code).
        impls: hook name -> the plugin's ``pluggy.HookImpl`` (missing op hooks are absent:
            that op is refused).
    """

    info: BackendInfo
    plugin: Any
    distribution: str
    impls: dict[str, pluggy.HookImpl]
    on_fault: Callable[[Fault], None] | None = None

    @property
    def name(self) -> str:
        return self.info.name

    def implements(self, hook: str) -> bool:
        return hook in self.impls

    def _invoke(self, hook: str, args: dict[str, Any]) -> Any:
        """Call the plugin's implementation of ``hook`` with the arguments it declares (pluggy's rule)."""
        impl = self.impls[hook]
        return impl.function(*[args[n] for n in impl.argnames])

    # -- the hooks, typed ---------------------------------------------------------------
    def backend_info(self) -> BackendInfo:
        return self._invoke("fp8kv_backend_info", {})

    def check_supports(self, device: DeviceInfo, request: Request) -> str | None:
        """The plugin's raw answer: None or its reason. Exceptions propagate (for the kit)."""
        hook = _OP_HOOKS.get(request.op)
        if hook is not None and hook not in self.impls:
            return f"does not implement {hook}"
        reason = self._invoke("fp8kv_supports", {"device": device, "request": request})
        if reason is None:
            return None
        if not isinstance(reason, str):
            raise TypeError(f"fp8kv_supports returned {reason!r}, expected None or a reason string")
        return reason or "refused (no reason given)"

    def supports(self, device: DeviceInfo, request: Request) -> str | None:
        """None or the reason; an exception inside the hook becomes the reason and a fault."""
        try:
            return self.check_supports(device, request)
        except Exception as exc:  # a broken plugin never breaks the others
            error = f"{type(exc).__name__}: {exc}"
            if self.on_fault is not None:
                self.on_fault(Fault(self.name, self.distribution, error, "fp8kv_supports"))
            return f"fp8kv_supports raised {error}"

    def write_kv(self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Run the plugin's ``fp8kv_write_kv``."""
        self._guarded("fp8kv_write_kv", {"cache": cache, "key": key, "value": value, "slot_mapping": slot_mapping})

    def plan_attention(self, device: DeviceInfo, metadata: AttentionMetadata) -> Any:
        """Run the plugin's ``fp8kv_plan_attention`` if it has one (else None)."""
        if "fp8kv_plan_attention" not in self.impls:
            return None
        return self._guarded("fp8kv_plan_attention", {"device": device, "metadata": metadata})

    def paged_attention(self, query: torch.Tensor, cache: KVCache, metadata: AttentionMetadata, out: torch.Tensor,
                        lse: torch.Tensor | None) -> None:
        """Run the plugin's ``fp8kv_paged_attention``."""
        self._guarded("fp8kv_paged_attention",
                      {"query": query, "cache": cache, "metadata": metadata, "out": out, "lse": lse})

    def _guarded(self, hook: str, args: dict[str, Any]) -> Any:
        """Call an op hook; any failure becomes an error naming this backend."""
        if hook not in self.impls:
            raise BackendFailure(f"backend {self.name!r} ({self.distribution}) does not implement {hook}")
        try:
            return self._invoke(hook, args)
        except BackendFailure:
            raise
        except Fp8KVError as exc:
            raise type(exc)(f"backend {self.name!r} ({self.distribution}) in {hook}: {exc}") from exc
        except Exception as exc:
            raise BackendFailure(
                f"backend {self.name!r} ({self.distribution}) claimed support and failed in {hook}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_backend`.

    Attributes:
        backend: the backend that will serve the request.
        reasons: every backend passed over -> why (lower priority ones that could
            also serve say ``"can serve, lower priority than <name>"``).
        request, device: what was asked, where.
        forced: True when the backend was named by the caller or ``FP8KV_BACKEND``.
    """

    backend: Backend
    reasons: dict[str, str]
    request: Request
    device: DeviceInfo
    forced: bool = False

    def explain(self) -> str:
        lines = [f"{self.request.describe()} on {self.device.name}: {self.backend.name}"
                 + (" (forced)" if self.forced else "")]
        lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def _check_info(info: Any, plugin: Any) -> BackendInfo:
    if not isinstance(info, BackendInfo):
        raise TypeError(f"fp8kv_backend_info returned {info!r}, expected a fp8kv.BackendInfo")
    name = info.name
    if not isinstance(name, str) or not name or name != name.strip() or name == "auto":
        raise ValueError(f"backend name {info.name!r}: expected a non-empty name other than 'auto'")
    if not isinstance(info.priority, int) or isinstance(info.priority, bool):
        raise TypeError(f"backend {info.name!r}: priority {info.priority!r}, expected an int")
    return info


@dataclass
class Registry:
    """All known backends. Use the module-level functions; this is the state behind them."""

    backends: dict[str, Backend] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    error: DuplicateBackendError | None = None
    loaded: bool = False
    _cache: dict = field(default_factory=dict)
    _answers: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set)
    _fault_keys: set = field(default_factory=set)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    pm: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())

    # -- loading ---------------------------------------------------------------------
    def load_entry_points(self) -> None:
        if self.loaded:
            return
        with self._lock:
            if self.loaded:
                return
            self.loaded = True
            for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                dist = ep.dist.name if ep.dist is not None else "<unknown>"
                try:
                    self.add(ep.load(), distribution=dist)
                except DuplicateBackendError as exc:
                    self.error = self.error or exc
                    warnings.warn(f"fp8kv: {exc}", RuntimeWarning, stacklevel=2)
                except Exception as exc:  # ImportError, a broken class, a bad hook: skip it
                    self.record(Fault(ep.name, dist, f"{type(exc).__name__}: {exc}"))

    def record(self, fault: Fault) -> None:
        """Remember a fault and warn about it once."""
        key = (fault.name, fault.where, fault.error)
        if key in self._fault_keys:
            return
        self._fault_keys.add(key)
        self.faults.append(fault)
        action = "was skipped" if fault.where == "load" else "is treated as refusing"
        warnings.warn(f"fp8kv: backend plugin {fault.describe()}; it {action}", RuntimeWarning, stacklevel=3)

    def add(self, obj: Any, distribution: str = "<runtime>") -> Backend:
        """Register ``obj`` (class, module or instance). Raises on an invalid plugin."""
        with self._lock:
            plugin = obj() if isinstance(obj, type) else obj
            self.pm.register(plugin)
            try:
                self.pm.check_pending()
                impls = {}
                for hook in (*_REQUIRED_HOOKS, *_OP_HOOKS.values(), *_OPTIONAL_HOOKS):
                    found = [i for i in getattr(self.pm.hook, hook).get_hookimpls() if i.plugin is plugin]
                    if found:
                        impls[hook] = found[0]
                    elif hook in _REQUIRED_HOOKS:
                        raise TypeError(f"backend plugin {plugin!r} does not implement {hook}")
                if not any(h in impls for h in _OP_HOOKS.values()):
                    raise TypeError(f"backend plugin {plugin!r} implements neither fp8kv_write_kv nor "
                                    "fp8kv_paged_attention")
                backend = Backend(None, plugin, distribution, impls, on_fault=self.record)  # type: ignore[arg-type]
                info = _check_info(backend.backend_info(), plugin)
                if info.name in self.backends:
                    other = self.backends[info.name]
                    raise DuplicateBackendError(
                        f"two backends are named {info.name!r}: one from the distribution "
                        f"{other.distribution!r}, one from {distribution!r}; uninstall or rename one")
            except Exception:
                self.pm.unregister(plugin)
                raise
            backend.info = info
            self.backends[info.name] = backend
            self._cache.clear()
            self._answers.clear()
            return backend

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self.backends:
                raise InvalidArgument(f"backend: got {name!r}, expected one of {sorted(self.backends)}")
            backend = self.backends.pop(name)
            self.pm.unregister(backend.plugin)
            self._cache.clear()
            self._answers.clear()

    # -- matching --------------------------------------------------------------------
    def answer(self, backend: Backend, device: DeviceInfo, request: Request) -> str | None:
        """``backend``'s (cached) answer to ``fp8kv_supports``."""
        key = (backend.name, device, request)
        try:
            return self._answers[key]
        except KeyError:
            reason = self._answers[key] = backend.supports(device, request)
            return reason

    def ranked(self) -> list[Backend]:
        """Backends by descending priority, then name."""
        return sorted(self.backends.values(), key=lambda b: (-b.info.priority, b.name))

    def explain(self, request: Request, device: DeviceInfo) -> dict[str, str | None]:
        """Every backend's answer for ``request`` on ``device`` (None = can serve), best first."""
        self.load_entry_points()
        return {b.name: self.answer(b, device, request) for b in self.ranked()}

    def select(self, request: Request, device: DeviceInfo, forced: str | None) -> Selection:
        key = (device, request, forced)
        sel = self._cache.get(key)
        if sel is None:
            self.load_entry_points()
            with self._lock:
                if self.error is not None:
                    raise self.error
                sel = self._select(request, device, forced)
                self._cache[key] = sel
        if not sel.forced and not sel.backend.info.fast and device.is_gpu and request.device_type != "cpu":
            self._no_fast_backend(sel)
        return sel

    def _select(self, request: Request, device: DeviceInfo, forced: str | None) -> Selection:
        if forced is not None:
            if forced not in self.backends:
                failed = [f for f in self.faults if f.name == forced and f.where == "load"]
                if failed:
                    raise Unsupported(f"backend {forced!r} is installed but failed to load: {failed[0].error}")
                raise InvalidArgument(f"backend: got {forced!r}, expected one of {sorted(self.backends)} "
                                 "(or 'auto'); see `fp8kv probe`")
            backend = self.backends[forced]
            reason = self.answer(backend, device, request)
            if reason is not None:
                raise Unsupported(f"backend {forced!r} cannot serve {request.describe()} on "
                                 f"{device.name}: {reason}")
            return Selection(backend, {}, request, device, forced=True)
        reasons: dict[str, str] = {}
        able: list[Backend] = []
        for backend in self.ranked():
            reason = self.answer(backend, device, request)
            if reason is None:
                able.append(backend)
            else:
                reasons[backend.name] = reason
        if not able:
            raise Unsupported(f"no backend can serve {request.describe()} on {device.name}: "
                             + ("; ".join(f"{n}: {r}" for n, r in reasons.items()) or "none is installed"))
        for other in able[1:]:
            reasons[other.name] = f"can serve, lower priority than {able[0].name}"
        return Selection(able[0], reasons, request, device)

    def _no_fast_backend(self, sel: Selection) -> None:
        fast = {n: r for n, r in sel.reasons.items() if self.backends[n].info.fast}
        why = "; ".join(f"{n}: {r}" for n, r in fast.items()) or "no fast backend is installed"
        msg = (f"fp8kv: {sel.request.describe()} on {sel.device.name} falls back to the slow "
               f"{sel.backend.name!r} backend ({why})")
        if settings.strict():
            raise Unsupported(msg + "; FP8KV_STRICT=1 forbids this")
        if sel.request not in self._warned:
            self._warned.add(sel.request)
            warnings.warn(msg, RuntimeWarning, stacklevel=5)


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(BackendSpec)
    return pm


_REGISTRY = Registry()


def registry() -> Registry:
    """The process-wide registry (entry points loaded on first use)."""
    _REGISTRY.load_entry_points()
    return _REGISTRY


def reset_registry() -> Registry:
    """Forget every backend, fault and cached answer; entry points are re-read on next use.

    For tests (e.g. after putting a plugin's dist-info on ``sys.path``).
    """
    global _REGISTRY
    importlib.invalidate_caches()
    _REGISTRY = Registry()
    return _REGISTRY


def register_backend(obj: Any, *, distribution: str = "<runtime>") -> Backend:
    """Register a backend object (or class, or module) at run time; returns the registered Backend.

    Raises :class:`Fp8KVError` (:class:`DuplicateBackendError` for a taken name) or the
    plugin's own error if it is invalid; nothing is registered then.
    """
    reg = registry()
    try:
        return reg.add(obj, distribution=distribution)
    except (Fp8KVError, pluggy.PluginValidationError):
        raise
    except (TypeError, ValueError) as exc:
        raise PluginError(f"backend plugin {obj!r}: {exc}") from exc


def unregister_backend(name: str) -> None:
    """Remove a backend by name (raises :class:`Fp8KVError` if unknown)."""
    registry().remove(name)


def available_backends() -> dict[str, Backend]:
    """Registered backends by name, best priority first."""
    return {b.name: b for b in registry().ranked()}


def faults() -> list[Fault]:
    """Plugins that failed to load or raised in a hook, so far."""
    return list(registry().faults)


def get_backend(name: str) -> Backend:
    """The registered backend ``name`` (raises :class:`Fp8KVError` naming the known ones)."""
    reg = registry()
    if name not in reg.backends:
        raise InvalidArgument(f"backend: got {name!r}, expected one of {sorted(reg.backends)}")
    return reg.backends[name]


def select_backend(request: Request, device: DeviceInfo | torch.device | str | None = None,
                   backend: str = "auto") -> Selection:
    """Choose the backend for ``request`` on ``device`` (a DeviceInfo, torch device or None).

    ``backend="name"`` (or ``FP8KV_BACKEND=name`` when ``backend="auto"``) forces one;
    a forced backend that cannot serve the request raises :class:`Fp8KVError` with its reason.
    On a GPU, landing on a non-fast backend warns once per request (``FP8KV_STRICT=1``: raises).
    """
    info = device if isinstance(device, DeviceInfo) else probe(device)
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend: got {backend!r}, expected 'auto' or a backend name")
    forced = backend if backend != "auto" else settings.forced_backend()
    return _REGISTRY.select(request, info, forced)


__all__ = [
    "ENTRY_POINT_GROUP", "OPS", "Backend", "BackendFailure", "DuplicateBackendError", "Fault",
    "Registry", "Selection", "available_backends", "faults", "get_backend", "register_backend", "registry",
    "reset_registry", "select_backend", "unregister_backend",
]
