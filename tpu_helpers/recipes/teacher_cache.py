"""The fine-tuning job's teacher cache (METHOD "distill" with TEACHER_CACHE): open it, or build it when missing.

    cache = job_teacher_cache(job)     # what `Finetune.teacher_cache` returns; built once from TEACHER, then reused

A complete cache at TEACHER_CACHE is opened, verified shard by shard and checked against this run: the tokenizer,
seq_len, the training rows (by fingerprint), TOP_K and TEMPERATURE must match, and TEACHER too when given (by
name; by weight hash when the teacher is loaded anyway). Any difference is an error naming it. A missing or
partial cache is built (or finished: the shards already written are verified and kept) from TEACHER on this
job's backend, one compiled graph for all batches (training/distill.py `TeacherTopK`), then the teacher is
dropped: training never holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_helpers.config import ConfigError
from tpu_helpers.data.teacher_cache import TeacherCache, build_teacher_cache, cache_identity, cache_status
from tpu_helpers.models import lora
from tpu_helpers.training.distill import TeacherTopK

if TYPE_CHECKING:
    from tpu_helpers.recipes.finetune import Finetune

ROWS_PER_SHARD = 256  # 256 MiB per shard at 1024 tokens x top-128 in float32: one file per chip's share and more


def _identity(job: Finetune, teacher_hash: str) -> dict:
    cfg = job.config
    vocab = job.model.get_output_embeddings().weight.shape[0]
    return cache_identity(teacher=cfg.teacher or "", teacher_hash=teacher_hash, tokenizer=job.tokenizer,
                          vocab_size=vocab, k=cfg.top_k, temperature=cfg.temperature, rows=job.train_data)


def job_teacher_cache(job: Finetune) -> TeacherCache:
    cfg = job.config
    path = cfg.teacher_cache
    ident = _identity(job, "")  # checks TOP_K against the vocabulary before any teacher loads
    ignore: tuple[str, ...] = ()
    if cache_status(path) != "complete":
        if not cfg.teacher:
            raise ConfigError(f"TEACHER_CACHE={path!r} holds no finished cache and TEACHER=None: give TEACHER (a model "
                              "with the student's tokenizer) to build it, or point TEACHER_CACHE to a built one")
        teacher = job.teacher
        ident["teacher_hash"] = lora.base_fingerprint(teacher, cfg.teacher)["base_hash"]
        topk = TeacherTopK(teacher, job.backend, k=cfg.top_k, temperature=cfg.temperature)
        if job.backend.is_main:
            build_teacher_cache(path, job.train_data, topk, identity=ident, batch_size=cfg.batch_size,
                                rows_per_shard=ROWS_PER_SHARD)
        job.backend.barrier()
        del topk
        job.__dict__.pop("teacher", None)  # the step never needs it again
    else:
        ignore = ("teacher_hash",) + (() if cfg.teacher else ("teacher",))
    cache = TeacherCache(path)
    cache.check(ident, ignore=ignore)
    return cache


def cache_summary(job: Finetune) -> str:
    cfg = job.config
    if not cfg.uses_cache:
        live = f"; the teacher {cfg.teacher!r} runs in every step" if cfg.method == "distill" else ""
        return f"no teacher cache (METHOD={cfg.method!r}, TEACHER_CACHE=None{live})"
    return job.teacher_cache.summary()


def cache_results(job: Finetune) -> dict:
    """{"teacher_cache": path, rows, k, bytes} for a run's results, or {} without one."""
    cache = job.teacher_cache
    if cache is None:
        return {}
    return {"teacher_cache": {"path": str(cache.path), "rows": len(cache), "k": cache.k, "bytes": cache.bytes}}
