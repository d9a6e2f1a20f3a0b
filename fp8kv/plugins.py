"""The API for backend authors and for tools that inspect backends.

A backend plugin implements the hooks of :class:`BackendSpec` with ``@hookimpl`` and is found
through the ``fp8kv.backends`` entry point (or :func:`register_backend`); docs/plugins.md walks
through writing one, and :func:`fp8kv.testing.check_backend` checks it against the reference.

* the contract: :data:`hookimpl`, :class:`BackendSpec`, :class:`BackendInfo`, :class:`Request`
  (with :data:`OPS` and :data:`FEATURES`);
* the device: :class:`DeviceInfo`, :func:`probe`, :func:`simulate_device`;
* the registry: :func:`register_backend`, :func:`unregister_backend`, :func:`available_backends`,
  :func:`select_backend` and its :class:`Selection`.
"""

from .hookspecs import BackendSpec, hookimpl
from .probe import DeviceInfo, probe, simulate_device
from .registry import available_backends, register_backend, select_backend, unregister_backend
from .request import FEATURES, OPS, BackendInfo, Request, Selection

__all__ = [
    "FEATURES", "OPS", "BackendInfo", "BackendSpec", "DeviceInfo", "Request", "Selection", "available_backends",
    "hookimpl", "probe", "register_backend", "select_backend", "simulate_device", "unregister_backend",
]
