"""Trainers for causal language models fed dict batches (input_ids, attention_mask, labels): SFT and distillation.

    trainer = CausalLMTrainer(model, train, val, config=cfg)            # a Hugging Face AutoModelForCausalLM
    trainer = DistillTrainer(student, train, val, config=cfg, teacher=teacher, temperature=2.0, alpha=0.5)

Small overrides of `Trainer` (pytorch/xla-examples style), nothing else changes (XLA hygiene, resume, signals):
- the loss of an optimizer step is the sum of the token losses of all its micro-batches divided by the number of
  target tokens (labels != -100) in all of them, counted on the device: with gradient accumulation and uneven
  prompt lengths every target token weighs the same, as in one big batch; no host read;
- `DistillTrainer` adds a frozen teacher (bf16 on TPU, eval mode) and mixes the soft cross-entropy at temperature T,
  written with elementwise ops (`xla_safe_kl_div`: XLA has no kl_div kernel), with the hard-label loss, in the
  same compiled step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.diagnostics.safe_ops import xla_safe_kl_div
from tpu_helpers.training.batches import bad_batch, causal_lm_loss_sum, target_tokens
from tpu_helpers.training.trainer import Trainer


def _check_lm_batch(batch: Any) -> None:
    if not (isinstance(batch, dict) and "input_ids" in batch and "labels" in batch):
        raise bad_batch(batch, " (a causal LM trainer needs 'input_ids' and 'labels')")


class CausalLMTrainer(Trainer):
    """Token-averaged next-token loss over a whole optimizer step, for models returning `.logits`."""

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed token loss of one micro-batch (float32)."""
        # Packed rows (data/sft.py) carry position_ids and no attention mask: the model masks per example.
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                            position_ids=batch.get("position_ids")).logits
        return causal_lm_loss_sum(logits, batch["labels"])

    def compute_loss(self, batch: Any) -> torch.Tensor:
        _check_lm_batch(batch)
        return self.loss_sum(batch) / target_tokens(batch["labels"]).clamp(min=1)

    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.backend
        micro = [next(batches) for _ in range(self.config.grad_accum)]
        for batch in micro:
            _check_lm_batch(batch)
        # All micro-batches are on the device already (one graph per step): count their target tokens first.
        count = sum(target_tokens(batch["labels"]) for batch in micro).clamp(min=1).float()
        total = None
        for batch in micro:
            with b.autocast():
                loss = self.loss_sum(batch) / count
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        return total, self.apply_gradients()


def check_same_vocab(student: torch.nn.Module, teacher: torch.nn.Module, teacher_name: str = "teacher") -> None:
    sv = student.get_output_embeddings().weight.shape[0]
    tv = teacher.get_output_embeddings().weight.shape[0]
    if sv != tv:
        raise ConfigError(f"TEACHER={teacher_name!r} has a vocabulary of {tv} tokens and the student {sv}; "
                          "distillation compares logits token by token, so both must share one tokenizer "
                          "(e.g. a larger model of the same family)")


class DistillTrainer(CausalLMTrainer):
    """Loss = alpha * hard-label CE + (1 - alpha) * T^2 * soft CE against a frozen teacher, per target token."""

    def __init__(self, *args: Any, teacher: torch.nn.Module, temperature: float = 2.0, alpha: float = 0.5,
                 teacher_name: str = "teacher", **kwargs: Any) -> None:
        if not temperature > 0:
            raise ConfigError(f"temperature={temperature!r} must be > 0")
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha={alpha!r} must be between 0 and 1")
        super().__init__(*args, **kwargs)
        check_same_vocab(self.raw_model, teacher, teacher_name)
        self.temperature, self.alpha = float(temperature), float(alpha)
        teacher.requires_grad_(False).eval()
        if self.backend.precision == "bf16":
            teacher = teacher.to(torch.bfloat16)
        # Not a submodule of the student: its weights stay out of the optimizer and the checkpoints.
        self.teacher = self.backend.move_model(teacher)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch["labels"]
        pos = batch.get("position_ids")
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        hard = causal_lm_loss_sum(logits, labels)
        with torch.no_grad():
            t_logits = self.teacher(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        t = self.temperature
        s_logp = torch.log_softmax(logits[:, :-1].float() / t, dim=-1)
        t_logp = torch.log_softmax(t_logits[:, :-1].float() / t, dim=-1)
        # Per position KL(teacher || student), summed over the vocabulary, kept only at target tokens.
        kl = xla_safe_kl_div(s_logp, t_logp, reduction="none", log_target=True).sum(-1)
        soft = (kl * (labels[:, 1:] != -100)).sum() * (t * t)
        return self.alpha * hard + (1.0 - self.alpha) * soft
