"""Checkpoints of sharded models as torch.distributed.checkpoint (DCP) directories: each process writes the shards
its devices hold, one tensor at a time, so no host ever holds the whole model.

A sharded checkpoint is the directory ``ckpt-00001200.dcp/``: DCP's files plus ``state.pt`` (the small state),
written by `CheckpointManager.save_sharded` into a hidden temp directory and renamed into place with its manifest.
The `ShardedCheckpoint` handle that `CheckpointManager.load` returns reads it back with `load_into(template,
planner)`, in place into tensors already sharded, or `read_whole()`, every tensor whole on the CPU. The backend
supplies the sharded state dicts and DCP planners; this module only knows DCP and files. The layout and when each
read applies: docs/guides/preemption.md.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend.torch_distributed import index_keyed

STATE_FILE = "state.pt"
SUFFIX = ".dcp"


def finite_checking(planner_cls: type) -> type:
    """A DCP save planner class that also notes each tensor holding nan/inf as its shards go by (on the CPU copy
    DCP writes anyway: no extra transfer), so a diverged model is never committed as a checkpoint."""

    class FiniteChecking(planner_cls):
        nonfinite: list[str]

        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor) and data.is_floating_point() and not bool(torch.isfinite(data).all()):
                found = getattr(self, "nonfinite", [])
                if write_item.index.fqn not in found:
                    self.nonfinite = [*found, write_item.index.fqn]
            return data

    FiniteChecking.__name__ = f"FiniteChecking{planner_cls.__name__}"
    return FiniteChecking


def write(directory: Path, tensors: dict, planner: Any) -> list[str]:
    """DCP-save `tensors` (the model's and optimizer's state dicts, sharded) into `directory`, which exists; every
    process of the run calls this. Returns the names of tensors holding nan/inf (checked while writing)."""
    import torch.distributed.checkpoint as dcp

    with _dcp_errors(directory):
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory)), planner=planner)
    bad = list(getattr(planner, "nonfinite", []))
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # all processes must agree to keep it or not
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, bad)
        bad = sorted({name for names in everyone for name in names})
    return bad


@contextlib.contextmanager
def _dcp_errors(path: Path):
    """DCP's "single process" notice silenced (intended here), and its CheckpointException (a BaseException that
    would pass every `except Exception`) turned into a ValueError naming the checkpoint and the first failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        try:
            yield
        except CheckpointException as err:
            failures = getattr(err, "failures", {}) or {}
            first = next(iter(failures.values()), err)
            first = getattr(first, "args", [first])[0] if getattr(first, "args", None) else first
            raise ValueError(f"torch.distributed.checkpoint failed on {path}: {str(first).splitlines()[0][:400]}"
                             ) from None


class ShardedCheckpoint:
    """A verified sharded checkpoint directory, read lazily: the tensors stay on disk until a loader asks."""

    def __init__(self, path: Path, writer: str) -> None:
        self.path = Path(path)
        self.writer = writer  # who wrote it: "xla-spmd" or "fsdp2" (their state dicts differ in form)

    def __repr__(self) -> str:
        return f"ShardedCheckpoint({str(self.path)!r}, writer={self.writer!r})"

    def load_into(self, template: dict, planner: Any) -> None:
        """Fill `template` ({"model": ..., "optimizer": ...} of sharded tensors, same form as saved) in place."""
        import torch.distributed.checkpoint as dcp

        with _dcp_errors(self.path):
            dcp.load(template, storage_reader=dcp.FileSystemReader(str(self.path)), planner=planner)

    def read_whole(self, parts: tuple[str, ...] = ("model", "optimizer")) -> dict:
        """{"model": ..., "optimizer": ...} with every tensor whole on the CPU, the optimizer keyed by index;
        `parts=("model",)` reads the model's alone (an export: no optimizer state on the host)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(str(self.path))
        metadata = reader.read_metadata()
        flat: dict[str, Any] = {}
        for fqn, item in metadata.state_dict_metadata.items():
            if fqn.split(".", 1)[0] not in parts:
                continue
            if isinstance(item, TensorStorageMetadata):
                flat[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
            else:
                flat[fqn] = None  # pickled objects (param groups): DCP's load_bytes puts them here
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        with _dcp_errors(self.path):
            dcp.load(flat, storage_reader=reader, planner=planner)
        mapping = {k: v for k, v in metadata.planner_data.items() if k in flat}
        nested = unflatten_state_dict(planner.state_dict, mapping)  # unpickled objects are there
        whole = {"model": nested.get("model", {})}
        if "optimizer" in parts:
            whole["optimizer"] = index_keyed(nested.get("optimizer", {}))
        return whole


def read_state(path: Path) -> dict:
    """The small, non-tensor part of a sharded checkpoint (`STATE_FILE`), with the handle to its tensors."""
    state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "sharded_by" not in state:
        raise ValueError(f"{Path(path) / STATE_FILE} is not the state file of a sharded checkpoint")
    state["sharded"] = ShardedCheckpoint(path, state.pop("sharded_by"))
    return state


def finish(directory: Path, state: dict, writer: str) -> dict[str, dict]:
    """After DCP wrote the tensors into `directory`: add the small `state` (`STATE_FILE`, noting the `writer`),
    make every file durable, and return {file name: {"bytes", "sha256"}} for the manifest."""
    from tpu_helpers.core.atomic_io import fsync_dir, sha256_file, write_temp

    _check_complete(directory)
    tmp, _ = write_temp(directory / STATE_FILE, lambda w: torch.save({**state, "sharded_by": writer}, w))
    os.replace(tmp, directory / STATE_FILE)
    files = {}
    for file in sorted(directory.iterdir()):
        with open(file, "rb") as f:  # DCP's writer fsyncs what it wrote; this covers the rest
            os.fsync(f.fileno())
        files[file.name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
    fsync_dir(directory)
    return files


def _check_complete(directory: Path) -> None:
    """Every file DCP's metadata refers to is here. On a pod each host writes its own files into the directory,
    so an out_dir that the hosts do not share would otherwise give a checkpoint with holes."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    wanted = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in wanted if not (directory / name).is_file())
    if missing:
        raise FileNotFoundError(
            f"{directory} lacks {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}, written by other "
            "processes: on a pod slice out_dir must be storage every host mounts (Filestore, a gcsfuse bucket)")
