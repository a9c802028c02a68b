"""One torchrun process of an FSDP2 (or one-process data-parallel) run of the tiny GPT (tests/launch/
test_fsdp2_torchrun.py). The main process writes the result to OUT_DIR/result.json.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/fsdp2_run.py fsdp 4 OUT_DIR 4
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tpu_helpers.config import TrainConfig
from tpu_helpers.core.atomic_io import atomic_write_text
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

sharding, batch, out_dir, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cfg = TrainConfig(device="cpu", preset="tiny", seq_len=32, lr=3e-3, warmup_steps=1, steps=steps, batch_size=batch,
                  eval_every=2, eval_batches=2, log_every=1, save_every=4, max_chars=100_000, out_dir=out_dir,
                  sharding=sharding)
train, val, tok = build_datasets("embedded", "byte", block_size=32, max_chars=100_000)
torch.manual_seed(0)
model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
t = Trainer(model, train, val, config=cfg, progress=False)
report = t.fit()
b = t.backend
params = list(t.model.parameters())
result = {"val": [e["val_loss"] for e in t.history.eval], "world": b.world_size, "resumed_from": report.resumed_from,
          "specs": sorted({b.sharding_spec(p) for p in params}),
          "ratio": sum(b.device_bytes(p) for p in params) / sum(p.numel() * p.element_size() for p in params)}
if b.is_main:
    atomic_write_text(Path(out_dir) / "result.json", json.dumps(result))
