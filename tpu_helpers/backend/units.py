"""What sharding needs to know about a model, with no device involved: its repeated layer (the sharding unit), its
own class name under FSDP2, and its parameter names without the levels the FSDP wrappers add.

    from tpu_helpers.backend.units import block_classes, plain_name, trainable_names
    block_classes(model)                  # {Qwen2DecoderLayer} (from _no_split_modules) or {Block} (the GPT)
    plain_name("h.0._orig_module.ln_1.weight")   # "h.0.ln_1.weight": the name state dicts use

The sharding unit is the model's own layer class: a Hugging Face model names it in `_no_split_modules`
(e.g. "Qwen2DecoderLayer"); otherwise the repeated module of the model's largest `nn.ModuleList` (the GPT's
`Block`). Each unit is gathered, run and freed in turn, so per-chip memory holds one block's full weights at a
time. The memory plans count one unit as what FSDP gathers. Imports torch only (not torch_xla).
"""

from __future__ import annotations

import torch

from tpu_helpers.core.sharding import ShardingError

# The level FSDPv2 (torch_xla's SPMD FSDP, and XLA FSDP) adds to module names; state dicts leave it out.
WRAPPER_LEVEL = "_orig_module."


def block_classes(model: torch.nn.Module) -> set[type]:
    """The model's sharding units: the classes `_no_split_modules` names, else the repeated layer of its largest
    ModuleList. Raises ShardingError when there is neither (wrap such a model's layers in an nn.ModuleList)."""
    names = _no_split_names(model)
    if names:
        found = {type(m) for m in model.modules() if type(m).__name__ in names}
        if found:
            return found
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


def block_params(model: torch.nn.Module) -> int:
    """Parameters of the model's largest sharding unit (one decoder layer: what FSDP gathers at a time)."""
    kinds = block_classes(model)
    return max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m) in kinds), default=0)


def _no_split_names(model: torch.nn.Module) -> set[str]:
    # PEFT and other wrappers hold the Hugging Face model a few attributes down; any module may carry the names.
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(type(module), "_no_split_modules", None) or ())
    return names


def model_class_name(model: torch.nn.Module) -> str:
    """The model's own class name, also once FSDP2's `fully_shard` swapped its class for "FSDP<Name>"."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch.distributed"):  # FSDP<Name> and FSDPModule live there
            return cls.__name__
    return type(model).__name__


def plain_name(name: str) -> str:
    """A parameter or module name without the wrapper levels FSDPv2 adds ("h.0._orig_module.ln_1.weight" ->
    "h.0.ln_1.weight"): the name state dicts use (the XLA sharding's state-dict hooks drop the same level)."""
    return name.replace(WRAPPER_LEVEL, "")


def trainable_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of `model`'s trainable parameters (plain names, also under FSDPv2's wrappers)."""
    return {plain_name(n) for n, p in model.named_parameters() if p.requires_grad}
