"""tpu_helpers: train PyTorch models on Google TPUs from notebooks, with the same code on a CUDA GPU or the CPU.

    import tpu_helpers as th
    backend = th.get_backend("auto")            # TPU -> CUDA -> CPU
    print(backend.status())
    run = th.train_gpt(th.TrainConfig(preset="tiny", steps=200, seq_len=64, batch_size=16))
    print(run.report)

Subpackages by role: `backend` (devices and the runtime; the only owner of torch_xla), `training` (the loop,
callbacks, resume, signals, history), `data` (corpus, tokenizers, loaders), `models` (the GPT), `diagnostics` (the
XLA problem detector, safe ops, debug logs), `memory` (estimates, the probe, the batch-size panel), `launch`
(papermill runs, targets, CLI, platform setup, notebook parameters). Top-level modules: `config` (TrainConfig),
`checkpoint`, `hardware` (the accelerator catalog).
"""

from tpu_helpers.backend import DEVICES, Backend, BackendUnavailable, get_backend
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.data import build_datasets, load_text, make_loader
from tpu_helpers.hardware import CATALOG, HardwareSpec, format_bytes, lookup
from tpu_helpers.launch.params import config_from_parameters
from tpu_helpers.models.gpt import GPT, PRESETS, GPTConfig, gpt_config, sample_text
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.recipes import GptRun, build_gpt_run, save_results, train_gpt
from tpu_helpers.training.trainer import Trainer, fit

__version__ = "0.1.0"

__all__ = [
    "CATALOG", "DEVICES", "GPT", "PRESETS", "Backend", "BackendUnavailable", "CheckpointManager", "ConfigError",
    "GPTConfig", "GptRun", "HardwareSpec", "History", "RunReport", "TrainConfig", "Trainer", "build_datasets",
    "build_gpt_run", "config_from_parameters", "fit", "format_bytes", "get_backend", "gpt_config", "load_text",
    "lookup", "make_loader", "sample_text", "save_results", "train_gpt",
]
