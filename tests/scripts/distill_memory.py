"""Distil the same student twice on XLA (live teacher, then from a teacher cache) in this process, whose XLA dumps
go to the JSON argument's "dump" directory, and print per run the compiled memory of its largest program (the
training step), the steady step time, the final losses (with "held_out_ce": true also the student's own
held-out next-token loss, the same figure for both runs) and, for the cached run, the cache's bytes per token.
For tests/training/test_finetune_cache_qat.py and benchmarks/distill_cache.py (run with runtime_env.dump_env).

    python tests/scripts/distill_memory.py '{"dump": "/tmp/d", "steps": 3, "top_k": 32, "out": "/tmp/runs"}'

Other keys are FinetuneConfig's (both runs), e.g. "model", "teacher", "batch_size", "seq_len", "max_records".
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.support import print_result, script_args
from tpu_helpers.backend import get_backend
from tpu_helpers.memory.compiled import parse_memory_reports
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig


def main() -> None:
    args = script_args()
    args_all = {"held_out_ce": args.pop("held_out_ce", False)}
    dump, steps = args.pop("dump"), args.pop("steps", 3)
    top_k = args.pop("top_k", 32)
    out = Path(args.pop("out", None) or tempfile.mkdtemp())
    backend = get_backend("xla", spmd=False)
    settings = {**dict(device="xla", method="distill", teacher="tiny", batch_size=8, seq_len=32, lr=3e-3,
                       warmup_steps=1, eval_every=10_000, eval_batches=2, log_every=1, save_every=10_000,
                       max_records=400, steps=steps, xla_checks="off", distill_temperature=1.0), **args}
    result = {}
    for name, extra in (("live", {}), ("cached", {"teacher_cache": str(out / "cache"), "teacher_top_k": top_k})):
        job = Finetune(FinetuneConfig(**{**settings, **extra, "out_dir": str(out / name)}), backend=backend,
                       progress=False)
        if job.config.uses_cache:
            job.teacher_cache  # noqa: B018 (built before the step's programs are told apart)
        before = set(parse_memory_reports(dump))
        report = job.train()
        programs = {k: v for k, v in parse_memory_reports(dump).items() if k not in before}
        result[name] = {"compiled_bytes": max(programs.values()), "programs": len(programs),
                        "steady_step_ms": report.timing.get("steady_step_ms"),
                        "final_train_loss": report.final_train_loss, "final_val_loss": report.final_val_loss,
                        "first_val_loss": report.first_val_loss}
        if args_all.get("held_out_ce"):
            # One figure for both runs: the student's own next-token loss on the held-out rows (the live run's
            # validation loss is its distillation mix; alpha = 1 leaves the hard-label part alone). After the
            # memory reports are read: this evaluation is a program of its own.
            job.trainer.alpha = 1.0
            result[name]["held_out_ce"] = job.trainer.evaluate()
        if job.teacher_cache is not None:
            cache = job.teacher_cache
            result[name]["cache_bytes"] = cache.bytes
            result[name]["cache_tokens"] = len(cache) * cache.identity["seq_len"]
        del job
    print_result({"live": result["live"]["compiled_bytes"], "cached": result["cached"]["compiled_bytes"],
                  "runs": result})


if __name__ == "__main__":
    main()
