"""One run per out_dir: a second run (a real second process) refuses at once naming the holder; SIGKILL of the
holder leaves no stale lock; the network-filesystem warning is read from /proc/mounts (a recorded file here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import tiny_config
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.recipes.pretrain import Pretrain
from tpu_helpers.training.history import History
from tpu_helpers.training.run_lock import RunLock, RunLocked, network_filesystem

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "train_tiny.py"


def _script(out_dir: Path, steps: int = 100000) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out_dir), "--steps", str(steps), "--save-every", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_for_step(proc: subprocess.Popen, step: int) -> None:
    for line in proc.stdout:
        if line.startswith(f"step {step}"):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.communicate()[1][-3000:]}")


def test_second_run_on_the_same_out_dir_refuses_and_a_killed_run_leaves_no_stale_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _script(out)
    try:
        _wait_for_step(first, 6)
        second = _script(out)
        _, err = second.communicate(timeout=120)
        assert second.returncode != 0
        assert "RunLocked" in err and f"is in use by another run: pid {first.pid} on host" in err, err[-2000:]
        assert "ready" not in _  # it never trained
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    steps = [i.step for i in CheckpointManager(out / "checkpoints").list() if i.valid]
    assert steps and steps[-1] >= 5
    # The OS dropped the killed run's lock: the rerun takes it at once and resumes.
    third = _script(out, steps=steps[-1] + 2)
    stdout, stderr = third.communicate(timeout=180)
    assert third.returncode == 0, stderr[-3000:]
    assert f"ready {steps[-1]}" in stdout and stdout.strip().endswith("None")


def test_lock_in_process_names_the_holder_and_is_released(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        holder = json.loads((tmp_path / ".run.lock").read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(RunLocked, match=rf"in use by another run: pid {os.getpid()} on host"):
            RunLock(tmp_path).acquire()  # a second open file: flock refuses it like another process's
    RunLock(tmp_path).acquire().release()


def test_network_filesystems_are_named_from_proc_mounts(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/root / ext4 rw 0 0\n"
                      "gcsfuse /mnt/bucket fuse.gcsfuse rw,nosuid 0 0\n"
                      "drive /content/drive fuse.drive rw 0 0\n"
                      "tmpfs /mnt/bucket/local tmpfs rw 0 0\n")
    assert network_filesystem("/mnt/bucket/runs/a", mounts) == "fuse.gcsfuse"
    assert network_filesystem("/content/drive/MyDrive/x", mounts) == "fuse.drive"
    assert network_filesystem("/mnt/bucket/local/x", mounts) is None  # the longest mount point wins
    assert network_filesystem("/home/user", mounts) is None
    assert network_filesystem("/x", tmp_path / "missing") is None


def test_save_results_uses_a_unique_temp_file(tmp_path: Path) -> None:
    class Report:
        def to_dict(self) -> dict:
            return {"steps": 1}

    cfg = tiny_config(tmp_path)
    (Path(cfg.out_dir) / ".loss.png.tmp").mkdir(parents=True)  # another writer's fixed-name temp in the way
    from tpu_helpers.backend.base import Backend

    job = Pretrain(cfg, backend=Backend("fp32"))
    job._trainer, job.report = type("T", (), {"history": History(), "tracking": None})(), Report()  # a finished run
    job.save_results()
    assert (Path(cfg.out_dir) / "loss.png").stat().st_size > 0
    assert [p.name for p in Path(cfg.out_dir).iterdir() if p.name.endswith(".tmp")] == [".loss.png.tmp"]
