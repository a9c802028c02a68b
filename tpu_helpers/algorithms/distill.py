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
one tail, exact on both sides. The live trainer is also on-policy distillation (TRL's GKD): in a share `lambda_` of
the micro-batches the student answers the prompts itself (the package's KV-cached generation, fixed shapes) and
learns the teacher's distribution on its own answers; `beta` makes the soft term a generalized Jensen-Shannon
divergence (0 forward KL, 1 reverse KL): docs/algorithms/distillation.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.algorithms.rollouts import sampling_key
from tpu_helpers.algorithms.sft import CausalLMTrainer, lm_logits
from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import warn_cut
from tpu_helpers.data.teacher_cache import TeacherCache, build_teacher_cache, cache_status
from tpu_helpers.models import lm_head, lora, quant4
from tpu_helpers.models.generation import Sampling, generate_ids
from tpu_helpers.training.batches import causal_lm_loss_sum

TEACHER_KEYS = ("teacher_ids", "teacher_logp", "teacher_tail")
ROWS_PER_SHARD = 256  # 256 MiB per shard at 1024 tokens x top-128 in float32: one file per chip's share and more


@dataclass(frozen=True)
class DistillSettings:
    """The distillation loss's settings, checked once here. Also notebook parameters of the fine-tuning recipe:
    `recipes.finetune.FinetuneConfig` takes each field as its own, prefixed (DISTILL_TEMPERATURE, ...)."""

    temperature: float = 2.0  # T, the softmax temperature of the soft loss
    alpha: float = 0.5  # the hard-label loss's weight; the soft loss gets 1 - alpha
    lambda_: float = 0.0  # share of micro-batches the student answers itself (0: the dataset's answers, 1: on-policy)
    beta: float = 0.0  # the soft term: 0 KL(teacher || student), 1 KL(student || teacher), between: generalized JSD

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ConfigError(f"distill_temperature={self.temperature!r} must be a finite number > 0")
        for name in ("alpha", "lambda_", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ConfigError(f"distill_{name.rstrip('_')}={value!r} must be a number between 0 and 1")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "temperature", float(self.temperature))

    @property
    def on_policy(self) -> bool:
        """Whether the student answers some prompts itself (lambda > 0)."""
        return self.lambda_ > 0

    def mix(self, hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        """alpha * hard-label loss + (1 - alpha) * soft loss (the soft one already scaled by T^2)."""
        return self.alpha * hard + (1.0 - self.alpha) * soft


def check_same_vocab(student: torch.nn.Module, teacher: torch.nn.Module, teacher_name: str = "teacher",
                     student_name: str = "the student", tokenizers: tuple[Any, Any] | None = None) -> None:
    """A ConfigError naming both models where the teacher's vocabulary is not the student's: another size of
    output layer, or (given `tokenizers`, the student's and the teacher's) another token for some id."""
    sv = student.get_output_embeddings().weight.shape[0]
    tv = teacher.get_output_embeddings().weight.shape[0]
    same = "distillation compares logits token by token, so both must share one tokenizer (e.g. a larger model " \
           "of the same family; a teacher of another tokenizer is out of scope)"
    if sv != tv:
        raise ConfigError(f"TEACHER={teacher_name!r} has a vocabulary of {tv} tokens and MODEL={student_name!r} "
                          f"{sv}; {same}")
    if tokenizers is not None:
        s_vocab, t_vocab = (tok.get_vocab() for tok in tokenizers)
        if s_vocab != t_vocab:
            differ = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: (kv[1], kv[0]))[:3]
            raise ConfigError(f"TEACHER={teacher_name!r} and MODEL={student_name!r} have different tokenizers "
                              f"({len(t_vocab)} and {len(s_vocab)} tokens; e.g. {differ} are in one only); {same}")


def frozen_teacher(teacher: torch.nn.Module, backend: Any) -> torch.nn.Module:
    """The teacher frozen, in eval mode, bf16 where the backend computes in bf16 (a 4-bit teacher as it loaded: its
    scales stay float32), on the backend's device. Not a submodule of the student: its weights stay out of the
    optimizer and the checkpoints."""
    teacher.requires_grad_(False).eval()
    if backend.precision == "bf16" and not quant4.is_quantized(teacher):
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


def prompt_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Each row's prompt: its tokens before the first trained one (the leading -100 labels), (B,) int64."""
    return (labels != -100).long().argmax(-1)  # argmax: the first maximum (XLA lowers it; cumprod it does not)


def left_padded_prompts(batch: dict, width: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), (B, width) each: every row's prompt (`prompt_lengths`) moved to the right end of `width` columns,
    padding on the left, as the KV-cached generation takes prompts; a prompt longer than `width` keeps its last
    `width` tokens. A gather: fixed shapes, no host read."""
    ids = batch["input_ids"]
    length = prompt_lengths(batch["labels"]).unsqueeze(1)
    source = torch.arange(width, device=ids.device).unsqueeze(0) - width + length  # the column each slot takes
    real = (source >= 0) & (source < ids.shape[1])
    taken = ids.gather(1, source.clamp(0, ids.shape[1] - 1))
    return torch.where(real, taken, torch.full_like(taken, pad)), real.long()


class DistillTrainer(CausalLMTrainer):
    """Loss = alpha * hard-label CE + (1 - alpha) * T^2 * D_beta(teacher, student) against a frozen teacher, per
    target token (D_0 is KL(teacher || student), `lm_head.full_jsd`).

    On-policy (`settings.lambda_` > 0): each micro-batch is, with probability lambda (seeded by SEED, the step and
    the micro-batch: the same choices on a resumed run), the student's own answers to its prompts instead of the
    dataset's: its first `max_new_tokens` tokens sampled at temperature 1 after the prompt (the row's tokens before
    its first trained one, left-padded to `seq_len - max_new_tokens` columns), ended at a `stop_ids` token. There
    is no reference answer, so their loss is the soft term alone, T^2 * D_beta; dataset micro-batches keep the mix.
    Both kinds have one shape (a row of seq_len) and one loss graph, the weights given as data."""

    def __init__(self, *args: Any, teacher: torch.nn.Module, settings: DistillSettings,
                 teacher_name: str = "teacher", stop_ids: Sequence[int] = (), pad_token_id: int = 0,
                 max_new_tokens: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_same_vocab(self.raw_model, teacher, teacher_name)
        self.settings = settings
        self.teacher = frozen_teacher(teacher, self.backend)
        self.weights: dict[tuple[int, bool], torch.Tensor] = {}
        if settings.on_policy:
            self._start_on_policy(list(stop_ids), pad_token_id, max_new_tokens)

    def _start_on_policy(self, stop_ids: list[int], pad: int, max_new_tokens: int) -> None:
        data = self.train_loader.dataset if self.train_loader else None
        seq_len = getattr(data, "seq_len", None)
        if getattr(data, "position_ids", None) is not None:
            raise ConfigError(f"distill_lambda={self.settings.lambda_!r} with pack=True: the student answers each "
                              "row's prompt, and a packed row holds several; set pack=False")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1 or (seq_len and max_new_tokens >= seq_len):
            raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1 and below seq_len="
                              f"{seq_len} for distill_lambda={self.settings.lambda_!r} (the student's answers take "
                              "the last max_new_tokens columns of a row, its prompt the rest)")
        self.stop_ids, self.pad, self.max_new_tokens = stop_ids, pad, max_new_tokens
        self.generations = 0  # the student's answers so far in this process (the generation compiles in two)
        self.prompt_width = (seq_len or max_new_tokens + 1) - max_new_tokens
        if data is not None:
            lengths = prompt_lengths(data.labels)
            if bool((lengths == 0).any()):
                raise ConfigError(f"distill_lambda={self.settings.lambda_!r}: {int((lengths == 0).sum())} training "
                                  "rows have no prompt (every token trained: plain text records); on-policy "
                                  "distillation needs prompt/completion or chat records, or distill_lambda=0")
            warn_cut(setting="SEQ_LEN - MAX_NEW_TOKENS", limit=self.prompt_width,
                     cut=int((lengths > self.prompt_width).sum()), total=len(lengths), longest=int(lengths.max()),
                     what="prompts the student answers", verb="keeps the end of",
                     lost="the student sees those prompts' last tokens only (lower MAX_NEW_TOKENS to keep more)")
        # The (hard, soft) weights of each micro-batch, one tensor per micro-batch and kind: a step's graph takes
        # each as an input of its own (one tensor fed to two micro-batches would make another graph).
        a, device = self.settings.alpha, self.backend.device
        self.weights = {(k, own): torch.tensor([0.0, 1.0] if own else [a, 1.0 - a]).to(device)
                        for k in range(self.config.grad_accum) for own in (False, True)}

    def answers_itself(self, micro: int) -> bool:
        """Whether micro-batch `micro` of this step is the student's own answers: a draw of probability lambda,
        seeded by SEED, the step and `micro` (no generator state: the same on a resumed run)."""
        return random.Random(f"{self.config.seed}:{self.step}:{micro}").random() < self.settings.lambda_

    def student_answers(self, batch: dict, micro: int) -> dict:
        """`batch` as the student answers it: its prompts left-padded, the sampled answer after each (the package's
        KV-cached generation: one prefill and one decode graph), labels on the answer's tokens up to its stop
        token; the same keys and shapes as a dataset batch."""
        b = self.backend
        self.generations += 1
        prompt, mask = left_padded_prompts(batch, self.prompt_width, self.pad)
        b.sync()  # the prompts as data: the generation's captured graphs take them as they are
        key = sampling_key(self.config.seed, self.step * self.config.grad_accum + micro, b)
        with b.autocast():
            gen = generate_ids(self.sampling_model, prompt, mask, max_new_tokens=self.max_new_tokens,
                               eos_token_id=self.stop_ids, pad_token_id=self.pad, sampling=Sampling(1.0), seed=key,
                               sync=b.sync, replay=b.compile_step, loop=b.compile_loop)
        labels = torch.cat([torch.full_like(prompt, -100), torch.where(gen.mask.bool(), gen.ids,
                                                                       torch.full_like(gen.ids, -100))], 1)
        out = {"input_ids": torch.cat([prompt, gen.ids], 1), "attention_mask": torch.cat([mask, gen.mask.long()], 1),
               "labels": labels}
        b.sync()  # the rows as data: the same graphs whichever micro-batches of a step the student answers
        return out

    def micro_batches(self, batches: Iterator) -> list[dict]:
        micro = super().micro_batches(batches)
        if not self.settings.on_policy:
            return micro
        draws = [self.answers_itself(k) for k in range(len(micro))]
        if self.backend.compiles_graphs:
            # The generation's graphs compile over its first two calls: make them in the run's first step whatever
            # it draws (answers thrown away), so that no later step compiles when the student first answers.
            for _ in range(2 - self.generations - sum(draws)):
                self.student_answers(micro[0], 0)
        out = []
        for k, (batch, own) in enumerate(zip(micro, draws, strict=True)):
            batch = self.student_answers(batch, k) if own else batch
            out.append({**batch, "distill_weights": self.weights[k, own]})
        return out

    def loss_sum(self, batch: dict) -> torch.Tensor:
        s = self.settings
        if "distill_weights" in batch:  # on-policy runs: left-padded rows need their positions
            batch = {**batch, "position_ids": lm_head.mask_positions(batch["attention_mask"])}
        chunked = lm_head.live_kd_sums(self.model, self.teacher, batch, s.temperature, beta=s.beta,
                                       chunk=getattr(self, "loss_chunk", None))
        if chunked is not None:
            hard, soft = chunked
        else:
            logits = lm_logits(self.model, batch)
            hard = causal_lm_loss_sum(logits, batch["labels"])
            with torch.no_grad():
                t_logits = lm_logits(self.teacher, batch)
            t = s.temperature
            # Per position D_beta(teacher, student) over the vocabulary, kept only at target tokens.
            div = lm_head.full_jsd(logits[:, :-1].float() / t, t_logits[:, :-1].float() / t, s.beta)
            soft = (div * (batch["labels"][:, 1:] != -100)).sum() * (t * t)
        if "distill_weights" in batch:
            w = batch["distill_weights"]
            return w[0] * hard + w[1] * soft
        return s.mix(hard, soft)


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
