"""Backend plugins: loading, capability matching, selection with reasons.

Backends come from the entry-point group ``fp8kv.backends`` (the built-in ones too,
exactly like an out-of-tree plugin) and from :func:`register_backend`. For each
(device, request) the registry asks every backend ``fp8kv_supports`` and picks the
highest priority one that answers None; everybody passed over keeps its reason.

Plugins are contained; a plugin never takes the others down:

* **Loading.** The built-in entry points (distribution ``fp8kv``: :data:`RESERVED_NAMES`)
  load first, then the third-party ones. Anything an entry point raises while it is
  imported, instantiated, validated against the hookspec or asked ``fp8kv_backend_info``
  (``SystemExit`` and other ``BaseException`` s included) is caught: the plugin is skipped
  and recorded as a :class:`Fault` (:func:`faults`, ``fp8kv probe``, a ``RuntimeWarning``).
  A ``KeyboardInterrupt`` propagates, but the registry stays consistent: what was loaded
  stays loaded, a third-party entry point that was interrupted is recorded as a fault and
  skipped (so a plugin that raises it at import cannot break every later call), an
  interrupted built-in one is retried, and the next call goes on with the entry points
  not loaded yet.
* **Names.** :data:`RESERVED_NAMES` (``reference``, ``triton``, ``cuda``, ``torch``) belong to fp8kv's own
  distribution: any other distribution (or a :func:`register_backend` call) claiming one
  is refused with :class:`ReservedNameError` and recorded as a fault; the built-in keeps
  working. Two third-party backends with one name: the first registered (entry points
  load in name order) is kept, the second is refused with :class:`DuplicateBackendError`
  naming both distributions, recorded as a fault.
* **Hooks.** An exception (``SystemExit`` included) raised by ``fp8kv_supports`` is a
  refusal (the exception is its reason) and a fault; one raised by an op hook after the
  backend claimed support is a :class:`BackendFailure` naming it. Only
  ``KeyboardInterrupt`` propagates (nothing is cached then; the next call asks again).
  Plugin code (imports aside) never runs under the registry lock: answers are computed
  without it and stored under it, so a plugin stuck in a hook blocks only the thread that
  called it, never a selection already cached or one that does not ask it.

``backend="auto"`` picks among the backends :envvar:`FP8KV_AUTO_BACKENDS` allows (all when
unset; a forced name is not affected; a listed name that is not installed is ignored, and
named in the error when nothing is left to serve a request). The first time a backend from
another distribution than fp8kv wins ``auto``, the ``fp8kv`` logger says so at INFO level
(which backend, which distribution, for which request).

Selections are cached per (device, request, forced name, auto allowlist), and so is every
``fp8kv_supports`` answer, so dispatch costs microseconds
(``benchmarks/profiles/dispatch_overhead.py``).
"""

from __future__ import annotations

import importlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from . import settings
from .errors import BackendFailure, Fp8KVError, InvalidArgument, PluginError, Unsupported
from .hookspecs import PROJECT, BackendSpec
from .probe import DeviceInfo, probe
from .request import OPS, BackendInfo, Request, Selection

if TYPE_CHECKING:
    from .cache import KVCache
    from .metadata import AttentionMetadata

ENTRY_POINT_GROUP = "fp8kv.backends"
BUILTIN_DISTRIBUTION = "fp8kv"
"""The distribution whose entry points are the built-in backends."""
RESERVED_NAMES = frozenset({"reference", "triton", "cuda", "torch", "hopper"})
"""Backend names only fp8kv's own distribution may register (its in-tree entry points,
``pyproject.toml``): a plugin claiming one is refused, never a duplicate of the built-in."""

_OP_HOOKS = {"write_kv": "fp8kv_write_kv", "paged_attention": "fp8kv_paged_attention"}
_REQUIRED_HOOKS = ("fp8kv_backend_info", "fp8kv_supports")
_OPTIONAL_HOOKS = ("fp8kv_plan_attention", "fp8kv_update_plan", "fp8kv_priority")

log = logging.getLogger("fp8kv")


class _NameError(PluginError):
    """A plugin refused for the backend name it claims (``name``: that name)."""

    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name


class DuplicateBackendError(_NameError):
    """A backend name is already taken by another distribution (the message names both)."""


class ReservedNameError(_NameError):
    """A plugin from another distribution than fp8kv claims a name of :data:`RESERVED_NAMES`."""


def _describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Fault:
    """A plugin that could not be loaded (or registered), or raised in a hook.

    Attributes:
        name: the entry-point name (load faults), or the backend name (hook faults and
            names refused to :func:`register_backend`).
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

    @property
    def builtin(self) -> bool:
        """Whether this is one of fp8kv's own backends."""
        return self.distribution == BUILTIN_DISTRIBUTION and self.info.name in RESERVED_NAMES

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
        """None or the reason; anything raised inside the hook (``SystemExit`` too) becomes the
        reason and a fault. Only ``KeyboardInterrupt`` propagates."""
        try:
            return self.check_supports(device, request)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken plugin never breaks the others
            error = _describe_exception(exc)
            if self.on_fault is not None:
                self.on_fault(Fault(self.name, self.distribution, error, "fp8kv_supports"))
            return f"fp8kv_supports raised {error}"

    def priority_for(self, device: DeviceInfo, request: Request) -> int:
        """The plugin's ``fp8kv_priority`` for ``request`` (its ``BackendInfo.priority`` without the
        hook, on ``None``, or when the hook fails: then a fault is recorded)."""
        if "fp8kv_priority" not in self.impls:
            return self.info.priority
        try:
            p = self._invoke("fp8kv_priority", {"device": device, "request": request})
            if p is None:
                return self.info.priority
            if not isinstance(p, int) or isinstance(p, bool):
                raise TypeError(f"fp8kv_priority returned {p!r}, expected an int or None")
            return p
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken plugin never breaks the others
            if self.on_fault is not None:
                self.on_fault(Fault(self.name, self.distribution, _describe_exception(exc), "fp8kv_priority"))
            return self.info.priority

    def write_kv(self, cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Run the plugin's ``fp8kv_write_kv``."""
        self._guarded("fp8kv_write_kv", {"cache": cache, "key": key, "value": value, "slot_mapping": slot_mapping})

    def plan_attention(self, device: DeviceInfo, metadata: AttentionMetadata) -> Any:
        """Run the plugin's ``fp8kv_plan_attention`` if it has one (else None)."""
        if "fp8kv_plan_attention" not in self.impls:
            return None
        return self._guarded("fp8kv_plan_attention", {"device": device, "metadata": metadata})

    def update_plan(self, device: DeviceInfo, metadata: AttentionMetadata) -> None:
        """Run the plugin's ``fp8kv_update_plan`` if it has one."""
        if "fp8kv_update_plan" in self.impls:
            self._guarded("fp8kv_update_plan", {"device": device, "metadata": metadata})

    def paged_attention(self, query: torch.Tensor, cache: KVCache, metadata: AttentionMetadata, out: torch.Tensor,
                        lse: torch.Tensor | None) -> None:
        """Run the plugin's ``fp8kv_paged_attention``."""
        self._guarded("fp8kv_paged_attention",
                      {"query": query, "cache": cache, "metadata": metadata, "out": out, "lse": lse})

    def _guarded(self, hook: str, args: dict[str, Any]) -> Any:
        """Call an op hook; any failure (``SystemExit`` too) becomes an error naming this backend.
        Only ``KeyboardInterrupt`` propagates as it is."""
        where = f"backend {self.name!r} ({self.distribution})"
        if hook not in self.impls:
            raise BackendFailure(f"{where} does not implement {hook}")
        try:
            return self._invoke(hook, args)
        except (BackendFailure, KeyboardInterrupt):
            raise
        except Fp8KVError as exc:
            try:
                wrapped = type(exc)(f"{where} in {hook}: {exc}")
            except Exception:  # noqa: BLE001 - a subclass with another constructor
                wrapped = BackendFailure(f"{where} in {hook}: {_describe_exception(exc)}")
            raise wrapped from exc
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a plugin must not end the process
            raise BackendFailure(
                f"{where} claimed support and failed in {hook}: {_describe_exception(exc)}") from exc


def _check_info(info: Any, plugin: Any) -> BackendInfo:
    if not isinstance(info, BackendInfo):
        raise TypeError(f"fp8kv_backend_info returned {info!r}, expected a fp8kv.plugins.BackendInfo")
    name = info.name
    if not isinstance(name, str) or not name or name != name.strip() or name == "auto":
        raise ValueError(f"backend name {info.name!r}: expected a non-empty name other than 'auto'")
    if not isinstance(info.priority, int) or isinstance(info.priority, bool):
        raise TypeError(f"backend {info.name!r}: priority {info.priority!r}, expected an int")
    return info


def _ranked(backends: Iterable[Backend]) -> list[Backend]:
    return sorted(backends, key=lambda b: (-b.info.priority, b.name))


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "<unknown>"


def _is_builtin_entry_point(ep: EntryPoint) -> bool:
    return _distribution(ep) == BUILTIN_DISTRIBUTION and ep.name in RESERVED_NAMES


def _allowlist_reason(allow: frozenset[str]) -> str:
    return f"not in FP8KV_AUTO_BACKENDS={','.join(sorted(allow))}"


@dataclass
class Registry:
    """All known backends. Use the module-level functions; this is the state behind them.

    ``error`` is kept for compatibility and is always None: a name taken twice is a
    fault now, not an error raised by every call.
    """

    backends: dict[str, Backend] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    error: PluginError | None = None
    loaded: bool = False
    _cache: dict = field(default_factory=dict)
    _answers: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set)
    _announced: set = field(default_factory=set)
    _fault_keys: set = field(default_factory=set)
    _done: set = field(default_factory=set)  # entry points dealt with (loaded or faulted)
    _loading: bool = False
    _generation: int = 0  # bumped by every add/remove: a selection made across one is not cached
    _lock: threading.RLock = field(default_factory=threading.RLock)  # guards the state; no plugin code under it
    _load_lock: threading.RLock = field(default_factory=threading.RLock)  # one loader at a time
    pm: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())

    # -- loading ---------------------------------------------------------------------
    def load_entry_points(self) -> None:
        """Load the entry points not loaded yet: the built-in ones first, then the others by name.

        Marked complete only when every entry point was dealt with, so after a
        ``KeyboardInterrupt`` the next call goes on where this one stopped.
        """
        if self.loaded:
            return
        with self._load_lock:
            if self.loaded or self._loading:  # done meanwhile, or a plugin's import called us back
                return
            self._loading = True
            try:
                eps = sorted(entry_points(group=ENTRY_POINT_GROUP),
                             key=lambda e: (not _is_builtin_entry_point(e), e.name, _distribution(e), e.value))
                for ep in eps:
                    self._load_one(ep)
                self.loaded = True
            finally:
                self._loading = False

    def _load_one(self, ep: EntryPoint) -> None:
        dist = _distribution(ep)
        key = (dist, ep.name, ep.value)
        if key in self._done:
            return
        try:
            self.add(ep.load(), distribution=dist)
        except KeyboardInterrupt as exc:
            if not _is_builtin_entry_point(ep):  # one that raises it at import must not break every call
                self._done.add(key)
                self.record(Fault(ep.name, dist, f"KeyboardInterrupt{': ' + str(exc) if str(exc) else ''} "
                                  "(interrupted while loading; skipped until reset_registry())"))
            raise
        except BaseException as exc:  # noqa: BLE001 - ImportError, SystemExit, a bad class or hook: skip it
            self._done.add(key)
            self.record(Fault(ep.name, dist, _describe_exception(exc)))
        else:
            self._done.add(key)

    def record(self, fault: Fault) -> None:
        """Remember a fault and warn about it once."""
        key = (fault.name, fault.distribution, fault.where, fault.error)
        with self._lock:
            if key in self._fault_keys:
                return
            self._fault_keys.add(key)
            self.faults.append(fault)
        action = "was skipped" if fault.where == "load" else "is treated as refusing"
        warnings.warn(f"fp8kv: backend plugin {fault.describe()}; it {action}", RuntimeWarning, stacklevel=3)

    def add(self, obj: Any, distribution: str = "<runtime>") -> Backend:
        """Register ``obj`` (class, module or instance). Raises on an invalid plugin or a name
        that is reserved or taken (nothing is registered then).

        The plugin's own code (instantiation, ``fp8kv_backend_info``) runs outside the lock.
        """
        plugin = obj() if isinstance(obj, type) else obj
        with self._lock:
            self.pm.register(plugin)
            try:
                self.pm.check_pending()
                impls = self._impls(plugin)
            except BaseException:
                self.pm.unregister(plugin)
                raise
        backend = Backend(None, plugin, distribution, impls, on_fault=self.record)  # type: ignore[arg-type]
        try:
            info = _check_info(backend.backend_info(), plugin)
            with self._lock:
                self._claim(info.name, distribution)
                backend.info = info
                self.backends[info.name] = backend
                self._changed()
            return backend
        except BaseException:
            with self._lock:
                if backend.info is not None and self.backends.get(backend.info.name) is backend:
                    del self.backends[backend.info.name]  # interrupted right after registering
                    self._changed()
                self.pm.unregister(plugin)
            raise

    def _impls(self, plugin: Any) -> dict[str, pluggy.HookImpl]:
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
        return impls

    def _claim(self, name: str, distribution: str) -> None:
        """Refuse a reserved name (from another distribution) or a taken one. Under the lock."""
        if name in RESERVED_NAMES and distribution != BUILTIN_DISTRIBUTION:
            raise ReservedNameError(
                f"backend name {name!r} is reserved for fp8kv's built-in backend: the backend from "
                f"{distribution!r} claiming it is refused; rename it", name)
        if name in self.backends:
            other = self.backends[name]
            raise DuplicateBackendError(
                f"two backends are named {name!r}: the one from the distribution {other.distribution!r} "
                f"(registered first) is kept, the one from {distribution!r} is refused; uninstall or "
                "rename one", name)

    def _changed(self) -> None:
        """The set of backends changed: forget cached answers and selections. Under the lock."""
        self._generation += 1
        self._cache.clear()
        self._answers.clear()

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self.backends:
                raise InvalidArgument(f"backend: got {name!r}, expected one of {sorted(self.backends)}")
            backend = self.backends.pop(name)
            self.pm.unregister(backend.plugin)
            self._changed()

    # -- matching --------------------------------------------------------------------
    def answer(self, backend: Backend, device: DeviceInfo, request: Request) -> str | None:
        """``backend``'s (cached) answer to ``fp8kv_supports``, asked outside the lock."""
        return self._cached("supports", backend, device, request, backend.supports)

    def priority(self, backend: Backend, device: DeviceInfo, request: Request) -> int:
        """``backend``'s (cached) priority for ``request`` on ``device`` (``fp8kv_priority``)."""
        return self._cached("priority", backend, device, request, backend.priority_for)

    def _cached(self, what: str, backend: Backend, device: DeviceInfo, request: Request, ask: Any) -> Any:
        """``ask(device, request)``, computed outside the lock and cached per (what, backend, device,
        request) while ``backend`` stays registered."""
        key = (what, backend.name, device, request)
        try:
            return self._answers[key]
        except KeyError:
            pass
        value = ask(device, request)
        with self._lock:
            if self.backends.get(backend.name) is backend:  # not removed or replaced meanwhile
                return self._answers.setdefault(key, value)
        return value

    def snapshot(self) -> tuple[dict[str, Backend], int]:
        """The registered backends and their generation, read consistently."""
        with self._lock:
            return dict(self.backends), self._generation

    def ranked(self) -> list[Backend]:
        """Backends by descending priority, then name."""
        return _ranked(self.snapshot()[0].values())

    def explain(self, request: Request, device: DeviceInfo) -> dict[str, str | None]:
        """Every backend's answer for ``request`` on ``device`` (None = can serve), best first.

        The answers to ``fp8kv_supports`` only: ``FP8KV_AUTO_BACKENDS`` is not applied
        (see :meth:`allowed_for_auto`)."""
        self.load_entry_points()
        return {b.name: self.answer(b, device, request) for b in self.ranked()}

    @staticmethod
    def allowed_for_auto(name: str) -> bool:
        """Whether ``FP8KV_AUTO_BACKENDS`` lets ``auto`` pick the backend ``name``."""
        allow = settings.auto_backends()
        return allow is None or name in allow

    def select(self, request: Request, device: DeviceInfo, forced: str | None) -> Selection:
        allow = settings.auto_backends() if forced is None else None
        key = (device, request, forced, allow)
        sel = self._cache.get(key)
        if sel is None:
            self.load_entry_points()
            backends, generation = self.snapshot()
            sel = self._select(request, device, forced, allow, backends)  # plugin hooks: no lock held
            with self._lock:
                if generation == self._generation:
                    sel = self._cache.setdefault(key, sel)
                announce = (not sel.forced and not sel.backend.builtin
                            and (sel.backend.name, sel.backend.distribution) not in self._announced)
                if announce:
                    self._announced.add((sel.backend.name, sel.backend.distribution))
            if announce:
                log.info("fp8kv: 'auto' picked the third-party backend %r (distribution %r) for %s on %s; "
                         "FP8KV_AUTO_BACKENDS restricts which backends 'auto' may pick",
                         sel.backend.name, sel.backend.distribution, request.describe(), device.name)
        if not sel.forced and not sel.backend.info.fast and device.is_gpu and request.device_type != "cpu":
            self._no_fast_backend(sel)
        return sel

    def _select(self, request: Request, device: DeviceInfo, forced: str | None, allow: frozenset[str] | None,
                backends: dict[str, Backend]) -> Selection:
        if forced is not None:
            if forced not in backends:
                failed = [f for f in list(self.faults) if f.name == forced and f.where == "load"]
                if failed:
                    raise Unsupported(f"backend {forced!r} is installed but failed to load: {failed[0].error}")
                raise InvalidArgument(f"backend: got {forced!r}, expected one of {sorted(backends)} "
                                      "(or 'auto'); see `fp8kv probe`")
            backend = backends[forced]
            reason = self.answer(backend, device, request)
            if reason is not None:
                raise Unsupported(f"backend {forced!r} cannot serve {request.describe()} on "
                                  f"{device.name}: {reason}")
            return Selection(backend, {}, request, device, forced=True)
        reasons: dict[str, str] = {}
        able: list[Backend] = []
        for backend in _ranked(backends.values()):
            if allow is not None and backend.name not in allow:  # not even asked
                reasons[backend.name] = _allowlist_reason(allow)
                continue
            reason = self.answer(backend, device, request)
            if reason is None:
                able.append(backend)
            else:
                reasons[backend.name] = reason
        if not able:
            msg = (f"no backend can serve {request.describe()} on {device.name}: "
                   + ("; ".join(f"{n}: {r}" for n, r in reasons.items()) or "none is installed"))
            missing = sorted(allow - set(backends)) if allow is not None else []
            if missing:
                msg += f" (FP8KV_AUTO_BACKENDS names backends that are not installed: {', '.join(missing)})"
            raise Unsupported(msg)
        prio = {b.name: self.priority(b, device, request) for b in able}
        able.sort(key=lambda b: (-prio[b.name], b.name))
        for other in able[1:]:
            reasons[other.name] = f"can serve, lower priority than {able[0].name}"
        return Selection(able[0], reasons, request, device)

    def _no_fast_backend(self, sel: Selection) -> None:
        backends = self.backends
        fast = {n: r for n, r in sel.reasons.items() if (b := backends.get(n)) is not None and b.info.fast}
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

    Raises :class:`Fp8KVError` if it is invalid: :class:`ReservedNameError` for a name of
    :data:`RESERVED_NAMES` (unless ``distribution="fp8kv"``), :class:`DuplicateBackendError`
    for a taken name (both also recorded as faults), :class:`PluginError` for anything the
    plugin raised (``SystemExit`` included), or pluggy's ``PluginValidationError``; nothing is
    registered then.
    """
    reg = registry()
    try:
        return reg.add(obj, distribution=distribution)
    except (ReservedNameError, DuplicateBackendError) as exc:
        reg.record(Fault(exc.name, distribution, _describe_exception(exc)))
        raise
    except (Fp8KVError, pluggy.PluginValidationError, KeyboardInterrupt):
        raise
    except (TypeError, ValueError) as exc:
        raise PluginError(f"backend plugin {obj!r}: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - SystemExit from the plugin's constructor or info hook
        raise PluginError(f"backend plugin {obj!r}: {_describe_exception(exc)}") from exc


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
    backends = registry().snapshot()[0]
    if name not in backends:
        raise InvalidArgument(f"backend: got {name!r}, expected one of {sorted(backends)}")
    return backends[name]


def select_backend(request: Request, device: DeviceInfo | torch.device | str | None = None,
                   backend: str = "auto") -> Selection:
    """Choose the backend for ``request`` on ``device`` (a DeviceInfo, torch device or None).

    ``backend="name"`` (or ``FP8KV_BACKEND=name`` when ``backend="auto"``) forces one;
    a forced backend that cannot serve the request raises :class:`Fp8KVError` with its reason.
    ``auto`` only picks among the backends ``FP8KV_AUTO_BACKENDS`` allows (all when unset).
    On a GPU, landing on a non-fast backend warns once per request (``FP8KV_STRICT=1``: raises).
    """
    info = device if isinstance(device, DeviceInfo) else probe(device)
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend: got {backend!r}, expected 'auto' or a backend name")
    forced = backend if backend != "auto" else settings.forced_backend()
    return _REGISTRY.select(request, info, forced)


__all__ = [
    "BUILTIN_DISTRIBUTION", "ENTRY_POINT_GROUP", "OPS", "RESERVED_NAMES", "Backend", "BackendFailure",
    "DuplicateBackendError", "Fault", "Registry", "ReservedNameError", "Selection", "available_backends",
    "faults", "get_backend", "register_backend", "registry", "reset_registry", "select_backend",
    "unregister_backend",
]
