"""The stack tests run the package in the Colab, Kaggle, core and latest venvs: `make test-stacks` builds them
(stacks/stack_venv.py) and names them in TPU_HELPERS_STACK_VENVS ("colab=/path,kaggle=/path,core=/path,latest=/path").

Without that variable (a plain `make test` or `pytest`) nothing here is collected: these tests need the venvs, and a
skipped stack test would read as a passed one. With it, the stacks it names are the ones asked for (`make
test-stacks STACKS=latest` names only latest): a named venv that is half-built fails, and the tests of a stack it
does not name skip, saying which STACKS runs them.

The tests run under the dev venv's pytest and drive each stack's own interpreter through its stable entry points
(`python -m tpu_helpers doctor`, `python -m tpu_helpers.train`, `python -m tpu_helpers run`, papermill), with this
checkout on PYTHONPATH, except where a test installs the package itself.
"""

from __future__ import annotations

import os

import pytest

from tests.stacks.venvs import NotAsked, StackVenv, Unbuilt, parse_venvs, select

VENVS = parse_venvs(os.environ.get("TPU_HELPERS_STACK_VENVS", ""))
if not VENVS:
    collect_ignore_glob = ["test_*.py"]


def stack(name: str) -> StackVenv:
    try:
        return select(name, VENVS)
    except NotAsked as why:
        pytest.skip(str(why))
    except Unbuilt as err:
        pytest.fail(str(err))


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
