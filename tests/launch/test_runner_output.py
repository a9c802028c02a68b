"""What `python -m tpu_helpers run` leaves and prints for a run that succeeds: one folder (the run directory inside
the notebook's OUT_DIR, beside its checkpoints and results), and no ERROR or warning from the kernel's shutdown; a
misspelt `-p` name or MODEL gets the nearest name, before anything trains.

The notebook of the first test keeps a SIGINT handler installed after its cell (the kernel's hooks, which set
and put back its own around each message, are turned off), so a SIGINT that reaches the kernel at shutdown writes a
file: what jupyter_client's interrupt before every shutdown did, and what the kernel logged as `ERROR |
KeyboardInterrupt caught in kernel` whenever it landed while the kernel handled a message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tpu_helpers.launch.runner import RunError, run_home, run_notebook

ROOT = Path(__file__).resolve().parents[2]

CELL = '''import signal
from tpu_helpers.training.results import write_results
kernel = get_ipython().kernel
kernel.pre_handler_hook = kernel.post_handler_hook = lambda: None  # the handler below stays for every message
signal.signal(signal.SIGINT, lambda *_: open(MARK, "w").write("SIGINT"))
write_results(OUT_DIR, {"report": {"final_val_loss": 1.5}})'''


def _notebook(path: Path, mark: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(f'OUT_DIR = "out"  # results\nMARK = "{mark}"  # written on a SIGINT')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def _encrypts() -> bool:
    """Whether this stack's jupyter_client provisions CurveZMQ keys for the kernel (>= 8.10, a curve-capable zmq
    and a kernelspec that declares it: ipykernel >= 7)."""
    import zmq
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    return ("transport_encryption" in AsyncKernelManager.class_traits() and zmq.has("curve")
            and "curve" in (spec.metadata or {}).get("supported_encryption", []))


@pytest.mark.notebooks
def test_a_successful_run_is_one_folder_and_prints_no_error_or_warning(tmp_path):
    out, mark = tmp_path / "out", tmp_path / "sigint"
    proc = subprocess.run([sys.executable, "-m", "tpu_helpers", "run", str(_notebook(tmp_path / "quiet.ipynb", mark)),
                           "-p", "OUT_DIR", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not mark.exists(), "the kernel got a SIGINT at its shutdown"
    assert "ERROR" not in proc.stderr, proc.stderr
    if _encrypts():
        assert "WARNING" not in proc.stderr, proc.stderr
    # The printed run directory is in OUT_DIR, with the executed notebook and the results; nothing went to runs/.
    printed = [line.split("ok: ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("   ok: ")]
    assert len(printed) == 1 and Path(printed[0]).parent == out, proc.stdout
    assert {p.name for p in Path(printed[0]).iterdir()} >= {"quiet.ipynb", "params.json", "results.json"}
    assert (out / "results.json").is_file() and not (tmp_path / "runs").exists()


def test_the_run_directory_goes_where_out_dir_says(tmp_path):
    assert run_home({"OUT_DIR": "runs/grpo-smollm2", "STEPS": 8}) == Path("runs/grpo-smollm2")
    assert run_home({"STEPS": 8}) == Path("runs") == run_home({"OUT_DIR": None}) == run_home({"OUT_DIR": " "})


def test_a_misspelt_parameter_gets_the_nearest_name_before_anything_runs(tmp_path):
    path = _notebook(tmp_path / "quiet.ipynb", tmp_path / "sigint")
    with pytest.raises(RunError, match=r"unknown parameter\(s\) \['OUT_DRI'\] for quiet\.ipynb; it declares: OUT_DIR, "
                                       r"MARK\. Did you mean OUT_DIR \(not OUT_DRI\)\?$"):
        run_notebook(path, params={"OUT_DRI": "x"}, runs_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.notebooks
def test_a_misspelt_model_fails_at_the_config_cell_naming_the_offline_models(tmp_path):
    """The newcomer's `-p MODEL smollm2-135`: the notebook stops at its config cell (nothing loaded or downloaded),
    naming the offline models and the nearest one."""
    result = run_notebook(ROOT / "notebooks" / "finetune_llm.ipynb", target="cpu", runs_dir=tmp_path / "runs",
                          params={"MODEL": "smollm2-135", "OUT_DIR": str(tmp_path / "out")})
    assert not result.ok and "cell starts with: import tpu_helpers as th" in result.error, result.error  # config
    assert "ConfigError: MODEL='smollm2-135' is no local folder, no offline model and no hub name (did you mean " \
           "'smollm2-135m'?)" in result.error, result.error
    assert not (tmp_path / "out").exists()
