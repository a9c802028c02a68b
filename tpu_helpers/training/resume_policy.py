"""What a setting does on resume: part of the run's identity (a change is refused) or applied from the resume step.

Each TrainConfig field is in exactly one group (the resume table on docs/guides/preemption.md lists them):

- IDENTITY_FIELDS: what the checkpoints are *of* (model, data, tokenization, optimizer kind, seed, global batch).
  Resuming with another value is refused, naming the old and the new value (`RunState._check_identity`).
- APPLIED_ON_RESUME: optimisation settings a user changes on purpose (a lower lr, more steps). They apply from
  the resume step: the learning-rate schedule is rebuilt from this run's config there, and `apply_changes` puts a
  new weight decay into the restored optimizer and returns lines for the report, e.g. "lr 0.003 -> 3e-05 from
  step 20".
- TAKES_EFFECT: everything else (logging, evaluation, saving, device, precision, batch split, paths, the divergence
  and best-checkpoint settings) simply takes effect. The divergence rule compares with the run's history, which
  the checkpoint restores, so a resumed run judges a spike against the same readings; the best checkpoint is read
  from the checkpoints' manifests, so a changed `best_metric` ranks them anew.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tpu_helpers.training.optimizers import warmup_cosine

IDENTITY_FIELDS = ("preset", "dataset", "text_field", "tokenizer", "max_chars", "seq_len", "val_fraction",
                   "optimizer", "seed")
APPLIED_ON_RESUME = ("lr", "weight_decay", "steps", "warmup_steps", "min_lr_ratio", "grad_clip")
TAKES_EFFECT = ("device", "fallback", "precision", "spmd", "sharding", "gradient_checkpointing", "batch_size",
                "grad_accum", "eval_every", "eval_batches", "log_every", "out_dir", "save_every", "keep_last", "resume",
                "on_nonfinite", "on_divergence", "divergence_factor", "best_metric", "compile_cache_dir",
                "xla_checks", "replay_steps", "trackers", "project", "run_name", "extra")


def same_dataset(old: Any, new: Any) -> bool:
    """run.json values of "dataset": equal, or an older run's relative path that resolves to the same place."""
    if old == new:
        return True
    return isinstance(old, str) and isinstance(new, str) and Path(old).expanduser().resolve() == Path(new)


def mismatched_identity(stored: dict, identity: dict) -> dict[str, tuple[Any, Any]]:
    """{field: (old, new)} for identity values that differ (keys an older run.json lacks are not compared)."""
    diff = {}
    for key, new in identity.items():
        if key not in stored:
            continue
        old = stored[key]
        if key == "dataset" and same_dataset(old, new):
            continue
        if old != new:
            diff[key] = (old, new)
    return diff


def checkpoint_config_mismatch(old_config: Any, config: Any) -> list[str]:
    """Identity fields where the config stored inside a checkpoint differs from this run's (dataset aside:
    its spelling may differ for the same data, which run.json's fingerprint covers)."""
    if not isinstance(old_config, dict):
        return []
    return [f"{k} {old_config[k]!r} there vs {getattr(config, k)!r} now" for k in IDENTITY_FIELDS
            if k != "dataset" and k in old_config and old_config[k] != getattr(config, k)]


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else repr(value)


def apply_changes(config: Any, optimizer: Any, step: int, old_config: Any) -> list[str]:
    """Apply APPLIED_ON_RESUME settings of `config` that differ from the checkpoint's (`old_config`, the dict it
    stored) to the restored `optimizer` at the resume `step`; returns one line per change.

    The learning rate follows by itself: the trainer rebuilds its schedule from this run's config at the resume
    step (`Trainer.load_progress_state`), so `optimizer`'s lr is already the new one. Weight decay lives in the
    optimizer's param groups, which the checkpoint restored with the old value: the decayed groups get the new one.
    `grad_clip` is read every step.
    """
    if not isinstance(old_config, dict):
        return []
    cfg = config
    changed = [k for k in APPLIED_ON_RESUME if k in old_config and old_config[k] != getattr(cfg, k)]
    if not changed:
        return []
    lines = [f"{k} {_fmt(old_config[k])} -> {_fmt(getattr(cfg, k))} from step {step}" for k in changed]
    if "weight_decay" in changed:
        old_wd = old_config["weight_decay"]
        for i, group in enumerate(optimizer.param_groups):
            # The decayed groups carry the configured value; no-decay groups (biases, norms) stay at 0.
            if group.get("weight_decay") == old_wd and (old_wd != 0 or i == 0):
                group["weight_decay"] = cfg.weight_decay
    schedule = ("lr", "warmup_steps", "steps", "min_lr_ratio")
    if all(k in old_config for k in schedule):
        lr_before = old_config["lr"] * warmup_cosine(step, warmup=old_config["warmup_steps"],
                                                     total=old_config["steps"], min_ratio=old_config["min_lr_ratio"])
        lr_after = optimizer.param_groups[0]["lr"]
        if not math.isclose(lr_before, lr_after, rel_tol=1e-9):
            lines.append(f"learning rate at step {step}: {lr_before:.3g} -> {lr_after:.3g} (the schedule now runs "
                         f"to step {cfg.steps}, warmup {cfg.warmup_steps}, down to {cfg.min_lr_ratio:g} x lr)")
    return lines
