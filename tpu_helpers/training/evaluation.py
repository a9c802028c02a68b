"""The validation loss of a run: the mean of the step's own loss over the same fixed batches every time.

    val = mean_val_loss(trainer)           # Trainer.evaluate: None without validation data

The eval callbacks run around it (`on_eval_start`, `on_eval_end`, which may put metrics of their own into
`trainer.eval_metrics`). XLA hygiene: every batch has the training batch's shape and runs one same graph, the
running total stays on the device, and the mean is read once at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from tpu_helpers.config import ConfigError


@torch.no_grad()
def mean_val_loss(trainer: Any) -> float | None:
    """Mean validation loss over `eval_batches` fixed batches of `trainer.val_loader` (one host read at the end)."""
    loader, b = trainer.val_loader, trainer.backend
    if loader is None:
        return None
    for cb in trainer.callbacks:
        cb.on_eval_start(trainer)
    trainer.model.eval()
    # The same fixed batches every time: a loop broken off after eval_batches would otherwise leave the sampler
    # mid-pass, so the next evaluation (and a resumed run's) would read other batches.
    if hasattr(getattr(loader, "sampler", None), "load_state_dict"):
        loader.sampler.load_state_dict({"epoch": 0, "index": 0})
    # The running total starts as data copied from the host, shape (1,) (XLA turns a 0-d zero into a constant,
    # i.e. a graph of its own), and the mean is taken on the host: every evaluation batch runs one same graph.
    total, n = torch.zeros(1).to(b.device), 0
    # Cap the host loader rather than break out of the device loader: the feeder thread then copies exactly
    # eval_batches batches to the device, not a prefetch of batches nobody reads.
    for batch in b.wrap_loader(_Take(loader, trainer.config.eval_batches)):
        with b.autocast():
            total = total + trainer.compute_loss(batch).float()
        b.sync()
        n += 1
    trainer.model.train()
    for cb in trainer.callbacks:
        cb.on_eval_end(trainer)
    if n == 0:
        raise ConfigError("the validation set is smaller than one batch; lower batch_size or val_fraction")
    return float(b.all_reduce_mean(total).item()) / n


class _Take:
    """The first `n` batches of a loader, with a length (MpDeviceLoader and progress bars ask for one)."""

    def __init__(self, loader: DataLoader, n: int) -> None:
        self.loader, self.n = loader, n

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.n)

    def __len__(self) -> int:
        return min(self.n, len(self.loader))
