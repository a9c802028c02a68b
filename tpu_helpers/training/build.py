"""Building and placing a run: what `Trainer.__init__` assembles before the first step, one function each.

    check_precision(config, backend)                       # config.precision against a backend passed in
    callbacks, tracking = run_callbacks(config, backend, callbacks)   # + the XLA detector and the trackers
    model = place_model(raw_model, config, backend)        # gradient checkpointing, then sharding / device
    loader = make_run_loader(data, backend, rows, shuffle=True, seed=config.seed)
    rule = spike_rule(config, watches_loss_spikes=True)    # the finite loss-spike check, or None

Each takes what it needs (config, backend, model, data) and returns what the trainer keeps; none touches the
trainer, so a variant that builds its run differently calls the ones it wants.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.callbacks import Callback, as_callback
from tpu_helpers.data import make_loader
from tpu_helpers.diagnostics import XlaDetector
from tpu_helpers.training.guard import divergence
from tpu_helpers.training.recompute import set_gradient_checkpointing
from tpu_helpers.training.tracking import Tracking


def check_precision(config: TrainConfig, backend: Any) -> None:
    """config.precision must be "auto" or what the backend runs."""
    if config.precision not in ("auto", backend.precision):
        raise ConfigError(
            f"precision={config.precision!r} conflicts with the backend passed in, which runs "
            f"{backend.precision!r}; create it with get_backend(..., precision={config.precision!r})"
        )


def run_callbacks(config: TrainConfig, backend: Any,
                  callbacks: list[Callback] | None) -> tuple[list[Callback], Tracking | None]:
    """The run's callbacks: the given ones, the XLA detector where graphs compile (unless config.xla_checks is
    "off" or one was given), and the experiment trackers (config.trackers; the main process only, a missing
    package fails here), which are returned too."""
    out: list[Callback] = [as_callback(c) for c in callbacks or []]
    if backend.compiles_graphs and config.xla_checks != "off" and not any(isinstance(c, XlaDetector) for c in out):
        out.append(XlaDetector(strict=config.xla_checks == "strict"))
    tracking = Tracking(config) if config.trackers and backend.is_main else None
    if tracking is not None:
        out.append(tracking)
    return out, tracking


def place_model(model: torch.nn.Module, config: TrainConfig, backend: Any) -> torch.nn.Module:
    """`model` with gradient checkpointing (the backend's per-block wrapping where it does that while placing,
    else the model's own hook: training/recompute.py), sharded or moved as config.sharding says."""
    blocks = config.gradient_checkpointing and backend.checkpoints_blocks(config.sharding)
    if config.gradient_checkpointing and not blocks:
        set_gradient_checkpointing(model, backend.checkpoint_fn())
    return backend.prepare_model(model, config.sharding, checkpoint_blocks=blocks)


def make_run_loader(data: Dataset | DataLoader, backend: Any, rows: int, *, shuffle: bool, seed: int) -> DataLoader:
    """A loader of `rows` rows per batch for this process (resumable, drop_last), or a DataLoader given whole,
    whose batch size must split over the chips this process feeds."""
    if isinstance(data, DataLoader):
        if data.batch_size and data.batch_size % max(1, backend.num_replicas // backend.world_size):
            raise ConfigError(
                f"loader batch size {data.batch_size} is not divisible by the {backend.num_replicas} "
                "devices it is sharded over"
            )
        return data
    rank, world = backend.loader_rank_and_world
    return make_loader(data, rows, rank=rank, world_size=world, shuffle=shuffle, seed=seed, **backend.loader_options)


def spike_rule(config: TrainConfig, *, watches_loss_spikes: bool) -> divergence.SpikeRule | None:
    """The finite loss-spike rule (training/guard/divergence.py), unless on_divergence is "off" or the trainer's loss is
    not one it suits (`Trainer.watches_loss_spikes`)."""
    if config.on_divergence == "off" or not watches_loss_spikes:
        return None
    return divergence.SpikeRule(config.divergence_factor)
