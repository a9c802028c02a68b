"""The figures of the steps between two log steps, summed on the device and read on the host once per window.

    window = LogWindow(backend.device, step)
    window.add(figures)                   # each step's StepFigures: device scalars summed in one tensor, no read
    taken = window.take()                 # at a log step: what the step closure reads (one transfer)
    loss, grad_norm, sums, host = taken.read(step, clipped=config.grad_clip is not None)   # in a step closure
    window.reset(step)                    # after the step's sync: the next window starts here

The running sum is one device tensor, (loss, grad norm, the variant's figures in the order its step gives them),
so a log step reads everything a step reported in one transfer and the step's graph is the same at every step.
Host figures (a variant's rewards, already on the host) are kept per step and averaged over the steps that have
them; those not yet logged are part of the run's progress (a checkpoint keeps them, `Trainer.progress_state`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.training.step import StepFigures


@dataclass
class TakenWindow:
    """A closed window, as the log step's closure reads it."""

    sums: torch.Tensor
    names: tuple[str, ...]
    host: list[dict]
    first_step: int
    started: float

    def steps(self, step: int) -> int:
        """The steps in the window closed at `step`."""
        return max(1, step - self.first_step)

    def read(self, step: int, *, clipped: bool) -> tuple[float, float | None, dict[str, float], dict[str, float]]:
        """(mean loss, mean gradient norm or None, the variant's device sums, its host figures' means); one read."""
        steps = self.steps(step)
        loss_sum, norm_sum, *rest = self.sums.tolist()
        host = {key: _mean([rec[key] for rec in self.host if key in rec])
                for key in sorted({k for rec in self.host for k in rec})}
        return loss_sum / steps, norm_sum / steps if clipped else None, dict(zip(self.names, rest, strict=True)), host


class LogWindow:
    """The running sums of the current log window (see the module docstring)."""

    def __init__(self, device: Any, step: int = 0) -> None:
        self.device = device
        self.names: tuple[str, ...] | None = None  # the variant's device figures, fixed by the first step
        self.host: list[dict] = []  # host figures of the steps not yet logged
        self.reset(step)

    def reset(self, step: int) -> None:
        """Start a window after `step` (the host figures not yet taken stay)."""
        self.first_step, self.started = step, time.perf_counter()
        self.sums = None if self.names is None else self._zeros()

    def _zeros(self) -> torch.Tensor:
        # Made on the host and copied over, so it enters the next graph as data exactly like the running sum does
        # (an on-device torch.zeros would be a different graph for the step after each log).
        return torch.zeros(2 + len(self.names or ())).to(self.device)

    def add(self, figures: StepFigures) -> None:
        names = tuple(figures.device)
        if self.names is None:
            self.names = names
        elif names != self.names:
            raise ValueError(f"a step reported the device figures {names}, another {self.names}: a step reports "
                             "the same figures every time (one running sum, one graph)")
        if self.sums is None:
            self.sums = self._zeros()
        self.sums = self.sums + _step_sums(figures)
        if figures.host:
            self.host.append(dict(figures.host))

    def take(self) -> TakenWindow:
        """The window as it stands, for a log step's closure; the host figures go with it."""
        taken = TakenWindow(self.sums, self.names or (), self.host, self.first_step, self.started)
        self.host = []
        return taken


def _step_sums(figures: StepFigures) -> torch.Tensor:
    loss = figures.loss.float()
    if figures.grad_norm is None and not figures.device:
        # One add instead of zeros_like + stack + add in every step's graph; entry 1 is unread without a norm.
        return loss
    norm = loss if figures.grad_norm is None else figures.grad_norm.float()  # unread without a norm
    return torch.stack([loss, norm, *(value.float() for value in figures.device.values())])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
