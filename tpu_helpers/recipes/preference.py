"""The preference-tuning recipe (DPO, ORPO) behind notebooks/preference_llm.ipynb: memory plan -> model -> pairs ->
held-out preference accuracy -> training -> accuracy again -> export.

    job = Preference(config_from_parameters(globals(), base=PreferenceConfig()))  # MODEL, DATASET, ALGORITHM, ...
    print(job.plan().summary())            # 2 rows per pair, the reference (or none): before loading anything
    before = job.preference_accuracy()     # held-out pairs: how often the chosen answer wins, and the margins
    report = job.train()                   # algorithms.preference.PreferenceTrainer on the package Trainer
    after = job.preference_accuracy(); job.plot(); paths = job.export()   # adapter + merged model
    job.save_results(before=before, after=after, paths=paths)    # results.json, loss.png, preference.png

A sibling of fine-tuning and GRPO on the shared Hugging Face job (`recipes.hf_job`). What it adds: the algorithm's
settings (`algorithms.preference_loss.PreferenceSettings`, whose fields are this config's: ALGORITHM, LOSS_TYPE,
BETA, ...), DATASET of preference pairs (`data.preference`) read at DATASET_SPLIT, and the held-out preference
accuracy. BATCH_SIZE counts pairs (2 rows each). Each setting, and what the accuracy means:
docs/algorithms/preference.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar

import torch

from tpu_helpers.algorithms.preference import PreferenceTrainer
from tpu_helpers.algorithms.preference_loss import PreferenceSettings
from tpu_helpers.config import settings_fields, settings_from
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.cuts import merged
from tpu_helpers.data.preference import (
    build_preference_dataset,
    load_preference_records,
    split_pair,
    warn_truncated,
)
from tpu_helpers.data.sft import DEFAULT_DATASET, exact_match, split_indices
from tpu_helpers.memory.preference_plan import preference_estimate
from tpu_helpers.models import hf
from tpu_helpers.recipes.hf_job import HFJob, HFJobConfig, JobData
from tpu_helpers.training.results import panels_figure

# As fine-tuning does: without transformers/peft the notebook stops at its first cell, naming the extra.
require_extra("hf", "preference tuning (tpu_helpers.recipes.preference)")

PREFERENCE_FIGURE = "preference.png"  # what save_results writes besides loss.png
CURVES = (("rewards/accuracy", "preference accuracy"), ("rewards/margin", "reward margin"),
          ("rewards/chosen", "chosen reward"), ("rewards/rejected", "rejected reward"), ("loss", "loss"))


def curves_figure(curves: dict[str, list], *, pyplot: bool = False):
    """Preference accuracy, margin, chosen and rejected rewards and loss against step, from `Preference.curves()`
    (or results.json's "curves"); `pyplot=True`: a figure a notebook shows, else a standalone one (for files)."""
    return panels_figure(curves, CURVES, width=16, pyplot=pyplot)


@dataclass
@settings_fields(PreferenceSettings)  # ALGORITHM, LOSS_TYPE, BETA, ...: declared there
class PreferenceConfig(HFJobConfig):
    """`HFJobConfig` plus preference tuning's settings, each a notebook parameter of the same UPPER_CASE name: the
    fields of `algorithms.preference_loss.PreferenceSettings` (built from them once, `config.preference`, as the
    trainer takes them) and the recipe's own below. BATCH_SIZE is pairs per chip and micro-batch; SEQ_LEN the
    length of each row (prompt and one answer)."""

    dataset: str = DEFAULT_DATASET  # "instructions" (generated pairs), a local .jsonl/.json/.csv/.parquet, a hub name
    dataset_split: str = "train"  # the hub split to read (ultrafeedback_binarized: train_prefs)
    seq_len: int = 32  # the generated pairs' rows are at most 22 tokens
    batch_size: int = 8
    steps: int = 100
    lr: float = 1e-3
    warmup_steps: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    save_every: int = 50
    out_dir: str = "runs/preference"

    recipe: ClassVar[str] = "preference tuning"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.preference = settings_from(self, PreferenceSettings)  # checked and parsed once; the trainer takes it


class Preference(HFJob):
    """One DPO or ORPO job; its parts load on first use (see the module docstring)."""

    config_class = PreferenceConfig
    config: PreferenceConfig

    @property
    def plan_what(self) -> str:
        return self.config.algorithm.upper()

    # ---- 1. memory plan ---------------------------------------------------------------------------------------
    def estimate(self, model_config: Any, model: torch.nn.Module):
        """One chip's memory for a step over B pairs (2B rows) with the reference's forward unless precomputed."""
        cfg = self.config
        s = cfg.preference
        live = s.uses_reference and not s.precompute_ref
        table = (cfg.max_records or 4000) if s.precompute_ref else 0  # pairs whose log-probabilities are kept
        kwargs = dict(self.plan_options(), reference=live, precomputed_pairs=table)
        return lambda b: preference_estimate(model_config, b * cfg.grad_accum, cfg.seq_len, model=model, **kwargs)

    # ---- 2. model -----------------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> None:
        hf.check_seq_len(model, self.config.seq_len)

    def reference(self) -> torch.nn.Module | None:
        """A frozen copy of MODEL for DPO under full fine-tuning (None under LoRA and for ORPO); not kept here, so
        that with PRECOMPUTE_REF the trainer can drop it."""
        cfg = self.config
        if cfg.uses_lora or not cfg.preference.uses_reference:
            return None
        return self.load(self.source, frozen=True)[0]

    # ---- 3. data ------------------------------------------------------------------------------------------------
    @property
    def eval_split(self) -> str:
        """A hub EVAL_DATASET's split: DATASET_SPLIT's test counterpart (train_prefs -> test_prefs), else "test"."""
        split = self.config.dataset_split
        return split.replace("train", "test") if "train" in split else "test"

    def load_data(self) -> JobData:
        """Pairs of DATASET's training records as fixed-shape rows (train, and validation split off them by
        VAL_FRACTION), and the held-out records (`hold_out`: the generated set's test split, EVAL_DATASET, or
        EVAL_SHARE of DATASET; none of them trains, none is a validation pair)."""
        cfg = self.config
        records = self.read_records(lambda source, max_records: load_preference_records(
            source, split=cfg.dataset_split, max_records=max_records))
        split_pair(records[0], f"DATASET={cfg.dataset!r} record 0")
        generated = cfg.dataset == DEFAULT_DATASET
        test = partial(load_preference_records, DEFAULT_DATASET, split="test") if generated else None
        held = self.hold_out(records, load_preference_records, generated=test,
                             usable=lambda record, where: bool(split_pair(record, where)))
        where = f"DATASET={cfg.dataset!r} record"
        built = []
        for part in split_indices(len(held.training), cfg.val_fraction, cfg.seed):
            idx = [held.training[k] for k in part]  # errors name the record as read
            built.append(build_preference_dataset(self.tokenizer, [records[i] for i in idx], seq_len=cfg.seq_len,
                                                  where=where, numbers=idx, warn=False))
        (train, stats), (val, val_stats) = built
        warn_truncated(merged(stats, val_stats), cfg.seq_len)  # once, for the training and validation pairs
        return JobData(train, val, stats, held, records)

    @cached_property
    def held_rows(self):
        """The held-out pairs as rows (what `preference_accuracy` scores)."""
        held = self.held_out
        return build_preference_dataset(self.tokenizer, held, seq_len=self.config.seq_len, where=held.where,
                                        numbers=held.numbers, warn=False)[0]

    @cached_property
    def held_reference(self) -> torch.Tensor | None:
        """DPO: the reference's log-probabilities of the held-out pairs (pairs, 2), computed once (before training:
        `train` asks for them while the reference is there)."""
        if not self.config.preference.uses_reference:
            return None
        return self.trainer.reference_table(self.held_rows)

    # ---- 4. held-out accuracy and samples -----------------------------------------------------------------------
    def preference_accuracy(self) -> dict:
        """Over the held-out pairs: the reward accuracy (chosen reward > rejected), the mean rewards and margin,
        and the log-probability accuracy (the policy's chosen log-probability > rejected)."""
        scored = self.trainer.score_pairs(self.held_rows, self.held_reference)
        logps, rewards = scored["logps"], scored["rewards"]
        margin = rewards[:, 0] - rewards[:, 1]
        return {"pairs": len(logps), "accuracy": float((margin > 0).float().mean()),
                "logp_accuracy": float((logps[:, 0] > logps[:, 1]).float().mean()),
                "margin": float(margin.mean()), "chosen_reward": float(rewards[:, 0].mean()),
                "rejected_reward": float(rewards[:, 1].mean())}

    def samples(self, n: int | None = None) -> dict:
        """Greedy answers to held-out prompts, and their exact match with the chosen answer."""
        records = self.held_out if n is None else self.held_out[:n]
        prompts, answers = [], []
        for k, record in enumerate(records):
            prompt, chosen, _ = split_pair(record, f"held-out record {k}")
            prompts.append(prompt)
            answers.append(chosen[-1]["content"])
        model = self.trainer.model
        before = self.backend.metrics().get("compilations", 0)
        # Every prompt fits SEQ_LEN (the rows were built so): a shorter width would cut the longer prompts' starts.
        preds = hf.generate(model, self.tokenizer, prompts, device=self.backend.device, sync=self.backend.sync,
                            max_new_tokens=self.config.max_new_tokens, prompt_len=self.config.seq_len,
                            replay=self.backend.compile_step, loop=self.backend.compile_loop)
        rows = [{"prompt": p[-1]["content"], "chosen": a, "prediction": y}
                for p, a, y in zip(prompts, answers, preds, strict=True)]
        return {"exact_match": exact_match(preds, answers), "rows": rows,
                "compilations": self.backend.metrics().get("compilations", 0) - before}

    # ---- 5. training --------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        cfg = self.config
        return {**super().run_identity(), "algorithm": cfg.algorithm, "dataset_split": cfg.dataset_split}

    def make_trainer(self) -> PreferenceTrainer:
        return PreferenceTrainer(self.model, self.train_data, self.val_data, settings=self.config.preference,
                                 ref_model=self.reference(), **self.trainer_options())

    def train(self):
        self.held_reference  # noqa: B018 (while the reference is there: PRECOMPUTE_REF drops a frozen copy)
        return super().train()

    # ---- 6. results ---------------------------------------------------------------------------------------------
    def curves(self) -> dict[str, list]:
        """Per log step: step, preference accuracy, margin, chosen and rejected rewards, loss (from the history)."""
        keys = ("step", *(k for k, _ in CURVES))
        return {k: [r.get(k) for r in self.history.train] for k in keys}

    def plot(self):
        """The figure `save_results` writes as preference.png (a pyplot figure, shown in a notebook)."""
        return curves_figure(self.curves(), pyplot=True)

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), PREFERENCE_FIGURE: curves_figure(self.curves())}

    def tracked_results(self, results: dict) -> dict:
        tracked = super().tracked_results(results)
        for when in ("before", "after"):
            acc = (results.get("accuracy") or {}).get(when) or {}
            for key in ("accuracy", "logp_accuracy"):
                if acc.get(key) is not None:
                    tracked["values"][f"held_out/{key}_{when}"] = acc[key]
        return tracked

    def results(self, *, before: dict | None = None, after: dict | None = None, samples_before: dict | None = None,
                samples_after: dict | None = None, **extra: Any) -> dict:
        """The run's results: `before` and `after` are `preference_accuracy()`'s, the samples `samples()`'."""
        return super().results(before=samples_before, after=samples_after, accuracy={"before": before, "after": after},
                               curves=self.curves(), data=self.data_stats, **extra)
