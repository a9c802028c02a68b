"""What a fine-tuning job writes when it is done: which weights (the best checkpoint's or the last), then the PEFT
adapter, the merged model and, under QAT, the quantized weights with their scales, each written atomically.

    taken, record = export_weights(config, trainer, model, "best")   # (checkpoint weights or None, what was taken)
    paths = write_exports(job, model, out_dir, merged=True, taken=taken)

`Finetune.export` (recipes/finetune.py) is the caller; these are its two halves, kept apart so the recipe stays a
readable list of parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.atomic_io import atomic_write_text
from tpu_helpers.choices import EXPORT_WEIGHTS, check_choice
from tpu_helpers.models import lora, qat


def export_weights(config: Any, trainer: Any, model: torch.nn.Module, choice: str) -> tuple[dict | None, dict]:
    """(checkpoint weights to export, or None for the live model's; what was taken, for finetune.json)."""
    check_choice("export", choice, EXPORT_WEIGHTS)
    step = trainer.step if trainer is not None else 0
    if choice == "best" and config.qat and not lora.is_peft(model):
        # Full QAT: the quantized and merged exports read the trained base from the live model.
        return None, {"weights": "last", "step": step, "asked": "best",
                      "why": "full fine-tuning under QAT exports the weights training ended with"}
    if choice == "best":
        best = trainer.state.best() if trainer is not None else None
        if best is not None:
            # The best is the last step: the live weights are the same, and need no read from disk.
            taken = trainer.state.checkpoint_weights(best["step"]) if best["step"] != step else None
            return taken, {"weights": "best", **best}
        metric = config.best_metric
        why = ("no training ran in this job" if trainer is None else "best_metric=None" if metric is None else
               f"no checkpoint recorded {metric} (no evaluation at a save step)")
        return None, {"weights": "last", "step": step, "asked": "best", "why": why}
    return None, {"weights": "last", "step": step}


def write_exports(job: Any, model: torch.nn.Module, out: Path, merged: bool, taken: dict | None) -> dict[str, str]:
    """Write the exports of `job` (a Finetune) from `model` (or the checkpoint weights `taken`) under `out`; returns
    their paths (empty on processes other than the main one, which still take part in reading the weights)."""
    cfg = job.config
    # Every process reads the weights to the host (on a pod a sharded tensor's read runs on all hosts); the
    # main one writes.
    state = lora.export_state(model, weights=taken) if merged or lora.is_peft(model) else {}
    raw = qat.base_state(model) if cfg.qat else None
    base_fq = qat.fake_quantized_state(model) if cfg.qat and merged else None
    if base_fq is not None and not lora.is_peft(model):
        state, base_fq = base_fq, None  # full QAT: the merged model is the fake-quantized weights
    job.backend.barrier()
    paths: dict[str, str] = {}
    if not job.backend.is_main:
        return paths
    if lora.is_peft(model):
        paths["adapter"] = str(lora.export_adapter(model, out / "adapter", state=state))
        job.tokenizer.save_pretrained(out / "adapter")
    if merged:
        paths["merged"] = str(lora.export_merged(model, job.tokenizer, out / "merged", base_source=job.source,
                                                 state=state, base_state=base_fq,
                                                 dtype=torch.bfloat16 if cfg.qat else torch.float32))
    if cfg.qat:
        paths["quantized"] = str(qat.export_quantized(model, job.tokenizer, out / "quantized", cfg.qat,
                                                      cfg.qat_group_size, state=raw))
    atomic_write_text(out / "finetune.json", json.dumps({**cfg.to_dict(), "paths": paths, "weights": job.exported},
                                                        indent=1, default=str))
    return paths
