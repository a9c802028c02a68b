"""The settings every Hugging Face recipe shares (`HFJobConfig`: MODEL, METHOD, LORA_*, QUANTIZE_BASE, the held-out
records, EXPORT, EVAL_TASKS, ...), checked here once, and what a job trains on (`JobData`). A recipe's config adds
its own fields to it; the job itself is `recipes.hf_job.HFJob`.

    @dataclass
    class MyConfig(HFJobConfig):              # a new HF recipe's settings: its own fields beside the shared ones
        dataset: str = "instructions"

A field of another recipe's config is refused by name (`config_from_parameters`); the held-out records never train
(docs/guides/data.md); EVAL_TASKS' names, files and network are checked when the config is built
(`recipes.harness.HarnessSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tpu_helpers.config import ConfigError, TrainConfig, settings_fields, settings_from
from tpu_helpers.core.choices import EXPORT_WEIGHTS, GGUF_TYPES, check_choice
from tpu_helpers.core.sharding import is_sharded
from tpu_helpers.data.held_out import HeldOut
from tpu_helpers.models import hf, lm_head, quant4
from tpu_helpers.recipes import harness
from tpu_helpers.recipes.hub import check_repo_id


@dataclass
class JobData:
    """What a Hugging Face job trains and samples on (`HFJob.data`)."""

    train: Any  # the training rows (a Dataset of fixed-shape rows)
    val: Any  # the validation rows, or None
    stats: dict  # figures of the rows (counts, tokens, what was skipped)
    held_out: HeldOut  # records with reference answers for `samples`, none of which trains
    records: list[dict]  # DATASET's records as read


@dataclass
@settings_fields(harness.HarnessSettings, prefix="eval_")  # EVAL_TASKS, EVAL_LIMIT, ...: declared there
class HFJobConfig(TrainConfig):
    """`TrainConfig` plus what every Hugging Face recipe has, each a notebook parameter of the same UPPER_CASE name:
    the fields of `recipes.harness.HarnessSettings` with the prefix `eval_` (built from them once, `config.harness`)
    and the shared ones below. The tokenizer is MODEL's own; DATASET is the recipe's data."""

    preset: str = "tiny"  # unused here (the GPT's size); kept small so nothing large is implied
    model: str = hf.TINY  # hub name, local dir written by save_pretrained, or "tiny" (offline, built locally)
    method: str = "lora"  # lora | full (a recipe may allow more: `methods`)
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated linear names, or "all-linear"
    quantize_base: str | None = None  # nf4 | int4 | None: QLoRA, the frozen base's linear layers in 4 bits (lora)
    quantize_group_size: int = 64  # QUANTIZE_BASE: input columns that share one scale
    max_records: int | None = None
    # The held-out figures' records never train (docs/guides/data.md); a generated DATASET has its own test split.
    eval_dataset: str | None = None  # records for the held-out figures, read like DATASET (a hub name: its test split)
    eval_share: float = 0.1  # without EVAL_DATASET: the share of DATASET held out of training (seeded); 0: none
    eval_records: int = 64  # held-out records at most: EVAL_DATASET's first ones, or EVAL_SHARE of DATASET
    attn_implementation: str = hf.DEFAULT_ATTN  # sdpa | eager (see models/hf.py for the measured figures)
    export_merged: bool = True
    export: str = "best"  # best: the best checkpoint's weights (lowest validation loss) when training evaluated | last
    export_gguf: str | None = None  # f16 | bf16 | q8_0: model-<type>.gguf beside merged/ (llama.cpp, Ollama, LM Studio)
    num_samples: int = 8  # held-out prompts shown before and after training
    max_new_tokens: int = 4  # tokens generated per answer
    loss_chunk: int | str = "auto"  # tokens per chunk of the loss's logits (models/lm_head.py); 0: the whole batch's
    push_to_hub: str | None = None  # a hub repo id "owner/name": the exports go there with a model card (recipes.hub)

    methods: ClassVar[tuple[str, ...]] = ("lora", "full")
    recipe: ClassVar[str] = "a Hugging Face job"  # how messages name the recipe

    def __post_init__(self) -> None:
        # The run's identity names the tokenizer: for a Hugging Face model it is the model's own.
        self.tokenizer = self.model if isinstance(self.model, str) else self.tokenizer
        super().__post_init__()
        hf.check_model_name(self.model)  # a misspelt name fails here, not at the first download
        if self.method not in self.methods:
            raise ConfigError(f"method={self.method!r} is not one of {self.methods} for {self.recipe}")
        check_choice("export", self.export, EXPORT_WEIGHTS)
        if self.export_gguf is not None:
            check_choice("export_gguf", self.export_gguf, GGUF_TYPES)
            if not self.export_merged:
                raise ConfigError(f"export_gguf={self.export_gguf!r} is written from the merged model: it needs "
                                  "export_merged=True")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r={self.lora_r!r} must be >= 1 (or 0 for full distillation)")
        if self.method == "lora" and self.lora_r < 1:
            raise ConfigError(f"lora_r={self.lora_r!r} must be >= 1 with method='lora'")
        # The 4-bit format the base loads in (QUANTIZE_BASE), parsed once: the loading and the plan take it.
        self.base_format = None if self.quantize_base is None else quant4.as_format(self.quantize_base)
        if self.quantize_base is not None:
            if self.method != "lora":
                raise ConfigError(f"quantize_base={self.quantize_base!r} (QLoRA) freezes the base in 4 bits and "
                                  f"trains LoRA adapters on it: it needs method='lora', not {self.method!r}")
            if is_sharded(self.sharding):
                raise ConfigError(f"quantize_base={self.quantize_base!r} with sharding={self.sharding!r}: a 4-bit "
                                  "base is not sharded yet; use sharding='data' (a 7B 4-bit base fits one chip)")
        if (isinstance(self.quantize_group_size, bool) or not isinstance(self.quantize_group_size, int)
                or self.quantize_group_size < 2 or self.quantize_group_size % 2):
            raise ConfigError(f"quantize_group_size={self.quantize_group_size!r} must be an even integer >= 2 that "
                              "divides the width of every linear layer's input (e.g. 32, 64, 128)")
        if self.max_records is not None and self.max_records < 1:
            raise ConfigError(f"max_records={self.max_records!r} must be >= 1, or None for all")
        self._check_held_out()
        self.harness = settings_from(self, harness.HarnessSettings)  # EVAL_TASKS: names, files, network checked
        if self.harness.specs and not self.export_merged:
            raise ConfigError(f"eval_tasks={self.eval_tasks!r} scores the merged export after training: it needs "
                              "export_merged=True")
        lm_head.check_loss_chunk(self.loss_chunk)
        check_repo_id(self.push_to_hub)
        for name in ("num_samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")

    def _check_held_out(self) -> None:
        if not 0 <= self.eval_share < 1:
            raise ConfigError(f"eval_share={self.eval_share!r} must be at least 0 and below 1 (the share of DATASET "
                              "held out of training for the held-out figures; 0 for none)")
        if isinstance(self.eval_records, bool) or not isinstance(self.eval_records, int) or self.eval_records < 1:
            raise ConfigError(f"eval_records={self.eval_records!r} must be an integer >= 1 (held-out records at most)")
        if self.eval_dataset is None:
            return
        if not isinstance(self.eval_dataset, str) or not self.eval_dataset.strip():
            raise ConfigError(f"eval_dataset={self.eval_dataset!r}: give a local .jsonl/.json/.csv/.parquet file or a "
                              "hub name, or None to hold out EVAL_SHARE of DATASET")
        same = Path(self.eval_dataset).expanduser()
        if same.is_file() and same.resolve() == Path(str(self.dataset)).expanduser().resolve():
            raise ConfigError(f"eval_dataset={self.eval_dataset!r} is DATASET itself, whose records train; give a "
                              "file of other records, or None to hold out EVAL_SHARE of DATASET")

    @property
    def uses_lora(self) -> bool:
        return self.method == "lora"

    @property
    def lora_target_list(self) -> str | list[str]:
        return self.lora_targets if self.lora_targets == "all-linear" else self.lora_targets.split(",")
