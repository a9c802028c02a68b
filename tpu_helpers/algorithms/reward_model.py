"""Reward models: train one on preference pairs (Bradley-Terry, as TRL's RewardTrainer), and score completions with
one as a GRPO or agent reward (as TRL takes a model for a reward function).

    loss = bradley_terry_loss(chosen, rejected, margin=m, center_rewards_coefficient=0.01)  # per pair
    trainer = RewardModelTrainer(model, pairs, val_pairs, config=cfg, settings=settings)    # ALGORITHM "reward"
    reward = ModelReward("runs/rm/merged")          # REWARDS "model:runs/rm/merged" (`algorithms.rewards`)
    reward.place(backend)                           # the recipe does this; unplaced, it scores on the CPU
    reward(prompts=prompts, completions=completions)   # -> one float per completion, via agents.call_rewards

The trainer is the preference step (`algorithms.preference.PreferenceTrainer`) with the scalar head's values of the
2B stacked rows for the pair scores: the same fixed shapes, accumulation and logged figures (the rewards are the
head's values). `ModelReward` renders each prompt and completion with the reward model's own chat template, and
scores them on the device in batches of `ROWS` rows, right-padded to a multiple of `WIDTH` tokens (fixed shapes: a
graph per width on XLA), with one host read per call. More: docs/algorithms/reward_model.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from tpu_helpers.algorithms.preference import PreferenceTrainer, _gather, _pair_sums, stack_pairs
from tpu_helpers.algorithms.preference_loss import PairLoss
from tpu_helpers.config import ConfigError
from tpu_helpers.data.loaders import fixed_batches
from tpu_helpers.models.reward_model import check_reward_model, load_reward_model, sequence_scores

PREFIX = "model:"  # REWARDS entries that name a reward model's directory
ROWS = 16  # completions per scoring batch (the last batch padded to it)
WIDTH = 64  # scoring rows are right-padded to a multiple of this many tokens


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> PairLoss:
    """Per pair: -log sigmoid(chosen - rejected - margin), plus center_rewards_coefficient x (chosen + rejected)^2;
    their mean is TRL RewardTrainer's loss. The rewards logged are the scores themselves."""
    c, r = chosen.float(), rejected.float()
    d = c - r if margin is None else c - r - margin.float()
    losses = -F.logsigmoid(d)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (c + r) ** 2
    return PairLoss(losses, c.detach(), r.detach())


def pair_scores(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The head's values (2B,) of a loader batch of B pairs, chosen rows first (a plain function: it is replayed)."""
    rows = stack_pairs(batch)
    return sequence_scores(model, rows["input_ids"], rows["attention_mask"])


class RewardModelTrainer(PreferenceTrainer):
    """Bradley-Terry over pairs on a sequence classifier (see the module docstring)."""

    def pair_loss(self, batch: dict, split: str = "train") -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                                                    torch.Tensor]:
        """(per-pair losses, the logged figures' sums, 0): a reward model has no NLL term."""
        chosen, rejected = self.replayed(pair_scores, self.model, batch).chunk(2)
        out = bradley_terry_loss(chosen, rejected, margin=batch.get("margin"),
                                 center_rewards_coefficient=self.settings.center_rewards_coefficient)
        return out.losses, _pair_sums(out), torch.zeros((), device=chosen.device)

    @torch.no_grad()
    def score_pairs(self, data: Any, ref: torch.Tensor | None = None) -> dict:
        """The head's values of chosen and rejected (pairs, 2) over `data`, in fixed batches, one host read at the
        end: {"logps": None, "rewards": scores} (a reward model has no log-probabilities)."""
        b = self.backend
        was_training = self.model.training
        self.model.eval()
        parts = []
        for idx, real in fixed_batches(len(data), self.loader_batch_size):
            with b.autocast():
                scores = pair_scores(self.model, b.to_device(_gather(data, idx)))
            parts.append(torch.stack(scores.chunk(2), 1)[:real])
            b.sync()
        self.model.train(was_training)
        return {"logps": None, "rewards": b.to_cpu(torch.cat(parts))}


def _messages(value: Any, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    return [{"role": m["role"], "content": m.get("content") or ""} for m in value]


class ModelReward:
    """A reward function backed by a reward model's directory (see the module docstring): checked when built (a
    ConfigError naming `path` unless it is a sequence classifier), loaded on its first call."""

    def __init__(self, path: str, *, setting: str = "REWARDS") -> None:
        self.path = str(check_reward_model(path, setting=setting))
        self.__name__ = PREFIX + str(path)
        self.backend: Any = None

    def place(self, backend: Any) -> None:
        """Score on `backend`'s device, in its precision (before the first call)."""
        if "_loaded" in self.__dict__ and backend is not self.backend:
            raise ConfigError(f"{self.__name__} is already loaded on another device; place it before its first call")
        self.backend = backend

    @cached_property
    def _loaded(self) -> tuple[torch.nn.Module, Any]:
        if self.backend is None:
            from tpu_helpers.backend import get_backend

            self.backend = get_backend("cpu", precision="fp32")
        dtype = torch.bfloat16 if self.backend.precision == "bf16" else None
        model, tokenizer = load_reward_model(self.path, dtype=dtype)
        model.requires_grad_(False).eval()
        return self.backend.move_model(model), tokenizer

    def rows(self, prompts: Sequence, completions: Sequence) -> list[list[int]]:
        """Each prompt and completion through the reward model's chat template (strings as a user's and an
        assistant's turn; messages as they are), as token ids."""
        _, tok = self._loaded
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            messages = _messages(prompt, "user") + _messages(completion, "assistant")
            if tok.chat_template:
                text = tok.apply_chat_template(messages, tokenize=False)
            else:
                text = "".join(m["content"] for m in messages)
            out.append(tok(text, add_special_tokens=False)["input_ids"])
        return out

    @torch.no_grad()
    def __call__(self, prompts: Sequence, completions: Sequence, **_: Any) -> list[float]:
        """One score per completion (see the module docstring)."""
        model, tok = self._loaded
        b = self.backend
        rows = self.rows(prompts, completions)
        longest = max(len(r) for r in rows)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise ConfigError(f"{self.__name__}: a prompt and completion of {longest} tokens exceeds the reward "
                              f"model's context of {limit} tokens; shorten MAX_PROMPT_LEN or MAX_NEW_TOKENS")
        width = -(-longest // WIDTH) * WIDTH
        if limit is not None:
            width = min(width, limit)
        pad = model.config.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        parts = []
        for idx, real in fixed_batches(len(rows), ROWS):
            t = torch.as_tensor(idx)
            with b.autocast():
                scores = sequence_scores(model, b.to_device(ids[t]), b.to_device(mask[t]))
            parts.append(scores[:real])
            b.sync()
        return b.to_cpu(torch.cat(parts)).tolist()


def place_reward_models(rewards: dict, backend: Any) -> None:
    """Place every reward model among `rewards` ({name: function}) on `backend`."""
    for fn in rewards.values():
        if isinstance(fn, ModelReward):
            fn.place(backend)

