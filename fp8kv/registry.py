"""Backend plugins: loading, capability matching, selection with reasons.

Backends come from the entry-point group ``fp8kv.backends`` (the reference too,
exactly like an out-of-tree plugin) and from :func:`register_backend`. For each
(device, request) the registry asks every backend ``fp8kv_supports`` and picks the
highest priority one that answers None; everybody passed over keeps its reason.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy
import torch

from .errors import Fp8KVError
from .hookspecs import PROJECT, BackendInfo, BackendSpec, Request
from .probe import DeviceInfo, probe

ENTRY_POINT_GROUP = "fp8kv.backends"


class BackendFailure(RuntimeError):
    """A backend claimed support for a request and then failed serving it."""


@dataclass(frozen=True)
class LoadFault:
    """A plugin that could not be loaded or answered a hook with an exception."""

    name: str
    distribution: str
    error: str


@dataclass
class Backend:
    """One registered backend: its info and its hook implementations."""

    info: BackendInfo
    plugin: Any
    distribution: str
    hooks: dict[str, Any]

    @property
    def name(self) -> str:
        return self.info.name

    def supports(self, device: DeviceInfo, request: Request) -> str | None:
        """None or the reason; an exception inside the hook becomes a reason too."""
        try:
            reason = self.hooks["fp8kv_supports"](device=device, request=request)
        except Exception as exc:  # a broken plugin never breaks the others
            return f"fp8kv_supports raised {type(exc).__name__}: {exc}"
        return None if reason is None else str(reason)

    def _call(self, hook: str, **kwargs) -> None:
        try:
            self.hooks[hook](**kwargs)
        except Fp8KVError:
            raise
        except Exception as exc:
            raise BackendFailure(
                f"backend {self.name!r} ({self.distribution}) claimed support and failed in {hook}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def write_kv(self, cache, key, value, slot_mapping) -> None:
        self._call("fp8kv_write_kv", cache=cache, key=key, value=value, slot_mapping=slot_mapping)

    def paged_attention(self, **kwargs) -> None:
        self._call("fp8kv_paged_attention", **kwargs)


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_backend`.

    Attributes:
        backend: the backend that will serve the request.
        reasons: every backend passed over -> why (lower priority ones that could
            also serve say ``"lower priority than <name>"``).
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


_HOOKS = ("fp8kv_backend_info", "fp8kv_supports", "fp8kv_write_kv", "fp8kv_paged_attention")


@dataclass
class Registry:
    """All known backends. Use the module-level functions; this is the state behind them."""

    backends: dict[str, Backend] = field(default_factory=dict)
    faults: list[LoadFault] = field(default_factory=list)
    loaded: bool = False
    _cache: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    pm: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())

    def load_entry_points(self) -> None:
        with self._lock:
            if self.loaded:
                return
            self.loaded = True
            for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                dist = ep.dist.name if ep.dist is not None else "<unknown>"
                try:
                    obj = ep.load()
                    self.add(obj, distribution=dist)
                except Fp8KVError:
                    raise
                except Exception as exc:
                    self._fault(ep.name, dist, f"{type(exc).__name__}: {exc}")

    def _fault(self, name: str, dist: str, error: str) -> None:
        self.faults.append(LoadFault(name, dist, error))
        warnings.warn(f"fp8kv: backend plugin {name!r} from {dist} was skipped: {error}",
                      RuntimeWarning, stacklevel=3)

    def add(self, obj: Any, distribution: str = "<runtime>") -> Backend:
        plugin = obj() if isinstance(obj, type) else obj
        self.pm.register(plugin)
        try:
            self.pm.check_pending()
            hooks = {}
            for hook in _HOOKS:
                impls = [i for i in getattr(self.pm.hook, hook).get_hookimpls() if i.plugin is plugin]
                if not impls:
                    raise Fp8KVError(f"backend plugin {plugin!r}: missing hook {hook}")
                hooks[hook] = impls[0].function
            info = hooks["fp8kv_backend_info"]()
            if not isinstance(info, BackendInfo):
                raise Fp8KVError(f"backend plugin {plugin!r}: fp8kv_backend_info returned {info!r}, "
                                 "expected a BackendInfo")
            if info.name in self.backends:
                other = self.backends[info.name]
                raise Fp8KVError(f"two backends are named {info.name!r}: one from {other.distribution}, "
                                 f"one from {distribution}; uninstall or rename one")
        except Exception:
            self.pm.unregister(plugin)
            raise
        backend = Backend(info, plugin, distribution, hooks)
        self.backends[info.name] = backend
        self._cache.clear()
        return backend

    def remove(self, name: str) -> None:
        with self._lock:
            backend = self.backends.pop(name)
            self.pm.unregister(backend.plugin)
            self._cache.clear()

    def select(self, request: Request, device: DeviceInfo, forced: str | None) -> Selection:
        key = (device, request, forced)
        sel = self._cache.get(key)
        if sel is None:
            with self._lock:
                self.load_entry_points()
                sel = self._select(request, device, forced)
                self._cache[key] = sel
        if not sel.forced and not sel.backend.info.fast and device.is_gpu and request.device_type != "cpu":
            self._no_fast_backend(sel)
        return sel

    def _select(self, request: Request, device: DeviceInfo, forced: str | None) -> Selection:
        if forced is not None:
            if forced not in self.backends:
                raise Fp8KVError(f"backend: got {forced!r}, expected one of {sorted(self.backends)} "
                                 f"(faults: {[f.name for f in self.faults] or 'none'})")
            backend = self.backends[forced]
            reason = backend.supports(device, request)
            if reason is not None:
                raise Fp8KVError(f"backend {forced!r} cannot serve {request.describe()} on "
                                 f"{device.name}: {reason}")
            return Selection(backend, {}, request, device, forced=True)
        reasons: dict[str, str] = {}
        able: list[Backend] = []
        for backend in sorted(self.backends.values(), key=lambda b: (-b.info.priority, b.name)):
            reason = backend.supports(device, request)
            if reason is None:
                able.append(backend)
            else:
                reasons[backend.name] = reason
        if not able:
            raise Fp8KVError(f"no backend can serve {request.describe()} on {device.name}: "
                             + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
        for other in able[1:]:
            reasons[other.name] = f"can serve, lower priority than {able[0].name}"
        return Selection(able[0], reasons, request, device)

    def _no_fast_backend(self, sel: Selection) -> None:
        why = "; ".join(f"{n}: {r}" for n, r in sel.reasons.items()) or "no fast backend is installed"
        msg = (f"fp8kv: {sel.request.describe()} on {sel.device.name} falls back to the slow "
               f"{sel.backend.name!r} backend ({why})")
        if os.environ.get("FP8KV_STRICT", "0") not in ("", "0"):
            raise Fp8KVError(msg + "; FP8KV_STRICT=1 forbids this")
        if sel.request not in self._warned:
            self._warned.add(sel.request)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)


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
    """Forget every backend and re-read the entry points on next use (for tests)."""
    global _REGISTRY
    _REGISTRY = Registry()
    return _REGISTRY


def register_backend(obj: Any) -> Backend:
    """Register a backend object (or class) at run time; returns the registered Backend."""
    reg = registry()
    with reg._lock:
        return reg.add(obj)


def unregister_backend(name: str) -> None:
    registry().remove(name)


def available_backends() -> dict[str, Backend]:
    return dict(registry().backends)


def select_backend(request: Request, device: DeviceInfo | torch.device | str | None = None,
                   backend: str = "auto") -> Selection:
    """Choose the backend for ``request`` on ``device`` (a DeviceInfo, torch device or None).

    ``backend="name"`` (or ``FP8KV_BACKEND=name`` when ``backend="auto"``) forces one;
    a forced backend that cannot serve the request raises :class:`Fp8KVError` with its reason.
    """
    info = device if isinstance(device, DeviceInfo) else probe(device)
    forced = backend if backend != "auto" else (os.environ.get("FP8KV_BACKEND") or None)
    return _REGISTRY.select(request, info, forced)
