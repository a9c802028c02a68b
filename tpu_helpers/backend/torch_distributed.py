"""The backend's side of SHARDING under torch.distributed (torchrun on GPUs or CPU processes): placing the model
(`prepare_model`: one device, DDP, or FSDP2's `fully_shard`), whole state dicts in the plain model's format, and
the sharded checkpoints' state dicts and DCP planners. `Backend` (and so the CPU and CUDA backends) inherits
`TorchSharding`; the XLA backend overrides it with `xla_fsdp.SpmdSharding`. The SHARDING value itself is
`tpu_helpers.core.sharding`; the files of a sharded checkpoint are `tpu_helpers.checkpoint.dcp`.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.backend.units import block_classes
from tpu_helpers.core.sharding import ShardingError, check_sharding


class TorchSharding:
    """Sharding methods of `Backend`: data parallel (DDP, set up by `Backend.prepare_model`) or FSDP2."""

    @property
    def device_count(self) -> int:
        """Devices this process's program spans (XLA SPMD: every chip; here: its own device)."""
        return 1

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(data, fsdp) sizes of the SPMD mesh; (1, 1) where there is none (one device per process)."""
        return 1, 1

    def prepare_model(self, model: torch.nn.Module, sharding: str = "data", *,
                      checkpoint_blocks: bool = False) -> torch.nn.Module:
        """Put the model to be trained on this backend's devices as `sharding` asks; returns the module to call.

        One process: the model on its device. Under torchrun: "data" wraps it in DDP, "fsdp" shards it with FSDP2
        (each sharding unit of `units.block_classes` one `fully_shard`, the root holding the rest). A DxF mesh
        needs XLA's SPMD. `checkpoint_blocks` is the XLA wrapper's; here the model's own checkpointing applies.
        """
        sharding = check_sharding(sharding)
        if sharding not in ("data", "fsdp"):
            raise ShardingError(f"sharding={sharding!r}: a 2-D mesh needs an XLA SPMD run (a TPU); under torchrun "
                                "use 'fsdp' or 'data'")
        if sharding == "fsdp" and self.world_size > 1:
            from torch.distributed.fsdp import fully_shard

            model = model.to(self.device)
            blocks = block_classes(model)
            for module in list(model.modules()):
                if type(module) in blocks:
                    fully_shard(module)
            fully_shard(model)
            return model
        model = self.move_model(model)
        if self.world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def move_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this process's device, unwrapped: for frozen copies (a teacher, a reference model) and
        generation, which need no gradient all-reduce. A model already there is returned as it is: `Module.to`
        would change nothing, and torch 2.15 (not 2.9) swaps each fake parameter for a new one there, which fails
        under FakeTensorMode (the traced estimate's fake CPU model: "Cannot swap t1 because it has weakref")."""
        tensors = [*model.parameters(), *model.buffers()]
        if tensors and all(t.device == self.device for t in tensors):
            return model
        return model.to(self.device)

    def checkpoints_blocks(self, sharding: str) -> bool:
        """Whether `prepare_model` under `sharding` checkpoints each block itself (XLA's FSDP wrapper), so the
        model's own gradient checkpointing must stay off. Never here."""
        return False

    def shard_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (on the device) laid out as the loader lays out a batch: its rows split over the chips under an
        XLA SPMD mesh, for a batch made outside the loader. Here (one process per device) as it is."""
        return tensor

    def sharding_spec(self, tensor: torch.Tensor) -> str:
        """How `tensor` is split over devices ("" when it is whole here)."""
        placements = getattr(tensor, "placements", None)  # a DTensor under FSDP2
        return str(tuple(placements)) if placements is not None else ""

    def device_bytes(self, tensor: torch.Tensor) -> int:
        """Bytes of `tensor` this device holds (its shard under FSDP)."""
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    def after_load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after a checkpoint was loaded into `model` and `optimizer` (XLA FSDP re-shards what it loaded)."""

    def state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and optimizer's whole (unsharded) state dicts, in the plain format of an unwrapped model, so
        a checkpoint loads under any sharding. FSDP2 gathers them with torch.distributed.checkpoint's state_dict
        API (the optimizer's then keyed by index again, as `Optimizer.state_dict` does)."""
        if not is_fsdp2(model):
            return model.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        if "param_groups" not in optim_sd:  # ranks other than 0 get empty dicts: only rank 0 writes
            return model_sd, optim_sd
        return model_sd, index_keyed(optim_sd)

    def load_state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict,
                         optim_sd: dict) -> None:
        """Load what `state_dicts` (or an unsharded run) saved into this run's model and optimizer."""
        if not is_fsdp2(model):
            model.load_state_dict(model_sd)
            optimizer.load_state_dict(optim_sd)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        name_of = {id(p): name for name, p in model.named_parameters()}
        names = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]]
        named = {"state": {names[i]: v for i, v in optim_sd["state"].items()}, "param_groups": groups}
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=named, options=options)

    def sharded_writer(self, model: torch.nn.Module) -> str | None:
        """Which kind of sharded checkpoint `model` is saved as ("fsdp2"), or None to save it whole."""
        return "fsdp2" if is_fsdp2(model) else None

    def sharded_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """{"model": ..., "optimizer": ...} as each process holds them (DTensor shards, nothing gathered); with a
        fresh optimizer its state is created first, so the same call gives the template to load into."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def dcp_planner(self, *, save: bool) -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

        return DefaultSavePlanner() if save else DefaultLoadPlanner()

    def load_sharded_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict, *,
                             strict: bool = True) -> None:
        """Put what DCP loaded into `sharded_tensors`' template into the model and optimizer; `strict=False` when
        the template held only some of the model's weights (LoRA's adapters)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        keys = set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"],
                              options=StateDictOptions(strict=strict))
        refuse_unexpected(getattr(keys, "unexpected_keys", []))


def refuse_unexpected(keys: list[str]) -> None:
    # A weight that matched no parameter (a wrapper level the load hooks did not add back) would stay untrained.
    if keys:
        raise ValueError(f"the checkpoint's weights {sorted(keys)[:5]} match no parameter of the model")


def is_fsdp2(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


def index_keyed(optim_sd: dict) -> dict:
    """An optimizer state dict keyed by parameter name (torch.distributed's `get_state_dict` form) turned back
    into `Optimizer.state_dict`'s form, keyed by the parameter's position in the param groups."""
    groups = optim_sd.get("param_groups", [])
    if not groups or all(isinstance(p, int) for g in groups for p in g["params"]):
        # DCP's flattening turns the state's int keys into strings ("0"); Optimizer.load_state_dict would then
        # silently drop every entry (it matches them to the int ids of the param groups).
        state = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in optim_sd.get("state", {}).items()}
        return {**optim_sd, "state": state}
    index: dict[str, int] = {}
    groups = [{**g, "params": [index.setdefault(name, len(index)) for name in g["params"]]} for g in groups]
    return {"state": {index[k]: v for k, v in optim_sd.get("state", {}).items()}, "param_groups": groups}
