"""Training: the loop and everything a run needs around it, whatever it trains.

    from tpu_helpers.training import Trainer, fit, Callback
    report = fit(model, train_dataset, val_dataset, config=TrainConfig(steps=200))

`trainer` (the Trainer with overridable steps) over `build` (building and placing the run), `step` (what a step
returns, the replay it runs under), `loop` (the steps with their cadence, checkpoints and report), `log_window` (a
step's figures summed on the device, read at log steps) and `evaluation` (the validation loss). Around them:
`cadence`, `optimizers`, `batches`, `recompute`, `replayed_optimizer`, `run_state` and `checkpoint_contents` (save
and resume), `run_lock`, `resume_policy`, `guard` (nan/inf, finite spikes, how a run ends), `signals`, `arguments`
(the Trainer's argument checks), `step_timing`, `history`, `results` and `tracking` (TensorBoard, W&B, trackio).
The helpers take what they need, never the trainer, except `loop` and `evaluation`, which run its steps and
callbacks. Names load their module on first use, so a light module (`cadence`, `history`) does not import the
trainer.
"""

from __future__ import annotations

from tpu_helpers.core.lazy import lazy_exports

_EXPORTS = {
    "Callback": "tpu_helpers.core.callbacks",
    "Cadence": "tpu_helpers.training.cadence",
    "History": "tpu_helpers.training.history", "RunReport": "tpu_helpers.training.history",
    "Trainer": "tpu_helpers.training.trainer", "fit": "tpu_helpers.training.trainer",
    "make_optimizer": "tpu_helpers.training.optimizers", "warmup_cosine": "tpu_helpers.training.optimizers",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
