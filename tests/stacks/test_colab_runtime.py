"""The fine-tuning notebook on Colab's TPU runtime as it ships: no tpu_helpers, no peft (papermill only runs the test).

A fresh venv layered over the colab stack venv stands for the runtime (installs land in it; the cached stack venv is
not changed). Papermill runs notebooks/finetune_llm.ipynb there with REPO_URL pointing at a git repository of this
checkout and pip limited to the stack's wheelhouse (offline, the lock's versions): the setup cell fetches the
package, installs peft and nothing else, leaves every package the runtime ships at its version, and the notebook runs
its offline default (the tiny Qwen2, the generated task) with LoRA on XLA:CPU.
"""

from __future__ import annotations

import json

import pytest

from tests.stacks.conftest import stack
from tests.stacks.test_profiles import check_finetune_results
from tests.stacks.venvs import distributions_in, offline_pip, overlay, repository_copy, site_packages

pytestmark = [pytest.mark.stacks, pytest.mark.slow, pytest.mark.notebooks]

ALL_VERSIONS = ("import importlib.metadata as m, json; "
                "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")


def _versions(venv) -> dict[str, str]:
    return json.loads(venv.run(["-c", ALL_VERSIONS], checkout=False).stdout.strip().splitlines()[-1])


def test_requirements_colab_adds_only_what_the_runtime_lacks():
    colab = stack("colab")
    code = ("from tpu_helpers import platform; import json; "
            "print(json.dumps(platform.missing_requirements(platform.colab_requirements())))")
    missing = json.loads(colab.run(["-c", code]).stdout.strip().splitlines()[-1])
    # Every range in the list contains what Colab ships; only the absent peft remains (papermill is there for tests).
    assert missing == ["peft>=0.17"], missing


def test_finetune_notebook_setup_cell_on_the_runtime_as_shipped(tmp_path):
    colab = stack("colab")
    runtime = overlay(colab, tmp_path / "runtime")
    repo = repository_copy(tmp_path / "repo")
    shipped = _versions(runtime)
    assert "peft" not in shipped and "tpu_helpers" not in shipped and "tpu-helpers" not in shipped

    kernels = tmp_path / "jupyter" / "kernels" / "colab-runtime"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [runtime.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab runtime (stack test)", "language": "python"}))
    out, executed = tmp_path / "out", tmp_path / "finetune_llm.ipynb"
    params = {"REPO_URL": f"file://{repo}", "DEVICE": "xla", "STEPS": "40", "SEQ_LEN": "32", "EVAL_EVERY": "20",
              "WARMUP_STEPS": "5", "OUT_DIR": str(out)}
    args = ["-m", "papermill", str(repo / "notebooks" / "finetune_llm.ipynb"), str(executed), "-k", "colab-runtime",
            "--cwd", str(tmp_path)]
    for name, value in params.items():
        args += ["-p", name, value]
    runtime.run(args, checkout=False, cwd=tmp_path, timeout=1200,
                env={**offline_pip(colab.wheelhouse), "JUPYTER_PATH": str(tmp_path / "jupyter"),
                     "TPU_HELPERS_CACHE": str(tmp_path / "cache"), "PJRT_DEVICE": "CPU"})

    nb = json.loads(executed.read_text())
    setup = next(c for c in nb["cells"] if "setup_notebook(" in "".join(c["source"]))
    said = "".join(o.get("text", "") if isinstance(o.get("text"), str) else "".join(o.get("text", []))
                   for o in setup["outputs"])
    assert "setup for finetune_llm" in said and "torch 2.9.0, torch_xla 2.9.0: ok" in said, said
    assert "installed: peft 0.21.2" in said and "transformers 5.15.0" in said, said
    # Only the package and peft were installed, into the runtime; nothing it shipped moved.
    assert distributions_in(site_packages(runtime)) == {"tpu-helpers", "peft"}, distributions_in(site_packages(runtime))
    after = _versions(runtime)
    moved = {k: (v, after.get(k)) for k, v in shipped.items() if after.get(k) != v}
    assert not moved, moved
    assert after["peft"] == "0.21.2"
    assert colab.versions("peft")["peft"] is None  # the cached stack venv is as built
    check_finetune_results(out, device="XLA:CPU")
