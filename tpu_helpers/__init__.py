"""tpu_helpers: train PyTorch models on Google TPUs from notebooks, with the same code on a CUDA GPU or the CPU.

    import tpu_helpers as th
    config = th.TrainConfig(preset="tiny", steps=200, seq_len=64, batch_size=16)
    backend = th.backend_for(config)            # TPU -> CUDA -> CPU for device="auto"
    print(backend.status())
    run = th.train_gpt(config, backend=backend)
    print(run.report)

Subpackages by role: `backend` (devices and the runtime; the only owner of torch_xla and of the PJRT/XLA
environment), `training` (the loop, callbacks, schedule, resume, signals, history, results), `data` (corpus,
tokenizers, loaders), `models` (the GPT), `diagnostics` (the XLA problem detector, safe ops, debug logs), `memory`
(estimates, the probe, the batch-size panel), `launch` (papermill runs, targets, CLI, platform setup, notebook
parameters). Top-level modules: `config` (TrainConfig), `choices` (allowed names), `checkpoint`, `hardware` (the
accelerator catalog).

The names below load their module on first use (PEP 562), so `import tpu_helpers.hardware` or
`import tpu_helpers.config` stays light: neither starts torch_xla nor builds the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "CATALOG": "tpu_helpers.hardware", "HardwareSpec": "tpu_helpers.hardware", "format_bytes": "tpu_helpers.hardware",
    "lookup": "tpu_helpers.hardware",
    "DEVICES": "tpu_helpers.choices", "PRECISIONS": "tpu_helpers.choices",
    "Backend": "tpu_helpers.backend", "BackendUnavailable": "tpu_helpers.backend", "get_backend": "tpu_helpers.backend",
    "backend_for": "tpu_helpers.backend",
    "CheckpointManager": "tpu_helpers.checkpoint",
    "ConfigError": "tpu_helpers.config", "TrainConfig": "tpu_helpers.config",
    "build_datasets": "tpu_helpers.data", "load_text": "tpu_helpers.data", "make_loader": "tpu_helpers.data",
    "config_from_parameters": "tpu_helpers.launch.params",
    "GPT": "tpu_helpers.models.gpt", "PRESETS": "tpu_helpers.models.gpt", "GPTConfig": "tpu_helpers.models.gpt",
    "gpt_config": "tpu_helpers.models.gpt", "sample_text": "tpu_helpers.models.gpt",
    "History": "tpu_helpers.training.history", "RunReport": "tpu_helpers.training.history",
    "Schedule": "tpu_helpers.training.schedule", "write_results": "tpu_helpers.training.results",
    "GptRun": "tpu_helpers.training.recipes", "build_gpt_run": "tpu_helpers.training.recipes",
    "save_results": "tpu_helpers.training.recipes", "train_gpt": "tpu_helpers.training.recipes",
    "Trainer": "tpu_helpers.training.trainer", "fit": "tpu_helpers.training.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpu_helpers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from tpu_helpers.backend import Backend, BackendUnavailable, backend_for, get_backend  # noqa: F401
    from tpu_helpers.checkpoint import CheckpointManager  # noqa: F401
    from tpu_helpers.choices import DEVICES, PRECISIONS  # noqa: F401
    from tpu_helpers.config import ConfigError, TrainConfig  # noqa: F401
    from tpu_helpers.data import build_datasets, load_text, make_loader  # noqa: F401
    from tpu_helpers.hardware import CATALOG, HardwareSpec, format_bytes, lookup  # noqa: F401
    from tpu_helpers.launch.params import config_from_parameters  # noqa: F401
    from tpu_helpers.models.gpt import GPT, PRESETS, GPTConfig, gpt_config, sample_text  # noqa: F401
    from tpu_helpers.training.history import History, RunReport  # noqa: F401
    from tpu_helpers.training.recipes import GptRun, build_gpt_run, save_results, train_gpt  # noqa: F401
    from tpu_helpers.training.results import write_results  # noqa: F401
    from tpu_helpers.training.schedule import Schedule  # noqa: F401
    from tpu_helpers.training.trainer import Trainer, fit  # noqa: F401
