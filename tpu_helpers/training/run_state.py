"""Saving and resuming a Trainer's whole state, and refusing to mix two runs in one directory.

A checkpoint holds the model, optimizer, scheduler, step, data position (epoch and samples of the global order
consumed) and every RNG stream, so a resumed run continues the same run, on any number of chips or processes that
keeps the global batch (per-chip batch x chips x accumulation). Checkpoints live in `<out_dir>/checkpoints/` and are written by
`tpu_helpers.checkpoint.CheckpointManager` (atomic, checksummed). `<out_dir>/checkpoints/run.json` records what
identifies the run (model, data, batch, seed); resuming with a different identity is an error rather than a
silent mix of two runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.sharding import model_class_name
from tpu_helpers.training.validation import check_out_dir

if TYPE_CHECKING:
    from tpu_helpers.training.trainer import Trainer

# Fields that define which run a checkpoint belongs to. Steps, logging and evaluation may change on resume.
# The batch enters as the global batch (recorded separately), so the chip count may change between runs.
IDENTITY_FIELDS = ("preset", "dataset", "text_field", "tokenizer", "max_chars", "seq_len", "val_fraction",
                   "optimizer", "seed")


class RunState:
    def __init__(self, trainer: Trainer, *, run_identity: dict | None = None) -> None:
        self.trainer = trainer
        cfg = trainer.config
        self.directory = Path(cfg.out_dir) / "checkpoints"
        self.manager = CheckpointManager(self.directory, keep_last=cfg.keep_last, is_main=trainer.backend.is_main)
        model = trainer.raw_model
        self.identity = {
            **{k: getattr(cfg, k) for k in IDENTITY_FIELDS},
            "global_batch": cfg.batch_size * trainer.backend.num_replicas * cfg.grad_accum,
            "model": model_class_name(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            **(run_identity or {}),
        }
        self.resumed_from: int | None = None
        self.last_path: Path | None = None

    def _check_identity(self) -> None:
        stored = self.manager.read_run_info()
        if stored is None:
            return
        # Keys an older run.json lacks are not compared, so its checkpoints stay resumable.
        diff = {k: (stored[k], v) for k, v in self.identity.items() if k in stored and stored[k] != v}
        if diff:
            details = ", ".join(f"{k}: {old!r} there vs {new!r} now" for k, (old, new) in sorted(diff.items()))
            hint = (" (global_batch = batch_size x chips x grad_accum: keep it to resume on another number of "
                    "chips, e.g. batch_size = global_batch / (chips x grad_accum))" if "global_batch" in diff else "")
            raise ConfigError(
                f"out_dir={str(self.trainer.config.out_dir)!r} holds checkpoints of a different run ({details}){hint}; "
                "choose another out_dir, or delete that directory to start over"
            )

    def resume_or_start(self) -> None:
        t = self.trainer
        if t.backend.is_main:
            check_out_dir(t.config.out_dir)  # now, not at the first save an hour into the run
        self._check_identity()
        latest = self.manager.latest()
        if latest is not None and not t.config.resume:
            raise ConfigError(
                f"out_dir={str(t.config.out_dir)!r} already holds checkpoints (newest: step {latest.step}) and "
                "resume=False; pass resume=True to continue that run, or choose another out_dir"
            )
        if t.backend.is_main:
            self.manager.write_run_info(self.identity)
        if latest is None or not t.config.resume:
            t.backend.manual_seed(t.config.seed)
            return
        loaded = self.manager.load_latest()
        if loaded is None:
            t.backend.manual_seed(t.config.seed)
            return
        step, state = loaded
        self.load_state(state)
        self.resumed_from = step

    def state_dict(self) -> dict:
        t = self.trainer
        model = getattr(t.model, "module", t.model)  # unwrap DDP
        model_sd, optimizer_sd = t.backend.state_dicts(model, t.optimizer)  # whole, under any sharding
        return t.backend.to_cpu({
            "step": t.step,
            "epoch": t.epoch,
            "samples_in_epoch": t.samples_in_epoch,
            "model": model_sd,
            "optimizer": optimizer_sd,
            "scheduler": t.scheduler.state_dict(),
            "rng": t.backend.rng_state(),
            "history": t.history.to_dict(),
            "config": t.config.to_dict(),
        })

    def load_state(self, state: dict) -> None:
        t = self.trainer
        t.backend.load_state_dicts(getattr(t.model, "module", t.model), t.optimizer, state["model"],
                                   state["optimizer"])
        t.scheduler.load_state_dict(state["scheduler"])
        t.backend.after_load(t.model, t.optimizer)
        t.step, t.epoch = state["step"], state["epoch"]
        t.samples_in_epoch = state["samples_in_epoch"]
        t.history = History.from_dict(state["history"])
        t.history.truncate(t.step)
        t.backend.set_rng_state(state["rng"])

    def save(self) -> Path:
        t = self.trainer
        self.last_path = self.manager.save(t.step, self.state_dict(), meta={"epoch": t.epoch})
        t.backend.barrier()
        return self.last_path

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
            xla={**t.backend.metrics(), "compile_cache_dir": getattr(t.backend, "compile_cache_dir", None)}
            if t.backend.is_xla else {},
            memory=t.backend.memory_info(),
            stop_reason=t.stop_reason,
        )
