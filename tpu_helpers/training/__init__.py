"""Training: the loop and everything a run needs around it.

    from tpu_helpers.training import Trainer, fit, Callback
    report = fit(model, train_dataset, val_dataset, config=TrainConfig(steps=200))

Modules: `callbacks` (the hook interface, a leaf), `trainer` (the loop with overridable steps), `run_state` (save
and resume), `run_lock` (one run per out_dir), `resume_policy` (what a changed setting does on resume), `finite`
(nan/inf: stop, never save), `signals` (clean stop on SIGTERM/SIGINT), `validation` (checks of Trainer arguments), `step_timing`
(where a step's time goes, MFU), `history` (loss history and the run report), `recipes` (train the package's GPT).
"""

from tpu_helpers.training.callbacks import Callback
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.trainer import Trainer, fit, warmup_cosine

__all__ = ["Callback", "History", "RunReport", "Trainer", "fit", "warmup_cosine"]
