"""The processes of one run (the hosts of a pod slice, torchrun's ranks) decide together what only one of them
could see: which checkpoint to resume from, and whether a save worked. Run here as 2 CPU processes over gloo under
torchrun, the same `gather_objects` path the XLA backend takes over its hosts' gloo group on a pod.

Before these checks, a host whose out_dir was its own disk started over while host 0 resumed (two different models
trained as one), and a save that failed on the main process only (a full disk) raised there while the other
processes waited at their next collective for ever."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT, SCRIPTS


def test_processes_agree_on_the_checkpoint_to_resume_and_on_a_failed_save(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(SCRIPTS / "processes_agree.py"), str(tmp_path)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    # A hang (the failure this guards against) ends at the timeout instead of blocking the suite.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # Each process writes its own file: their stdout lines can interleave on torchrun's pipe.
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-2000:]
    for r in results:
        print(r)
        assert r["first"] == "ok", r
        assert r["split"].startswith("ConfigError: the processes of this run see different checkpoints"), r
        assert "process 0: step 2, process 1: no checkpoint" in r["split"] and "storage all hosts mount" in r["split"]
    main, other = results
    for key in ("sharded_save", "whole_save"):
        assert main[key].startswith("CheckpointError") and "No space left on device" in main[key], main[key]
        assert other[key].startswith("CheckpointError") and "process 0 failed" in other[key], other[key]
