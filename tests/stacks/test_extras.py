"""`pip install tpu_helpers` and its extras, into fresh venvs over the `core` stack (torch and the core dependencies
only, at the dev lock's versions; pip limited to the stack's wheelhouse, so offline and at the lock's versions).

- the core alone: the package installs (its build from the wheelhouse's setuptools), imports, runs the doctor and
  trains the GPT on the CPU; the fine-tuning module then stops with an error that names the `hf` extra;
- `.[hf,notebooks]`: transformers, peft, tokenizers and safetensors come with it, and the fine-tuning notebook runs its
  offline default from the installed package (not this checkout).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.stacks.conftest import stack
from tests.stacks.test_profiles import check_finetune_results
from tests.stacks.venvs import ROOT, distributions_in, offline_pip, overlay, site_packages

pytestmark = [pytest.mark.stacks, pytest.mark.slow]

HF = {"transformers", "peft", "tokenizers", "safetensors"}


def _source(tmp_path):
    """The package's source as pip sees it in a clone (a copy: building in the checkout leaves build/ behind)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "tpu_helpers", src / "tpu_helpers", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    return src


def test_core_install_imports_trains_and_names_the_extra_fine_tuning_needs(tmp_path):
    core = stack("core")
    venv, src, elsewhere = overlay(core, tmp_path / "venv"), _source(tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    venv.run(["-m", "pip", "install", "-q", str(src)], checkout=False, env=offline_pip(core.wheelhouse))
    assert distributions_in(site_packages(venv)) == {"tpu-helpers"}  # its dependencies were all there
    assert all(v is None for k, v in core.versions(*HF).items() if k != "python")  # the core has none of hf
    where = venv.run(["-c", "import tpu_helpers, tpu_helpers.launch.doctor; print(tpu_helpers.__file__)"],
                     checkout=False, cwd=elsewhere).stdout
    assert where.strip().startswith(str(site_packages(venv))), where
    doctor = venv.run(["-m", "tpu_helpers", "doctor"], checkout=False, cwd=elsewhere, check=False)
    assert doctor.returncode in (0, 1) and "fine-tuning" in doctor.stdout, doctor.stderr[-2000:]
    assert "transformers, peft, tokenizers, safetensors not installed" in doctor.stdout, doctor.stdout
    venv.run(["-m", "tpu_helpers.train", "--device", "cpu", "--preset", "tiny", "--steps", "6", "--batch_size", "4",
              "--seq_len", "32", "--eval_every", "3", "--log_every", "3", "--max_chars", "100000",
              "--out_dir", str(tmp_path / "gpt")], checkout=False, cwd=elsewhere)
    assert json.loads((tmp_path / "gpt" / "results.json").read_text())["report"]["steps"] == 6
    err = venv.run(["-c", "from tpu_helpers.recipes.finetune import Finetune"], checkout=False, cwd=elsewhere,
                   check=False)
    assert err.returncode == 1
    last = err.stderr.strip().splitlines()[-1]
    assert last.startswith("tpu_helpers.core.extras.MissingExtra: fine-tuning (tpu_helpers.recipes.finetune) needs the "
                           "'hf' extra"), last
    assert "not installed here: transformers, peft, tokenizers, safetensors" in last
    assert 'pip install "tpu_helpers[hf]"' in last, last


def test_hf_extra_brings_what_the_finetune_notebook_needs(tmp_path):
    core = stack("core")
    venv, src, elsewhere = overlay(core, tmp_path / "venv"), _source(tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    venv.run(["-m", "pip", "install", "-q", f"{src}[hf,notebooks]"], checkout=False, env=offline_pip(core.wheelhouse))
    installed = distributions_in(site_packages(venv))
    assert HF | {"tpu-helpers", "papermill", "ipywidgets"} <= installed, installed
    assert "torch" not in installed  # the core's torch was kept
    out = tmp_path / "out"
    venv.run(["-m", "tpu_helpers", "run", str(ROOT / "notebooks" / "finetune_llm.ipynb"), "--target", "cpu",
              "--runs-dir", str(tmp_path / "runs"), "-p", "STEPS", "40", "-p", "SEQ_LEN", "32", "-p", "EVAL_EVERY",
              "20", "-p", "WARMUP_STEPS", "5", "-p", "OUT_DIR", str(out)], checkout=False, cwd=elsewhere,
             env={"TPU_HELPERS_CACHE": str(tmp_path / "cache")})
    check_finetune_results(out, device="CPU")
