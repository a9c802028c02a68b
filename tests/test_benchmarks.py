"""Every script in benchmarks/ runs at a smoke size and prints its figures, so a benchmark nothing else runs cannot
rot unnoticed (a keyword a package function loses breaks only the benchmark that passes it).

Each script runs as a subprocess (its own XLA runtime: several set XLA flags or device counts, which are fixed per
process) on XLA:CPU, with the tiny arguments in SMOKE; the test checks it exits 0 and printed the lines that carry its
figures. The figures themselves are not checked (timings belong in benchmark output, not in tests): at these sizes
they mean nothing. A new script fails here until it gets an entry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.xla]

BENCHMARKS = ROOT / "benchmarks"
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"

# name: (arguments, patterns its output must match, one per figure line). `--smoke` where a script needed new
# arguments to get small; the arguments it already takes otherwise.
SMOKE: dict[str, tuple[list[str], list[str]]] = {
    "agent_episodes": (["--smoke"], [rf"^cpu +package +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +-$",
                                     rf"^cpu +hf +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +-$",
                                     rf"^xla +package +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +\d+ then 0$"]),
    "agent_grpo_vs_trl": (["--smoke"], [rf"^package +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}$",
                                        rf"^trl(: skipped \(trl is not installed| +{NUMBER} +{NUMBER} +{NUMBER} +"
                                        rf"{NUMBER}$)"]),
    "attention_impl": (["--smoke"], [rf"^sdpa +\d+ +{NUMBER} +{NUMBER}$"]),
    "chunked_loss": (["--smoke"], [rf"^whole logits +{NUMBER} +{NUMBER}$", rf"^chunks of 32 +{NUMBER} +{NUMBER}$",
                                   rf"^saved {NUMBER} MiB",
                                   rf"^chunked +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}$",
                                   rf"^the chunked loss saves {NUMBER} GB compiled",
                                   rf"^plan/compiled at fp32: whole logits {NUMBER}, chunked {NUMBER}"]),
    "compile_cache": (["--seq-len", "32"], [rf"^process 2: \d+ compilations, {NUMBER} s compiling",
                                            r"second/first compile time = "]),
    "distill_cache": (["--steps", "2", "--top-k", "8"],
                      [rf"^cached +{NUMBER} ", rf"^cache: {NUMBER} MiB for", rf"LoRA r=16 instead of 8 adds {NUMBER} GB"]),
    "dpo_vs_trl": (["--smoke", "--methods", "dpo,kto,simpo,reward"],
                   [*(rf"^{m} +package +{NUMBER} s/step after 2 warm-up steps \(median\), loss {NUMBER}"
                      for m in ("dpo", "kto", "simpo", "reward")),
                    *(rf"^(trl: skipped \(trl is not installed|{m} +trl +{NUMBER} s/step)" for m in ("dpo", "kto", "simpo", "reward"))]),
    "finetune_memory": (["--smoke"], [rf"^lora \+ checkpointing \(\d+ s\) +{NUMBER} +{NUMBER} +{NUMBER}",
                                      rf"^full \+ checkpointing \(\d+ s\) +{NUMBER} +{NUMBER} +-"]),
    "finetune_vs_hf_trainer": (["--steps", "30", "--window-start", "10", "--window-end", "20", "--batch-size", "2",
                                "--seq-len", "32", "--records", "64"],
                               [r"^package +\d+ +\d+ ", r"^hf +\d+ +\d+ ",
                                rf"steady throughput ratio package / HF Trainer: {NUMBER}"]),
    # HF generate on XLA compiles a graph per token (16 for 4 tokens): it runs on the CPU here, XLA says skipped.
    "generation": (["--tokens", "2", "--batch", "8", "--prompt", "8", "--hf-xla-tokens", "0", "--threads", "1",
                    "--sides", "cached,replay,loop,uncached,hf", "--devices", "cpu,xla,xla8"],
                   [rf"^CPU +2 +hf +{NUMBER}", rf"^XLA:CPU +2 +uncached +{NUMBER}", r"^XLA:CPU +2 +hf +skipped",
                    *(rf"^XLA:CPU +2 +{side} +{NUMBER} .* {NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +True$"
                      for side in ("replay", "loop")),
                    rf"^XLA x8 +2 +loop +{NUMBER} .* {NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +True$"]),
    "gpu_throughput": (["--smoke"], [rf"eager: {NUMBER} tokens/s, MFU"]),
    "graph_hygiene": (["--steps", "12", "--eval-every", "6", "--log-every", "3", "--save-every", "6"],
                      [r"^distinct graphs compiled: \d+", r"^last step that compiled: \d+",
                       r"^host transfers in \d+ steps between log intervals: \d+"]),
    "grpo_loss_types": (["--smoke"], [rf"^held-out before training: mean reward {NUMBER}",
                                      *(rf"^{t} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}$"
                                        for t in ("grpo", "bnpo", "dr_grpo", "dapo"))]),
    "grpo_vs_trl": (["--smoke", "--sides", "package,package-replay,trl"],
                    [rf"^{side} +{NUMBER} s/step after the first, host CPU {NUMBER} s/step, generation \d+%"
                     for side in ("package", "package-replay")]
                    + [rf"^trl(: skipped \(trl is not installed| +{NUMBER} s/step)"]),
    "kill_soak": (["--kills", "3", "--sigterms", "1", "--steps", "60"],
                  [r"^stops survived +4 ", r"^final weights +identical bit for bit"]),
    "onpolicy_distill_vs_trl": (["--smoke"],
                                [rf"^package +{NUMBER} s/step after 2 warm-up steps \(median\), loss {NUMBER}",
                                 rf"^trl(: skipped \(trl is not installed| +{NUMBER} s/step)"]),
    "qlora_memory": (["--smoke"], [rf"^bf16 +no +{NUMBER} +{NUMBER} +{NUMBER}$", rf"^nf4 +no +{NUMBER} +{NUMBER} +{NUMBER}$",
                                   rf"^nf4 / bf16 step time = {NUMBER}$"]),
    "loop_overhead": (["--device", "cpu", "--steps", "10", "--repeats", "1"], [rf"median ratio {NUMBER}"]),
    # On the CPU: on XLA each runner compiles in a process pinned to one core (minutes on a busy 2-core machine); the
    # package's XLA loop runs in graph_hygiene and zero_grad (which trains loop_vs_peers' model).
    "loop_vs_peers": (["--device", "cpu", "--runs", "1", "--steps", "40"],
                      [rf"^package +\d+ +\d+ +\d+ +{NUMBER}", rf"^hand +\d+ +\d+ +\d+ +{NUMBER}"]),
    "memory_accuracy": (["--smoke"], [rf"^GPT tiny b=4 s=32 grad_accum=2 +.* {NUMBER} [KMG]i?B +{NUMBER}%$",
                                      rf"^worst traced error {NUMBER}%"]),
    "sandbox_calls": (["--smoke"], [r"^sandbox: ", *(rf"^{mode} +\d+ +{NUMBER} +{NUMBER}$" for mode in (
        "bare python -c", "cold serial", "cold concurrent", "warm serial", "warm one, pool full", "warm concurrent",
        "session serial"))]),
    "sharded_checkpoint": (["--preset", "tiny", "--saves", "1"],
                           [rf"^whole +\d+ +{NUMBER} ", rf"^sharded +\d+ +{NUMBER} "]),
    "sharding": (["--widths", "64", "--seq-len", "32", "--batch", "1", "--time-width", "64", "--time-steps", "4",
                  "--layers", "1"],
                 [r"^small ", rf"^ +64 +{NUMBER}M", rf"step time fsdp / data: {NUMBER}"]),
    "spike_margin": (["--smoke"], [rf"^lr50 +False +{NUMBER} ", rf"^lora-log1 +True +{NUMBER} "]),
    "step_host_time": (["--device", "cpu", "--runs", "1", "--steps", "40", "--replay"], [r"^forward +\d+ +\d+ +\d+ +\d+",
                                                                           r"^total +\d+ +\d+ +\d+ +\d+"]),
    "throughput": (["--steps", "10", "--batch", "4", "--seq", "32"],
                   [rf"^XLA:CPU .* steady +{NUMBER} steps/s .* compilations \d+"]),
    "tracking_overhead": (["--device", "cpu", "--steps", "10", "--log-every", "5", "--repeats", "1"],
                          [rf"^{name} +{NUMBER} +{NUMBER}" for name in ("none", "tensorboard", "wandb", "trackio")]),
    "zero_grad": (["--runs", "1", "--steps", "10"], [r"^set_to_none=True +graphs \[\d+\]",
                                                     r"^set_to_none=False +graphs \[\d+\]"]),
}

# Started first (the longest runs, slowest first, as timed side by side under make test's two xdist workers), so that
# the two workers end together rather than one finishing the alphabet's last long run alone.
SLOWEST = ("chunked_loss", "generation", "sharding", "zero_grad", "qlora_memory", "grpo_vs_trl",
           "finetune_vs_hf_trainer", "attention_impl", "distill_cache", "memory_accuracy", "loop_vs_peers",
           "finetune_memory", "sharded_checkpoint")


def _scripts() -> list[str]:
    """Every script, SLOWEST first (in its order), then A-Z."""
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    return sorted(names, key=lambda name: SLOWEST.index(name) if name in SLOWEST else len(SLOWEST))


def test_every_smoke_entry_is_a_script():
    assert not set(SMOKE) - set(_scripts()), "entries for scripts that are gone (renamed?)"
    assert not set(SLOWEST) - set(SMOKE), "SLOWEST names scripts without a smoke entry"


def _run(name: str, tmp: Path) -> tuple[subprocess.CompletedProcess, float]:
    args, _ = SMOKE[name]
    # XLA:CPU with one device unless the script sets its own; this checkout's package; W&B never online. TMPDIR: several
    # scripts leave mkdtemp directories behind (run outputs, XLA dumps), which then go with pytest's temporary tree.
    # One OpenMP thread for eager torch: two scripts run side by side on a 2-core machine, where two threads each
    # spin against each other (the tiny GPT's eager step took 0.67 s instead of a few ms).
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "TMPDIR": str(tmp), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.pop("CPU_NUM_DEVICES", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    return proc, time.perf_counter() - start


class _Now:
    """A run made when its result is asked for (the `Future` interface the tests read)."""

    def __init__(self, name: str, tmp: Path):
        self.name, self.tmp = name, tmp

    def result(self) -> tuple[subprocess.CompletedProcess, float]:
        return _run(self.name, self.tmp)


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """The selected scripts' runs. In one pytest process they start together two at a time: most of a run is one
    process importing torch or one XLA compile, each on one core, so two side by side halve the file's wall time on
    a 2-core machine. Under pytest-xdist each test is a unit of its own (tests/runner_hooks.py) that a worker runs
    when it gets it, so the workers keep the cores busy instead."""
    test = "test_benchmark_runs_at_smoke_size_and_prints_its_figures"
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == test and item.callspec.params["name"] in SMOKE]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield {name: _Now(name, tmp_path_factory.mktemp(name)) for name in names}
        return
    pool = ThreadPoolExecutor(2)
    yield {name: pool.submit(_run, name, tmp_path_factory.mktemp(name)) for name in names}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("name", _scripts())  # the session's items, and so the runs, go SLOWEST first
def test_benchmark_runs_at_smoke_size_and_prints_its_figures(name, smoke_runs):
    assert name in SMOKE, f"benchmarks/{name}.py has no smoke entry: give it tiny arguments in SMOKE"
    proc, seconds = smoke_runs[name].result()
    print(f"benchmarks/{name}.py {' '.join(SMOKE[name][0])}: {seconds:.0f} s")  # shown by pytest -s or -rP
    out = proc.stdout
    assert proc.returncode == 0, f"{name}.py exited {proc.returncode}:\n{out[-3000:]}\n{proc.stderr[-5000:]}"
    missing = [p for p in SMOKE[name][1] if not re.search(p, out, re.MULTILINE)]
    assert not missing, f"{name}.py printed no line matching {missing}:\n{out[-4000:]}"
