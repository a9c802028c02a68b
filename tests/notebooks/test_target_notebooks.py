"""The three platform notebooks run headlessly through the batch runner with tiny parameters: the Colab notebook on
XLA:CPU (one device, then rerun to resume), the TPU VM notebook on 8 simulated XLA:CPU devices in SPMD, the GPU
notebook on the CPU path; and the runner's failures (a failing cell, bad targets and names) are clear and leave no
run directory that looks finished."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support import NOTEBOOKS, ROOT
from tpu_helpers.__main__ import main
from tpu_helpers.launch.runner import RunError, run_notebook

pytestmark = pytest.mark.notebooks

TINY = {"PRESET": "tiny", "SEQ_LEN": 32, "DATASET": "embedded", "MAX_CHARS": 200_000, "WARMUP_STEPS": 5,
        "LR": 3e-3, "LOG_EVERY": 10, "EVAL_EVERY": 20, "SAVE_EVERY": 20}


def _finished(result, runs_dir):
    assert result.ok, result.error
    assert result.directory.parent == runs_dir and not result.directory.name.endswith((".running", ".failed"))
    for name in ("params.json", "results.json", "loss.png", result.directory.name.rsplit("-", 2)[0] + ".ipynb"):
        assert (result.directory / name).exists(), name
    return json.loads((result.directory / "results.json").read_text())


def _fell(results):
    report = results["report"]
    assert report["final_val_loss"] < report["first_val_loss"], report
    assert report["tokens_per_s"] > 0
    return report


@pytest.mark.xla
def test_colab_notebook_on_xla_cpu_and_rerun_resumes(tmp_path):
    runs = tmp_path / "runs"
    params = {**TINY, "STEPS": 20, "BATCH_SIZE": 8, "OUT_DIR": str(tmp_path / "colab")}
    first = _finished(run_notebook(NOTEBOOKS["colab_tpu"], target="xla-cpu", params=params, runs_dir=runs), runs)
    report = _fell(first)
    assert report["device"].startswith("XLA:CPU x1") and report["steps"] == 20
    assert report["xla"]["compilations"] >= 1 and report["xla"]["cpu_fallback_ops"] == {}
    assert report["checkpoint"].endswith("ckpt-00000020.pt")
    assert first["platform"] == "colab" and first["drive"] is False
    # Rerunning the notebook with more steps continues from the checkpoint instead of starting over.
    params["STEPS"] = 30
    again = _finished(run_notebook(NOTEBOOKS["colab_tpu"], target="xla-cpu", params=params, runs_dir=runs), runs)
    assert again["report"]["resumed_from"] == 20 and again["report"]["steps_this_run"] == 10
    print(f"colab_tpu on XLA:CPU: {report['tokens_per_s']:,.0f} tokens/s")


@pytest.mark.xla
def test_tpuvm_notebook_runs_spmd_on_eight_xla_cpu_devices(tmp_path):
    runs = tmp_path / "runs"
    params = {**TINY, "STEPS": 20, "GLOBAL_BATCH": 16, "OUT_DIR": str(tmp_path / "v5e8")}
    results = _finished(run_notebook(NOTEBOOKS["tpuvm_v5e8"], target="xla-cpu-8", params=params, runs_dir=runs),
                        runs)
    report = _fell(results)
    assert report["device"].startswith("XLA:CPU x8 (SPMD)"), report["device"]
    assert (results["mode"], results["chips"], results["global_batch"]) == ("spmd", 8, 16)
    assert results["config"]["batch_size"] == 2 and report["tokens_per_step"] == 16 * 32
    executed = (results_dir := next(runs.iterdir())) / "tpuvm_v5e8.ipynb"
    assert "global batch 16 = 2 per chip x 8 chips x 1 accumulation" in executed.read_text(), results_dir
    print(f"tpuvm_v5e8 on 8 XLA:CPU devices: {report['tokens_per_s']:,.0f} tokens/s")


def test_gpu_notebook_on_the_cpu_path_prints_the_torchrun_command(tmp_path):
    runs = tmp_path / "runs"
    params = {**TINY, "STEPS": 20, "BATCH_SIZE": 8, "OUT_DIR": str(tmp_path / "gpu")}
    result = run_notebook(NOTEBOOKS["gpu_fallback"], target="cpu", params=params, runs_dir=runs)
    report = _fell(_finished(result, runs))
    assert report["device"].startswith("CPU") and report["precision"] == "fp32"
    text = (result.directory / "gpu_fallback.ipynb").read_text()
    assert "torchrun --nproc_per_node=4 -m tpu_helpers.train --device cpu --preset tiny" in text
    print(f"gpu_fallback on the CPU: {report['tokens_per_s']:,.0f} tokens/s")


def test_failing_cell_exits_non_zero_naming_the_cell(tmp_path):
    # 12 sequences cannot be split over 8 chips: the notebook's planning cell fails before any XLA work.
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "tpu_helpers", "run", str(NOTEBOOKS["tpuvm_v5e8"]), "--target",
                           "xla-cpu-8", "-p", "GLOBAL_BATCH", "12", "-p", "DATASET", "embedded", "--runs-dir",
                           str(runs)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # Execution count 5: the parameters, papermill's injected cell, the setup cell, the doctor, then the plan.
    assert re.search(r"FAILED: cell \d+ \(execution count 5\) failed: ConfigError: GLOBAL_BATCH=12 cannot be "
                     r"split over 8 chips", proc.stdout), proc.stdout
    assert "cell starts with: import tpu_helpers as th" in proc.stdout
    assert [p.name.endswith(".failed") for p in runs.iterdir()] == [True]


def test_drive_mount_outside_colab_fails_the_run_clearly(tmp_path):
    runs = tmp_path / "runs"
    result = run_notebook(NOTEBOOKS["colab_tpu"], target="cpu", runs_dir=runs,
                          params={"MOUNT_DRIVE": True, "OUT_DIR": str(tmp_path / "c")})
    assert not result.ok and result.directory.name.endswith(".failed")
    assert "PlatformError: MOUNT_DRIVE=True needs Google Colab" in result.error
    assert [p.name for p in runs.iterdir()] == [result.directory.name]
    assert not (tmp_path / "c").exists()


def test_unknown_target_and_parameter_are_refused_before_anything_runs(tmp_path, capsys):
    runs = tmp_path / "runs"
    with pytest.raises(RunError, match=r"unknown target 'tpu-v9'; known targets: auto, local, cpu"):
        run_notebook(NOTEBOOKS["gpu_fallback"], target="tpu-v9", runs_dir=runs)
    assert main(["run", str(NOTEBOOKS["tpuvm_v5e8"]), "--target", "xla-cpu-8", "-p", "BATCH_SIZE", "8",
                 "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter(s) ['BATCH_SIZE'] for tpuvm_v5e8.ipynb" in err and "GLOBAL_BATCH" in err
    assert not runs.exists()
