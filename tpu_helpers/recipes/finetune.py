"""The fine-tuning recipe behind notebooks/finetune_llm.ipynb: memory plan -> load -> data -> train -> samples -> export.

    job = Finetune(config_from_parameters(globals(), base=FinetuneConfig()))   # MODEL, DATASET, METHOD, LORA_*, ...
    print(job.plan().summary())                       # from the model's config only: nothing large allocated yet
    before = job.samples()                            # held-out prompts, exact match
    report = job.train()                              # the package Trainer (XLA hygiene, resume, signals)
    after = job.samples(); paths = job.export()       # adapter dir (LoRA) and merged safetensors model

A sibling of GRPO and preference tuning on the shared Hugging Face job (`recipes.hf_job`). METHOD "lora" trains
adapters on a frozen base, "full" every weight, "distill" a student against a frozen TEACHER run in every step or
against TEACHER_CACHE, the teacher's top-k written once (`algorithms.distill`; its `DistillSettings` fields are this
config's DISTILL_TEMPERATURE, ...; DISTILL_LAMBDA > 0 lets the student answer the prompts itself, MAX_NEW_TOKENS
tokens, as TRL's GKD). QAT fake-quantizes the base's linear weights (`models.qat`) and adds
a quantized export. Every parameter: docs/jobs/finetune.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar

import torch

from tpu_helpers.algorithms.distill import (
    CachedDistillTrainer,
    DistillSettings,
    DistillTrainer,
    check_same_vocab,
    open_teacher_cache,
)
from tpu_helpers.algorithms.sft import CausalLMTrainer
from tpu_helpers.config import ConfigError, settings_fields, settings_from
from tpu_helpers.core.choices import FINETUNE_METHODS, QAT_SCHEMES, check_choice
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.sft import (
    DEFAULT_DATASET,
    build_sft_datasets,
    check_records,
    exact_match,
    load_records,
    prompts_and_answers,
    record_form,
)
from tpu_helpers.data.teacher_cache import cache_identity
from tpu_helpers.memory.hf_plan import hf_finetune_estimate
from tpu_helpers.models import hf, lora, qat, quant4
from tpu_helpers.recipes.hf_job import HFJob, HFJobConfig, JobData

# Here, not at the first from_pretrained: without transformers/peft the notebook stops at its first cell, saying what
# to install, instead of after the memory plan with a bare ImportError.
require_extra("hf", "fine-tuning (tpu_helpers.recipes.finetune)")

_WHAT = {"lora": "LoRA fine-tuning", "full": "full fine-tuning", "distill": "distillation"}


def _tail(text: str, n: int = 200) -> str:
    """A rendered prompt's end (a tool conversation's last messages and the generation prompt), for the samples."""
    return text if len(text) <= n else "..." + text[-n:]


@dataclass
@settings_fields(DistillSettings, prefix="distill_")  # DISTILL_TEMPERATURE, ...: declared there
class FinetuneConfig(HFJobConfig):
    """`HFJobConfig` plus fine-tuning's own settings (distillation, QAT, packing), each a notebook parameter of
    the same UPPER_CASE name: the fields of `algorithms.distill.DistillSettings` with the prefix `distill_` (built
    from them once, `config.distill`) and the recipe's own below. DATASET is the fine-tuning data."""

    dataset: str = DEFAULT_DATASET  # "instructions" (generated), a local .jsonl/.json/.csv/.parquet, or a hub name
    method: str = "lora"  # lora | full | distill
    teacher: str | None = None  # distill: a model with the student's vocabulary
    teacher_cache: str | None = None  # distill: a directory of the teacher's top-k per position (built when missing)
    teacher_top_k: int = 128  # distill from a cache: the teacher's most likely tokens kept per position
    teacher_quantize: str | None = None  # nf4 | int4 | None: the live teacher's linear layers in 4 bits (QUANTIZE_BASE's)
    qat: str | None = None  # int4 | int8 | None: fake-quantized linear weights (LoRA on top, or full QAT)
    qat_group_size: int = 32  # QAT: input columns that share one scale
    pack: bool = False  # several examples per row (positions restart per example) instead of one padded row each

    methods: ClassVar[tuple[str, ...]] = FINETUNE_METHODS
    recipe: ClassVar[str] = "fine-tuning"
    # Other names of the distillation settings an older notebook may pass (TEMPERATURE and TOP_K mean sampling).
    renamed: ClassVar[dict[str, str]] = {"temperature": "distill_temperature", "top_k": "teacher_top_k"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teacher is not None:
            hf.check_model_name(self.teacher, "TEACHER")
        if self.method == "distill" and not self.teacher and not self.teacher_cache:
            raise ConfigError("method='distill' needs a teacher: teacher=None; give a model that shares the "
                              "student's tokenizer (e.g. a larger model of the same family), or a teacher_cache")
        if self.teacher_cache is not None and (self.method != "distill" or not str(self.teacher_cache).strip()):
            raise ConfigError(f"teacher_cache={self.teacher_cache!r} is a directory for method='distill' (the "
                              f"teacher's top-k per position); method={self.method!r}")
        if isinstance(self.teacher_top_k, bool) or self.teacher_top_k < 1:
            raise ConfigError(f"teacher_top_k={self.teacher_top_k!r} must be an integer >= 1 (at most the "
                              "vocabulary size)")
        self.distill = settings_from(self, DistillSettings)  # checked once; the distillation trainers take it
        if self.distill.on_policy and (self.method != "distill" or self.teacher_cache is not None):
            raise ConfigError(f"distill_lambda={self.distill_lambda!r}: the student's own answers are scored by a "
                              f"teacher run live (method='distill' with TEACHER and teacher_cache=None); "
                              f"method={self.method!r}, teacher_cache={self.teacher_cache!r}")
        # The live teacher's 4-bit format, parsed once (QUANTIZE_BASE's formats and QUANTIZE_GROUP_SIZE).
        self.teacher_format = None if self.teacher_quantize is None else quant4.as_format(self.teacher_quantize)
        if self.teacher_quantize is not None and (self.method != "distill" or self.teacher_cache is not None):
            raise ConfigError(f"teacher_quantize={self.teacher_quantize!r} loads a live teacher in 4 bits: it needs "
                              f"method='distill' and teacher_cache=None; method={self.method!r}, "
                              f"teacher_cache={self.teacher_cache!r}")
        if self.qat is not None:
            check_choice("qat", self.qat, QAT_SCHEMES)
        if self.qat is not None and self.quantize_base is not None:
            raise ConfigError(f"qat={self.qat!r} and quantize_base={self.quantize_base!r}: choose one (QAT trains "
                              "on fake-quantized weights, QUANTIZE_BASE stores the frozen base in 4 bits)")
        if isinstance(self.qat_group_size, bool) or self.qat_group_size < 2:
            raise ConfigError(f"qat_group_size={self.qat_group_size!r} must be an integer >= 2 that divides the "
                              "width of every linear layer's input (e.g. 32, 64, 128)")

    @property
    def uses_lora(self) -> bool:
        return self.method == "lora" or (self.method == "distill" and self.lora_r > 0)

    @property
    def uses_cache(self) -> bool:
        return self.method == "distill" and self.teacher_cache is not None


class Finetune(HFJob):
    """One fine-tuning job; its parts load on first use, so a notebook shows results between any two calls."""

    config_class = FinetuneConfig
    config: FinetuneConfig

    # ---- 1. memory plan (config only) ----------------------------------------------------------------------------
    def plan_options(self) -> dict:
        cfg = self.config
        method = "full" if (cfg.method == "distill" and cfg.lora_r == 0) else cfg.method
        return {**super().plan_options(), "method": method}

    @property
    def plan_what(self) -> str:
        method = self.plan_options()["method"]
        return _WHAT.get(method, method)

    def estimate(self, model_config: Any, model: torch.nn.Module):
        from transformers import AutoConfig

        cfg = self.config
        live = cfg.teacher and not cfg.uses_cache
        teacher = AutoConfig.from_pretrained(hf.resolve_model_source(cfg.teacher)) if live else None
        kwargs = dict(self.plan_options(), teacher_config=teacher,
                      teacher_topk=cfg.teacher_top_k if cfg.uses_cache else 0, qat=cfg.qat,
                      teacher_quantize=cfg.teacher_format, teacher_group_size=cfg.quantize_group_size,
                      answer_tokens=cfg.max_new_tokens if cfg.distill.on_policy else 0)
        return lambda b: hf_finetune_estimate(model_config, b, cfg.seq_len, model=model, **kwargs)

    # ---- 2. model ----------------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> None:
        cfg = self.config
        hf.check_seq_len(model, cfg.seq_len)
        if cfg.qat:  # before LoRA: the adapters sit on top of the fake-quantized base
            qat.add_fake_quant(model, cfg.qat, cfg.qat_group_size)

    def _load_teacher(self) -> torch.nn.Module:
        """TEACHER, frozen-ready (bf16 where the step computes in bf16; TEACHER_QUANTIZE: its linear layers in 4
        bits), its vocabulary and tokenizer checked against MODEL's."""
        cfg = self.config
        source = hf.resolve_model_source(cfg.teacher)
        if cfg.teacher_format is None:
            teacher, tokenizer = self.load(source, frozen=True)
        else:
            dtype = torch.bfloat16 if self.backend.precision == "bf16" else None
            teacher, tokenizer = hf.load_causal_lm(source, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                                   quantize=cfg.teacher_format, group_size=cfg.quantize_group_size)
        check_same_vocab(self.model, teacher, cfg.teacher, str(cfg.model), (self.tokenizer, tokenizer))
        return teacher

    @cached_property
    def teacher(self) -> torch.nn.Module | None:
        """The frozen teacher run in every step (METHOD 'distill' without TEACHER_CACHE), else None."""
        return self._load_teacher() if self.config.method == "distill" and not self.config.uses_cache else None

    @cached_property
    def teacher_cache(self):
        """The teacher's top-k of the training rows (METHOD 'distill' with TEACHER_CACHE), built on first use when
        missing and checked against this run; None without TEACHER_CACHE."""
        cfg = self.config
        if not cfg.uses_cache:
            return None
        vocab = self.model.get_output_embeddings().weight.shape[0]
        # Checks TEACHER_TOP_K against the vocabulary before any teacher loads.
        ident = cache_identity(teacher=cfg.teacher or "", teacher_hash="", tokenizer=self.tokenizer, vocab_size=vocab,
                               k=cfg.teacher_top_k, temperature=cfg.distill_temperature, rows=self.train_data)
        return open_teacher_cache(cfg.teacher_cache, ident, backend=self.backend, rows=self.train_data,
                                  k=cfg.teacher_top_k, temperature=cfg.distill_temperature,
                                  batch_size=cfg.batch_size, load_teacher=self._load_teacher if cfg.teacher else None,
                                  teacher_name=cfg.teacher or "")

    def teacher_cache_summary(self) -> str:
        """What the teacher cache holds (building it first when missing), or why this run has none."""
        cfg = self.config
        if not cfg.uses_cache:
            live = f"; the teacher {cfg.teacher!r} runs in every step" if cfg.method == "distill" else ""
            return f"no teacher cache (METHOD={cfg.method!r}, TEACHER_CACHE=None{live})"
        return self.teacher_cache.summary()

    # ---- 3. data -----------------------------------------------------------------------------------------------
    def load_data(self) -> JobData:
        """Fixed-shape SFT rows of DATASET's training records (stats: rows, tokens, the share of trained tokens),
        validation rows split off them (VAL_FRACTION), and the held-out records with answers (`hold_out`: the
        generated set's test split, EVAL_DATASET, or EVAL_SHARE of DATASET; none of them trains)."""
        cfg = self.config
        records = self.read_records(load_records)
        record_form(records[0], where=f"DATASET={cfg.dataset!r} record 0")
        check_records(records, where=f"DATASET={cfg.dataset!r} record")  # errors name the record as read
        test = partial(load_records, DEFAULT_DATASET, split="test") if cfg.dataset == DEFAULT_DATASET else None
        held = self.hold_out(records, load_records, generated=test,
                             usable=lambda record, where: record_form(record, where=where) != "text")
        train, val, stats = build_sft_datasets(self.tokenizer, [records[i] for i in held.training],
                                               seq_len=cfg.seq_len, val_fraction=cfg.val_fraction, seed=cfg.seed,
                                               pack=cfg.pack)
        return JobData(train, val, stats, held, records)

    # ---- 4. samples --------------------------------------------------------------------------------------------
    def samples(self, n: int | None = None) -> dict:
        """Greedy answers to held-out prompts (all of them for the generated set), exact match and graph count."""
        if not self.held_out:
            return {"exact_match": None, "rows": [], "compilations": 0}
        records = self.held_out if n is None else self.held_out[:n]
        prompts, answers = prompts_and_answers(records, self.tokenizer)  # a tool conversation's prompt: its text
        model = self._model_on_device()
        before = self.backend.metrics().get("compilations", 0)
        preds = hf.generate(model, self.tokenizer, prompts, device=self.backend.device, sync=self.backend.sync,
                            max_new_tokens=self.config.max_new_tokens, prompt_len=self.config.seq_len // 2,
                            replay=self.backend.compile_step, loop=self.backend.compile_loop)
        compiles = self.backend.metrics().get("compilations", 0) - before
        rows = [{"prompt": p[-1]["content"] if isinstance(p, list) else _tail(p), "answer": a, "prediction": y}
                for p, a, y in zip(prompts, answers, preds, strict=True)]
        return {"exact_match": exact_match(preds, answers), "rows": rows, "compilations": compiles}

    # ---- 5. training -------------------------------------------------------------------------------------------
    def run_identity(self) -> dict:
        cfg = self.config
        ident = {**super().run_identity(), "teacher": cfg.teacher or ""}
        if cfg.qat:
            ident.update(qat=cfg.qat, qat_group_size=cfg.qat_group_size)
        if cfg.uses_cache:
            # Under "top_k", the key the identities of existing checkpoints hold, so that they resume.
            ident.update(teacher_cache=self.teacher_cache.identity["data"], top_k=cfg.teacher_top_k)
        return ident

    def make_trainer(self) -> CausalLMTrainer:
        # GRADIENT_CHECKPOINTING: the Trainer passes the backend's checkpoint function to the model's own hook.
        cfg = self.config
        if cfg.uses_cache:
            return CachedDistillTrainer(self.model, self.teacher_cache.attach(self.train_data), self.val_data,
                                        settings=cfg.distill, **self.trainer_options())
        if cfg.method == "distill":
            return DistillTrainer(self.model, self.train_data, self.val_data, teacher=self.teacher,
                                  settings=cfg.distill, teacher_name=cfg.teacher,
                                  stop_ids=hf.eos_ids(self.tokenizer, self.model),
                                  pad_token_id=self.tokenizer.pad_token_id, max_new_tokens=cfg.max_new_tokens,
                                  **self.trainer_options())
        return CausalLMTrainer(self.model, self.train_data, self.val_data, **self.trainer_options())

    # ---- 6. export ---------------------------------------------------------------------------------------------
    def export_weights(self, trainer: Any, model: torch.nn.Module, choice: str) -> tuple[dict | None, dict]:
        if choice == "best" and self.config.qat and not lora.is_peft(model):
            # Full QAT: the quantized and merged exports read the trained base from the live model.
            step = trainer.step if trainer is not None else 0
            return None, {"weights": "last", "step": step, "asked": "best",
                          "why": "full fine-tuning under QAT exports the weights training ended with"}
        return super().export_weights(trainer, model, choice)

    def merged_base(self, model: torch.nn.Module, merged: bool) -> tuple[dict | None, torch.dtype]:
        # Under QAT the merged model is bf16 with the fake-quantized base: what training computed.
        if not self.config.qat:
            return super().merged_base(model, merged)
        return (qat.fake_quantized_state(model) if merged else None), torch.bfloat16

    def extra_exports(self, model: torch.nn.Module):
        # Under QAT, `quantized/`: the int weights with their scales (loads with from_pretrained through
        # transformers' torchao integration).
        cfg = self.config
        if not cfg.qat:
            return None
        raw = qat.base_state(model)
        return lambda out: {"quantized": str(qat.export_quantized(model, self.tokenizer, out / "quantized", cfg.qat,
                                                                  cfg.qat_group_size, state=raw))}

    # ---- 7. results --------------------------------------------------------------------------------------------
    def tracked_results(self, results: dict) -> dict:
        """The samples before and after training as tables, and their exact match, for the trackers."""
        tracked = super().tracked_results(results)
        for when in ("before", "after"):
            samples = results.get(f"samples_{when}") or {}
            if samples.get("exact_match") is not None:
                tracked["values"][f"samples/exact_match_{when}"] = samples["exact_match"]
        return tracked

    def results(self, **extra: Any) -> dict:
        """The run's results plus the samples, exports, plan, data figures and the teacher cache."""
        cache = self.teacher_cache
        if cache is not None:
            extra["teacher_cache"] = {"path": str(cache.path), "rows": len(cache), "k": cache.k, "bytes": cache.bytes}
        return super().results(data=self.data_stats, **extra)
