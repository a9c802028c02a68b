"""Preference tuning (DPO, ORPO) on the package's Trainer: push a causal LM towards the chosen answer of each pair
and away from the rejected one. One step (`PreferenceTrainer.train_step`): the log-probabilities of each
micro-batch's pairs as 2B rows (chosen, then rejected) in one forward, the pair losses of
`algorithms.preference_loss` against the reference (DPO) or the odds (ORPO, plus the chosen answers' NLL), a
backward each, then the optimizer step; the step's loss is the mean over all its pairs.

    settings = PreferenceSettings(algorithm="dpo", beta=0.1, precompute_ref=True)   # algorithms.preference_loss
    trainer = PreferenceTrainer(model, pairs, val_pairs, config=cfg, settings=settings)  # data.preference rows
    report = trainer.fit()          # resume, signals, the run lock, the XLA detector as for SFT

DPO's reference is the model with its adapter disabled under LoRA, else `ref_model`, a frozen copy; with
`precompute_ref` its log-probabilities of every pair are computed once when `fit` starts and the copy dropped.
Logged per log step: the loss, the mean chosen and rejected rewards, their margin and the preference accuracy.
More: docs/algorithms/preference.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tpu_helpers.algorithms.preference_loss import (
    PairLoss,
    PreferenceSettings,
    dpo_loss,
    orpo_loss,
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


class PreferenceTrainer(Trainer):
    """DPO or ORPO over pairs (see the module docstring)."""

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
                raise ConfigError("DPO without LoRA needs ref_model, a frozen copy of the starting model")
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
        """One optimizer step over grad_accum micro-batches of pairs: each micro-batch's pair losses (and ORPO's
        chosen NLL) with a backward, then the optimizer step. The divisors are the whole step's (its pairs, its
        chosen tokens), counted up front: the gradients do not depend on grad_accum."""
        b, s = self.backend, self.settings
        micro = [next(batches) for _ in range(self.config.grad_accum)]
        pairs = float(sum(m["input_ids"].shape[0] for m in micro))  # a host number: shapes are fixed
        if not s.uses_reference:  # ORPO: every chosen token of the step weighs the same, as the package's SFT
            count = sum((m["labels"][:, 0, 1:] != -100).sum() for m in micro).clamp(min=1).float()
        total, sums = None, None
        for batch in micro:
            with b.autocast():
                out, nll, _ = self.pair_loss(batch)
                loss = out.losses.sum() / pairs
                if not s.uses_reference:
                    loss = loss + nll / count
            b.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
            c, r = out.chosen_rewards, out.rejected_rewards
            part = torch.stack([c.sum(), r.sum(), (c > r).float().sum()])
            sums = part if sums is None else sums + part
        device = {"chosen": sums[0], "rejected": sums[1], "correct": sums[2], "pairs": torch.ones_like(sums[0]) * pairs}
        return StepFigures(total, self.apply_gradients(), device=device)

    def pair_loss(self, batch: dict, split: str = "train") -> tuple[PairLoss, torch.Tensor, torch.Tensor]:
        """(per-pair loss, chosen NLL token sum, chosen token count) of one micro-batch of pairs."""
        sums, counts, per_token = self.replayed(batch_pair_logps, self.model, batch)
        chosen, rejected = sums.chunk(2)
        n_chosen, n_rejected = counts.chunk(2)
        s = self.settings
        if not s.uses_reference:
            out = orpo_loss(chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1), settings=s)
            return out, -chosen.sum(), n_chosen.sum()
        if self.ref_tables is not None:
            ref = self.ref_tables[split][batch["index"]]
            ref_chosen, ref_rejected = ref[:, 0], ref[:, 1]
        else:
            ref_chosen, ref_rejected = self.reference_logps(stack_pairs(batch)).float().chunk(2)
        out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, settings=s, chosen_tokens=n_chosen,
                       rejected_tokens=n_rejected)
        zero = torch.zeros((), device=chosen.device)
        return out, zero, zero

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one batch of pairs (evaluation: the validation pairs)."""
        out, nll, tokens = self.pair_loss(batch, split="val")
        loss = out.losses.mean()
        return loss if self.settings.uses_reference else loss + nll / tokens.clamp(min=1)

    def log_figures(self, sums: dict[str, float], steps: int) -> dict[str, float]:
        """The window's reward sums as means per pair, and the share of pairs whose chosen reward is the higher."""
        pairs = max(sums["pairs"], 1.0)
        chosen, rejected = sums["chosen"], sums["rejected"]
        return {"rewards/chosen": chosen / pairs, "rewards/rejected": rejected / pairs,
                "rewards/margin": (chosen - rejected) / pairs, "rewards/accuracy": sums["correct"] / pairs}

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
        """The reference's summed log-probabilities (pairs, 2) of `data`, on the CPU (DPO only)."""
        return self.backend.to_cpu(self._reference_rows(data))

    def fit(self):
        if self.settings.precompute_ref and self.ref_tables is None and self.train_loader is not None:
            self.precompute_reference()
        return super().fit()

    # ---- held-out pairs ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def score_pairs(self, data: Any, ref: torch.Tensor | None = None) -> dict:
        """Over `data` (a PreferenceDataset), in fixed batches, one host read at the end: the policy's summed
        log-probabilities of chosen and rejected (pairs, 2), and, for DPO with `ref` (pairs, 2) given, the
        rewards. Returns {"logps", "rewards"} as CPU tensors (rewards None without a reference for DPO)."""
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
            rewards = s.orpo_lambda * host["means"]
        return {"logps": host["logps"], "rewards": rewards}


def _gather(data: Any, idx: list[int]) -> dict:
    """Rows `idx` of a PreferenceDataset as one batch (the loader's collation, without a loader)."""
    t = torch.as_tensor(idx, dtype=torch.long)
    return {"input_ids": data.input_ids[t], "attention_mask": data.attention_mask[t], "labels": data.labels[t],
            "index": t}
