"""A non-editable install (what `pip install .` or a wheel gives) works from another directory: no file is read
from a source checkout. Installed with `pip --target` into a temporary folder, so the shared venv is untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.support import ROOT, SCRIPTS


def test_installed_package_finds_its_data_and_its_subprocesses_import_it(tmp_path):
    src, site, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    # Built from a copy: building in the checkout would leave build/ and *.egg-info behind.
    shutil.copytree(ROOT / "tpu_helpers", src / "tpu_helpers", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "installed_probe.py")], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["package"] == str(site / "tpu_helpers" / "__init__.py")
    assert got["requirements"].startswith(str(site)) and os.path.isfile(got["requirements"])
    assert got["missing"] == []  # everything the Colab list names is in this environment
    assert got["child_path"] == str(site)
    cli = subprocess.run([sys.executable, "-m", "tpu_helpers", "targets"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "kaggle-v5e-8" in cli.stdout, cli.stderr[-2000:]
