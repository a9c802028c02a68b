"""Divergence: a nan/inf training loss stops the run with a clear error, and a non-finite state is never saved.

Costs no host transfer of its own. The loss check runs in the trainer's log closure on the value already read for
the history (`log_every`); the weight check runs at a save, on the CPU copy the checkpoint is written from. What
either finds goes to `Trainer.on_divergence`: with `TrainConfig(on_nonfinite="stop")` (default) the trainer ends
after the step, saves nothing, and `fit` raises `TrainingDiverged` naming the step, the loss and the newest good
checkpoint; `"warn"` only warns (once) and keeps training, but still never saves non-finite weights. There is no
"skip the step" mode: deciding before the optimizer update whether a step is finite would need a host read every
step, which XLA runs must avoid.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class TrainingDiverged(RuntimeError):
    """The training loss or the weights became nan/inf; the last good checkpoints were kept."""

    report: Any = None  # the partial run's RunReport


def nonfinite_loss(step: int, loss: float, first_step: int) -> str | None:
    """What went wrong when the mean loss logged for steps first_step+1..step is nan/inf, else None."""
    if math.isfinite(loss):
        return None
    return f"the training loss became {loss} in steps {first_step + 1}-{step}"


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of floating-point tensors in a (CPU) state dict that hold nan or inf."""
    return [name for name, t in state.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def diverged_error(trainer: Any, report: Any) -> TrainingDiverged:
    cfg = trainer.config
    latest = trainer.state.manager.latest()
    kept = f"the newest good checkpoint is step {latest.step} ({latest.path})" if latest else "no checkpoint was saved"
    err = TrainingDiverged(
        f"training diverged: {trainer.diverged} (lr={cfg.lr:g}). Nothing non-finite was saved; {kept}. Lower lr, "
        "raise warmup_steps, or check grad_clip and the data; a rerun with resume=True continues from that "
        "checkpoint and applies the new lr (see the README's resume table)")
    err.report = report
    return err
