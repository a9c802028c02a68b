"""One process of a 2-process torchrun (tests/launch/test_processes_agree.py): the processes must agree on which
checkpoint to resume and on whether a save worked. Writes its findings to <DIR>/result-<rank>.json (not stdout:
two processes' lines can interleave on torchrun's pipe).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/scripts/processes_agree.py DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import TrainConfig
from tpu_helpers.core.atomic_io import atomic_write_text
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

base, rank = Path(sys.argv[1]), int(os.environ["RANK"])
train, _, tok = build_datasets("embedded", "byte", block_size=32, max_chars=50_000)


def fit(out_dir: Path, sharding: str = "data", steps: int = 2) -> str:
    cfg = TrainConfig(device="cpu", preset="tiny", seq_len=32, steps=steps, batch_size=2, eval_every=1000,
                      log_every=1, save_every=1000, max_chars=50_000, out_dir=str(out_dir), sharding=sharding)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    try:
        Trainer(model, train, None, config=cfg, progress=False).fit()
        return "ok"
    except Exception as e:  # noqa: BLE001 - what each process saw is the result
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
atomic_write_text(base / f"result-{rank}.json", json.dumps(out))
