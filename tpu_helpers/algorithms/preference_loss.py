"""Preference losses as pure functions of completion log-probabilities: DPO (sigmoid, with cDPO label smoothing;
IPO), ORPO, SimPO (CPO's loss_type "simpo") and KTO, each with the rewards TRL logs, and the settings that choose
between them. `algorithms.preference.PreferenceTrainer` runs them; tests hold each to TRL's own code on the same
inputs.

    settings = PreferenceSettings(algorithm="dpo", loss_type="sigmoid", beta=0.1)   # checked and parsed once
    out = dpo_loss(pol_c, pol_r, ref_c, ref_r, settings=settings, chosen_tokens=nc, rejected_tokens=nr)
    out.losses.mean()        # per pair; out.chosen_rewards, out.rejected_rewards: beta x log-ratio to the reference
    out = orpo_loss(mean_c, mean_r, settings=settings)      # the odds-ratio term per pair (add the chosen NLL)
    out = simpo_loss(mean_c, mean_r, settings=settings)     # SimPO per pair (add cpo_alpha x the chosen NLL)
    out = kto_loss(logps, ref, kl_logps, ref_kl, desirable, settings=settings)   # KTO per labelled completion

DPO's loss types are a registry (`DPO_LOSSES`, by TRL's names) the settings parse once. The formulas, and where
they differ from TRL 1.16's: docs/algorithms/preference.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import check_choice, choose, is_finite_number

# DPO scores pairs against a reference model; ORPO by their odds and SimPO by their mean log-probabilities, without
# one; KTO scores single completions labelled desirable or not against the reference; "reward" trains a reward
# model: a scalar head on the pairs (algorithms.reward_model).
ALGORITHMS = ("dpo", "orpo", "kto", "simpo", "reward")


def _sigmoid_losses(chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor, settings: PreferenceSettings,
                    chosen_tokens: torch.Tensor | None, rejected_tokens: torch.Tensor | None) -> torch.Tensor:
    d = settings.beta * (chosen_ratio - rejected_ratio)
    eps = settings.label_smoothing
    return -F.logsigmoid(d) * (1 - eps) - F.logsigmoid(-d) * eps if eps else -F.logsigmoid(d)


def _ipo_losses(chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor, settings: PreferenceSettings,
                chosen_tokens: torch.Tensor | None, rejected_tokens: torch.Tensor | None) -> torch.Tensor:
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError("loss_type='ipo' needs chosen_tokens and rejected_tokens (completion lengths)")
    d = chosen_ratio / chosen_tokens.float().clamp(min=1) - rejected_ratio / rejected_tokens.float().clamp(min=1)
    return (d - 1 / (2 * settings.beta)) ** 2


# DPO's LOSS_TYPE: per pair, from the log-ratios to the reference of the chosen and rejected answers.
DPO_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"sigmoid": _sigmoid_losses, "ipo": _ipo_losses}


@dataclass(frozen=True)
class PreferenceSettings:
    """What preference tuning does, apart from the model, the data and the run. Each field is also a notebook
    parameter of the recipe (`recipes.preference.PreferenceConfig` takes these fields as its own); checked, and the
    choices parsed, here, once."""

    algorithm: str = "dpo"  # dpo | kto (against a reference) | orpo | simpo (no reference)
    loss_type: str = "sigmoid"  # DPO's loss: sigmoid | ipo
    beta: float = 0.1  # DPO and KTO: the log-ratio's scale (IPO's tau); SimPO: the mean log-probability's
    label_smoothing: float = 0.0  # cDPO and SimPO: the assumed share of flipped labels in [0, 0.5)
    orpo_lambda: float = 0.1  # ORPO: the odds-ratio term's weight (TRL's ORPOConfig calls it beta)
    precompute_ref: bool = False  # DPO and KTO: the reference's log-probabilities once, before training
    desirable_weight: float = 1.0  # KTO: the weight of a desirable completion's loss
    undesirable_weight: float = 1.0  # KTO: the weight of an undesirable completion's loss
    simpo_gamma: float = 0.5  # SimPO: the target reward margin gamma
    cpo_alpha: float = 0.0  # SimPO: the chosen answers' NLL weight (CPO's; 0 is SimPO alone)
    center_rewards_coefficient: float | None = None  # reward: TRL's weight of the mean squared summed score, or None

    # The choices above as the step uses them, set once by __post_init__.
    uses_reference: bool = field(init=False, repr=False, compare=False)  # DPO, KTO: the rewards are log-ratios to it
    unpaired: bool = field(init=False, repr=False, compare=False)  # KTO: labelled completions, not pairs
    nll_weight: float = field(init=False, repr=False, compare=False)  # the chosen NLL's weight: ORPO 1, SimPO alpha
    mean_losses: Callable[..., PairLoss] | None = field(init=False, repr=False, compare=False)  # ORPO's, SimPO's
    pair_losses: Callable[..., torch.Tensor] = field(init=False, repr=False, compare=False)  # DPO_LOSSES[loss_type]

    def __post_init__(self) -> None:
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        object.__setattr__(self, "uses_reference", self.algorithm in ("dpo", "kto"))
        object.__setattr__(self, "unpaired", self.algorithm == "kto")
        object.__setattr__(self, "nll_weight", {"orpo": 1.0, "simpo": self.cpo_alpha}.get(self.algorithm, 0.0))
        object.__setattr__(self, "mean_losses", {"orpo": orpo_loss, "simpo": simpo_loss}.get(self.algorithm))
        object.__setattr__(self, "pair_losses", choose("loss_type", self.loss_type, DPO_LOSSES))
        for name in ("beta", "orpo_lambda"):
            value = getattr(self, name)
            if not is_finite_number(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a finite number > 0")
        for name in ("desirable_weight", "undesirable_weight", "simpo_gamma", "cpo_alpha"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            raise ConfigError("desirable_weight=0 and undesirable_weight=0: KTO would learn nothing; give either > 0")
        ls = self.label_smoothing
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0 <= ls < 0.5:
            raise ConfigError(f"label_smoothing={ls!r} must be a number in [0, 0.5) (the share of flipped labels)")
        if ls and self.algorithm not in ("dpo", "simpo"):
            raise ConfigError(f"label_smoothing={ls!r} applies to algorithm 'dpo' (loss_type='sigmoid') and 'simpo' "
                              f"only; algorithm={self.algorithm!r}")
        if ls and self.algorithm == "dpo" and self.loss_type != "sigmoid":
            raise ConfigError(f"label_smoothing={ls!r} applies to loss_type='sigmoid' only; "
                              f"loss_type={self.loss_type!r}")
        crc = self.center_rewards_coefficient
        if crc is not None and (not is_finite_number(crc) or crc < 0):
            raise ConfigError(f"center_rewards_coefficient={crc!r} must be None or a finite number >= 0 (TRL's "
                              "RewardConfig: e.g. 0.01)")
        if crc is not None and self.algorithm != "reward":
            raise ConfigError(f"center_rewards_coefficient={crc!r} applies to algorithm='reward' only; "
                              f"algorithm={self.algorithm!r}")
        if not isinstance(self.precompute_ref, bool):
            raise ConfigError(f"precompute_ref={self.precompute_ref!r} must be True or False")
        if self.precompute_ref and not self.uses_reference:
            raise ConfigError(f"precompute_ref=True: {self.algorithm.upper()} has no reference model; set it False "
                              "(or algorithm='dpo' or 'kto')")


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
    chosen_ratio = chosen_logps.float() - ref_chosen_logps.float()
    rejected_ratio = rejected_logps.float() - ref_rejected_logps.float()
    losses = settings.pair_losses(chosen_ratio, rejected_ratio, settings, chosen_tokens, rejected_tokens)
    beta = settings.beta
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


def simpo_loss(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor, *,
               settings: PreferenceSettings) -> PairLoss:
    """SimPO per pair from mean per-token log-probabilities (pairs,): -log sigmoid(beta (mean_c - mean_r) - gamma),
    with label smoothing as CPO's; the rewards are beta x the means. The full loss adds cpo_alpha x the chosen NLL."""
    beta, eps = settings.beta, settings.label_smoothing
    c, r = chosen_mean_logps.float(), rejected_mean_logps.float()
    d = beta * ((c - r) - settings.simpo_gamma / beta)
    losses = -F.logsigmoid(d) * (1 - eps) - F.logsigmoid(-d) * eps if eps else -F.logsigmoid(d)
    return PairLoss(losses, beta * c.detach(), beta * r.detach())


class KTOLoss(NamedTuple):
    """Per labelled completion: the weighted loss and the reward beta x log-ratio; and the batch's KL estimate."""

    losses: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor,
             desirable: torch.Tensor, *, settings: PreferenceSettings) -> KTOLoss:
    """KTO per completion from summed log-probabilities (n,) of the policy and the reference, of each completion and
    of its mismatched one (its prompt with another example's completion): the KL estimate is the batch's mean
    log-ratio of the mismatched ones, detached and at least 0; a desirable completion's loss is
    1 - sigmoid(beta (ratio - kl)), an undesirable one's 1 - sigmoid(beta (kl - ratio)), each times its weight."""
    beta = settings.beta
    ratio = logps.float() - ref_logps.float()
    kl = (kl_logps.float() - ref_kl_logps.float()).mean().detach().clamp(min=0)
    desirable = desirable.bool()
    losses = torch.where(desirable, settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return KTOLoss(losses, beta * ratio.detach(), kl)
