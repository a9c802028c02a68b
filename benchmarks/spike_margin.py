"""How far the loss-spike rule (training/guard/divergence.py) stays from firing on healthy runs, and where diverging runs are.

    PYTHONPATH=. python benchmarks/spike_margin.py            # every run below, on the CPU (a few minutes)
    PYTHONPATH=. python benchmarks/spike_margin.py --runs healthy-log1,lr50
    PYTHONPATH=. python benchmarks/spike_margin.py --smoke    # CI: a diverging GPT run (30 steps) and LoRA (10)

Each run trains with `on_divergence="off"` (so it goes to the end) and its history is then read as the trainer reads
it: at every log step the training interval's loss over its reference (the median of the intervals before it), at
every evaluation the validation loss over its reference (the lowest before it), both floored at a tenth of the
first value of their series. It prints the largest ratio of each kind, the step, and the margin to the default
divergence_factor (factor / largest ratio: above 1 the run is not stopped). The healthy runs are the package's own
tiny runs (the `make run` CPU demo, the tests' tiny GPT with the loss read every step, a hot learning rate, LoRA and
full fine-tuning of the offline tiny Qwen2 with the loss read every step); the diverging ones use huge learning
rates, and for them the first step at which the rule would fire is printed.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tpu_helpers.config import TrainConfig
from tpu_helpers.training.guard.divergence import SpikeRule
from tpu_helpers.training.history import History

GPT_RUNS = {
    # name: (TrainConfig overrides, healthy?)
    "make-run-cpu": (dict(preset="tiny", steps=300, batch_size=32, seq_len=64, eval_every=50, log_every=10,
                          warmup_steps=30, lr=3e-3, max_chars=2_000_000), True),
    "healthy-log1": (dict(preset="tiny", steps=150, batch_size=8, seq_len=32, eval_every=10, eval_batches=2,
                          log_every=1, warmup_steps=5, lr=3e-3, max_chars=200_000), True),
    "healthy-log1-seed1": (dict(preset="tiny", steps=150, batch_size=8, seq_len=32, eval_every=10, eval_batches=2,
                                log_every=1, warmup_steps=5, lr=3e-3, max_chars=200_000, seed=1), True),
    "hot-lr-1e-2": (dict(preset="tiny", steps=150, batch_size=8, seq_len=32, eval_every=10, eval_batches=2,
                         log_every=1, warmup_steps=5, lr=1e-2, max_chars=200_000), True),
    "lr50": (dict(preset="tiny", steps=30, batch_size=8, seq_len=32, eval_every=10, save_every=10, lr=50.0), False),
    "lr1": (dict(preset="tiny", steps=60, batch_size=8, seq_len=32, eval_every=10, eval_batches=2, log_every=5,
                 warmup_steps=5, lr=1.0, max_chars=200_000), False),
}
FT_RUNS = {
    "lora-log1": (dict(method="lora", steps=200, batch_size=16, seq_len=48, lr=3e-3, eval_every=25, log_every=1,
                       warmup_steps=20, eval_batches=4), True),
    "full-log1": (dict(method="full", steps=200, batch_size=16, seq_len=48, lr=3e-3, eval_every=25, log_every=1,
                       warmup_steps=20, eval_batches=4), True),
}


def readings(history: History, rule: SpikeRule) -> tuple[list, list]:
    """Every (ratio, step) the rule would compute over the run, replaying the history in order."""
    train, val = [], []
    replay = History()
    for record in history.train:
        replay.train.append(record)
        r = rule.train_reading(replay, record["step"])
        if r is not None:
            train.append((r.ratio, r.step))
    for record in history.eval:
        replay.eval.append(record)
        r = rule.val_reading(replay, record["step"])
        if r is not None:
            val.append((r.ratio, r.step))
    return train, val


# --smoke (CI): a diverging pretraining run (30 steps already) and a fine-tuning run cut to 10 steps by these
# settings, so both take seconds (the ratios then say nothing about the defaults).
SMOKE_RUNS, SMOKE = "lr50,lora-log1", {"lora-log1": dict(steps=10, eval_every=5, warmup_steps=2, batch_size=4)}


def run(name: str, overrides: dict | None = None) -> History:
    base = dict(device="cpu", on_divergence="off", save_every=10**6, out_dir=tempfile.mkdtemp(prefix="spike_"))
    if name in GPT_RUNS:
        from tpu_helpers.recipes.pretrain import Pretrain

        job = Pretrain(TrainConfig(**{**base, **GPT_RUNS[name][0], **(overrides or {})}), progress=False)
    else:
        from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

        job = Finetune(FinetuneConfig(**{**base, **FT_RUNS[name][0], **(overrides or {})}), progress=False)
    job.train()
    return job.history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = {**GPT_RUNS, **FT_RUNS}
    ap.add_argument("--runs", default=",".join(every), help="comma-separated subset of " + ",".join(every))
    ap.add_argument("--factor", type=float, default=TrainConfig().divergence_factor)
    ap.add_argument("--smoke", action="store_true", help=f"runs {SMOKE_RUNS}, with {SMOKE} (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.runs = SMOKE_RUNS
    torch.set_num_threads(1)
    rule = SpikeRule(args.factor)
    print(f"divergence_factor {args.factor:g}; ratio = loss / reference; margin = factor / largest ratio")
    print(f"{'run':<20} {'healthy':>7} {'largest train ratio':>22} {'largest val ratio':>20} {'margin':>7}  "
          "first spike  seconds")
    for name in args.runs.split(","):
        t0 = time.perf_counter()
        history = run(name, SMOKE.get(name) if args.smoke else None)
        train, val = readings(history, rule)
        top_t, top_v = max(train, default=(0.0, None)), max(val, default=(0.0, None))
        worst = max(top_t[0], top_v[0])
        spikes = sorted([s for r, s in train + val if r > args.factor])
        print(f"{name:<20} {str(every[name][1]):>7} {top_t[0]:12.3f} (step {top_t[1]}) {top_v[0]:10.3f} "
              f"(step {top_v[1]}) {args.factor / worst if worst else float('inf'):7.2f}  "
              f"{spikes[0] if spikes else '-':>11}  {time.perf_counter() - t0:7.1f}", flush=True)


if __name__ == "__main__":
    main()
