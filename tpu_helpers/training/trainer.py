"""The training loop's face: `Trainer`, whose small steps a variant overrides, and `fit`, which runs one.

    trainer = Trainer(model, train_dataset, val_dataset, config=TrainConfig(steps=200, batch_size=16))
    report = trainer.fit()
    trainer.history.plot(); print(report)

It trains any `nn.Module`: with `loss_fn=None` the model is called as `model(inputs, targets)` and returns the loss
(or `(output, loss)`, as the package's GPT does); otherwise `loss_fn(model(inputs), targets)`. Batches are
`(inputs, targets)` pairs, or Hugging Face dict batches for a model that returns `.loss` (training/batches.py).
A variant (the algorithms in `tpu_helpers.algorithms`: SFT, distillation, GRPO, DPO/ORPO) overrides `train_step`
(or `compute_loss`) and keeps the rest: `training.build` assembles the run, the step runs under `training.step`'s
replay and returns `StepFigures`, `training.loop` runs the steps (cadence, log window, checkpoints through
`run_state`, signals, divergence checks, XLA hygiene) and `training.evaluation` gives the validation loss.
Without data (`train_data=None`) a trainer still runs `train_step` on batches it is given: the batch-size probe and
the memory estimates measure exactly this step that way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from tpu_helpers.backend import Backend, backend_for
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.training import build, evaluation, loop
from tpu_helpers.training.arguments import check_trainer_args
from tpu_helpers.training.batches import batch_loss
from tpu_helpers.training.cadence import Cadence
from tpu_helpers.training.guard import finite
from tpu_helpers.training.guard.outcome import RunOutcome
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.log_window import LogWindow
from tpu_helpers.training.optimizers import make_optimizer, make_scheduler
from tpu_helpers.training.run_state import RunParts, RunState
from tpu_helpers.training.signals import resume_hint, stop_on_signals
from tpu_helpers.training.step import StepFigures, StepReplay
from tpu_helpers.training.step_timing import StepTimer

# The one loss-function form: loss_fn(model_output, targets) -> scalar loss.
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class Trainer:
    """Base training loop. Override `configure_optimizer`, `compute_loss`, `train_step` or `evaluate`."""

    # The finite spike rule suits a loss bounded below that falls (cross entropy); a variant whose loss is not
    # (a centred policy-gradient surrogate) sets this False and keeps the nan/inf checks.
    watches_loss_spikes = True
    # Whether this class's step goes through `replayed` (config.replay_steps). A subclass that overrides the method
    # holding the replay (compute_loss, train_step) without declaring it again is traced lazily, with a warning.
    replays_steps = True

    def __init__(self, model: torch.nn.Module, train_data: Dataset | DataLoader | None,
                 val_data: Dataset | DataLoader | None = None, *, config: TrainConfig | None = None,
                 backend: Backend | None = None, loss_fn: LossFn | None = None, run_identity: dict | None = None,
                 progress: bool = True, callbacks: list[Callback] | None = None,
                 save_trainable_only: bool = False) -> None:
        check_trainer_args(model=model, train_data=train_data, val_data=val_data, config=config, backend=backend,
                           loss_fn=loss_fn, callbacks=callbacks, run_identity=run_identity, progress=progress,
                           save_trainable_only=save_trainable_only)
        self.config = cfg = config or TrainConfig()
        self.backend = b = backend or backend_for(cfg)
        build.check_precision(cfg, b)
        self.loss_fn, self.progress = loss_fn, progress
        self.save_trainable_only = save_trainable_only  # under LoRA: the adapters and their optimizer state only
        self.cadence = Cadence.from_config(cfg)  # when this run logs, evaluates and saves
        self.callbacks, self.tracking = build.run_callbacks(cfg, b, callbacks)
        self.timer = StepTimer(device_clock=b.device_seconds)  # device time per step where known
        self.replay = StepReplay(cfg, b, type(self))  # config.replay_steps: what `replayed` captures
        self.outcome = RunOutcome(cfg)  # how the run ends: a stop reason, what diverged (outcome.py)
        self.spike_rule = build.spike_rule(cfg, watches_loss_spikes=self.watches_loss_spikes)
        self.eval_metrics: dict[str, float] = {}  # what eval callbacks add to an evaluation (on_eval_end)
        self.raw_model = model
        self.model = build.place_model(model, cfg, b)
        self.train_loader = self._loader(train_data, shuffle=True) if train_data is not None else None
        self.val_loader = self._loader(val_data, shuffle=False) if val_data is not None else None
        self.optimizer = self.configure_optimizer()
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.history = History()
        self.window = LogWindow(b.device)  # the figures of the steps since the last log step
        self.state = RunState(cfg, b, RunParts(model=self.model, raw_model=model, optimizer=self.optimizer,
                                               progress_state=self.progress_state,
                                               load_progress_state=self.load_progress_state),
                              outcome=self.outcome, run_identity=run_identity, save_trainable_only=save_trainable_only)
        # The data position in samples of the global order (not loader batches), so a checkpoint resumes at the
        # same sample on any number of chips or processes with the same global batch.
        self.step, self.epoch, self.samples_in_epoch = 0, 0, 0

    # ---- construction (override to customise) --------------------------------------------------------------------
    @property
    def sampling_model(self) -> torch.nn.Module:
        """The placed model for passes without gradients (generation): a DistributedDataParallel wrapper's module,
        since DDP's forward only adds the gradients' all-reduce and passes no attribute (`config`) through."""
        model = self.model
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    @property
    def loader_batch_size(self) -> int:
        """Rows per loader batch: this host's chips' share under SPMD (all of it on one host), else per chip."""
        b = self.backend
        return self.config.batch_size * max(1, b.num_replicas // b.world_size)  # chips this process feeds

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.backend.num_replicas * self.config.grad_accum * self.config.seq_len

    @property
    def samples_per_batch(self) -> int:
        """Samples of the global data order one loader batch consumes, over all processes."""
        return (self.train_loader.batch_size or 1) * self.backend.loader_rank_and_world[1]

    def _loader(self, data: Dataset | DataLoader, *, shuffle: bool) -> DataLoader:
        return build.make_run_loader(data, self.backend, self.loader_batch_size, shuffle=shuffle,
                                     seed=self.config.seed)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        return make_optimizer(cfg.optimizer, self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    # ---- the step ------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: Any) -> torch.Tensor:
        # (inputs, targets) pairs or Hugging Face dict batches; anything else is an error listing both forms.
        return self.replayed(batch_loss, self.model, batch, self.loss_fn)

    def replayed(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)`, under config.replay_steps on XLA captured once per shape by `backend.compile_step` and
        replayed (its backward through the captured backward) instead of traced every call. A function that cannot
        be captured whole runs as it is from then on, after one warning naming it. `fn` is a plain function (not a
        bound method: the capture cache would keep the trainer alive); pass `self` among the args."""
        return self.replay(fn, *args)

    def train_step(self, batches: Iterator) -> StepFigures:
        """One optimizer step over `grad_accum` micro-batches: the summed loss and the gradient norm (device
        tensors; it unpacks as that pair)."""
        b, accum = self.backend, self.config.grad_accum
        total = None
        for _ in range(accum):
            with b.autocast():
                loss = self.compute_loss(next(batches))
                if accum > 1:  # a division by 1 would only add an op to the graph's forward and backward
                    loss = loss / accum
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        return StepFigures(total, self.apply_gradients())

    def apply_gradients(self) -> torch.Tensor | None:
        """After the backward passes of a step: clip, step the optimizer and the schedule, zero the gradients.
        Returns the gradient norm (a device tensor) when clipping, else None."""
        grad_norm = self.replay.optimizer_step(self.optimizer)
        self.scheduler.step()
        self.backend.zero_grad(self.optimizer)
        return grad_norm

    def evaluate(self) -> float | None:
        """Mean validation loss over `eval_batches` fixed batches (one host read at the end)."""
        return evaluation.mean_val_loss(self)

    def log_figures(self, sums: dict[str, float], steps: int) -> dict[str, float]:
        """The logged values of a log window's summed device figures (`StepFigures.device`, read in the log step's
        closure): their means per step. A variant whose figures are totals over other units overrides this."""
        return {name: value / steps for name, value in sums.items()}

    # ---- progress: what a checkpoint restores besides the weights (run_state.py writes the files) ----------------
    def progress_state(self) -> dict:
        """Step, data position, RNG streams, history and the host figures not yet logged (the schedule follows
        from the config and the step)."""
        return {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch,
                "rng": self.backend.rng_state(), "history": self.history.to_dict(),
                "host_figures": list(self.window.host)}

    def load_progress_state(self, state: dict) -> None:
        """Continue from `progress_state()`: the same step, data position and RNG streams; the learning-rate
        schedule of this run's config positioned at that step."""
        self.step, self.epoch = state["step"], state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]
        self.history = History.from_dict(state["history"])
        self.history.truncate(self.step)
        self.window.host = list(state.get("host_figures", []))
        self.scheduler = make_scheduler(self.optimizer, self.config, step=self.step)
        self.backend.set_rng_state(state["rng"])

    # ---- how the run ends: kept by `self.outcome` (outcome.py); these names are the trainer's public face ---------
    @property
    def stop_reason(self) -> str | None:
        """Why the run stops early, or None. A callback sets it to end the run after the current step."""
        return self.outcome.stop_reason

    @stop_reason.setter
    def stop_reason(self, reason: str | None) -> None:
        self.outcome.stop(reason)

    @property
    def diverged(self) -> str | None:
        """The divergence this run stopped on (finite.py, divergence.py), in words, or None."""
        return self.outcome.diverged

    def on_divergence(self, what: str, *, kind: str = "nonfinite") -> None:
        """A divergence: `kind` "nonfinite" (a nan/inf loss or weights) or "spike" (a finite loss far above its
        reference); its policy decides what it does (`RunOutcome.diverge`)."""
        self.outcome.diverge(what, kind=kind)

    # ---- the run -------------------------------------------------------------------------------------------------
    def fit(self) -> RunReport:
        """Train to `config.steps`, resuming from out_dir's checkpoints; SIGTERM/Ctrl-C stop cleanly (signals.py)."""
        if self.train_loader is None:
            raise ConfigError("this Trainer was made without train_data (for its step alone): pass a Dataset or "
                              "DataLoader as train_data to fit it")
        cfg = self.config

        def hint() -> str:  # said after a signal stopped the run: where it stopped, how to continue it
            return resume_hint(self.stop_reason, step=self.step, steps=cfg.steps, out_dir=cfg.out_dir,
                               last_path=self.state.last_path)

        with stop_on_signals(self.outcome, lambda: self.step, hint):
            try:
                report = loop.run(self)
            finally:
                self.state.release_lock()  # one run per out_dir: held from resume_or_start to here
        if self.outcome.diverged is not None:
            raise finite.diverged_error(self.outcome, report, lr=cfg.lr, latest=self.state.manager.latest(),
                                        directory=self.state.directory)
        return report


def fit(model: torch.nn.Module, train_data: Dataset, val_data: Dataset | None = None, *,
        config: TrainConfig | None = None, **kwargs: Any) -> tuple[Trainer, RunReport]:
    """Train `model` with the package's loop; returns the trainer (history, model) and the run report."""
    trainer = Trainer(model, train_data, val_data, config=config, **kwargs)
    return trainer, trainer.fit()
