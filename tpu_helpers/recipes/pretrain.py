"""Pretraining the package's GPT on text: the quickstart, the platform notebooks, `multichip` and the CLI.

    job = Pretrain(TrainConfig(preset="tiny", steps=200, batch_size=16, seq_len=64, out_dir="runs/demo"))
    print(job.backend.status(), job.plan().summary())     # the device, and the memory plan before anything compiles
    job.train(); job.history.plot(); print(job.sample()); print(job.report)
    job = train_gpt(config)                                # the same in one call

The settings are `TrainConfig`'s own (preset, dataset, tokenizer, seq_len, ...). The data, the tokenizer and the
model are made on first use; the same seed gives the same initial weights on every device (built on the CPU,
then moved).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from tpu_helpers.backend import Backend
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.hardware import HardwareSpec
from tpu_helpers.data import TokenBlocks, build_datasets
from tpu_helpers.memory.analytic import analytic_estimate
from tpu_helpers.memory.report import MemoryReport, memory_report
from tpu_helpers.models.gpt import GPT, GPTConfig, gpt_config, sample_text
from tpu_helpers.recipes.base import Recipe
from tpu_helpers.training.trainer import Trainer


class Pretrain(Recipe):
    """The GPT of `config.preset` trained on `config.dataset` (see the module docstring)."""

    def __init__(self, config: TrainConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        try:
            self.model_config: GPTConfig = gpt_config(config.preset)
        except ValueError as err:
            raise ConfigError(f"preset: {err}") from None
        if config.seq_len > self.model_config.block_size:
            raise ConfigError(
                f"seq_len={config.seq_len} exceeds the context of preset {config.preset!r} "
                f"(block_size {self.model_config.block_size}); use seq_len <= {self.model_config.block_size} or a "
                "larger preset"
            )

    def plan(self, hardware: str | HardwareSpec | None = None) -> MemoryReport:
        """One step's memory per chip (the analytic estimate of this GPT, data parallel) against the chip's HBM:
        this backend's chip, or `hardware` from the catalog. Reads no data and builds no model."""
        cfg = self.config
        cfg_model = gpt_config(cfg.preset, block_size=cfg.seq_len)
        attention = self.backend.attention_kind

        def estimate(b: int):
            return analytic_estimate(cfg_model, b, cfg.seq_len, precision=self.backend.precision,
                                     optimizer=cfg.optimizer, gradient_checkpointing=cfg.gradient_checkpointing,
                                     attention=attention, grad_accum=cfg.grad_accum)

        return memory_report(estimate, cfg.batch_size, hardware or self.backend.hardware)

    @cached_property
    def _datasets(self) -> tuple[TokenBlocks, TokenBlocks, Any]:
        cfg = self.config
        return build_datasets(cfg.dataset, cfg.tokenizer, block_size=cfg.seq_len, val_fraction=cfg.val_fraction,
                              seed=cfg.seed, max_chars=cfg.max_chars, text_field=cfg.text_field)

    @property
    def train_data(self) -> TokenBlocks:
        return self._datasets[0]

    @property
    def val_data(self) -> TokenBlocks:
        return self._datasets[1]

    @property
    def tokenizer(self) -> Any:
        return self._datasets[2]

    @cached_property
    def model(self) -> GPT:
        torch.manual_seed(self.config.seed)
        return GPT(gpt_config(self.config.preset, vocab_size=self.tokenizer.vocab_size, block_size=self.config.seq_len))

    def make_trainer(self) -> Trainer:
        return Trainer(self.model, self.train_data, self.val_data, run_identity={"vocab_size": self.tokenizer.vocab_size},
                       **self.trainer_options())

    def sample(self, prompt: str = "Once upon a time", max_new_tokens: int = 200, **kwargs: Any) -> str:
        return sample_text(self.model, self.tokenizer, prompt, max_new_tokens=max_new_tokens,
                           device=self.backend.device, **kwargs)


def train_gpt(config: TrainConfig, *, backend: Backend | None = None, progress: bool = True) -> Pretrain:
    """`Pretrain(config)` trained: the job with its model, history, report and `sample()`."""
    job = Pretrain(config, backend=backend, progress=progress)
    job.train()
    return job
