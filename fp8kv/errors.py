"""fp8kv's exceptions: one root, :class:`Fp8KVError`, and three kinds under it.

* :class:`InvalidArgument`: bad input (a wrong shape, dtype, value, name or type); the
  message names the argument, what was given and what was expected. Nothing was changed.
* :class:`Unsupported`: the input is valid, but no backend (or the backend asked for) can
  serve it here; the message carries every backend's reason.
* :class:`BackendFailure`: a backend claimed support and then failed; names the backend.

``Fp8KVError`` subclasses ``ValueError`` so that code written against the first version
(``except ValueError``) keeps working.
"""

from __future__ import annotations


class Fp8KVError(ValueError):
    """Anything fp8kv refuses or fails at. Messages name the argument or the backend."""


class InvalidArgument(Fp8KVError):
    """Bad input: ``name: got <given>, expected <expected>``. The cache is unchanged."""


class Unsupported(Fp8KVError):
    """A valid request that no installed backend (or the forced one) can serve on this device."""


class BackendFailure(Fp8KVError, RuntimeError):
    """A backend claimed support for a request and then failed serving it (names the backend)."""


class PluginError(Fp8KVError):
    """A backend plugin is invalid (bad hooks, a name taken twice)."""


def bad_argument(name: str, given: object, expected: str) -> InvalidArgument:
    """The standard error: ``name: got <given>, expected <expected>``."""
    return InvalidArgument(f"{name}: got {given}, expected {expected}")


__all__ = ["BackendFailure", "Fp8KVError", "InvalidArgument", "PluginError", "Unsupported", "bad_argument"]
