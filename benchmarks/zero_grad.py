"""zero_grad(set_to_none=True) against set_to_none=False in the package's loop on XLA:CPU, by the numbers.

    PYTHONPATH=. python benchmarks/zero_grad.py --runs 3 --steps 40

Each run is its own process (alternating the two settings), pinned to one CPU core (the first), and trains the
benchmarks/loop_vs_peers.py model (2-layer GPT, d128, 4 heads, seq 64, batch 16) with the package's Trainer, with
gradient accumulation (2 micro-batches), evaluation every 10 steps and before step 1, a log every 5 and a
checkpoint every 20, so every graph the loop can build appears. Per setting it prints: the graphs compiled
(evaluation before step 1 included), the last step that compiled, the detector's findings, the steady step time
(the run report's step timer: median per-step host time, and this process's CPU seconds per steady step) and
XLA's memory-usage report for the largest compiled program (the training step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def child(set_to_none: bool, steps: int) -> dict:
    import loop_vs_peers as peers
    import torch

    from tpu_helpers.backend import get_backend
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.data import build_datasets
    from tpu_helpers.training.trainer import Trainer

    torch.set_num_threads(1)
    backend = get_backend("xla", spmd=False, compile_cache_dir=None)
    type(backend).zero_grad_set_to_none = set_to_none
    model, loader = peers._setup("xla")
    _, val, _ = build_datasets("embedded", "byte", block_size=peers.SEQ, max_chars=300_000)

    class Steps(Callback):
        def on_fit_start(self, trainer):
            self.compiles = [trainer.backend.metrics()["compilations"]]
            self.cpu = [time.process_time()]

        def on_step_end(self, trainer):
            self.compiles.append(trainer.backend.metrics()["compilations"])
            self.cpu.append(time.process_time())

    class Given(Trainer):
        def configure_optimizer(self):
            return torch.optim.AdamW(self.model.parameters(), lr=peers.LR)

        def evaluate(self):
            before = self.backend.metrics()["compilations"]
            value = super().evaluate()
            if self.step == 0:
                self.eval0_compiles = self.backend.metrics()["compilations"] - before
            return value

    out_dir = tempfile.mkdtemp(prefix="zero_grad_")
    cfg = TrainConfig(device="xla", steps=steps, batch_size=peers.BATCH, seq_len=peers.SEQ, lr=peers.LR, warmup_steps=0,
                      min_lr_ratio=1.0, grad_clip=None, grad_accum=2, eval_every=10, eval_batches=2, log_every=5,
                      save_every=20, out_dir=out_dir, compile_cache_dir=None)
    probe = Steps()
    trainer = Given(model, loader, val, config=cfg, backend=backend, progress=False, callbacks=[probe])
    report = trainer.fit()
    shutil.rmtree(out_dir, ignore_errors=True)
    last = max((i for i in range(1, len(probe.compiles)) if probe.compiles[i] > probe.compiles[i - 1]), default=0)
    # CPU seconds of the steps that neither evaluate nor save (nor follow a save), after warm-up.
    quiet = [probe.cpu[i] - probe.cpu[i - 1] for i in range(3, len(probe.cpu))
             if i % cfg.eval_every and i % cfg.save_every and (i - 1) % cfg.save_every]
    return {"set_to_none": set_to_none, "graphs": trainer.eval0_compiles + report.xla["compilations"],
            "last_compile_step": last, "problems": [p["message"][:80] for p in report.xla.get("problems", [])],
            "step_ms": report.timing["steady_step_ms"], "cpu_ms": 1e3 * statistics.median(quiet),
            "val_loss": report.final_val_loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--child", choices=("true", "false"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(json.dumps(child(args.child == "true", args.steps)))
        return
    from tpu_helpers.backend import runtime_env
    from tpu_helpers.memory.compiled import parse_memory_reports

    results: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(args.runs):
        for flag in (True, False) if i % 2 == 0 else (False, True):
            dump = tempfile.mkdtemp(prefix="zero_grad_dump_")
            try:
                env = {**runtime_env.dump_env(dump), "TOKENIZERS_PARALLELISM": "false",
                       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
                proc = subprocess.run([sys.executable, __file__, "--child", str(flag).lower(), "--steps",
                                       str(args.steps)], env=env, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise RuntimeError(f"set_to_none={flag} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                totals = parse_memory_reports(dump)
                r["memory_bytes"] = max(totals.values())
            finally:
                shutil.rmtree(dump, ignore_errors=True)
            results[flag].append(r)
            print(f"  run {i} set_to_none={flag}: {r}", flush=True)
    print(f"\n{args.steps} steps, grad_accum 2, eval every 10 (and before step 1), log every 5, save every 20; "
          f"{args.runs} runs each; median [min-max]")
    for flag, rs in results.items():
        ms = [r["step_ms"] for r in rs]
        cpu = [r["cpu_ms"] for r in rs]
        print(f"set_to_none={flag!s:<5}  graphs {sorted({r['graphs'] for r in rs})}, last compile at step "
              f"{max(r['last_compile_step'] for r in rs)}, detector findings {sum(len(r['problems']) for r in rs)}, "
              f"step {statistics.median(ms):.1f} ms [{min(ms):.1f}-{max(ms):.1f}], CPU/step "
              f"{statistics.median(cpu):.1f} ms [{min(cpu):.1f}-{max(cpu):.1f}], compiled step memory "
              f"{max(r['memory_bytes'] for r in rs) / 2**20:.2f} MiB, val loss {rs[-1]['val_loss']:.4f}")


if __name__ == "__main__":
    main()
