"""Graph hygiene of the package's loop on XLA: compilations, distinct graphs and host transfers.

    PJRT_DEVICE=CPU python benchmarks/graph_hygiene.py --steps 200 --eval-every 50 --log-every 10

Trains the tiny GPT for 200 steps with evaluation every 50 and counts, from torch_xla's metrics: the distinct graphs
compiled (the evaluation before step 1 included), the step after which nothing compiled any more, and host
transfers in steps that read nothing by design (not a log, evaluation or checkpoint step). Targets: at most 3
distinct graphs, none after step 2, no host transfers between log intervals.

`--inject-recompile` multiplies in a real recompile (a Python exponent that changes every step, a new constant in
each step's graph) to show the check still catches one: then graphs keep compiling up to the last step.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from tpu_helpers.backend import backend_for, runtime_env

# XLA:CPU unless the caller chose (before anything starts the XLA runtime).
os.environ.update({**runtime_env.xla_cpu_env(devices=1), **runtime_env.runtime_vars()})

from tpu_helpers.config import TrainConfig  # noqa: E402
from tpu_helpers.core.callbacks import Callback  # noqa: E402
from tpu_helpers.data import build_datasets  # noqa: E402
from tpu_helpers.models.gpt import GPT, gpt_config  # noqa: E402
from tpu_helpers.training.trainer import Trainer  # noqa: E402


class Probe(Trainer):
    """Counts the compilations of the evaluation fit runs before step 1 (fit resets the metrics after it)."""

    def evaluate(self):
        before = self.backend.metrics()["compilations"]
        value = super().evaluate()
        if self.step == 0:
            self.eval0_compiles = self.backend.metrics()["compilations"] - before
        return value

    def compute_loss(self, batch):
        loss = super().compute_loss(batch)
        return loss ** (1.0 + self.step / 1000.0) if self.inject_recompile else loss


class PerStep(Callback):
    def on_fit_start(self, trainer):
        self.samples = [(0, trainer.backend.metrics())]

    def on_step_end(self, trainer):
        self.samples.append((trainer.step, trainer.backend.metrics()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--inject-recompile", action="store_true", help="add a real recompile to every step (a check)")
    args = ap.parse_args()
    cfg = TrainConfig(device="xla", preset="tiny", steps=args.steps, batch_size=8, seq_len=64, warmup_steps=10,
                      eval_every=args.eval_every, eval_batches=4, log_every=args.log_every,
                      save_every=args.save_every, out_dir=tempfile.mkdtemp())
    backend = backend_for(cfg, spmd=False)
    train, val, tok = build_datasets("embedded", "byte", block_size=cfg.seq_len, max_chars=300_000)
    probe = PerStep()
    trainer = Probe(GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len)), train, val,
                    config=cfg, backend=backend, progress=False, callbacks=[probe])
    trainer.inject_recompile = args.inject_recompile
    report = trainer.fit()
    samples = probe.samples
    compiles_by_step = [(s, m["compilations"] - p["compilations"]) for (s, m), (_, p) in zip(samples[1:], samples, strict=False)]
    last_compile = max((s for s, c in compiles_by_step if c), default=0)
    quiet = []
    for (s, m), (_, p) in zip(samples[1:], samples, strict=False):
        sched = trainer.cadence
        expected = sched.is_log_step(s) or sched.is_eval_step(s) or (s > 1 and sched.is_save_step(s - 1))
        if not expected:
            quiet.append(m["device_to_host_transfers"] - p["device_to_host_transfers"])
    graphs = trainer.eval0_compiles + report.xla["compilations"]
    print(f"{backend.status()}, {cfg.steps} steps, eval every {cfg.eval_every}, log every {cfg.log_every}")
    print(f"distinct graphs compiled: {graphs} (evaluation before step 1: {trainer.eval0_compiles}, training "
          f"loop: {report.xla['compilations']})  target <= 3")
    print(f"last step that compiled: {last_compile}  target <= 2")
    print(f"host transfers in {len(quiet)} steps between log intervals: {sum(quiet)}  target 0")
    print(f"host transfers in the whole run: {report.xla['device_to_host_transfers']} "
          f"({cfg.steps // cfg.log_every} log reads, evaluations and checkpoints)")
    print(f"CPU fallbacks: {report.xla['cpu_fallback_ops'] or 'none'}; detector findings: "
          f"{report.xla.get('problems') or 'none'}")


if __name__ == "__main__":
    main()
