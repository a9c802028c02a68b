"""How the suite runs: a hung test fails by name, and pytest-xdist keeps each test file on one worker.

Loaded by tests/conftest.py (`pytest_plugins`); `pytest -p tests.runner_hooks` loads it elsewhere.

- Timeouts (pytest-timeout; `timeout` and `timeout_method` in pyproject.toml): the thread method, since a test stuck
  in torch's or XLA's C++ never returns to the interpreter for a signal's handler. That method ends the process
  with thread stacks and no test name, so the timer here writes the test's node id first. Under xdist the
  controller then reports the crashed worker's test by name too, and the run goes on with a new worker.
- Scheduling (`make test`'s `-n 2 --dist loadfile`): whole files go to a worker, so a module's fixtures (models
  built, graphs compiled) are made once. The benchmark smoke runs are the exception: each script is a process of
  its own, so each of those tests is a unit, and the two workers share them. The units go out in collection order
  with those runs first (the longest units, so that the workers end together on the short files at the end),
  rather than xdist's order by test count, which sent the one-test units last.
"""

from __future__ import annotations

import sys
import threading

import pytest

# Tests whose every case is a unit of its own under xdist (see above).
PER_TEST = ("tests/test_benchmarks.py::test_benchmark_runs_at_smoke_size_and_prints_its_figures",)
# Folders whose tests run for minutes on 2 cores, past pyproject.toml's per-test limit under load: the real model's
# jobs, and the stack tests (venvs built over a stack's, notebooks or a whole test selection run in them).
LONG_RUNS = {"tests/real/": 1800, "tests/stacks/": 1800}


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
    return nodeid.split("[", 1)[0] in PER_TEST


def pytest_collection_modifyitems(config, items):
    for item in items:
        limit = next((s for folder, s in LONG_RUNS.items() if item.nodeid.startswith(folder)), None)
        if limit is not None:
            item.add_marker(pytest.mark.timeout(limit))
    if hasattr(config, "workerinput"):  # an xdist worker: its collection is the order the units go out in
        items.sort(key=lambda item: not _per_test(item.nodeid))  # stable: each group keeps its order


def split_scope(nodeid: str) -> str:
    """The work unit a test belongs to: its file, or itself for the tests in PER_TEST."""
    if _per_test(nodeid):
        return nodeid
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # collection order (above), not the units' test counts

    class FilesAndBenchmarks(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return split_scope(nodeid)

    return FilesAndBenchmarks(config, log)
