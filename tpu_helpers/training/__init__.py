"""Training: the loop and everything a run needs around it.

    from tpu_helpers.training import Trainer, fit, Callback
    report = fit(model, train_dataset, val_dataset, config=TrainConfig(steps=200))

Modules: `callbacks` (the hook interface, a leaf), `schedule` (when to log, evaluate and save), `trainer` (the loop
with overridable steps), `run_state` (save and resume), `run_lock` (one run per out_dir), `resume_policy` (what a
changed setting does on resume), `finite` (nan/inf: stop, never save), `signals` (clean stop on SIGTERM/SIGINT),
`validation` (checks of Trainer arguments), `step_timing` (where a step's time goes, MFU), `history` (loss history
and the run report), `results` (results.json and the figure of a run), `recipes` (train the package's GPT).

Names load their module on first use, so importing a light module (`schedule`, `results`, `history`) does not
import the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Callback": "tpu_helpers.training.callbacks",
    "History": "tpu_helpers.training.history", "RunReport": "tpu_helpers.training.history",
    "Schedule": "tpu_helpers.training.schedule",
    "Trainer": "tpu_helpers.training.trainer", "fit": "tpu_helpers.training.trainer",
    "warmup_cosine": "tpu_helpers.training.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpu_helpers.training' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
