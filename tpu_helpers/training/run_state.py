"""Saving and resuming a run's whole state, and refusing to mix two runs in one directory.

    state = RunState(config, backend, RunParts(model=wrapped, raw_model=model, optimizer=optimizer,
                                               progress_state=trainer.progress_state,
                                               load_progress_state=trainer.load_progress_state),
                     outcome=run_outcome, run_identity={...}, save_trainable_only=False)
    state.resume_or_start()   # when fit starts: takes the run lock, checks the directory, loads the newest checkpoint
    state.save()              # at a save step: a checkpoint of the step `progress_state()` records
    state.report(start_step, seconds, step=..., history=..., tokens_per_step=...)   # the RunReport
    state.release_lock()      # when fit ends, however it ends

A `RunState` is built from explicit parts rather than from the trainer: the config and backend, the `RunParts` it
saves and restores (the model as trained and as made, the optimizer, and the progress as a pair of callables, so a
variant's own progress such as GRPO's rollout travels with it), and the run's `outcome.RunOutcome`: a run that
diverged saves nothing more, and non-finite weights found at a save are reported to it (never saved).

A checkpoint holds the model (only its trainable weights with `save_trainable_only`, as LoRA fine-tuning does: the
frozen base is identified by a fingerprint in run.json instead), the optimizer and the run's progress
(`Trainer.progress_state`: step, data position in samples of the global order, every RNG stream, the history), so
a resumed run continues the same run, on any number of chips or processes that keeps the global batch (per-chip
batch x chips x accumulation). The learning-rate schedule is not stored: the trainer rebuilds it from its config
at the resume step. Checkpoints live in `<out_dir>/checkpoints/` and are written by
`tpu_helpers.checkpoint.CheckpointManager` (atomic, checksummed). `<out_dir>/checkpoints/run.json` records what
identifies the run (model, data by resolved path and content fingerprint, batch, seed); resuming with a different
identity is an error rather than a silent mix of two runs. What each setting does on resume: `resume_policy`.

The best checkpoint: each checkpoint's manifest records the validation metrics of its step (when it is an
evaluation step), and the manager keeps the best by `TrainConfig.best_metric` whatever `keep_last` says. `best()`
names it; it is also recorded in run.json (`"best"`, rewritten when it changes) and in the run report, and
`checkpoint_weights(step)` reads a checkpoint's model weights for an export.

One run per out_dir: `resume_or_start` takes the directory's run lock (`run_lock.RunLock`) and `release_lock`
(called when `fit` ends, however it ends) gives it back. Checkpoints that cannot be verified (a `.pt` without its
manifest) are never overwritten or pruned silently: the run refuses to start until told, and `resume="force_new"`
moves every checkpoint into a dated `set-aside-*` folder (nothing is deleted) and starts over.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tpu_helpers.backend import Backend
from tpu_helpers.backend.base import first_line
from tpu_helpers.backend.units import model_class_name, trainable_names
from tpu_helpers.checkpoint import CheckpointManager, sharded
from tpu_helpers.checkpoint.manager import agreed
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.data.text import data_identity
from tpu_helpers.training import finite
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.outcome import RunOutcome
from tpu_helpers.training.resume_policy import (
    IDENTITY_FIELDS,
    apply_changes,
    checkpoint_config_mismatch,
    mismatched_identity,
)
from tpu_helpers.training.run_lock import RunLock
from tpu_helpers.training.validation import check_out_dir

__all__ = ["IDENTITY_FIELDS", "RunParts", "RunState"]

TRACKED_RUN = "tracked_run"  # run.json's entry naming the trackers' run (not part of the identity)


def _say(message: str) -> None:
    print(f"[tpu_helpers] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RunParts:
    """What a checkpoint saves and restores, as the trainer holds it."""

    model: torch.nn.Module  # as trained: what the backend made of it (wrapped in DDP, sharded...)
    raw_model: torch.nn.Module  # as made: its class and size identify the run
    optimizer: torch.optim.Optimizer
    # The rest of the run's progress (`Trainer.progress_state`): a dict holding at least "step", "epoch" and
    # "history" (`History.to_dict()`), read when a checkpoint is written; and its inverse, called on resume.
    progress_state: Callable[[], dict]
    load_progress_state: Callable[[dict], None]


class RunState:
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
            # What the run's trackers logged to (training/tracking.py) stays with the run it belongs to.
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

    def _small_state(self) -> dict:
        """Everything but the model and optimizer: the run's progress and the config it ran with."""
        return self.backend.to_cpu({**self.parts.progress_state(), "config": self.config.to_dict()})

    def _unwrapped(self):
        return getattr(self.parts.model, "module", self.parts.model)  # unwrap DDP

    def sharded_writer(self) -> str | None:
        """The sharded checkpoint kind this run saves ("xla-spmd", "fsdp2"), or None: saved whole in one file."""
        return self.backend.sharded_writer(self._unwrapped())

    def state_dict(self, small: dict | None = None) -> dict:
        """The whole checkpoint: `small` (`_small_state()`, taken now when not given), the model and optimizer."""
        b, model = self.backend, self._unwrapped()
        model_sd, optimizer_sd = b.state_dicts(model, self.parts.optimizer)  # whole, under any sharding
        return {**(small if small is not None else self._small_state()),
                **b.to_cpu({"model": self._model_state(model, model_sd), "optimizer": optimizer_sd})}

    def load_state(self, state: dict) -> None:
        b, optimizer, model = self.backend, self.parts.optimizer, self._unwrapped()
        handle = state.get("sharded")
        if handle is not None and handle.writer == self.sharded_writer():
            # Same kind of sharded run (any chip count): DCP reads each device's part in place.
            template = b.sharded_tensors(model, optimizer)
            template["model"] = self._model_state(model, template["model"])
            handle.load_into(template, b.dcp_planner(save=False))
            b.load_sharded_tensors(model, optimizer, template, strict=not self.save_trainable_only)
        else:
            if handle is not None:  # saved sharded, resumed unsharded (or by another writer): whole, on the CPU
                state = {**state, **handle.read_whole()}
            if self.save_trainable_only:  # LoRA: only the adapters were saved
                _load_trainable(model, state["model"])
                optimizer.load_state_dict(state["optimizer"])
            else:
                b.load_state_dicts(model, optimizer, state["model"], state["optimizer"])
        b.after_load(self.parts.model, optimizer)
        self.parts.load_progress_state(state)

    def _model_state(self, model, state: dict) -> dict:
        """The model's state dict `state`; with `save_trainable_only` (LoRA) only the trainable weights.

        `state` has the plain names (FSDPv2's state-dict hooks drop its "_orig_module." level) while the wrapped
        model's parameters carry that level: compare plain with plain, or under fsdp no adapter weight is kept."""
        if self.save_trainable_only:
            names = trainable_names(model)
            state = {k: v for k, v in state.items() if k in names}
        return state

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

    def checkpoint_weights(self, step: int) -> dict:
        """The model weights checkpoint `step` holds, whole on the CPU (the trainable ones under LoRA), under the
        plain model's names: what an export of that step writes. Reads no optimizer state from a sharded one."""
        state = self.manager.load(step, mmap=True)  # a .pt's optimizer state stays on disk
        handle = state.get("sharded")
        return handle.read_whole(parts=("model",))["model"] if handle is not None else state["model"]

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

    def _save_sharded(self, writer: str, step: int, small: dict, meta: dict) -> Path | list[str]:
        """A sharded checkpoint: each process writes its devices' shards (no gather onto one host)."""
        b, model = self.backend, self._unwrapped()
        tensors = b.sharded_tensors(model, self.parts.optimizer)
        tensors["model"] = self._model_state(model, tensors["model"])  # LoRA: the adapters only
        planner = sharded.finite_checking(type(b.dcp_planner(save=True)))()

        def write(directory: Path) -> list[str]:
            bad = sharded.write(directory, tensors, planner)
            return [name.removeprefix("model.") for name in bad if not name.startswith("optimizer.")] or bad

        size = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + AdamW moments
        return self.manager.save_sharded(step, small, write, writer=writer, size=size, gather=b.gather_objects,
                                         meta=meta)

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


def _load_trainable(model, state: dict) -> None:
    trainable = trainable_names(model)
    if set(state) != trainable:
        missing, unexpected = sorted(trainable - set(state)), sorted(set(state) - trainable)
        raise ConfigError(f"the checkpoint's trainable weights do not match the model's (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}); was it written with other LoRA settings?")
    # strict=False: the frozen base is not in it. A key that matched no parameter (say, a wrapper level the
    # load hooks did not add back) would leave that adapter silently untrained: refuse it.
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise ConfigError(f"the checkpoint's trainable weights {sorted(unexpected)[:5]} match no parameter of the model")
