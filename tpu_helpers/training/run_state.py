"""Saving and resuming a Trainer's whole state, and refusing to mix two runs in one directory.

A checkpoint holds the model (only its trainable weights when the trainer was made with `save_trainable_only`,
as LoRA fine-tuning does: the frozen base is identified by a fingerprint in run.json instead), the optimizer and
the trainer's progress (`Trainer.progress_state`: step, data position in samples of the global order, every RNG
stream, the history), so a resumed run continues the same run, on any number of chips or processes that keeps the
global batch (per-chip batch x chips x accumulation). The learning-rate schedule is not stored: the trainer
rebuilds it from its config at the resume step. Checkpoints live in `<out_dir>/checkpoints/` and are written by
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
from pathlib import Path
from typing import TYPE_CHECKING

from tpu_helpers.backend.units import model_class_name, trainable_names
from tpu_helpers.checkpoint import CheckpointManager, sharded
from tpu_helpers.checkpoint.manager import agreed
from tpu_helpers.config import ConfigError
from tpu_helpers.data.text import data_identity
from tpu_helpers.training import finite
from tpu_helpers.training.history import RunReport
from tpu_helpers.training.resume_policy import (
    IDENTITY_FIELDS,
    apply_changes,
    checkpoint_config_mismatch,
    mismatched_identity,
)
from tpu_helpers.training.run_lock import RunLock
from tpu_helpers.training.validation import check_out_dir

if TYPE_CHECKING:
    from tpu_helpers.training.trainer import Trainer

__all__ = ["IDENTITY_FIELDS", "RunState"]

TRACKED_RUN = "tracked_run"  # run.json's entry naming the trackers' run (not part of the identity)


def _say(message: str) -> None:
    print(f"[tpu_helpers] {message}", file=sys.stderr, flush=True)


class RunState:
    def __init__(self, trainer: Trainer, *, run_identity: dict | None = None) -> None:
        self.trainer = trainer
        cfg = trainer.config
        self.directory = Path(cfg.out_dir) / "checkpoints"
        self.manager = CheckpointManager(self.directory, keep_last=cfg.keep_last, is_main=trainer.backend.is_main,
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
        t, cfg = self.trainer, self.trainer.config
        model = t.raw_model
        return {
            **{k: getattr(cfg, k) for k in IDENTITY_FIELDS},
            **data_identity(cfg.dataset),
            "global_batch": cfg.batch_size * t.backend.num_replicas * cfg.grad_accum,
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
                f"out_dir={str(self.trainer.config.out_dir)!r} holds checkpoints of a different run ({details}){hint}; "
                "choose another out_dir, or pass resume='force_new' to move its checkpoints into a dated set-aside "
                "folder and start over"
            )

    def _check_unverifiable(self, any_valid: bool) -> None:
        bad = self.manager.unverifiable(any_valid)
        if not bad:
            return
        listed = "\n".join(f"  {i.path.name}: {i.reason}" for i in bad)
        raise ConfigError(
            f"out_dir={str(self.trainer.config.out_dir)!r} holds checkpoint data that cannot be verified, and "
            f"starting this run would overwrite or delete it:\n{listed}\n"
            "Copy the matching .json manifests back next to them to resume, or pass resume='force_new' to move "
            f"every checkpoint into a dated set-aside folder under {str(self.directory)!r} (nothing is deleted) "
            "and start over"
        )

    def resume_or_start(self) -> None:
        t, cfg = self.trainer, self.trainer.config
        if t.backend.is_main:
            check_out_dir(cfg.out_dir)  # now, not at the first save an hour into the run
            self.lock.acquire()  # refuses at once, naming the holder, if another run uses this out_dir
        if cfg.resume == "force_new":
            if t.backend.is_main:
                self.set_aside = self.manager.set_aside()
                if self.set_aside is not None:
                    _say(f"resume='force_new': moved the earlier checkpoints of {str(cfg.out_dir)!r} into "
                         f"{self.set_aside} (nothing deleted); starting a new run")
            t.backend.barrier()  # other processes must not read checkpoints the main one is moving away
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
        if t.backend.is_main:
            # What the run's trackers logged to (training/tracking.py) stays with the run it belongs to.
            self.manager.write_run_info(self._run_info())
        loaded = self.manager.load_latest() if latest is not None and cfg.resume is True else None
        self._check_same_start(loaded[0] if loaded else None)
        if loaded is None:
            t.backend.manual_seed(cfg.seed)
            return
        step, state = loaded
        self._load_checked(step, state)
        self.resumed_from = step
        self.resume_changes = apply_changes(t, state.get("config"))
        if self.resume_changes and t.backend.is_main:
            _say(f"resumed from step {step} with changed settings: " + "; ".join(self.resume_changes))

    def _check_same_start(self, step: int | None) -> None:
        """Every process resumes from the same step (or none starts over while another resumes): on a pod slice an
        out_dir on each host's own disk has host 0's checkpoints only, and the hosts would silently train
        different models."""
        seen = self.trainer.backend.gather_objects(step)
        if len(set(seen)) > 1:
            said = ", ".join(f"process {i}: {'no checkpoint' if s is None else f'step {s}'}" for i, s in enumerate(seen))
            raise ConfigError(
                f"the processes of this run see different checkpoints in out_dir="
                f"{str(self.trainer.config.out_dir)!r} ({said}); every process must read the same directory: on a "
                "pod slice put out_dir on storage all hosts mount (Filestore, a gcsfuse bucket)"
            )

    def _load_checked(self, step: int, state: dict) -> None:
        """load_state, with "this checkpoint belongs to another run" instead of a raw state_dict error."""
        path = self.manager.path_for(step)
        mismatch = checkpoint_config_mismatch(state.get("config") if isinstance(state, dict) else None,
                                              self.trainer.config)
        try:
            if mismatch:
                raise ValueError("its config differs: " + ", ".join(mismatch))
            self.load_state(state)
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
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
        """Everything but the model and optimizer: the trainer's progress and the config it ran with."""
        t = self.trainer
        return t.backend.to_cpu({**t.progress_state(), "config": t.config.to_dict()})

    def _unwrapped(self):
        return getattr(self.trainer.model, "module", self.trainer.model)  # unwrap DDP

    def sharded_writer(self) -> str | None:
        """The sharded checkpoint kind this run saves ("xla-spmd", "fsdp2"), or None: saved whole in one file."""
        return self.trainer.backend.sharded_writer(self._unwrapped())

    def state_dict(self) -> dict:
        t = self.trainer
        model = self._unwrapped()
        model_sd, optimizer_sd = t.backend.state_dicts(model, t.optimizer)  # whole, under any sharding
        return {**self._small_state(),
                **t.backend.to_cpu({"model": _model_state(t, model, model_sd), "optimizer": optimizer_sd})}

    def load_state(self, state: dict) -> None:
        t = self.trainer
        model = self._unwrapped()
        handle = state.get("sharded")
        if handle is not None and handle.writer == self.sharded_writer():
            # Same kind of sharded run (any chip count): DCP reads each device's part in place.
            template = t.backend.sharded_tensors(model, t.optimizer)
            template["model"] = _model_state(t, model, template["model"])
            handle.load_into(template, t.backend.dcp_planner(save=False))
            t.backend.load_sharded_tensors(model, t.optimizer, template, strict=not t.save_trainable_only)
        else:
            if handle is not None:  # saved sharded, resumed unsharded (or by another writer): whole, on the CPU
                state = {**state, **handle.read_whole()}
            if t.save_trainable_only:  # LoRA: only the adapters were saved
                _load_trainable(model, state["model"])
                t.optimizer.load_state_dict(state["optimizer"])
            else:
                t.backend.load_state_dicts(model, t.optimizer, state["model"], state["optimizer"])
        t.backend.after_load(t.model, t.optimizer)
        t.load_progress_state(state)

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
        if not self.trainer.backend.is_main:
            return
        best = self.best()
        if best != self._recorded_best:
            self._recorded_best = best
            self.manager.write_run_info(self._run_info())

    def _metrics_at(self, step: int) -> dict:
        """The validation metrics recorded at `step` (the loss and what eval callbacks added), for the manifest."""
        record = next((e for e in reversed(self.trainer.history.eval) if e["step"] == step), None)
        return {k: v for k, v in (record or {}).items() if k != "step"}

    def checkpoint_weights(self, step: int) -> dict:
        """The model weights checkpoint `step` holds, whole on the CPU (the trainable ones under LoRA), under the
        plain model's names: what an export of that step writes. Reads no optimizer state from a sharded one."""
        state = self.manager.load(step, mmap=True)  # a .pt's optimizer state stays on disk
        handle = state.get("sharded")
        return handle.read_whole(parts=("model",))["model"] if handle is not None else state["model"]

    def save(self) -> Path | None:
        """Save a checkpoint unless the run diverged (then the good checkpoints stay as they are): a stop on a
        nan/inf or a loss spike saves nothing more, and non-finite weights are never saved."""
        t = self.trainer
        if t.diverged is not None:
            return None  # stopping on a divergence: the weights are not worth a checkpoint slot
        writer = self.sharded_writer()
        meta = {"epoch": t.epoch, "metrics": self._metrics_at(t.step)}

        def save_here() -> tuple[Path | None, list[str]]:
            if writer is not None:
                saved = self._save_sharded(writer, meta)
                return (None, saved) if isinstance(saved, list) else (saved, [])
            state = self.state_dict()
            bad = finite.nonfinite_tensors(state["model"])
            return None if bad else self.manager.save(t.step, state, meta=meta), bad

        # Every process learns whether the save worked: the main one failing alone (a full disk on host 0 of a
        # pod) must not leave the others waiting at their next collective.
        saved, bad = agreed(save_here, t.backend.gather_objects)
        if bad:
            t.on_divergence(f"the weights hold nan/inf at step {t.step} ({', '.join(bad[:3])}"
                            f"{', ...' if len(bad) > 3 else ''})")
            return None
        self.last_path = saved
        self._record_best()
        return self.last_path

    def _save_sharded(self, writer: str, meta: dict) -> Path | list[str]:
        """A sharded checkpoint: each process writes its devices' shards (no gather onto one host)."""
        t = self.trainer
        model = self._unwrapped()
        tensors = t.backend.sharded_tensors(model, t.optimizer)
        tensors["model"] = _model_state(t, model, tensors["model"])  # LoRA: the adapters only
        planner = sharded.finite_checking(type(t.backend.dcp_planner(save=True)))()

        def write(directory: Path) -> list[str]:
            bad = sharded.write(directory, tensors, planner)
            return [name.removeprefix("model.") for name in bad if not name.startswith("optimizer.")] or bad

        size = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + AdamW moments
        return self.manager.save_sharded(t.step, self._small_state(), write, writer=writer, size=size,
                                         gather=t.backend.gather_objects, meta=meta)

    def report(self, start_step: int, seconds: float) -> RunReport:
        t = self.trainer
        steps = t.step - start_step
        evals = t.history.eval
        trains = t.history.train
        return RunReport(
            device=t.backend.status(),
            steps=t.step,
            steps_this_run=steps,
            resumed_from=self.resumed_from,
            seconds=seconds,
            tokens_per_step=t.tokens_per_step,
            tokens_per_s=steps * t.tokens_per_step / seconds if seconds > 0 else 0.0,
            steps_per_s=steps / seconds if seconds > 0 else 0.0,
            first_val_loss=evals[0]["val_loss"] if evals else None,
            final_val_loss=evals[-1]["val_loss"] if evals else None,
            final_train_loss=trains[-1]["loss"] if trains else None,
            checkpoint=str(self.last_path) if self.last_path else None,
            parameters=sum(p.numel() for p in t.raw_model.parameters()),
            precision=t.backend.precision,
            xla=t.backend.run_metrics(),
            memory=t.backend.memory_info(),
            stop_reason=t.stop_reason,
            resume_changes=list(self.resume_changes),
            best_checkpoint=self.best(),
        )


def _model_state(trainer: Trainer, model, state: dict) -> dict:
    """The model's state dict `state`; with `trainer.save_trainable_only` (LoRA) only the trainable weights.

    `state` has the plain names (FSDPv2's state-dict hooks drop its "_orig_module." level) while the wrapped
    model's parameters carry that level: compare plain with plain, or under fsdp no adapter weight is kept."""
    if trainer.save_trainable_only:
        names = trainable_names(model)
        state = {k: v for k, v in state.items() if k in names}
    return state


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
