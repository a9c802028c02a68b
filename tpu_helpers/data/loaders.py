"""Resumable, sharded loaders with fixed-shape batches.

    loader = make_loader(train, batch_size=32, rank=rank, world_size=world, **backend.loader_options)
    ...
    ckpt["sampler"] = loader.sampler.state_dict(consumed=steps_this_epoch * 32)
    loader.sampler.load_state_dict(ckpt["sampler"])   # on resume: same order, same position

Every batch has the same shape (``drop_last=True``), because XLA compiles one graph per input shape and a ragged
last batch would trigger a recompilation each epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ResumableSampler", "make_loader"]


class ResumableSampler(Sampler[int]):
    """Deterministic, per-rank sampler that can be saved and resumed mid-epoch.

    The order of epoch ``e`` is ``randperm(n)`` from ``torch.Generator().manual_seed(seed + e)``, cut so
    it divides ``world_size`` (``drop_last``) or padded by wrapping around, then strided by rank. It depends
    only on (seed, epoch), so every rank and every resumed run agree on it without communicating.

    Epochs: ``set_epoch(e)`` to a new epoch starts it from the beginning; ``set_epoch`` of the current
    epoch keeps the position, so a resumed loop can call it as usual (and gets the rest of that epoch, even
    if that is nothing). Iterating again after a finished pass without any ``set_epoch`` call moves on to
    the next epoch by itself, so forgetting ``set_epoch`` still reshuffles instead of yielding nothing.
    """

    def __init__(self, n: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (the dataset size) must be a positive int, got {n!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        if drop_last and n < world_size:
            raise ValueError(f"n={n} samples cannot give every one of world_size={world_size} ranks a sample")
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.num_samples = n // world_size if drop_last else -(-n // world_size)
        self.epoch = 0
        self.index = 0  # samples of this epoch already handed out
        # Bumped whenever the position is set from outside or a new pass starts, so an abandoned iterator
        # (a loop that broke early) cannot keep moving the position of the new one.
        self._generation = 0
        self._hold = False  # set_epoch(current) on a finished pass: the caller wants that epoch, not the next

    def _epoch_indices(self, epoch: int) -> list[int]:
        if self.shuffle:
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            perm = torch.arange(self.n)
        total = self.num_samples * self.world_size
        if total <= self.n:
            perm = perm[:total]
        else:
            # Pad by repeating from the start so every rank takes the same number of steps (no hang in
            # collectives because one rank ran out early).
            perm = torch.cat([perm] * (-(-total // self.n)))[:total]
        return perm[self.rank :: self.world_size].tolist()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.index, self._hold = epoch, 0, False
            self._generation += 1
        elif self.index >= self.num_samples:
            self._hold = True

    def _pass_finished(self) -> bool:
        return self.index >= self.num_samples and not self._hold

    def __iter__(self) -> Iterator[int]:
        if self._pass_finished():
            self.epoch, self.index = self.epoch + 1, 0
        self._hold = False
        self._generation += 1
        # Eager work above, lazy yielding below: a loader that only calls iter() and len() sees the new state.
        return self._yield_from(self._epoch_indices(self.epoch), self._generation)

    def _yield_from(self, indices: list[int], generation: int) -> Iterator[int]:
        for i in range(self.index, len(indices)):
            if self._generation != generation:
                return
            self.index = i + 1
            yield indices[i]

    def __len__(self) -> int:
        # What the next iteration will yield; a finished pass means the next one is a whole new epoch.
        return self.num_samples if self._pass_finished() else self.num_samples - self.index

    def state_dict(self, consumed: int | None = None) -> dict[str, int]:
        """``{"epoch", "index"}``; ``index`` counts samples of the epoch already yielded.

        Loader workers and device loaders fetch ahead, so the sampler is usually a few batches ahead of
        the training loop. For an exact resume pass ``consumed`` = samples this rank's loop has actually
        used in the current epoch (steps * batch_size).
        """
        index = self.index if consumed is None else int(consumed)
        if not 0 <= index <= self.num_samples:
            raise ValueError(f"consumed must be in [0, {self.num_samples}], got {consumed!r}")
        return {"epoch": self.epoch, "index": index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "index"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; got keys {sorted(state)}")
        epoch, index = int(state["epoch"]), int(state["index"])
        if not 0 <= index <= self.num_samples:
            raise ValueError(f"sampler state index {index} is outside [0, {self.num_samples}] for this sampler "
                             f"(n={self.n}, world_size={self.world_size})")
        self.epoch, self.index, self._hold = epoch, index, False
        self._generation += 1


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader[Any]:
    """A DataLoader with fixed-shape batches and a :class:`ResumableSampler` (``loader.sampler``).

    ``num_workers`` and ``pin_memory`` depend on the device: the backend says which (``backend.loader_options``:
    CUDA pins host memory and uses workers, XLA uses workers without pinning since ``MpDeviceLoader`` copies on its
    own thread, the CPU loads in the main process).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(dataset)  # type: ignore[arg-type]
    per_rank = n // max(world_size, 1)
    if per_rank < batch_size:
        raise ValueError(f"dataset too small: {n} samples over world_size={world_size} gives {per_rank} per "
                         f"rank, fewer than batch_size={batch_size} (lower batch_size or add data)")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    sampler = ResumableSampler(n, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Its own generator: without one, every new iterator (each epoch, each evaluation, a resume) draws
        # its worker seed from the global torch RNG, which shifts the dropout stream and breaks exact resume.
        generator=torch.Generator().manual_seed(seed),
    )


def release_workers(loader: Any) -> None:
    """Stop a DataLoader's persistent worker processes now; iterating it again starts new ones. A run's loaders
    keep their workers between epochs and evaluations (`make_loader`'s persistent_workers), but after the run they
    would live as long as the loader does: in a notebook, until the kernel restarts; in a test session, until the
    garbage collector reaches the trainer (dozens of forked copies of the process piled up)."""
    iterator = getattr(loader, "_iterator", None)  # DataLoader keeps its persistent iterator here
    if iterator is None:
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    loader._iterator = None


def fixed_batches(stop: int, rows: int, start: int = 0) -> Iterator[tuple[list[int], int]]:
    """Indices of [start, stop) in batches of exactly `rows`, with how many of each are real: the last batch is
    padded by repeating its last index, because on XLA a short last batch would be a graph of its own."""
    for first in range(start, stop, rows):
        idx = list(range(first, min(first + rows, stop)))
        real = len(idx)
        yield idx + [idx[-1]] * (rows - real), real
