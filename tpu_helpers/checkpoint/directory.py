"""The checkpoints in one directory as a reader sees them: which exist, which verify, the newest, the best, and
loading one.

`CheckpointDirectory` holds the settings of a checkpoint directory and reads it; `retention.CheckpointRetention`
adds what to keep and delete, and `manager.CheckpointManager` (the class to use) adds the writing:

    mgr = CheckpointManager("runs/exp1/ckpt", best_metric="val_loss")
    mgr.latest()           # CheckpointInfo of the newest valid checkpoint, or None
    mgr.best()             # the valid one with the best val_loss in its manifest, or None
    step, state = mgr.load_latest()   # skips (and warns about) damaged ones

Every check of a checkpoint against its manifest is `layout.verify`. Loading uses ``torch.load(weights_only=False)``
because states hold optimizer and RNG objects that the safe loader refuses: only load checkpoints you wrote.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.checkpoint import dcp, layout
from tpu_helpers.checkpoint.layout import CheckpointCorrupt, CheckpointInfo
from tpu_helpers.core.choices import best_metric_order

__all__ = ["CheckpointDirectory"]


class CheckpointDirectory:
    """Finds, verifies and loads the ``ckpt-{step:08d}.pt`` (or ``.dcp/``) checkpoints of one directory.

    Every process may read; only the one with ``is_main=True`` writes or deletes (in the subclasses), so all ranks
    of a multi-process run can share the code path without racing on the files.
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, *, is_main: bool = True,
                 best_metric: str | None = None) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1 (something to resume from), got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.is_main = is_main
        self.best_metric = best_metric
        # (metric name, higher is better) of best_metric
        self.best_order = best_metric_order(best_metric) if best_metric is not None else None
        # step -> (data, manifest) size and time stamps of checkpoints known good: hashed once, or just written
        self._trusted: dict[int, tuple] = {}
        self.run_info_path = self.directory / "run.json"

    def path_for(self, step: int) -> Path:
        """The data of checkpoint `step`: its sharded directory when there is one, else its .pt file."""
        path = self.directory / f"ckpt-{step:08d}.pt"
        folder = path.with_suffix(dcp.SUFFIX)
        return folder if folder.is_dir() else path

    def _steps(self) -> set[int]:
        if not self.directory.is_dir():
            return set()
        return {int(m.group(1)) for p in self.directory.iterdir() if (m := layout.CKPT_RE.match(p.name))}

    def list(self) -> list[CheckpointInfo]:
        """All checkpoints (complete or not) sorted by step, each verified against its manifest."""
        return [layout.verify(self.path_for(s)) for s in sorted(self._steps())]

    def latest(self) -> CheckpointInfo | None:
        """The newest valid checkpoint, or None."""
        for step in sorted(self._steps(), reverse=True):
            info = layout.verify(self.path_for(step))
            if info.valid:
                return info
        return None

    def best(self) -> CheckpointInfo | None:
        """The valid checkpoint with the best `best_metric` value in its manifest (the earliest of equal ones), or
        None (no best_metric, or no checkpoint recorded it). Its data is hashed once per manager (not at all when
        this manager wrote it), then trusted while its files keep their size and time stamps."""
        if self.best_order is None:
            return None
        name, higher = self.best_order
        found = [(info.metric(name), info.step, info) for info in
                 (layout.verify(self.path_for(s), deep=False) for s in self._steps())]
        ranked = sorted(((-v if higher else v, step, info) for v, step, info in found if v is not None and info.valid),
                        key=lambda x: x[:2])
        for _, step, info in ranked:
            stamps = _stamps(info.path)
            if self._trusted.get(step) == stamps:
                return info
            deep = layout.verify(info.path)
            if deep.valid:
                self._trusted[step] = stamps
                return deep
        return None

    def unverifiable(self, any_valid: bool | None = None) -> list[CheckpointInfo]:
        """Checkpoints holding data that must not be overwritten or pruned silently by a run starting over.

        A .pt whose manifest is missing or unreadable (not from an interrupted save: copied without its manifest,
        dropped by a sync), and, when no checkpoint is valid at all, every damaged one as well. Pass `any_valid`
        (whether `latest()` found one) to spare hashing the files again.
        """
        if any_valid is None:
            any_valid = self.latest() is not None
        shallow = [layout.verify(self.path_for(s), deep=False) for s in sorted(self._steps())]
        if any_valid:
            return [i for i in shallow if i.unverifiable]
        # None is valid, so hashing them all costs nothing that resuming would not have spent.
        return [i for i in (layout.verify(i.path) for i in shallow) if not i.valid and not i.interrupted
                and i.path.exists()]

    def _torch_load(self, path: Path, map_location: Any, mmap: bool = False) -> dict:
        if path.is_dir():  # sharded: the small state now, the tensors when the trainer asks (state["sharded"])
            return dcp.read_state(path)
        # weights_only=False: optimizer and RNG states are arbitrary objects; these are our own trusted files.
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)

    def load(self, step_or_path: int | str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> dict:
        """Verify then load one checkpoint; raises CheckpointCorrupt naming the file and what is wrong. `mmap`:
        the tensors of a .pt stay in the file until used (reading the model of a checkpoint that also holds the
        optimizer's state)."""
        path = self.path_for(step_or_path) if isinstance(step_or_path, int) else Path(step_or_path)
        if not path.exists() and not path.with_suffix(".json").exists():
            raise FileNotFoundError(f"no checkpoint {path}")
        info = layout.verify(path)
        if not info.valid:
            raise CheckpointCorrupt(f"checkpoint {path} is damaged: {info.reason}")
        try:
            return self._torch_load(path, map_location, mmap)
        except Exception as e:
            raise CheckpointCorrupt(
                f"checkpoint {path} matches its manifest but torch.load failed: {e}"
            ) from e

    def load_latest(self, map_location: Any = "cpu") -> tuple[int, dict] | None:
        """(step, state) of the newest checkpoint that verifies and loads, or None if there is none.

        Each newer damaged checkpoint is reported with a warning and skipped, so a run killed mid-save
        resumes from the one before.
        """
        damaged = 0
        for step in sorted(self._steps(), reverse=True):
            info = layout.verify(self.path_for(step))
            if info.valid:
                try:
                    return step, self._torch_load(info.path, map_location)
                except Exception as e:
                    info.reason = f"torch.load failed: {type(e).__name__}: {e}"
            damaged += 1
            msg = (
                f"checkpoint {info.path} is damaged ({info.reason}); falling back to the previous checkpoint"
            )
            warnings.warn(msg, stacklevel=2)
        if damaged:
            warnings.warn(f"no valid checkpoint in {self.directory} ({damaged} damaged)", stacklevel=2)
        return None


def _stamps(path: Path) -> tuple:
    """Size and modification time of a checkpoint's data and manifest (None for a file that is not there)."""
    out = []
    for p in (path, path.with_suffix(".json")):
        try:
            st = p.stat()
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)
