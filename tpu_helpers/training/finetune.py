"""The fine-tuning recipe behind notebooks/finetune_llm.ipynb: memory plan -> load -> data -> train -> samples -> export.

    ft, cfg = finetune_from_parameters(globals())     # MODEL, DATASET, METHOD, LORA_*, SEQ_LEN, STEPS, DEVICE, ...
    job = Finetune(ft, cfg)
    print(job.plan().summary())                       # from the model's config only: nothing large allocated yet
    print(job.sharding_advice())                      # several chips: per chip under data and fsdp (SHARDING)
    job.load(); job.prepare_data()
    before = job.samples()                            # held-out prompts, exact match
    report = job.train()                              # the package Trainer (XLA hygiene, resume, signals)
    after = job.samples(); paths = job.export()       # adapter dir (LoRA) and merged safetensors model

METHOD "lora" trains peft adapters on a frozen base (bf16 on TPU); "full" trains every weight (fp32 master weights,
bf16 autocast on TPU); "distill" trains LoRA adapters (or the full model with LORA_R=0) against a frozen TEACHER of
the same vocabulary. The default MODEL "tiny" and DATASET "instructions" need no network.

SHARDING (TrainConfig.sharding) "fsdp" shards the model, gradients and optimizer state over the chips (FSDPv2 on a
v5e-8, one decoder layer gathered at a time; FSDP2 under torchrun): LoRA on a 7B or full fine-tuning of a 1.5B
model on v5e chips. Checkpoints and exports keep the unwrapped model's names, so they load under any sharding.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend import Backend, backend_for
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
from tpu_helpers.launch.params import config_from_parameters
from tpu_helpers.models import hf, lora
from tpu_helpers.training.callbacks import as_callback
from tpu_helpers.training.causal_lm import CausalLMTrainer, DistillTrainer
from tpu_helpers.training.sharding import is_sharded, mesh_shape

# Here, not at the first from_pretrained: without transformers/peft the notebook stops at its first cell, saying what
# to install, instead of after the memory plan with a bare ImportError.
require_extra("hf", "fine-tuning (tpu_helpers.training.finetune)")

METHODS = ("lora", "full", "distill")


@dataclass
class FinetuneConfig:
    model: str = hf.TINY  # hub name, local dir written by save_pretrained, or "tiny" (offline, built locally)
    dataset: str = DEFAULT_DATASET  # "instructions" (generated), a local .jsonl/.json/.csv/.parquet, or a hub name
    method: str = "lora"  # lora | full | distill
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated linear names, or "all-linear"
    teacher: str | None = None  # distill: a model with the student's vocabulary
    temperature: float = 2.0
    distill_alpha: float = 0.5  # weight of the hard-label loss; the soft loss gets 1 - this
    max_records: int | None = None
    pack: bool = False  # several examples per row (positions restart per example) instead of one padded row each
    attn_implementation: str = hf.DEFAULT_ATTN  # sdpa | eager (see models/hf.py for the measured figures)
    grad_checkpointing: bool = False  # recompute activations in backward (torch_xla's checkpoint on XLA)
    export_merged: bool = True
    num_samples: int = 8  # held-out prompts shown before and after training
    max_new_tokens: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"METHOD={self.method!r} is not one of {METHODS}")
        if self.method == "distill" and not self.teacher:
            raise ConfigError("METHOD='distill' needs TEACHER: a model sharing the student's tokenizer")
        if self.lora_r < 0:
            raise ConfigError(f"LORA_R={self.lora_r!r} must be >= 1 (or 0 for full distillation)")
        if self.method == "lora" and self.lora_r < 1:
            raise ConfigError(f"LORA_R={self.lora_r!r} must be >= 1 with METHOD='lora'")


_FT_FIELDS = {f.name.upper(): f for f in fields(FinetuneConfig)}


def finetune_from_parameters(namespace: dict, *, base: TrainConfig | None = None
                             ) -> tuple[FinetuneConfig, TrainConfig]:
    """Split a notebook's UPPER_CASE parameters into the recipe's and the Trainer's (unknown names are errors)."""
    extra = {name: object for name in _FT_FIELDS}
    cfg = config_from_parameters(namespace, base=base or TrainConfig(preset="tiny"), extra=extra)
    ft_values = {k: cfg.extra.pop(k) for k in list(cfg.extra) if k.upper() in _FT_FIELDS}
    try:
        ft = FinetuneConfig(**ft_values)
    except TypeError as err:
        raise ConfigError(str(err)) from None
    return ft, cfg.replace(dataset=ft.dataset, tokenizer=ft.model,
                           gradient_checkpointing=ft.grad_checkpointing or cfg.gradient_checkpointing)


class Finetune:
    """One fine-tuning job; each step is a method so a notebook shows its results in between."""

    def __init__(self, ft: FinetuneConfig, cfg: TrainConfig, *, backend: Backend | None = None) -> None:
        self.ft, self.cfg = ft, cfg
        self.backend = backend or backend_for(cfg)
        self.source = hf.resolve_model_source(ft.model)
        self.model: torch.nn.Module | None = None
        self.trainer: CausalLMTrainer | None = None

    # ---- 1. memory plan (config only) ----------------------------------------------------------------------------
    @property
    def chips(self) -> int:
        """The chips this run spans: the SPMD program's devices on XLA, the torchrun processes elsewhere."""
        return max(self.backend.device_count, self.backend.world_size)

    def _plan_inputs(self) -> tuple[Any, dict]:
        from transformers import AutoConfig

        ft, cfg = self.ft, self.cfg
        teacher = AutoConfig.from_pretrained(hf.resolve_model_source(ft.teacher)) if ft.teacher else None
        return AutoConfig.from_pretrained(self.source), dict(
            method="full" if (ft.method == "distill" and ft.lora_r == 0) else ft.method, lora_r=ft.lora_r,
            lora_targets=ft.lora_targets if ft.lora_targets == "all-linear" else ft.lora_targets.split(","),
            precision=self.backend.precision, gradient_checkpointing=cfg.gradient_checkpointing,
            teacher_config=teacher)

    def sharding_plan(self, hardware: Any = None, *, chips: int | None = None):
        """Per-chip memory under data parallel and FSDP over 2, 4, ... chips (`tpu_helpers.memory.sharded`)."""
        from tpu_helpers.memory.hf_plan import hf_sharding_plan

        config, kwargs = self._plan_inputs()
        return hf_sharding_plan(config, self.cfg.batch_size, self.cfg.seq_len, chips=chips or self.chips,
                                hardware=hardware or self.backend.hardware, **kwargs)

    def plan(self, hardware: Any = None, *, chips: int | None = None):
        """The memory report of one step per chip under this run's SHARDING over its chips (fsdp: 1/N of the
        weights, gradients and optimizer state plus one gathered block)."""
        from tpu_helpers.memory.hf_plan import (
            block_params,
            gathered_bytes_per_param,
            hf_finetune_estimate,
            meta_model,
        )
        from tpu_helpers.memory.report import memory_report
        from tpu_helpers.memory.sharded import shard_estimate

        config, kwargs = self._plan_inputs()
        model = meta_model(config)
        fsdp = mesh_shape(self.cfg.sharding, chips or self.chips)[1]
        block, width = block_params(model), gathered_bytes_per_param(kwargs["method"], kwargs["precision"])

        def estimate(b: int):
            est = hf_finetune_estimate(config, b, self.cfg.seq_len, model=model, **kwargs)
            return shard_estimate(est, fsdp, block_params=block, bytes_per_param=width)

        return memory_report(estimate, self.cfg.batch_size, hardware or self.backend.hardware)

    def sharding_advice(self, hardware: Any = None, *, chips: int | None = None) -> str:
        """What SHARDING needs per chip here and what the other choices would ("" on a single chip)."""
        chips = chips or self.chips
        if chips == 1:
            return ""
        plan = self.sharding_plan(hardware, chips=chips)
        fsdp = mesh_shape(self.cfg.sharding, chips)[1]
        choice = plan.per_chip.get("data" if fsdp == 1 else f"fsdp x{fsdp}")
        mine = f"SHARDING={self.cfg.sharding!r}: about {format_bytes(choice.peak_bytes)} per chip. " if choice else ""
        return f"{mine}{plan.advice()}\n{plan.table()}"

    # ---- 2. model ----------------------------------------------------------------------------------------------
    @property
    def uses_lora(self) -> bool:
        return self.ft.method == "lora" or (self.ft.method == "distill" and self.ft.lora_r > 0)

    def _dtype(self) -> torch.dtype | None:
        # A frozen base in bf16 on TPU; trained weights stay fp32 (bf16 autocast computes in bf16 anyway).
        return torch.bfloat16 if self.backend.precision == "bf16" and self.uses_lora else None

    def load(self) -> torch.nn.Module:
        ft = self.ft
        model, self.tokenizer = hf.load_causal_lm(self.source, dtype=self._dtype(),
                                                  attn_implementation=ft.attn_implementation)
        hf.check_seq_len(model, self.cfg.seq_len)
        if self.uses_lora:
            torch.manual_seed(self.cfg.seed)  # the adapters' initial values depend on the seed only
            model = lora.add_lora(model, r=ft.lora_r, alpha=ft.lora_alpha, dropout=ft.lora_dropout,
                                  targets=ft.lora_targets)
        self.teacher = None
        if ft.method == "distill":
            from tpu_helpers.training.causal_lm import check_same_vocab

            self.teacher, _ = hf.load_causal_lm(hf.resolve_model_source(ft.teacher), dtype=torch.bfloat16
                                                if self.backend.precision == "bf16" else None,
                                                attn_implementation=ft.attn_implementation)
            check_same_vocab(model, self.teacher, ft.teacher)
        self.model = model
        return model

    def parameter_summary(self) -> dict:
        m = self.model
        total = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        return {"parameters": total, "trainable": trainable, "trainable_share": trainable / total}

    # ---- 3. data -----------------------------------------------------------------------------------------------
    def prepare_data(self) -> dict:
        records = load_records(self.ft.dataset, max_records=self.ft.max_records)
        if not records:
            raise ConfigError(f"DATASET={self.ft.dataset!r} has no records")
        record_form(records[0], where=f"DATASET={self.ft.dataset!r} record 0")
        self.train_data, self.val_data, self.data_stats = build_sft_datasets(
            self.tokenizer, records, seq_len=self.cfg.seq_len, val_fraction=self.cfg.val_fraction, seed=self.cfg.seed,
            pack=self.ft.pack)
        if self.ft.dataset == DEFAULT_DATASET:
            held = load_records(DEFAULT_DATASET, split="test")
        else:
            held = [r for r in records[:64] if record_form(r) != "text"]
        self.held_out = held
        return self.data_stats

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
                            max_new_tokens=self.ft.max_new_tokens, prompt_len=self.cfg.seq_len // 2)
        compiles = self.backend.metrics().get("compilations", 0) - before
        rows = [{"prompt": p[-1]["content"], "answer": a, "prediction": y}
                for p, a, y in zip(prompts, answers, preds, strict=True)]
        return {"exact_match": exact_match(preds, answers), "rows": rows, "compilations": compiles}

    def _model_on_device(self) -> torch.nn.Module:
        if self.trainer is None and is_sharded(self.cfg.sharding) and self.chips > 1:
            # Sharded because it may not fit one chip whole: shard it now, as training will (the trainer does).
            self.make_trainer()
        return self.trainer.model if self.trainer is not None else self.backend.prepare_model(self.model)

    # ---- 5. training -------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        ft = self.ft
        ident = {"method": ft.method, "model_source": self.source, "lora_r": ft.lora_r if self.uses_lora else 0,
                 "lora_targets": ft.lora_targets if self.uses_lora else "", "teacher": ft.teacher or ""}
        if self.uses_lora:
            ident.update(lora.base_fingerprint(self.model, self.source))
        return ident

    def make_trainer(self, **kwargs: Any) -> CausalLMTrainer:
        # GRADIENT_CHECKPOINTING: the Trainer passes the backend's checkpoint function to the model's own hook.
        common = dict(config=self.cfg, backend=self.backend, run_identity=self.run_identity(), **kwargs)
        if self.ft.method == "distill":
            trainer = DistillTrainer(self.model, self.train_data, self.val_data, teacher=self.teacher,
                                     temperature=self.ft.temperature, alpha=self.ft.distill_alpha,
                                     teacher_name=self.ft.teacher, **common)
        else:
            trainer = CausalLMTrainer(self.model, self.train_data, self.val_data, **common)
        # Under LoRA a checkpoint holds the adapters and their optimizer state only (run_state.py).
        trainer.save_trainable_only = self.uses_lora
        self.trainer = trainer
        return trainer

    def train(self, *, progress: bool | None = None, callbacks: list | None = None, **kwargs: Any):
        """Fit; `progress`, `callbacks` and the other Trainer arguments apply when the trainer is made here. Made
        earlier (by `samples()` under a sharded SHARDING), it takes `progress` and `callbacks` still."""
        if self.trainer is None:
            given = {k: v for k, v in (("progress", progress), ("callbacks", callbacks)) if v is not None}
            return self.make_trainer(**given, **kwargs).fit()
        if kwargs:
            raise ConfigError(f"Finetune.train({', '.join(kwargs)}=...): the trainer already exists (made by "
                              "samples() or make_trainer()); pass these to make_trainer() before sampling")
        if progress is not None:
            self.trainer.progress = progress
        self.trainer.callbacks.extend(as_callback(c) for c in callbacks or [])
        return self.trainer.fit()

    # ---- 6. export ---------------------------------------------------------------------------------------------
    def export(self, out_dir: str | Path | None = None, *, merged: bool | None = None) -> dict[str, str]:
        out = Path(out_dir or self.cfg.out_dir)
        model = self.trainer.model if self.trainer is not None else self.model
        merged = self.ft.export_merged if merged is None else merged
        # Every process reads the weights to the host (on a pod a sharded tensor's read runs on all hosts); the
        # main one writes.
        state = lora.export_state(model) if merged or lora.is_peft(model) else {}
        self.backend.barrier()
        paths: dict[str, str] = {}
        if not self.backend.is_main:
            return paths
        if lora.is_peft(model):
            paths["adapter"] = str(lora.export_adapter(model, out / "adapter", state=state))
            self.tokenizer.save_pretrained(out / "adapter")
        if merged:
            paths["merged"] = str(lora.export_merged(model, self.tokenizer, out / "merged", base_source=self.source,
                                                     state=state))
        from tpu_helpers.atomic_io import atomic_write_text

        atomic_write_text(out / "finetune.json", json.dumps({**dataclasses.asdict(self.ft), "paths": paths}, indent=1))
        return paths

    # ---- 7. results --------------------------------------------------------------------------------------------
    def save_results(self, report: Any, *, before: dict | None = None, after: dict | None = None,
                     paths: dict | None = None, plan: Any = None) -> Path:
        """`<out_dir>/results.json` (report, history, samples, exports, plan) and `loss.png`, atomically; copied
        into the run directory when run by `python -m tpu_helpers run`."""
        from tpu_helpers.training.results import write_results

        history = self.trainer.history
        results = {"report": report.to_dict(), "config": self.cfg.to_dict(), "finetune": dataclasses.asdict(self.ft),
                   "history": history.to_dict(), "samples_before": before, "samples_after": after,
                   "exports": paths or {}, "parameters": self.parameter_summary(), "data": self.data_stats,
                   "plan": plan.to_dict() if plan is not None else None,
                   "sharding": {"sharding": self.cfg.sharding, "chips": self.chips,
                                "mesh": list(getattr(self.backend, "mesh_shape", ()))}}
        return write_results(self.cfg.out_dir, results, figure=history.figure(), is_main=self.backend.is_main)
