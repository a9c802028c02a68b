"""Preference losses as pure functions of completion log-probabilities: DPO (sigmoid, with cDPO label smoothing;
IPO) and ORPO, each with the chosen and rejected rewards TRL logs, and the settings that choose between them.
`algorithms.preference.PreferenceTrainer` runs them; tests hold each to TRL's own code on the same inputs.

    settings = PreferenceSettings(algorithm="dpo", loss_type="sigmoid", beta=0.1)   # checked and parsed once
    out = dpo_loss(pol_c, pol_r, ref_c, ref_r, settings=settings, chosen_tokens=nc, rejected_tokens=nr)
    out.losses.mean()        # per pair; out.chosen_rewards, out.rejected_rewards: beta x log-ratio to the reference
    out = orpo_loss(mean_c, mean_r, settings=settings)      # the odds-ratio term per pair (add the chosen NLL)

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
from tpu_helpers.core.choices import check_choice, choose

ALGORITHMS = ("dpo", "orpo")  # DPO scores pairs against a reference model; ORPO by their odds, without one


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

    algorithm: str = "dpo"  # dpo (against a reference) | orpo (no reference)
    loss_type: str = "sigmoid"  # DPO's loss: sigmoid | ipo
    beta: float = 0.1  # DPO's beta (the sigmoid's scale, IPO's tau)
    label_smoothing: float = 0.0  # cDPO: the assumed share of flipped labels in [0, 0.5), sigmoid only
    orpo_lambda: float = 0.1  # ORPO: the odds-ratio term's weight (TRL's ORPOConfig calls it beta)
    precompute_ref: bool = False  # DPO: the reference's log-probabilities once, before training

    # The choices above as the step uses them, set once by __post_init__.
    uses_reference: bool = field(init=False, repr=False, compare=False)  # DPO: the rewards are log-ratios to it
    pair_losses: Callable[..., torch.Tensor] = field(init=False, repr=False, compare=False)  # DPO_LOSSES[loss_type]

    def __post_init__(self) -> None:
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        object.__setattr__(self, "uses_reference", self.algorithm == "dpo")
        object.__setattr__(self, "pair_losses", choose("loss_type", self.loss_type, DPO_LOSSES))
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
        if self.precompute_ref and not self.uses_reference:
            raise ConfigError("precompute_ref=True: ORPO has no reference model; set it False (or algorithm='dpo')")


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

