"""Training on every chip of a TPU VM (a v5e-8): the batch plan, SPMD in this process, or one process per chip.

    plan = plan_multichip(config, global_batch=64, mode="spmd")   # validated before any XLA runtime starts
    print(plan.describe())   # "global batch 64 = 8 per chip x 8 chips x 1 accumulation step ..."
    results = train(plan)    # the GPT recipe (recipes.pretrain) over every chip; the results on every host

SPMD ("spmd") is the default: the notebook's own process drives all chips as one program, the global batch is
sharded over the mesh's "data" axis, nothing forks or pickles inside Jupyter, and checkpoints are written once.
The multi-process alternative ("spawn") runs `spawn_worker` once per chip through `xmp.spawn`; the worker is a
module-level function so it can be started from a notebook (start method "fork"). Either way the checkpoint
records the data position in samples of the global order, so it resumes on any chip count with the same global
batch. On XLA:CPU, `CPU_NUM_DEVICES=8` simulates the 8 chips for SPMD (multi-process collectives can hang there,
so spawn is exercised with one process only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tpu_helpers.backend import backend_for, runtime_env, xla_module
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.core.sharding import ShardingError, is_sharded, mesh_shape
from tpu_helpers.memory.per_chip import gpt_sharding_plan
from tpu_helpers.recipes.pretrain import Pretrain, train_gpt

MODES = ("spmd", "spawn")


def slice_device_count(device: str = "tpu") -> int:
    """XLA devices of the whole run, read without starting the XLA runtime: this host's chips (or simulated
    XLA:CPU devices) times the hosts of a pod slice; 1 for "cpu"/"cuda"."""
    return runtime_env.slice_device_count(device)


def split_global_batch(global_batch: int, chips: int, grad_accum: int = 1) -> int:
    """Per-chip batch for a global batch, or a ConfigError naming the numbers when it does not divide."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"GLOBAL_BATCH={global_batch!r} must be a positive int")
    if chips < 1:
        raise ConfigError(f"chips={chips!r} must be >= 1")
    share = chips * grad_accum
    if global_batch % share:
        lower, upper = global_batch // share * share, (global_batch // share + 1) * share
        raise ConfigError(
            f"GLOBAL_BATCH={global_batch} cannot be split over {chips} chips x GRAD_ACCUM={grad_accum}: it must be a "
            f"multiple of {share} (e.g. {upper}" + (f" or {lower}" if lower else "") + "), or change the chip count"
        )
    return global_batch // share


@dataclass(frozen=True)
class MultiChipPlan:
    config: TrainConfig  # batch_size set to the per-chip batch
    mode: str
    chips: int
    global_batch: int
    nprocs: int | None  # spawn only: 1 (this process) or None (one per chip)

    def describe(self) -> str:
        cfg = self.config
        tokens = self.global_batch * cfg.seq_len
        how = "SPMD in this process" if self.mode == "spmd" else (
            "xmp.spawn, one process per chip" if self.nprocs is None else "xmp.spawn, a single process")
        return (f"global batch {self.global_batch} = {cfg.batch_size} per chip x {self.chips} chips x "
                f"{cfg.grad_accum} accumulation step(s) ({tokens:,} tokens per optimizer step; {how})")


def plan_multichip(config: TrainConfig, *, global_batch: int, mode: str = "spmd", spawn_procs: int = 0,
                   chips: int | None = None) -> MultiChipPlan:
    """Check the mode and split `global_batch` over the chips (read from the host unless `chips` is given).

    spawn_procs (mode "spawn"): 0 = one process per chip, 1 = a single process.
    """
    if mode not in MODES:
        raise ConfigError(f"MODE={mode!r} is not one of {MODES}")
    if spawn_procs not in (0, 1):
        raise ConfigError(f"SPAWN_PROCS={spawn_procs!r} must be 0 (one process per chip) or 1 (a single process); "
                          "torch_xla spawns no other counts")
    nprocs = None if spawn_procs == 0 else 1
    if chips is None:
        chips = 1 if mode == "spawn" and nprocs == 1 else slice_device_count(config.device)
    per_chip = split_global_batch(global_batch, chips, config.grad_accum)
    _check_sharding(config.sharding, mode, chips)
    return MultiChipPlan(config.replace(batch_size=per_chip, spmd=mode == "spmd"), mode, chips, global_batch,
                         nprocs if mode == "spawn" else None)


def _check_sharding(sharding: str, mode: str, chips: int) -> None:
    if mode == "spawn" and is_sharded(sharding):
        raise ConfigError(f"SHARDING={sharding!r} needs MODE='spmd' (one program over all chips); MODE='spawn' runs "
                          "one process per chip, data parallel only")
    try:
        mesh_shape(sharding, chips)
    except ShardingError as err:
        raise ConfigError(str(err).replace("sharding=", "SHARDING=")) from None


def sharding_advice(plan: MultiChipPlan, hardware: str = "v5e") -> str:
    """What the planned run needs per chip of `hardware` under its SHARDING, and under the other choices
    (the analytic estimate of the package GPT, `tpu_helpers.memory.per_chip`)."""
    cfg = plan.config
    precision = "bf16" if cfg.precision == "auto" else cfg.precision
    memory = gpt_sharding_plan(cfg.preset, cfg.batch_size, cfg.seq_len, chips=plan.chips, hardware=hardware,
                               precision=precision, gradient_checkpointing=cfg.gradient_checkpointing, what="training")
    fsdp = mesh_shape(cfg.sharding, plan.chips)[1]
    chosen = memory.per_chip["data" if fsdp == 1 else f"fsdp x{fsdp}"] if (fsdp == 1 or f"fsdp x{fsdp}" in
                                                                           memory.per_chip) else None
    mine = f"SHARDING={cfg.sharding!r}: about {format_bytes(chosen.peak_bytes)} per chip. " if chosen else ""
    return mine + memory.advice()


def train(plan: MultiChipPlan, *, prompt: str = "Once upon a time", max_new_tokens: int = 200) -> dict:
    """Train the planned run (SPMD from this process, or `xmp.spawn` for MODE "spawn") and return its results:
    what host 0 writes to results.json, returned on every host of a pod, so the notebook's results cells run on
    each without waiting for a file. SPMD prints the device and model size first and a sample at the end."""
    if plan.mode == "spawn":
        return train_spawn(plan)
    backend = backend_for(plan.config)
    check_backend(plan, backend)
    print(backend.status())
    job = Pretrain(plan.config, backend=backend)
    print(f"{job.model.num_params():,} parameters")
    job.train()
    extra = {"mode": plan.mode, "chips": plan.chips, "global_batch": plan.global_batch}
    job.save_results(**extra)
    print(job.sample(prompt, max_new_tokens=max_new_tokens))
    return job.results(**extra)


def summary(results: dict) -> str:
    """The report's headline figures, a line each."""
    report = results["report"]
    keys = ("device", "steps", "tokens_per_s", "first_val_loss", "final_val_loss", "final_train_loss", "checkpoint")
    lines = [f"{key:18s} {report.get(key)}" for key in keys]
    return "\n".join([*lines, f"{'compilations':18s} {(report.get('xla') or {}).get('compilations')}"])


def check_backend(plan: MultiChipPlan, backend) -> None:
    """Fail clearly when the running backend does not have the chip count the plan split the batch over."""
    if backend.num_replicas != plan.chips:
        raise ConfigError(f"the backend drives {backend.num_replicas} devices but the batch was planned for "
                          f"{plan.chips} chips ({backend.status()}); plan again with chips={backend.num_replicas}")


def spawn_worker(index: int, config_dict: dict, extra_results: dict) -> None:
    """One process of a spawned run: train on this process's chip; rank 0 writes the results (importable, so
    `xmp.spawn` can start it from a notebook)."""
    config = TrainConfig(**config_dict)
    backend = backend_for(config, spmd=False)
    job = train_gpt(config, backend=backend, progress=backend.is_main)
    if backend.is_main:
        job.save_results(process_index=index, world_size=backend.world_size, **extra_results)


def train_spawn(plan: MultiChipPlan, *, start_method: str = "fork") -> dict:
    """Run `spawn_worker` on the plan's processes and return the results rank 0 saved."""
    if plan.mode != "spawn":
        raise ConfigError(f"train_spawn needs a plan with mode='spawn', got mode={plan.mode!r}")
    extra = {"mode": plan.mode, "global_batch": plan.global_batch, "chips": plan.chips}
    config_dict = {**plan.config.to_dict(), "spmd": False}
    xla_module().spawn(spawn_worker, (config_dict, extra), nprocs=plan.nprocs, start_method=start_method)
    return load_results(plan.config.out_dir)


def load_results(out_dir: str | Path, name: str = "results") -> dict:
    """The results.json a run saved in `out_dir` (written by a recipe's `save_results`)."""
    path = Path(out_dir) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: the run saved no results (did training finish?)")
    return json.loads(path.read_text())
