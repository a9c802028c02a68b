"""GRPO on the package's Trainer: sample G answers per prompt, score them with Python rewards, and push the policy
towards the answers that beat their group (the step and each setting: docs/algorithms/grpo.md). Simpler than
TRL's GRPOTrainer, on purpose:
1. the policy itself generates, with a KV cache in fixed shapes: no vLLM server, no weight sync, no
   importance-sampling correction for a generation engine;
2. rewards are Python functions on the host, summed (no reward weights), after the generation's one host read;
3. the loss types are grpo, bnpo, dr_grpo and dapo (not cispo, sapo, luspo), the clip two-sided only (no delta),
   with no entropy masking or bonus, and bnpo divides by the whole step's tokens (TRL's by each micro-batch's);
4. under LoRA the KL reference is the model with its adapter disabled: no second copy of the weights.

    rollouts = AnswerRollouts(tok, resolve_rewards("answer,format"), settings, stop_ids=eos_ids(tok, model),
                              backend=b, max_prompt_len=32)            # or EpisodeRollouts: agent episodes
    prompts, _ = rollouts.prompts(records)
    trainer = GRPOTrainer(model, prompts, config=cfg, rollouts=rollouts, settings=settings)
    report = trainer.fit()          # resume, signals, the run lock, the XLA detector and MFU as for SFT
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tpu_helpers.algorithms import grpo_loss
from tpu_helpers.algorithms.rewards import parse_reward_weights
from tpu_helpers.algorithms.rollouts import AnswerRollouts, EpisodeRollouts
from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import choose
from tpu_helpers.models import lm_head, lora
from tpu_helpers.models.generation import Sampling
from tpu_helpers.training.cadence import Cadence
from tpu_helpers.training.step import StepFigures
from tpu_helpers.training.trainer import Trainer

_PARSED = dict(init=False, repr=False, compare=False)


@dataclass(frozen=True)
class GRPOSettings:
    """What GRPO does, apart from the model, the data and the run (`TrainConfig`). Each field is also a notebook
    parameter of the recipe (`recipes.grpo.GRPOConfig` takes these fields as its own); checked, and the choices
    parsed into what the step calls, here, once."""

    num_generations: int = 8  # answers sampled per prompt: the group (>= 2)
    max_new_tokens: int = 4  # tokens per answer
    temperature: float = 1.0  # sampling (> 0: a group of identical greedy answers teaches nothing)
    top_k: int = 0  # sampling: the k likeliest tokens (0: all)
    top_p: float = 1.0  # sampling: within this probability mass (1.0: all)
    kl_beta: float = 0.04  # weight of the k3 KL to the reference (0: no reference)
    clip_eps: float = 0.2  # the ratio's clip: [1 - clip_eps, 1 + epsilon_high]
    epsilon_high: float | None = None  # the upper clip (DAPO's clip-higher, e.g. 0.28); None: clip_eps
    loss_type: str = "bnpo"  # grpo | bnpo | dr_grpo | dapo: what the token losses are divided by
    importance: str = "token"  # token | sequence (GSPO: one importance ratio per answer)
    scale_rewards: str = "group"  # group | batch | none: the std the advantages are divided by
    num_iterations: int = 1  # optimizer steps per batch of sampled answers (the old log-probabilities kept)
    prompt_field: str = "prompt"  # the record field the prompts are read from
    answer_field: str = "answer"  # the record field holding the reference answer the rewards compare with
    disable_dropout: bool = True  # every dropout of the policy and reference at 0: ratio 1 on-policy, a clean KL
    reward_weights: str | Sequence[float] | None = None  # one per REWARDS entry ("1,0.1", TRL's); None: 1 each

    # The choices above as the step calls them (registries of algorithms.grpo_loss), set once by __post_init__.
    loss: grpo_loss.LossType = field(**_PARSED)
    log_ratio: Callable = field(**_PARSED)
    scale: grpo_loss.Scale = field(**_PARSED)
    weights: tuple[float, ...] | None = field(**_PARSED)  # REWARD_WEIGHTS as numbers (`rewards.summed_rewards`)

    def __post_init__(self) -> None:
        if not isinstance(self.disable_dropout, bool):
            raise ConfigError(f"disable_dropout={self.disable_dropout!r} must be True or False")
        n = self.num_generations
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(f"num_generations={n!r} must be >= 2 (an integer): advantages are relative to the "
                              "other answers to the same prompt")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ConfigError(f"temperature={self.temperature!r} must be > 0: GRPO samples several different answers "
                              "per prompt (about 1.0); 0 would sample greedily, every answer in a group the same")
        self.sampling  # noqa: B018 (checks top_k and top_p)
        for name in ("max_new_tokens", "num_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if not (math.isfinite(self.kl_beta) and self.kl_beta >= 0):
            raise ConfigError(f"kl_beta={self.kl_beta!r} must be a finite number >= 0 (0: no reference model)")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"clip_eps={self.clip_eps!r} must be between 0 and 1")
        high = self.epsilon_high
        if high is not None and not (isinstance(high, (int, float)) and math.isfinite(high) and high >= self.clip_eps):
            raise ConfigError(f"epsilon_high={high!r} must be a finite number >= clip_eps={self.clip_eps!r} (the "
                              "upper clip, DAPO's clip-higher: e.g. 0.28), or None for clip_eps")
        object.__setattr__(self, "loss", choose("loss_type", self.loss_type, grpo_loss.LOSS_TYPES))
        object.__setattr__(self, "log_ratio", choose("importance", self.importance, grpo_loss.IMPORTANCE_LEVELS))
        object.__setattr__(self, "scale", choose("scale_rewards", self.scale_rewards, grpo_loss.SCALE_REWARDS))
        object.__setattr__(self, "weights", parse_reward_weights(self.reward_weights))

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)

    def rows(self, prompts: int) -> int:
        """Rows (sampled answers) of `prompts` prompts: B x G."""
        return prompts * self.num_generations

    def check_split(self, batch_size: int, grad_accum: int) -> None:
        """The B x G rows of a step must split evenly into `grad_accum` micro-batches (one graph per step)."""
        rows = self.rows(batch_size)
        if rows % grad_accum:
            raise ConfigError(f"grad_accum={grad_accum} must divide batch_size x num_generations = {rows} (the rows "
                              "of one step's micro-batches)")


def disable_dropout(model: torch.nn.Module) -> None:
    """Every `torch.nn.Dropout` of `model` (LoRA's included) gets p = 0, and every attention module's float
    `attention_dropout` (HF's eager attention reads it in train mode) 0.0, so train mode computes what eval mode
    does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def completion_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, completion: int,
                     temperature: float, group: int = 1) -> torch.Tensor:
    """Log-probabilities (rows, completion) of the last `completion` tokens of `ids` under softmax(logits / T);
    only those positions' logits are computed, in chunks of tokens where they are large (`models.lm_head`, the
    model's LOSS_CHUNK), else at once (`logits_to_keep`); no full log-softmax is kept. `group` > 1: runs of that
    many rows share their prompt, whose pass then runs once per run (`lm_head.completion_hidden`)."""
    chunked = lm_head.completion_token_logps(model, ids, mask, completion, temperature, group=group)
    if chunked is not None:
        return chunked
    positions = lm_head.mask_positions(mask)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=completion + 1).logits[:, :-1].float() / temperature
    tokens = ids[:, -completion:].unsqueeze(-1)
    return logits.gather(-1, tokens).squeeze(-1) - logits.logsumexp(-1)


def rows_completion_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, start: int, stop: int,
                          completion: int, temperature: float, group: int = 1) -> torch.Tensor:
    """`completion_logps` of the rows [start, stop) of a rollout, sliced here so that a replayed capture
    (`Trainer.replayed`) takes the rollout's tensors as they are, not a pending slice of them."""
    return completion_logps(model, ids[start:stop], mask[start:stop], completion, temperature, group)


def used_columns(rollout: dict) -> dict:
    """`rollout` without the columns no row uses (the padding every row has: left of the shortest prompt, an
    episode's slots no turn filled). Positions count valid tokens and each scored token's previous column is one
    of its row's own, so every log-probability is the same. The completion's columns are the last
    `completion_mask.shape[1]`; its per-column tensors (`completion_mask`, `old_logp`) lose the same columns."""
    keep = rollout["mask"].bool().any(0)
    if bool(keep.all()):
        return rollout
    width = rollout["completion_mask"].shape[1]
    columns, completion = keep.nonzero().squeeze(1), keep[-width:].nonzero().squeeze(1)
    out = {**rollout, "ids": rollout["ids"][:, columns], "mask": rollout["mask"][:, columns]}
    for name in ("completion_mask", "old_logp"):
        out[name] = rollout[name][:, completion]
    return out


class GRPOTrainer(Trainer):
    """GRPO over `prompts` (a `data.rl.PromptDataset`); see the module docstring."""

    # Its loss is the clipped surrogate, centred near 0 and of either sign: no spike rule on it (nan/inf still stop).
    watches_loss_spikes = False
    # config.replay_steps: the policy's forward (`rows_completion_logps`, and so its backward) is captured and
    # replayed; the surrogate's few element-wise ops on its output are traced as they are.
    replays_steps = True

    def __init__(self, model: torch.nn.Module, prompts: Any, *, rollouts: AnswerRollouts | EpisodeRollouts,
                 settings: GRPOSettings, ref_model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(model, prompts, None, **kwargs)
        cfg = self.config
        settings.check_split(cfg.batch_size, cfg.grad_accum)
        self.settings = settings
        # Where the step's rows come from (algorithms.rollouts): answers, or agent episodes whose loss spans the
        # episode's columns, the model's own tokens in them. The step never asks which.
        self.rollouts = rollouts
        self.width = rollouts.width
        # The first of every num_iterations steps reads the sampled tokens: declared, so the detector expects it.
        self.cadence = Cadence.from_config(cfg, read_every=settings.num_iterations)
        if settings.disable_dropout:
            disable_dropout(model)
        self.ref_model = None
        if settings.kl_beta > 0 and not lora.is_peft(model):
            if ref_model is None:
                raise ConfigError("kl_beta > 0 without LoRA needs ref_model, a frozen copy of the starting model")
            ref_model.requires_grad_(False).eval()
            if settings.disable_dropout:
                disable_dropout(ref_model)  # eval mode already; kept for a caller that trains it again
            if self.backend.precision == "bf16":
                ref_model = ref_model.to(torch.bfloat16)
            self.ref_model = self.backend.move_model(ref_model)  # not a submodule: no optimizer, no checkpoint
        self.rollout: dict | None = None  # the answers the current num_iterations steps train on
        self.rollout_seconds: list[float] = []

    @property
    def tokens_per_step(self) -> int:
        """The tokens the policy's forward runs a step: each row's completion columns, and each prompt once per group
        where the group shares it (`prompt_group`)."""
        prompt = self.rollouts.prompt_width if self.train_loader else 0
        rows = self.settings.rows(self.config.batch_size) * self.backend.num_replicas
        group = self.prompt_group(self.settings.num_generations,
                                  slice(0, self.settings.rows(self.config.batch_size) // self.config.grad_accum))
        return rows * self.width + rows // group * prompt

    # ---- the step ---------------------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator) -> StepFigures:
        """One GRPO step: on the first of every num_iterations steps a rollout of new answers (`make_rollout`:
        sample, score, advantages), then the clipped loss over grad_accum micro-batches with a backward each
        (`accumulate`), then the optimizer step. Logged: the KL and the clipped share per completion token, and
        the rollout's rewards, lengths and seconds."""
        host: dict[str, float] = {}
        if self.step % self.settings.num_iterations == 0 or self.rollout is None:
            self.rollout, host = self.make_rollout(next(batches))  # 1-3: sample, score, advantages
        loss, kl, clipped = self.accumulate(self.rollout, self.config.grad_accum)  # 4: loss, backward per micro-batch
        count = self.rollout["completion_mask"].sum().clamp(min=1).float()
        device = {"kl": kl / count, "clip_fraction": clipped / count}  # per completion token
        return StepFigures(loss, self.apply_gradients(), device=device, host=host)  # 5: the optimizer step

    def make_rollout(self, prompts: dict) -> tuple[dict, dict[str, float]]:
        """Sample G answers (or agent episodes) to each prompt and score them (`self.rollouts`), and turn the
        rewards into advantages within each group; with kl_beta > 0, the reference's log-probabilities of the
        answers too. Ends with a sync. Returns the rollout (device tensors) and its host figures (rewards,
        completion length, seconds)."""
        b, s = self.backend, self.settings
        t0 = time.perf_counter()
        # 1-2. sample and score: draw step // num_iterations (its sampling stream: the same on a resumed run)
        rollout, rewards, host = self.rollouts.sample(self.sampling_model, prompts, self.step // s.num_iterations)
        if b.name == "cpu":  # eager: a shape of its own per rollout costs nothing, and the forward skips padding
            rollout = used_columns(rollout)
        rollout["advantages"] = self.advantages(rewards).to(b.device)  # 3. advantages within each group
        if s.kl_beta > 0:
            with torch.no_grad(), b.autocast():
                rollout["ref_logp"] = self.reference_logps(rollout["ids"], rollout["mask"],
                                                           self.prompt_group(rollout["group"], slice(0, len(rewards))),
                                                           rollout["completion_mask"].shape[1])
        b.sync()  # the reference's forward in a graph of its own: the optimizer step's graph never changes
        self.rollout_seconds.append(time.perf_counter() - t0)
        return rollout, {**host, "generate_s": self.rollout_seconds[-1]}

    def accumulate(self, rollout: dict, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward passes of one optimizer step over `rollout`, split into `micro_batches`: (loss, KL sum,
        clipped-token sum), device tensors. The gradients are the same for any split (the divisor is the step's)."""
        b, s = self.backend, self.settings
        rows = rollout["ids"].shape[0] // micro_batches
        divisor = grpo_loss.step_divisor(s.loss, rollout["completion_mask"], self.width, b.all_reduce_mean)
        total, kl, clipped = None, 0.0, 0.0
        for k in range(micro_batches):
            with b.autocast():
                loss, kl_k, clipped_k = self.policy_loss(rollout, slice(k * rows, (k + 1) * rows), divisor)
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
            kl, clipped = kl + kl_k.detach(), clipped + clipped_k.detach()
        return total, kl, clipped

    def policy_loss(self, rollout: dict, rows: slice,
                    divisor: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, KL sum, clipped-token sum) of the rows `rows` of `rollout`: their share of the step's loss, whose
        divisor (`grpo_loss.step_divisor`) spans every micro-batch of the step."""
        s = self.settings
        logp = self.replayed(rows_completion_logps, self.model, rollout["ids"], rollout["mask"], rows.start,
                             rows.stop, rollout["completion_mask"].shape[1], s.temperature,
                             self.prompt_group(rollout.get("group", 1), rows))
        # One iteration per rollout: logp_old is logp itself (detached), the ratio exactly 1, the update on-policy.
        old = logp.detach() if s.num_iterations == 1 else rollout["old_logp"][rows]
        ref = rollout["ref_logp"][rows] if "ref_logp" in rollout else None
        mask = rollout["completion_mask"][rows]
        per_token, kl, clipped = grpo_loss.policy_terms(
            logp, old, ref, rollout["advantages"][rows], mask, clip_eps=s.clip_eps, epsilon_high=s.epsilon_high,
            kl_beta=s.kl_beta, importance=s.log_ratio)
        m = mask.float()
        loss = grpo_loss.micro_batch_loss(s.loss, per_token, mask, divisor)
        return loss, (kl * m).sum(), (clipped * m).sum()

    # ---- what the step calls ----------------------------------------------------------------------------------------
    def advantages(self, rewards: list[float]) -> torch.Tensor:
        """The rows' advantages from their summed rewards (host floats), scaled as SCALE_REWARDS says. The "batch"
        std spans the rows of every process (TRL's spans its gathered rewards): a host gather of the floats, where
        processes hold different rows."""
        s, b = self.settings, self.backend
        batch = None
        if s.scale is grpo_loss.by_batch_std and b.loader_rank_and_world[1] > 1:
            batch = torch.tensor([x for part in b.gather_objects(rewards) for x in part])
        return grpo_loss.group_advantages(torch.tensor(rewards), s.num_generations, scale=s.scale, batch=batch)

    def prompt_group(self, group: int, rows: slice) -> int:
        """How many consecutive rows of `rows` share one pass over their prompt in the forward: a rollout's `group`
        (GRPO's G; an agent group whose prompts are the same tokens), 1 under gradient checkpointing (a recomputed
        block would write its keys and values into the shared cache twice) or where the micro-batch splits a
        group."""
        if self.config.gradient_checkpointing or rows.start % group or rows.stop % group:
            return 1
        return group

    @torch.no_grad()
    def reference_logps(self, ids: torch.Tensor, mask: torch.Tensor, group: int = 1,
                        width: int | None = None) -> torch.Tensor:
        """The reference's log-probabilities of the last `width` (the completion's) columns: the adapter-disabled
        model under LoRA."""
        n, t = width or self.width, self.settings.temperature
        if self.ref_model is not None:
            return completion_logps(self.ref_model, ids, mask, n, t, group)
        with self.raw_model.disable_adapter():
            return completion_logps(self.sampling_model, ids, mask, n, t, group)

    # ---- checkpoints ------------------------------------------------------------------------------------------------
    def progress_state(self) -> dict:
        # Mid-way through num_iterations the next steps reuse this rollout: it is part of the run's state.
        keep = self.rollout if self.step % self.settings.num_iterations else None
        return {**super().progress_state(), "grpo_rollout": keep}

    def load_progress_state(self, state: dict) -> None:
        super().load_progress_state(state)
        saved = state.get("grpo_rollout")
        self.rollout = None if saved is None else self.backend.to_device(saved)

