"""The one exception type fp8kv raises for bad input or an impossible request."""

from __future__ import annotations


class Fp8KVError(ValueError):
    """Bad input, an unknown name, or a request no backend can serve.

    Messages name the argument, what was given and what was expected.
    """


def bad_argument(name: str, given: object, expected: str) -> Fp8KVError:
    """Build the standard error: ``name: got <given>, expected <expected>``."""
    return Fp8KVError(f"{name}: got {given}, expected {expected}")
