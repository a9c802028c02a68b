"""SHARDING="fsdp" under torchrun uses torch.distributed's FSDP2 (`fully_shard`): 2 CPU processes over gloo hold
half of each parameter and follow a one-process run of the same global batch; each process saves its own shards
(torch.distributed.checkpoint), and the run resumes under FSDP2 or, whole, on one process."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT, SCRIPTS


def _run(tmp_path, nproc: int, sharding: str, batch: int, name: str, steps: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", str(SCRIPTS / "fsdp2_run.py"),
           sharding, str(batch), str(tmp_path / name), str(steps)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / name / "result.json").read_text())


def test_fsdp2_on_two_processes_matches_one_process_and_resumes(tmp_path):
    two = _run(tmp_path, 2, "fsdp", 4, "fsdp2", 4)
    one = _run(tmp_path, 1, "data", 8, "one", 4)
    assert two["world"] == 2 and one["world"] == 1
    assert all("Shard(dim=0)" in s for s in two["specs"]), two["specs"]  # every parameter is a sharded DTensor
    assert 0.49 < two["ratio"] <= 0.52, two["ratio"]  # each process holds half of the model
    assert one["specs"] == [""]
    v2, v1 = two["val"], one["val"]
    print(f"FSDP2 x2 vs 1 process, validation losses: {v2} vs {v1}")
    assert len(v2) == len(v1) == 3 and max(abs(a - b) for a, b in zip(v2, v1, strict=True)) < 1e-5
    assert v2[-1] < v2[0]
    # The checkpoint is sharded (torch.distributed.checkpoint): each process wrote its own half of every tensor,
    # nothing gathered; read whole it is the plain format and loads into an unwrapped GPT.
    from torch.distributed.checkpoint import FileSystemReader

    from tpu_helpers.checkpoint import CheckpointManager
    from tpu_helpers.models.gpt import GPT, gpt_config

    folder = tmp_path / "fsdp2" / "checkpoints" / "ckpt-00000004.dcp"
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    items = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert all(len(v.chunks) == 2 for k, v in items.items() if k.startswith("model.") and v.size[0] % 2 == 0)
    step, state = CheckpointManager(folder.parent).load_latest()
    assert step == 4 and state["sharded"].writer == "fsdp2"
    whole = state["sharded"].read_whole()
    GPT(gpt_config("tiny", vocab_size=256, block_size=32)).load_state_dict(whole["model"])
    assert sorted(whole["optimizer"]["state"]) == list(range(len(whole["optimizer"]["state"])))
    # Resumed to step 6 under FSDP2 on 2 processes, and (a copy) under data parallel on 1: the same run goes on.
    import shutil

    shutil.copytree(tmp_path / "fsdp2", tmp_path / "cross")
    resumed = _run(tmp_path, 2, "fsdp", 4, "fsdp2", 6)
    cross = _run(tmp_path, 1, "data", 8, "cross", 6)
    assert resumed["resumed_from"] == cross["resumed_from"] == 4 and len(resumed["val"]) == len(cross["val"]) == 4
    print(f"resumed to step 6: FSDP2 x2 {resumed['val']}, data x1 {cross['val']}")
    assert abs(resumed["val"][-1] - cross["val"][-1]) < 1e-5 and resumed["val"][-1] < v2[-1]
