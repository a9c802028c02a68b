"""The quickstart notebook, executed by papermill with tiny parameters on the CPU and on XLA:CPU."""

from __future__ import annotations

import json

import nbformat
import pytest

from tests.support import tensorboard_run, tensorboard_scalars
from tpu_helpers.launch.runner import RunError, run_notebook

pytestmark = pytest.mark.notebooks

TINY = {"PRESET": "tiny", "STEPS": 60, "BATCH_SIZE": 16, "SEQ_LEN": 64, "EVAL_EVERY": 30, "LOG_EVERY": 10,
        "SAVE_EVERY": 30, "WARMUP_STEPS": 10, "LR": 3e-3}


def _run(notebooks, tmp_path, target, **params):
    out_dir = tmp_path / "out"
    result = run_notebook(notebooks["quickstart"], target=target, runs_dir=tmp_path / "runs",
                          params={**TINY, "OUT_DIR": str(out_dir), **params})
    return result, out_dir


def _check_trained(result, out_dir):
    assert result.ok, result.error
    assert result.directory.name.startswith("quickstart-") and not result.directory.name.endswith(".running")
    for name in ("quickstart.ipynb", "params.json", "results.json", "loss.png"):
        assert (result.directory / name).stat().st_size > 0, name
    report = json.loads((out_dir / "results.json").read_text())["report"]
    assert report["steps"] == 60
    assert report["final_val_loss"] < 0.7 * report["first_val_loss"], report
    assert (out_dir / "checkpoints" / "ckpt-00000060.pt").exists()
    assert report["checkpoint"].endswith("ckpt-00000060.pt")
    return report


def test_quickstart_trains_on_cpu_watched_in_tensorboard(notebooks, tmp_path):
    result, out_dir = _run(notebooks, tmp_path, "cpu", TRACKERS="tensorboard")
    report = _check_trained(result, out_dir)
    assert report["device"].startswith("CPU") and report["xla"] == {}
    # TRACKERS: the curves in TensorBoard (its own reader) are results.json's.
    history = json.loads((out_dir / "results.json").read_text())["history"]
    scalars = tensorboard_scalars(tensorboard_run(out_dir))
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in history["train"]]
    assert scalars["eval/loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in history["eval"]]
    assert [s for s, _ in scalars["eval/loss"]] == [0, 30, 60]


@pytest.mark.xla
def test_quickstart_trains_on_xla_cpu_without_recompiling(notebooks, tmp_path):
    result, out_dir = _run(notebooks, tmp_path, "xla-cpu")
    report = _check_trained(result, out_dir)
    assert report["device"] == "XLA:CPU x1, fp32"
    # Two training graphs (first step, steady state) and one evaluation graph; no CPU fallbacks.
    assert 1 <= report["xla"]["compilations"] <= 4, report["xla"]
    assert report["xla"]["cpu_fallback_ops"] == {}


def test_rerun_resumes_from_the_checkpoint(notebooks, tmp_path):
    _run(notebooks, tmp_path, "cpu", STEPS=30)
    result, out_dir = _run(notebooks, tmp_path, "cpu", STEPS=40)
    assert result.ok, result.error
    report = json.loads((out_dir / "results.json").read_text())["report"]
    assert report["resumed_from"] == 30 and report["steps_this_run"] == 10


def test_unknown_parameter_is_refused_before_anything_runs(notebooks, tmp_path):
    with pytest.raises(RunError, match=r"unknown parameter\(s\) \['STEPZ'\] for quickstart.ipynb; it declares: "):
        _run(notebooks, tmp_path, "cpu", STEPZ=3)
    assert not (tmp_path / "runs").exists()


def test_wrong_type_fails_in_the_validation_cell_and_writes_nothing(notebooks, tmp_path):
    result, out_dir = _run(notebooks, tmp_path, "cpu", STEPS="ten")
    assert not result.ok
    assert "ConfigError: STEPS='ten' has type str; expected int" in result.error
    # It failed in the cell that validates the parameters (after the setup cell), and nothing after it ran.
    executed = nbformat.read(result.directory / "quickstart.ipynb", as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(code) if "injected-parameters" in c.metadata.get("tags", [])) + 1
    assert "platform.setup_notebook(" in code[first].source  # the setup cell comes first: it needs no parameter check
    first += 1
    failed = [i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert failed == [first] and "th.config_from_parameters(globals())" in code[first].source
    assert all(c.get("execution_count") is None for c in code[first + 1:])
    assert result.directory.name.endswith(".failed")
    assert not out_dir.exists()  # nothing half-written
    assert not list((tmp_path / "runs").glob("*.running"))
