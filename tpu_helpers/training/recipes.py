"""Ready-made runs built from a TrainConfig: the package's GPT on a text dataset.

    run = train_gpt(TrainConfig(preset="tiny", steps=200, batch_size=16, seq_len=64, out_dir="runs/demo"))
    print(run.report); run.history.plot(); print(run.sample())

`build_gpt_run` does every step but training (backend, data, model, trainer), so a notebook can show the device
and the model size before it commits to a long run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend import Backend, backend_for
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.data import TokenBlocks, build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config, sample_text
from tpu_helpers.training.history import History, RunReport
from tpu_helpers.training.results import write_results
from tpu_helpers.training.trainer import Trainer


@dataclass
class GptRun:
    config: TrainConfig
    backend: Backend
    model: GPT
    tokenizer: Any
    train_data: TokenBlocks
    val_data: TokenBlocks
    trainer: Trainer
    report: RunReport | None = None
    extra_results: dict = field(default_factory=dict)

    @property
    def history(self) -> History:
        return self.trainer.history

    def sample(self, prompt: str = "Once upon a time", max_new_tokens: int = 200, **kwargs: Any) -> str:
        return sample_text(self.model, self.tokenizer, prompt, max_new_tokens=max_new_tokens,
                           device=self.backend.device, **kwargs)


def build_gpt_run(config: TrainConfig, *, backend: Backend | None = None, progress: bool = True) -> GptRun:
    backend = backend or backend_for(config)
    try:
        model_cfg = gpt_config(config.preset)
    except ValueError as err:
        raise ConfigError(f"preset: {err}") from None
    if config.seq_len > model_cfg.block_size:
        raise ConfigError(
            f"seq_len={config.seq_len} exceeds the context of preset {config.preset!r} "
            f"(block_size {model_cfg.block_size}); use seq_len <= {model_cfg.block_size} or a larger preset"
        )
    train, val, tokenizer = build_datasets(config.dataset, config.tokenizer, block_size=config.seq_len,
                                           val_fraction=config.val_fraction, seed=config.seed,
                                           max_chars=config.max_chars, text_field=config.text_field)
    # The same seed gives the same initial weights on every device (built on the CPU, then moved).
    torch.manual_seed(config.seed)
    model = GPT(gpt_config(config.preset, vocab_size=tokenizer.vocab_size, block_size=config.seq_len))
    trainer = Trainer(model, train, val, config=config, backend=backend, progress=progress,
                      run_identity={"vocab_size": tokenizer.vocab_size})
    return GptRun(config, backend, model, tokenizer, train, val, trainer)


def train_gpt(config: TrainConfig, *, backend: Backend | None = None, progress: bool = True) -> GptRun:
    run = build_gpt_run(config, backend=backend, progress=progress)
    run.report = run.trainer.fit()
    return run


def run_results(run: GptRun, **extra: Any) -> dict:
    """What `save_results` writes: the report, config, history and `extra` values of a finished run."""
    if run.report is None:
        raise RuntimeError("save_results() needs a finished run: call train_gpt() or run.trainer.fit() first")
    return {"report": run.report.to_dict(), "config": run.config.to_dict(), "history": run.history.to_dict(),
            **run.extra_results, **extra}


def save_results(run: GptRun, *, name: str = "results", **extra: Any) -> Path:
    """Write `<out_dir>/<name>.json` (report, config, final losses, extra values) and `loss.png`, atomically;
    on the main process only (host 0 of a pod, rank 0 under torchrun).

    When run by `python -m tpu_helpers run`, the same files are copied into that run's directory.
    """
    results = run_results(run, **extra)
    return write_results(run.config.out_dir, results, name=name, figure=run.history.figure(),
                         is_main=run.backend.is_main)
