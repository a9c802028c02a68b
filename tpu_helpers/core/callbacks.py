"""The hooks a training run calls: subclass `Callback` and pass instances as `Trainer(..., callbacks=[...])`.

A leaf (it imports nothing from the package at run time): the trainer calls these hooks, and what watches a run
from a lower layer (the XLA detector in `diagnostics`) implements them without importing the trainer.

    class PrintLoss(Callback):
        def on_log(self, trainer, record):
            print(record["step"], record["loss"])

An object that does not subclass Callback works too when it has at least one of the hooks (`HOOKS`): the Trainer
wraps it with `as_callback`, and the hooks it lacks do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpu_helpers.training.history import RunReport
    from tpu_helpers.training.trainer import Trainer


class Callback:
    """Hooks into `Trainer.fit`. They run on the host between steps and must not read device tensors."""

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_batch(self, trainer: Trainer, batch: Any) -> None:
        """Each training batch as the step takes it (a device batch: read shapes and dtypes only, not values)."""

    def on_step_end(self, trainer: Trainer) -> None:
        """After the step's sync; `trainer.step` is the number of finished steps."""

    def on_log(self, trainer: Trainer, record: dict) -> None:
        """After a log record was read from the device (inside the step closure)."""

    def on_eval_start(self, trainer: Trainer) -> None: ...

    def on_eval_end(self, trainer: Trainer) -> None:
        """After an evaluation. Metrics of the callback's own (host floats) put into `trainer.eval_metrics` are
        recorded with the validation loss, and `TrainConfig.best_metric` may name one."""

    def on_fit_end(self, trainer: Trainer, report: RunReport) -> None: ...


# Every hook the loop calls, read from the class itself so a new hook cannot be forgotten here.
HOOKS: tuple[str, ...] = tuple(name for name in vars(Callback) if name.startswith("on_"))


class _PartialCallback(Callback):
    """A callback object that does not subclass Callback and defines only some hooks: the others do nothing."""

    def __init__(self, target: Any) -> None:
        self.target = target
        for name in HOOKS:
            hook = getattr(target, name, None)
            if hook is not None:
                setattr(self, name, hook)

    def __repr__(self) -> str:
        return f"{type(self.target).__name__} (as a Callback)"


def as_callback(obj: Any) -> Callback:
    """`obj` itself when it is a Callback; otherwise a Callback that calls the hooks `obj` has and skips the rest."""
    return obj if isinstance(obj, Callback) else _PartialCallback(obj)
