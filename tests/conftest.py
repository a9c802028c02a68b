"""Shared fixtures. Shared helpers live in `tests.support` (imported first: it selects XLA:CPU and starts it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import NOTEBOOKS
from tpu_helpers.data import build_datasets


@pytest.fixture(scope="session")
def notebooks() -> dict[str, Path]:
    return NOTEBOOKS


@pytest.fixture(scope="session")
def tiny_data():
    """Small train/val block datasets of the embedded corpus, byte tokens, 32-token blocks."""
    train, val, tok = build_datasets("embedded", "byte", block_size=32, max_chars=200_000)
    return train, val, tok


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
