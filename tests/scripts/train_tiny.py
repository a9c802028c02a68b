"""A tiny, fully deterministic training run for the kill/signal tests (tests/training/test_preemption.py).

    python tests/scripts/train_tiny.py OUT_DIR [--steps 300] [--save-every 1] [--device cpu|xla]
        [--lr 3e-3] [--eval-every 50] [--keep-last 2] [--on-divergence stop|warn|off]

It resumes from OUT_DIR's checkpoints like any rerun would, and prints one line per event on stdout (flushed) so a
test can time its signals: "ready STEP" once resumed, "step N" after each step, "saving N" just before each
checkpoint save, "done STEP REASON" at the end (`child` sends the same events through a pipe instead). The
model has dropout, so exact resume also covers the RNG streams; the data is small (about 40 batches an epoch)
so runs cross epoch boundaries.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from tpu_helpers.config import TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer


def _print_line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Announce(Callback):
    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit

    def on_fit_start(self, trainer: Trainer) -> None:
        self._emit(f"ready {trainer.step}")

    def on_step_end(self, trainer: Trainer) -> None:
        cfg = trainer.config
        self._emit(f"step {trainer.step}")
        # The trainer saves right after this hook on these steps: the test aims kills at that window.
        if trainer.step % cfg.save_every == 0 or trainer.step == cfg.steps or trainer.stop_reason is not None:
            self._emit(f"saving {trainer.step}")


def main(argv: list[str] | None = None, emit: Callable[[str], None] = _print_line) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "xla"))
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--on-divergence", default="stop")
    args = parser.parse_args(argv)
    # One thread: the same reduction order in every process (bit-identical results), and fair on shared CPUs.
    torch.set_num_threads(1)
    cfg = TrainConfig(device=args.device, preset="tiny", steps=args.steps, batch_size=4, seq_len=32, lr=args.lr,
                      warmup_steps=10, eval_every=args.eval_every, eval_batches=2, log_every=10,
                      save_every=args.save_every, keep_last=args.keep_last, out_dir=args.out_dir, max_chars=6_000,
                      grad_clip=1.0, on_divergence=args.on_divergence)
    train, val, tok = build_datasets("embedded", "byte", block_size=cfg.seq_len, max_chars=cfg.max_chars,
                                     seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len, dropout=0.1))
    trainer = Trainer(model, train, val, config=cfg, progress=False, callbacks=[Announce(emit)])
    report = trainer.fit()
    emit(f"done {report.steps} {report.stop_reason}")
    return 0


def child(argv: list[str], conn: Any) -> None:
    """Entry point for a multiprocessing child (the kill test forks these from a warm forkserver: no 3 s of
    torch imports per process); events go to the parent through `conn` (small messages: atomic pipe writes)."""
    main(argv, emit=conn.send)


def start_child(ctx: Any, out_dir: Any, steps: int, save_every: int) -> tuple[Any, Any]:
    """Start `child` in a process of the multiprocessing context `ctx`; returns (process, receiving connection)."""
    conn, child_conn = ctx.Pipe(duplex=False)
    argv = [str(out_dir), "--steps", str(steps), "--save-every", str(save_every)]
    proc = ctx.Process(target=child, args=(argv, child_conn), daemon=True)
    proc.start()
    child_conn.close()  # the parent keeps only its end, so it sees EOF when the child exits
    return proc, conn


if __name__ == "__main__":
    sys.exit(main())
