"""How the suite runs (tests/runner_hooks.py): a test that hangs fails naming itself, also under pytest-xdist where
the run goes on without it; whole files are xdist's units of work except the benchmark smoke runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.runner_hooks import split_scope
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
