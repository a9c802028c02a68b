"""Command-line training: `python -m tpu_helpers.train --preset tiny --steps 100 --device cpu ...`.

Every TrainConfig field is a flag of the same name (`--batch_size 16` or `--batch-size 16`; values are Python
literals, so `--max_chars None`, `--resume False`). The same command runs data parallel on several GPUs (or CPU
processes) under torchrun, one process per device, with DDP set up by the backend from torchrun's WORLD_SIZE:

    torchrun --nproc_per_node=4 -m tpu_helpers.train --device cuda --preset small --steps 2000 --out_dir runs/gpu4

Rank 0 writes checkpoints and `<out_dir>/results.json` (as the notebooks do); a run that diverges (a nan/inf or a
loss spike: `on_nonfinite`, `on_divergence`) prints its report and the error, which names the best checkpoint, and
exits 1. `torchrun_command(config, n)` builds
this command line from a notebook's config, so the GPU notebook can print what to run for several GPUs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import MISSING, fields

from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.launch.runner import parse_value

_SKIP = ("extra",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tpu_helpers.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(TrainConfig):
        if f.name in _SKIP:
            continue
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        default = f.default if f.default is not MISSING else None
        parser.add_argument(*names, dest=f.name, type=parse_value, default=argparse.SUPPRESS,
                            metavar="VALUE", help=f"(default: {default!r})")
    return parser


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse flags into a TrainConfig; a wrong value raises ConfigError naming the flag."""
    args = vars(build_parser().parse_args(argv))
    try:
        return TrainConfig(**args)
    except ConfigError as err:
        raise ConfigError(f"{err} (flags: {' '.join(f'--{k} {v!r}' for k, v in args.items())})") from None


def torchrun_command(config: TrainConfig, nproc_per_node: int) -> str:
    """The torchrun command that trains `config` with one process per device (the fields that differ from the
    defaults become flags)."""
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node={nproc_per_node!r} must be a positive int")
    return " ".join(["torchrun", f"--nproc_per_node={nproc_per_node}", "-m", "tpu_helpers.train",
                     *train_flags(config)])


def train_flags(config: TrainConfig) -> list[str]:
    """The command-line flags (shell-quoted) for the fields of `config` that differ from the defaults."""
    default = TrainConfig()
    flags = []
    for f in fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name not in _SKIP and value != getattr(default, f.name):
            flags += [f"--{f.name}", shlex.quote(repr(value) if not isinstance(value, str) else value)]
    return flags


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from tpu_helpers.backend import BackendUnavailable, backend_for
    from tpu_helpers.core.sharding import ShardingError
    from tpu_helpers.recipes.pretrain import train_gpt
    from tpu_helpers.training.guard.finite import TrainingDiverged

    try:  # a missing device or a TPU another process holds: one line that says what to do, not a traceback
        backend = backend_for(config)
    except BackendUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        job = train_gpt(config, backend=backend, progress=backend.is_main)
    except (ConfigError, ShardingError) as err:  # a setting this machine or run cannot take: say which
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingDiverged as err:  # the partial run's report, then what went wrong and what to do: exit 1
        if backend.is_main:
            print(err.report)
        print(f"error: {err}", file=sys.stderr)
        return 1
    if backend.is_main:
        path = job.save_results(world_size=backend.world_size, entry_point="tpu_helpers.train")
        print(job.report)
        print(f"results: {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
