"""What one optimizer step hands the loop (`StepFigures`), and the replay the steps run under (`StepReplay`).

    figures = trainer.train_step(batches)          # StepFigures(loss, grad_norm, device={...}, host={...})
    loss, grad_norm = figures                      # it unpacks as the pair, as the memory probe takes it
    logp = trainer.replayed(completion_logps, model, ids, ...)   # captured once per shape, replayed (XLA)
    grad_norm = trainer.apply_gradients()          # clip, optimizer and schedule step, zero_grad

A step returns device tensors only (no host read); the loop sums them over a log window and reads them once, at
the log step (`training.log_window`). `StepReplay` is config.replay_steps: each function a step routes through
`replayed` is captured by `backend.compile_step` and replayed instead of traced every call, and AdamW's update is
captured too (`training.replayed_optimizer`); whatever cannot be captured runs as it is, after one warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tpu_helpers.backend.base import ReplayUnsupported
from tpu_helpers.training import replayed_optimizer


@dataclass
class StepFigures:
    """One optimizer step's figures: the loss and gradient norm (device tensors; the norm None without clipping),
    a variant's device scalars (summed over the log window on the device, see `Trainer.log_figures`) and its host
    floats (already on the host: averaged over the window's steps that have them)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | None = None
    device: dict[str, torch.Tensor] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    def __iter__(self) -> Iterator:
        return iter((self.loss, self.grad_norm))

    @classmethod
    def of(cls, result: Any) -> StepFigures:
        """A step's return value as StepFigures: a (loss, grad_norm) pair is taken as it is."""
        return result if isinstance(result, StepFigures) else cls(*result)


def replays_steps(cls: type) -> bool:
    """Whether `cls`'s step goes through `Trainer.replayed`: the nearest class declaring `replays_steps` says so,
    and `cls` keeps that class's compute_loss and train_step (where its replay lives)."""
    owner = next(k for k in cls.__mro__ if "replays_steps" in vars(k))
    return bool(owner.replays_steps) and all(getattr(cls, m) is getattr(owner, m) for m in ("compute_loss", "train_step"))


class StepReplay:
    """config.replay_steps for one trainer: which functions are replayed, and the optimizer step with or without."""

    def __init__(self, config: Any, backend: Any, trainer_class: type) -> None:
        self.config, self.backend = config, backend
        self.enabled = bool(config.replay_steps) and backend.compiles_graphs
        self.lazy_fns: set = set()  # functions that could not be captured whole: run as they are
        if self.enabled and not replays_steps(trainer_class):
            self.enabled = False
            warnings.warn(f"replay_steps: {trainer_class.__name__} does not replay its steps (its loss is computed "
                          "by code the replay does not cover); they are traced lazily, with the same results",
                          stacklevel=3)

    def __call__(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)`, captured once per shape and replayed where enabled; lazily after a failed capture."""
        if self.enabled and fn not in self.lazy_fns:
            try:
                return self.backend.compile_step(fn)(*args)
            except ReplayUnsupported as err:
                self.lazy_fns.add(fn)
                warnings.warn(f"{err}; the steps are traced lazily instead (replay_steps=False)", stacklevel=3)
        return fn(*args)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Clip and step the optimizer (AdamW's update replayed where it can be); the gradient norm or None."""
        replayed, grad_norm = self._replayed_optimizer_step(optimizer)
        if not replayed:
            grad_norm = self.backend.optimizer_step(optimizer, clip_norm=self.config.grad_clip)
        return grad_norm

    def _replayed_optimizer_step(self, optimizer: torch.optim.Optimizer) -> tuple[bool, torch.Tensor | None]:
        """(True, the gradient norm or None) after a replayed AdamW step; (False, None) where it does not apply
        (another optimizer, several processes, a scaler), or once its capture failed (said in one warning; nothing
        was updated: a failed capture raises before it runs)."""
        if not (self.enabled and replayed_optimizer.adamw_update not in self.lazy_fns
                and replayed_optimizer.can_replay(optimizer, self.backend)):
            return False, None
        try:
            return True, replayed_optimizer.replayed_step(optimizer, self.backend, clip_norm=self.config.grad_clip)
        except ReplayUnsupported as err:
            self.lazy_fns.add(replayed_optimizer.adamw_update)
            warnings.warn(f"{err}; the optimizer steps are traced lazily instead", stacklevel=3)
            return False, None
