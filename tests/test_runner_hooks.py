"""How the suite runs (tests/runner_hooks.py): a test that hangs fails naming itself, also under pytest-xdist where
the run goes on without it; whole files are xdist's units of work except the benchmark smoke runs and the tests of
tests/real and tests/stacks (those sharing a module fixture stay together); units go out longest first."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.runner_hooks import SHARED, UNIT_SECONDS, split_scope, unit_order
from tests.support import ROOT

HANGS = '''
import time


def test_hangs():
    time.sleep(120)


def test_after_it():
    assert True
'''


def _pytest(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "test_hang.py").write_text(HANGS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.runner_hooks", "-p", "no:cacheprovider",
                           "-o", "timeout=3", "-o", "timeout_method=thread", "-q", *args, "test_hang.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    return proc, time.monotonic() - start


def test_a_hung_test_fails_with_its_name_within_its_limit(tmp_path):
    proc, seconds = _pytest(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "TIMEOUT: test_hang.py::test_hangs ran past its 3 s limit" in out, out
    assert seconds < 60, seconds  # the sleep is 120 s


def test_under_xdist_the_hung_test_fails_by_name_and_the_rest_still_run(tmp_path):
    proc, _ = _pytest(tmp_path, "-n", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "test_hang.py::test_hangs" in out and "crashed" in out, out
    assert "1 failed, 1 passed" in out, out


def test_files_are_the_units_of_work_except_each_benchmark_run():
    assert split_scope("tests/models/test_generation.py::test_x[qwen2]") == "tests/models/test_generation.py"
    assert split_scope("tests/test_checkpoint.py::TestX::test_y") == "tests/test_checkpoint.py"
    bench = "tests/test_benchmarks.py::test_benchmark_runs_at_smoke_size_and_prints_its_figures[sharding]"
    assert split_scope(bench) == bench
    assert split_scope("tests/test_benchmarks.py::test_every_smoke_entry_is_a_script") == "tests/test_benchmarks.py"


def test_each_test_of_the_job_folders_is_a_unit_except_those_sharing_a_module_fixture():
    real = "tests/real/test_real_model.py::test_grpo_raises_the_real_models_held_out_reward"
    assert split_scope(real) == real
    qat, qlora = (f"tests/real/test_real_model.py::{name}" for name in (
        "test_qat_int4_costs_the_real_model_loss_and_a_recovery_lora_wins_it_back",
        "test_qlora_on_an_nf4_base_ends_close_to_lora_on_the_full_precision_one"))
    assert split_scope(qat) == split_scope(qlora) == "tests/real/test_real_model.py@unquantized_lora"
    stack = "tests/stacks/test_profiles.py::test_doctor_names_the_platform_stack[kaggle]"
    assert split_scope(stack) == stack


def test_units_go_out_longest_first_then_one_test_units_then_files():
    bench = "tests/test_benchmarks.py::test_benchmark_runs_at_smoke_size_and_prints_its_figures"
    units = ["tests/a/test_small.py", f"{bench}[kill_soak]", "tests/models/test_generation.py",
             f"{bench}[chunked_loss]", "tests/b/test_other.py", f"{bench}[throughput]"]
    assert unit_order(units) == ["tests/models/test_generation.py", f"{bench}[chunked_loss]", f"{bench}[kill_soak]",
                                 f"{bench}[throughput]", "tests/a/test_small.py", "tests/b/test_other.py"]
    assert UNIT_SECONDS["tests/models/test_generation.py"] > UNIT_SECONDS[f"{bench}[chunked_loss]"] > 0


def test_every_unit_timed_names_a_test_that_exists():
    from tests.test_benchmarks import SMOKE

    for unit in UNIT_SECONDS:
        file, _, rest = unit.partition("::")
        file, _, fixture = file.partition("@")
        source = (ROOT / file).read_text()
        if fixture:  # file@fixture: the tests of SHARED that share it
            assert f"def {fixture}(" in source and fixture in SHARED.values(), unit
        if rest:
            assert f"def {rest.split('[', 1)[0]}(" in source, unit
        if rest.startswith("test_benchmark_runs_at_smoke_size"):
            assert rest.split("[", 1)[1].rstrip("]") in SMOKE, unit
    for test, fixture in SHARED.items():
        file, name = test.split("::")
        assert f"def {name}({fixture}," in (ROOT / file).read_text(), test


JOBS = '''
import os
import time

import pytest


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    (BUILDS / f"{os.getpid()}").write_text("built")
    return os.environ["PYTEST_XDIST_WORKER"]


def _log(name, worker):
    (RAN / name).write_text(worker)
    time.sleep(0.5)


def test_a(shared):
    _log("a", shared)


def test_b(shared):
    _log("b", shared)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_alone(n):
    _log(f"alone{n}", os.environ["PYTEST_XDIST_WORKER"])
'''


def test_under_xdist_a_job_folders_tests_spread_over_the_workers_and_a_shared_fixture_is_built_once(tmp_path):
    folder = tmp_path / "tests" / "real"
    folder.mkdir(parents=True)
    (tmp_path / "ran").mkdir()
    (tmp_path / "builds").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the rootdir: node ids start with tests/real/
    (folder / "test_jobs.py").write_text(f"from pathlib import Path\nRAN = Path({str(tmp_path / 'ran')!r})\n"
                                         f"BUILDS = Path({str(tmp_path / 'builds')!r})\n{JOBS}")
    # SHARED as it would list them; without them, the collection fails naming the tests.
    (tmp_path / "hooks.py").write_text("from tests.runner_hooks import *  # noqa\nfrom tests import runner_hooks\n"
                                       "runner_hooks.SHARED.update({f'tests/real/test_jobs.py::test_{x}': 'shared' "
                                       "for x in 'ab'})\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}

    def run(plugin):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", plugin, "-p", "no:cacheprovider", "-n", "2",
                               "--dist", "loadfile", "-q", "tests/real"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    proc = run("tests.runner_hooks")
    assert proc.returncode == 1 and "3 passed, 2 errors" in proc.stdout, proc.stdout + proc.stderr
    assert "test_a shares the module fixture 'shared' with ['test_b']: list them in" in proc.stdout, proc.stdout
    assert sorted(p.name for p in (tmp_path / "ran").iterdir()) == ["alone1", "alone2", "alone3"]
    for path in (*(tmp_path / "ran").iterdir(), *(tmp_path / "builds").iterdir()):
        path.unlink()
    proc = run("hooks")
    assert proc.returncode == 0 and "5 passed" in proc.stdout, proc.stdout + proc.stderr
    ran = {p.name: p.read_text() for p in (tmp_path / "ran").iterdir()}
    assert len(list((tmp_path / "builds").iterdir())) == 1  # the module fixture: once, on one worker
    assert ran["a"] == ran["b"] and set(ran.values()) == {"gw0", "gw1"}, ran  # one file, both workers
