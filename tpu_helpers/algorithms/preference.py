"""Preference tuning (DPO, ORPO, SimPO, KTO) on the package's Trainer: push a causal LM towards the chosen answer of
each pair and away from the rejected one, or, for KTO, towards desirable completions and away from undesirable ones.
One step (`PreferenceTrainer.train_step`): the log-probabilities of each micro-batch's B items as 2B rows in one
forward (a pair's chosen and rejected rows; a KTO completion's row and its mismatched row for the KL estimate), the
losses of `algorithms.preference_loss` against the reference (DPO, KTO) or from the mean log-probabilities (ORPO's
odds, SimPO's margin; plus the chosen answers' NLL), a backward each, then the optimizer step; the step's loss is the
mean over all its items.

    settings = PreferenceSettings(algorithm="dpo", beta=0.1, precompute_ref=True)   # algorithms.preference_loss
    trainer = PreferenceTrainer(model, pairs, val_pairs, config=cfg, settings=settings)  # data.preference rows
    report = trainer.fit()          # resume, signals, the run lock, the XLA detector as for SFT

The reference (DPO, KTO) is the model with its adapter disabled under LoRA, else `ref_model`, a frozen copy; with
`precompute_ref` its log-probabilities of every item's two rows are computed once when `fit` starts and the copy
dropped. Logged per log step: the loss, the mean chosen (desirable) and rejected (undesirable) rewards, their margin,
the preference accuracy (KTO: the share of completions whose reward has their label's sign) and KTO's KL estimate.
More: docs/algorithms/preference.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tpu_helpers.algorithms.preference_loss import (
    KTOLoss,
    PairLoss,
    PreferenceSettings,
    dpo_loss,
    kto_loss,
)
from tpu_helpers.config import ConfigError
from tpu_helpers.data.loaders import fixed_batches
from tpu_helpers.models import lm_head, lora
from tpu_helpers.training.step import StepFigures
from tpu_helpers.training.trainer import Trainer


def stack_pairs(batch: dict) -> dict:
    """A batch of B pairs (B, 2, L) as 2B rows: the chosen rows, then the rejected ones."""
    return {k: torch.cat([batch[k][:, 0], batch[k][:, 1]]) for k in ("input_ids", "attention_mask", "labels")}


def pair_logps(model: torch.nn.Module, rows: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed answer log-probabilities, answer token counts, per-token log-probabilities) of 2B stacked rows."""
    per_token = lm_head.token_logps(model, rows["input_ids"], rows["labels"], attention_mask=rows["attention_mask"])
    mask = (rows["labels"][:, 1:] != -100).float()
    return per_token.sum(-1), mask.sum(-1), per_token


def batch_pair_logps(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pair_logps` of a loader batch of pairs, stacked here so that a replayed capture (`Trainer.replayed`) takes
    the batch's tensors as they are, not a pending concatenation of them."""
    return pair_logps(model, stack_pairs(batch))


def _pair_sums(out: PairLoss) -> dict[str, torch.Tensor]:
    c, r = out.chosen_rewards, out.rejected_rewards
    n = torch.ones_like(c).sum()
    return {"chosen": c.sum(), "rejected": r.sum(), "n_chosen": n, "n_rejected": n, "correct": (c > r).float().sum(),
            "kl": torch.zeros_like(n)}


def _kto_sums(out: KTOLoss, desirable: torch.Tensor) -> dict[str, torch.Tensor]:
    d = desirable.bool()
    rew, zero = out.rewards, torch.zeros_like(out.rewards)
    right = torch.where(d, rew > 0, rew < 0)
    return {"chosen": torch.where(d, rew, zero).sum(), "rejected": torch.where(d, zero, rew).sum(),
            "n_chosen": d.float().sum(), "n_rejected": (~d).float().sum(), "correct": right.float().sum(),
            "kl": out.kl}


class PreferenceTrainer(Trainer):
    """DPO, ORPO, SimPO or KTO (see the module docstring)."""

    # DPO's and IPO's losses fall towards 0 as the pairs separate, where a window of a few harder pairs is several
    # times the last one: the relative spike rule (training/guard/divergence.py) would stop sound runs. nan/inf still stop.
    watches_loss_spikes = False
    # config.replay_steps: the policy's forward (`batch_pair_logps`, and so its backward) is captured and replayed;
    # the reference's no-grad forward and the loss's few ops on the log-probabilities are traced as they are.
    replays_steps = True

    def __init__(self, model: torch.nn.Module, train_data: Any, val_data: Any = None, *,
                 settings: PreferenceSettings, ref_model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__(model, train_data, val_data, **kwargs)
        self.settings = settings
        self.ref_model = None
        if settings.uses_reference and not lora.is_peft(model):
            if ref_model is None:
                raise ConfigError(f"{settings.algorithm.upper()} without LoRA needs ref_model, a frozen copy of the "
                                  "starting model")
            ref_model.requires_grad_(False).eval()
            if self.backend.precision == "bf16":
                ref_model = ref_model.to(torch.bfloat16)
            self.ref_model = self.backend.move_model(ref_model)  # not a submodule: no optimizer, no checkpoint
        self.ref_tables: dict[str, torch.Tensor] | None = None  # precomputed: split -> (pairs, 2) on the device

    @property
    def tokens_per_step(self) -> int:
        return 2 * super().tokens_per_step  # two rows per pair

    # ---- the step ---------------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator) -> StepFigures:
        """One optimizer step over grad_accum micro-batches: each micro-batch's losses (and the chosen NLL, ORPO's
        and SimPO's) with a backward, then the optimizer step. The divisors are the whole step's (its items, its
        chosen tokens), counted up front: the gradients do not depend on grad_accum."""
        b, s = self.backend, self.settings
        micro = [next(batches) for _ in range(self.config.grad_accum)]
        items = float(sum(m["input_ids"].shape[0] for m in micro))  # a host number: shapes are fixed
        if s.nll_weight:  # every chosen token of the step weighs the same, as the package's SFT
            count = sum((m["labels"][:, 0, 1:] != -100).sum() for m in micro).clamp(min=1).float()
        total, sums = None, None
        for batch in micro:
            with b.autocast():
                losses, figures, nll = self.pair_loss(batch)
                loss = losses.sum() / items
                if s.nll_weight:
                    loss = loss + s.nll_weight * nll / count
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
            sums = figures if sums is None else {k: sums[k] + v for k, v in figures.items()}
        device = {**sums, "pairs": torch.ones_like(sums["chosen"]) * items}
        return StepFigures(total, self.apply_gradients(), device=device)

    def pair_loss(self, batch: dict, split: str = "train") -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                                                    torch.Tensor]:
        """(per-item losses, the logged figures' sums, the chosen answers' summed NLL) of one micro-batch."""
        sums, counts, _ = self.replayed(batch_pair_logps, self.model, batch)
        first, second = sums.chunk(2)
        s = self.settings
        zero = torch.zeros((), device=first.device)
        if not s.uses_reference:
            n_first, n_second = counts.chunk(2)
            out = s.mean_losses(first / n_first.clamp(min=1), second / n_second.clamp(min=1), settings=s)
            return out.losses, _pair_sums(out), -first.sum()
        if self.ref_tables is not None:
            ref = self.ref_tables[split][batch["index"]]
            ref_first, ref_second = ref[:, 0], ref[:, 1]
        else:
            ref_first, ref_second = self.reference_logps(stack_pairs(batch)).float().chunk(2)
        if s.unpaired:  # KTO: a completion's row, then its mismatched row (the KL estimate's)
            out = kto_loss(first, ref_first, second, ref_second, batch["desirable"], settings=s)
            return out.losses, _kto_sums(out, batch["desirable"]), zero
        n_first, n_second = counts.chunk(2)
        out = dpo_loss(first, second, ref_first, ref_second, settings=s, chosen_tokens=n_first,
                       rejected_tokens=n_second)
        return out.losses, _pair_sums(out), zero

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one batch (evaluation: the validation pairs or completions)."""
        losses, _, nll = self.pair_loss(batch, split="val")
        if not self.settings.nll_weight:
            return losses.mean()
        tokens = (batch["labels"][:, 0, 1:] != -100).sum().clamp(min=1)
        return losses.mean() + self.settings.nll_weight * nll / tokens

    def log_figures(self, sums: dict[str, float], steps: int) -> dict[str, float]:
        """The window's reward sums as means per chosen and rejected answer (KTO: desirable and undesirable
        completion), the share of items ranked right, and KTO's KL estimate (its mean over the micro-batches)."""
        chosen = sums["chosen"] / max(sums["n_chosen"], 1.0)
        rejected = sums["rejected"] / max(sums["n_rejected"], 1.0)
        out = {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margin": chosen - rejected,
               "rewards/accuracy": sums["correct"] / max(sums["pairs"], 1.0)}
        if self.settings.unpaired:
            out["kl"] = sums["kl"] / max(steps * self.config.grad_accum, 1)
        return out

    # ---- the reference ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def reference_logps(self, rows: dict) -> torch.Tensor:
        """The reference's summed answer log-probabilities of 2B stacked rows (the adapter disabled under LoRA)."""
        if self.ref_model is not None:
            return pair_logps(self.ref_model, rows)[0]
        if not lora.is_peft(self.raw_model):
            raise ConfigError("the reference model was dropped after precomputing; reference_logps needs it")
        with self.raw_model.disable_adapter():
            return pair_logps(self.model, rows)[0]

    @torch.no_grad()
    def _reference_rows(self, data: Any) -> torch.Tensor:
        """The reference's summed log-probabilities (pairs, 2) of a PreferenceDataset, on the device: fixed batches
        of the training batch's shape (one graph), a sync after each, no host read."""
        b = self.backend
        parts = []
        was_training = self.model.training
        self.model.eval()
        for idx, real in fixed_batches(len(data), self.loader_batch_size):
            with b.autocast():
                ref = self.reference_logps(stack_pairs(b.to_device(_gather(data, idx)))).float()
            parts.append(torch.stack(ref.chunk(2), 1)[:real])
            b.sync()
        self.model.train(was_training)
        return torch.cat(parts)

    def precompute_reference(self) -> None:
        """The reference's log-probabilities of every training and validation pair, kept on the device; a frozen
        copy is dropped afterwards (the point of precomputing: no reference weights held while training)."""
        tables = {}
        for split, loader in (("train", self.train_loader), ("val", self.val_loader)):
            data = getattr(loader, "dataset", None) if loader is not None else None
            if data is not None:
                tables[split] = self._reference_rows(data)
        self.ref_tables = tables
        self.ref_model = None

    def reference_table(self, data: Any) -> torch.Tensor:
        """The reference's summed log-probabilities (pairs, 2) of `data`, on the CPU (DPO and KTO)."""
        return self.backend.to_cpu(self._reference_rows(data))

    def fit(self):
        if self.settings.precompute_ref and self.ref_tables is None and self.train_loader is not None:
            self.precompute_reference()
        return super().fit()

    # ---- held-out pairs ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def score_pairs(self, data: Any, ref: torch.Tensor | None = None) -> dict:
        """Over `data` (a PreferenceDataset of pairs), in fixed batches, one host read at the end: the policy's summed
        log-probabilities of chosen and rejected (pairs, 2), and the rewards: for DPO and KTO with `ref` (pairs, 2)
        given, beta x the log-ratios; for ORPO and SimPO, their loss's from the mean log-probabilities. Returns
        {"logps", "rewards"} as CPU tensors (rewards None without `ref` for DPO and KTO)."""
        b, rows, s = self.backend, self.loader_batch_size, self.settings
        was_training = self.model.training
        self.model.eval()
        logps, means = [], []
        for idx, real in fixed_batches(len(data), rows):
            batch = b.to_device(_gather(data, idx))
            with b.autocast():
                sums, counts, _ = pair_logps(self.model, stack_pairs(batch))
            logps.append(torch.stack(sums.float().chunk(2), 1)[:real])
            means.append(torch.stack((sums.float() / counts.clamp(min=1)).chunk(2), 1)[:real])
            b.sync()
        self.model.train(was_training)
        host = b.to_cpu({"logps": torch.cat(logps), "means": torch.cat(means)})
        if s.uses_reference:
            rewards = None if ref is None else s.beta * (host["logps"] - ref)
        else:
            out = s.mean_losses(host["means"][:, 0], host["means"][:, 1], settings=s)
            rewards = torch.stack([out.chosen_rewards, out.rejected_rewards], 1)
        return {"logps": host["logps"], "rewards": rewards}


def _gather(data: Any, idx: list[int]) -> dict:
    """Rows `idx` of a PreferenceDataset as one batch (the loader's collation, without a loader)."""
    t = torch.as_tensor(idx, dtype=torch.long)
    return data.gather(t) | {"index": t}
