"""A tiny Pretrain run logging to trackers, optionally stopped or killed (SIGKILL) after a step: the tracking tests.

    python tests/scripts/tracked_run.py '{"out_dir": "...", "trackers": "wandb,trackio", "kill_at": 17}'
    (other keys: "stop_at", "device", "xla_checks", "project", "steps")

The trackers' stores come from the environment the test sets (WANDB_MODE=offline, TRACKIO_DIR, ...). Killed, it
first waits until what it logged is stored (as a kill that comes seconds after the last log step finds it), so the
rerun meets the points the killed process left. Prints the run's results (RESULT line) when it finishes.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import print_result, script_args  # noqa: E402
from tpu_helpers.config import TrainConfig  # noqa: E402
from tpu_helpers.core.callbacks import Callback  # noqa: E402
from tpu_helpers.recipes.pretrain import Pretrain  # noqa: E402


class StopAt(Callback):
    """A clean stop (as SIGTERM makes one): save at this step and return; the results close the tracked run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.step == self.step:
            trainer.stop_reason = f"stopped by the test at step {self.step}"


class KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.step == self.step:
            for tracker in trainer.tracking.trackers:
                tracker.flush()
            time.sleep(2.0)  # trackio writes every 0.5 s and W&B's service takes what it was sent
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args = script_args()
    config = TrainConfig(device=args.get("device", "cpu"), preset="tiny", steps=args.get("steps", 20), batch_size=8,
                         seq_len=32, lr=3e-3, warmup_steps=5, eval_every=10, eval_batches=2, log_every=5,
                         save_every=10, out_dir=args["out_dir"], max_chars=200_000, trackers=args["trackers"],
                         project=args.get("project", "tpu_helpers"), xla_checks=args.get("xla_checks", "warn"))
    callbacks = ([KillAt(args["kill_at"])] if args.get("kill_at") else []) + (
        [StopAt(args["stop_at"])] if args.get("stop_at") else [])
    job = Pretrain(config, progress=False, callbacks=callbacks)
    job.train()
    job.save_results()
    print_result(job.results())


if __name__ == "__main__":
    main()
