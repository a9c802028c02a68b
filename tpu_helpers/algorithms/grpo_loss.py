"""GRPO's loss as pure functions of tensors, each variant a registry entry chosen by name (as Tunix registers its
losses): LOSS_TYPES (what the step's token losses are divided by), IMPORTANCE_LEVELS (the ratio per token or per
answer) and SCALE_REWARDS (what the advantages are divided by). `GRPOSettings` parses each name once; the step
(`algorithms.grpo.GRPOTrainer.train_step`) calls the chosen entries. Each is TRL 1.16's definition, tested against
TRL's own code on the same tensors (tests/algorithms/test_grpo_loss.py).

    adv = group_advantages(rewards, 8, scale=SCALE_REWARDS["group"])        # one per row, rows group by group
    loss_type = LOSS_TYPES["dapo"]
    divisor = step_divisor(loss_type, step_mask, max_new_tokens, backend.all_reduce_mean)   # once per step
    per_token, kl, clipped = policy_terms(logp, old, ref, adv, mask, clip_eps=0.2, epsilon_high=0.28, kl_beta=0.04,
                                          importance=IMPORTANCE_LEVELS["token"])
    loss = micro_batch_loss(loss_type, per_token, mask, divisor)    # the micro-batch losses add up to the step's

What each variant does, and how the divisors span micro-batches and processes: docs/algorithms/grpo.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

AllReduceMean = Callable[[torch.Tensor], torch.Tensor]


# ---- LOSS_TYPE: the divisor of the step's summed token losses ----------------------------------------------------
def _rows(mask: torch.Tensor, max_tokens: int, all_reduce_mean: AllReduceMean | None) -> float:
    return float(mask.shape[0])


def _rows_x_max_tokens(mask: torch.Tensor, max_tokens: int, all_reduce_mean: AllReduceMean | None) -> float:
    return float(mask.shape[0] * max_tokens)


def _local_tokens(mask: torch.Tensor, max_tokens: int, all_reduce_mean: AllReduceMean | None) -> torch.Tensor:
    return mask.sum().float().clamp(min=1.0)


def _mean_tokens(mask: torch.Tensor, max_tokens: int, all_reduce_mean: AllReduceMean | None) -> torch.Tensor:
    tokens = mask.sum().float()
    mean = tokens if all_reduce_mean is None else all_reduce_mean(tokens)
    # TRL clamps the global count at 1; the mean over P processes is then >= 1 / P. Only a step without a single
    # completion token (numerator 0) reaches this floor: a loss of 0 rather than nan.
    return mean.clamp(min=1e-6)


def _token_weights(mask: torch.Tensor) -> torch.Tensor:
    return mask.float()


def _row_mean_weights(mask: torch.Tensor) -> torch.Tensor:
    m = mask.float()
    return m / m.sum(-1, keepdim=True).clamp(min=1.0)


class LossType(NamedTuple):
    """A LOSS_TYPE: the step's divisor (mask, max_tokens, all_reduce_mean) and each token's weight in the sum."""

    divisor: Callable[[torch.Tensor, int, AllReduceMean | None], torch.Tensor | float]
    weights: Callable[[torch.Tensor], torch.Tensor] = _token_weights


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(_rows, _row_mean_weights),  # each row's mean over its tokens, then the mean over the rows
    "bnpo": LossType(_local_tokens),  # the step's completion tokens on this process
    "dr_grpo": LossType(_rows_x_max_tokens),  # rows x MAX_NEW_TOKENS, a constant
    "dapo": LossType(_mean_tokens),  # the step's completion tokens, averaged over the data-parallel processes
}


# ---- IMPORTANCE: the log-ratio per token or per answer -----------------------------------------------------------
def _token_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _sequence_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # GSPO: the row's mean


IMPORTANCE_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_ratio, "sequence": _sequence_log_ratio}


# ---- SCALE_REWARDS: what the centred rewards are divided by -------------------------------------------------------
def _by_group_std(centred: torch.Tensor, grouped: torch.Tensor, batch: torch.Tensor, eps: float) -> torch.Tensor:
    return centred / (grouped.std(1, keepdim=True).expand_as(grouped).reshape(-1) + eps)


def by_batch_std(centred: torch.Tensor, grouped: torch.Tensor, batch: torch.Tensor, eps: float) -> torch.Tensor:
    return centred / (batch.float().std() + eps)


def _unscaled(centred: torch.Tensor, grouped: torch.Tensor, batch: torch.Tensor, eps: float) -> torch.Tensor:
    return centred


Scale = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
SCALE_REWARDS: dict[str, Scale] = {"group": _by_group_std, "batch": by_batch_std, "none": _unscaled}


# ---- the functions the step calls --------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group: int, *, scale: Scale = _by_group_std,
                     batch: torch.Tensor | None = None, eps: float = 1e-4) -> torch.Tensor:
    """Advantages of rewards laid out group by group (G consecutive rows each): r - group mean, scaled by a
    SCALE_REWARDS entry (`batch`: every reward of the step across processes, default `rewards`)."""
    r = rewards.float().reshape(-1, group)
    centred = (r - r.mean(1, keepdim=True)).reshape(-1)
    return scale(centred, r, rewards if batch is None else batch, eps)


def step_divisor(loss_type: LossType, mask: torch.Tensor, max_tokens: int,
                 all_reduce_mean: AllReduceMean | None = None) -> torch.Tensor | float:
    """What the whole optimizer step's loss is divided by: `mask` is the completion mask of every micro-batch of the
    step on this process (rows x at most `max_tokens` columns: the CPU drops the columns no row uses);
    `all_reduce_mean` averages a device tensor over the data-parallel processes (`backend.all_reduce_mean`; only
    dapo uses it)."""
    return loss_type.divisor(mask, max_tokens, all_reduce_mean)


def policy_terms(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float, kl_beta: float,
                 epsilon_high: float | None = None, importance: Callable = _token_log_ratio,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of (rows, N) inputs, unmasked: (clipped surrogate + kl_beta * k3 KL to the reference, the KL, 1.0
    where the ratio was clipped). The ratio exp(logp - old_logp) at an IMPORTANCE_LEVELS entry's level, clipped to
    [1 - clip_eps, 1 + epsilon_high] (default clip_eps). No KL without `ref_logp`."""
    high = clip_eps if epsilon_high is None else epsilon_high
    m = mask.float()
    ratio = torch.exp(importance(logp - old_logp, m))
    adv = advantages.unsqueeze(-1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv)
    clipped = (((ratio < 1.0 - clip_eps) & (adv < 0)) | ((ratio > 1.0 + high) & (adv > 0))).float()
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    else:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1.0
        per_token = per_token + kl_beta * kl
    # A sequence ratio is one value per row: each of the row's tokens carries it.
    return per_token.expand_as(logp), kl, clipped.expand_as(logp)


def micro_batch_loss(loss_type: LossType, per_token: torch.Tensor, mask: torch.Tensor,
                     divisor: torch.Tensor | float) -> torch.Tensor:
    """One micro-batch's share of the step's loss: its per-token losses weighed as the loss type says (grpo: each
    row's averaged over its tokens) summed and divided by the step's `divisor` (`step_divisor`)."""
    return (per_token * loss_type.weights(mask)).sum() / divisor
