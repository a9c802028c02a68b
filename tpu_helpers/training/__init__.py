"""Training: the loop and everything a run needs around it.

    from tpu_helpers.training import Trainer, fit, Callback
    report = fit(model, train_dataset, val_dataset, config=TrainConfig(steps=200))

Modules: `trainer` (the Trainer with overridable steps) over `build` (building and placing the run), `step` (what a
step returns, the replay it runs under), `loop` (the steps with their cadence, checkpoints and report),
`log_window` (a step's figures summed on the device, read at log steps), `evaluation` (the validation loss);
`cadence` (when to log, evaluate and save), `optimizers` (the optimizers and the learning-rate schedule), `batches`
(accepted batch forms and the causal-LM losses), `outcome` (how a run ends: its stop reason, what diverged, the divergence
policies), `run_state` (save and resume), `run_lock` (one run per out_dir), `resume_policy` (what a changed setting
does on resume), `finite` (nan/inf: stop, never save), `divergence` (a finite loss spike), `signals` (clean stop on
SIGTERM/SIGINT), `validation` (checks of Trainer arguments), `step_timing` (where a step's time goes, MFU),
`history` (loss history and the run report), `results` (results.json and the figure of a run), `tracking`
(the run's figures live in TensorBoard, W&B or trackio: `TrainConfig.trackers`) over `trackers` (one adapter each). The hooks a run
calls are `tpu_helpers.callbacks` (below the trainer, so what watches a run need not import it); the ready-made
jobs built on the trainer are `tpu_helpers.recipes`, its algorithms (SFT, distillation, GRPO, DPO/ORPO)
`tpu_helpers.algorithms`. The trainer's helpers take what they need (config, backend,
model, optimizer, history, the run's `outcome`); `loop` and `evaluation`, which run its steps and callbacks, take
the trainer itself. No module here but `trainer` imports it.

Names load their module on first use, so importing a light module (`cadence`, `results`, `history`) does not
import the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Callback": "tpu_helpers.callbacks",
    "Cadence": "tpu_helpers.training.cadence",
    "History": "tpu_helpers.training.history", "RunReport": "tpu_helpers.training.history",
    "Trainer": "tpu_helpers.training.trainer", "fit": "tpu_helpers.training.trainer",
    "make_optimizer": "tpu_helpers.training.optimizers", "warmup_cosine": "tpu_helpers.training.optimizers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpu_helpers.training' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
