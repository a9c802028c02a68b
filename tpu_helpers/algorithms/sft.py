"""Supervised fine-tuning of causal language models fed dict batches (input_ids, attention_mask, labels).

    trainer = CausalLMTrainer(model, train, val, config=cfg)            # a Hugging Face AutoModelForCausalLM

A small override of `Trainer` (pytorch/xla-examples style); nothing else changes (XLA hygiene, resume, signals).
The loss of an optimizer step is the sum of the token losses of all its micro-batches divided by the number of
target tokens (labels != -100) in all of them, counted on the device: with gradient accumulation and uneven prompt
lengths every target token weighs the same, as in one big batch; no host read. The distillation trainers
(`algorithms.distill`) change only `loss_sum`.

The loss is computed from the final hidden states in chunks of positions where the logits are large
(`models.lm_head`: LOSS_CHUNK, "auto" by default; `loss_chunk=0` here, or `set_loss_chunk(model, 0)`, for the
whole batch's logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tpu_helpers.models import lm_head
from tpu_helpers.training.batches import bad_batch, causal_lm_loss_sum, target_tokens
from tpu_helpers.training.step import StepFigures
from tpu_helpers.training.trainer import Trainer


def _check_lm_batch(batch: Any) -> None:
    if not (isinstance(batch, dict) and "input_ids" in batch and "labels" in batch):
        raise bad_batch(batch, " (a causal LM trainer needs 'input_ids' and 'labels')")


def lm_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's logits of a dict batch. Packed rows (data/sft.py) carry position_ids and no attention mask: the
    model masks per example."""
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                 position_ids=batch.get("position_ids")).logits


class CausalLMTrainer(Trainer):
    """Token-averaged next-token loss over a whole optimizer step, for models returning `.logits`.

    `loss_chunk`: tokens per chunk of the loss (`models.lm_head`), "auto", 0 for none; None: the model's own
    setting (`lm_head.set_loss_chunk`, which the recipes make from LOSS_CHUNK), else "auto"."""

    def __init__(self, *args: Any, loss_chunk: int | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_chunk = None if loss_chunk is None else lm_head.check_loss_chunk(loss_chunk)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """Summed token loss of one micro-batch (float32)."""
        chunked = lm_head.lm_loss_sum(self.model, batch, chunk=getattr(self, "loss_chunk", None))
        if chunked is not None:
            return chunked
        return causal_lm_loss_sum(lm_logits(self.model, batch), batch["labels"])

    # config.replay_steps: `loss_sum` (whatever a subclass makes it: distillation's) is captured and replayed.
    replays_steps = True

    def _loss_sum(self, batch: dict) -> torch.Tensor:
        # type(self).loss_sum, not the bound method: the capture cache must not keep the trainer alive.
        return self.replayed(type(self).loss_sum, self, batch)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        _check_lm_batch(batch)
        return self._loss_sum(batch) / target_tokens(batch["labels"]).clamp(min=1)

    def micro_batches(self, batches: Iterator) -> list[dict]:
        """The step's grad_accum micro-batches, checked (on-policy distillation puts the student's answers in
        some)."""
        micro = [next(batches) for _ in range(self.config.grad_accum)]
        for batch in micro:
            _check_lm_batch(batch)
        return micro

    def train_step(self, batches: Iterator) -> StepFigures:
        b = self.backend
        micro = self.micro_batches(batches)
        # All micro-batches are on the device already (one graph per step): count their target tokens first.
        count = sum(target_tokens(batch["labels"]) for batch in micro).clamp(min=1).float()
        total = None
        for batch in micro:
            with b.autocast():
                loss = self._loss_sum(batch) / count
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        return StepFigures(total, self.apply_gradients())
