"""A real full disk: a 2 MiB tmpfs mounted in a user+mount namespace (`unshare -rm`, no root needed).

tests/test_checkpoint.py simulates ENOSPC with a write hook; this test lets the kernel refuse the write instead,
during a real training run: the step-1 checkpoint (about 1.4 MB) fits, the step-2 save cannot, so fit must stop
with a CheckpointError that says the disk is full, and the step-1 checkpoint must still load. Skipped where
unprivileged user namespaces are disabled (some CI kernels, Ubuntu's AppArmor policy).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = ROOT / "tests" / "scripts" / "full_disk_run.py"


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt || exit 1"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _namespaces_work(), reason="cannot mount a tmpfs in an unprivileged user namespace here")
def test_full_disk_during_training_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    mount = tmp_path / "small_disk"
    mount.mkdir()
    shell = f"mount -t tmpfs -o size=2m tmpfs {mount} && exec {sys.executable} {SCRIPT} {mount}/run save"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert "checkpoint step 2 could not be saved" in out["ERROR"]
    assert "the disk is full (No space left on device)" in out["ERROR"]
    assert "Earlier checkpoints are untouched" in out["ERROR"]
    assert out["CHECKPOINTS"] == "[(1, True)]"
    assert out["LOADS"] == "1"
    assert not [n for n in ast.literal_eval(out["FILES"]) if n.endswith(".tmp")]  # no half-written temp left


@pytest.mark.skipif(not _namespaces_work(), reason="cannot mount a tmpfs in an unprivileged user namespace here")
@pytest.mark.parametrize("mode", ["lower keep_last", "fill"])
def test_full_disk_lowering_keep_last_helps_and_a_fresh_out_dir_fails_clearly(tmp_path: Path, mode: str) -> None:
    """Following the advice "lower keep_last" works: older checkpoints go before the save when space is short
    (pruning only after a successful save would fail the rerun the same way). A fresh out_dir on a
    full disk gives an error that says so, not a raw OSError."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    size = "1m" if mode == "fill" else "4m"  # 4 MiB: two checkpoints of about 1.4 MB fit, a third does not
    arg = "fill" if mode == "fill" else "keep"
    shell = f"mount -t tmpfs -o size={size} tmpfs {mount} && exec {sys.executable} {SCRIPT} {mount}/run {arg}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    if mode == "fill":
        assert out["KEEP1"].startswith("CheckpointError ") and "the disk is full" in out["KEEP1"], out
        return
    assert out["KEEP3"].startswith("CheckpointError checkpoint step 3 could not be saved"), out
    assert out["KEEP2"] == "steps 4", out  # the rerun with keep_last=2 made room before each save
    assert "or lower keep_last (now 3)" in out["KEEP3"]
    assert out["CHECKPOINTS"] == "[(3, True), (4, True)]"
