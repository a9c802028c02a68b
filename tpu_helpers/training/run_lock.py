"""One run per out_dir: an advisory lock held for the life of `Trainer.fit`, refused at once to a second run.

Two runs on one directory (two terminals, `make run` twice, two notebook tabs) would interleave their checkpoints
and prune each other's files. `RunLock(out_dir)` takes `fcntl.flock` on `<out_dir>/.run.lock` and writes who holds
it (pid, host, start time, command); a second `acquire` fails at once with a `RunLocked` error that names that
holder. The kernel drops a flock when its process dies in any way (SIGKILL, OOM, a crashed VM), so a killed run
never leaves a stale lock behind; the file itself stays, and only its lock state counts.

    with RunLock("runs/exp1"):      # Trainer.fit does this
        ...train, save checkpoints...

What it cannot promise: flock is kept by the kernel of the machine that took it. Processes on one machine always
see each other's lock (network filesystems included), but on a filesystem shared between machines (gcsfuse, Google
Drive, NFS, SMB) a run on another machine may not see it. `network_filesystem(path)` names such a filesystem from
/proc/mounts, and `acquire` warns once about it. Where flock is missing (Windows) the lock is skipped with a warning. Forked children (DataLoader workers) close
their copy of the lock's file descriptor, so the lock ends with the run, not with the last worker.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".run.lock"
# Filesystem types (as /proc/mounts spells them) whose files other machines can also open.
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse.gcsfuse", "fuse.drive", "fuse.rclone",
               "fuse.sshfs", "fuse.s3fs", "fuse.blobfuse", "fuse", "lustre", "gpfs", "ceph", "glusterfs")
_warned_network: set[str] = set()
_HELD: set[int] = set()  # lock fds of this process


def _drop_in_child() -> None:
    # A forked child (a DataLoader worker) shares the lock's open file: if it kept the fd, the lock would outlive
    # the run until the worker exits. Closing the child's copy leaves the parent's lock in place.
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


class RunLocked(RuntimeError):
    """Another live process holds the out_dir's run lock."""


def network_filesystem(path: str | os.PathLike, mounts: str = "/proc/mounts") -> str | None:
    """The type of the network filesystem `path` lies on (e.g. "fuse.gcsfuse"), or None for a local one."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target = str(Path(path).resolve())
    best, best_type = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, parts[2]
    return best_type if best_type in _NETWORK_FS else None


def describe_holder(text: str) -> str:
    """Words for the holder recorded in a lock file ("pid 123 on host tpu-vm since 2026-...: python ...")."""
    try:
        info = json.loads(text)
    except ValueError:
        return "an unknown process (the lock file holds no readable owner)"
    if not isinstance(info, dict):
        return "an unknown process (the lock file holds no readable owner)"
    return (f"pid {info.get('pid')} on host {info.get('host')!s} since {info.get('started')}"
            + (f" ({info['command']})" if info.get("command") else ""))


class RunLock:
    """The advisory lock of one out_dir (see the module docstring); a context manager."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        if fcntl is None:
            warnings.warn("this platform has no fcntl.flock: nothing stops a second run from sharing "
                          f"out_dir={str(self.out_dir)!r}", stacklevel=2)
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fs = network_filesystem(self.out_dir)
        if fs is not None and fs not in _warned_network:
            _warned_network.add(fs)
            warnings.warn(
                f"out_dir={str(self.out_dir)!r} is on a network filesystem ({fs}): the run lock stops a second run "
                "on this machine, but a run on another machine using the same folder may not see it; run one "
                "training per folder yourself", stacklevel=2)
        # O_RDWR without O_TRUNC: the holder's record must survive until we know we are the holder.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            os.close(fd)
            raise RunLocked(
                f"out_dir={str(self.out_dir)!r} is in use by another run: {holder}. One run per directory: wait "
                "for it to finish, stop it, or choose another out_dir"
            ) from None
        except OSError as err:  # a filesystem without locks (some FUSE mounts): say so, do not fail the run
            os.close(fd)
            warnings.warn(f"could not lock out_dir={str(self.out_dir)!r} ({err.strerror or err}): nothing stops a "
                          "second run from sharing it", stacklevel=2)
            return self
        self._fd = fd
        _HELD.add(fd)
        try:
            record = json.dumps(self.holder_record()).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the holder's description is missing
        return self

    @staticmethod
    def holder_record() -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:300]}

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(fd)
        try:
            os.ftruncate(fd, 0)  # no holder any more (the file stays: deleting it would race a new holder)
        except OSError:
            pass
        os.close(fd)  # closing drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
