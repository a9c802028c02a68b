"""Memory estimates and the report that sets them against a chip's HBM.

A :class:`MemoryEstimate` is what each estimator returns: the peak bytes of one training step per chip, split into
parameters, gradients, optimizer state, activations and temporaries. :func:`memory_report` puts one against the
chosen hardware's memory (``tpu_helpers.core.hardware`` catalog) with a safety margin and finds the largest per-chip batch
that fits::

    from tpu_helpers.memory import memory_report, analytic_estimate
    rep = memory_report(lambda b: analytic_estimate("small", b, 1024, precision="bf16"), batch_size=8,
                        hardware="v5e")
    print(rep.summary()); rep.plot()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tpu_helpers.core.hardware import HardwareSpec, format_bytes, lookup

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
MAX_BATCH = 1 << 20


@dataclass
class MemoryEstimate:
    """Peak bytes per chip of one training step at ``batch_size`` (per chip), and where they go.

    ``phases``: when the estimate weighed several moments of the step for its peak (the start of the backward,
    every activation alive; its end, every gradient), each one's breakdown, so that a transformation such as
    FSDP's sharding can weigh them again (the breakdown is the largest one's)."""

    method: str
    batch_size: int
    breakdown: dict[str, int]
    peak_bytes: int
    notes: list[str] = field(default_factory=list)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def from_categories(cls, method: str, batch_size: int, *, total: int | None = None, notes=(),
                        **parts: int) -> MemoryEstimate:
        unknown = set(parts) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown memory categories {sorted(unknown)}; allowed: {CATEGORIES}")
        peak = int(total) if total is not None else int(sum(parts.values()))
        return cls(method, batch_size, {k: int(parts.get(k, 0)) for k in CATEGORIES}, peak, list(notes))

    @classmethod
    def from_phases(cls, method: str, batch_size: int, phases: dict[str, dict[str, int]], *,
                    notes=()) -> MemoryEstimate:
        """The largest of `phases` ({moment: its categories}) as the peak; every phase kept in ``phases``."""
        full = {name: cls.from_categories(method, batch_size, **parts).breakdown for name, parts in phases.items()}
        peak = max(full, key=lambda name: sum(full[name].values()))
        return cls(method, batch_size, full[peak], sum(full[peak].values()), [*notes, f"peak: {peak}"], full)

    def to_dict(self) -> dict:
        return asdict(self)


Estimator = Callable[[int], MemoryEstimate]


def resolve_hardware(hardware: str | HardwareSpec) -> HardwareSpec:
    spec = lookup(hardware) if isinstance(hardware, str) else hardware
    if not isinstance(spec, HardwareSpec):
        raise TypeError(f"hardware must be a catalog name or a HardwareSpec, got {type(hardware).__name__}")
    if spec.hbm_bytes <= 0:
        raise ValueError(f"hardware {spec.name!r} has no known memory size; pass a HardwareSpec with hbm_bytes")
    return spec


def largest_fitting_batch(estimate: Estimator, budget_bytes: float, *, upper: int = MAX_BATCH) -> int:
    """Largest batch size whose estimate is at most ``budget_bytes`` (0 if even batch 1 does not fit).

    Peak memory grows with the batch, so: double until it no longer fits, then bisect (about 2*log2(n) calls).
    """
    if estimate(1).peak_bytes > budget_bytes:
        return 0
    good, bad = 1, None
    while bad is None:
        nxt = good * 2
        if nxt > upper:
            return good if estimate(upper).peak_bytes > budget_bytes else upper
        if estimate(nxt).peak_bytes <= budget_bytes:
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if estimate(mid).peak_bytes <= budget_bytes:
            good = mid
        else:
            bad = mid
    return good


@dataclass
class MemoryReport:
    """An estimate against one chip's memory: does it fit with the margin, and the largest batch that does."""

    estimate: MemoryEstimate
    hardware: HardwareSpec
    safety_margin: float
    max_batch_size: int

    @property
    def hbm_bytes(self) -> int:
        return self.hardware.hbm_bytes

    @property
    def budget_bytes(self) -> float:
        """HBM less the safety margin (runtime reservations, fragmentation, the estimate's error)."""
        return self.hardware.hbm_bytes * (1.0 - self.safety_margin)

    @property
    def fits(self) -> bool:
        return self.estimate.peak_bytes <= self.budget_bytes

    @property
    def utilization(self) -> float:
        return self.estimate.peak_bytes / self.hardware.hbm_bytes

    def summary(self) -> str:
        e = self.estimate
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in e.breakdown.items())
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{e.method} estimate, batch {e.batch_size}/chip: peak {format_bytes(e.peak_bytes)} of "
                f"{format_bytes(self.hbm_bytes)} on {self.hardware.name} ({100 * self.utilization:.0f}%; "
                f"{verdict} with a {100 * self.safety_margin:.0f}% margin). Largest batch that fits: "
                f"{self.max_batch_size}/chip.\n  {parts}")

    def to_dict(self) -> dict:
        return {"estimate": self.estimate.to_dict(), "hardware": self.hardware.name, "hbm_bytes": self.hbm_bytes,
                "safety_margin": self.safety_margin, "budget_bytes": self.budget_bytes, "fits": self.fits,
                "max_batch_size": self.max_batch_size}

    def plot(self, ax=None):
        """Stacked bar of the breakdown next to the chip's HBM and the margin line; returns the figure."""
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(6, 3.2))
        else:
            fig = ax.figure
        gib = 2**30
        bottom = 0.0
        for name, value in self.estimate.breakdown.items():
            ax.bar(["estimate"], [value / gib], bottom=bottom, label=name)
            bottom += value / gib
        ax.bar(["HBM"], [self.hbm_bytes / gib], color="lightgray", label=f"{self.hardware.name} HBM")
        ax.axhline(self.budget_bytes / gib, color="red", linestyle="--",
                   label=f"budget ({100 * self.safety_margin:.0f}% margin)")
        ax.set_ylabel("GiB per chip")
        ax.set_title(f"{self.estimate.method} estimate, batch {self.estimate.batch_size}/chip")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return fig


def memory_report(estimator: Estimator, batch_size: int, hardware: str | HardwareSpec = "v5e", *,
                  safety_margin: float = 0.1) -> MemoryReport:
    """Estimate at ``batch_size`` against ``hardware`` (a catalog name such as "v5e", "h100", or a spec)."""
    if not 0.0 <= safety_margin < 1.0:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    spec = resolve_hardware(hardware)
    est = estimator(batch_size)
    best = largest_fitting_batch(estimator, spec.hbm_bytes * (1.0 - safety_margin))
    return MemoryReport(est, spec, safety_margin, best)
