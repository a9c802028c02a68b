"""How close are the memory estimates to a real step? Prints a table; run on any machine:

    PYTHONPATH=. python benchmarks/memory_accuracy.py            # CPU measurements + XLA:CPU compiled figures
    PYTHONPATH=. python benchmarks/memory_accuracy.py --no-xla   # skip the XLA:CPU compiles (subprocesses)
    PYTHONPATH=. python benchmarks/memory_accuracy.py --small    # also GPT "small" (a real fp32 step: ~3 GB RAM)
    PYTHONPATH=. python benchmarks/memory_accuracy.py --smoke    # CI's toy run: two tiny GPT cases, a small CNN batch

For each case, one training step (AdamW, fp32 unless stated) is measured for real, as the peak of the second of two
steps: on the CPU by :class:`tpu_helpers.memory.LiveBytes` (live tensor storage), on CUDA, when a GPU is present,
by ``torch.cuda.max_memory_allocated``. The traced estimate (fake tensors, nothing allocated) and, for the GPT, the
analytic one are compared with it; targets: traced within 2%, analytic within 10%. The compiled column is what XLA
reports for the same step's compiled graph on XLA:CPU, shown against the eager measurement: it is not an estimate
of the eager figure (see ``tpu_helpers/memory/compiled.py`` for why it differs).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import torch

from tpu_helpers.backend import get_backend
from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.memory import (
    LiveBytes,
    analytic_estimate,
    compiled_estimate,
    gpt_batch,
    step_trainer,
    traced_estimate,
)
from tpu_helpers.models.gpt import GPT, gpt_config

# The example models are test fixtures (tests/example_models.py): the checkout's root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.example_models import SmallCNN, cnn_batch  # noqa: E402


def _trainer(model, device: str, **kw):
    """The trainer's own step over `model` (what the estimates measure): its optimizer, clipping, zero_grad."""
    precision = kw.pop("precision", "fp32")
    if kw.pop("pure_bf16", False):
        model = model.to(torch.bfloat16)
    return step_trainer(model, get_backend(device, precision=precision), precision=precision, **kw)


def measure_cpu(make_model, batch, **kw) -> int:
    trainer = _trainer(make_model(), "cpu", **kw)
    trainer.train_step(itertools.repeat(batch))
    with LiveBytes(trainer.model, trainer.optimizer, batch) as live:
        trainer.train_step(itertools.repeat(batch))
    peak = live.peak_bytes
    del trainer
    gc.collect()
    return peak


def measure_cuda(make_model, batch, **kw) -> int:
    trainer = _trainer(make_model(), "cuda", **kw)
    batch = tuple(t.cuda() for t in batch)
    trainer.train_step(itertools.repeat(batch))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(itertools.repeat(batch))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del trainer
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA:CPU compiled figures")
    ap.add_argument("--small", action="store_true", help="include GPT small (a real CPU step needs ~3 GB)")
    ap.add_argument("--smoke", action="store_true", help="a toy-sized run of each kind of case (CI)")
    args = ap.parse_args()
    cnn_b = 64
    cases = [("tiny", 16, 64, {}), ("tiny", 16, 64, {"precision": "bf16"}), ("mini", 8, 256, {}),
             ("mini", 8, 256, {"gradient_checkpointing": True}), ("mini", 8, 256, {"precision": "bf16"}),
             ("mini", 8, 256, {"optimizer": "sgd"}), ("mini", 8, 256, {"optimizer": "adafactor"}),
             ("mini", 8, 256, {"grad_accum": 2}), ("mini", 1, 16, {})]
    if args.small:
        cases.append(("small", 2, 512, {}))
    if args.smoke:  # the tiny GPT with grad_accum (compiled too) and in bf16, and a small CNN batch: every path
        cases = [("tiny", 4, 32, {"grad_accum": 2}), ("tiny", 4, 32, {"precision": "bf16"})]
        cnn_b = 8
    rows = []
    for preset, b, s, kw in cases:
        cfg = gpt_config(preset)
        batch = gpt_batch(s, cfg.vocab_size)(b)
        t0 = time.perf_counter()
        real = measure_cpu(lambda cfg=cfg: GPT(cfg), batch, **kw)
        traced = traced_estimate(lambda cfg=cfg: GPT(cfg), gpt_batch(s, cfg.vocab_size), b, **kw).peak_bytes
        analytic = analytic_estimate(cfg, b, s, **kw).peak_bytes
        compiled = None
        if not args.no_xla and not kw.get("precision"):
            compiled = compiled_estimate(cfg, b, s, **kw).peak_bytes
        label = f"GPT {preset} b={b} s={s} " + " ".join(f"{k}={v}" for k, v in kw.items())
        rows.append((label, real, traced, analytic, compiled, time.perf_counter() - t0))
    ce = torch.nn.functional.cross_entropy  # the trainer's loss_fn(output, targets)
    real = measure_cpu(SmallCNN, cnn_batch(cnn_b), loss_fn=ce)
    traced = traced_estimate(SmallCNN, cnn_batch, cnn_b, loss_fn=ce).peak_bytes
    compiled = None if args.no_xla else compiled_estimate("tests.example_models:SmallCNN", cnn_b,
                                                          batch_fn="tests.example_models:cnn_batch",
                                                          loss_fn="torch.nn.functional:cross_entropy").peak_bytes
    rows.append((f"SmallCNN b={cnn_b} (32x32 RGB)", real, traced, None, compiled, 0.0))

    def pct(x, ref):
        return "n/a" if x is None else f"{100 * (x / ref - 1):+.1f}%"

    print(f"{'case':48} {'measured (CPU)':>14} {'traced':>10} {'err':>7} {'analytic':>10} {'err':>7} "
          f"{'XLA compiled':>12} {'vs eager':>8}")
    for label, real, traced, analytic, compiled, _ in rows:
        print(f"{label:48} {format_bytes(real):>14} {format_bytes(traced):>10} {pct(traced, real):>7} "
              f"{format_bytes(analytic) if analytic else 'n/a':>10} {pct(analytic, real):>7} "
              f"{format_bytes(compiled) if compiled else 'n/a':>12} {pct(compiled, real):>8}")
    worst_traced = max(abs(t / r - 1) for _, r, t, _, _, _ in rows)
    worst_analytic = max(abs(a / r - 1) for _, r, _, a, _, _ in rows if a)
    print(f"\nworst traced error {100 * worst_traced:.2f}% (target 2%), worst analytic error "
          f"{100 * worst_analytic:.2f}% (target 10%)")
    if torch.cuda.is_available():
        cfg = gpt_config("mini")
        real = measure_cuda(lambda: GPT(cfg), gpt_batch(256, cfg.vocab_size)(8))
        traced = traced_estimate(lambda: GPT(cfg), gpt_batch(256, cfg.vocab_size), 8).peak_bytes
        print(f"CUDA GPT mini b=8 s=256: max_memory_allocated {format_bytes(real)}, traced {format_bytes(traced)} "
              f"({pct(traced, real)})")


if __name__ == "__main__":
    main()
