"""Divergence that stays finite: a spike rule on the losses the loop already reads, without a host read of its own.

    rule = SpikeRule(factor=config.divergence_factor)
    rule.check_train(history, step)     # after the log closure recorded the mean training loss of a log interval
    rule.check_val(history, step)       # after an evaluation recorded the validation loss

Each returns None, or a sentence naming the step, the value and what it was compared with. The trainer calls
`check_loss(history, step, loss, spike_rule=...)` after each loss it reads and passes what it finds (nan/inf
first, then a spike) to its `outcome.RunOutcome`, which applies `TrainConfig.on_divergence` ("stop", "warn",
"off"). A spike is a loss above `divergence_factor` (default 3) x a reference that exists only after warm-up:
the lowest validation loss so far, or the median of the recent log intervals, for `PERSIST` intervals in a row.
The rule in full, and the default factor's measured margin: docs/guides/preemption.md.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from statistics import median
from typing import Any, NamedTuple

from tpu_helpers.training.guard import finite

RECENT = 10  # training intervals the median is taken over
MIN_RECORDS = 3  # training intervals logged before the rule compares
PERSIST = 2  # consecutive training intervals that must all be above the limit
FLOOR = 0.1  # the reference is at least this x the first value of its series


@dataclass
class Reading:
    """A loss read at `step` and what the rule compares it with."""

    what: str  # "training" | "validation"
    step: int
    loss: float
    reference: float  # k x this is the limit
    basis: str  # what the reference is, in words
    values: list[float] | None = None  # the training intervals' losses, when several were read

    @property
    def ratio(self) -> float:
        return self.loss / self.reference


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class SpikeRule:
    """Finds a finite loss spike in a run's history (see the module docstring)."""

    def __init__(self, factor: float = 3.0) -> None:
        if not factor > 1.0:
            raise ValueError(f"factor={factor!r} must be > 1")
        self.factor = factor

    def train_reading(self, history, step: int) -> Reading | None:
        """The training intervals logged up to `step` against the median of the RECENT intervals before the last
        PERSIST of them; the reading is the lowest of those PERSIST (a one-interval spike that recovers at the next
        log is no divergence). None before warm-up. Reads only the last records (and the first): cheap at every
        log step of a long run."""
        if len(history.train) < MIN_RECORDS + PERSIST or history.train[-1]["step"] != step:
            return None
        tail = [r["loss"] for r in history.train[-PERSIST - RECENT:]]
        earlier, latest = [x for x in tail[:-PERSIST] if _finite(x)], tail[-PERSIST:]
        if len(earlier) < MIN_RECORDS or not all(_finite(x) for x in latest):
            return None
        first_step = history.train[-PERSIST]["step"]
        reference, basis = _floored(median(earlier), f"the median of the {len(earlier)} log intervals before step "
                                    f"{first_step}", history.train[0]["loss"])
        return Reading("training", step, min(latest), reference, basis, values=latest) if reference > 0 else None

    def val_reading(self, history, step: int) -> Reading | None:
        """The evaluation at `step` against the lowest one before it; None without an earlier one."""
        evals = [e for e in history.eval if _finite(e["val_loss"])]
        if len(evals) < 2 or evals[-1]["step"] != step:
            return None
        best = min(evals[:-1], key=lambda e: e["val_loss"])
        reference, basis = _floored(best["val_loss"], f"its lowest so far, at step {best['step']}",
                                    evals[0]["val_loss"])
        return Reading("validation", step, evals[-1]["val_loss"], reference, basis) if reference > 0 else None

    def spike(self, reading: Reading | None) -> str | None:
        """What went wrong when `reading` is above factor x its reference, else None."""
        if reading is None or reading.loss <= self.factor * reading.reference:
            return None
        if reading.values:
            rose = (f"stayed at {', '.join(f'{v:.4g}' for v in reading.values)} in the last {len(reading.values)} "
                    f"log intervals up to step {reading.step}, at least")
        else:
            rose = f"rose to {reading.loss:.4g} at step {reading.step},"
        return (f"the {reading.what} loss {rose} {reading.ratio:.1f} x {reading.basis} ({reading.reference:.4g}; "
                f"the limit is divergence_factor={self.factor:g} x that)")

    def check_train(self, history, step: int) -> str | None:
        return self.spike(self.train_reading(history, step))

    def check_val(self, history, step: int) -> str | None:
        return self.spike(self.val_reading(history, step))


def _floored(value: float, basis: str, first: float) -> tuple[float, str]:
    """`value`, or a tenth of the series' first value when that is higher (a loss near 0 is all noise)."""
    floor = FLOOR * first if _finite(first) and first > 0 else 0.0
    if value >= floor:
        return value, basis
    return floor, f"a tenth of the first value ({basis} is {value:.4g}, lower)"


# ---- the trainer's side: what it calls after reading a loss, and the policies ------------------------------------
class Finding(NamedTuple):
    """A divergence a check found: `what` in words, and its kind ("nonfinite" or "spike") for its policy."""

    what: str
    kind: str


def check_loss(history: Any, step: int, loss: float, *, spike_rule: SpikeRule | None,
               first_step: int | None = None, validation: bool = False) -> Finding | None:
    """After the trainer recorded a loss in `history` (the mean training loss of steps first_step+1..step at a log
    step, or the validation loss): a nan/inf, else (with a `spike_rule`) a spike; None when the loss is fine. The
    trainer passes what it finds to its `outcome.RunOutcome`, and passes no rule once a spike would change nothing."""
    problem = finite.nonfinite_loss(step, loss, first_step=first_step, validation=validation)
    if problem:  # nan/inf: under "stop", end after this step and save nothing
        return Finding(problem, "nonfinite")
    if spike_rule is None:
        return None
    spike = spike_rule.check_val(history, step) if validation else spike_rule.check_train(history, step)
    return Finding(spike, "spike") if spike else None


def policy(config: Any, kind: str) -> str:
    """The setting that decides what a divergence of `kind` does: on_nonfinite (nan/inf) or on_divergence."""
    return config.on_nonfinite if kind == "nonfinite" else config.on_divergence


def warn(what: str, kind: str) -> None:
    """The one warning of a "warn" policy."""
    if kind == "nonfinite":
        warnings.warn(f"{what}; training goes on (on_nonfinite='warn') but non-finite weights are never saved",
                      stacklevel=4)
    else:
        warnings.warn(f"{what}; training goes on (on_divergence='warn': said once) and the best checkpoint is kept",
                      finite.DivergenceWarning, stacklevel=4)
