"""GRPO under torchrun data parallelism (DDP over gloo, 2 CPU processes), single-turn and on agent episodes: both
run (generation reads the DDP wrapper's module: the wrapper passes no `config` through), each process on its own
rows, and the processes end with the same trained weights, moved from the start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.algorithms.test_grpo_episodes import tool_tiny_dir  # noqa: F401 (the fixture)
from tests.support import ROOT, SCRIPTS


@pytest.mark.slow
def test_single_and_multi_turn_grpo_train_under_torchrun_ddp(tmp_path, tool_tiny_dir):  # noqa: F811
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(SCRIPTS / "grpo_ddp.py"), str(tmp_path), tool_tiny_dir]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    for job in ("single", "agent"):
        ranks = [r[job] for r in results]
        for r in ranks:
            assert r["outcome"] == "ok", r.get("trace")
            assert r["world"][1] == 2 and r["moved"] > 0, r
        assert [r["world"][0] for r in ranks] == [0, 1]
        assert ranks[0]["weights"] == ranks[1]["weights"], ranks  # the all-reduced gradients: one model
    assert all(t is not None and t >= 1 for r in results for t in r["agent"]["turns"])
