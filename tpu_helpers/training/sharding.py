"""How a model is spread over the chips: the SHARDING choice, the mesh it means, and the sharding unit (the block).

    from tpu_helpers.training.sharding import prepare_model, mesh_shape
    mesh_shape("2x4", 8)              # (2, 4): 2-way data parallel x 4-way FSDP
    model = prepare_model(backend, model, config)   # what the Trainer does

SHARDING values (`TrainConfig.sharding`):
- "data": every chip holds the whole model, optimizer state and gradients; the batch is split (today's default).
- "fsdp": parameters, gradients and optimizer state are sharded over all chips and gathered one block at a time
  (torch_xla's FSDPv2 over the SPMD mesh on TPUs; torch.distributed's FSDP2 `fully_shard` under torchrun).
- "DxF", e.g. "2x4": a 2-D (data, fsdp) mesh: D groups of F chips; each group shards the model F ways, the batch
  is split over all D x F chips. D x F must be the number of chips. (XLA only; torchrun takes "data" or "fsdp".)

The sharding unit is the model's own layer class: a Hugging Face model names it in `_no_split_modules`
(e.g. "Qwen2DecoderLayer"); otherwise the repeated module of the model's largest `nn.ModuleList` (the GPT's
`Block`). Each unit is gathered, run and freed in turn, so per-chip memory holds one block's full weights at a time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # config imports this module and must import without torch
    import torch

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
    return check_sharding(sharding) != "data" and not check_sharding(sharding).endswith("x1")


def block_classes(model: torch.nn.Module) -> set[type]:
    """The model's sharding units: the classes `_no_split_modules` names, else the repeated layer of its largest
    ModuleList. Raises ShardingError when there is neither (wrap such a model's layers in an nn.ModuleList)."""
    names = _no_split_names(model)
    if names:
        found = {type(m) for m in model.modules() if type(m).__name__ in names}
        if found:
            return found
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    lists.sort(key=lambda m: sum(p.numel() for p in m.parameters()), reverse=True)
    for layers in lists:
        kinds = {type(layer) for layer in layers}
        if len(kinds) == 1 and any(True for _ in layers[0].parameters()):
            return kinds
    raise ShardingError(
        f"cannot find the repeated layer of {type(model).__name__} to shard: it has no _no_split_modules and no "
        "nn.ModuleList of identical layers; set model._no_split_modules = ['MyLayerClass'] or use sharding='data'"
    )


def model_class_name(model: torch.nn.Module) -> str:
    """The model's own class name, also once FSDP2's `fully_shard` swapped its class for "FSDP<Name>"."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.distributed"):  # FSDP<Name> and FSDPModule live there
            return cls.__name__
    return type(model).__name__


def _no_split_names(model: torch.nn.Module) -> set[str]:
    # PEFT and other wrappers hold the Hugging Face model a few attributes down; any module may carry the names.
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(type(module), "_no_split_modules", None) or ())
    return names


def checkpoints_blocks(config: Any, backend: Any) -> bool:
    """Whether gradient checkpointing is applied per block by the sharding wrapper (XLA FSDP) rather than by the
    model's own `set_gradient_checkpointing`: only when `prepare_model` will wrap the model, i.e. the fsdp axis
    of the mesh spans more than one chip ("fsdp" on a single chip runs unwrapped and checkpoints by itself)."""
    if not (config.gradient_checkpointing and backend.is_xla and is_sharded(config.sharding)):
        return False
    return mesh_shape(config.sharding, backend.device_count)[1] > 1


def check_hosts(fsdp: int, devices: int, hosts: int) -> None:
    """On a pod slice (several hosts), FSDP stays within each host's chips: its per-block all-gathers and
    reduce-scatters then run over the chips' own interconnect, while only the data-parallel gradient reduction
    crosses hosts; and fsdp spanning hosts cannot be simulated here, so it is not offered untested."""
    per_host = devices // max(1, hosts)
    if hosts > 1 and fsdp > per_host:
        raise ShardingError(f"fsdp over {fsdp} chips spans several of the {hosts} hosts ({per_host} chips each); "
                            f"use a 2-D mesh with the fsdp size at most {per_host}, e.g. "
                            f"sharding='{devices // per_host}x{per_host}' (fsdp within each host, data across hosts)")


def prepare_model(backend: Any, model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Put `model` on the backend's devices as `config.sharding` asks; returns the module the loop calls."""
    sharding = check_sharding(config.sharding)
    if backend.is_xla and is_sharded(sharding) and backend.device_count == 1 and backend.world_size > 1:
        raise ShardingError(f"sharding={sharding!r} on XLA runs as one SPMD program per host; this run has one "
                            "process per chip (spmd=False): use spmd='auto' (or True), or sharding='data'")
    if backend.is_xla:
        data, fsdp = mesh_shape(sharding, backend.device_count)
        check_hosts(fsdp, backend.device_count, backend.world_size)
        backend.set_mesh(data, fsdp)
        model = backend.prepare_model(model)
        if fsdp == 1:
            return model
        return backend.shard_model(model, block_classes(model), checkpoint=checkpoints_blocks(config, backend))
    if sharding not in ("data", "fsdp"):
        raise ShardingError(f"sharding={sharding!r}: a 2-D mesh needs an XLA SPMD run (a TPU); under torchrun "
                            "use 'fsdp' or 'data'")
    if sharding == "fsdp" and backend.world_size > 1:
        return backend.shard_model(model, block_classes(model), checkpoint=False)
    return backend.prepare_model(model)


_WRAPPED = "_orig_module."  # the level FSDPv2 (and XLA FSDP) add to module names


def plain_name(name: str) -> str:
    """A parameter or module name without the wrapper levels FSDPv2 adds ("h.0._orig_module.ln_1.weight" ->
    "h.0.ln_1.weight"): the name state dicts use (sharding_xla's hooks drop the same level)."""
    return name.replace(_WRAPPED, "")


def trainable_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of `model`'s trainable parameters (plain names, also under FSDPv2's wrappers)."""
    return {plain_name(n) for n, p in model.named_parameters() if p.requires_grad}


def adapter_state_dict(model: torch.nn.Module, adapter_name: str = "default") -> dict:
    """The PEFT (LoRA) adapter weights of `model` with peft's own key names, also when FSDP wrapped its layers.

    peft finds the adapter by the tuner layers' module names; the FSDP wrappers add a level to those names while
    the state dict keeps the plain ones (so checkpoints load under any sharding), and peft then silently returns
    an empty adapter (the missing-adapter-keys failure also seen with the HF Trainer under FSDP). So the state
    dict is handed to peft under the wrapped names and the result renamed back.
    """
    from peft import get_peft_model_state_dict

    plain = model.state_dict()
    wrapped = {}
    for name in [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]:
        key = plain_name(name)
        if key in plain:
            wrapped[name] = plain[key]
    adapter = get_peft_model_state_dict(model, state_dict=wrapped, adapter_name=adapter_name)
    return {plain_name(k): v for k, v in adapter.items()}
