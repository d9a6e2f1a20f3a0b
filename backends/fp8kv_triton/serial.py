"""One interpreted kernel at a time: the lock around launches under Triton's CPU interpreter.

Triton's interpreter (``TRITON_INTERPRET=1``) is not thread-safe: for the length of a launch it
patches ``triton.language`` process-wide and restores it afterwards, so two threads interpreting
kernels at once break each other's launches (one fails with "Did you forget to add @triton.jit ?").
Every launch of this backend's kernels, and of the Hopper backend's, goes through
:func:`launching`: an interpreted kernel (an ``InterpretedFunction``, what ``@triton.jit`` makes
while the interpreter is on) is launched holding :data:`INTERPRETER_LOCK`; a compiled kernel (a
GPU) takes no lock.
"""

from __future__ import annotations

import contextlib
import threading

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # (a Triton without the interpreter: no kernel is ever interpreted)
    InterpretedFunction = ()

INTERPRETER_LOCK = threading.Lock()
"""Held for each interpreted launch (the launch's copies of its tensors in and back included)."""

_NO_LOCK = contextlib.nullcontext()


def interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs through Triton's CPU interpreter."""
    return isinstance(kernel, InterpretedFunction)


def launching(kernel) -> contextlib.AbstractContextManager:
    """The context to launch ``kernel`` in: :data:`INTERPRETER_LOCK` if it is interpreted, else none.

    Usage: ``with launching(kernel): kernel[grid](...)``."""
    return INTERPRETER_LOCK if interpreted(kernel) else _NO_LOCK


__all__ = ["INTERPRETER_LOCK", "interpreted", "launching"]
