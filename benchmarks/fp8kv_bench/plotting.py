"""Matplotlib for the benchmarks' plots: the file-only backend, so that plots draw on machines
without a display (GPU hosts, CI)."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the ``Agg`` backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
