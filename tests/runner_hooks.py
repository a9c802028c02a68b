"""How the suite runs: a hung test fails by name, and pytest-xdist's units of work go out longest first.

Loaded by tests/conftest.py (`pytest_plugins`); `pytest -p tests.runner_hooks` loads it elsewhere.

- Timeouts (pytest-timeout; `timeout` and `timeout_method` in pyproject.toml): the thread method, since a test stuck
  in torch's or XLA's C++ never returns to the interpreter for a signal's handler. That method ends the process
  with thread stacks and no test name, so the timer here writes the test's node id first. Under xdist the
  controller then reports the crashed worker's test by name too, and the run goes on with a new worker.
- Units (`-n 2 --dist loadfile` in the Makefile): a test file goes to one worker, so a module's fixtures (models
  built, graphs compiled) are made once. Each benchmark smoke run and each test of tests/real and tests/stacks is a
  unit of its own instead (a process or a job of minutes that shares nothing with its neighbours), except tests
  there that share a module-scoped fixture of their file (SHARED): those stay one unit, so it is built once.
- Order: units go out longest first by UNIT_SECONDS, then the other one-test units, then the files in collection
  order, rather than xdist's order by test count, so that no long unit starts while the other worker is finishing
  (a worker always holds the next unit as well as the running one: xdist's prefetch).
"""

from __future__ import annotations

import sys
import threading

import pytest

# Tests whose every case is a unit of its own under xdist (test_benchmarks' module fixture `smoke_runs` makes
# nothing there), and folders whose every test is, except tests that share a module fixture (see above).
PER_TEST = ("tests/test_benchmarks.py::test_benchmark_runs_at_smoke_size_and_prints_its_figures",)
PER_TEST_FOLDERS = ("tests/real/", "tests/stacks/")
# Folders whose tests run for minutes on 2 cores, past pyproject.toml's per-test limit under load: the real model's
# jobs, and the stack tests (venvs built over a stack's, notebooks or a whole test selection run in them).
LONG_RUNS = {"tests/real/": 1800, "tests/stacks/": 1800}
_BENCH = "tests/test_benchmarks.py::test_benchmark_runs_at_smoke_size_and_prints_its_figures"
_REAL = "tests/real/test_real_model.py"
_RM = "tests/real/test_reward_model.py"
# Tests of PER_TEST_FOLDERS that share a module-scoped fixture of their file ("file::test": fixture): one unit per
# fixture, so that it is built once. Under xdist a test that shares one and is not listed fails, saying so
# (pytest 9's node ids cannot carry a group, as xdist's loadgroup would write it, so the list is by name).
SHARED = {
    f"{_REAL}::test_lora_sft_teaches_the_real_model_the_held_out_task": "lora_sft_run",
    f"{_REAL}::test_on_policy_distillation_from_a_fine_tuned_teacher_raises_the_students_held_out_exact_match":
        "lora_sft_run",
    f"{_REAL}::test_qat_int4_costs_the_real_model_loss_and_a_recovery_lora_wins_it_back": "unquantized_lora",
    f"{_REAL}::test_qlora_on_an_nf4_base_ends_close_to_lora_on_the_full_precision_one": "unquantized_lora",
    f"{_RM}::test_the_reward_model_reaches_08_held_out_pair_accuracy": "reward_model",
    f"{_RM}::test_grpo_with_the_reward_model_raises_its_score_and_the_rule_reward": "reward_model",
}
# Seconds of the longest units on this 2-core machine under CI's load (each run's --durations; a file's figure is
# the sum of its slow tests): the order units go out in. Rough is enough: a unit missing here goes out after these.
# tests/test_runner_hooks.py checks that each names a test that exists.
UNIT_SECONDS = {
    # make test, tests/training apart
    "tests/models/test_generation.py": 120,
    # Out after the first benchmarks: its 8-device job (1.6 cores) beside test_generation's 150k-vocabulary sampling
    # (one thread, memory-bound) made that test 3x slower.
    "tests/algorithms/test_grpo_episodes.py": 50,
    "tests/algorithms/test_onpolicy_distill.py": 70,  # its strict XLA run 34 s of CPU, the CPU runs about as much
    f"{_BENCH}[chunked_loss]": 54,
    f"{_BENCH}[generation]": 44,
    "tests/models/test_generation_replay.py": 43,
    "tests/models/test_generation_loop.py": 40,
    "tests/notebooks/test_grpo_notebook.py": 40,
    f"{_BENCH}[dpo_vs_trl]": 48,  # DPO, KTO and SimPO beside TRL: 48 s CPU, 113 s wall at load 9
    f"{_BENCH}[grpo_vs_trl]": 38,
    f"{_BENCH}[sharding]": 37,
    f"{_BENCH}[distill_cache]": 36,
    f"{_BENCH}[qlora_memory]": 36,
    f"{_BENCH}[zero_grad]": 35,
    f"{_BENCH}[attention_impl]": 32,
    "tests/notebooks/test_target_notebooks.py": 30,
    "tests/notebooks/test_finetune_notebook.py": 29,
    f"{_BENCH}[memory_accuracy]": 29,
    # tests/training
    "tests/training/test_sharding.py": 155,
    "tests/training/test_replay_steps.py": 144,
    "tests/training/test_eval_tasks.py": 75,
    "tests/training/test_finetune_sharding.py": 47,
    "tests/training/test_finetune_spmd.py": 34,
    "tests/training/test_tracking.py": 30,
    # make test-real and make test-stacks (make test-long: both in one run)
    f"{_RM}@reward_model": 350,  # the reward model (207 s of one core), then GRPO rewarded by it (140 s)
    # the agents' proofs, beside another real test (2026-12-03): each SFT step of 8 rows of 300+ tokens 88 s
    f"{_REAL}::test_agent_grpo_teaches_the_real_model_to_use_the_feedback_across_turns": 1643,  # long: make test-long
    f"{_REAL}::test_agent_grpo_teaches_the_real_model_to_multiply_with_the_sandboxed_python_tool": 857,  # long
    f"{_REAL}::test_agent_grpo_raises_the_real_models_held_out_tool_use": 600,  # long
    # seconds of one thread on a quiet machine: the 20 SFT steps with their samples, then 16 distillation steps
    f"{_REAL}@lora_sft_run": 230,  # the SFT test and on-policy distillation from its run, sharing it
    # Measured at a load average of about 9 on 2 cores (other jobs running): about a third of that on a quiet core.
    "tests/real/test_eval_tasks.py::test_eval_tasks_scores_the_real_model_on_sums_before_and_after_fine_tuning": 396,
    "tests/stacks/test_latest_torch.py::test_the_cpu_suite_passes_on_the_newest_torch": 186,
    "tests/real/test_gguf_export.py::test_the_real_models_f16_gguf_answers_with_the_merged_exports_greedy_tokens": 207,
    f"{_REAL}::test_grpo_raises_the_real_models_held_out_reward": 168,
    f"{_REAL}@unquantized_lora": 140,  # QAT's and QLoRA's tests, which share the unquantized run
    "tests/stacks/test_profiles.py::test_v5e8_notebook_with_fsdp_on_eight_simulated_devices[kaggle]": 79,
    "tests/stacks/test_colab_runtime.py::test_finetune_notebook_setup_cell_on_the_runtime_as_shipped": 61,
    "tests/stacks/test_extras.py::test_hf_extra_brings_what_the_finetune_notebook_needs": 59,
    "tests/stacks/test_profiles.py::test_finetune_notebook_with_lora_on_xla_cpu": 53,
    f"{_REAL}::test_distillation_from_the_real_models_cache_teaches_a_smaller_student": 50,
    # Measured as CPU seconds (one thread each) beside a load of 10, where their wall was 604 s and 848 s.
    "tests/real/test_preference_real.py::test_kto_and_simpo_raise_the_real_models_held_out_log_prob_margin[kto]": 158,
    "tests/real/test_preference_real.py::test_kto_and_simpo_raise_the_real_models_held_out_log_prob_margin[simpo]": 130,
    "tests/stacks/test_profiles.py::test_v5e8_notebook_with_fsdp_on_eight_simulated_devices[colab]": 47,
    "tests/stacks/test_profiles.py::test_xla_cpu_training_with_strict_checks[kaggle]": 38,
}


def timeout_message(nodeid: str, seconds: float) -> str:
    return f"\nTIMEOUT: {nodeid} ran past its {seconds:g} s limit (pytest-timeout; see pyproject.toml)\n"


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a venv without pytest-timeout still runs the tests
def pytest_timeout_set_timer(item, settings):
    if settings.method != "thread":
        return None  # pytest-timeout's own signal timer raises inside the test, whose report names it
    import pytest_timeout

    def expire():
        sys.stderr.write(timeout_message(item.nodeid, settings.timeout))
        sys.stderr.flush()
        pytest_timeout.timeout_timer(item, settings)  # stacks, then the process exits

    timer = threading.Timer(settings.timeout, expire)
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel():
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # what pytest-timeout's own cancel hook calls
    timer.start()
    return True


def _per_test(nodeid: str) -> bool:
    return _test(nodeid) in PER_TEST or nodeid.startswith(PER_TEST_FOLDERS)


def _test(nodeid: str) -> str:
    """file::function, without parameters."""
    return nodeid.split("[", 1)[0]


def shared_fixture(item) -> str | None:
    """The first (by name) module-, class- or package-scoped fixture defined in the test's own file that it uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    file = item.nodeid.split("::", 1)[0]
    for name in sorted(info.names_closure):
        defs = info.name2fixturedefs.get(name) or ()
        if defs and defs[-1].scope in ("class", "module", "package") and defs[-1].baseid.split("::", 1)[0] == file:
            return name
    return None


UNLISTED = pytest.StashKey[str]()


def check_shared(items) -> None:
    """Fail, at setup, the tests of a per-test folder that share a module fixture SHARED does not list (on two
    workers it would be built twice), saying so."""
    users: dict[tuple[str, str], list] = {}
    for item in items:
        if item.nodeid.startswith(PER_TEST_FOLDERS) and (name := shared_fixture(item)):
            users.setdefault((item.nodeid.split("::", 1)[0], name), []).append(item)
    for (_, name), group in users.items():
        for item in group:
            if len(group) > 1 and SHARED.get(_test(item.nodeid)) != name:
                item.stash[UNLISTED] = (f"{item.nodeid} shares the module fixture {name!r} with "
                                        f"{[other.name for other in group if other is not item]}: list them in "
                                        "tests/runner_hooks.py's SHARED, or each worker builds it anew")


def pytest_runtest_setup(item):
    if (why := item.stash.get(UNLISTED, None)) is not None:
        pytest.fail(why, pytrace=False)


def split_scope(nodeid: str) -> str:
    """The work unit a test belongs to: its file; itself for the per-test tests; `file@fixture` for those of them
    in SHARED."""
    if not _per_test(nodeid):
        return nodeid.split("::", 1)[0]
    if (name := SHARED.get(_test(nodeid))) is not None:
        return f"{nodeid.split('::', 1)[0]}@{name}"
    return nodeid


def unit_order(units: list[str]) -> list[str]:
    """Units in the order they go out: UNIT_SECONDS's longest first, then the other one-test units, then the rest,
    each group in the order given."""
    def key(unit: str) -> tuple[float, int]:
        return -UNIT_SECONDS.get(unit, 0), 0 if _per_test(unit) else 1

    return sorted(dict.fromkeys(units), key=key)


def pytest_collection_modifyitems(config, items):
    for item in items:
        limit = next((s for folder, s in LONG_RUNS.items() if item.nodeid.startswith(folder)), None)
        if limit is not None:
            item.add_marker(pytest.mark.timeout(limit))
    if not hasattr(config, "workerinput"):  # not an xdist worker: ids and order as collected
        return
    check_shared(items)
    # A worker's collection is the order the units go out in (the controller queues them by first appearance).
    rank = {unit: i for i, unit in enumerate(unit_order([split_scope(item.nodeid) for item in items]))}
    items.sort(key=lambda item: rank[split_scope(item.nodeid)])  # stable: a unit's tests keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # the workers' collection order (above), not the units' test counts

    class Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return split_scope(nodeid)

    return Units(config, log)
