"""Shared fixtures. Shared helpers live in `tests.support` (imported first: it selects XLA:CPU, which this file then
starts before any test module is imported)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import support
from tests.support import NOTEBOOKS
from tpu_helpers.data import build_datasets

support.start_xla()

pytest_plugins = ["tests.runner_hooks"]  # timeouts that name their test; pytest-xdist's work units


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


@pytest.fixture(autouse=True, scope="module")
def _captures_end_with_their_module():
    """Dynamo's captures (backend.compile_step: replayed decode steps, losses, optimizer steps) cleared after each
    test module. A capture outlives its test otherwise, and a later module calling the same function with the same
    shapes replays it; by then torch_xla's compile cache (an LRU of 2048 graphs) may have evicted its graph: the
    suite compiles many thousands. A forward replay then captures anew (backend/xla.py); a replayed backward graph
    cannot."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test: on a loaded 2-core machine (CI, shared runners) two OpenMP threads spin
    against each other: one forward of 37 tokens took 1.3 s with 2 threads and 0.26 s with 1 at a load of 10."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_lm_dir() -> Path:
    """The offline tiny Qwen2 + tokenizer directory (built once into the package cache, then reused)."""
    from tpu_helpers.models.hf_tiny import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_sft(tiny_lm_dir):
    """(tokenizer, train, val) of the generated instruction set at 32 tokens."""
    from transformers import AutoTokenizer

    from tpu_helpers.data.sft import build_sft_datasets, instruction_records

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    train, val, _ = build_sft_datasets(tok, instruction_records(400), seq_len=32, val_fraction=0.1)
    return tok, train, val
