"""Helpers the tests share (imported as `tests.support`; conftest.py only holds fixtures).

XLA tests run on XLA:CPU: PJRT_DEVICE=CPU must be set before torch_xla is first imported, so this module sets it
before it imports the package. Code that must run in a fresh interpreter (XLA fixes SPMD and the device count per
process) lives in files under tests/scripts/, run with `run_script`, and may import this module too.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The session (and every process it starts) keeps no more compiled graphs than XLA:CPU's memory mappings allow
# (runtime_env.cap_xla_cpu_cache): the whole suite in one process would otherwise exhaust vm.max_map_count.
from tpu_helpers.backend import runtime_env  # noqa: E402

runtime_env.cap_xla_cpu_cache()
# XLA:CPU compiles with LLVM at -O0 here and in every process the tests start (they inherit XLA_FLAGS): the tests'
# programs are tiny, and LLVM's optimisation passes were most of their compile time (3.4 s -> 0.4 s per graph of a
# 1-layer Qwen2; tests/training/test_xla_hygiene.py 77 -> 35 s). What the tests check is untouched: the HLO passes,
# the graphs compiled and XLA's buffer assignment (the compiled memory figures, identical at -O0) are the same; a
# TPU never uses this CPU code generator.
_O0 = "--xla_backend_optimization_level=0"
if os.environ["PJRT_DEVICE"] == "CPU" and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_O0}".strip()
# One OpenMP thread for eager torch in every process the tests start (scripts, notebooks, benchmarks): on a 2-core
# machine shared with other work, two threads spin against each other and the models here are too small to gain
# from a second one. A single pytest process keeps torch's default (it read the environment at import), and its long
# eager tests take conftest.py's `one_thread` fixture instead; `make test`'s pytest-xdist workers are processes it
# starts, so each runs on one thread: two workers, one core each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from pathlib import Path  # noqa: E402

from tpu_helpers.backend import BackendUnavailable, get_backend  # noqa: E402
from tpu_helpers.config import TrainConfig  # noqa: E402
from tpu_helpers.core.callbacks import Callback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"

XLA_BACKEND = None  # the test session's single-device XLA:CPU backend (conftest.py calls start_xla first)


def start_xla() -> None:
    """Make the session's XLA:CPU backend before any test runs. torch's autograd engine sizes its per-device queues
    at the first backward pass: the XLA device must exist before any CPU test runs backward, or later XLA backward
    passes fail an internal assert. (SPMD tests run scripts in their own processes: SPMD is fixed per process, so
    the scripts import this module without starting anything.)"""
    global XLA_BACKEND
    try:
        XLA_BACKEND = get_backend("xla", spmd=False)
    except BackendUnavailable:
        XLA_BACKEND = None

# Short names for the notebooks the tests execute (microsoft/recommenders style).
NOTEBOOKS = {name: ROOT / "notebooks" / f"{name}.ipynb" for name in (
    "quickstart", "colab_tpu", "tpuvm_v5e8", "gpu_fallback", "xla_debugging", "batch_size_tuning", "finetune_llm",
    "grpo_llm", "preference_llm", "agents_llm")}


def tiny_config(tmp_path: Path, **overrides) -> TrainConfig:
    """A TrainConfig shrunk for tests: tiny GPT, short sequences, frequent logging."""
    base = dict(device="cpu", preset="tiny", steps=20, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=5,
                eval_every=10, eval_batches=2, log_every=5, save_every=10, out_dir=str(tmp_path / "run"),
                max_chars=200_000)
    base.update(overrides)
    return TrainConfig(**base)


def optimized_xla(level: int = 1) -> dict[str, str]:
    """XLA_FLAGS for a child process whose programs run long rather than compile often, at LLVM -O`level` instead
    of the session's -O0: the 8-device agent GRPO job (tests/algorithms/test_grpo_episodes.py) spends its time
    running its decode loops, not compiling them (CHANGELOG.md, 2026-11-28: what -O1 saves there, costs elsewhere)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(_O0, "").strip()
    return {"XLA_FLAGS": f"{flags} --xla_backend_optimization_level={level}".strip()}


def run_script(name: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run tests/scripts/<name>.py with `args` in a fresh interpreter (XLA SPMD and device counts are fixed per
    process); an AssertionError with its output if it fails."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{name}.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def script_result(name: str, args: dict | None = None, **kwargs) -> object:
    """Run tests/scripts/<name>.py with `args` as JSON and read back the JSON it prints on its last
    "RESULT ..." line (`print_result` in the script)."""
    proc = run_script(name, *([json.dumps(args)] if args is not None else []), **kwargs)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def script_args() -> dict:
    """In a script: the JSON arguments `script_result` passed."""
    return json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}


def print_result(value: object) -> None:
    """In a script: the value `script_result` reads back."""
    print("RESULT " + json.dumps(value), flush=True)


class StopAt(Callback):
    """An interruption, as a SIGTERM would make: the trainer finishes the step, saves and returns after each of
    `steps` (one step or several)."""

    def __init__(self, steps: int | Iterable[int]) -> None:
        self.steps = {steps} if isinstance(steps, int) else set(steps)

    def on_step_end(self, trainer) -> None:
        if trainer.step in self.steps:
            trainer.stop_reason = f"interrupted by the test at step {trainer.step}"


def assert_same_trainable_weights(whole, resumed) -> dict:
    """The two models' trainable parameters are the same names and bit-identical (a run killed and resumed against
    the same run left whole); returns the whole run's, by name."""
    import torch

    a = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    b = {n: p for n, p in resumed.named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    return a


class StepCounters(Callback):
    """Compilations and device-to-host transfers of each step (`steps[step]`), from the backend's XLA counters read
    on the host before and after it."""

    def on_fit_start(self, trainer) -> None:
        self.last, self.steps = trainer.backend.metrics(), {}

    def on_step_end(self, trainer) -> None:
        now = trainer.backend.metrics()
        self.steps[trainer.step] = {k: now[k] - self.last[k] for k in ("compilations", "device_to_host_transfers")}
        self.last = now


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of a TensorBoard log directory, as TensorBoard shows them (its own reader, which
    applies purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> dict[str, list[tuple[int, str]]]:
    """{tag: [(step, text)]} of the text summaries (add_text) in a TensorBoard log directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode())
                                                for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def tensorboard_run(out_dir: Path) -> Path:
    """The one tracked run's TensorBoard directory under `<out_dir>/tensorboard/`."""
    runs = [p for p in (Path(out_dir) / "tensorboard").iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]
