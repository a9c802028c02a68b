"""tpu_helpers: train PyTorch models on Google TPUs from notebooks, with the same code on a CUDA GPU or the CPU.

    import tpu_helpers as th
    backend = th.get_backend("auto")            # TPU -> CUDA -> CPU
    print(backend.status())
    run = th.train_gpt(th.TrainConfig(preset="tiny", steps=200, seq_len=64, batch_size=16))
    print(run.report)

Modules: `backend` (devices; the only place torch_xla is imported), `config` (TrainConfig and notebook
parameters), `data`, `model` (a small GPT), `trainer` (the loop), `checkpoint`, `history`, `recipes`, `runner`
(papermill batch runs: `python -m tpu_helpers run NOTEBOOK`).
"""

from tpu_helpers.backend import DEVICES, Backend, BackendUnavailable, get_backend
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig, config_from_parameters
from tpu_helpers.data import build_datasets, load_text, make_loader
from tpu_helpers.hardware import CATALOG, HardwareSpec, format_bytes, lookup
from tpu_helpers.history import History, RunReport
from tpu_helpers.model import GPT, PRESETS, GPTConfig, gpt_config, sample_text
from tpu_helpers.recipes import GptRun, build_gpt_run, save_results, train_gpt
from tpu_helpers.trainer import Trainer, fit

__version__ = "0.1.0"

__all__ = [
    "CATALOG", "DEVICES", "GPT", "PRESETS", "Backend", "BackendUnavailable", "CheckpointManager", "ConfigError",
    "GPTConfig", "GptRun", "HardwareSpec", "History", "RunReport", "TrainConfig", "Trainer", "build_datasets",
    "build_gpt_run", "config_from_parameters", "fit", "format_bytes", "get_backend", "gpt_config", "load_text",
    "lookup", "make_loader", "sample_text", "save_results", "train_gpt",
]
