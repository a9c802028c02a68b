"""Preemption soak: SIGKILL and SIGTERM a tiny training run many times, resume each time, and print the figures.

    PYTHONPATH=. python benchmarks/kill_soak.py --kills 100 --sigterms 10 --steps 600 --save-every 1

The CI test (tests/training/test_preemption.py) does 20 kills; this runs as many as asked and prints: kills survived by
kind (start-up, between steps, during a save), checkpoints verified after each kill (every one with a manifest
must load), steps lost per kill (last step reached minus the step the next process resumed from: at most the
steps since the last save), SIGTERM stop latency and steps past the signal, whether the final weights equal
an uninterrupted run's bit for bit, and whether the best checkpoint (by validation loss, kept whatever keep_last
says) was on disk and loaded after every stop and is the uninterrupted run's at the end. Exits 1 if any of those
guarantees failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from tpu_helpers.checkpoint import CheckpointManager  # noqa: E402


class Run:
    """One training process forked from a warm forkserver, with its event stream."""

    def __init__(self, ctx, out: Path, steps: int, save_every: int) -> None:
        import train_tiny

        self.proc, self.conn = train_tiny.start_child(ctx, out, steps, save_every)
        self.started = time.monotonic()
        self.ready: int | None = None
        self.last_step: int | None = None
        self.done: str | None = None

    def read_until(self, prefix: str, count: int = 1) -> bool:
        seen = 0
        while self.conn.poll(300):
            try:
                event = self.conn.recv()
            except EOFError:
                return False
            kind, _, rest = event.partition(" ")
            if kind == "ready":
                self.ready = int(rest)
            elif kind == "step":
                self.last_step = int(rest)
            elif kind == "done":
                self.done = event
            if event.startswith(prefix):
                seen += 1
                if seen == count:
                    return True
        raise TimeoutError("no event for 300 s")

    def end(self, sig: int | None) -> int:
        if sig is not None and self.proc.is_alive():
            os.kill(self.proc.pid, sig)
        self.read_until("\0")  # drain to EOF: the last step it reported, and "done"
        self.proc.join(120)
        self.conn.close()
        return self.proc.exitcode


def verify(out: Path) -> int:
    mgr = CheckpointManager(out / "checkpoints")
    manifests = sorted(mgr.directory.glob("ckpt-*.json")) if mgr.directory.is_dir() else []
    complete = [m for m in manifests if m.with_suffix(".pt").exists()]  # a lone manifest: a pruning cut short
    for manifest in complete:
        mgr.load(manifest.with_suffix(".pt"))  # raises CheckpointCorrupt naming the file
    return len(complete)


def final_model(out: Path) -> dict:
    mgr = CheckpointManager(out / "checkpoints")
    return mgr.load(mgr.latest().step)["model"]


def best_step(out: Path) -> int | None:
    """The best checkpoint's step by validation loss (it must load), or None before the first evaluation."""
    mgr = CheckpointManager(out / "checkpoints", best_metric="val_loss")
    best = mgr.best()
    if best is None:
        return None
    mgr.load(best.step)
    return best.step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--sigterms", type=int, default=10)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.optim", "tpu_helpers.training.trainer", "train_tiny"])
    rng = random.Random(args.seed)
    failures: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir, out = Path(tmp) / "reference", Path(tmp) / "soak"
        ref = Run(ctx, ref_dir, args.steps, args.save_every)
        ref.read_until("ready")
        start_up = time.monotonic() - ref.started
        assert ref.end(None) == 0
        t_ref = time.monotonic() - ref.started

        kinds = ["start-up"] * (args.kills // 5) + ["between steps"] * (args.kills * 3 // 10)
        kinds += ["during a save"] * (args.kills - len(kinds)) + ["SIGTERM"] * args.sigterms
        rng.shuffle(kinds)
        counts: dict[str, int] = {}
        lost, latencies, past_signal, verified, best_seen = [], [], [], 0, set()
        previous_last: int | None = None
        for kind in kinds:
            run = Run(ctx, out, args.steps, args.save_every)
            if kind == "start-up":
                time.sleep(rng.uniform(0.0, 1.2) * start_up)
            else:
                if not run.read_until("ready"):
                    failures.append(f"{kind}: process ended before it was ready")
                    continue
                if previous_last is not None:
                    lost.append(previous_last - run.ready)
                if kind == "during a save":
                    run.read_until("saving", rng.randint(1, 4))
                    time.sleep(rng.uniform(0.0, 0.03))
                else:
                    run.read_until("step", rng.randint(1, 8))
                    time.sleep(rng.uniform(0.0, 0.02))
            if run.done is not None or not run.proc.is_alive():
                failures.append(f"the run finished before a {kind} stop: use more --steps")
                break
            if kind == "SIGTERM":
                at = run.last_step
                t_sig = time.monotonic()
                code = run.end(signal.SIGTERM)
                latencies.append(time.monotonic() - t_sig)
                past_signal.append(run.last_step - at)
                if code != 0:
                    failures.append(f"SIGTERM exit code {code}")
            else:
                if run.end(signal.SIGKILL) != -signal.SIGKILL:
                    failures.append(f"{kind}: the process was not killed by SIGKILL")
            previous_last = run.last_step if run.last_step is not None else previous_last
            counts[kind] = counts.get(kind, 0) + 1
            try:
                verified += verify(out)
                best_seen.add(best_step(out))
            except Exception as err:  # any failure to load is the finding
                failures.append(f"after a {kind} stop: {err}")
        last = Run(ctx, out, args.steps, args.save_every)
        last.read_until("ready")
        if previous_last is not None:
            lost.append(previous_last - last.ready)
        if last.end(None) != 0:
            failures.append("the final resumed run failed")
        ref_best, final_best = best_step(ref_dir), best_step(out)
        if final_best != ref_best:
            failures.append(f"the best checkpoint is step {final_best}, the uninterrupted run's is step {ref_best}")
        ref_model, model = final_model(ref_dir), final_model(out)
        differing = [k for k in ref_model if not torch.equal(ref_model[k], model[k])]
        if differing:
            failures.append(f"final weights differ from the uninterrupted run in {differing}")
        if lost and max(lost) > args.save_every:
            failures.append(f"a kill lost {max(lost)} steps, more than save_every={args.save_every}")

    print(f"stops survived         {sum(counts.values())} ({', '.join(f'{k}: {v}' for k, v in counts.items())})")
    print(f"checkpoints verified   {verified} loads after the stops, none failed" if not any(
        "after a" in f for f in failures) else "checkpoints verified   FAILED")
    if lost:
        print(f"steps lost per resume  mean {statistics.mean(lost):.2f}, max {max(lost)} "
              f"(save_every={args.save_every})")
    if latencies:
        print(f"SIGTERM to exit        median {statistics.median(latencies) * 1000:.0f} ms, "
              f"max {max(latencies) * 1000:.0f} ms; steps past the signal: max {max(past_signal)}")
    print(f"best checkpoint        step {final_best} at the end (the uninterrupted run's: step {ref_best}); steps "
          f"it was at after the stops: {sorted(best_seen, key=lambda s: -1 if s is None else s)}")
    print(f"process start-up       {start_up:.2f} s (forkserver); uninterrupted run {t_ref:.1f} s")
    print(f"final weights          {'identical bit for bit' if not differing else 'DIFFERENT'} to the "
          "uninterrupted run")
    print(f"wall time              {time.monotonic() - t0:.1f} s")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
