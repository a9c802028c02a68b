"""What every recipe shares: one typed config, the backend, a trainer built once on first use, training, results.

    job = Pretrain(config)                # or Finetune(FinetuneConfig(...)): the same shape
    print(job.backend.status()); print(job.plan().summary())
    report = job.train()                  # the package Trainer (XLA hygiene, resume, signals)
    job.history.plot(); job.save_results(platform="colab")

A recipe has no call-order traps: its parts (data, model, trainer) are built on first use and kept, so any method
may come first, and everything the trainer takes (progress bar, callbacks) is given to the constructor. A variant
is a small subclass: `make_trainer` (and the parts it needs) plus what its notebook shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpu_helpers.backend import Backend, backend_for
from tpu_helpers.config import TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.results import write_results
from tpu_helpers.training.tracking import tracker_names
from tpu_helpers.training.tracking.clients import check_ready
from tpu_helpers.training.trainer import Trainer


class Recipe:
    """The shared half of a recipe; subclasses supply `make_trainer` and their own parts."""

    config_class: type[TrainConfig] = TrainConfig

    def __init__(self, config: TrainConfig, *, backend: Backend | None = None, progress: bool = True,
                 callbacks: list[Callback] | None = None) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
                            + ("; build one from a notebook's parameters with "
                               f"config_from_parameters(globals(), base={self.config_class.__name__}())"
                               if isinstance(config, TrainConfig) else ""))
        self.config = config
        self.backend = backend or backend_for(config)
        if self.backend.is_main:  # the trackers log from the main process only (the Trainer checks the same)
            check_ready(tracker_names(config))  # a missing package or W&B login: now, before any model loads
        self.progress = progress
        self.callbacks = list(callbacks or [])
        self.report: RunReport | None = None
        self._trainer: Trainer | None = None

    # ---- training ----------------------------------------------------------------------------------------------
    @property
    def trainer(self) -> Trainer:
        """The trainer, made on first use (by `train`, or earlier by whatever needs the placed model)."""
        if self._trainer is None:
            trainer = self.make_trainer()
            if trainer.tracking is not None:
                # The tracked run gets the memory plan as config and stays open for `save_results`' tables.
                trainer.tracking.describe(memory_plan=self._tracked_plan())
                trainer.tracking.hold_open = True
            self._trainer = trainer
        return self._trainer

    @property
    def has_trainer(self) -> bool:
        """Whether the trainer exists yet: what runs before training (samples, exports) must not build it."""
        return self._trainer is not None

    def _tracked_plan(self) -> dict | None:
        plan = getattr(self, "plan", None)
        try:
            return plan().to_dict() if plan is not None else None
        except Exception as err:  # a plan the tracker cannot get is no reason not to train
            return {"unavailable": f"{type(err).__name__}: {err}"}

    def make_trainer(self) -> Trainer:
        raise NotImplementedError(f"{type(self).__name__} must define make_trainer()")

    def trainer_options(self) -> dict[str, Any]:
        """The arguments every recipe's trainer gets: this recipe's config, backend, progress bar and callbacks."""
        return {"config": self.config, "backend": self.backend, "progress": self.progress,
                "callbacks": self.callbacks}

    def train(self) -> RunReport:
        """Fit to `config.steps`, resuming from out_dir's checkpoints; returns (and keeps) the run report."""
        self.report = self.trainer.fit()
        return self.report

    @property
    def history(self) -> History:
        return self.trainer.history

    # ---- results -----------------------------------------------------------------------------------------------
    def results(self, **extra: Any) -> dict:
        """What `save_results` writes: the report, config and history of the finished run, and `extra` values."""
        if self.report is None:
            raise RuntimeError("results() needs a finished run: call train() first")
        return {"report": self.report.to_dict(), "config": self.config.to_dict(), "history": self.history.to_dict(),
                **extra}

    def save_results(self, *, name: str = "results", **extra: Any) -> Path:
        """Write `<out_dir>/<name>.json` (`results(**extra)`) and the `figures()` (`loss.png`, and what a recipe
        adds), atomically, on the main process only (host 0 of a pod, rank 0 under torchrun); under `python -m
        tpu_helpers run`, into its run directory too. With TRACKERS, `tracked_results` goes to the trackers and the
        tracked run is finished."""
        results = self.results(**extra)
        path = write_results(self.config.out_dir, results, name=name, figures=self.figures(),
                             is_main=self.backend.is_main)
        tracking = self.trainer.tracking
        if tracking is not None:  # the main process's trackers: this recipe's tables, then the run is finished
            tracking.log_results(self.trainer.step, **self.tracked_results(results))
            tracking.close()
        return path

    def figures(self) -> dict[str, Any]:
        """The figures `save_results` writes, {file name: matplotlib Figure}: the loss and throughput curves as
        `loss.png`; a recipe adds its own (GRPO: `grpo.png`)."""
        return {"loss.png": self.history.figure()}

    def tracked_results(self, results: dict) -> dict:
        """What `save_results` gives the trackers besides the loop's figures: {"tables": {name: [row dicts]},
        "values": {name: number}} (a variant's samples, scores)."""
        return {}
