"""When a run logs, evaluates and saves: the one place that decides, asked by the trainer, the detector and tools.

    cadence = trainer.cadence                  # or Cadence.from_config(config): built once per run
    cadence.is_log_step(step)                  # the loss is read on the host at these steps only
    cadence.is_eval_step(step); cadence.is_save_step(step)

`step` counts optimizer steps done (1 after the first). Each event happens every N steps and at the last step, so
a run always ends with a logged loss, a validation loss and a checkpoint. (The learning-rate schedule is another
thing: `training.trainer.warmup_cosine`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cadence:
    steps: int  # the run's last step
    log_every: int
    eval_every: int
    save_every: int

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_every", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")

    @classmethod
    def from_config(cls, config: Any) -> Cadence:
        return cls(config.steps, config.log_every, config.eval_every, config.save_every)

    def is_last_step(self, step: int) -> bool:
        return step == self.steps

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def is_eval_step(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.steps

    def is_save_step(self, step: int) -> bool:
        return step % self.save_every == 0 or step == self.steps
