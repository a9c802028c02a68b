"""The training loop: one class whose small steps a variant can override, and `fit` that runs it.

    trainer = Trainer(model, train_dataset, val_dataset, config=TrainConfig(steps=200, batch_size=16))
    report = trainer.fit()
    trainer.history.plot(); print(report)

It trains any `nn.Module`: with `loss_fn=None` the model is called as `model(inputs, targets)` and returns the loss
(or `(output, loss)`, as the package's GPT does); otherwise `loss_fn(model(inputs), targets)`. Batches are
`(inputs, targets)` pairs, or Hugging Face dict batches for a model that returns `.loss` (training/batches.py;
`training.causal_lm.CausalLMTrainer` averages over the target tokens of a whole step). Without data
(`train_data=None`) a trainer still runs `train_step` on batches it is given: the batch-size probe and the memory
estimates measure exactly this step, optimizer and zero_grad policy that way.

Around the loop, each concern is a helper given what it needs rather than the trainer: `self.state` (run_state.py:
checkpoints, resume, run lock), `self.outcome` (outcome.py: how the run ends; `trainer.stop_reason`, which a
callback may set to stop after the current step, and `trainer.diverged` read it), `self.timer` (step_timing.py),
the loss checks (divergence.py, finite.py) and the signal handlers (signals.py).

XLA hygiene is built in rather than left to the user:
- exactly one `backend.sync()` per optimizer step (gradient accumulation stays inside one graph);
- fixed shapes: loaders drop the last partial batch, evaluation uses the same batch shape every time;
- no host read of a device tensor in the hot loop: losses accumulate on the device and reach the host through a
  step closure at log steps only; the progress bar advances on host-side counters;
- the learning rate never hits 0.0 or 1.0 exactly (`optimizers.warmup_cosine`);
- gradients are dropped after each step (`zero_grad(set_to_none=True)`, through the backend): measured on XLA, it
  compiles no extra graph and the step keeps no gradient buffers alive (see `XlaBackend.zero_grad_set_to_none`).
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from tpu_helpers.backend import Backend, backend_for
from tpu_helpers.backend.base import ReplayUnsupported
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.callbacks import Callback, as_callback
from tpu_helpers.data import make_loader, release_workers
from tpu_helpers.diagnostics import XlaDetector
from tpu_helpers.training import replayed_optimizer
from tpu_helpers.training.arguments import check_trainer_args
from tpu_helpers.training.batches import batch_loss
from tpu_helpers.training.cadence import Cadence
from tpu_helpers.training.guard import divergence, finite
from tpu_helpers.training.guard.outcome import RunOutcome
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.optimizers import make_optimizer, make_scheduler
from tpu_helpers.training.recompute import set_gradient_checkpointing
from tpu_helpers.training.run_state import RunParts, RunState
from tpu_helpers.training.signals import resume_hint, stop_on_signals
from tpu_helpers.training.step_timing import StepTimer, mfu_inputs
from tpu_helpers.training.tracking import Tracking

# The one loss-function form: loss_fn(model_output, targets) -> scalar loss.
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class Trainer:
    """Base training loop. Override `configure_optimizer`, `compute_loss`, `train_step` or `evaluate`."""

    # The finite spike rule suits a loss bounded below that falls (cross entropy); a variant whose loss is not
    # (a centred policy-gradient surrogate) sets this False and keeps the nan/inf checks.
    watches_loss_spikes = True

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: Dataset | DataLoader | None,
        val_data: Dataset | DataLoader | None = None,
        *,
        config: TrainConfig | None = None,
        backend: Backend | None = None,
        loss_fn: LossFn | None = None,
        run_identity: dict | None = None,
        progress: bool = True,
        callbacks: list[Callback] | None = None,
        save_trainable_only: bool = False,
    ) -> None:
        check_trainer_args(model=model, train_data=train_data, val_data=val_data, config=config, backend=backend,
                           loss_fn=loss_fn, callbacks=callbacks, run_identity=run_identity, progress=progress,
                           save_trainable_only=save_trainable_only)
        self.config = cfg = config or TrainConfig()
        self.backend = backend or backend_for(cfg)
        if cfg.precision not in ("auto", self.backend.precision):
            raise ConfigError(
                f"precision={cfg.precision!r} conflicts with the backend passed in, which runs "
                f"{self.backend.precision!r}; create it with get_backend(..., precision={cfg.precision!r})"
            )
        self.loss_fn = loss_fn
        self.progress = progress
        # Under LoRA a checkpoint holds the trainable weights (the adapters) and their optimizer state only.
        self.save_trainable_only = save_trainable_only
        self.cadence = Cadence.from_config(cfg)  # when this run logs, evaluates and saves; built once
        self.callbacks: list[Callback] = [as_callback(c) for c in callbacks or []]
        if self.backend.compiles_graphs and cfg.xla_checks != "off" and \
                not any(isinstance(c, XlaDetector) for c in self.callbacks):
            self.callbacks.append(XlaDetector(strict=cfg.xla_checks == "strict"))
        # Experiment trackers (config.trackers), fed by the main process only; a missing package fails here.
        self.tracking = Tracking(cfg) if cfg.trackers and self.backend.is_main else None
        if self.tracking is not None:
            self.callbacks.append(self.tracking)
        self.timer = StepTimer(device_clock=self.backend.device_seconds)  # device time per step where known
        # config.replay_steps: the loss captured once per shape and replayed (`self.replayed`); a trainer whose step
        # has no replay says so once and traces lazily.
        self._replay = bool(cfg.replay_steps) and self.backend.compiles_graphs
        self._lazy_fns: set = set()  # functions that could not be captured whole: run as they are
        if self._replay and not _replays_steps(type(self)):
            self._replay = False
            warnings.warn(f"replay_steps: {type(self).__name__} does not replay its steps (its loss is computed by "
                          "code the replay does not cover); they are traced lazily, with the same results",
                          stacklevel=2)
        # How the run ends: its stop reason (a signal, a callback, a divergence) and what diverged (outcome.py).
        self.outcome = RunOutcome(cfg)
        # A finite loss spike (training/guard/divergence.py), checked on the losses the loop reads anyway.
        self.spike_rule = (divergence.SpikeRule(cfg.divergence_factor)
                           if cfg.on_divergence != "off" and self.watches_loss_spikes else None)
        self.eval_metrics: dict[str, float] = {}  # what eval callbacks add to an evaluation (on_eval_end)
        blocks = cfg.gradient_checkpointing and self.backend.checkpoints_blocks(cfg.sharding)
        if cfg.gradient_checkpointing and not blocks:
            # The package GPT's set_gradient_checkpointing(fn), or a Hugging Face model's own hook (training/recompute.py).
            set_gradient_checkpointing(model, self.backend.checkpoint_fn())
        self.raw_model = model
        self.model = self.backend.prepare_model(model, cfg.sharding, checkpoint_blocks=blocks)
        self.train_loader = self._loader(train_data, shuffle=True) if train_data is not None else None
        self.val_loader = self._loader(val_data, shuffle=False) if val_data is not None else None
        self.optimizer = self.configure_optimizer()
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.history = History()
        self.state = RunState(cfg, self.backend,
                              RunParts(model=self.model, raw_model=model, optimizer=self.optimizer,
                                       progress_state=self.progress_state,
                                       load_progress_state=self.load_progress_state),
                              outcome=self.outcome, run_identity=run_identity, save_trainable_only=save_trainable_only)
        self.step = 0
        self.epoch = 0
        # The data position in samples of the global order (not loader batches), so a checkpoint resumes at the
        # same sample on any number of chips or processes with the same global batch.
        self.samples_in_epoch = 0

    # ---- construction steps (override to customise) ------------------------------------------------------------
    @property
    def loader_batch_size(self) -> int:
        """Rows per loader batch: this host's chips' share under SPMD (all of it on one host), else per chip."""
        b = self.backend
        return self.config.batch_size * max(1, b.num_replicas // b.world_size)  # chips this process feeds

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.backend.num_replicas * self.config.grad_accum * self.config.seq_len

    def _loader(self, data: Dataset | DataLoader, *, shuffle: bool) -> DataLoader:
        if isinstance(data, DataLoader):
            if data.batch_size and data.batch_size % max(1, self.backend.num_replicas // self.backend.world_size):
                raise ConfigError(
                    f"loader batch size {data.batch_size} is not divisible by the {self.backend.num_replicas} "
                    "devices it is sharded over"
                )
            return data
        rank, world = self.backend.loader_rank_and_world
        return make_loader(data, self.loader_batch_size, rank=rank, world_size=world, shuffle=shuffle,
                           seed=self.config.seed, **self.backend.loader_options)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        return make_optimizer(cfg.optimizer, self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    # ---- the step ------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: Any) -> torch.Tensor:
        # (inputs, targets) pairs or Hugging Face dict batches; anything else is an error listing both forms.
        return self.replayed(batch_loss, self.model, batch, self.loss_fn)

    # Whether this class's step goes through `replayed` (config.replay_steps). A subclass that overrides the method
    # holding the replay (compute_loss, train_step) without declaring it again is traced lazily, with a warning.
    replays_steps = True

    def replayed(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)`, under config.replay_steps on XLA captured once per shape by `backend.compile_step` and
        replayed (its backward through the captured backward) instead of traced every call. A function that cannot
        be captured whole runs as it is from then on, after one warning naming it. `fn` is a plain function (not a
        bound method: the capture cache would keep the trainer alive); pass `self` among the args."""
        if self._replay and fn not in self._lazy_fns:
            try:
                return self.backend.compile_step(fn)(*args)
            except ReplayUnsupported as err:
                self._lazy_fns.add(fn)
                warnings.warn(f"{err}; the steps are traced lazily instead (replay_steps=False)", stacklevel=2)
        return fn(*args)

    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over `grad_accum` micro-batches; returns device tensors (loss, grad norm)."""
        b, accum = self.backend, self.config.grad_accum
        total = None
        for _ in range(accum):
            with b.autocast():
                loss = self.compute_loss(next(batches))
                if accum > 1:  # a division by 1 would only add an op to the graph's forward and backward
                    loss = loss / accum
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        return total, self.apply_gradients()

    def apply_gradients(self) -> torch.Tensor | None:
        """After the backward passes of a step: clip, step the optimizer and the schedule, zero the gradients.
        Returns the gradient norm (a device tensor) when clipping, else None."""
        replayed, grad_norm = self._replayed_optimizer_step()
        if not replayed:
            grad_norm = self.backend.optimizer_step(self.optimizer, clip_norm=self.config.grad_clip)
        self.scheduler.step()
        self.backend.zero_grad(self.optimizer)
        return grad_norm

    def _replayed_optimizer_step(self) -> tuple[bool, torch.Tensor | None]:
        """config.replay_steps: AdamW's clip and step captured once and replayed (`replayed_optimizer`): (True, the
        gradient norm or None). (False, None) where it does not apply (another optimizer, several processes, a
        scaler), or once its capture failed (said in one warning; nothing was updated: a failed capture raises
        before it runs)."""
        if not (self._replay and replayed_optimizer.adamw_update not in self._lazy_fns
                and replayed_optimizer.can_replay(self.optimizer, self.backend)):
            return False, None
        try:
            return True, replayed_optimizer.replayed_step(self.optimizer, self.backend, clip_norm=self.config.grad_clip)
        except ReplayUnsupported as err:
            self._lazy_fns.add(replayed_optimizer.adamw_update)
            warnings.warn(f"{err}; the optimizer steps are traced lazily instead", stacklevel=2)
            return False, None

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over `eval_batches` fixed batches (one host read at the end)."""
        if self.val_loader is None:
            return None
        for cb in self.callbacks:
            cb.on_eval_start(self)
        self.model.eval()
        # The same fixed batches every time: a loop broken off after eval_batches would otherwise leave the
        # sampler mid-pass, so the next evaluation (and a resumed run's) would read other batches.
        if hasattr(getattr(self.val_loader, "sampler", None), "load_state_dict"):
            self.val_loader.sampler.load_state_dict({"epoch": 0, "index": 0})
        # The running total starts as data copied from the host, shape (1,) (XLA turns a 0-d zero into a constant,
        # i.e. a graph of its own), and the mean is taken on the host: every evaluation batch runs one same graph.
        total, n = torch.zeros(1).to(self.backend.device), 0
        # Cap the host loader rather than break out of the device loader: the feeder thread then copies exactly
        # eval_batches batches to the device, not a prefetch of batches nobody reads.
        for batch in self.backend.wrap_loader(_Take(self.val_loader, self.config.eval_batches)):
            with self.backend.autocast():
                total = total + self.compute_loss(batch).float()
            self.backend.sync()
            n += 1
        self.model.train()
        for cb in self.callbacks:
            cb.on_eval_end(self)
        if n == 0:
            raise ConfigError("the validation set is smaller than one batch; lower batch_size or val_fraction")
        return float(self.backend.all_reduce_mean(total).item()) / n

    @property
    def samples_per_batch(self) -> int:
        """Samples of the global data order one loader batch consumes, over all processes."""
        return (self.train_loader.batch_size or 1) * self.backend.loader_rank_and_world[1]

    def _batches(self) -> Iterator:
        """Endless device batches across epochs; counts what the loop consumed (prefetching runs ahead)."""
        while True:
            sampler = getattr(self.train_loader, "sampler", None)
            # Position first, then set_epoch: resumed exactly at the end of an epoch, set_epoch(current) makes the
            # sampler yield the (empty) rest of it, so the loop moves to the next epoch with its own counters in
            # step. The other order let the sampler start the next epoch by itself while self.epoch stayed behind.
            if self.samples_in_epoch and hasattr(sampler, "load_state_dict"):
                # Each process's sampler takes every world-th sample of the global order (ResumableSampler).
                world = self.backend.loader_rank_and_world[1]
                sampler.load_state_dict({"epoch": self.epoch, "index": self.samples_in_epoch // world})
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            for batch in self.backend.wrap_loader(self.train_loader):
                self.samples_in_epoch += self.samples_per_batch
                for cb in self.callbacks:
                    cb.on_batch(self, batch)
                yield batch
            self.epoch += 1
            self.samples_in_epoch = 0

    # ---- progress: what a checkpoint restores besides the weights (run_state.py writes the files) ----------------
    def progress_state(self) -> dict:
        """Step, data position, RNG streams and history (the schedule follows from the config and the step)."""
        return {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch,
                "rng": self.backend.rng_state(), "history": self.history.to_dict()}

    def load_progress_state(self, state: dict) -> None:
        """Continue from `progress_state()`: the same step, data position and RNG streams; the learning-rate
        schedule of this run's config positioned at that step."""
        self.step, self.epoch = state["step"], state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]
        self.history = History.from_dict(state["history"])
        self.history.truncate(self.step)
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

    # ---- the loop ------------------------------------------------------------------------------------------------
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
                report = self._fit()
            finally:
                self.state.release_lock()  # one run per out_dir: held from resume_or_start to here
        if self.outcome.diverged is not None:
            raise finite.diverged_error(self.outcome, report, lr=cfg.lr, latest=self.state.manager.latest(),
                                        directory=self.state.directory)
        return report

    def _fit(self) -> RunReport:
        cfg, b = self.config, self.backend
        self.state.resume_or_start()
        start_step, t_start = self.step, time.perf_counter()
        if self.step == 0 and self.val_loader is not None:
            self._evaluate_and_check()
        b.reset_metrics()
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not (self.progress and b.is_main),
                   desc="train", unit="step", dynamic_ncols=True)
        window = self._zero_window()
        window_start = (self.step, time.perf_counter())
        source = self._batches()
        batches = self.timer.wrap(source)  # step timing: data wait is the time spent in next()
        self.model.train()
        for cb in self.callbacks:
            cb.on_fit_start(self)
        try:
            while self.step < cfg.steps and self.stop_reason is None:
                self.timer.begin()
                loss, grad_norm = self.train_step(batches)
                window = self._add_to_window(window, loss, grad_norm)
                self.step += 1
                if self.cadence.is_log_step(self.step):
                    lr = self.optimizer.param_groups[0]["lr"]
                    b.add_step_closure(self._on_log, self.step, window, window_start, lr, bar)
                    self.timer.sync(b.sync)
                    window = self._zero_window()
                    window_start = (self.step, time.perf_counter())
                else:
                    self.timer.sync(b.sync)
                bar.update(1)
                if self.cadence.is_eval_step(self.step):
                    val = self._evaluate_and_check()
                    if val is not None:
                        bar.set_postfix_str(f"val {val:.3f}", refresh=False)
                for cb in self.callbacks:
                    cb.on_step_end(self)
                if self.cadence.is_save_step(self.step) or self.stop_reason is not None:
                    self.state.save()
                self.timer.end()
        finally:
            # The loader's pass is left mid-epoch: close it now (on XLA its feeder threads and the DataLoader's
            # worker processes stop with it) rather than whenever the generator is collected.
            source.close()
            for loader in (self.train_loader, self.val_loader):
                release_workers(loader)  # the persistent worker processes, which would outlive the run
        bar.close()
        report = self.state.report(start_step, time.perf_counter() - t_start, step=self.step, history=self.history,
                                   tokens_per_step=self.tokens_per_step)
        self.timer.fill_report(report, tokens_per_step=self.tokens_per_step,
                               mfu=mfu_inputs(b, self.raw_model, cfg.seq_len))
        for cb in self.callbacks:
            cb.on_fit_end(self, report)
        return report

    def log_extras(self, step: int) -> dict:
        """Values a variant adds to the log record of `step` (already on the host: read them in a step closure of
        its own, as GRPO does, never here). Called inside the log step's closure; none by default."""
        return {}

    def _evaluate_and_check(self) -> float | None:
        """Evaluate, record the loss and the eval callbacks' metrics, and check the loss for a divergence."""
        self.eval_metrics = {}
        val = self.evaluate()
        self.history.log_eval(self.step, val, **self.eval_metrics)
        if val is not None:
            self._check_loss(self.step, val, validation=True)
        return val

    def _check_loss(self, step: int, loss: float, **where: Any) -> None:
        """A loss just recorded in the history: a nan/inf or a spike found in it goes to the run's outcome. Once a
        spike would change nothing (a stop, a warning given, policy "off") the rule is not run."""
        rule = self.spike_rule if self.outcome.watching("spike") else None
        found = divergence.check_loss(self.history, step, loss, spike_rule=rule, **where)
        if found is not None:
            self.on_divergence(found.what, kind=found.kind)

    @staticmethod
    def _add_to_window(window: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """Sum (loss, gradient norm) on the device in one tensor: one host transfer per log interval."""
        if grad_norm is None:
            # One add instead of zeros_like + stack + add in every step's graph; entry 1 is unread without a norm.
            return window + loss.float()
        return window + torch.stack([loss.float(), grad_norm.float()])

    def _zero_window(self) -> torch.Tensor:
        # Made on the host and copied over, so it enters the next graph as data exactly like the running sum does
        # (an on-device torch.zeros would be a different graph for the step after each log).
        return torch.zeros(2).to(self.backend.device)

    def _on_log(self, step: int, window: torch.Tensor, window_start: tuple, lr: float, bar: Any) -> None:
        """Runs after the step's graph executed: the only place the training loss is read on the host."""
        first_step, t0 = window_start
        steps = max(1, step - first_step)
        seconds = max(time.perf_counter() - t0, 1e-9)
        loss_sum, norm_sum = window.tolist()
        loss = loss_sum / steps
        tok_s = steps * self.tokens_per_step / seconds
        norm = norm_sum / steps if self.config.grad_clip is not None else None
        self.history.log_train(step, loss=loss, lr=lr, tokens_per_s=tok_s, grad_norm=norm, **self.log_extras(step))
        self._check_loss(step, loss, first_step=first_step)  # nan/inf or a spike: the outcome's policy decides
        for cb in self.callbacks:
            cb.on_log(self, self.history.train[-1])
        bar.set_postfix_str(f"loss {loss:.3f} | {tok_s:,.0f} tok/s", refresh=False)


def _replays_steps(cls: type) -> bool:
    """Whether `cls`'s step goes through `Trainer.replayed`: the nearest class declaring `replays_steps` says so,
    and `cls` keeps that class's compute_loss and train_step (where its replay lives)."""
    owner = next(k for k in cls.__mro__ if "replays_steps" in vars(k))
    return bool(owner.replays_steps) and all(getattr(cls, m) is getattr(owner, m) for m in ("compute_loss", "train_step"))


class _Take:
    """The first `n` batches of a loader, with a length (MpDeviceLoader and progress bars ask for one)."""

    def __init__(self, loader: DataLoader, n: int) -> None:
        self.loader, self.n = loader, n

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.n)

    def __len__(self) -> int:
        return min(self.n, len(self.loader))


def fit(model: torch.nn.Module, train_data: Dataset, val_data: Dataset | None = None, *,
        config: TrainConfig | None = None, **kwargs: Any) -> tuple[Trainer, RunReport]:
    """Train `model` with the package's loop; returns the trainer (history, model) and the run report."""
    trainer = Trainer(model, train_data, val_data, config=config, **kwargs)
    return trainer, trainer.fit()
