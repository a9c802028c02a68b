"""The preference-tuning recipe (DPO, ORPO, SimPO, KTO, reward models) behind notebooks/preference_llm.ipynb: memory
plan -> model -> pairs -> held-out preference accuracy -> training -> accuracy again -> export.

    job = Preference(config_from_parameters(globals(), base=PreferenceConfig()))  # MODEL, DATASET, ALGORITHM, ...
    print(job.plan().summary())            # 2 rows per pair, the reference (or none): before loading anything
    before = job.preference_accuracy()     # held-out pairs: how often the chosen answer wins, and the margins
    report = job.train()                   # algorithms.preference.PreferenceTrainer on the package Trainer
    after = job.preference_accuracy(); job.plot(); paths = job.export()   # adapter + merged model
    job.save_results(before=before, after=after, paths=paths)    # results.json, loss.png, preference.png

A sibling of fine-tuning and GRPO on the shared Hugging Face job (`recipes.hf_job`). What it adds: the algorithm's
settings (`algorithms.preference_loss.PreferenceSettings`, whose fields are this config's: ALGORITHM, LOSS_TYPE,
BETA, ...), DATASET of preference pairs (`data.preference`; KTO also takes labelled completions) read at
DATASET_SPLIT, and the held-out preference accuracy over pairs. BATCH_SIZE counts pairs, or KTO's completions (2 rows
each). ALGORITHM "reward" trains MODEL as a sequence classifier (`algorithms.reward_model`: its accuracy is the share
of held-out pairs whose chosen answer scores higher, its merged export an `AutoModelForSequenceClassification`;
docs/algorithms/reward_model.md). Each setting, and what the accuracy means: docs/algorithms/preference.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar

import torch

from tpu_helpers.algorithms.preference import PreferenceTrainer
from tpu_helpers.algorithms.preference_loss import PreferenceSettings
from tpu_helpers.algorithms.reward_model import RewardModelTrainer
from tpu_helpers.config import ConfigError, settings_fields, settings_from
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.cuts import merged
from tpu_helpers.data.preference import (
    build_kto_dataset,
    build_preference_dataset,
    load_preference_records,
    pair_up,
    split_example,
    split_pair,
    warn_kto_balance,
    warn_truncated,
)
from tpu_helpers.data.sft import DEFAULT_DATASET, exact_match, split_indices
from tpu_helpers.memory.preference_plan import preference_estimate
from tpu_helpers.models import hf
from tpu_helpers.models.reward_model import load_reward_model
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
    save_every: int = 50
    out_dir: str = "runs/preference"

    recipe: ClassVar[str] = "preference tuning"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.preference = settings_from(self, PreferenceSettings)  # checked and parsed once; the trainer takes it
        if self.reward_model and self.quantize_base is not None:
            raise ConfigError(f"quantize_base={self.quantize_base!r} with algorithm='reward': a 4-bit base loads as "
                              "a causal LM only; set QUANTIZE_BASE None to train a reward model")

    @property
    def reward_model(self) -> bool:
        """ALGORITHM "reward": a sequence classifier trained on the pairs (`algorithms.reward_model`)."""
        return self.algorithm == "reward"


class Preference(HFJob):
    """One DPO, ORPO, SimPO or KTO job; its parts load on first use (see the module docstring)."""

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
        # Items whose log-probabilities are kept: pairs, or KTO's completions (two of each pair).
        table = (cfg.max_records or 4000) * (2 if s.unpaired else 1) if s.precompute_ref else 0
        kwargs = dict(self.plan_options(), reference=live, precomputed_pairs=table)
        return lambda b: preference_estimate(model_config, b * cfg.grad_accum, cfg.seq_len, model=model, **kwargs)

    # ---- 2. model -----------------------------------------------------------------------------------------------
    def load(self, source: str, *, frozen: bool = False) -> tuple[torch.nn.Module, Any]:
        """ALGORITHM "reward": MODEL's body with a scalar head (`models.reward_model`); else the causal LM."""
        if not self.config.reward_model:
            return super().load(source, frozen=frozen)
        torch.manual_seed(self.config.seed)  # the new head's initial values depend on the seed only
        return load_reward_model(source, dtype=self._dtype(), attn_implementation=self.config.attn_implementation)

    def prepare_model(self, model: torch.nn.Module) -> None:
        hf.check_seq_len(model, self.config.seq_len)

    def reference(self) -> torch.nn.Module | None:
        """A frozen copy of MODEL for DPO and KTO under full fine-tuning (None under LoRA and for ORPO and SimPO); not
        kept here, so that with PRECOMPUTE_REF the trainer can drop it."""
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
        """Pairs (KTO: labelled completions) of DATASET's training records as fixed-shape rows (train, and
        validation split off them by VAL_FRACTION), and the held-out records (`hold_out`: the generated set's test
        split, EVAL_DATASET, or EVAL_SHARE of DATASET; none of them trains, none is a validation pair)."""
        cfg = self.config
        kto = cfg.preference.unpaired
        split = split_example if kto else split_pair
        build = build_kto_dataset if kto else build_preference_dataset
        records = self.read_records(lambda source, max_records: load_preference_records(
            source, split=cfg.dataset_split, max_records=max_records))
        split(records[0], f"DATASET={cfg.dataset!r} record 0")
        generated = cfg.dataset == DEFAULT_DATASET
        test = partial(load_preference_records, DEFAULT_DATASET, split="test") if generated else None
        held = self.hold_out(records, load_preference_records, generated=test,
                             usable=lambda record, where: bool(split(record, where)))
        where = f"DATASET={cfg.dataset!r} record"
        built = []
        for part in split_indices(len(held.training), cfg.val_fraction, cfg.seed):
            idx = [held.training[k] for k in part]  # errors name the record as read
            built.append(build(self.tokenizer, [records[i] for i in idx], seq_len=cfg.seq_len, where=where,
                               numbers=idx, warn=False))
        (train, stats), (val, val_stats) = built
        warn_truncated(merged(stats, val_stats), cfg.seq_len)  # once, for the training and validation rows
        if kto:
            warn_kto_balance(stats, cfg.desirable_weight, cfg.undesirable_weight)
        return JobData(train, val, stats, held, records)

    @cached_property
    def held_pairs(self) -> tuple[list[dict], list[int] | None]:
        """The held-out pairs (what `preference_accuracy` and `samples` use) and their record numbers: the held-out
        records; KTO's labelled ones paired up per prompt (`data.preference.pair_up`), those left without a
        partner said in a warning."""
        held = self.held_out
        if not self.config.preference.unpaired:
            return list(held), held.numbers
        pairs, numbers, alone = pair_up(held, held.where)
        if not pairs:
            raise ConfigError(f"none of the {len(held)} {held.label()} records pairs up: the held-out preference "
                              "accuracy needs a desirable and an undesirable completion of the same prompt, or pairs "
                              "(chosen, rejected); give such an EVAL_DATASET")
        if alone:
            warnings.warn(f"{alone} of the {len(held)} {held.label()} records have no partner (a completion of the "
                          "same prompt with the other label) and are left out of the held-out preference accuracy; "
                          "an EVAL_DATASET of pairs (chosen, rejected) keeps every one", stacklevel=2)
        return pairs, [held.numbers[k] for k in numbers] if held.numbers else numbers

    @cached_property
    def held_rows(self):
        """The held-out pairs as rows (what `preference_accuracy` scores)."""
        pairs, numbers = self.held_pairs
        return build_preference_dataset(self.tokenizer, pairs, seq_len=self.config.seq_len,
                                        where=self.held_out.where, numbers=numbers, warn=False)[0]

    @cached_property
    def held_reference(self) -> torch.Tensor | None:
        """DPO, KTO: the reference's log-probabilities of the held-out pairs (pairs, 2), computed once (before training:
        `train` asks for them while the reference is there)."""
        if not self.config.preference.uses_reference:
            return None
        return self.trainer.reference_table(self.held_rows)

    # ---- 4. held-out accuracy and samples -----------------------------------------------------------------------
    def preference_accuracy(self) -> dict:
        """Over the held-out pairs: the reward accuracy (chosen reward > rejected), the mean rewards and margin,
        and the log-probability accuracy (the policy's chosen log-probability > rejected)."""
        scored = self.trainer.score_pairs(self.held_rows, self.held_reference)
        logps, rewards = scored["logps"], scored["rewards"]  # a reward model: no log-probabilities
        margin = rewards[:, 0] - rewards[:, 1]
        return {"pairs": len(rewards), "accuracy": float((margin > 0).float().mean()),
                "logp_accuracy": None if logps is None else float((logps[:, 0] > logps[:, 1]).float().mean()),
                "margin": float(margin.mean()), "chosen_reward": float(rewards[:, 0].mean()),
                "rejected_reward": float(rewards[:, 1].mean())}

    def samples(self, n: int | None = None) -> dict:
        """Greedy answers to held-out prompts, and their exact match with the chosen answer (a reward model: its
        scores of the chosen and rejected answers, `reward_samples`)."""
        if self.config.reward_model:
            return self.reward_samples(n)
        pairs = self.held_pairs[0]
        records = pairs if n is None else pairs[:n]
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

    def reward_samples(self, n: int | None = None) -> dict:
        """A reward model's scores of held-out pairs: rows of the prompt, the chosen answer and, as "prediction",
        both scores; "exact_match" is the share where the chosen one scores higher."""
        held = self.held_rows if n is None else self.held_rows.select(range(min(n, len(self.held_rows))))
        before = self.backend.metrics().get("compilations", 0)
        scores = self.trainer.score_pairs(held)["rewards"]
        rows = []
        for k, (c, r) in enumerate(scores.tolist()):
            prompt, chosen, rejected = split_pair(self.held_pairs[0][k], f"held-out pair {k}")
            rows.append({"prompt": prompt[-1]["content"], "chosen": chosen[-1]["content"],
                         "prediction": f"chosen {c:+.3f}, rejected {rejected[-1]['content']!r} {r:+.3f}"})
        return {"exact_match": float((scores[:, 0] > scores[:, 1]).float().mean()), "rows": rows,
                "compilations": self.backend.metrics().get("compilations", 0) - before}

    # ---- 5. training --------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        cfg = self.config
        return {**super().run_identity(), "algorithm": cfg.algorithm, "dataset_split": cfg.dataset_split}

    def make_trainer(self) -> PreferenceTrainer:
        trainer = RewardModelTrainer if self.config.reward_model else PreferenceTrainer
        return trainer(self.model, self.train_data, self.val_data, settings=self.config.preference,
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
