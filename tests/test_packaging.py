"""What users install and what CI installs: the extras, the locked dev set, the stack profiles.

- pyproject.toml's extras are the ones the package names in its errors (tpu_helpers.core.extras), and the ranges that
  requirements-colab.txt (what a notebook's setup cell installs) gives are pyproject's;
- requirements-dev.lock is complete and is what this venv holds: every pin installed at its version, `pip check`
  clean but for the dependencies of the data packages (stacks/dev-data.txt, installed --no-deps), and every range of
  its inputs met by a pin;
- the stack profiles the doctor knows (tpu_helpers.platform.stacks) are the pins stacks/*.txt give the stack venvs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.support import ROOT
from tpu_helpers import platform
from tpu_helpers.core import extras
from tpu_helpers.platform import stacks


def _stack_venv_module():
    """stacks/stack_venv.py (a script, not a package module), loaded once."""
    if "stack_venv" not in sys.modules:
        spec = importlib.util.spec_from_file_location("stack_venv", ROOT / "stacks" / "stack_venv.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["stack_venv"] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["stack_venv"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCK = _stack_venv_module().pins(ROOT / "requirements-dev.lock")


def test_extras_are_pyprojects_and_the_colab_list_uses_their_ranges():
    optional = {k: [Requirement(r) for r in v] for k, v in PYPROJECT["optional-dependencies"].items()}
    for extra, names in extras.EXTRAS.items():
        assert [r.name for r in optional[extra]] == list(names), extra
    # The dev extra narrows ipywidgets to 8 for the dev venv's JupyterLab 4: users' ranges are the other extras'.
    ranges = {_canonical(r.name): r.specifier for k, reqs in optional.items() if k != "dev" for r in reqs}
    ranges.update({_canonical(Requirement(r).name): Requirement(r).specifier for r in PYPROJECT["dependencies"]})
    for req in platform.read_requirements(platform.colab_requirements()):
        assert req.specifier == ranges[_canonical(req.name)], req
    # What a parameter asks the setup cell for (QAT: torchao; TRACKERS: a tracker; EXPORT_GGUF: gguf; EVAL_TASKS:
    # lm_eval) is its extra's requirement.
    asked = {_canonical(Requirement(r).name): Requirement(r) for r in platform.PARAMETER_REQUIREMENTS.values()}
    assert {k: str(r) for k, r in asked.items()} == {_canonical(r.name): str(r) for e in ("qat", "tracking", "gguf",
                                                                                                "eval")
                                                     for r in optional[e]}


def test_missing_extra_is_a_clear_error_that_names_the_extra():
    extras.require_extra("hf", "fine-tuning")  # all here
    assert extras.missing("hf", ["surely-absent-th3", "peft"]) == ["surely-absent-th3"]
    with pytest.raises(ImportError, match=r"^the panel needs the 'notebooks' extra \(papermill, ipywidgets, nbformat, "
                       r"ipykernel, datasets\); not installed here: surely-absent-th3\. Install it with: pip install "
                       r"\"tpu_helpers\[notebooks\]\""):
        extras.require_extra("notebooks", "the panel", ["surely-absent-th3"])
    with pytest.raises(ValueError, match=r"extra='gpu' is not one of \['eval', 'gguf', 'hf', 'notebooks'\]"):
        extras.missing("gpu")


def test_the_lock_is_complete_and_is_what_this_venv_holds():
    wrong = {}
    for key, line in LOCK.items():
        want = line.split("==")[1]
        try:
            have = importlib.metadata.version(key)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != want:
            wrong[key] = (want, have)
    assert not wrong, f"this venv is not requirements-dev.lock (run make setup): {wrong}"
    # The data packages (stacks/dev-data.txt) are installed without their dependencies, on purpose: pip check may
    # list those as missing, and nothing else.
    data = _stack_venv_module().pins(ROOT / _stack_venv_module().STACKS["dev"].data)
    for key, line in data.items():
        assert importlib.metadata.version(key) == line.split("==")[1], f"{line} is not installed (run make setup)"
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [x for x in check.stdout.splitlines() if x.strip() and _canonical(x.split()[0]) not in data]
    assert not problems and (check.returncode == 0 or check.stdout.strip()), check.stdout + check.stderr


def test_every_range_of_the_lock_inputs_is_met_by_a_pin():
    inputs = [Requirement(r) for r in PYPROJECT["dependencies"]]
    for extra in ("hf", "notebooks", "dev"):
        inputs += [Requirement(r) for r in PYPROJECT["optional-dependencies"][extra]]
    inputs += platform.read_requirements(ROOT / "requirements-dev.txt")
    inputs += platform.read_requirements(platform.colab_requirements())
    for req in inputs:
        pin = LOCK.get(_canonical(req.name))
        assert pin, f"{req.name} is not in requirements-dev.lock: run make lock"
        assert req.specifier.contains(pin.split("==")[1], prereleases=True), (str(req), pin)


def _pins(path) -> dict[str, str]:
    out = {}
    for line in (ROOT / path).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s#]+)", line)
        if m:
            out[_canonical(m.group(1))] = m.group(3).rstrip(".*")
    return out


@pytest.mark.parametrize("name", ["colab", "kaggle", "latest"])
def test_the_doctors_stack_profiles_are_the_stack_venvs_pins(name):
    profile, stack = stacks.PROFILES[name], _stack_venv_module().STACKS[name]
    pinned = _pins(f"stacks/{name}.txt")
    assert pinned["torch"] == profile.torch and pinned.get("torch-xla") == (profile.torch if profile.xla else None)
    assert {k: v for k, v in pinned.items() if k not in ("torch", "torch-xla", "notebook")} == \
        {_canonical(k): v for k, v in profile.packages.items()}
    assert stack.python == profile.python
    locked = _stack_venv_module().pins(ROOT / stack.lock.path)
    assert ("torch-xla" in locked) == profile.xla and "torch-tpu" not in locked
    for dist, version in {"torch": profile.torch, **({"torch_xla": profile.torch} if profile.xla else {}),
                          **profile.packages}.items():
        assert stacks._matches(locked[_canonical(dist)].split("==")[1], version), (dist, locked[_canonical(dist)])
    assert profile.python == stack.lock.python


def test_the_recommended_pair_is_the_backends_newest_torch_xla_and_a_tested_one():
    from tpu_helpers.backend import NEWEST_TORCH_XLA

    # One concept, one place: the pair a fix installs is the backend's newest torch_xla itself, not a copy of its
    # number that could drift from it.
    assert stacks.RECOMMENDED is NEWEST_TORCH_XLA
    assert stacks.RECOMMENDED in stacks.TESTED_PAIRS
    assert stacks.PAIR_FIX == f"pip install 'torch=={NEWEST_TORCH_XLA}' 'torch_xla[tpu]=={NEWEST_TORCH_XLA}'"
