"""Which checkpoints a directory keeps: pruning beyond ``keep_last``, making room on a full disk, setting all aside.

`CheckpointRetention` adds the deletions to `directory.CheckpointDirectory`; `manager.CheckpointManager` (the class
to use) prunes after every save and makes room before one when the disk is short:

    mgr = CheckpointManager("runs/exp1/ckpt", keep_last=3, best_metric="val_loss")
    mgr.prune()           # keep the 3 newest valid checkpoints and the best one
    mgr.set_aside()       # move everything into set-aside-<UTC time>/ (a run starting over; nothing is deleted)

The rules: damaged checkpoints newer than the newest valid one stay for inspection, older ones go; the best
checkpoint by ``best_metric`` stays whatever ``keep_last`` says; only the main process deletes.
"""

from __future__ import annotations

import os
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

from tpu_helpers.checkpoint import layout
from tpu_helpers.checkpoint.directory import CheckpointDirectory
from tpu_helpers.core.atomic_io import fsync_dir

__all__ = ["CheckpointRetention"]


class CheckpointRetention(CheckpointDirectory):
    """Prunes the checkpoints of one directory to ``keep_last`` (and the best one), and sets them all aside."""

    def prune(self) -> None:
        """Delete checkpoints beyond ``keep_last`` (also done after every save)."""
        self._prune(just_written=None, temps_before=None)

    def _prune(self, just_written: int | None, temps_before: float | None) -> None:
        if not self.is_main:
            return
        # Anchor on the checkpoint just written (known good) or else the newest valid one. Damaged ones newer
        # than the anchor are left for inspection; older damaged ones can never be resumed from.
        anchor = just_written
        kept = 0
        best = self.best()
        for step in sorted(self._steps(), reverse=True):
            if step == just_written:
                kept += 1
                continue
            if best is not None and step == best.step:
                continue  # the best checkpoint stays, whatever keep_last says
            if anchor is not None and step < anchor and kept >= self.keep_last:
                self._delete(step)  # beyond the quota either way: no need to hash it
                continue
            valid = layout.verify(self.path_for(step)).valid
            if anchor is None and valid:
                anchor = step
            if anchor is None or step > anchor:
                continue
            if valid and kept < self.keep_last:
                kept += 1
            else:
                self._delete(step)
        self._remove_leftovers(temps_before)

    def _remove_leftovers(self, temps_before: float | None) -> None:
        """Save markers whose checkpoint is gone, and (given `temps_before`) temp files older than that time."""
        steps = self._steps()
        for marker in self.directory.glob(".ckpt-*.saving"):
            m = re.match(r"^\.ckpt-(\d{8,})\.saving$", marker.name)
            if m and int(m.group(1)) not in steps:  # its checkpoint was pruned or never renamed into place
                marker.unlink(missing_ok=True)
        if temps_before is None:
            return
        # Leftovers of writes killed before they could clean up (a live save's temps are newer than ours).
        for tmp in [*self.directory.glob(".ckpt-*.tmp"), *self.directory.glob(".run.json.*.tmp")]:
            try:
                if tmp.stat().st_mtime < temps_before:
                    layout.remove(tmp)
            except OSError:
                pass

    def _make_room(self, step: int, size: int) -> None:
        """Prune before writing when the disk cannot hold one more checkpoint (pruning normally follows a save).

        Keeps the newest `keep_last - 1` valid checkpoints (at least one): the new one completes the quota. With
        keep_last=1 the only good checkpoint must survive until its successor is complete, so nothing goes.
        """
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return
        existing = [self.path_for(s) for s in sorted(self._steps(), reverse=True)]
        newest = next((p for p in existing if p.exists()), None)  # its size, unverified: hashing costs seconds
        needed = layout.size(newest) if newest is not None else size
        if free >= needed * 1.1 + (1 << 20):
            return
        keep = max(1, self.keep_last - 1)
        best = self.best()
        valid = [i.step for i in self.list() if i.valid and i.step < step and (best is None or i.step != best.step)]
        for old in sorted(valid, reverse=True)[keep:]:
            self._delete(old)

    def _delete(self, step: int) -> None:
        path = self.path_for(step)
        # Data first: a kill in between leaves a lone manifest, which reads as "data file missing" and is cleaned
        # up later. The other order would leave a .pt without a manifest and without a save marker, which
        # discovery must treat as data it cannot verify (a lost manifest) and refuse to start over.
        layout.remove(path)
        path.with_suffix(".json").unlink(missing_ok=True)

    def set_aside(self) -> Path | None:
        """Move all checkpoints, manifests, save markers and run.json into `<directory>/set-aside-<UTC time>/`.

        Nothing is deleted; returns the new folder (None when there was nothing to move).
        """
        if not self.is_main or not self.directory.is_dir():
            return None
        names = [p for p in self.directory.iterdir() if layout.CKPT_RE.match(p.name) or p.name == self.run_info_path.name
                 or (p.name.startswith(".ckpt-") and p.name.endswith(".saving"))]
        if not names:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        target = self.directory / f"set-aside-{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"set-aside-{stamp}-{n}"
        target.mkdir()
        for p in names:
            os.replace(p, target / p.name)
        fsync_dir(self.directory)
        return target
