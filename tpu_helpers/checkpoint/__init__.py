"""Crash-safe checkpoints: `CheckpointManager` saves, verifies, prunes and loads them in one directory.

    from tpu_helpers.checkpoint import CheckpointManager
    mgr = CheckpointManager("runs/exp1/checkpoints", keep_last=3, is_main=(rank == 0))
    resumed = mgr.load_latest()       # (step, state) or None; damaged checkpoints are reported and skipped
    mgr.save(step, state)             # ckpt-00000012.pt + its manifest, atomically (whole, unsharded state)
    mgr.save_sharded(step, small_state, write, writer="xla-spmd")   # ckpt-00000012.dcp/ (sharded)

- `manager.py`: `CheckpointManager`, which writes checkpoints (atomically, with a manifest) and run.json;
- `directory.py`: what a directory holds and reading it (which checkpoints verify, the newest, the best, loading);
- `retention.py`: what is kept (pruning to keep_last and the best one, room on a full disk, setting all aside);
- `layout.py`: how each looks on disk (names, manifests with sha256, the save marker, verification, renames);
- `sharded.py`: the torch.distributed.checkpoint directories of sharded models, read back in place or whole.

The trainer's use of it: what a checkpoint holds is `tpu_helpers.training.checkpoint_contents`, resuming and
saving `tpu_helpers.training.run_state`.
"""

from tpu_helpers.checkpoint.dcp import ShardedCheckpoint
from tpu_helpers.checkpoint.layout import FORMAT, CheckpointCorrupt, CheckpointError, CheckpointInfo
from tpu_helpers.checkpoint.manager import CheckpointManager

__all__ = ["FORMAT", "CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointManager",
           "ShardedCheckpoint"]
