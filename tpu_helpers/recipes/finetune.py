"""The fine-tuning recipe behind notebooks/finetune_llm.ipynb: memory plan -> load -> data -> train -> samples -> export.

    job = Finetune(config_from_parameters(globals(), base=FinetuneConfig()))   # MODEL, DATASET, METHOD, LORA_*, ...
    print(job.plan().summary())                       # from the model's config only: nothing large allocated yet
    print(job.sharding_advice())                      # several chips: per chip under data and fsdp (SHARDING)
    print(job.parameter_summary(), job.data_stats)    # the model and the data, loaded on first use
    before = job.samples()                            # held-out prompts, exact match
    report = job.train()                              # the package Trainer (XLA hygiene, resume, signals)
    after = job.samples(); paths = job.export()       # adapter dir (LoRA) and merged safetensors model
    job.exported                                      # which weights: the best checkpoint's (EXPORT="best") or the last

METHOD "lora" trains peft adapters on a frozen base (bf16 on TPU); "full" trains every weight (fp32 master weights,
bf16 autocast on TPU); "distill" trains LoRA adapters (or the full model with LORA_R=0) against a frozen TEACHER of
the same vocabulary, run in every step, or, with TEACHER_CACHE, against a cache of its top-TOP_K log-probabilities
per position written once (built from TEACHER when missing; recipes/teacher_cache.py): no teacher in the step.
QAT "int4"/"int8" fake-quantizes the base's linear weights in the forward pass (torchao, models/qat.py): LoRA then
trains recovery adapters on the quantized base, "full" is full QAT; `export` adds the quantized weights with their
scales (`quantized/`, loads with from_pretrained through transformers' torchao integration) and writes the merged
model in bf16 with the quantized base. The default MODEL "tiny" and DATASET "instructions" need no network.

SHARDING (TrainConfig.sharding) "fsdp" shards the model, gradients and optimizer state over the chips (FSDPv2 on a
v5e-8, one decoder layer gathered at a time; FSDP2 under torchrun): LoRA on a 7B or full fine-tuning of a 1.5B
model on v5e chips. Checkpoints and exports keep the unwrapped model's names, so they load under any sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend.units import block_params
from tpu_helpers.choices import EXPORT_WEIGHTS, FINETUNE_METHODS, QAT_SCHEMES, check_choice
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.data.sft import (
    DEFAULT_DATASET,
    build_sft_datasets,
    exact_match,
    load_records,
    prompts_and_answers,
    record_form,
)
from tpu_helpers.extras import require_extra
from tpu_helpers.hardware import format_bytes
from tpu_helpers.memory.hf_plan import (
    gathered_bytes_per_param,
    hf_finetune_estimate,
    hf_sharding_plan,
    meta_model,
)
from tpu_helpers.memory.report import memory_report
from tpu_helpers.memory.sharded import shard_estimate
from tpu_helpers.models import hf, lora, qat
from tpu_helpers.recipes.base import Recipe
from tpu_helpers.recipes.exports import export_weights, write_exports
from tpu_helpers.recipes.teacher_cache import cache_results, cache_summary, job_teacher_cache
from tpu_helpers.sharding import is_sharded, mesh_shape
from tpu_helpers.training.causal_lm import CausalLMTrainer, DistillTrainer, check_same_vocab
from tpu_helpers.training.distill import CachedDistillTrainer

# Here, not at the first from_pretrained: without transformers/peft the notebook stops at its first cell, saying what
# to install, instead of after the memory plan with a bare ImportError.
require_extra("hf", "fine-tuning (tpu_helpers.recipes.finetune)")


@dataclass
class FinetuneConfig(TrainConfig):
    """`TrainConfig` plus the fine-tuning settings, each a notebook parameter of the same UPPER_CASE name. The
    trainer's settings keep their meaning (GRADIENT_CHECKPOINTING, SHARDING, ...); DATASET is the fine-tuning
    data, and the tokenizer is MODEL's own."""

    preset: str = "tiny"  # unused here (the GPT's size); kept small so nothing large is implied
    dataset: str = DEFAULT_DATASET  # "instructions" (generated), a local .jsonl/.json/.csv/.parquet, or a hub name
    model: str = hf.TINY  # hub name, local dir written by save_pretrained, or "tiny" (offline, built locally)
    method: str = "lora"  # lora | full | distill
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated linear names, or "all-linear"
    teacher: str | None = None  # distill: a model with the student's vocabulary
    temperature: float = 2.0
    distill_alpha: float = 0.5  # weight of the hard-label loss; the soft loss gets 1 - this
    teacher_cache: str | None = None  # distill: a directory of the teacher's top-k per position (built when missing)
    top_k: int = 128  # distill from a cache: the teacher's most likely tokens kept per position
    qat: str | None = None  # int4 | int8 | None: fake-quantized linear weights (LoRA on top, or full QAT)
    qat_group_size: int = 32  # QAT: input columns that share one scale
    max_records: int | None = None
    pack: bool = False  # several examples per row (positions restart per example) instead of one padded row each
    attn_implementation: str = hf.DEFAULT_ATTN  # sdpa | eager (see models/hf.py for the measured figures)
    export_merged: bool = True
    export: str = "best"  # best: the best checkpoint's weights (lowest validation loss) when training evaluated | last
    num_samples: int = 8  # held-out prompts shown before and after training
    max_new_tokens: int = 4

    def __post_init__(self) -> None:
        # The run's identity names the tokenizer: for a Hugging Face model it is the model's own.
        self.tokenizer = self.model if isinstance(self.model, str) else self.tokenizer
        super().__post_init__()
        check_choice("method", self.method, FINETUNE_METHODS)
        check_choice("export", self.export, EXPORT_WEIGHTS)
        if self.method == "distill" and not self.teacher and not self.teacher_cache:
            raise ConfigError("method='distill' needs a teacher: teacher=None; give a model that shares the "
                              "student's tokenizer (e.g. a larger model of the same family), or a teacher_cache")
        if self.teacher_cache is not None and (self.method != "distill" or not str(self.teacher_cache).strip()):
            raise ConfigError(f"teacher_cache={self.teacher_cache!r} is a directory for method='distill' (the "
                              f"teacher's top-k per position); method={self.method!r}")
        # top_k counts a teacher cache's tokens (distillation); GRPOConfig reuses the name for sampling (0: off).
        if self.method == "distill" and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 1 (at most the vocabulary size)")
        if self.qat is not None:
            check_choice("qat", self.qat, QAT_SCHEMES)
        if isinstance(self.qat_group_size, bool) or self.qat_group_size < 2:
            raise ConfigError(f"qat_group_size={self.qat_group_size!r} must be an integer >= 2 that divides the "
                              "width of every linear layer's input (e.g. 32, 64, 128)")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r={self.lora_r!r} must be >= 1 (or 0 for full distillation)")
        if self.method == "lora" and self.lora_r < 1:
            raise ConfigError(f"lora_r={self.lora_r!r} must be >= 1 with method='lora'")
        if self.max_records is not None and self.max_records < 1:
            raise ConfigError(f"max_records={self.max_records!r} must be >= 1, or None for all")
        for name in ("num_samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")

    @property
    def uses_lora(self) -> bool:
        return self.method == "lora" or (self.method == "distill" and self.lora_r > 0)

    @property
    def uses_cache(self) -> bool:
        return self.method == "distill" and self.teacher_cache is not None


class Finetune(Recipe):
    """One fine-tuning job; its parts load on first use, so a notebook shows results between any two calls."""

    config_class = FinetuneConfig
    config: FinetuneConfig

    def __init__(self, config: FinetuneConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.source = hf.resolve_model_source(config.model)
        self.exported: dict | None = None  # which weights the last export() took (the best checkpoint's or the last)

    @property
    def chips(self) -> int:
        """The chips this run spans: the SPMD program's devices on XLA, the torchrun processes elsewhere."""
        return max(self.backend.device_count, self.backend.world_size)

    # ---- 1. memory plan (config only) ----------------------------------------------------------------------------
    def _plan_inputs(self) -> tuple[Any, dict]:
        from transformers import AutoConfig

        cfg = self.config
        live = cfg.teacher and not cfg.uses_cache
        teacher = AutoConfig.from_pretrained(hf.resolve_model_source(cfg.teacher)) if live else None
        return AutoConfig.from_pretrained(self.source), dict(
            method="full" if (cfg.method == "distill" and cfg.lora_r == 0) else cfg.method, lora_r=cfg.lora_r,
            lora_targets=cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(","),
            precision=self.backend.precision, gradient_checkpointing=cfg.gradient_checkpointing,
            grad_accum=cfg.grad_accum, teacher_config=teacher, teacher_topk=cfg.top_k if cfg.uses_cache else 0,
            qat=cfg.qat)

    def sharding_plan(self, hardware: Any = None, *, chips: int | None = None):
        """Per-chip memory under data parallel and FSDP over 2, 4, ... chips (`tpu_helpers.memory.sharded`)."""
        config, kwargs = self._plan_inputs()
        return hf_sharding_plan(config, self.config.batch_size, self.config.seq_len, chips=chips or self.chips,
                                hardware=hardware or self.backend.hardware, **kwargs)

    def plan(self, hardware: Any = None, *, chips: int | None = None):
        """The memory report of one step per chip under this run's SHARDING over its chips (fsdp: 1/N of the
        weights, gradients and optimizer state plus one gathered block)."""
        config, kwargs = self._plan_inputs()
        model = meta_model(config)
        fsdp = mesh_shape(self.config.sharding, chips or self.chips)[1]
        block, width = block_params(model), gathered_bytes_per_param(kwargs["method"], kwargs["precision"])

        def estimate(b: int):
            est = hf_finetune_estimate(config, b, self.config.seq_len, model=model, **kwargs)
            return shard_estimate(est, fsdp, block_params=block, bytes_per_param=width)

        return memory_report(estimate, self.config.batch_size, hardware or self.backend.hardware)

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

    @cached_property
    def _loaded(self) -> tuple[torch.nn.Module, Any]:
        cfg = self.config
        model, tokenizer = hf.load_causal_lm(self.source, dtype=self._dtype(), attn_implementation=cfg.attn_implementation)
        hf.check_seq_len(model, cfg.seq_len)
        if cfg.qat:  # before LoRA: the adapters sit on top of the fake-quantized base
            qat.add_fake_quant(model, cfg.qat, cfg.qat_group_size)
        if cfg.uses_lora:
            torch.manual_seed(cfg.seed)  # the adapters' initial values depend on the seed only
            model = lora.add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                  targets=cfg.lora_targets)
        return model, tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The model being fine-tuned (peft-wrapped under LoRA), loaded on first use."""
        return self._loaded[0]

    @property
    def tokenizer(self) -> Any:
        return self._loaded[1]

    @cached_property
    def teacher(self) -> torch.nn.Module | None:
        """The frozen teacher of METHOD 'distill' (bf16 where the step computes in bf16), else None."""
        cfg = self.config
        if cfg.method != "distill":
            return None
        teacher, _ = hf.load_causal_lm(hf.resolve_model_source(cfg.teacher), attn_implementation=cfg.attn_implementation,
                                       dtype=torch.bfloat16 if self.backend.precision == "bf16" else None)
        check_same_vocab(self.model, teacher, cfg.teacher)
        return teacher

    @cached_property
    def teacher_cache(self):
        """The teacher's top-k of the training rows (METHOD 'distill' with TEACHER_CACHE), built on first use when
        missing and checked against this run; None without TEACHER_CACHE."""
        return job_teacher_cache(self) if self.config.uses_cache else None

    def teacher_cache_summary(self) -> str:
        """What the teacher cache holds (building it first when missing), or why this run has none."""
        return cache_summary(self)

    def parameter_summary(self) -> dict:
        m = self.model
        total = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        return {"parameters": total, "trainable": trainable, "trainable_share": trainable / total}

    # ---- 3. data -----------------------------------------------------------------------------------------------
    @cached_property
    def _data(self) -> tuple[Any, Any, dict, list[dict]]:
        cfg = self.config
        records = load_records(cfg.dataset, max_records=cfg.max_records)
        if not records:
            raise ConfigError(f"DATASET={cfg.dataset!r} has no records")
        record_form(records[0], where=f"DATASET={cfg.dataset!r} record 0")
        train, val, stats = build_sft_datasets(self.tokenizer, records, seq_len=cfg.seq_len,
                                               val_fraction=cfg.val_fraction, seed=cfg.seed, pack=cfg.pack)
        if cfg.dataset == DEFAULT_DATASET:
            held = load_records(DEFAULT_DATASET, split="test")
        else:
            held = [r for r in records[:64] if record_form(r) != "text"]
        return train, val, stats, held

    @property
    def train_data(self) -> Any:
        return self._data[0]

    @property
    def val_data(self) -> Any:
        return self._data[1]

    @property
    def data_stats(self) -> dict:
        """Rows, tokens and the share of trained tokens of the fixed-shape SFT rows."""
        return self._data[2]

    @property
    def held_out(self) -> list[dict]:
        """Records with reference answers for `samples` (the generated set's held-out prompts)."""
        return self._data[3]

    # ---- 4. samples --------------------------------------------------------------------------------------------
    def samples(self, n: int | None = None) -> dict:
        """Greedy answers to held-out prompts (all of them for the generated set), exact match and graph count."""
        if not self.held_out:
            return {"exact_match": None, "rows": [], "compilations": 0}
        records = self.held_out if n is None else self.held_out[:n]
        prompts, answers = prompts_and_answers(records)
        model = self._model_on_device()
        before = self.backend.metrics().get("compilations", 0)
        preds = hf.generate(model, self.tokenizer, prompts, device=self.backend.device, sync=self.backend.sync,
                            max_new_tokens=self.config.max_new_tokens, prompt_len=self.config.seq_len // 2)
        compiles = self.backend.metrics().get("compilations", 0) - before
        rows = [{"prompt": p[-1]["content"], "answer": a, "prediction": y}
                for p, a, y in zip(prompts, answers, preds, strict=True)]
        return {"exact_match": exact_match(preds, answers), "rows": rows, "compilations": compiles}

    def _model_on_device(self) -> torch.nn.Module:
        if "trainer" in self.__dict__ or (is_sharded(self.config.sharding) and self.chips > 1):
            # Sharded because it may not fit one chip whole: placed as training will place it (the trainer does).
            return self.trainer.model
        return self.backend.move_model(self.model)

    # ---- 5. training -------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        cfg = self.config
        ident = {"method": cfg.method, "model_source": self.source, "lora_r": cfg.lora_r if cfg.uses_lora else 0,
                 "lora_targets": cfg.lora_targets if cfg.uses_lora else "", "teacher": cfg.teacher or ""}
        if cfg.uses_lora:
            ident.update(lora.base_fingerprint(self.model, self.source))
        if cfg.qat:
            ident.update(qat=cfg.qat, qat_group_size=cfg.qat_group_size)
        if cfg.uses_cache:
            ident.update(teacher_cache=self.teacher_cache.identity["data"], top_k=cfg.top_k)
        return ident

    def make_trainer(self) -> CausalLMTrainer:
        # GRADIENT_CHECKPOINTING: the Trainer passes the backend's checkpoint function to the model's own hook.
        cfg = self.config
        # Under LoRA a checkpoint holds the adapters and their optimizer state only (run_state.py).
        common = dict(run_identity=self.run_identity(), save_trainable_only=cfg.uses_lora, **self.trainer_options())
        if cfg.uses_cache:
            return CachedDistillTrainer(self.model, self.teacher_cache.attach(self.train_data), self.val_data,
                                        temperature=cfg.temperature, alpha=cfg.distill_alpha, **common)
        if cfg.method == "distill":
            return DistillTrainer(self.model, self.train_data, self.val_data, teacher=self.teacher,
                                  temperature=cfg.temperature, alpha=cfg.distill_alpha, teacher_name=cfg.teacher,
                                  **common)
        return CausalLMTrainer(self.model, self.train_data, self.val_data, **common)

    # ---- 6. export ---------------------------------------------------------------------------------------------
    def export(self, out_dir: str | Path | None = None, *, merged: bool | None = None,
               weights: str | None = None) -> dict[str, str]:
        """The PEFT adapter directory (LoRA) and a merged safetensors model, each written atomically; under QAT the
        merged model is bf16 with the fake-quantized base (what training computed) and `quantized/` holds the int
        weights with their scales (models/qat.py).

        `weights` (default EXPORT): "best" exports the best checkpoint's weights (TrainConfig.best_metric, the
        lowest validation loss by default) when training evaluated and saved one, else the last ones; "last" the
        weights training ended with. The live model is not changed; `self.exported` says which were taken."""
        model = self.trainer.model if "trainer" in self.__dict__ else self.model
        taken, self.exported = export_weights(self.config, self.__dict__.get("trainer"), model,
                                              weights or self.config.export)
        return write_exports(self, model, Path(out_dir or self.config.out_dir),
                             self.config.export_merged if merged is None else merged, taken)

    # ---- 7. results --------------------------------------------------------------------------------------------
    def tracked_results(self, results: dict) -> dict:
        """The samples before and after training as tables, and their exact match, for the trackers."""
        tables, values = {}, {}
        for when in ("before", "after"):
            samples = results.get(f"samples_{when}") or {}
            tables[f"samples/{when}"] = samples.get("rows") or []
            if samples.get("exact_match") is not None:
                values[f"samples/exact_match_{when}"] = samples["exact_match"]
        return {"tables": tables, "values": values}

    def results(self, *, before: dict | None = None, after: dict | None = None, paths: dict | None = None,
                plan: Any = None, **extra: Any) -> dict:
        """The run's results plus the samples before and after, the exports, the plan and the data figures."""
        return super().results(
            samples_before=before, samples_after=after, exports=paths or {},
            parameters=self.parameter_summary(), data=self.data_stats,
            plan=plan.to_dict() if plan is not None else None,
            sharding={"sharding": self.config.sharding, "chips": self.chips, "mesh": list(self.backend.mesh_shape)},
            export_weights=self.exported, **cache_results(self), **extra)

