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

from tests.support import ROOT

_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import TrainConfig
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

base, rank = Path(sys.argv[1]), int(os.environ["RANK"])
train, _, tok = build_datasets("embedded", "byte", block_size=32, max_chars=50_000)

def fit(out_dir, sharding="data", steps=2):
    cfg = TrainConfig(device="cpu", preset="tiny", seq_len=32, steps=steps, batch_size=2, eval_every=1000,
                      log_every=1, save_every=1000, max_chars=50_000, out_dir=str(out_dir), sharding=sharding)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    try:
        Trainer(model, train, None, config=cfg, progress=False).fit()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"

def full_disk_on_the_main_process(manager, *args, **kwargs):
    if manager.is_main:
        raise OSError(28, "No space left on device")

out = {"rank": rank, "first": fit(base / "shared")}  # a checkpoint at step 2, written by process 0
# Process 1 reads a directory of its own, as a pod host whose out_dir is on its local disk does.
out["split"] = fit(base / ("shared" if rank == 0 else "own"), steps=4)
# Both kinds of save make room on the disk first, on the main process only: there it fails.
CheckpointManager._make_room = full_disk_on_the_main_process
out["sharded_save"] = fit(base / "fsdp", sharding="fsdp")  # every process writes its shards (DCP)
out["whole_save"] = fit(base / "data")  # process 0 writes the .pt alone
print("RESULT" + json.dumps(out), flush=True)
"""


def test_processes_agree_on_the_checkpoint_to_resume_and_on_a_failed_save(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    # A hang (the failure this guards against) ends at the timeout instead of blocking the suite.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = sorted((json.loads(ln[len("RESULT"):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT")),
                     key=lambda r: r["rank"])
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
