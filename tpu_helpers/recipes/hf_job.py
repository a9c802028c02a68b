"""The Hugging Face job every HF recipe shares: the model, its tokenizer and LoRA, the data's records, the memory
plan, held-out samples, and the adapter and merged exports. Fine-tuning, GRPO and preference tuning are siblings on
it; each adds only its own settings and parts.

    class MyJob(HFJob):                       # a new HF recipe: a config of its own fields, then its parts
        config_class = MyConfig               # MyConfig(HFJobConfig): MODEL, METHOD, LORA_*, EXPORT, ... are shared
        def estimate(self, model_config, meta): ...   # batch -> MemoryEstimate for the plan
        def make_trainer(self): ...            # its algorithm's trainer (tpu_helpers.algorithms)

Every part is built on first use (no call-order traps): `model` and `tokenizer` (from `source`), `plan()` (from the
model's config alone), `data` (DATASET read once), `export()` (the PEFT adapter, a merged safetensors model, and
with EXPORT_GGUF a .gguf file of it for llama.cpp, Ollama and LM Studio: `models.gguf_export`, whose family check
runs when the job is built). The held-out records (`hold_out`) never train: EVAL_DATASET's, a generated set's test
split, or EVAL_SHARE of DATASET split off before training (seeded by SEED).
QUANTIZE_BASE loads the frozen base in 4 bits (`models.quant4`; parsed once, `config.base_format`). The shared
fields are checked here, once; a field of another recipe's config is refused by name.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch

from tpu_helpers.backend.units import block_params
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.atomic_io import atomic_write_text
from tpu_helpers.core.choices import EXPORT_WEIGHTS, GGUF_TYPES, check_choice
from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.core.sharding import is_sharded, mesh_shape
from tpu_helpers.data.held_out import HeldOut, hold_out
from tpu_helpers.memory.hf_plan import gathered_bytes_per_param, meta_model
from tpu_helpers.memory.per_chip import shard_estimate, sharding_plan
from tpu_helpers.memory.report import MemoryEstimate, memory_report
from tpu_helpers.models import gguf_export, hf, lm_head, lora, quant4
from tpu_helpers.recipes.base import Recipe
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
class HFJobConfig(TrainConfig):
    """`TrainConfig` plus what every Hugging Face recipe has, each a notebook parameter of the same UPPER_CASE name.
    The tokenizer is MODEL's own; DATASET is the recipe's data."""

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


class HFJob(Recipe):
    """The shared half of a Hugging Face recipe (see the module docstring); a recipe supplies `estimate`,
    `make_trainer` and its data."""

    config_class: type[TrainConfig] = HFJobConfig
    config: HFJobConfig

    def __init__(self, config: HFJobConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.model_source = hf.resolve_model_source(config.model)  # MODEL, resolved
        self.exported: dict | None = None  # which weights the last export() took (the best checkpoint's or the last)
        if config.export_gguf is not None:  # now, not after training: the package and the model's family
            gguf_export.require_gguf()
            gguf_export.check_exportable(self.model_config())

    @property
    def source(self) -> str:
        """The model this job trains from and exports merge into: MODEL here (GRPO's START_FROM may change it)."""
        return self.model_source

    @property
    def chips(self) -> int:
        """The chips this run spans: the SPMD program's devices on XLA, the torchrun processes elsewhere."""
        return max(self.backend.device_count, self.backend.world_size)

    # ---- 1. memory plan (config only) ----------------------------------------------------------------------------
    def model_config(self) -> Any:
        """MODEL's Hugging Face config: all the plan reads (a recipe checks its own limits against it here)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_source)

    def estimate(self, model_config: Any, model: torch.nn.Module) -> Callable[[int], MemoryEstimate]:
        """batch -> one chip's data-parallel MemoryEstimate of this recipe's step (`model`: on the meta device)."""
        raise NotImplementedError(f"{type(self).__name__} must define estimate()")

    def plan_options(self) -> dict:
        """The estimate's keyword arguments every HF recipe shares."""
        cfg = self.config
        options = dict(method=cfg.method, lora_r=cfg.lora_r,
                       lora_targets=cfg.lora_target_list, precision=self.backend.precision,
                       gradient_checkpointing=cfg.gradient_checkpointing, grad_accum=cfg.grad_accum,
                       loss_chunk=cfg.loss_chunk)
        if cfg.base_format is not None:  # only then: an estimate that knows no 4-bit base still takes the rest
            options.update(quantize_base=cfg.base_format, quantize_group_size=cfg.quantize_group_size)
        return options

    plan_what = "training"  # what the sharding advice calls the step

    def _planned(self) -> tuple[Callable[[int], MemoryEstimate], torch.nn.Module, int]:
        config = self.model_config()
        model = meta_model(config)
        return self.estimate(config, model), model, gathered_bytes_per_param(self.plan_options()["method"],
                                                                             self.backend.precision)

    def plan(self, hardware: Any = None, *, chips: int | None = None):
        """The memory report of one step per chip under this run's SHARDING over its chips (fsdp: 1/N of the
        weights, gradients and optimizer state plus one gathered block)."""
        estimate, model, width = self._planned()
        fsdp = mesh_shape(self.config.sharding, chips or self.chips)[1]
        block = block_params(model)
        return memory_report(lambda b: shard_estimate(estimate(b), fsdp, block_params=block, bytes_per_param=width),
                             self.config.batch_size, hardware or self.backend.hardware)

    def sharding_plan(self, hardware: Any = None, *, chips: int | None = None):
        """Per-chip memory under data parallel and FSDP over 2, 4, ... chips (`tpu_helpers.memory.per_chip`)."""
        estimate, model, width = self._planned()
        return sharding_plan(estimate, self.config.batch_size, chips=chips or self.chips,
                             hardware=hardware or self.backend.hardware, block_params=block_params(model),
                             params=sum(p.numel() for p in model.parameters()), bytes_per_param=width,
                             what=self.plan_what)

    def sharding_advice(self, hardware: Any = None, *, chips: int | None = None) -> str:
        """What SHARDING needs per chip here and what the other choices would ("" on a single chip)."""
        chips = chips or self.chips
        if chips == 1:
            return ""
        plan = self.sharding_plan(hardware, chips=chips)
        fsdp = mesh_shape(self.config.sharding, chips)[1]
        choice = plan.per_chip.get("data" if fsdp == 1 else f"fsdp x{fsdp}")
        mine = f"SHARDING={self.config.sharding!r}: about {format_bytes(choice.peak_bytes)} per chip. " if choice else ""
        return f"{mine}{plan.advice()}\n{plan.table()}"

    # ---- 2. model ----------------------------------------------------------------------------------------------
    def _dtype(self) -> torch.dtype | None:
        # A frozen base in bf16 on TPU; trained weights stay fp32 (bf16 autocast computes in bf16 anyway).
        return torch.bfloat16 if self.backend.precision == "bf16" and self.config.uses_lora else None

    def load(self, source: str, *, frozen: bool = False) -> tuple[torch.nn.Module, Any]:
        """(model, tokenizer) of `source` with this job's attention; `frozen`: a model that only runs forward (a
        teacher, a reference), bf16 where the step computes in bf16. QUANTIZE_BASE: the trained model's base in 4
        bits, quantized as it loads (a frozen teacher or reference stays as it is)."""
        cfg = self.config
        dtype = (torch.bfloat16 if self.backend.precision == "bf16" else None) if frozen else self._dtype()
        quantize = dict(quantize=cfg.base_format, group_size=cfg.quantize_group_size) \
            if cfg.base_format is not None and not frozen else {}
        return hf.load_causal_lm(source, dtype=dtype, attn_implementation=cfg.attn_implementation, **quantize)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """What a recipe puts on the loaded base before LoRA (QAT's fake quantizers); nothing by default. A
        recipe's own checks of the loaded model go here too."""

    @cached_property
    def _loaded(self) -> tuple[torch.nn.Module, Any]:
        cfg = self.config
        model, tokenizer = self.load(self.source)
        lm_head.set_loss_chunk(model, cfg.loss_chunk)  # what every loss of this model reads (SFT, distill, GRPO)
        self.prepare_model(model)
        if cfg.uses_lora:
            torch.manual_seed(cfg.seed)  # the adapters' initial values depend on the seed only
            model = lora.add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                  targets=cfg.lora_targets)
        return model, tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained (peft-wrapped under LoRA), loaded on first use."""
        return self._loaded[0]

    @property
    def tokenizer(self) -> Any:
        return self._loaded[1]

    def parameter_summary(self) -> dict:
        m = self.model
        total = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        return {"parameters": total, "trainable": trainable, "trainable_share": trainable / total}

    def _model_on_device(self) -> torch.nn.Module:
        """The model placed for samples: as training places it once the trainer exists, or when it is sharded
        because it may not fit one chip whole (the trainer does that placing); else moved to the device."""
        if self.has_trainer or (is_sharded(self.config.sharding) and self.chips > 1):
            return self.trainer.model
        return self.backend.move_model(self.model)

    # ---- 3. data -----------------------------------------------------------------------------------------------
    def load_data(self) -> JobData:
        """The recipe's data from DATASET (`read_records`), made once by `data`."""
        raise NotImplementedError(f"{type(self).__name__} must define load_data()")

    @cached_property
    def data(self) -> JobData:
        """The job's data, built on first use (after the tokenizer): training rows, validation rows, figures,
        held-out records for `samples`, and the records read."""
        return self.load_data()

    @property
    def train_data(self) -> Any:
        return self.data.train

    @property
    def val_data(self) -> Any:
        return self.data.val

    @property
    def data_stats(self) -> dict:
        return self.data.stats

    @property
    def held_out(self) -> HeldOut:
        """Records with reference answers for `samples`, none of which trains (`hold_out`); with EVAL_SHARE=0 and
        no EVAL_DATASET there are none to measure, which is an error here."""
        held = self.data.held_out
        if not held and self.config.eval_share == 0 and self.config.eval_dataset is None:
            raise ConfigError(f"no held-out records to measure: EVAL_SHARE=0 holds none of DATASET="
                              f"{self.config.dataset!r} out; set EVAL_SHARE (e.g. 0.1) or give EVAL_DATASET")
        return held

    def held_out_label(self, n: int | None = None) -> str:
        """Where the held-out records come from and how many (`n` of them, e.g. the samples shown), as the
        notebooks print it: 'held-out (EVAL_DATASET, 64 records)', 'held-out (10% of DATASET, 41 records)'."""
        return self.data.held_out.label(n)

    @property
    def records(self) -> list[dict]:
        return self.data.records

    def read_records(self, load: Callable[..., list[dict]]) -> list[dict]:
        """DATASET's records through the recipe's reader `load(dataset, max_records=)`; none is an error."""
        cfg = self.config
        records = load(cfg.dataset, max_records=cfg.max_records)
        if not records:
            raise ConfigError(f"DATASET={cfg.dataset!r} has no records")
        return records

    eval_split = "test"  # the split of a hub EVAL_DATASET (and the test split of a generated one)

    def hold_out(self, records: list[dict], load: Callable[..., list[dict]], *,
                 generated: Callable[[], list[dict]] | None = None,
                 usable: Callable[[dict, str], bool] | None = None) -> HeldOut:
        """The held-out records, none of which trains, and which of DATASET's `records` may train
        (`data.held_out.hold_out`, with this job's EVAL_DATASET, EVAL_SHARE, EVAL_RECORDS and SEED)."""
        cfg = self.config
        return hold_out(records, load, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, eval_share=cfg.eval_share,
                        eval_records=cfg.eval_records, seed=cfg.seed, split=self.eval_split, generated=generated,
                        usable=usable)

    # ---- 4. training -------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        """What the checkpoints are of, beyond TrainConfig's identity: the method, model and adapters."""
        cfg = self.config
        ident = {"method": cfg.method, "model_source": self.source, "lora_r": cfg.lora_r if cfg.uses_lora else 0,
                 "lora_targets": cfg.lora_targets if cfg.uses_lora else "",
                 "held_out": self.data.held_out.source}  # which of DATASET's records train
        if cfg.uses_lora:
            ident.update(lora.base_fingerprint(self.model, self.source))
        if cfg.quantize_base:
            ident.update(quantize_base=cfg.quantize_base, quantize_group_size=cfg.quantize_group_size)
        return ident

    def trainer_options(self) -> dict[str, Any]:
        # Under LoRA a checkpoint holds the adapters and their optimizer state only (run_state.py).
        return {**super().trainer_options(), "run_identity": self.run_identity(),
                "save_trainable_only": self.config.uses_lora}

    # ---- 5. export ---------------------------------------------------------------------------------------------
    def export(self, out_dir: str | Path | None = None, *, merged: bool | None = None,
               weights: str | None = None) -> dict[str, str]:
        """The PEFT adapter directory (LoRA) and a merged safetensors model, each written atomically.

        `weights` (default EXPORT): "best" exports the best checkpoint's weights (TrainConfig.best_metric, the
        lowest validation loss by default) when training evaluated and saved one, else the last ones; "last" the
        weights training ended with. The live model is not changed; `self.exported` says which were taken."""
        trainer = self.trainer if self.has_trainer else None
        model = trainer.model if trainer is not None else self.model
        taken, self.exported = self.export_weights(trainer, model, weights or self.config.export)
        out = Path(out_dir or self.config.out_dir)
        paths = self.write_exports(model, out, self.config.export_merged if merged is None else merged, taken)
        if self.backend.is_main:
            atomic_write_text(out / "finetune.json", json.dumps(
                {**self.config.to_dict(), "paths": paths, "weights": self.exported}, indent=1, default=str))
        return paths

    def export_weights(self, trainer: Any, model: torch.nn.Module, choice: str) -> tuple[dict | None, dict]:
        """(checkpoint weights to export, or None for the live model's; what was taken, for finetune.json)."""
        check_choice("export", choice, EXPORT_WEIGHTS)
        step = trainer.step if trainer is not None else 0
        if choice == "best":
            best = trainer.state.best() if trainer is not None else None
            if best is not None:
                # The best is the last step: the live weights are the same, and need no read from disk.
                taken = trainer.state.checkpoint_weights(best["step"]) if best["step"] != step else None
                return taken, {"weights": "best", **best}
            metric = self.config.best_metric
            why = ("no training ran in this job" if trainer is None else "best_metric=None" if metric is None else
                   f"no checkpoint recorded {metric} (no evaluation at a save step)")
            return None, {"weights": "last", "step": step, "asked": "best", "why": why}
        return None, {"weights": "last", "step": step}

    def write_exports(self, model: torch.nn.Module, out: Path, merged: bool, taken: dict | None) -> dict[str, str]:
        """Write the adapter (LoRA), the merged model and a recipe's own exports (`merged_base`, `extra_exports`)
        from `model` (or the checkpoint weights `taken`) under `out`; returns their paths (empty on processes other
        than the main one, which still take part in reading the weights: on a pod a sharded tensor's read runs on
        all hosts)."""
        state = lora.export_state(model, weights=taken) if merged or lora.is_peft(model) else {}
        base, dtype = self.merged_base(model, merged)
        if base is not None and not lora.is_peft(model):
            state, base = base, None  # no adapter: the merged model is that base itself
        write_extra = self.extra_exports(model)
        self.backend.barrier()
        paths: dict[str, str] = {}
        if not self.backend.is_main:
            return paths
        if lora.is_peft(model):
            paths["adapter"] = str(lora.export_adapter(model, out / "adapter", state=state))
            self.tokenizer.save_pretrained(out / "adapter")
        if merged:
            paths["merged"] = str(lora.export_merged(model, self.tokenizer, out / "merged", base_source=self.source,
                                                     state=state, base_state=base, dtype=dtype))
            kind = self.config.export_gguf
            if kind is not None:
                paths["gguf"] = str(gguf_export.write_gguf(paths["merged"], out / gguf_export.file_name(kind), kind,
                                                           name=Path(self.source).name))
        elif self.config.export_gguf is not None:
            warnings.warn(f"EXPORT_GGUF={self.config.export_gguf!r}: no .gguf written, since this export wrote no "
                          "merged model (merged=False); call export() without merged=False to write both",
                          stacklevel=3)
        if write_extra is not None:
            paths.update(write_extra(out))
        return paths

    def merged_base(self, model: torch.nn.Module, merged: bool) -> tuple[dict | None, torch.dtype]:
        """(the base weights the merged export takes instead of the source's, or None; its dtype). A recipe whose
        training changed what the base computes (QAT) says so here; a 4-bit base (QUANTIZE_BASE) merges its
        dequantized weights, in bf16: what the adapters were trained on."""
        if self.config.quantize_base:
            return (quant4.dequantized_state(model) if merged else None), torch.bfloat16
        return None, torch.float32

    def extra_exports(self, model: torch.nn.Module) -> Callable[[Path], dict[str, str]] | None:
        """A recipe's own exports: what it reads from `model` now (every process), as a function the main process
        calls with the output directory after the adapter and merged model; None for none."""
        return None

    # ---- 6. results --------------------------------------------------------------------------------------------
    def tracked_results(self, results: dict) -> dict:
        """The samples before and after training as tables, for the trackers (a recipe adds its scores)."""
        tables = {f"samples/{when}": (results.get(f"samples_{when}") or {}).get("rows") or []
                  for when in ("before", "after")}
        return {"tables": tables, "values": {}}

    def results(self, *, before: dict | None = None, after: dict | None = None, paths: dict | None = None,
                plan: Any = None, **extra: Any) -> dict:
        """The run's results plus the samples before and after, where the held-out records come from, the exports,
        the plan and the sharding."""
        held = self.data.held_out
        return super().results(
            samples_before=before, samples_after=after, exports=paths or {},
            held_out={"source": held.source, "records": len(held), "label": held.label()},
            parameters=self.parameter_summary(), plan=plan.to_dict() if plan is not None else None,
            sharding={"sharding": self.config.sharding, "chips": self.chips, "mesh": list(self.backend.mesh_shape)},
            export_weights=self.exported, **extra)
