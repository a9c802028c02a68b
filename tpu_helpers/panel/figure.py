"""The tuning panel's chart, built on ``matplotlib.figure.Figure`` (never pyplot: widget callbacks may run on
another thread, and pyplot's global state is not thread-safe).

Left: the step's peak per chip against the chip's HBM and the safety-margin budget, at full scale; a tiny estimate
still gets a visible marker and its figure. Right: the same peak split into parameters, gradients, optimizer state,
activations and temporaries on its own scale, so the split is readable whatever the chip::

    fig = memory_figure(report)           # a MemoryReport
    png = figure_png(fig)                 # bytes for an ipywidgets Image or a file
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure

from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.memory.report import MemoryReport

_COLOURS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52", "activations": "#8172b2",
            "temporaries": "#ccb974"}


def memory_figure(report: MemoryReport, *, stale: str | None = None, plan: str = "") -> Figure:
    """The chart for ``report``; ``stale`` (a reason) greys it and says so, for when a control holds a bad value;
    ``plan`` (e.g. "x 8 chips, global batch 64") completes the title."""
    gib = 2**30
    est = report.estimate
    fig = Figure(figsize=(9.0, 2.9), dpi=100)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1.0]})
    hbm, budget, peak = report.hbm_bytes / gib, report.budget_bytes / gib, est.peak_bytes / gib
    start = 0.0
    for name, value in est.breakdown.items():
        left.barh(["estimate"], [value / gib], left=start, color=_COLOURS.get(name))
        start += value / gib
    left.barh(["HBM"], [hbm], color="lightgray")
    left.axvline(budget, color="red", linestyle="--")
    left.text(budget, 0.5, f"budget ({100 * report.safety_margin:.0f}% margin) ", color="red", fontsize=7,
              ha="right", va="center", transform=left.get_xaxis_transform())
    colour = "green" if report.fits else "red"
    if peak < 0.02 * hbm:  # thinner than a pixel or two at this scale: mark where it ends
        left.plot([peak], [0], marker="<", color=colour, markersize=10, clip_on=False, zorder=5)
    pct = 100 * report.utilization
    left.text(min(peak, hbm) + 0.03 * hbm, 0, f"{format_bytes(est.peak_bytes)} ({pct:.0f}%)" if pct >= 10 else
              f"{format_bytes(est.peak_bytes)} ({pct:.2g}%)",
              va="center", ha="left", fontsize=9, color=colour, fontweight="bold",
              bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    left.set_xlim(0, max(hbm, peak) * 1.05)
    left.set_xlabel(f"GiB per chip ({report.hardware.name}: {format_bytes(report.hbm_bytes)})")
    left.set_title(f"batch {est.batch_size}/chip {plan}: {'fits' if report.fits else 'does NOT fit'}", fontsize=10,
                   color=colour, loc="left")
    names = list(est.breakdown)
    values = [est.breakdown[n] for n in names]
    unit, scale = ("GiB", gib) if est.peak_bytes >= gib else ("MiB", 2**20)
    right.barh(names, [v / scale for v in values], color=[_COLOURS.get(n) for n in names])
    for i, v in enumerate(values):
        right.text(v / scale, i, f" {format_bytes(v)}", va="center", fontsize=8)
    right.set_xlim(0, max(values + [1]) / scale * 1.35)
    right.invert_yaxis()
    right.set_xlabel(f"{unit} (own scale)")
    right.set_title(f"peak {format_bytes(est.peak_bytes)}, by kind", fontsize=10)
    if stale:
        for ax in (left, right):
            ax.set_alpha(0.3)
            for artist in ax.get_children():
                artist.set_alpha(0.25)
        fig.text(0.5, 0.5, f"STALE: {stale}", ha="center", va="center", fontsize=13, color="darkred",
                 fontweight="bold", bbox={"facecolor": "white", "edgecolor": "darkred"})
    fig.tight_layout()
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """PNG bytes of ``fig`` through the Agg canvas (no pyplot, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
