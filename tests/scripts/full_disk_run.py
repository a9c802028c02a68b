"""Training of the tiny GPT onto a tiny disk (a tmpfs the test mounts in a user+mount namespace), for
tests/test_disk_full.py. Prints UPPER_CASE lines the test reads.

    python tests/scripts/full_disk_run.py OUT_DIR save        # saves every step until the disk is full
    python tests/scripts/full_disk_run.py OUT_DIR keep        # keep_last=3, then a rerun with keep_last=2
    python tests/scripts/full_disk_run.py OUT_DIR fill        # a fresh out_dir on a disk with no space left
"""

from __future__ import annotations

import sys

import torch

from tpu_helpers.checkpoint import CheckpointError, CheckpointManager
from tpu_helpers.config import TrainConfig
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

out, mode = sys.argv[1], sys.argv[2]
train, val, tok = build_datasets("embedded", "byte", block_size=32, max_chars=20_000)


def trainer(keep_last: int) -> Trainer:
    cfg = TrainConfig(device="cpu", preset="tiny", steps=4, batch_size=4, seq_len=32, eval_every=100, log_every=1,
                      save_every=1, keep_last=keep_last, out_dir=out, max_chars=20_000)
    torch.manual_seed(0)
    return Trainer(GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32)), train, val, config=cfg,
                   progress=False)


if mode == "save":
    try:
        trainer(1).fit()
    except CheckpointError as err:
        print("ERROR", err)
    mgr = CheckpointManager(out + "/checkpoints")
    print("CHECKPOINTS", [(i.step, i.valid) for i in mgr.list()])
    print("LOADS", mgr.load(mgr.latest().step)["step"])
    print("FILES", sorted(p.name for p in mgr.directory.iterdir()))
    sys.exit(0)
if mode == "fill":  # a fresh out_dir on a disk with no space left at all
    try:
        with open(out.rsplit("/", 1)[0] + "/filler", "wb") as f:
            while True:
                f.write(b"x" * 65536)
    except OSError:
        pass
for keep_last in ((1,) if mode == "fill" else (3, 2)):
    try:
        print(f"KEEP{keep_last}", "steps", trainer(keep_last).fit().steps)
    except Exception as err:  # noqa: BLE001 - the error each run ends with is the result
        print(f"KEEP{keep_last}", type(err).__name__, str(err).replace(chr(10), " "))
if mode != "fill":
    print("CHECKPOINTS", [(i.step, i.valid) for i in CheckpointManager(out + "/checkpoints").list()])
