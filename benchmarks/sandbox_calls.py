"""Sandboxed python calls per second (agents/sandbox.py) for a trivial snippet: a worker started per call (cold)
against warm workers started ahead, one call at a time and `--concurrency` at once, a session's interpreter kept
between calls, and a bare `python -c` per call with no isolation at all, for scale.

    PYTHONPATH=. python benchmarks/sandbox_calls.py                 # 40 calls a mode
    PYTHONPATH=. python benchmarks/sandbox_calls.py --calls 200 --concurrency 4
    PYTHONPATH=. python benchmarks/sandbox_calls.py --smoke         # CI: 4 calls a mode

The snippet is `print(6 * 7)`. Each line: the mode, the calls, calls per second and milliseconds per call (wall time
over the calls). The warm pool holds `--concurrency` workers; a warm call's latency is what a rollout sees when
its calls come no faster than the pool refills, the serial rate counts the refill too. The start-up line printed
first says which isolation layers held on this machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpu_helpers.agents.sandbox import PythonSession, Sandbox  # noqa: E402

SNIPPET = "print(6 * 7)"


def timed(calls: int, fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def line(mode: str, calls: int, seconds: float) -> None:
    print(f"{mode:<22} {calls:>6} {calls / seconds:>9.1f} {1000 * seconds / calls:>9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="4 calls a mode")
    a = ap.parse_args()
    calls = 4 if a.smoke else a.calls
    cold = Sandbox(concurrency=a.concurrency, warm=0)
    print(cold.describe())
    warm = Sandbox(concurrency=a.concurrency, probe=False)
    warm.run(SNIPPET)  # starts the pool
    time.sleep(0.5)
    print(f"{'mode':<22} {'calls':>6} {'calls/s':>9} {'ms/call':>9}")
    line("bare python -c", calls, timed(calls, lambda: [subprocess.run([sys.executable, "-I", "-c", SNIPPET],
                                                                       capture_output=True) for _ in range(calls)]))
    line("cold serial", calls, timed(calls, lambda: [cold.run(SNIPPET) for _ in range(calls)]))
    line("cold concurrent", calls, timed(calls, lambda: cold.run_many([SNIPPET] * calls)))
    line("warm serial", calls, timed(calls, lambda: [warm.run(SNIPPET) for _ in range(calls)]))
    latencies = []
    for _ in range(min(calls, 10)):
        time.sleep(0.2)  # the pool refilled: the latency a call sees
        latencies.append(timed(1, lambda: warm.run(SNIPPET)))
    line("warm one, pool full", len(latencies), sum(latencies))
    line("warm concurrent", calls, timed(calls, lambda: warm.run_many([SNIPPET] * calls)))
    session = PythonSession(warm)
    assert session.python(SNIPPET) == "42"
    line("session serial", calls, timed(calls, lambda: [session.python(SNIPPET) for _ in range(calls)]))
    assert all(r == "42" for r in warm.run_many([SNIPPET] * 2))
    cold.close()
    warm.close()


if __name__ == "__main__":
    main()
