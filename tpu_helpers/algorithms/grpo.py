"""GRPO (group relative policy optimization) on the package's Trainer: sample G answers per prompt, reward them in
Python, and push the policy towards the answers that beat their group.

    settings = GRPOSettings(num_generations=8, max_new_tokens=128, temperature=1.0, kl_beta=0.04)  # checked once
    trainer = GRPOTrainer(model, prompts, config=cfg, tokenizer=tok, records=records,
                          rewards=resolve_rewards("answer,format"), settings=settings)
    report = trainer.fit()          # resume, signals, the run lock, the XLA detector and MFU as for SFT

The algorithm's settings (`GRPOSettings`) are apart from the model, the data and the run's `TrainConfig` (as in
Tunix): the recipe's config (`recipes.grpo.GRPOConfig`) builds them from its notebook parameters, and the trainer
takes them whole.

Each generation step (the first of every `num_iterations` optimizer steps) takes B prompts from the loader
(`data.rl.PromptDataset`: left-padded to MAX_PROMPT_LEN) and:
1. generates G completions of each with the KV cache (`models.generation`: one prefill and one decode graph, a
   sampling stream keyed on (seed, generation index, process rank), so a resumed run samples the same answers and
   data-parallel processes different ones);
2. reads the completions and the rows' record indices to the host in one transfer (the step's only read,
   declared through `Cadence.read_every`, so the XLA detector expects it), decodes them and calls the rewards
   (`algorithms.rewards`) with each record's fields;
3. turns the summed rewards into advantages within each group, A = (r - mean) / (std + 1e-4) (`scale_rewards`
   "group", std with Bessel's correction, as TRL; "batch": the step's std; "none": no division), and, with
   `kl_beta` > 0, computes the reference's log-probabilities of the completions: under LoRA the same model with the
   adapter disabled (no second copy of the weights), otherwise `ref_model`, a frozen copy (bf16 where the step
   computes in bf16); then syncs, so the optimizer step is the same graph at every step.

Every optimizer step then minimises, over the completion tokens of all B x G rows (split into `grad_accum`
micro-batches whose losses add up to the step's, so the gradient does not depend on `grad_accum`):

    ratio = exp(logp - logp_old)         (importance "sequence": per row, the exp of its tokens' mean log-ratio)
    loss  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + beta * (exp(ref - logp) - (ref - logp) - 1)

summed over the tokens and divided as `loss_type` says (`algorithms.grpo_loss`: grpo, per-row means then their
mean; bnpo, the step's token count; dr_grpo, rows x max_new_tokens; dapo, the token count averaged over
data-parallel processes by an all-reduce on the device), each as TRL 1.16 defines it.
logp under softmax(logits / temperature), as sampled (dropout off by default, `disable_dropout`, so the training
forward computes what generation did). With `num_iterations` 1, logp_old is logp itself (detached:
the ratio is exactly 1 and the update on-policy); with more, the generation's own log-probabilities are kept for
the `num_iterations` updates over the same completions, as in the GRPO paper. Logged per log step: the loss, the
mean reward (and each reward's), its spread within groups, the completion length, the KL to the reference, the
share of clipped tokens (of clipped rows' tokens with the sequence ratio), and the seconds spent generating and
rewarding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.algorithms import grpo_loss
from tpu_helpers.algorithms.rewards import Reward, score
from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import check_choice
from tpu_helpers.data.rl import prompt_and_answer
from tpu_helpers.models import lm_head, lora
from tpu_helpers.models.generation import Sampling, generate_ids
from tpu_helpers.models.hf import completion_lengths, completion_texts, eos_ids
from tpu_helpers.training.cadence import Cadence
from tpu_helpers.training.trainer import Trainer

_RESERVED = ("prompts", "completions", "completion_tokens", "max_new_tokens")


@dataclass(frozen=True)
class GRPOSettings:
    """What GRPO does, apart from the model, the data and the run (`TrainConfig`): each field is checked here, once.

    num_generations: answers sampled per prompt (the group; >= 2); max_new_tokens: tokens per answer;
    temperature / top_k / top_p: the sampling (temperature > 0: a group of identical greedy answers teaches
    nothing); kl_beta: weight of the k3 KL to the reference (0: no reference); clip_eps: the ratio's clip
    (epsilon_high: its upper side, DAPO's clip-higher, default clip_eps); loss_type (grpo | bnpo | dr_grpo | dapo),
    importance (token | sequence) and scale_rewards (group | batch | none): see `algorithms.grpo_loss`;
    num_iterations: optimizer steps per batch of sampled answers; prompt_field / answer_field: the record fields
    the rewards read; disable_dropout: every dropout of the policy and the reference set to 0 when the trainer is
    built (generation runs in eval mode and the loss in train mode: with dropout the on-policy ratio would not be 1
    and the KL noisy, as TRL says).
    """

    num_generations: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kl_beta: float = 0.04
    clip_eps: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "bnpo"
    importance: str = "token"
    scale_rewards: str = "group"
    num_iterations: int = 1
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    disable_dropout: bool = True

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
        check_choice("loss_type", self.loss_type, grpo_loss.LOSS_TYPES)
        check_choice("importance", self.importance, grpo_loss.IMPORTANCE_LEVELS)
        check_choice("scale_rewards", self.scale_rewards, grpo_loss.SCALE_REWARDS)

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
                     temperature: float) -> torch.Tensor:
    """Log-probabilities (rows, completion) of the last `completion` tokens of `ids` under softmax(logits / T);
    only those positions' logits are computed, in chunks of tokens where they are large (`models.lm_head`, the
    model's LOSS_CHUNK), else at once (`logits_to_keep`); no full log-softmax is kept."""
    chunked = lm_head.completion_token_logps(model, ids, mask, completion, temperature)
    if chunked is not None:
        return chunked
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=completion + 1).logits[:, :-1].float() / temperature
    tokens = ids[:, -completion:].unsqueeze(-1)
    return logits.gather(-1, tokens).squeeze(-1) - logits.logsumexp(-1)


def rows_completion_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, start: int, stop: int,
                          completion: int, temperature: float) -> torch.Tensor:
    """`completion_logps` of the rows [start, stop) of a rollout, sliced here so that a replayed capture
    (`Trainer.replayed`) takes the rollout's tensors as they are, not a pending slice of them."""
    return completion_logps(model, ids[start:stop], mask[start:stop], completion, temperature)


def score_completions(tokenizer: Any, rewards: dict[str, Reward], records: Sequence[dict], rows: list[list[int]],
                      settings: GRPOSettings, stop_ids: list[int] | None = None) -> dict:
    """Decode completion token rows (one per record) and score them with every reward: {"total", "rewards"
    ({name: values}), "prompts", "completions", "completion_tokens"}; each record's fields go to the rewards.
    `stop_ids`: where completions end (default the tokenizer's EOS; give `eos_ids(tokenizer, model)`)."""
    stop_ids = eos_ids(tokenizer) if stop_ids is None else stop_ids
    texts = completion_texts(tokenizer, rows, stop_ids)
    lengths = completion_lengths(rows, stop_ids)
    pairs = [prompt_and_answer(r, prompt_field=settings.prompt_field, answer_field=settings.answer_field)
             for r in records]
    fields: dict[str, Any] = {k: [r.get(k) for r in records] for k in sorted({k for r in records for k in r})
                              if k not in _RESERVED}
    fields.update(answer=[a for _, a in pairs], completion_tokens=lengths, max_new_tokens=settings.max_new_tokens)
    prompts = [p for p, _ in pairs]
    scores = score(rewards, prompts, texts, fields)
    total = [sum(values) for values in zip(*scores.values(), strict=True)]
    return {"total": total, "rewards": scores, "prompts": prompts, "completions": texts, "completion_tokens": lengths}


class GRPOTrainer(Trainer):
    """GRPO over `prompts` (a `data.rl.PromptDataset`); see the module docstring."""

    # Its loss is the clipped surrogate, centred near 0 and of either sign: no spike rule on it (nan/inf still stop).
    watches_loss_spikes = False
    # config.replay_steps: the policy's forward (`rows_completion_logps`, and so its backward) is captured and
    # replayed; the surrogate's few element-wise ops on its output are traced as they are.
    replays_steps = True

    def __init__(self, model: torch.nn.Module, prompts: Any, *, tokenizer: Any, records: Sequence[dict],
                 rewards: dict[str, Reward], settings: GRPOSettings, ref_model: torch.nn.Module | None = None,
                 **kwargs: Any) -> None:
        if not rewards:
            raise ConfigError("REWARDS is empty: GRPO needs at least one reward function")
        super().__init__(model, prompts, None, **kwargs)
        cfg = self.config
        settings.check_split(cfg.batch_size, cfg.grad_accum)
        self.settings = settings
        self.tokenizer, self.records, self.rewards = tokenizer, list(records), dict(rewards)
        # Where answers end: the tokenizer's EOS and the model's generation_config.eos_token_id (end of turn).
        self.stop_ids = eos_ids(tokenizer, model)
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
        self.rollout: dict | None = None
        self._host_log: list[dict] = []  # per generation step, since the last log
        self._device_log: list[float] = []
        self._metrics = self._zero_metrics()
        self.rollout_seconds: list[float] = []
        self.last_samples: list[dict] = []  # one completion per prompt of the latest generation step

    @property
    def tokens_per_step(self) -> int:
        seq = self.train_loader.dataset.input_ids.shape[1] + self.settings.max_new_tokens if self.train_loader else 0
        return self.settings.rows(self.config.batch_size) * self.backend.num_replicas * seq

    # ---- generation and rewards ---------------------------------------------------------------------------------
    def make_rollout(self, batch: dict) -> dict:
        """Generate, read, reward and score one batch of prompts (see the module docstring); ends with a sync."""
        b, g, n = self.backend, self.settings.num_generations, self.settings.max_new_tokens
        t0 = time.perf_counter()
        ids = batch["input_ids"].repeat_interleave(g, 0)
        mask = batch["attention_mask"].repeat_interleave(g, 0)
        key = self.sampling_key(self.step // self.settings.num_iterations)
        with b.autocast():
            gen = generate_ids(self.model, ids, mask, max_new_tokens=n, eos_token_id=self.stop_ids,
                               pad_token_id=self.tokenizer.pad_token_id, sampling=self.settings.sampling, seed=key,
                               sync=b.sync, replay=b.compile_step, loop=b.compile_loop)
        host = b.to_cpu({"ids": gen.ids, "index": batch["index"]})  # the step's one read
        rewards, stats = self.score(host["ids"].tolist(), host["index"].tolist())
        rollout = {"ids": torch.cat([ids, gen.ids], 1), "mask": torch.cat([mask, gen.mask], 1),
                   "completion_mask": gen.mask, "old_logp": gen.logprobs,
                   "advantages": self.advantages(rewards).to(b.device)}
        if self.settings.kl_beta > 0:
            with torch.no_grad(), b.autocast():
                rollout["ref_logp"] = self.reference_logps(rollout["ids"], rollout["mask"])
        b.sync()  # the reference's forward in a graph of its own: the optimizer step's graph never changes
        self.rollout_seconds.append(time.perf_counter() - t0)
        self._host_log.append({**stats, "generate_s": self.rollout_seconds[-1]})
        return rollout

    def advantages(self, rewards: list[float]) -> torch.Tensor:
        """The rows' advantages from their summed rewards (host floats), as `settings.scale_rewards` says. The
        "batch" std spans the rows of every process (TRL's spans its gathered rewards): a host gather of the floats,
        where processes hold different rows."""
        s, b = self.settings, self.backend
        batch = None
        if s.scale_rewards == "batch" and b.loader_rank_and_world[1] > 1:
            batch = torch.tensor([x for part in b.gather_objects(rewards) for x in part])
        return grpo_loss.group_advantages(torch.tensor(rewards), s.num_generations, scale=s.scale_rewards,
                                          batch=batch)

    def sampling_key(self, index: int) -> torch.Tensor:
        """The sampling stream of generation `index`: a function of the seed, the index and the process (the
        backend's rank: under data parallelism every process samples its own rows, which must not share one
        stream), sent as data (no recompile); the same on a resumed run of the same process."""
        return torch.tensor([self.config.seed, index, self.backend.rank], dtype=torch.long).to(self.backend.device)

    def score(self, rows: list[list[int]], indices: list[int]) -> tuple[list[float], dict]:
        """The summed reward of each completion (token rows) of the records at `indices`, and what is logged."""
        g = self.settings.num_generations
        records = [self.records[i] for i in indices for _ in range(g)]
        scored = score_completions(self.tokenizer, self.rewards, records, rows, self.settings, self.stop_ids)
        total, lengths = scored["total"], scored["completion_tokens"]
        groups = torch.tensor(total).reshape(-1, g)
        stats = {"reward": sum(total) / len(total), "reward_std": float(groups.std(1).mean()),
                 "completion_tokens": sum(lengths) / len(lengths),
                 **{f"reward/{k}": sum(v) / len(v) for k, v in scored["rewards"].items()}}
        self.last_samples = [{"prompt": p, "completion": c, "reward": r} for p, c, r in
                             zip(scored["prompts"][::g], scored["completions"][::g], total[::g], strict=True)]
        return total, stats

    @torch.no_grad()
    def reference_logps(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The reference's log-probabilities of the completions: the adapter-disabled model under LoRA."""
        n, t = self.settings.max_new_tokens, self.settings.temperature
        if self.ref_model is not None:
            return completion_logps(self.ref_model, ids, mask, n, t)
        with self.raw_model.disable_adapter():
            return completion_logps(self.model, ids, mask, n, t)

    # ---- the optimizer step ---------------------------------------------------------------------------------------
    def policy_loss(self, rollout: dict, rows: slice,
                    divisor: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, KL sum, clipped-token sum) of the rows `rows` of `rollout`: their share of the step's loss, whose
        divisor (`grpo_loss.step_divisor`) spans every micro-batch of the step."""
        s = self.settings
        logp = self.replayed(rows_completion_logps, self.model, rollout["ids"], rollout["mask"], rows.start,
                             rows.stop, s.max_new_tokens, s.temperature)
        old = logp.detach() if s.num_iterations == 1 else rollout["old_logp"][rows]
        ref = rollout["ref_logp"][rows] if "ref_logp" in rollout else None
        mask = rollout["completion_mask"][rows]
        per_token, kl, clipped = grpo_loss.policy_terms(
            logp, old, ref, rollout["advantages"][rows], mask, clip_eps=s.clip_eps, epsilon_high=s.epsilon_high,
            kl_beta=s.kl_beta, importance=s.importance)
        m = mask.float()
        loss = grpo_loss.micro_batch_loss(s.loss_type, per_token, mask, divisor)
        return loss, (kl * m).sum(), (clipped * m).sum()

    def accumulate(self, rollout: dict, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward passes of one optimizer step over `rollout`, split into `micro_batches`: (loss, KL sum,
        clipped-token sum), device tensors. The gradients are the same for any split (the divisor is the step's)."""
        b, s = self.backend, self.settings
        rows = rollout["ids"].shape[0] // micro_batches
        mask = rollout["completion_mask"]
        divisor = grpo_loss.step_divisor(s.loss_type, mask, s.max_new_tokens, b.all_reduce_mean)
        total, kl, clipped = None, 0.0, 0.0
        for k in range(micro_batches):
            with b.autocast():
                loss, kl_k, clipped_k = self.policy_loss(rollout, slice(k * rows, (k + 1) * rows), divisor)
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
            kl, clipped = kl + kl_k.detach(), clipped + clipped_k.detach()
        return total, kl, clipped

    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.step % self.settings.num_iterations == 0 or self.rollout is None:
            self.rollout = self.make_rollout(next(batches))
        total, kl, clipped = self.accumulate(self.rollout, self.config.grad_accum)
        count = self.rollout["completion_mask"].sum().clamp(min=1).float()
        one = torch.ones_like(count)
        self._metrics = self._metrics + torch.stack([kl / count, clipped / count, one])
        if self.cadence.is_log_step(self.step + 1):
            self.backend.add_step_closure(self._read_metrics, self.step + 1, self._metrics)
            self._metrics = self._zero_metrics()
        return total, self.apply_gradients()

    # ---- logging and checkpoints ----------------------------------------------------------------------------------
    def _zero_metrics(self) -> torch.Tensor:
        # (KL, clipped share, steps) summed over a log window; copied in as data, like the trainer's loss window.
        return torch.zeros(3).to(self.backend.device)

    def _read_metrics(self, step: int, metrics: torch.Tensor) -> None:
        self._device_log = [step, *metrics.tolist()]

    def log_extras(self, step: int) -> dict:
        out: dict[str, float] = {}
        if self._device_log and self._device_log[0] == step:
            _, kl, clipped, steps = self._device_log
            out["kl"], out["clip_fraction"] = kl / max(steps, 1), clipped / max(steps, 1)
        for key in sorted({k for rec in self._host_log for k in rec}):
            values = [rec[key] for rec in self._host_log if key in rec]
            out[key] = sum(values) / len(values)
        self._host_log = []
        return out

    def progress_state(self) -> dict:
        # Mid-way through num_iterations the next steps reuse this rollout: it is part of the run's state.
        keep = self.rollout if self.step % self.settings.num_iterations else None
        return {**super().progress_state(), "grpo_rollout": keep, "grpo_log": list(self._host_log)}

    def load_progress_state(self, state: dict) -> None:
        super().load_progress_state(state)
        saved = state.get("grpo_rollout")
        self.rollout = None if saved is None else self.backend.to_device(saved)
        self._host_log = list(state.get("grpo_log", []))
