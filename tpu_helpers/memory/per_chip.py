"""Per-chip memory under each SHARDING choice, and the advice it leads to.

Data parallel keeps the whole model, its gradients and optimizer state on every chip; FSDP over ``n`` chips keeps
``1/n`` of each, plus, while a block runs, that block's gathered weights (and in the backward its full gradient
before the reduce-scatter). Activations depend on the per-chip batch only, so they do not change::

    from tpu_helpers.memory.per_chip import sharding_plan
    from tpu_helpers.memory import analytic_estimate
    plan = sharding_plan(lambda b: analytic_estimate("xl", b, 1024, precision="bf16"), batch_size=1, chips=8,
                         hardware="v5e", block_params=12 * 1600**2, what="full fine-tuning")
    print(plan.advice())   # "full fine-tuning of this 1.6B model needs fsdp over at least 2 chips ..."

`shard_estimate` turns any `MemoryEstimate` (analytic, traced) into its per-chip figure under FSDP over ``n`` chips.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpu_helpers.core.hardware import HardwareSpec, format_bytes
from tpu_helpers.memory.report import Estimator, MemoryEstimate, resolve_hardware

_SHARDED = ("params", "grads", "optimizer")


def shard_estimate(estimate: MemoryEstimate, fsdp: int, *, block_params: int = 0,
                   bytes_per_param: int = 4) -> MemoryEstimate:
    """`estimate` (per chip, data parallel) turned into FSDP over `fsdp` chips.

    Parameters, gradients and optimizer state are split `fsdp` ways (rounded up, as XLA pads uneven shards); the
    temporaries gain one block's gathered weights and its unsharded gradient (`block_params` parameters of
    `bytes_per_param` bytes each: 2 x block). With fsdp=1 the estimate comes back unchanged.
    """
    if isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1:
        raise ValueError(f"fsdp={fsdp!r} must be an integer >= 1 (the chips the model is sharded over)")
    if fsdp == 1:
        return estimate

    def shard(breakdown: dict[str, int]) -> dict[str, int]:
        parts = dict(breakdown)
        for key in _SHARDED:
            parts[key] = -(-parts[key] // fsdp)
        parts["temporaries"] = max(parts["temporaries"], 2 * block_params * bytes_per_param)
        return parts

    notes = [*(n for n in estimate.notes if not n.startswith("peak: ")),
             f"fsdp over {fsdp} chips: parameters, gradients and optimizer state / {fsdp}, plus one gathered block"]
    method = f"{estimate.method}, fsdp x{fsdp}"
    if estimate.phases:  # sharding shrinks the gradients, not the activations: the peak may move to another moment
        return MemoryEstimate.from_phases(method, estimate.batch_size,
                                          {name: shard(parts) for name, parts in estimate.phases.items()}, notes=notes)
    return MemoryEstimate.from_categories(method, estimate.batch_size, notes=notes, **shard(estimate.breakdown))


@dataclass
class ShardingPlan:
    """Per-chip peak bytes of one step under data parallel and under fsdp over 2, 4, ... chips."""

    per_chip: dict[str, MemoryEstimate]  # "data", "fsdp x2", "fsdp x4", ...
    hardware: HardwareSpec
    safety_margin: float
    chips: int
    params: int
    what: str

    @property
    def budget_bytes(self) -> float:
        return self.hardware.hbm_bytes * (1.0 - self.safety_margin)

    def fits(self, choice: str) -> bool:
        return self.per_chip[choice].peak_bytes <= self.budget_bytes

    def min_fsdp_chips(self) -> int | None:
        """The fewest chips FSDP needs for this step to fit (1 when data parallel fits), None if not on `chips`."""
        if self.fits("data"):
            return 1
        for choice, est in self.per_chip.items():
            if choice != "data" and est.peak_bytes <= self.budget_bytes:
                return int(choice.split("x")[-1])
        return None

    def recommended(self) -> str:
        """The SHARDING value to use: "data" when it fits (no gathers), else "fsdp", else "fsdp" anyway."""
        return "data" if self.fits("data") else "fsdp"

    def advice(self) -> str:
        size = _human_count(self.params)
        data = format_bytes(self.per_chip["data"].peak_bytes)
        chip = f"{self.hardware.name} ({format_bytes(self.hardware.hbm_bytes)} each)"
        need = self.min_fsdp_chips()
        if need == 1:
            return f"{self.what} of this {size} model fits data parallel on {chip}: {data} per chip"
        if need is None:
            if self.chips == 1:
                return (f"{self.what} of this {size} model does not fit on one chip of {chip}: {data} per chip. "
                        "Use fsdp over several chips, a smaller batch, gradient checkpointing or LoRA")
            most = self.per_chip[f"fsdp x{self.chips}"].peak_bytes
            return (f"{self.what} of this {size} model does not fit on {self.chips} chips of {chip} even with fsdp "
                    f"({format_bytes(most)} per chip); data parallel needs {data} per chip. Use more chips, a "
                    "smaller batch, gradient checkpointing or LoRA")
        fsdp = format_bytes(self.per_chip[f"fsdp x{need}"].peak_bytes)
        return (f"{self.what} of this {size} model needs fsdp over at least {need} chips of {chip}: {fsdp} per "
                f"chip; data parallel needs {data} per chip")

    def table(self) -> str:
        rows = [f"{'sharding':<12}{'per chip':>12}  fits"]
        for choice, est in self.per_chip.items():
            rows.append(f"{choice:<12}{format_bytes(est.peak_bytes):>12}  {'yes' if self.fits(choice) else 'no'}")
        return "\n".join(rows)


def sharding_plan(estimator: Estimator, batch_size: int, *, chips: int, hardware: str | HardwareSpec = "v5e",
                  block_params: int = 0, params: int | None = None, bytes_per_param: int = 4,
                  safety_margin: float = 0.1, what: str = "training") -> ShardingPlan:
    """Per-chip memory of one step at `batch_size` per chip under data parallel and fsdp over 2, 4, ... `chips`.

    `estimator(batch) -> MemoryEstimate` is a data-parallel estimate (analytic or traced); `block_params` the
    parameters of the largest sharding unit (one transformer layer); `params` the model's size for the message
    (taken from the estimate's parameter bytes when not given).
    """
    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 1:
        raise ValueError(f"chips={chips!r} must be an integer >= 1")
    spec = resolve_hardware(hardware)
    base = estimator(batch_size)
    per_chip = {"data": base}
    n = 2
    while n <= chips:
        if chips % n == 0:
            per_chip[f"fsdp x{n}"] = shard_estimate(base, n, block_params=block_params,
                                                    bytes_per_param=bytes_per_param)
        n *= 2
    if chips > 1 and f"fsdp x{chips}" not in per_chip:
        per_chip[f"fsdp x{chips}"] = shard_estimate(base, chips, block_params=block_params,
                                                    bytes_per_param=bytes_per_param)
    total = params if params is not None else base.breakdown["params"] // bytes_per_param
    return ShardingPlan(per_chip, spec, safety_margin, chips, int(total), what)


def _human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def gpt_sharding_plan(model: object, batch_size: int, seq_len: int | None = None, *, chips: int,
                      hardware: str | HardwareSpec = "v5e", precision: str = "bf16", pure_bf16: bool = False,
                      optimizer: str = "adamw", gradient_checkpointing: bool = False, safety_margin: float = 0.1,
                      what: str = "full fine-tuning") -> ShardingPlan:
    """`sharding_plan` for the package GPT (a preset name, GPTConfig or dict of sizes) from the analytic estimate."""
    from tpu_helpers.memory.analytic import (
        analytic_estimate,
        block_params,
        bytes_per_weight,
        param_counts,
        resolve_config,
    )

    cfg = resolve_config(model)  # type: ignore[arg-type]
    total, _, _ = param_counts(cfg)
    block = block_params(cfg)
    w = bytes_per_weight(precision, pure_bf16)
    return sharding_plan(
        lambda b: analytic_estimate(cfg, b, seq_len, precision=precision, pure_bf16=pure_bf16, optimizer=optimizer,
                                    gradient_checkpointing=gradient_checkpointing),
        batch_size, chips=chips, hardware=hardware, block_params=block, params=total, bytes_per_param=w,
        safety_margin=safety_margin, what=what)
