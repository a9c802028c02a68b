"""When a run logs, evaluates and saves: the one place that decides, asked by the trainer, the detector and tools.

    cadence = trainer.cadence                  # or Cadence.from_config(config): built once per run
    cadence.is_log_step(step)                  # the loss is read on the host at these steps only
    cadence.is_eval_step(step); cadence.is_save_step(step)
    cadence.is_read_step(step)                 # a step that reads the device by design (GRPO's rewards), if any

`step` counts optimizer steps done (1 after the first). Each event happens every N steps and at the last step, so
a run always ends with a logged loss, a validation loss and a checkpoint. A trainer whose step reads the device on
the host by design (GRPO reads the sampled tokens for its rewards in the first of every `read_every` steps) says so
with `read_every`, which the XLA detector takes as a declared read rather than a stray one. (The learning-rate
schedule is another thing: `training.optimizers.warmup_cosine`.)
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
    read_every: int | None = None  # steps 1, 1 + n, 1 + 2n, ... read the device by design; None: no step does

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "eval_every", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.read_every is not None and (isinstance(self.read_every, bool) or not isinstance(self.read_every, int)
                                            or self.read_every < 1):
            raise ValueError(f"read_every={self.read_every!r} must be an int >= 1 or None")

    @classmethod
    def from_config(cls, config: Any, *, read_every: int | None = None) -> Cadence:
        return cls(config.steps, config.log_every, config.eval_every, config.save_every, read_every)

    def is_last_step(self, step: int) -> bool:
        return step == self.steps

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def is_eval_step(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.steps

    def is_save_step(self, step: int) -> bool:
        return step % self.save_every == 0 or step == self.steps

    def is_read_step(self, step: int) -> bool:
        """Whether step `step` (counted from 1) reads the device on the host by design, besides log steps."""
        return self.read_every is not None and (step - 1) % self.read_every == 0
