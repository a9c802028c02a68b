"""The SHARDING value: what a user may write, and the (data, fsdp) mesh it means on a number of chips.

    from tpu_helpers.core.sharding import check_sharding, mesh_shape
    check_sharding(" 2X4 ")          # "2x4"
    mesh_shape("2x4", 8)             # (2, 4): 2-way data parallel x 4-way FSDP
    mesh_shape("fsdp", 8)            # (1, 8)

Values (`TrainConfig.sharding`, the notebooks' SHARDING, `--sharding`): "data" (the default), "fsdp", and "DxF" (D
data-parallel groups of F chips, D x F the chip count; XLA only); what each holds: docs/guides/devices.md.
Arithmetic only: a leaf that imports nothing, so the config, the memory plans and the tuning panel use it without
torch. Wrapping a model for a sharding is the backend's (`Backend.prepare_model(model, sharding)`).
"""

from __future__ import annotations

import re
from typing import Any

SHARDINGS = ("data", "fsdp", "DxF (e.g. 2x4)")
_MESH = re.compile(r"^\s*(\d+)\s*[x,]\s*(\d+)\s*$")


class ShardingError(ValueError):
    """A SHARDING value, or a model or chip count it cannot be applied to."""


def check_sharding(value: Any) -> str:
    """Normalise and validate a SHARDING value ("data", "fsdp", "2x4" or a (data, fsdp) pair); returns the string."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = f"{value[0]}x{value[1]}"
    if not isinstance(value, str):
        raise ShardingError(f"sharding={value!r} must be one of {SHARDINGS}")
    text = value.strip().lower()
    if text in ("data", "fsdp"):
        return text
    match = _MESH.match(text)
    if not match:
        raise ShardingError(f"sharding={value!r} is not one of {SHARDINGS}")
    data, fsdp = int(match.group(1)), int(match.group(2))
    if data < 1 or fsdp < 1:
        raise ShardingError(f"sharding={value!r}: both mesh sizes must be >= 1 (data x fsdp, e.g. 2x4)")
    return f"{data}x{fsdp}"


def mesh_shape(sharding: str, devices: int) -> tuple[int, int]:
    """(data, fsdp) sizes of the mesh `sharding` means on `devices` chips, or a ShardingError saying why not."""
    sharding = check_sharding(sharding)
    if sharding == "data":
        return devices, 1
    if sharding == "fsdp":
        return 1, devices
    data, fsdp = (int(v) for v in sharding.split("x"))
    if data * fsdp != devices:
        divisors = [d for d in range(1, devices + 1) if devices % d == 0]
        examples = ", ".join(f"{d}x{devices // d}" for d in divisors[1:4] or divisors)
        raise ShardingError(f"sharding={sharding!r} needs {data} x {fsdp} = {data * fsdp} chips but this run has "
                            f"{devices}; use a mesh whose sizes multiply to {devices} (e.g. {examples}) or 'fsdp'")
    return data, fsdp


def is_sharded(sharding: str) -> bool:
    """Whether the parameters are split over chips (anything but pure data parallel)."""
    value = check_sharding(sharding)
    return value != "data" and not value.endswith("x1")


def check_hosts(fsdp: int, devices: int, hosts: int) -> None:
    """On a pod slice (several hosts), FSDP stays within each host's chips: its per-block all-gathers and
    reduce-scatters then run over the chips' own interconnect, while only the data-parallel gradient reduction
    crosses hosts; and fsdp spanning hosts cannot be simulated here, so it is not offered untested."""
    per_host = devices // max(1, hosts)
    if hosts > 1 and fsdp > per_host:
        raise ShardingError(f"fsdp over {fsdp} chips spans several of the {hosts} hosts ({per_host} chips each); "
                            f"use a 2-D mesh with the fsdp size at most {per_host}, e.g. "
                            f"sharding='{devices // per_host}x{per_host}' (fsdp within each host, data across hosts)")
