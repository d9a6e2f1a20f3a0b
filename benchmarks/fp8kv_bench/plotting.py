"""Matplotlib for the benchmarks' plots: the file-only backend, so that plots draw on machines
without a display (GPU hosts, CI)."""

from __future__ import annotations

import os


def pyplot():
    """``matplotlib.pyplot`` on the ``Agg`` backend (ImportError when matplotlib is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_beside(json_path: str) -> str:
    """The plot's path: the results JSON's, ending in ``.png``."""
    return os.path.splitext(str(json_path))[0] + ".png"


def draw(plot, record: dict, json_path: str) -> str | None:
    """``plot(record, plt)`` (a benchmark's figure) saved beside ``json_path``; the PNG's path, or None
    (and a line saying why) when matplotlib is not installed."""
    try:
        plt = pyplot()
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    fig = plot(record, plt)
    out = png_beside(json_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}", flush=True)
    return out
