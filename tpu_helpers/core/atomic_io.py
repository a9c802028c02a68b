"""Files that are never half-written: write a temp file next to the target, fsync it, rename it over the target.

    from tpu_helpers.core.atomic_io import atomic_write_text
    atomic_write_text("runs/demo/results.json", text)   # readers see the old file or the new one, never a part

Preemptible TPUs and Colab disconnects stop a process mid-write; checkpoints, results and run records all go
through here. `write_temp` with a `SinkWriter` is the building block (it also hashes and counts what it wrote, and
keeps the real cause of a failure: disk full, or a second Ctrl-C/SIGTERM during the write).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class SinkWriter:
    """File-like sink for torch.save that writes through ``os.write`` and hashes and counts what it wrote.

    torch.save turns an exception from ``write`` into an opaque RuntimeError, so the OSError is kept here to
    report "disk full" properly. Going through ``os.write`` also gives tests one place to simulate ENOSPC.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None
        # A KeyboardInterrupt/SystemExit raised in a write (a second Ctrl-C or SIGTERM during a save): torch turns
        # it into "unexpected pos" RuntimeErrors, so it is kept here and re-raised as itself.
        self.interrupt: BaseException | None = None

    def write(self, data: Any) -> int:
        try:  # all of it: a signal handler can raise between any two bytecodes of this method
            if self.interrupt is not None:
                raise self.interrupt
            if self.error is not None:  # torch keeps writing after a failure; don't let a later write "succeed"
                raise self.error
            rest = view = memoryview(data).cast("B")
            try:
                while rest:
                    rest = rest[os.write(self.fd, rest) :]  # os.write may write less than asked (large buffers)
            except OSError as e:
                self.error = e
                raise
            self.sha.update(view)
            self.size += len(view)
            return len(view)
        except BaseException as e:
            if not isinstance(e, Exception) and self.interrupt is None:
                self.interrupt = e
            raise

    def flush(self) -> None:  # nothing is buffered in user space; fsync happens after the last write
        pass


def fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable. Best effort: Windows and some FUSE mounts (Drive, gcsfuse) refuse it.
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def create_temp(path: Path) -> tuple[int, Path]:
    # Like mkstemp, but with mode 0666 so the process umask applies as for any new file (mkstemp makes 0600 files;
    # results and checkpoints should read like any file) without reading the umask, which means setting it.
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name next to {path}")


def write_temp(path: Path, produce: Callable[[SinkWriter], None]) -> tuple[Path, SinkWriter]:
    """Write a fsynced temp file next to ``path``; the caller renames it. Removes it on any failure."""
    fd, tmp = create_temp(path)
    writer = SinkWriter(fd)
    try:
        try:
            produce(writer)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if writer.interrupt is not None and writer.interrupt is not e:
            raise writer.interrupt from None  # the user's stop, not torch's "unexpected pos" wrapper of it
        if isinstance(e, Exception) and writer.error is not None and writer.error is not e:
            raise writer.error from None  # the real cause (e.g. ENOSPC), not torch's opaque wrapper
        raise
    return tmp, writer


def atomic_write_bytes(path: str | Path, data: bytes) -> SinkWriter:
    """Write ``data`` to ``path`` so that readers (and a rerun after a crash) see the old or new file only. Returns
    the writer, which counted the bytes (``size``) and hashed them (``sha``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, writer = write_temp(path, lambda w: w.write(data))
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return writer


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(encoding))


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()
