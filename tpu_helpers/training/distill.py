"""Distillation from a cache of the teacher's top-k: the teacher's top-k of a batch, the loss, the trainer.

    topk = TeacherTopK(teacher, backend, k=128, temperature=1.0)     # a callable for data/teacher_cache.py
    cache = build_teacher_cache(path, train_rows, topk, identity=..., batch_size=16)
    trainer = CachedDistillTrainer(student, cache.attach(train_rows), val_rows, config=cfg, temperature=1.0)

The teacher runs once, over the data, instead of in every step: the step holds neither its weights nor its logits,
only k ids and log-probabilities per position (k = 128 of a 152k vocabulary is 0.08% of the teacher's logits).

The loss per target position is KL(teacher || student) over k + 1 buckets: the teacher's k tokens and the rest
of the vocabulary as one "tail" bucket. Teacher side: the cached log-probabilities at temperature T and the log of
its remaining mass, both exact. Student side: log_softmax(logits / T) gathered at the teacher's ids, and its own
tail log(1 - sum of those k probabilities). With k = the vocabulary this is the full-softmax KL of
`causal_lm.DistillTrainer` (the tail is empty and left out). Like that trainer it is mixed with the hard-label
loss: alpha * CE + (1 - alpha) * T^2 * KL, summed over target tokens, averaged over the step's target tokens.
Everything is gather, topk and elementwise ops, which XLA lowers (no kl_div kernel, no host read).

Validation batches carry no teacher: the trainer's validation loss is the student's own next-token loss, the
held-out figure to compare with the teacher's or with another run's.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.training.batches import causal_lm_loss_sum
from tpu_helpers.training.causal_lm import CausalLMTrainer

# log of the smallest tail mass the student's side keeps: below it (its top-k holds all the mass in float32) the
# log would be -inf and its gradient nan; the teacher's tail there is as small, so the term is ~0 either way.
_TAIL_FLOOR = 1e-30
TEACHER_KEYS = ("teacher_ids", "teacher_logp", "teacher_tail")


def teacher_topk(logits: torch.Tensor, k: int, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (..., k) int32, log-probabilities (..., k), log of the remaining mass (...)) at temperature T.

    The remaining mass is the log-sum-exp of the other tokens' log-probabilities (exact, not 1 - sum, which loses
    a tail below float32's resolution); -inf when k is the whole vocabulary.
    """
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ConfigError(f"TOP_K={k} must be between 1 and the vocabulary size {vocab}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    top, ids = logp.topk(k, dim=-1)
    if k == vocab:
        tail = torch.full_like(top[..., 0], float("-inf"))
    else:
        tail = logp.scatter(-1, ids, float("-inf")).logsumexp(-1)
    return ids.to(torch.int32), top, tail


def topk_kd_sum(logits: torch.Tensor, ids: torch.Tensor, t_logp: torch.Tensor, t_tail: torch.Tensor,
                labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum over target tokens of T^2 * KL(teacher's top-k + tail || student's), float32.

    `logits` (B, S, V) the student's; `ids`, `t_logp` (B, S, k) and `t_tail` (B, S) the teacher's at every
    position; position p predicts token p + 1, so positions up to S - 1 count where labels[:, 1:] != -100.
    """
    t = float(temperature)
    ids, t_logp, t_tail = ids[:, :-1].long(), t_logp[:, :-1].float(), t_tail[:, :-1].float()
    s_logp = torch.log_softmax(logits[:, :-1].float() / t, dim=-1)
    s_top = s_logp.gather(-1, ids)
    kl = (torch.exp(t_logp) * (t_logp - s_top)).sum(-1)
    if ids.shape[-1] < logits.shape[-1]:
        # The student's mass outside the teacher's k tokens, as log(1 - sum); floored so it stays finite.
        s_tail = torch.log((-torch.expm1(s_top.logsumexp(-1))).clamp(min=_TAIL_FLOOR))
        kl = kl + torch.exp(t_tail) * (t_tail - s_tail)
    keep = labels[:, 1:] != -100
    return (kl * keep).sum() * (t * t)


class TeacherTopK:
    """The teacher on the backend as a `topk_fn` for `build_teacher_cache`: a batch of CPU rows in, the top-k out.

    Every batch has the builder's fixed shape, so on XLA one graph serves the whole cache; the results are read to
    the host once per batch (they are the product). The teacher is frozen, in eval mode, in bf16 where the backend
    computes in bf16.
    """

    def __init__(self, teacher: torch.nn.Module, backend: Any, *, k: int, temperature: float = 1.0) -> None:
        if not temperature > 0:
            raise ConfigError(f"temperature={temperature!r} must be > 0")
        vocab = teacher.get_output_embeddings().weight.shape[0]
        if not isinstance(k, int) or not 1 <= k <= vocab:
            raise ConfigError(f"TOP_K={k!r} must be between 1 and the teacher's vocabulary of {vocab} tokens")
        teacher.requires_grad_(False).eval()
        if backend.precision == "bf16":
            teacher = teacher.to(torch.bfloat16)
        self.backend, self.k, self.temperature = backend, k, float(temperature)
        self.model = backend.move_model(teacher)

    @torch.no_grad()
    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.backend
        batch = b.to_device(batch)
        with b.autocast():
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch.get("position_ids")).logits
        out = teacher_topk(logits, self.k, self.temperature)
        b.sync()
        return b.to_cpu(out)


class CachedDistillTrainer(CausalLMTrainer):
    """Loss = alpha * hard-label CE + (1 - alpha) * T^2 * top-k KL against the cached teacher, per target token.

    Training batches carry `teacher_ids`, `teacher_logp`, `teacher_tail` (`TeacherCache.attach`); batches without
    them (validation) get the hard-label loss alone.
    """

    def __init__(self, *args: Any, temperature: float = 1.0, alpha: float = 0.5, **kwargs: Any) -> None:
        if not temperature > 0:
            raise ConfigError(f"temperature={temperature!r} must be > 0")
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha={alpha!r} must be between 0 and 1")
        super().__init__(*args, **kwargs)
        self.temperature, self.alpha = float(temperature), float(alpha)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                            position_ids=batch.get("position_ids")).logits
        hard = causal_lm_loss_sum(logits, batch["labels"])
        if "teacher_ids" not in batch:
            return hard
        vocab = logits.shape[-1]
        if batch["teacher_ids"].shape[-1] > vocab:
            raise ConfigError(f"the teacher cache has top-{batch['teacher_ids'].shape[-1]} per position, more than "
                              f"the student's vocabulary of {vocab} tokens: it was made for another tokenizer")
        soft = topk_kd_sum(logits, batch["teacher_ids"], batch["teacher_logp"], batch["teacher_tail"],
                           batch["labels"], self.temperature)
        return self.alpha * hard + (1.0 - self.alpha) * soft
