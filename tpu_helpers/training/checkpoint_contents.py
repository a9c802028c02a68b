"""What a checkpoint of a run holds: building it from the run (whole or sharded) and restoring the run from it.

A checkpoint holds the model (only its trainable weights with `save_trainable_only`, as LoRA fine-tuning does: the
frozen base is identified in run.json instead), the optimizer and the run's progress (`RunParts.progress_state`:
step, data position, every RNG stream, the history) with the config it ran with; not the learning-rate schedule,
which the trainer rebuilds at the resume step. So a resumed run continues on any number of chips or processes that
keeps the global batch. A sharded run writes its devices' shards through DCP (no gather onto one host), read back
in place by the same kind of run, or whole on the CPU by any other.

`run_state.RunState` is the class to use; it inherits these methods and decides when to save and what to resume:

    state.state_dict()                 # the whole checkpoint, on the CPU
    state.load_state(state_dict)       # the model, optimizer and progress restored from one
    state.checkpoint_weights(step)     # the model weights of checkpoint `step`, for an export
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tpu_helpers.backend import Backend
from tpu_helpers.backend.units import trainable_names
from tpu_helpers.checkpoint import CheckpointManager, dcp
from tpu_helpers.config import ConfigError, TrainConfig

__all__ = ["CheckpointContents", "RunParts"]


@dataclass(frozen=True)
class RunParts:
    """What a checkpoint saves and restores, as the trainer holds it."""

    model: torch.nn.Module  # as trained: what the backend made of it (wrapped in DDP, sharded...)
    raw_model: torch.nn.Module  # as made: its class and size identify the run
    optimizer: torch.optim.Optimizer
    # The rest of the run's progress (`Trainer.progress_state`): a dict holding at least "step", "epoch" and
    # "history" (`History.to_dict()`), read when a checkpoint is written; and its inverse, called on resume.
    progress_state: Callable[[], dict]
    load_progress_state: Callable[[dict], None]


class CheckpointContents:
    """The contents of a run's checkpoints; `run_state.RunState` sets the attributes below and saves and resumes."""

    config: TrainConfig
    backend: Backend
    parts: RunParts
    manager: CheckpointManager
    save_trainable_only: bool

    def _small_state(self) -> dict:
        """Everything but the model and optimizer: the run's progress and the config it ran with."""
        return self.backend.to_cpu({**self.parts.progress_state(), "config": self.config.to_dict()})

    def _unwrapped(self):
        return getattr(self.parts.model, "module", self.parts.model)  # unwrap DDP

    def sharded_writer(self) -> str | None:
        """The sharded checkpoint kind this run saves ("xla-spmd", "fsdp2"), or None: saved whole in one file."""
        return self.backend.sharded_writer(self._unwrapped())

    def state_dict(self, small: dict | None = None) -> dict:
        """The whole checkpoint: `small` (`_small_state()`, taken now when not given), the model and optimizer."""
        b, model = self.backend, self._unwrapped()
        model_sd, optimizer_sd = b.state_dicts(model, self.parts.optimizer)  # whole, under any sharding
        return {**(small if small is not None else self._small_state()),
                **b.to_cpu({"model": self._model_state(model, model_sd), "optimizer": optimizer_sd})}

    def load_state(self, state: dict) -> None:
        b, optimizer, model = self.backend, self.parts.optimizer, self._unwrapped()
        handle = state.get("sharded")
        if handle is not None and handle.writer == self.sharded_writer():
            # Same kind of sharded run (any chip count): DCP reads each device's part in place.
            template = b.sharded_tensors(model, optimizer)
            template["model"] = self._model_state(model, template["model"])
            handle.load_into(template, b.dcp_planner(save=False))
            b.load_sharded_tensors(model, optimizer, template, strict=not self.save_trainable_only)
        else:
            if handle is not None:  # saved sharded, resumed unsharded (or by another writer): whole, on the CPU
                state = {**state, **handle.read_whole()}
            if self.save_trainable_only:  # LoRA: only the adapters were saved
                _load_trainable(model, state["model"])
                optimizer.load_state_dict(state["optimizer"])
            else:
                b.load_state_dicts(model, optimizer, state["model"], state["optimizer"])
        b.after_load(self.parts.model, optimizer)
        self.parts.load_progress_state(state)

    def _model_state(self, model, state: dict) -> dict:
        """The model's state dict `state`; with `save_trainable_only` (LoRA) only the trainable weights.

        `state` has the plain names (FSDPv2's state-dict hooks drop its "_orig_module." level) while the wrapped
        model's parameters carry that level: compare plain with plain, or under fsdp no adapter weight is kept."""
        if self.save_trainable_only:
            names = trainable_names(model)
            state = {k: v for k, v in state.items() if k in names}
        return state

    def checkpoint_weights(self, step: int) -> dict:
        """The model weights checkpoint `step` holds, whole on the CPU (the trainable ones under LoRA), under the
        plain model's names: what an export of that step writes. Reads no optimizer state from a sharded one."""
        state = self.manager.load(step, mmap=True)  # a .pt's optimizer state stays on disk
        handle = state.get("sharded")
        return handle.read_whole(parts=("model",))["model"] if handle is not None else state["model"]

    def _save_sharded(self, writer: str, step: int, small: dict, meta: dict) -> Path | list[str]:
        """A sharded checkpoint: each process writes its devices' shards (no gather onto one host)."""
        b, model = self.backend, self._unwrapped()
        tensors = b.sharded_tensors(model, self.parts.optimizer)
        tensors["model"] = self._model_state(model, tensors["model"])  # LoRA: the adapters only
        planner = dcp.finite_checking(type(b.dcp_planner(save=True)))()

        def write(directory: Path) -> list[str]:
            bad = dcp.write(directory, tensors, planner)
            return [name.removeprefix("model.") for name in bad if not name.startswith("optimizer.")] or bad

        size = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + AdamW moments
        return self.manager.save_sharded(step, small, write, writer=writer, size=size, gather=b.gather_objects,
                                         meta=meta)


def _load_trainable(model, state: dict) -> None:
    trainable = trainable_names(model)
    if set(state) != trainable:
        missing, unexpected = sorted(trainable - set(state)), sorted(set(state) - trainable)
        raise ConfigError(f"the checkpoint's trainable weights do not match the model's (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}); was it written with other LoRA settings?")
    # strict=False: the frozen base is not in it. A key that matched no parameter (say, a wrapper level the
    # load hooks did not add back) would leave that adapter silently untrained: refuse it.
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise ConfigError(f"the checkpoint's trainable weights {sorted(unexpected)[:5]} match no parameter of the model")
