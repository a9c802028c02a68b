"""Helpers the tests share (imported as `tests.support`; conftest.py only holds fixtures).

XLA tests run on XLA:CPU: PJRT_DEVICE=CPU must be set before torch_xla is first imported, so this module sets it
before it imports the package.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tpu_helpers.backend import BackendUnavailable, get_backend  # noqa: E402
from tpu_helpers.config import TrainConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# torch's autograd engine sizes its per-device queues at the first backward pass: the XLA device must exist
# before any CPU test runs backward, or later XLA backward passes fail an internal assert. So the session's
# single-device XLA:CPU backend is made first (SPMD tests run in subprocesses: SPMD is fixed per process).
try:
    XLA_BACKEND = get_backend("xla", spmd=False)
except BackendUnavailable:
    XLA_BACKEND = None

# Short names for the notebooks the tests execute (microsoft/recommenders style).
NOTEBOOKS = {name: ROOT / "notebooks" / f"{name}.ipynb" for name in (
    "quickstart", "colab_tpu", "tpuvm_v5e8", "gpu_fallback", "xla_debugging", "batch_size_tuning", "finetune_llm")}


def tiny_config(tmp_path: Path, **overrides) -> TrainConfig:
    """A TrainConfig shrunk for tests: tiny GPT, short sequences, frequent logging."""
    base = dict(device="cpu", preset="tiny", steps=20, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=5,
                eval_every=10, eval_batches=2, log_every=5, save_every=10, out_dir=str(tmp_path / "run"),
                max_chars=200_000)
    base.update(overrides)
    return TrainConfig(**base)


def run_python(code: str, *, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (XLA SPMD and device counts are fixed per process)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
