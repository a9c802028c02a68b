"""The one writer of a run's results: `<out_dir>/results.json` and its figure, each written atomically.

    write_results("runs/demo", {"report": ..., "config": ...}, figure=history.plot())   # -> runs/demo/results.json

Under `python -m tpu_helpers run` (which sets `TPU_HELPERS_RUN_DIR`), the same files also go into that run's
directory, where the runner reads them back. Each figure is rendered once and closed, so a long notebook session
neither accumulates open figures nor shows them again. The figures are written before the JSON: a results.json
that exists always has its figures beside it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from tpu_helpers.core.atomic_io import atomic_write_bytes, atomic_write_text

RUN_DIR_ENV = "TPU_HELPERS_RUN_DIR"  # set by `python -m tpu_helpers run`: results are copied there too


def result_dirs(out_dir: str | Path) -> list[Path]:
    """`out_dir`, and the runner's run directory when there is one."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    dirs = [Path(out_dir)] + ([Path(run_dir)] if run_dir else [])
    return list(dict.fromkeys(d.resolve() for d in dirs))


def render_png(figure: Any, *, dpi: int = 110) -> bytes:
    """A matplotlib figure as PNG bytes; the figure is closed afterwards."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        figure.savefig(buf, dpi=dpi, format="png")
    finally:
        plt.close(figure)
    return buf.getvalue()


def panels_figure(curves: dict[str, list], panels: tuple[tuple[str, str], ...], *, width: float,
                  pyplot: bool = False) -> Any:
    """One panel per (key, title) of `panels`, each `curves[key]` against `curves["step"]` (a recipe's curves, or
    results.json's "curves"). `pyplot=True`: a pyplot figure (a notebook shows it); otherwise a standalone Figure
    pyplot does not track (for files: nothing to close)."""
    if pyplot:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(width, 3.2))
    else:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(width, 3.2))
    for ax, (key, title) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        ax.plot(curves["step"], curves[key], ".-")
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_results(out_dir: str | Path, results: dict, *, name: str = "results", figure: Any = None,
                  figure_name: str = "loss.png", figures: dict[str, Any] | None = None, is_main: bool = True) -> Path:
    """Write `<name>.json` (and `figure_name` when a figure is given, and each of `figures`, {file name: figure})
    into `out_dir` and the runner's run directory; returns the JSON path in `out_dir`. Values JSON cannot hold are
    written as their `str`. `is_main=False` (every host of a pod but host 0, every torchrun rank but 0) writes
    nothing."""
    named = {**({figure_name: figure} if figure is not None else {}), **(figures or {})}
    if not is_main:
        if named:
            import matplotlib.pyplot as plt

            for fig in named.values():
                plt.close(fig)
        return Path(out_dir) / f"{name}.json"
    text = json.dumps(results, indent=2, default=str)
    pngs = {file: render_png(fig) for file, fig in named.items()}
    for directory in result_dirs(out_dir):
        directory.mkdir(parents=True, exist_ok=True)
        for file, png in pngs.items():
            atomic_write_bytes(directory / file, png)
        atomic_write_text(directory / f"{name}.json", text)
    return Path(out_dir) / f"{name}.json"
