"""The files of a checkpoint directory: names, manifests, the save marker, verification and the final renames.

    ckpt-00001200.pt     a whole checkpoint (torch.save)             } data: exactly one of the two
    ckpt-00001200.dcp/   a sharded one (torch.distributed.checkpoint) }
    ckpt-00001200.json   its manifest: sha256 and size of the .pt, or of every file of the .dcp directory
    .ckpt-00001200.saving  present only between the renames of a save: data without a manifest is then an
                           interrupted save (disposable), not data whose manifest was lost (to be kept)

`CheckpointManager` decides what to write (manager.py), keep (retention.py) and load (directory.py); this module
knows how each looks on disk.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.core.atomic_io import fsync_dir, sha256_file, write_temp

FORMAT = 1
CKPT_RE = re.compile(r"^ckpt-(\d{8,})\.(pt|json|dcp)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint exists but is incomplete or damaged."""


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    valid: bool
    reason: str | None
    interrupted: bool = False  # a save of ours was cut short here (its marker exists): nothing to recover
    meta: dict | None = None  # the manifest's "meta" (epoch, the validation metrics at this step) when readable

    def metric(self, name: str) -> float | None:
        """The value of validation metric `name` recorded with this checkpoint (a finite number), else None."""
        value = ((self.meta or {}).get("metrics") or {}).get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    @property
    def unverifiable(self) -> bool:
        """Data that may be good but cannot be checked: a .pt whose manifest is missing or unreadable."""
        return (not self.valid and not self.interrupted and self.path.exists()
                and self.reason is not None and self.reason.startswith(("no manifest", "unreadable manifest")))


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Rough size of the tensors in a state, to tell the user how much space a failed save needed."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()  # views and tied weights share one storage, which is saved once
        new = storage.data_ptr() not in seen
        seen.add(storage.data_ptr())
        return storage.nbytes() if new else 0
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v, seen) for v in items)


def marker(directory: Path, step: int) -> Path:
    return directory / f".ckpt-{step:08d}.saving"


def verify(path: Path, *, deep: bool = True) -> CheckpointInfo:
    """Check checkpoint data `path` (a .pt file or a sharded .dcp directory) against its manifest; `deep=False`
    stops after reading the manifest (no size or hash)."""
    step = _step_of(path)
    missing = _missing(path, step)
    if missing is not None:
        return missing
    try:
        manifest, expected = _read_manifest(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return CheckpointInfo(path, step, False, f"unreadable manifest: {type(e).__name__}: {e}")
    reason = _manifest_mismatch(manifest, step) or (_data_mismatch(path, expected) if deep else None)
    if reason is not None:
        return CheckpointInfo(path, step, False, reason)
    meta = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else None
    return CheckpointInfo(path, step, True, None, meta=meta)


def _step_of(path: Path) -> int:
    """The step in a checkpoint's data name; ValueError for a name that is not a checkpoint's data."""
    m = CKPT_RE.match(path.name)
    if m is None or m.group(2) == "json":
        raise ValueError(f"{path} is not a checkpoint (expected a name like ckpt-00000012.pt or .dcp)")
    return int(m.group(1))


def _missing(path: Path, step: int) -> CheckpointInfo | None:
    """The invalid CheckpointInfo of a checkpoint whose data or manifest is not there, else None."""
    if not path.exists():
        return CheckpointInfo(path, step, False, "data file missing (only the manifest exists)")
    if not path.with_suffix(".json").exists():
        if marker(path.parent, step).exists():
            return CheckpointInfo(path, step, False, "no manifest: its save was interrupted", interrupted=True)
        return CheckpointInfo(path, step, False,
                              "no manifest (it was not copied, or a sync dropped it); the data cannot be verified")
    return None


def _read_manifest(path: Path) -> tuple[dict, dict[str | None, tuple[int, str]]]:
    """The manifest of checkpoint data `path` and the (size, sha256) it expects of each file: keyed by the file's
    name in a .dcp directory, by None for a .pt. Raises what a damaged manifest raises (OSError, KeyError...)."""
    manifest = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    if path.is_dir():
        expected = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in manifest["files"].items()}
    else:
        expected = {None: (int(manifest["bytes"]), str(manifest["sha256"]))}
    return manifest, expected


def _manifest_mismatch(manifest: dict, step: int) -> str | None:
    """Why a readable manifest does not describe checkpoint `step` of this format, or None."""
    if manifest.get("format") != FORMAT:
        return f"unsupported manifest format {manifest.get('format')!r}"
    if manifest.get("step") != step:
        return f"manifest says step {manifest.get('step')!r} but the file name says {step}"
    return None


def _data_mismatch(path: Path, expected: dict[str | None, tuple[int, str]]) -> str | None:
    """Why the data at `path` does not match the sizes and hashes its manifest lists (the first file that does
    not), or None."""
    for name, (expected_size, expected_sha) in expected.items():
        file = path if name is None else path / name
        where = "" if name is None else f"{name}: "
        try:  # a dying disk fails reads with EIO: that is damage to report, not a crash of the caller
            if not file.is_file():
                return f"{where}missing"
            size = file.stat().st_size
            if size < expected_size:
                return f"{where}truncated: {size} of {expected_size} bytes"
            if size != expected_size:
                return f"{where}size mismatch: {size} bytes, manifest says {expected_size}"
            if sha256_file(file) != expected_sha:
                return f"{where}checksum mismatch"
        except OSError as e:
            return f"{where}unreadable: {e}"
    return None


def commit(data_temp: Path, data: Path, manifest: dict) -> None:
    """Rename a fully written checkpoint (`data_temp`: a file or a directory) to `data` and write its manifest.

    Everything that can run out of space is done first; only renames are left. Dropping an old manifest of the
    same step first means a crash between the renames reads as "interrupted", not as rot. The marker says so on
    disk: data without a manifest and without a marker is data whose manifest was lost (copied without it,
    dropped by a sync), which discovery must not treat as disposable. The step's data in the other form (saved
    sharded before the run was resumed unsharded, or the reverse) is replaced.
    """
    manifest_path = data.with_suffix(".json")
    text = json.dumps(manifest, indent=2) + "\n"
    tmp_json, _ = write_temp(manifest_path, lambda w: w.write(text.encode()))
    try:
        mark = marker(data.parent, manifest["step"])
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT, 0o666))
        fsync_dir(data.parent)
        manifest_path.unlink(missing_ok=True)
        for form in (".pt", ".dcp"):
            remove(data.with_suffix(form))
        os.replace(data_temp, data)
        os.replace(tmp_json, manifest_path)
        fsync_dir(data.parent)
        mark.unlink(missing_ok=True)
    finally:
        tmp_json.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Delete a file or a (sharded checkpoint) directory; nothing if it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
