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
split, or EVAL_SHARE of DATASET split off before training (seeded by SEED). EVAL_TASKS scores the model before
training and the merged export after with lm-evaluation-harness (`run_eval_tasks`, `recipes.harness`).
QUANTIZE_BASE loads the frozen base in 4 bits (`models.quant4`). The shared settings: `recipes.hf_config`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend.units import block_params
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.atomic_io import atomic_write_text
from tpu_helpers.core.choices import EXPORT_WEIGHTS, check_choice
from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.core.sharding import is_sharded, mesh_shape
from tpu_helpers.data.held_out import HeldOut, hold_out
from tpu_helpers.memory.hf_plan import gathered_bytes_per_param, meta_model
from tpu_helpers.memory.per_chip import shard_estimate, sharding_plan
from tpu_helpers.memory.report import MemoryEstimate, memory_report
from tpu_helpers.models import gguf_export, hf, lm_head, lora, quant4
from tpu_helpers.recipes import harness
from tpu_helpers.recipes.base import Recipe
from tpu_helpers.recipes.hf_config import HFJobConfig, JobData  # noqa: F401  (re-exported: recipes import them here)


class HFJob(Recipe):
    """The shared half of a Hugging Face recipe (see the module docstring); a recipe supplies `estimate`,
    `make_trainer` and its data."""

    config_class: type[TrainConfig] = HFJobConfig
    config: HFJobConfig

    def __init__(self, config: HFJobConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.model_source = hf.resolve_model_source(config.model)  # MODEL, resolved
        self.exported: dict | None = None  # which weights the last export() took (the best checkpoint's or the last)
        self.export_paths: dict[str, str] = {}  # what the last export() wrote
        self.eval_runs: dict[str, dict] = {}  # EVAL_TASKS' scores: "before" and "after" (`run_eval_tasks`)
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
        self.export_paths = paths
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

    # ---- 6. standard evaluation (EVAL_TASKS) ------------------------------------------------------------------
    def run_eval_tasks(self, when: str) -> dict | None:
        """EVAL_TASKS scored by lm-evaluation-harness (`recipes.harness`): `when` "before" on the model training
        starts from, "after" on the merged export (`export()` first); kept for results.json and the trackers. None
        without EVAL_TASKS, and on every process but the main one (which the others wait for)."""
        check_choice("when", when, ("before", "after"))
        settings = self.config.harness
        if not settings.specs:
            return None
        if when == "after" and self.exported is None:
            raise RuntimeError("run_eval_tasks('after') scores the merged export: call export() first")
        if self.backend.is_main:
            model = self.source if when == "before" else self.export_paths.get("merged")
            if model is None:
                raise RuntimeError("run_eval_tasks('after') scores the merged export, which the last export() did not "
                                   "write (merged=False): call export() without it")
            cuda = self.backend.name == "cuda"
            self.eval_runs[when] = harness.evaluate(model, settings, device="cuda" if cuda else "cpu",
                                                    dtype="auto" if cuda else "float32", seed=self.config.seed)
        self.backend.barrier()
        return self.eval_runs.get(when)

    def eval_tasks_summary(self) -> str:
        """EVAL_TASKS' scores, one "task metric A -> B" line each (before -> after), or why there are none."""
        if not self.config.harness.specs:
            return "EVAL_TASKS: none (lm-evaluation-harness task names or task YAML paths; docs/guides/evaluation.md)"
        return harness.summary(self.eval_runs) or "EVAL_TASKS: not run yet (run_eval_tasks('before' / 'after'))"

    # ---- 7. results --------------------------------------------------------------------------------------------
    def tracked_results(self, results: dict) -> dict:
        """The samples before and after training as tables, and EVAL_TASKS' scores, for the trackers (a recipe
        adds its own scores)."""
        tables = {f"samples/{when}": (results.get(f"samples_{when}") or {}).get("rows") or []
                  for when in ("before", "after")}
        values = {f"eval_tasks/{task}/{metric}_{when}": value
                  for when, run in (results.get("eval_tasks") or {}).items() if when in ("before", "after")
                  for task, metrics in run["scores"].items() for metric, value in metrics.items()}
        return {"tables": tables, "values": values}

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
            export_weights=self.exported, **self._eval_tasks_results(), **extra)

    def _eval_tasks_results(self) -> dict:
        cfg = self.config.harness
        if not self.eval_runs:
            return {}
        return {"eval_tasks": {"tasks": list(cfg.specs), "limit": cfg.limit, "fewshot": cfg.fewshot,
                               "chat_template": cfg.chat_template, **self.eval_runs}}
