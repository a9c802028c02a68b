"""Crash-safe training checkpoints: a run killed at any moment never damages one, and a rerun resumes.

Preemptible TPUs and Colab disconnects stop a process mid-write. Every file here is written to a temp file in
the same directory, fsynced and renamed over the final name, so a reader sees the old file or the new one,
never half of one. Each ``ckpt-00001200.pt`` gets a ``ckpt-00001200.json`` manifest (sha256 and size of the
``.pt``) renamed into place last: a checkpoint counts only when its manifest exists and matches.

Usage (the trainer moves tensors to the CPU first; this module never touches torch_xla)::

    mgr = CheckpointManager("runs/exp1/ckpt", keep_last=3, is_main=(rank == 0))
    resumed = mgr.load_latest()          # None on a fresh run; warns about and skips damaged checkpoints
    if resumed is not None:
        step, state = resumed
        model.load_state_dict(state["model"])
    ...
    mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, meta={"loss": 0.31})

Checkpoints are loaded with ``torch.load(weights_only=False)`` because states hold optimizer and RNG objects
that the safe loader refuses. That unpickles arbitrary objects: only load checkpoints you wrote yourself.

Best checkpoint: with ``best_metric`` (a validation metric the trainer records in each checkpoint's manifest under
``meta["metrics"]``, e.g. ``"val_loss"``; ``"max:NAME"`` when higher is better), the valid checkpoint with the best
value is kept whatever ``keep_last`` says, by pruning and by the "make room" deletions on a full disk alike, and
``best()`` returns it. The manifests are the record, so a kill at any moment leaves it right.

Sharded models are saved as torch.distributed.checkpoint directories ``ckpt-00001200.dcp/`` by `save_sharded`,
with the same manifest, renames and checks (`sharded.py`); how each looks on disk is `layout.py`. The atomic file
writing itself (temp file, fsync, rename) is `tpu_helpers.atomic_io`, which other modules use too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.atomic_io import DISK_FULL, atomic_write_text, fsync_dir, write_temp
from tpu_helpers.checkpoint import layout, sharded
from tpu_helpers.checkpoint.layout import CheckpointCorrupt, CheckpointError, CheckpointInfo
from tpu_helpers.choices import best_metric_order

__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointManager"]


class CheckpointManager:
    """Saves, verifies, prunes and loads ``ckpt-{step:08d}.pt`` checkpoints in one directory.

    Every process may read; only the one with ``is_main=True`` writes or deletes, so all ranks of a
    multi-process run can share the code path without racing on the files. With ``best_metric`` the best
    checkpoint by that metric is kept too (see the module docstring).
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
        folder = path.with_suffix(sharded.SUFFIX)
        return folder if folder.is_dir() else path

    def save(self, step: int, state: dict, meta: dict | None = None) -> Path:
        """Atomically write checkpoint ``step`` and its manifest, then prune. Raises CheckpointError."""
        _check_step(step)
        path = self.directory / f"ckpt-{step:08d}.pt"
        if not self.is_main:
            return path
        started = time.time()
        tmp_pt = None
        try:
            meta_json = json.loads(json.dumps(meta or {}))  # fail before writing gigabytes, not after
            self.directory.mkdir(parents=True, exist_ok=True)
            self._make_room(step, layout.tensor_bytes(state))
            tmp_pt, writer = write_temp(path, lambda w: torch.save(state, w))
            layout.commit(tmp_pt, path, {"format": layout.FORMAT, "step": step, "sha256": writer.sha.hexdigest(),
                                         "bytes": writer.size, "created": _now(), "meta": meta_json})
        except Exception as e:
            raise CheckpointError(self._save_failure(step, layout.tensor_bytes(state), e)) from e
        finally:
            if tmp_pt is not None:
                tmp_pt.unlink(missing_ok=True)
        self._after_save(step, path, started)
        return path

    def _after_save(self, step: int, path: Path, started: float) -> None:
        self._trusted[step] = _stamps(path)  # hashed as it was written: no need to read it again
        try:
            self._prune(just_written=step, temps_before=started)
        except OSError as e:  # the new checkpoint is safe; a failed cleanup must not look like a failed save
            warnings.warn(f"saved {path} but could not prune old checkpoints: {e}", stacklevel=2)

    def save_sharded(self, step: int, state: dict, write: Callable[[Path], list[str]], *, writer: str,
                     size: int = 0, gather: Callable[[Any], list] = lambda value: [value],
                     meta: dict | None = None) -> Path | list[str]:
        """Write checkpoint `step` of a sharded model as a DCP directory (every process of the run calls this).

        `write(directory)` writes the tensors there (`sharded.write`: the model's and optimizer's sharded state
        dicts through DCP) and returns the names of tensors holding nan/inf, agreed by all processes; `state`
        (step, RNG, history...: small) is pickled by the main process. Everything goes into a hidden temp
        directory, is hashed into the manifest and renamed into place, so an interrupted save leaves the earlier
        checkpoints as they were. Returns the directory, or the nan/inf names (then nothing is kept). `size`: the
        tensors' bytes, to make room on a full disk; `gather(value)` collects a value from every process (the
        backend's `gather_objects`): the processes wait for each other between the phases and agree on failures,
        so a save that fails on one host fails on all of them instead of leaving the others waiting.
        """
        _check_step(step)
        path = self.directory / f"ckpt-{step:08d}{sharded.SUFFIX}"
        temp = self.directory / f".ckpt-{step:08d}{sharded.SUFFIX}.tmp"
        started = time.time()
        meta_json = json.loads(json.dumps(meta or {}))  # fail before writing gigabytes, not after

        def prepare() -> None:
            if self.is_main:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._make_room(step, size)
                layout.remove(temp)
                temp.mkdir()

        def finish() -> None:
            if self.is_main and not bad:
                files = sharded.finish(temp, state, writer)
                layout.commit(temp, path, {"format": layout.FORMAT, "step": step, "kind": "dcp", "writer": writer,
                                           "files": files, "bytes": sum(f["bytes"] for f in files.values()),
                                           "created": _now(), "meta": meta_json})

        bad: list[str] = []
        try:
            agreed(prepare, gather)
            bad = write(temp)
            agreed(finish, gather)
        except Exception as e:
            raise CheckpointError(self._save_failure(step, size, e)) from e
        finally:
            if self.is_main:
                layout.remove(temp)
        if bad or not self.is_main:
            return bad
        self._after_save(step, path, started)
        return path

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

    def _save_failure(self, step: int, needed: int, exc: BaseException) -> str:
        where = f"checkpoint step {step} could not be saved to {self.directory}"
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            try:
                free = f", {shutil.disk_usage(self.directory).free:,} bytes free"
            except OSError:
                free = ""
            return (
                f"{where}: the disk is full ({exc.strerror}) while writing about {needed:,} bytes of tensors"
                f"{free}. Earlier checkpoints are untouched. Free some space"
                + (" (keep_last=1 needs room for two checkpoints while the next one is written)"
                   if self.keep_last == 1 else f", or lower keep_last (now {self.keep_last}): older checkpoints are "
                   "then deleted before a save when space is short") + "."
            )
        return f"{where}: {type(exc).__name__}: {exc}. Earlier checkpoints are untouched."

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

    def _delete(self, step: int) -> None:
        path = self.path_for(step)
        # Data first: a kill in between leaves a lone manifest, which reads as "data file missing" and is cleaned
        # up later. The other order would leave a .pt without a manifest and without a save marker, which
        # discovery must treat as data it cannot verify (a lost manifest) and refuse to start over.
        layout.remove(path)
        path.with_suffix(".json").unlink(missing_ok=True)

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

    def _torch_load(self, path: Path, map_location: Any, mmap: bool = False) -> dict:
        if path.is_dir():  # sharded: the small state now, the tensors when the trainer asks (state["sharded"])
            return sharded.read_state(path)
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

    def write_run_info(self, info: dict) -> None:
        """Store a JSON fingerprint of the run (config hash, model name...) so a rerun can check it."""
        if not self.is_main:
            return
        try:
            atomic_write_text(self.run_info_path, json.dumps(info, indent=2, sort_keys=True) + "\n")
        except OSError as e:
            full = " (the disk is full)" if e.errno in DISK_FULL else ""
            raise CheckpointError(f"could not write {self.run_info_path}{full}: {e.strerror or e}; nothing was "
                                  "trained yet: free some space or choose another out_dir") from None

    def read_run_info(self) -> dict | None:
        """The stored fingerprint, or None if none was written."""
        if not self.run_info_path.exists():
            return None
        try:
            info = json.loads(self.run_info_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise CheckpointCorrupt(f"{self.run_info_path} is not valid JSON: {e}") from e
        if not isinstance(info, dict):
            raise CheckpointCorrupt(
                f"{self.run_info_path} holds {json.dumps(info)[:60]} ({type(info).__name__}), not the JSON object "
                "a run writes there, so it cannot tell which run these checkpoints belong to; restore it, or "
                "move it away if the checkpoints are yours")
        return info


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


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def agreed(phase: Callable[[], Any], gather: Callable[[Any], list]) -> Any:
    """`phase()` run here, then every process waits for the others (`gather`: the backend's `gather_objects`) and
    learns whether it failed anywhere: then it raises everywhere (its own error, or a CheckpointError naming the
    process that failed), instead of one process raising alone while the others wait at their next collective
    for ever (a full disk on host 0 of a pod). Returns what `phase` returned."""
    error: Exception | None = None
    result = None
    try:
        result = phase()
    except Exception as e:  # noqa: BLE001 (told to the other processes, then raised)
        error = e
    failures = gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for index, failure in enumerate(failures):
        if failure:
            raise CheckpointError(f"process {index} failed: {failure}")
    return result
