"""Preference losses as pure functions of completion log-probabilities: DPO (sigmoid, with cDPO label smoothing;
IPO) and ORPO, each with the chosen and rejected rewards TRL logs; and the per-token log-probabilities they start
from. `algorithms.preference.PreferenceTrainer` runs them; tests hold each to TRL's own code on the same inputs.

    settings = PreferenceSettings(algorithm="dpo", loss_type="sigmoid", beta=0.1)   # checked once
    out = dpo_loss(pol_c, pol_r, ref_c, ref_r, settings=settings, chosen_tokens=nc, rejected_tokens=nr)
    out.losses.mean()        # per pair; out.chosen_rewards, out.rejected_rewards: beta x log-ratio to the reference
    out = orpo_loss(mean_c, mean_r, settings=settings)      # the odds-ratio term per pair (add the chosen NLL)

DPO (Rafailov et al. 2023), per pair, with d = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)) of the summed
completion log-probabilities:

    sigmoid   -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)     eps = label_smoothing (cDPO; 0: the paper)
    ipo       (d_c / n_c - d_r / n_r - 1 / (2 beta))^2                        the log-ratios per completion token (TRL)

TRL 1.16's `sigmoid` no longer reads label_smoothing (only `robust`, `exo_pair` and `aot` do); its `aot` on one
pair is exactly the cDPO form above, which is what the tests compare against. ORPO (Hong et al. 2024) has no
reference: loss = NLL of the chosen completion + mean over pairs of -lambda log sigmoid(log odds), the log odds
log(p_c / (1 - p_c)) - log(p_r / (1 - p_r)) of the length-normalised (mean per token) log-probabilities p.
Its rewards are lambda x those mean log-probabilities (TRL's). The chosen NLL here is over the completion tokens
(the labels), as the package's SFT trains; TRL's ORPOTrainer counts the prompt tokens too.

The log-probabilities come in (`algorithms.preference.pair_logps` computes them from the model, in chunks of
positions through `models.lm_head`): everything here is a function of tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import DPO_LOSS_TYPES, PREFERENCE_ALGORITHMS

ALGORITHMS = PREFERENCE_ALGORITHMS
LOSS_TYPES = DPO_LOSS_TYPES


@dataclass(frozen=True)
class PreferenceSettings:
    """What preference tuning does, apart from the model, the data and the run; each field checked here, once.

    algorithm: "dpo" (against a reference) | "orpo" (no reference); loss_type: DPO's loss, "sigmoid" | "ipo";
    beta: DPO's beta (the sigmoid's scale, IPO's tau); label_smoothing: cDPO's eps in [0, 0.5), sigmoid only;
    orpo_lambda: the weight of ORPO's odds-ratio term (TRL's ORPOConfig calls it beta); precompute_ref: DPO's
    reference log-probabilities computed once before training instead of a reference forward every step.
    """

    algorithm: str = "dpo"
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1
    precompute_ref: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm={self.algorithm!r} is not one of {ALGORITHMS}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type={self.loss_type!r} is not one of {LOSS_TYPES} (DPO's losses)")
        for name in ("beta", "orpo_lambda"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                      and value > 0):
                raise ConfigError(f"{name}={value!r} must be a finite number > 0")
        ls = self.label_smoothing
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0 <= ls < 0.5:
            raise ConfigError(f"label_smoothing={ls!r} must be a number in [0, 0.5) (the share of flipped labels)")
        if ls and self.loss_type != "sigmoid":
            raise ConfigError(f"label_smoothing={ls!r} applies to loss_type='sigmoid' only; "
                              f"loss_type={self.loss_type!r}")
        if not isinstance(self.precompute_ref, bool):
            raise ConfigError(f"precompute_ref={self.precompute_ref!r} must be True or False")
        if self.precompute_ref and self.algorithm == "orpo":
            raise ConfigError("precompute_ref=True: ORPO has no reference model; set it False (or algorithm='dpo')")

    @property
    def uses_reference(self) -> bool:
        return self.algorithm == "dpo"


class PairLoss(NamedTuple):
    """Per pair: the loss (ORPO: the odds-ratio term only), and the rewards TRL logs for chosen and rejected."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, settings: PreferenceSettings,
             chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None) -> PairLoss:
    """DPO per pair from summed completion log-probabilities (pairs,) of the policy and the reference; IPO also
    needs each completion's token count (see the module docstring)."""
    beta = settings.beta
    chosen_ratio = chosen_logps.float() - ref_chosen_logps.float()
    rejected_ratio = rejected_logps.float() - ref_rejected_logps.float()
    if settings.loss_type == "sigmoid":
        d = beta * (chosen_ratio - rejected_ratio)
        eps = settings.label_smoothing
        losses = -F.logsigmoid(d) * (1 - eps) - F.logsigmoid(-d) * eps if eps else -F.logsigmoid(d)
    else:  # ipo
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type='ipo' needs chosen_tokens and rejected_tokens (completion lengths)")
        d = chosen_ratio / chosen_tokens.float().clamp(min=1) - rejected_ratio / rejected_tokens.float().clamp(min=1)
        losses = (d - 1 / (2 * beta)) ** 2
    return PairLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (Maechler 2012: switch at -log 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor) -> torch.Tensor:
    """log odds(chosen) - log odds(rejected) of mean per-token log-probabilities (pairs,)."""
    c, r = chosen_mean_logps.float(), rejected_mean_logps.float()
    return (c - r) - (log1mexp(c) - log1mexp(r))


def orpo_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, *,
              settings: PreferenceSettings) -> PairLoss:
    """ORPO's odds-ratio term per pair, -lambda log sigmoid(log odds); the full loss adds the chosen NLL."""
    lam = settings.orpo_lambda
    losses = -lam * F.logsigmoid(orpo_log_odds(chosen_mean_logps, rejected_mean_logps))
    return PairLoss(losses, lam * chosen_mean_logps.float().detach(), lam * rejected_mean_logps.float().detach())

