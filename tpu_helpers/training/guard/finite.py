"""Divergence: a nan/inf loss stops the run with a clear error, and a non-finite state is never saved.

Costs no host transfer of its own. The loss check runs in the trainer's log closure on the value already read for
the history (`log_every`) and on each validation loss; the weight check runs at a save, on the CPU copy the
checkpoint is written from. What either finds goes to the run's `outcome.RunOutcome`: with
`TrainConfig(on_nonfinite="stop")` (default) the trainer ends after the step, saves nothing, and `fit` raises
`TrainingDiverged` naming the step, the loss, the newest good checkpoint and the best one; `"warn"` only warns
(once) and keeps training, but still never saves non-finite weights. There is no "skip the step" mode: deciding
before the optimizer update whether a step is finite would need a host read every step, which XLA runs must avoid.
A loss that blows up but stays finite is `divergence.py`'s (`on_divergence`), raised as the same `TrainingDiverged`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch


class TrainingDiverged(RuntimeError):
    """The loss or the weights became nan/inf, or the loss spiked (divergence.py); the good checkpoints were kept."""

    report: Any = None  # the partial run's RunReport


class DivergenceWarning(UserWarning):
    """A loss spike under on_divergence='warn' (said once per run)."""


def nonfinite_loss(step: int, loss: float, *, first_step: int | None = None, validation: bool = False) -> str | None:
    """What went wrong when a loss is nan/inf, else None: the mean training loss logged for steps
    first_step+1..step, or (`validation`) the validation loss at `step`."""
    if math.isfinite(loss):
        return None
    if validation:
        return f"the validation loss became {loss} at step {step}"
    return f"the training loss became {loss} in steps {(first_step or 0) + 1}-{step}"


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of floating-point tensors in a (CPU) state dict that hold nan or inf."""
    return [name for name, t in state.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def diverged_error(outcome: Any, report: Any, *, lr: float, latest: Any, directory: Path) -> TrainingDiverged:
    """The error `fit` raises after a stop on a divergence: what, where, which checkpoints are good, what to do.

    `outcome` is the run's `outcome.RunOutcome` (its `diverged` says what), `report` the partial run's RunReport
    (its best checkpoint), `latest` the newest good checkpoint (a CheckpointInfo: step, path) or None, `directory`
    where the checkpoints are."""
    best = report.best_checkpoint if report is not None else None
    if latest is None:
        kept = "no checkpoint was saved before it"
    else:
        kept = f"the newest good checkpoint is step {latest.step} ({latest.path})"
    if best is not None:
        kept += (f"; the best checkpoint is step {best['step']} ({best['metric']} {best['value']:.4g}, "
                 f"{best['path']})")
    back = ""
    if best is not None and latest is not None and best["step"] < latest.step:
        back = (f"; to go back to the best one instead, move the checkpoints after step {best['step']} out of "
                f"{directory} first")
    err = TrainingDiverged(
        f"training diverged: {outcome.diverged} (lr={lr:g}). Nothing was saved after it; {kept}. Lower lr, "
        "raise warmup_steps, or check grad_clip and the data; a rerun with resume=True continues from the newest "
        f"good checkpoint and applies the new lr (see the resume table on docs/guides/preemption.md){back}")
    err.report = report
    return err
