"""Distillation: a student trained against a frozen teacher run in every step, or against a cache of the
teacher's top-k written once; the settings, the losses, the teacher's top-k and the two trainers.

    settings = DistillSettings(temperature=2.0, alpha=0.5)           # checked once, taken whole by the trainers
    trainer = DistillTrainer(student, train, val, config=cfg, teacher=teacher, settings=settings)
    cache = open_teacher_cache(path, identity, backend=backend, rows=train, k=128, temperature=1.0,
                               batch_size=16, load_teacher=load)     # opened, or built from the teacher when missing
    trainer = CachedDistillTrainer(student, cache.attach(train), val, config=cfg, settings=settings)

Both mix the hard-label loss with the soft one, alpha * CE + (1 - alpha) * T^2 * KL(teacher || student), summed
over target tokens and averaged over the step's target tokens (`sft.CausalLMTrainer`); validation is the student's
own next-token loss. The cached KL is over k + 1 buckets, the teacher's k tokens and the rest of the vocabulary as
one tail, exact on both sides: docs/algorithms/distillation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.algorithms.sft import CausalLMTrainer, lm_logits
from tpu_helpers.config import ConfigError
from tpu_helpers.data.teacher_cache import TeacherCache, build_teacher_cache, cache_status
from tpu_helpers.diagnostics.safe_ops import xla_safe_kl_div
from tpu_helpers.models import lm_head, lora
from tpu_helpers.training.batches import causal_lm_loss_sum

TEACHER_KEYS = ("teacher_ids", "teacher_logp", "teacher_tail")
ROWS_PER_SHARD = 256  # 256 MiB per shard at 1024 tokens x top-128 in float32: one file per chip's share and more


@dataclass(frozen=True)
class DistillSettings:
    """The distillation loss's settings, checked once here. Also notebook parameters of the fine-tuning recipe:
    `recipes.finetune.FinetuneConfig` takes each field as its own, prefixed (DISTILL_TEMPERATURE, ...)."""

    temperature: float = 2.0  # T, the softmax temperature of the soft loss
    alpha: float = 0.5  # the hard-label loss's weight; the soft loss gets 1 - alpha

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ConfigError(f"distill_temperature={self.temperature!r} must be a finite number > 0")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"distill_alpha={self.alpha!r} must be between 0 and 1")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "alpha", float(self.alpha))

    def mix(self, hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        """alpha * hard-label loss + (1 - alpha) * soft loss (the soft one already scaled by T^2)."""
        return self.alpha * hard + (1.0 - self.alpha) * soft


def check_same_vocab(student: torch.nn.Module, teacher: torch.nn.Module, teacher_name: str = "teacher") -> None:
    sv = student.get_output_embeddings().weight.shape[0]
    tv = teacher.get_output_embeddings().weight.shape[0]
    if sv != tv:
        raise ConfigError(f"TEACHER={teacher_name!r} has a vocabulary of {tv} tokens and the student {sv}; "
                          "distillation compares logits token by token, so both must share one tokenizer "
                          "(e.g. a larger model of the same family)")


def frozen_teacher(teacher: torch.nn.Module, backend: Any) -> torch.nn.Module:
    """The teacher frozen, in eval mode, bf16 where the backend computes in bf16, on the backend's device. Not a
    submodule of the student: its weights stay out of the optimizer and the checkpoints."""
    teacher.requires_grad_(False).eval()
    if backend.precision == "bf16":
        teacher = teacher.to(torch.bfloat16)
    return backend.move_model(teacher)


def teacher_topk(logits: torch.Tensor, k: int, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (..., k) int32, log-probabilities (..., k), log of the remaining mass (...)) at temperature T.

    The remaining mass is the log-sum-exp of the other tokens' log-probabilities (exact, not 1 - sum, which loses
    a tail below float32's resolution); -inf when k is the whole vocabulary.
    """
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ConfigError(f"TEACHER_TOP_K={k} must be between 1 and the vocabulary size {vocab}")
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
    kl = lm_head.topk_kl(logits[:, :-1].float() / t, ids[:, :-1], t_logp[:, :-1], t_tail[:, :-1])
    keep = labels[:, 1:] != -100
    return (kl * keep).sum() * (t * t)


class TeacherTopK:
    """The teacher on the backend as a `topk_fn` for `build_teacher_cache`: a batch of CPU rows in, the top-k out.

    Every batch has the builder's fixed shape, so on XLA one graph serves the whole cache; the results are read to
    the host once per batch (they are the product). The teacher is frozen, in eval mode, in bf16 where the backend
    computes in bf16.
    """

    def __init__(self, teacher: torch.nn.Module, backend: Any, *, k: int, temperature: float = 1.0) -> None:
        temperature = DistillSettings(temperature).temperature  # the one check of a temperature
        vocab = teacher.get_output_embeddings().weight.shape[0]
        if not isinstance(k, int) or not 1 <= k <= vocab:
            raise ConfigError(f"TEACHER_TOP_K={k!r} must be between 1 and the teacher's vocabulary of {vocab} tokens")
        self.backend, self.k, self.temperature = backend, k, temperature
        self.model = frozen_teacher(teacher, backend)

    @torch.no_grad()
    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.backend
        batch = b.to_device(batch)
        with b.autocast():
            logits = lm_logits(self.model, batch)
        out = teacher_topk(logits, self.k, self.temperature)
        b.sync()
        return b.to_cpu(out)


class DistillTrainer(CausalLMTrainer):
    """Loss = alpha * hard-label CE + (1 - alpha) * T^2 * soft CE against a frozen teacher, per target token."""

    def __init__(self, *args: Any, teacher: torch.nn.Module, settings: DistillSettings,
                 teacher_name: str = "teacher", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_same_vocab(self.raw_model, teacher, teacher_name)
        self.settings = settings
        self.teacher = frozen_teacher(teacher, self.backend)

    def loss_sum(self, batch: dict) -> torch.Tensor:
        chunked = lm_head.live_kd_sums(self.model, self.teacher, batch, self.settings.temperature,
                                       chunk=getattr(self, "loss_chunk", None))
        if chunked is not None:
            return self.settings.mix(*chunked)
        logits = lm_logits(self.model, batch)
        hard = causal_lm_loss_sum(logits, batch["labels"])
        with torch.no_grad():
            t_logits = lm_logits(self.teacher, batch)
        t = self.settings.temperature
        s_logp = torch.log_softmax(logits[:, :-1].float() / t, dim=-1)
        t_logp = torch.log_softmax(t_logits[:, :-1].float() / t, dim=-1)
        # Per position KL(teacher || student), summed over the vocabulary, kept only at target tokens.
        kl = xla_safe_kl_div(s_logp, t_logp, reduction="none", log_target=True).sum(-1)
        soft = (kl * (batch["labels"][:, 1:] != -100)).sum() * (t * t)
        return self.settings.mix(hard, soft)


class CachedDistillTrainer(CausalLMTrainer):
    """Loss = alpha * hard-label CE + (1 - alpha) * T^2 * top-k KL against the cached teacher, per target token.

    Training batches carry `teacher_ids`, `teacher_logp`, `teacher_tail` (`TeacherCache.attach`); batches without
    them (validation) get the hard-label loss alone.
    """

    def __init__(self, *args: Any, settings: DistillSettings, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings

    def loss_sum(self, batch: dict) -> torch.Tensor:
        if "teacher_ids" not in batch:
            return CausalLMTrainer.loss_sum(self, batch)
        vocab = getattr(self, "raw_model", self.model).get_output_embeddings().weight.shape[0]
        if batch["teacher_ids"].shape[-1] > vocab:
            raise ConfigError(f"the teacher cache has top-{batch['teacher_ids'].shape[-1]} per position, more than "
                              f"the student's vocabulary of {vocab} tokens: it was made for another tokenizer")
        chunked = lm_head.cached_kd_sums(self.model, batch, self.settings.temperature,
                                         chunk=getattr(self, "loss_chunk", None))
        if chunked is not None:
            return self.settings.mix(*chunked)
        logits = lm_logits(self.model, batch)
        hard = causal_lm_loss_sum(logits, batch["labels"])
        soft = topk_kd_sum(logits, batch["teacher_ids"], batch["teacher_logp"], batch["teacher_tail"],
                           batch["labels"], self.settings.temperature)
        return self.settings.mix(hard, soft)


def open_teacher_cache(path: str, identity: dict, *, backend: Any, rows: Any, k: int, temperature: float,
                       batch_size: int, load_teacher: Callable[[], torch.nn.Module] | None,
                       teacher_name: str = "") -> TeacherCache:
    """The teacher cache at `path`, checked against `identity` (`data.teacher_cache.cache_identity` of this run);
    built first from `load_teacher()` when missing or partial (see the module docstring). The teacher is a local
    here: once the cache is written nothing holds it, and training never does."""
    ignore: tuple[str, ...] = ()
    if cache_status(path) != "complete":
        if load_teacher is None:
            raise ConfigError(f"TEACHER_CACHE={path!r} holds no finished cache and TEACHER=None: give TEACHER (a model "
                              "with the student's tokenizer) to build it, or point TEACHER_CACHE to a built one")
        teacher = load_teacher()
        identity = {**identity, "teacher_hash": lora.base_fingerprint(teacher, teacher_name)["base_hash"]}
        topk = TeacherTopK(teacher, backend, k=k, temperature=temperature)
        del teacher
        if backend.is_main:
            build_teacher_cache(path, rows, topk, identity=identity, batch_size=batch_size,
                                rows_per_shard=ROWS_PER_SHARD)
        backend.barrier()
    else:
        ignore = ("teacher_hash",) + (() if teacher_name else ("teacher",))
    cache = TeacherCache(path)
    cache.check(identity, ignore=ignore)
    return cache
