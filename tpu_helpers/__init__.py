"""tpu_helpers: train PyTorch models on Google TPUs from notebooks, with the same code on a CUDA GPU or the CPU.

    import tpu_helpers as th
    config = th.TrainConfig(preset="tiny", steps=200, seq_len=64, batch_size=16)
    backend = th.backend_for(config)            # TPU -> CUDA -> CPU for device="auto"
    print(backend.status())
    job = th.train_gpt(config, backend=backend)
    print(job.report)

Parts by role, in their layer order: each part imports only parts listed before it, at module level or inside a
function (tests/test_structure.py checks every import), so any part can be read, tested or replaced with only the
parts below it in mind:

    1. atomic_io, hardware, choices, sharding, callbacks,  leaves: files never half-written, the accelerator catalog,
       extras                                              the allowed values, the SHARDING value and its mesh, the
                                                           hooks a run calls (no torch at import but `callbacks`' types),
                                                           the pip extras and the error that names a missing one
    2. config                                              TrainConfig and notebook parameters
    3. backend                                             devices and the runtime: the only owner of torch_xla and
                                                           of the PJRT/XLA environment; placing a model for a SHARDING
    4. targets, diagnostics, data, checkpoint              platform presets; the XLA detector, safe ops, debug logs;
                                                           corpus, tokenizers, loaders, SFT rows; crash-safe files
    5. models                                              the GPT, Hugging Face loading and generation, LoRA
    6. training                                            the loop and what a run needs around it
    7. algorithms, memory                                  SFT, distillation, GRPO and rewards, DPO and ORPO (each
                                                           on the loop, its settings one checked object); estimates and
                                                           the probe (of the trainer's step)
    8. recipes, panel                                      whole jobs: GPT pretraining, the Hugging Face job and its
                                                           siblings fine-tuning, GRPO and preference tuning
                                                           (DPO, ORPO), the XLA demo; the batch-size tuning panel
    9. launch                                              papermill runs, CLI, platform setup, multichip, doctor

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
    "DEVICES": "tpu_helpers.choices", "OPTIMIZERS": "tpu_helpers.choices", "PRECISIONS": "tpu_helpers.choices",
    "Backend": "tpu_helpers.backend", "BackendUnavailable": "tpu_helpers.backend", "get_backend": "tpu_helpers.backend",
    "backend_for": "tpu_helpers.backend",
    "CheckpointManager": "tpu_helpers.checkpoint",
    "ConfigError": "tpu_helpers.config", "TrainConfig": "tpu_helpers.config",
    "build_datasets": "tpu_helpers.data", "load_text": "tpu_helpers.data", "make_loader": "tpu_helpers.data",
    "config_from_parameters": "tpu_helpers.config",
    "GPT": "tpu_helpers.models.gpt", "PRESETS": "tpu_helpers.models.gpt", "GPTConfig": "tpu_helpers.models.gpt",
    "gpt_config": "tpu_helpers.models.gpt", "sample_text": "tpu_helpers.models.gpt",
    "History": "tpu_helpers.training.history", "RunReport": "tpu_helpers.training.history",
    "Cadence": "tpu_helpers.training.cadence", "write_results": "tpu_helpers.training.results",
    "Pretrain": "tpu_helpers.recipes.pretrain", "train_gpt": "tpu_helpers.recipes.pretrain",
    "Finetune": "tpu_helpers.recipes.finetune", "FinetuneConfig": "tpu_helpers.recipes.finetune",
    "GRPO": "tpu_helpers.recipes.grpo", "GRPOConfig": "tpu_helpers.recipes.grpo",
    "Preference": "tpu_helpers.recipes.preference", "PreferenceConfig": "tpu_helpers.recipes.preference",
    "Callback": "tpu_helpers.callbacks",
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
    from tpu_helpers.callbacks import Callback  # noqa: F401
    from tpu_helpers.checkpoint import CheckpointManager  # noqa: F401
    from tpu_helpers.choices import DEVICES, OPTIMIZERS, PRECISIONS  # noqa: F401
    from tpu_helpers.config import ConfigError, TrainConfig, config_from_parameters  # noqa: F401
    from tpu_helpers.data import build_datasets, load_text, make_loader  # noqa: F401
    from tpu_helpers.hardware import CATALOG, HardwareSpec, format_bytes, lookup  # noqa: F401
    from tpu_helpers.models.gpt import GPT, PRESETS, GPTConfig, gpt_config, sample_text  # noqa: F401
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig  # noqa: F401
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig  # noqa: F401
    from tpu_helpers.recipes.pretrain import Pretrain, train_gpt  # noqa: F401
    from tpu_helpers.training.cadence import Cadence  # noqa: F401
    from tpu_helpers.training.history import History, RunReport  # noqa: F401
    from tpu_helpers.training.results import write_results  # noqa: F401
    from tpu_helpers.training.trainer import Trainer, fit  # noqa: F401
