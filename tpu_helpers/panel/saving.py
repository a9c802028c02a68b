"""The tuning notebook's glue: a panel from its parameters, and its results written to disk.

    panel = panel_from_config(config)                 # config: th.config_from_parameters(...)
    save_tuning_results(panel, "runs/batch_size_tuning", device=backend.status())
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tpu_helpers.panel.tuning import TuningPanel


def panel_from_config(config) -> TuningPanel:
    """A panel from a notebook's validated TrainConfig (``config.extra`` holds the tuning-only parameters)."""
    ex = config.extra
    return TuningPanel(preset=config.preset, seq_len=config.seq_len, batch_size=config.batch_size,
                       grad_accum=config.grad_accum, precision=config.precision, pure_bf16=ex.get("pure_bf16", False),
                       gradient_checkpointing=config.gradient_checkpointing, optimizer=config.optimizer,
                       hardware=ex.get("hardware", "v5e"), chips=ex.get("chips", 8), sharding=config.sharding,
                       mfu=ex.get("mfu", 0.4), steps=config.steps, safety_margin=ex.get("safety_margin", 0.1))


def save_tuning_results(panel: TuningPanel, out_dir: str, **extra: Any) -> Path:
    """Write ``results.json`` (the panel's figures, the probe's if run, ``extra``) and ``memory.png``, atomically,
    into ``out_dir`` and, under ``python -m tpu_helpers run``, the run's directory."""
    from tpu_helpers.training.results import write_results

    results = {**panel.result(), "verdict": panel.verdict(), "warnings": panel.warnings(),
               "suggestion": dataclasses.asdict(s) if (s := panel.suggestion()) else None,
               "probe": panel.probe_result.to_dict() if panel.probe_result else None, **extra}
    return write_results(out_dir, results, figure=panel.figure(), figure_name="memory.png")
