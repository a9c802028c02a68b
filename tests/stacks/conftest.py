"""The stack tests run the package in the Colab, Kaggle, core and latest venvs: `make test-stacks` builds them
(stacks/stack_venv.py) and names them in TPU_HELPERS_STACK_VENVS ("colab=/path,kaggle=/path,core=/path,latest=/path").

Without that variable (a plain `make test` or `pytest`) nothing here is collected: these tests need the venvs, and a
skipped stack test would read as a passed one. With it, a named venv that is missing or half-built fails.

The tests run under the dev venv's pytest and drive each stack's own interpreter through its stable entry points
(`python -m tpu_helpers doctor`, `python -m tpu_helpers.train`, `python -m tpu_helpers run`, papermill), with this
checkout on PYTHONPATH, except where a test installs the package itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.stacks.venvs import StackVenv, parse_venvs

VENVS = parse_venvs(os.environ.get("TPU_HELPERS_STACK_VENVS", ""))
if not VENVS:
    collect_ignore_glob = ["test_*.py"]


def stack(name: str) -> StackVenv:
    if name not in VENVS:
        pytest.fail(f"TPU_HELPERS_STACK_VENVS names no {name!r} venv ({sorted(VENVS)}): run make test-stacks")
    venv = VENVS[name]
    if not (Path(venv.path) / ".complete").exists():
        pytest.fail(f"the {name} venv at {venv.path} is not complete: run make test-stacks (it rebuilds it)")
    return venv


@pytest.fixture(params=["colab", "kaggle"])
def profile_venv(request) -> StackVenv:
    """Each platform profile's venv in turn."""
    return stack(request.param)


@pytest.fixture
def colab_venv() -> StackVenv:
    return stack("colab")


@pytest.fixture
def core_venv() -> StackVenv:
    return stack("core")


@pytest.fixture
def latest_venv() -> StackVenv:
    """The newest torch without torch_xla (Colab's CPU/GPU runtimes)."""
    return stack("latest")
