"""tpu_helpers: train PyTorch models on Google TPUs from notebooks, with the same code on a CUDA GPU or the CPU.

    import tpu_helpers as th
    config = th.TrainConfig(preset="tiny", steps=200, seq_len=64, batch_size=16)
    backend = th.backend_for(config)            # TPU -> CUDA -> CPU for device="auto"
    print(backend.status())
    job = th.train_gpt(config, backend=backend)
    print(job.report)

The package's parts, in the layer order `LAYERS` below: a part imports only parts of lower layers, at module level
or inside a function (tests/test_structure.py checks every import), so any part can be read, tested or replaced
with only the parts below it in mind:

    1. core                                   the torch-free leaves: atomic files, the accelerator catalog, the
                                              allowed values, SHARDING, the callback hooks, the pip extras
    2. config, agents                         TrainConfig and notebook parameters; tools, environments and tool-call
                                              formats in TRL's form
    3. backend                                devices and the runtime: the only owner of torch_xla and of the PJRT/XLA
                                              environment; placing a model for a SHARDING
    4. platform, diagnostics, data,           Colab, Kaggle, TPU VM: setup, presets, tested stacks; the XLA detector;
       checkpoint                             corpus, tokenizers, loaders, rows; crash-safe checkpoints
    5. models                                 the GPT, Hugging Face loading, generation, LoRA, QAT, the 4-bit base
    6. training                               the loop and what a run needs around it
    7. algorithms, memory                     SFT, distillation, GRPO, DPO and ORPO on the loop; memory plans, the probe
    8. recipes, panel, demos                  whole jobs; the batch-size panel; the XLA debugging notebook's loops
    9. launch                                 papermill runs, the CLI, multichip, pods, doctor

The names below load their module on first use (PEP 562), so `import tpu_helpers.core.hardware` or
`import tpu_helpers.config` stays light: neither starts torch_xla nor builds the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_helpers.core.lazy import lazy_exports

__version__ = "0.1.0"

# The layer order of the parts (see the module docstring); tests/test_structure.py holds every import to it.
LAYERS = (
    ("core",),
    ("config", "agents"),
    ("backend",),
    ("platform", "diagnostics", "data", "checkpoint"),
    ("models",),
    ("training",),
    ("algorithms", "memory"),
    ("recipes", "panel", "demos"),
    ("launch",),
)

# public name -> the module that defines it
_EXPORTS = {
    "CATALOG": "tpu_helpers.core.hardware", "HardwareSpec": "tpu_helpers.core.hardware", "format_bytes": "tpu_helpers.core.hardware",
    "lookup": "tpu_helpers.core.hardware",
    "DEVICES": "tpu_helpers.core.choices", "OPTIMIZERS": "tpu_helpers.core.choices", "PRECISIONS": "tpu_helpers.core.choices",
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
    "Callback": "tpu_helpers.core.callbacks",
    "Trainer": "tpu_helpers.training.trainer", "fit": "tpu_helpers.training.trainer",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from tpu_helpers.backend import Backend, BackendUnavailable, backend_for, get_backend  # noqa: F401
    from tpu_helpers.checkpoint import CheckpointManager  # noqa: F401
    from tpu_helpers.config import ConfigError, TrainConfig, config_from_parameters  # noqa: F401
    from tpu_helpers.core.callbacks import Callback  # noqa: F401
    from tpu_helpers.core.choices import DEVICES, OPTIMIZERS, PRECISIONS  # noqa: F401
    from tpu_helpers.core.hardware import CATALOG, HardwareSpec, format_bytes, lookup  # noqa: F401
    from tpu_helpers.data import build_datasets, load_text, make_loader  # noqa: F401
    from tpu_helpers.models.gpt import GPT, PRESETS, GPTConfig, gpt_config, sample_text  # noqa: F401
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig  # noqa: F401
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig  # noqa: F401
    from tpu_helpers.recipes.pretrain import Pretrain, train_gpt  # noqa: F401
    from tpu_helpers.training.cadence import Cadence  # noqa: F401
    from tpu_helpers.training.history import History, RunReport  # noqa: F401
    from tpu_helpers.training.results import write_results  # noqa: F401
    from tpu_helpers.training.trainer import Trainer, fit  # noqa: F401
