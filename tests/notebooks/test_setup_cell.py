"""Every notebook opens on a fresh Colab or Kaggle runtime: the cell after the parameters is the same short setup cell
(a minimal bootstrap that fetches the package when it is missing, then `platform.setup_notebook` with the notebook's
own name and the parameters that ask for packages: QAT, TRACKERS), and REPO_URL and INSTALL are parameters. Running it: tests/stacks/test_colab_runtime.py."""

from __future__ import annotations

import ast

import nbformat
import pytest

from tests.support import NOTEBOOKS
from tpu_helpers.launch import platform

BOOTSTRAP = [
    "import importlib.util, subprocess, sys",
    'if importlib.util.find_spec("tpu_helpers") is None:',
    '    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"git+{REPO_URL}"], check=True)',
    "    importlib.invalidate_caches()",
    "from tpu_helpers.launch import platform",
]


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_setup_cell_follows_the_parameters(name):
    nb = nbformat.read(NOTEBOOKS[name], as_version=4)
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    params = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(nb.cells[idx].source).body
              if isinstance(n, ast.Assign)}
    assert params["INSTALL"] is True and params["REPO_URL"] == "https://github.com/OWNER/tpu_helpers"
    code = [c for c in nb.cells[idx + 1:] if c.cell_type == "code"][0].source.splitlines()
    assert code[0].startswith("# Setup: ") and code[1:6] == BOOTSTRAP, code
    # What a parameter asks for is installed too: torchao for QAT, each tracker TRACKERS names.
    asks = "".join(f", {arg}={param}" for arg, param in (("qat", "QAT"), ("trackers", "TRACKERS")) if param in params)
    assert code[6].startswith(f'print(platform.setup_notebook("{name}", install=INSTALL{asks}))'), code
    assert len(code) == 7 and name in platform.NOTEBOOK_NEEDS
    # Nothing above the setup cell needs the package.
    above = "\n".join(c.source for c in nb.cells[:idx + 1] if c.cell_type == "code")
    assert "import tpu_helpers" not in above and "from tpu_helpers" not in above
