"""Experiment tracking: a run's figures in TensorBoard, Weights & Biases or trackio while it trains.

    config = TrainConfig(..., trackers="tensorboard,wandb", project="my-project", run_name="lr-3e-3")
    report = Trainer(model, train, val, config=config).fit()   # the trainer adds `Tracking` by itself

The trainer adds a `Tracking` callback when `config.trackers` names any tracker, on the main process only. It logs
what the loop already read (train/*, time/* and xla/* at log steps, eval/loss at evaluations, the config at the
start, the report's figures at the end), so tracking adds no device read or graph. A resumed run continues the
same tracked run (its id is in `<out_dir>/checkpoints/run.json`) and logs no step twice. A missing package or W&B
login is a ConfigError when the trainer is made; a tracker that fails during the run is dropped with one warning:
a tracker never stops a run. What is logged when, resume and failures in full: docs/guides/tracking.md.
"""

from __future__ import annotations

import secrets
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpu_helpers.config import TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.diagnostics.detector import detector_for
from tpu_helpers.training.step_timing import mfu_inputs
from tpu_helpers.training.tracking.clients import TrackedRun, Tracker, check_ready, open_tracker

if TYPE_CHECKING:
    from tpu_helpers.training.history import RunReport


class TrackingError(RuntimeError):
    """A tracker could not start its run (before any training step)."""


class TrackingWarning(UserWarning):
    """A tracker failed during the run and was dropped; training went on."""


def tracker_names(config: TrainConfig) -> list[str]:
    return [name for name in config.trackers.split(",") if name]


class Tracking(Callback):
    """Feeds the run's trackers from the loop's hooks (see the module docstring).

    The hooks get the running Trainer (the Callback protocol); typed Any so that this helper of the trainer does
    not import it. What they read of it: step, config, backend, raw_model, history, timer, state (the tracked run
    kept in run.json) and tokens_per_step."""

    def __init__(self, config: TrainConfig) -> None:
        self.names = tracker_names(config)
        check_ready(self.names)
        self.config = config
        self.described: dict[str, Any] = {}
        self.trackers: list[Tracker] = []
        self.floors: dict[str, int] = {}  # per tracker: steps at or below are already in its run
        self.run: TrackedRun | None = None
        self._pending: dict[str, float] = {}
        self._pending_step: int | None = None
        self._eval_logged: int | None = None
        self._timed = 0  # the trainer's timed steps already summarised in a log
        self._flops: tuple = (None, None, 1)
        # A recipe keeps the tracked run open after fit, for its results (save_results closes it).
        self.hold_open = False

    def describe(self, **values: Any) -> None:
        """Add values to the run's config (before `fit`), e.g. `memory_plan=plan.to_dict()`."""
        self.described.update(values)

    # ---- hooks -------------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any) -> None:
        if self.run is None:
            self._open(trainer)
        self._timed = len(trainer.timer.steps)
        self._flops = mfu_inputs(trainer.backend, trainer.raw_model, trainer.config.seq_len)
        # What a tracked run lacks of the history this run starts with (the first evaluation; on resume the
        # checkpoint's records, of which a killed process's tracker may have kept only part, or nothing).
        rows: dict[int, dict[str, float]] = {}
        for record in trainer.history.train:
            rows.setdefault(record["step"], {}).update(_train_values(record))
        for record in trainer.history.eval:
            rows.setdefault(record["step"], {})["eval/loss"] = record["val_loss"]
        for step in sorted(rows):
            self._write(step, rows[step])
        self._eval_logged = trainer.step

    def on_log(self, trainer: Any, record: dict) -> None:
        # Inside the step closure: keep the values; they are written once at the end of the step.
        values = _train_values(record)
        window = trainer.timer.window(self._timed)
        self._timed = len(trainer.timer.steps)
        if window:
            values.update({f"time/{part}_ms": ms for part, ms in window.items()})
            fpt, peak, chips = self._flops
            if fpt and peak and window["step"] > 0:
                values["train/mfu"] = trainer.tokens_per_step * fpt / (window["step"] / 1e3) / (peak * 1e12 * chips)
        self._add(record["step"], values)

    def on_step_end(self, trainer: Any) -> None:
        if self._pending_step == trainer.step and trainer.backend.compiles_graphs:
            # The counters after this log step; the XLA detector already read them (reading them costs about a
            # millisecond once a run has made many counters).
            detector = detector_for(trainer)
            counters = (detector.counters if detector is not None else None) or trainer.backend.metrics()
            self._pending.update({"xla/compilations": counters.get("compilations", 0),
                                  "xla/host_transfers": counters.get("device_to_host_transfers", 0),
                                  "xla/executions": counters.get("executions", 0)})
        self._add_eval(trainer)
        self._flush()

    def on_fit_end(self, trainer: Any, report: RunReport) -> None:
        self._flush()
        figures = {"steps": report.steps, "tokens_per_s": report.tokens_per_s,
                   "final_train_loss": report.final_train_loss, "final_val_loss": report.final_val_loss,
                   "steady_step_ms": report.timing.get("steady_step_ms"), "mfu": report.mfu,
                   "stop_reason": report.stop_reason}
        figures.update({f"xla/{k}": v for k, v in report.xla.items() if isinstance(v, (int, float))})
        self._each("summary", {k: v for k, v in figures.items() if v is not None}, report.steps)
        self._each("flush")
        if not self.hold_open:
            self.close()

    # ---- what recipes call -------------------------------------------------------------------------------------
    def log_results(self, step: int, *, tables: dict[str, list[dict]] | None = None,
                    values: dict[str, float] | None = None) -> None:
        """A recipe's results after training: tables (a list of row dicts each) and single values, at `step`."""
        for key, rows in (tables or {}).items():
            if rows:
                self._each("log_table", key, rows, step)
        if values:
            self._each("summary", values, step)

    def close(self) -> None:
        """Finish the tracked run (a later `fit` of the same trainer opens it again and continues it)."""
        self._flush()
        self._each("close")
        self.trackers, self.run = [], None

    # ---- internals ---------------------------------------------------------------------------------------------
    def _open(self, trainer: Any) -> None:
        cfg = self.config
        ident = trainer.state.tracked_run(lambda: {"id": secrets.token_hex(4),
                                                   "name": cfg.run_name or Path(cfg.out_dir).resolve().name})
        config = {**cfg.to_dict(), "backend": trainer.backend.status(), "tokens_per_step": trainer.tokens_per_step,
                  "parameters": sum(p.numel() for p in trainer.raw_model.parameters()), **self.described}
        self.run = TrackedRun(id=ident["id"], name=ident["name"], project=cfg.project, out_dir=Path(cfg.out_dir),
                              start_step=trainer.step, config=config)
        for name in self.names:
            try:
                tracker = open_tracker(name, self.run)
                floor = tracker.last_step()
            except Exception as err:
                self._each("close")
                self.trackers, self.run = [], None
                raise TrackingError(f"{name} could not start the tracked run {ident['name']!r} (id {ident['id']}): "
                                    f"{type(err).__name__}: {err}") from err
            self.trackers.append(tracker)
            self.floors[name] = -1 if floor is None else floor

    def _add(self, step: int, values: dict[str, float]) -> None:
        if self._pending_step is not None and step != self._pending_step:
            self._flush()
        self._pending_step = step
        self._pending.update(values)

    def _add_eval(self, trainer: Any) -> None:
        evals = trainer.history.eval
        if evals and evals[-1]["step"] == trainer.step and self._eval_logged != trainer.step:
            self._eval_logged = trainer.step
            self._add(trainer.step, {"eval/loss": evals[-1]["val_loss"]})

    def _flush(self) -> None:
        if self._pending_step is None:
            return
        step, values = self._pending_step, self._pending
        self._pending, self._pending_step = {}, None
        self._write(step, values)

    def _write(self, step: int, values: dict[str, float]) -> None:
        """Log `values` at `step` to each tracker whose run does not hold that step yet."""
        for tracker in list(self.trackers):
            if step > self.floors[tracker.name]:
                self._call(tracker, "log", values, step)
                self.floors[tracker.name] = step

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, method, *args)

    def _call(self, tracker: Tracker, method: str, *args: Any) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as err:  # a tracker never stops a run: drop it, say so once
            self.trackers.remove(tracker)
            warnings.warn(f"{tracker.name} failed ({type(err).__name__}: {err}); the run goes on without it",
                          TrackingWarning, stacklevel=2)


_RECORD_KEYS = ("step", "loss", "lr", "tokens_per_s", "grad_norm")


def _train_values(record: dict) -> dict[str, float]:
    values = {"train/loss": record["loss"], "train/learning_rate": record["lr"],
              "train/tokens_per_s": record["tokens_per_s"]}
    if record.get("grad_norm") is not None:
        values["train/grad_norm"] = record["grad_norm"]
    # What a step adds to its records (`StepFigures`' device and host figures: GRPO's reward, KL, completion length...).
    values.update({f"train/{k}": v for k, v in record.items() if k not in _RECORD_KEYS
                   and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return values
