"""Crash-safe training checkpoints: a run killed at any moment never damages one, and a rerun resumes.

Every file is written to a temp file beside it, fsynced and renamed over the final name, so a reader sees the old
file or the new one, never half of one. Each ``ckpt-00001200.pt`` gets a ``ckpt-00001200.json`` manifest (sha256
and size) renamed into place last: a checkpoint counts only when its manifest exists and matches.

    mgr = CheckpointManager("runs/exp1/ckpt", keep_last=3, is_main=(rank == 0), best_metric="val_loss")
    resumed = mgr.load_latest()          # None on a fresh run; warns about and skips damaged checkpoints
    mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, meta={"metrics": {"val_loss": 0.31}})

This module writes (`save`, `save_sharded` for DCP directories, run.json); reading is `directory.py`, what is kept
`retention.py`, the files on disk `layout.py`, the temp file, fsync and rename `tpu_helpers.core.atomic_io`. The trainer
moves tensors to the CPU first: no torch_xla here.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.checkpoint import dcp, layout
from tpu_helpers.checkpoint.directory import _stamps
from tpu_helpers.checkpoint.layout import CheckpointCorrupt, CheckpointError, CheckpointInfo
from tpu_helpers.checkpoint.retention import CheckpointRetention
from tpu_helpers.core.atomic_io import DISK_FULL, atomic_write_text, write_temp

__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointManager"]


class CheckpointManager(CheckpointRetention):
    """Saves, verifies, prunes and loads ``ckpt-{step:08d}.pt`` checkpoints in one directory.

    Every process may read; only the one with ``is_main=True`` writes or deletes, so all ranks of a
    multi-process run can share the code path without racing on the files. With ``best_metric`` (a validation
    metric recorded under ``meta["metrics"]``, e.g. ``"val_loss"``; ``"max:NAME"`` when higher is better) the
    valid checkpoint with the best value is kept whatever ``keep_last`` says, and ``best()`` returns it.
    """

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

        `write(directory)` writes the tensors there (`dcp.write`: the model's and optimizer's sharded state
        dicts through DCP) and returns the names of tensors holding nan/inf, agreed by all processes; `state`
        (step, RNG, history...: small) is pickled by the main process. Everything goes into a hidden temp
        directory, is hashed into the manifest and renamed into place, so an interrupted save leaves the earlier
        checkpoints as they were. Returns the directory, or the nan/inf names (then nothing is kept). `size`: the
        tensors' bytes, to make room on a full disk; `gather(value)` collects a value from every process (the
        backend's `gather_objects`): the processes wait for each other between the phases and agree on failures,
        so a save that fails on one host fails on all of them instead of leaving the others waiting.
        """
        _check_step(step)
        path = self.directory / f"ckpt-{step:08d}{dcp.SUFFIX}"
        temp = self.directory / f".ckpt-{step:08d}{dcp.SUFFIX}.tmp"
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
                files = dcp.finish(temp, state, writer)
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
