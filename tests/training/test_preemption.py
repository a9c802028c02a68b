"""Preemption safety with real processes and real signals: SIGKILL at random moments, SIGTERM, SIGINT.

The kill test forks its training processes from a multiprocessing forkserver that has torch and the package
already imported, so a kill costs a fraction of a second instead of 4 s of interpreter start-up; the processes
are still separate processes killed by a real SIGKILL. The SIGTERM and SIGINT tests start fresh interpreters
(`python tests/scripts/train_tiny.py`) exactly as a user's script would run. Every run uses one torch thread,
so an uninterrupted run and a run stopped and resumed any number of times must end with identical bits.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tpu_helpers.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "train_tiny.py"
KILLS = 20
KILL_STEPS = 100  # 20 kills make a few steps of progress each (about 50 in all): they never reach the end
SIGNAL_STEPS = 30


@pytest.fixture(scope="module")
def forkserver():
    """A multiprocessing context whose children start with torch and the training script already imported."""
    sys.path.insert(0, str(SCRIPT.parent))  # the forkserver inherits sys.path: `train_tiny` must import there
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.optim", "tpu_helpers.training.trainer", "train_tiny"])
    import train_tiny  # noqa: F401  (fails here, clearly, if the path is wrong)

    yield ctx
    sys.path.remove(str(SCRIPT.parent))


class Child:
    """One training process; `events()` yields what it reports ("ready N", "step N", "saving N", "done ...")."""

    def __init__(self, ctx, out_dir: Path, steps: int, save_every: int = 1) -> None:
        import train_tiny

        self.proc, self.conn = train_tiny.start_child(ctx, out_dir, steps, save_every)
        self.started = time.monotonic()

    def next_event(self, timeout: float = 60.0) -> str | None:
        """The next event, or None once the process has exited (or died) without sending more."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"no event from the training process within {timeout} s")
        try:
            return self.conn.recv()
        except EOFError:
            return None

    def wait_for(self, prefix: str, count: int = 1) -> int | None:
        """Step number of the `count`-th event starting with `prefix`, or None if the process ended first."""
        seen = 0
        while (event := self.next_event()) is not None:
            if event.startswith(prefix):
                seen += 1
                if seen == count:
                    return int(event.split()[1])
        return None

    def kill(self) -> bool:
        """SIGKILL; True if that is what ended the process (it had not finished on its own)."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)
        self.conn.close()
        return self.proc.exitcode == -signal.SIGKILL

    def finish(self) -> str:
        """Let it run to the end; returns its last event."""
        last = None
        while (event := self.next_event(timeout=300)) is not None:
            last = event
        self.proc.join(30)
        self.conn.close()
        assert self.proc.exitcode == 0, f"training process failed with exit code {self.proc.exitcode}"
        return last


def _final_state(out_dir: Path, steps: int) -> dict:
    mgr = CheckpointManager(out_dir / "checkpoints")
    latest = mgr.latest()
    assert latest is not None and latest.step == steps, f"newest checkpoint is {latest}, expected step {steps}"
    return mgr.load(latest.step)


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs: max |diff| {(a[name] - b[name]).abs().max()}"


def _assert_same_training_state(resumed: dict, reference: dict) -> None:
    _assert_same_bits(resumed["model"], reference["model"])
    for pid, ref_state in reference["optimizer"]["state"].items():
        _assert_same_bits(resumed["optimizer"]["state"][pid], ref_state)
    # The schedule's position: the same step, and the learning rates it gave the optimizer there.
    assert resumed["step"] == reference["step"]
    assert [g["lr"] for g in resumed["optimizer"]["param_groups"]] == \
        [g["lr"] for g in reference["optimizer"]["param_groups"]]
    assert (resumed["epoch"], resumed["samples_in_epoch"]) == (reference["epoch"], reference["samples_in_epoch"])
    assert torch.equal(resumed["rng"]["torch"], reference["rng"]["torch"])


def _verify_every_complete_checkpoint(out_dir: Path) -> int:
    """Every checkpoint whose data and manifest both exist must verify and load; returns how many there were. (A
    lone manifest is a pruned checkpoint whose deletion a kill cut short: its data goes first.)"""
    mgr = CheckpointManager(out_dir / "checkpoints")
    manifests = sorted(mgr.directory.glob("ckpt-*.json")) if mgr.directory.is_dir() else []
    complete = [m for m in manifests if m.with_suffix(".pt").exists()]
    for manifest in complete:
        state = mgr.load(manifest.with_suffix(".pt"))  # raises CheckpointCorrupt naming the file
        assert state["step"] == int(manifest.stem.split("-")[1])
    return len(complete)


def test_sigkill_at_20_random_moments_then_resume_gives_identical_weights(forkserver, tmp_path: Path) -> None:
    ref_dir = tmp_path / "reference"
    ref = Child(forkserver, ref_dir, KILL_STEPS)
    assert ref.wait_for("ready") == 0
    start_up = time.monotonic() - ref.started  # how long a process takes to reach its first step
    assert ref.finish() == f"done {KILL_STEPS} None"
    reference = _final_state(ref_dir, KILL_STEPS)
    assert reference["epoch"] >= 2  # the kills also land across epoch boundaries (about 44 batches an epoch)

    rng = random.Random(6)  # seeded: the same kill schedule every time the test runs
    out = tmp_path / "killed"
    kinds = ["start-up"] * 4 + ["between steps"] * 6 + ["during a save"] * 10
    rng.shuffle(kinds)
    log, saved_before = [], 0
    for kind in kinds:
        child = Child(forkserver, out, KILL_STEPS)
        if kind == "start-up":  # imports done; building data, model, optimizer, loading the checkpoint
            time.sleep(rng.uniform(0.0, 1.2) * start_up)  # mostly before the first step, whatever the machine
        else:
            ready = child.wait_for("ready")
            assert ready is not None, "the training process ended before it was ready"
            # No more work lost than the steps since the last save: it resumes from the save before the kill.
            assert ready >= saved_before, f"resumed at step {ready}, but step {saved_before} had been saved"
            if kind == "between steps":
                step = child.wait_for("step", rng.randint(1, 5))
                delay = rng.uniform(0.0, 0.02)
            else:
                step = child.wait_for("saving", rng.randint(1, 4))
                delay = rng.uniform(0.0, 0.03)  # a save of this model takes about 10-40 ms
            assert step is not None, f"the run finished before kill {len(log) + 1}: raise KILL_STEPS"
            saved_before = max(saved_before, step - 1)  # step N's events come after save N-1 returned
            time.sleep(delay)
        assert child.kill(), f"kill {len(log) + 1} ({kind}) came after the run finished: raise KILL_STEPS"
        complete = _verify_every_complete_checkpoint(out)
        latest = CheckpointManager(out / "checkpoints").latest()
        log.append((kind, latest.step if latest else None, complete))

    assert len(log) == KILLS
    assert sum(1 for kind, _, _ in log if kind == "during a save") == 10
    print("kills (kind, newest good step, complete checkpoints):", log)
    assert Child(forkserver, out, KILL_STEPS).finish() == f"done {KILL_STEPS} None"
    _assert_same_training_state(_final_state(out, KILL_STEPS), reference)
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == [], f"temp files of killed saves were not cleaned up: {leftovers}"


def _script(out_dir: Path, steps: int, save_every: int, device: str = "cpu") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out_dir), "--steps", str(steps), "--save-every",
                             str(save_every), "--device", device], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)


def _signal_at(proc: subprocess.Popen, sig: int, after_step: int) -> tuple[int, int, str]:
    """Send `sig` once the run reports `after_step`; returns (step the signal arrived at, last step, stderr)."""
    for line in proc.stdout:
        if line.startswith(f"step {after_step}"):
            break
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{stderr[-3000:]}"
    received = [line for line in stderr.splitlines() if f"received {sig.name} at step" in line]
    assert len(received) == 1, stderr[-3000:]
    at_step = int(received[0].split(" at step ")[1].split(":")[0])
    done = stdout.strip().splitlines()[-1]
    assert done.startswith("done ") and f"signal {sig.name} at step {at_step}" in done, stdout[-2000:]
    return at_step, int(done.split()[1]), stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_within_one_step_exits_0_and_the_rerun_finishes(forkserver, tmp_path: Path, sig) -> None:
    ref_dir = tmp_path / "reference"
    assert Child(forkserver, ref_dir, SIGNAL_STEPS, save_every=10).finish() == f"done {SIGNAL_STEPS} None"
    reference = _final_state(ref_dir, SIGNAL_STEPS)

    out = tmp_path / "run"
    proc = _script(out, SIGNAL_STEPS, save_every=10)  # a fresh interpreter, as a user's script runs
    # At step 7, between regular saves (10, 20): the stop must add a save of its own.
    at_step, stopped, stderr = _signal_at(proc, sig, after_step=7)
    assert at_step <= stopped <= at_step + 1, f"signal at step {at_step}, stopped at step {stopped}"
    assert stopped < SIGNAL_STEPS
    latest = CheckpointManager(out / "checkpoints").latest()
    assert latest is not None and latest.step == stopped  # saved on the way out, not only at step 10
    assert "To continue, run the same notebook or command again" in stderr
    assert f"out_dir={str(out)!r}" in stderr

    child = Child(forkserver, out, SIGNAL_STEPS, save_every=10)
    assert child.wait_for("ready") == stopped
    assert child.finish() == f"done {SIGNAL_STEPS} None"
    _assert_same_training_state(_final_state(out, SIGNAL_STEPS), reference)


@pytest.mark.xla
@pytest.mark.slow
def test_sigterm_on_xla_cpu_saves_exits_0_and_resumes(tmp_path: Path) -> None:
    """The same on the XLA path: the handler runs between graph executions, the step still ends in one save."""
    pytest.importorskip("torch_xla")
    out = tmp_path / "run"
    at_step, stopped, _ = _signal_at(_script(out, 8, save_every=5, device="xla"), signal.SIGTERM, after_step=2)
    assert at_step <= stopped <= at_step + 1 and CheckpointManager(out / "checkpoints").latest().step == stopped
    proc = _script(out, 8, save_every=5, device="xla")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"ready {stopped}" in stdout and stdout.strip().endswith("done 8 None")
