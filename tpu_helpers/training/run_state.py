"""A run's checkpoints over its life: resume or start, save, the best one, the run lock and the run report.

    state = RunState(config, backend, RunParts(model=wrapped, raw_model=model, optimizer=optimizer,
                                               progress_state=trainer.progress_state,
                                               load_progress_state=trainer.load_progress_state),
                     outcome=run_outcome, run_identity={...}, save_trainable_only=False)
    state.resume_or_start()   # when fit starts: takes the run lock, checks the directory, loads the newest checkpoint
    state.save()              # at a save step: a checkpoint of the step `progress_state()` records
    state.report(start_step, seconds, step=..., history=..., tokens_per_step=...)   # the RunReport
    state.release_lock()      # when fit ends, however it ends

What a checkpoint holds is `checkpoint_contents`; the files `tpu_helpers.checkpoint` (in `<out_dir>/checkpoints/`).
`run.json` there records the run's identity (model, data by content fingerprint, global batch, seed): resuming
with another is refused, and so is starting over on checkpoints that cannot be verified, unless `resume="force_new"`
sets them aside. A diverged run saves nothing more (its `outcome.RunOutcome` says so); the best checkpoint by
`best_metric` is kept by the manager and recorded in run.json and the report. Per-setting resume rules: `resume_policy`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tpu_helpers.backend import Backend
from tpu_helpers.backend.base import first_line
from tpu_helpers.backend.units import model_class_name
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.checkpoint.manager import agreed
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.data.text import data_identity
from tpu_helpers.training.arguments import check_out_dir
from tpu_helpers.training.checkpoint_contents import CheckpointContents, RunParts
from tpu_helpers.training.guard import finite
from tpu_helpers.training.guard.outcome import RunOutcome
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.resume_policy import (
    IDENTITY_FIELDS,
    apply_changes,
    checkpoint_config_mismatch,
    mismatched_identity,
)
from tpu_helpers.training.run_lock import RunLock

__all__ = ["IDENTITY_FIELDS", "RunParts", "RunState"]

TRACKED_RUN = "tracked_run"  # run.json's entry naming the trackers' run (not part of the identity)


def _say(message: str) -> None:
    print(f"[tpu_helpers] {message}", file=sys.stderr, flush=True)


class RunState(CheckpointContents):
    """A run's checkpoints: resume or start (`resume_or_start`), `save`, the best one, the run lock."""

    def __init__(self, config: TrainConfig, backend: Backend, parts: RunParts, *, outcome: RunOutcome,
                 run_identity: dict | None = None, save_trainable_only: bool = False) -> None:
        self.config = cfg = config
        self.backend, self.parts = backend, parts
        self.outcome = outcome  # a diverged run saves nothing; non-finite weights found at a save are reported
        self.save_trainable_only = save_trainable_only
        self.directory = Path(cfg.out_dir) / "checkpoints"
        self.manager = CheckpointManager(self.directory, keep_last=cfg.keep_last, is_main=backend.is_main,
                                         best_metric=cfg.best_metric)
        self.lock = RunLock(cfg.out_dir)
        self.run_identity = dict(run_identity or {})
        self.resumed_from: int | None = None
        self.resume_changes: list[str] = []
        self.set_aside: Path | None = None
        self.last_path: Path | None = None
        self._identity: dict | None = None  # what run.json holds besides "best"
        self._recorded_best: dict | None = None

    @property
    def identity(self) -> dict:
        """What the checkpoints are of (model, data by content fingerprint, global batch, seed...), read when the
        run starts: a trainer made only for its step (the probe, the estimates) never reads its data files."""
        cfg, model = self.config, self.parts.raw_model
        return {
            **{k: getattr(cfg, k) for k in IDENTITY_FIELDS},
            **data_identity(cfg.dataset),
            "global_batch": cfg.batch_size * self.backend.num_replicas * cfg.grad_accum,
            "model": model_class_name(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            **self.run_identity,
        }

    def _check_identity(self, identity: dict) -> None:
        stored = self.manager.read_run_info()
        if stored is None:
            return
        diff = mismatched_identity(stored, identity)
        if diff:
            details = ", ".join(f"{k}: {old!r} there vs {new!r} now" for k, (old, new) in sorted(diff.items()))
            hint = (" (global_batch = batch_size x chips x grad_accum: keep it to resume on another number of "
                    "chips, e.g. batch_size = global_batch / (chips x grad_accum))" if "global_batch" in diff else "")
            raise ConfigError(
                f"out_dir={str(self.config.out_dir)!r} holds checkpoints of a different run ({details}){hint}; "
                "choose another out_dir, or pass resume='force_new' to move its checkpoints into a dated set-aside "
                "folder and start over"
            )

    def _check_unverifiable(self, any_valid: bool) -> None:
        bad = self.manager.unverifiable(any_valid)
        if not bad:
            return
        listed = "\n".join(f"  {i.path.name}: {i.reason}" for i in bad)
        raise ConfigError(
            f"out_dir={str(self.config.out_dir)!r} holds checkpoint data that cannot be verified, and "
            f"starting this run would overwrite or delete it:\n{listed}\n"
            "Copy the matching .json manifests back next to them to resume, or pass resume='force_new' to move "
            f"every checkpoint into a dated set-aside folder under {str(self.directory)!r} (nothing is deleted) "
            "and start over"
        )

    def resume_or_start(self) -> None:
        b, cfg = self.backend, self.config
        if b.is_main:
            check_out_dir(cfg.out_dir)  # now, not at the first save an hour into the run
            self.lock.acquire()  # refuses at once, naming the holder, if another run uses this out_dir
        if cfg.resume == "force_new":
            if b.is_main:
                self.set_aside = self.manager.set_aside()
                if self.set_aside is not None:
                    _say(f"resume='force_new': moved the earlier checkpoints of {str(cfg.out_dir)!r} into "
                         f"{self.set_aside} (nothing deleted); starting a new run")
            b.barrier()  # other processes must not read checkpoints the main one is moving away
        latest = self.manager.latest()
        self._check_unverifiable(latest is not None)
        identity = self.identity
        self._check_identity(identity)
        if latest is not None and cfg.resume is False:
            raise ConfigError(
                f"out_dir={str(cfg.out_dir)!r} already holds checkpoints (newest: step {latest.step}) and "
                "resume=False; pass resume=True to continue that run, resume='force_new' to set them aside and "
                "start over, or choose another out_dir"
            )
        self._identity = identity
        self._recorded_best = self.best()
        if b.is_main:
            # What the run's trackers logged to (training/tracking/__init__.py) stays with the run it belongs to.
            self.manager.write_run_info(self._run_info())
        loaded = self.manager.load_latest() if latest is not None and cfg.resume is True else None
        self._check_same_start(loaded[0] if loaded else None)
        if loaded is None:
            b.manual_seed(cfg.seed)
            return
        step, state = loaded
        self._load_checked(step, state)
        self.resumed_from = step
        self.resume_changes = apply_changes(cfg, self.parts.optimizer, step, state.get("config"))
        if self.resume_changes and b.is_main:
            _say(f"resumed from step {step} with changed settings: " + "; ".join(self.resume_changes))

    def _check_same_start(self, step: int | None) -> None:
        """Every process resumes from the same step (or none starts over while another resumes): on a pod slice an
        out_dir on each host's own disk has host 0's checkpoints only, and the hosts would silently train
        different models."""
        seen = self.backend.gather_objects(step)
        if len(set(seen)) > 1:
            said = ", ".join(f"process {i}: {'no checkpoint' if s is None else f'step {s}'}" for i, s in enumerate(seen))
            raise ConfigError(
                f"the processes of this run see different checkpoints in out_dir="
                f"{str(self.config.out_dir)!r} ({said}); every process must read the same directory: on a "
                "pod slice put out_dir on storage all hosts mount (Filestore, a gcsfuse bucket)"
            )

    def _load_checked(self, step: int, state: dict) -> None:
        """load_state, with "this checkpoint belongs to another run" instead of a raw state_dict error."""
        path = self.manager.path_for(step)
        mismatch = checkpoint_config_mismatch(state.get("config") if isinstance(state, dict) else None,
                                              self.config)
        try:
            if mismatch:
                raise ValueError("its config differs: " + ", ".join(mismatch))
            self.load_state(state)
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as err:
            first = first_line(err)
            raise ConfigError(
                f"checkpoint {path} does not belong to this run ({type(err).__name__}: {first[:400]}); it was "
                "probably copied in from another run. Choose another out_dir, or pass resume='force_new' to move "
                "the checkpoints into a dated set-aside folder and start over"
            ) from err

    def tracked_run(self, make: Callable[[], dict]) -> dict:
        """The tracked run this run logs to (its id and name, kept in run.json so a resumed run continues it):
        the stored one, or `make()` stored now. Main process only, after `resume_or_start`."""
        info = self.manager.read_run_info() or {}
        if not isinstance(info.get(TRACKED_RUN), dict):
            info[TRACKED_RUN] = make()
            self.manager.write_run_info(info)
        return info[TRACKED_RUN]

    def release_lock(self) -> None:
        self.lock.release()

    # ---- the best checkpoint ---------------------------------------------------------------------------------
    def best(self) -> dict | None:
        """{"step", "path", "metric", "value"} of the best checkpoint by `best_metric`, or None."""
        info = self.manager.best()
        if info is None:
            return None
        name = self.manager.best_order[0]
        return {"step": info.step, "path": str(info.path), "metric": name, "value": info.metric(name)}

    def _run_info(self) -> dict:
        """run.json: the run's identity, its best checkpoint, and the trackers' run as stored (tracked_run)."""
        stored = self.manager.read_run_info() or {}
        kept = {k: stored[k] for k in (TRACKED_RUN,) if k in stored}
        return {**(self._identity or stored), **kept, "best": self._recorded_best}

    def _record_best(self) -> None:
        """run.json's "best" follows the manifests (rewritten after a save that changed it; main process only)."""
        if not self.backend.is_main:
            return
        best = self.best()
        if best != self._recorded_best:
            self._recorded_best = best
            self.manager.write_run_info(self._run_info())

    def save(self) -> Path | None:
        """Save a checkpoint of the run's step unless the run diverged (then the good checkpoints stay as they are):
        a stop on a nan/inf or a loss spike saves nothing more, and non-finite weights are never saved (they are
        reported to the outcome as a "nonfinite" divergence)."""
        if self.outcome.diverged is not None:
            return None  # stopping on a divergence: the weights are not worth a checkpoint slot
        writer = self.sharded_writer()

        def save_here() -> tuple[int, Path | None, list[str]]:
            # The checkpoint is of the step its progress records; its manifest gets that step's epoch and metrics.
            small = self._small_state()
            step = small["step"]
            meta = {"epoch": small["epoch"], "metrics": _metrics_at(small["history"], step)}
            if writer is not None:
                saved = self._save_sharded(writer, step, small, meta)
                return (step, None, saved) if isinstance(saved, list) else (step, saved, [])
            state = self.state_dict(small)
            bad = finite.nonfinite_tensors(state["model"])
            return step, None if bad else self.manager.save(step, state, meta=meta), bad

        # Every process learns whether the save worked: the main one failing alone (a full disk on host 0 of a
        # pod) must not leave the others waiting at their next collective.
        step, saved, bad = agreed(save_here, self.backend.gather_objects)
        if bad:
            self.outcome.diverge(f"the weights hold nan/inf at step {step} ({', '.join(bad[:3])}"
                                 f"{', ...' if len(bad) > 3 else ''})")
            return None
        self.last_path = saved
        self._record_best()
        return self.last_path

    def report(self, start_step: int, seconds: float, *, step: int, history: History,
               tokens_per_step: int) -> RunReport:
        """The run report of a `fit` that went from `start_step` to `step` in `seconds`: what this run state knows
        (resumed from, last checkpoint, changed settings, best checkpoint), the backend's figures, the outcome's
        stop reason, and the loss `history`."""
        b = self.backend
        steps = step - start_step
        evals, trains = history.eval, history.train
        return RunReport(
            device=b.status(),
            steps=step,
            steps_this_run=steps,
            resumed_from=self.resumed_from,
            seconds=seconds,
            tokens_per_step=tokens_per_step,
            tokens_per_s=steps * tokens_per_step / seconds if seconds > 0 else 0.0,
            steps_per_s=steps / seconds if seconds > 0 else 0.0,
            first_val_loss=evals[0]["val_loss"] if evals else None,
            final_val_loss=evals[-1]["val_loss"] if evals else None,
            final_train_loss=trains[-1]["loss"] if trains else None,
            checkpoint=str(self.last_path) if self.last_path else None,
            parameters=sum(p.numel() for p in self.parts.raw_model.parameters()),
            precision=b.precision,
            xla=b.run_metrics(),
            memory=b.memory_info(),
            stop_reason=self.outcome.stop_reason,
            resume_changes=list(self.resume_changes),
            best_checkpoint=self.best(),
        )


def _metrics_at(history: dict, step: int) -> dict:
    """The validation metrics recorded at `step` in a history dict (the loss and what eval callbacks added), for
    the manifest."""
    record = next((e for e in reversed(history.get("eval", [])) if e["step"] == step), None)
    return {k: v for k, v in (record or {}).items() if k != "step"}
