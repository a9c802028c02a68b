"""GRPO's loss as pure functions, each variant chosen by name (as Tunix does): the advantages (SCALE_REWARDS), the
importance ratio (IMPORTANCE), the clipped surrogate with clip-higher (CLIP_EPS, EPSILON_HIGH) and the divisor of
the step's token losses (LOSS_TYPE). `algorithms.grpo.GRPOTrainer` calls them; each is defined as TRL 1.16's
`GRPOTrainer` defines it (`_compute_loss`; the advantages of `_generate_and_score_completions`) and is tested against
TRL's own code on the same tensors (tests/algorithms/test_grpo_loss.py).

    adv = group_advantages(rewards, 8, scale="group")                     # one per row, rows group by group
    divisor = step_divisor("dapo", step_mask, max_new_tokens, backend.all_reduce_mean)   # once per optimizer step
    per_token, kl, clipped = policy_terms(logp, old, ref, adv, mask, clip_eps=0.2, epsilon_high=0.28,
                                          kl_beta=0.04, importance="token")
    loss = micro_batch_loss("dapo", per_token, mask, divisor)            # the micro-batch losses add up to the step's

LOSS_TYPE: every type sums the per-token loss over this process's completion tokens; the types differ in how the
tokens are weighed and what the sum is divided by:

    grpo     each row's mean over its tokens, then the mean over the rows (DeepSeekMath's GRPO). A token of a short
             answer weighs more than one of a long answer: a length bias towards short right answers and long
             wrong ones.
    bnpo     the step's completion-token count on this process: every token weighs the same (TRL's name; this
             package's one loss before LOSS_TYPE existed).
    dr_grpo  rows x MAX_NEW_TOKENS, a constant (Dr. GRPO): no length bias, and a scale that does not move with the
             answers' lengths.
    dapo     the step's completion-token count averaged over the data-parallel processes (DAPO's token-level loss):
             every token of the global step weighs the same, whichever process holds it.

Over GRAD_ACCUM: each divisor is the whole optimizer step's (all its micro-batches), and the micro-batch losses add
up to the step's loss, so the gradient does not depend on GRAD_ACCUM. That is TRL's definition for grpo, dr_grpo and
dapo (with TRL's default steps_per_generation = gradient_accumulation_steps); TRL's bnpo divides each micro-batch by
its own token count and averages the micro-batches, so this bnpo is TRL's with gradient_accumulation_steps 1.

Over processes: gradients are averaged over data-parallel processes (DDP, `xm.reduce_gradients`), so dapo divides
by the mean token count over processes (`backend.all_reduce_mean`, an all-reduce on the device, never a host read),
which makes the averaged gradient sum(tokens' losses) / global tokens, as TRL's num_items_in_batch / num_processes.
On one process, and under SPMD (one program over every chip, whose tensors are global already) bnpo and dapo are
the same loss.

IMPORTANCE: "token" (each token's ratio exp(logp - logp_old), PPO's) | "sequence" (GSPO: one ratio per row, the exp
of the mean of logp - logp_old over its completion tokens, clipped as a whole; TRL's importance_sampling_level).
TRL suggests grpo with the sequence ratio: the token-sum types weigh each sequence by its length.

SCALE_REWARDS (TRL's names): "group" (A = (r - group mean) / (group std + 1e-4)) | "batch" (the same centring, divided
by the std of every reward of the step, over all processes: PPO-Lite's "group mean, batch std") | "none" (r - group
mean: Dr. GRPO, for which the std over-weighs the groups whose answers barely differ, the too easy and too hard
questions). Stds with Bessel's correction, as TRL's `nanstd`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpu_helpers.core.choices import GRPO_IMPORTANCE, GRPO_LOSS_TYPES, GRPO_SCALE_REWARDS, check_choice

LOSS_TYPES = GRPO_LOSS_TYPES
IMPORTANCE_LEVELS = GRPO_IMPORTANCE
SCALE_REWARDS = GRPO_SCALE_REWARDS


def group_advantages(rewards: torch.Tensor, group: int, *, scale: str = "group", batch: torch.Tensor | None = None,
                     eps: float = 1e-4) -> torch.Tensor:
    """Advantages of rewards laid out group by group (G consecutive rows each): r - group mean, divided by the
    group's std + eps ("group"), by the std of `batch` + eps ("batch"; `batch`: every reward of the step across
    processes, default `rewards`) or not at all ("none")."""
    check_choice("scale_rewards", scale, SCALE_REWARDS)
    r = rewards.float().reshape(-1, group)
    centred = (r - r.mean(1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = r.std(1, keepdim=True).expand_as(r).reshape(-1)
    else:
        std = (rewards if batch is None else batch).float().std()
    return centred / (std + eps)


def step_divisor(loss_type: str, mask: torch.Tensor, max_tokens: int,
                 all_reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | float:
    """What the whole optimizer step's loss is divided by (see the module docstring): `mask` is the completion mask
    (rows, max_tokens) of every micro-batch of the step on this process; `all_reduce_mean` averages a device tensor
    over the data-parallel processes (`backend.all_reduce_mean`; only dapo uses it)."""
    check_choice("loss_type", loss_type, LOSS_TYPES)
    rows = mask.shape[0]
    if loss_type == "grpo":
        return float(rows)
    if loss_type == "dr_grpo":
        return float(rows * max_tokens)
    tokens = mask.sum().float()
    if loss_type == "bnpo":
        return tokens.clamp(min=1.0)
    mean = tokens if all_reduce_mean is None else all_reduce_mean(tokens)
    # TRL clamps the global count at 1; the mean over P processes is then >= 1 / P. Only a step without a single
    # completion token (numerator 0) reaches this floor: a loss of 0 rather than nan.
    return mean.clamp(min=1e-6)


def policy_terms(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float, kl_beta: float,
                 epsilon_high: float | None = None,
                 importance: str = "token") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of (rows, N) inputs, unmasked: (clipped surrogate + kl_beta * k3 KL to the reference, the KL, 1.0
    where the ratio was clipped). The ratio exp(logp - old_logp) per token, or per row (`importance` "sequence": the
    mean log-ratio over the row's completion tokens); clipped to [1 - clip_eps, 1 + epsilon_high] (default
    clip_eps). No KL without `ref_logp`."""
    check_choice("importance", importance, IMPORTANCE_LEVELS)
    high = clip_eps if epsilon_high is None else epsilon_high
    m = mask.float()
    log_ratio = logp - old_logp
    if importance == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
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


def micro_batch_loss(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor,
                     divisor: torch.Tensor | float) -> torch.Tensor:
    """One micro-batch's share of the step's loss: its masked per-token losses (grpo: each row's averaged over its
    tokens) summed and divided by the step's `divisor` (`step_divisor`)."""
    check_choice("loss_type", loss_type, LOSS_TYPES)
    m = mask.float()
    if loss_type == "grpo":
        m = m / m.sum(-1, keepdim=True).clamp(min=1.0)
    return (per_token * m).sum() / divisor
