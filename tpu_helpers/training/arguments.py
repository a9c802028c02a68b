"""Checks of `Trainer`/`fit` arguments and of out_dir, run before anything is compiled, trained or written.

A wrong argument should fail in the first second with a message naming the value and what is allowed, not
after an hour of training (an out_dir that cannot hold checkpoints) or deep inside torch (a model that is not a
module). `TrainConfig` checks its own fields (config.py); this module checks what the Trainer is given besides.

    check_trainer_args(model=model, train_data=train, val_data=val, config=cfg, backend=None, loss_fn=None,
                       callbacks=[], run_identity=None, progress=True, save_trainable_only=False)   # Trainer does
    check_out_dir(cfg.out_dir)   # exists as a directory or can be made, and is writable
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from tpu_helpers.backend import Backend
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.callbacks import HOOKS, Callback


def _kind(value: Any) -> str:
    return type(value).__name__


def _check_dataset(name: str, data: Any, batch_rows: int) -> None:
    if data is None:  # train_data=None: a trainer for its step alone (fit then says what is missing)
        return
    if isinstance(data, DataLoader):
        return  # the caller chose its own batching; Trainer checks it against the device count
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(f"{name} must be a map-style Dataset (with __len__ and __getitem__) or a DataLoader, "
                        f"got {_kind(data)}")
    n = len(data)
    if n < batch_rows:
        raise ConfigError(f"{name} has {n} samples, fewer than one batch of {batch_rows} (batch_size x devices "
                          "fed by this process); lower batch_size or use more data")


def check_trainer_args(*, model: Any, train_data: Any, val_data: Any, config: Any, backend: Any, loss_fn: Any,
                       callbacks: Any, run_identity: Any, progress: Any, save_trainable_only: Any) -> None:
    """Raise TypeError (wrong kind of object) or ConfigError (unusable value) for a bad Trainer argument.

    Datasets must hold at least one batch of `config.batch_size` (per device; under SPMD one process reads
    batch_size x chips, which `make_loader` checks once the device count is known).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_kind(model)}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model {_kind(model)} has no trainable parameters (none with requires_grad=True)")
    if config is not None and not isinstance(config, TrainConfig):
        hint = "; build one with TrainConfig(**your_dict)" if isinstance(config, dict) else ""
        raise TypeError(f"config must be a TrainConfig or None, got {_kind(config)}{hint}")
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"backend must be a tpu_helpers Backend (from get_backend) or None, got {_kind(backend)}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(outputs, targets) or None, got {_kind(loss_fn)}")
    if callbacks is not None:
        if not isinstance(callbacks, (list, tuple)):
            raise TypeError(f"callbacks must be a list of Callback objects, got {_kind(callbacks)}")
        for i, cb in enumerate(callbacks):
            if isinstance(cb, Callback):
                continue
            # Duck-typed callbacks are welcome (the Trainer skips the hooks they lack), but an object with no hook
            # at all, a hook that is not callable, or a misspelt one (on_step) would silently never run.
            names = [n for n in dir(cb) if n.startswith("on_") and not n.startswith("on__")]
            unknown = [n for n in names if n not in HOOKS]
            not_callable = [n for n in names if n in HOOKS and not callable(getattr(cb, n))]
            if unknown or not_callable or not names:
                problem = ("has no hook method" if not names else f"{unknown[0]} is not a hook" if unknown
                           else f"{not_callable[0]} is not callable")
                raise TypeError(f"callbacks[{i}] ({_kind(cb)}) {problem}; a callback defines some of: "
                                f"{', '.join(HOOKS)} (or subclass tpu_helpers.training.Callback)")
    if run_identity is not None and not isinstance(run_identity, dict):
        raise TypeError(f"run_identity must be a dict or None, got {_kind(run_identity)}")
    for name, value in (("progress", progress), ("save_trainable_only", save_trainable_only)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    rows = config.batch_size if config is not None else TrainConfig.batch_size  # the field's default
    _check_dataset("train_data", train_data, rows)
    _check_dataset("val_data", val_data, rows)


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """Make sure `out_dir` (and its checkpoints/ folder) is a directory this process can write into."""
    path = Path(out_dir)
    for p in (path, path / "checkpoints"):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"out_dir={str(out_dir)!r}: {str(p)!r} is a file, not a directory; "
                              "choose another out_dir")
    try:
        (path / "checkpoints").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path / "checkpoints"):
            pass
    except OSError as err:
        raise ConfigError(f"out_dir={str(out_dir)!r} is not writable ({err.strerror or err}); checkpoints could "
                          "not be saved there: choose a directory you can write to") from None
    return path
