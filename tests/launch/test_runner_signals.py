"""SIGTERM and SIGINT sent to `python -m tpu_helpers run` (a real process, real signals) reach the training in the
notebook's kernel: it saves a checkpoint after the signal and stops; the run directory ends `.stopped`/`.failed`.

The notebook trains the tiny model of tests/scripts/train_tiny.py for far more steps than the test waits for, with
no periodic save, so any checkpoint in out_dir was written because of the signal. The test knows the training has
started when the run lock file names its holder (the kernel process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from tpu_helpers.checkpoint import CheckpointManager

pytestmark = pytest.mark.notebooks

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ('import sys\nsys.path.insert(0, "tests/scripts")\nimport train_tiny\n'
         'train_tiny.main([OUT_DIR, "--steps", "100000", "--save-every", "100000"])')


def _notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('OUT_DIR = "out"  # where the checkpoints go')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell('print("after fit")')]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path, int]:
    """Start the runner; return it, out_dir and the kernel's pid once the training holds the run lock."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "tpu_helpers", "run", str(_notebook(tmp_path / "long.ipynb")),
                             "-p", "OUT_DIR", str(out), "--runs-dir", str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    lock = out / ".run.lock"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if lock.exists() and lock.read_text().strip():
            kernel = json.loads(lock.read_text())["pid"]
            time.sleep(2.0)  # some steps, well short of any periodic save
            return proc, out, kernel
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the training never started:\n{proc.communicate()[0][-3000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_runner_saves_in_the_kernel_and_ends_stopped(tmp_path: Path, sig) -> None:
    proc, out, kernel = _start(tmp_path)
    assert CheckpointManager(out / "checkpoints").latest() is None
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, output[-3000:]
    latest = CheckpointManager(out / "checkpoints").latest()
    assert latest is not None and 0 < latest.step < 100000, output[-3000:]  # written because of the signal
    runs = [p.name for p in (tmp_path / "runs").iterdir()]
    assert len(runs) == 1 and runs[0].endswith(".stopped"), runs
    executed = nbformat.read(tmp_path / "runs" / runs[0] / "long.ipynb", as_version=4)
    text = json.dumps([c.get("outputs") for c in executed.cells])
    assert f"done {latest.step} signal {sig.name} at step" in text  # fit returned the partial run...
    assert "after fit" in text  # ...and the rest of the notebook ran
    assert f"received {sig.name}: passed it to the notebook's kernel (pid {kernel})" in output
    assert not (out / ".run.lock").read_text().strip()  # the run lock was given back


def test_second_signal_stops_the_runner_and_the_kernel_at_once(tmp_path: Path) -> None:
    proc, out, kernel = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "received SIGTERM again" in output
    runs = [p.name for p in (tmp_path / "runs").iterdir()]
    assert len(runs) == 1 and runs[0].endswith(".failed"), runs
    deadline = time.monotonic() + 10
    while _alive(kernel) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(kernel), "the kernel kept running after the runner stopped"
    for info in CheckpointManager(out / "checkpoints").list():  # whatever was saved is whole
        assert info.valid or info.interrupted, info
