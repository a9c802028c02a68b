"""FSDP over the SPMD mesh on XLA (torch_xla's FSDPv2), called through `XlaBackend.prepare_model`.

    model = backend.prepare_model(model, "2x4", checkpoint_blocks=True)   # a (data, fsdp) mesh over the 8 chips

Each block (a transformer layer, found by `tpu_helpers.backend.units.block_classes`) is wrapped by
`SpmdFullyShardedDataParallel` through torch_xla's `transformer_auto_wrap_policy`, and the root wrapper shards what
is left (embeddings, final norm, head). Parameters are sharded over the mesh's "fsdp" axis (replicated over "data");
XLA's SPMD partitioner inserts the all-gathers before each block and the reduce-scatters of the gradients. With
`checkpoint=True` each block is first wrapped by torch_xla's `checkpoint_module` (what transformers' FSDPv2 path
does), so activations are recomputed per block in the backward pass.

The optimizer state is created by the first step and comes out sharded like its parameter (the partitioner
propagates it). State dicts keep the unwrapped model's names (hooks drop FSDPv2's "_orig_module." level), so
checkpoints load under any sharding; after a load, `reshard_after_load` gives the loaded (whole) parameters and
optimizer state their FSDP sharding again.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

from tpu_helpers.backend.torch_distributed import refuse_unexpected
from tpu_helpers.backend.units import WRAPPER_LEVEL, block_classes
from tpu_helpers.core.sharding import ShardingError, check_hosts, check_sharding, is_sharded, mesh_shape


def sharding_spec(tensor: torch.Tensor) -> str:
    """XLA's sharding annotation of a device tensor, e.g. "{devices=[8,1]0,1,2,3,4,5,6,7}" for a batch split 8
    ways on its first axis; "" when it carries none (a single-device or replicated tensor)."""
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def weights_split(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of `tensors` is split over devices (FSDPv2's parameters are tiled; a data mesh's carry no
    annotation, or a replicated one)."""
    whole = (None, int(xs.ShardingType.REPLICATED))
    return any(torch_xla._XLAC._get_xla_sharding_type(t) not in whole for t in tensors)


def replicated_copy(tensor: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    """`tensor` gathered whole onto every device by a graph op, for a read to the host: torch_xla reads a sharded
    tensor by compiling a program that gathers it, anew on every read (a GRPO rollout's tokens on a data mesh: one
    compile every step). The op's program is compiled once per shape and sharding, then cached, and its replicated
    result reads with no compile; it holds the whole tensor on every device until read. A tensor not sharded, or
    not placed yet (a pending value carries no annotation until its graph runs: read after a sync), is returned as
    it is."""
    if tensor.device.type != "xla" or tensor.dim() == 0 or sharding_spec(tensor) in ("", "{replicated}"):
        return tensor
    # A new node (a clone would carry the sharding annotation, which mark_sharding refuses to change); adding a
    # zero of the same dtype keeps the dtype (bool and integers too) and folds away in the compiler.
    out = tensor.detach() + torch.zeros((), dtype=tensor.dtype, device=tensor.device)
    xs.mark_sharding(out, mesh, (None,) * tensor.dim())
    return out


def make_mesh(data: int, fsdp: int) -> xs.Mesh:
    """The device mesh: ("data",) for pure data parallel (fsdp == 1), else ("data", "fsdp")."""
    if fsdp == 1:
        return xs.Mesh(np.arange(data), (data,), ("data",))
    return xs.Mesh(np.arange(data * fsdp), (data, fsdp), ("data", "fsdp"))


def batch_axes(mesh: xs.Mesh) -> Any:
    """The mesh axes the batch dimension is split over: every device holds its own rows."""
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)  # Hugging Face ModelOutput
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)


def _shard_output(output: Any, mesh: xs.Mesh) -> None:
    # Marks the block's (or model's) activations as split by batch over all devices: this is what makes the
    # partitioner gather the weights (FSDP) instead of gathering the activations.
    tensor = _first_tensor(output)
    if tensor is None or tensor.dim() == 0:
        return
    xs.mark_sharding(tensor, mesh, (batch_axes(mesh),) + (None,) * (tensor.dim() - 1))


def shard_model(model: torch.nn.Module, mesh: xs.Mesh, blocks: set[type], *,
                checkpoint: bool = False) -> torch.nn.Module:
    """Wrap `model` (already on the XLA device) in FSDPv2 with one unit per block; returns the wrapper."""
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(blocks))
    wrapper = None
    if checkpoint:
        def wrapper(module: torch.nn.Module, *args: Any, **kwargs: Any) -> FSDPv2:
            return FSDPv2(checkpoint_module(module), *args, **kwargs)
    wrapped = FSDPv2(model, mesh=mesh, shard_output=_shard_output, auto_wrap_policy=policy,
                     auto_wrapper_callable=wrapper)
    for module in wrapped.modules():
        if isinstance(module, FSDPv2):
            module.register_state_dict_post_hook(_drop_wrapper_names)
            module.register_load_state_dict_pre_hook(_add_wrapper_names)
    return wrapped


def _drop_wrapper_names(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # State dicts keep the plain model's names ("h.0.ln_1.weight", not "h.0._orig_module.ln_1.weight"), so a
    # checkpoint saved under fsdp loads into an unwrapped model (data parallel, one chip, a GPU) and back.
    for key in [k for k in state_dict if k.startswith(prefix + WRAPPER_LEVEL)]:
        state_dict[prefix + key[len(prefix + WRAPPER_LEVEL):]] = state_dict.pop(key)


def _add_wrapper_names(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + WRAPPER_LEVEL)]:
        state_dict[prefix + WRAPPER_LEVEL + key[len(prefix):]] = state_dict.pop(key)


def reshard_after_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: xs.Mesh) -> None:
    """Restore FSDPv2's sharding on parameters and optimizer state that a checkpoint load replaced with
    unsharded copies, so the resumed run holds 1/N per chip and runs the same compiled step as before."""
    for param in model.parameters():
        if param.dim() > 0 and not sharding_spec(param):
            xs.mark_sharding(param, mesh, _prepare_spmd_partition_spec(param, shard_maximal=True))
    shard_optimizer_state(optimizer, mesh)


def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh: xs.Mesh) -> None:
    """Give each per-parameter optimizer tensor (Adam's moments) its parameter's sharding (FSDPv2's rule)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not sharding_spec(param):
                continue
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0 and \
                        not sharding_spec(value):
                    xs.mark_sharding(value, mesh, _prepare_spmd_partition_spec(value, shard_maximal=True))


def dcp_planner(*, save: bool) -> Any:
    """torch_xla's planners for torch.distributed.checkpoint: each device's shard is written (and read back into
    any other sharding) one tensor at a time, with no gather and no compiled program."""
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

    return SPMDSavePlanner() if save else SPMDLoadPlanner()


def prime_optimizer(optimizer: torch.optim.Optimizer, mesh: xs.Mesh) -> None:
    """Create the optimizer's state (sharded like the parameters) before a checkpoint is loaded into it in place:
    torch_xla's `prime_optimizer` (one step on zero gradients; the load overwrites what it changed)."""
    from torch_xla.experimental.distributed_checkpoint import prime_optimizer as _prime

    _prime(optimizer)
    shard_optimizer_state(optimizer, mesh)


def shard_shape(shape: tuple[int, ...], spec: str) -> tuple[int, ...]:
    """The shape of one device's shard under XLA's sharding annotation `spec` (read from the annotation, so no
    device data is touched): "{devices=[8,1]0,...}" splits the first axis 8 ways; "last_tile_dim_replicate" means
    the last tile count is a replication factor (a 2-D mesh: sharded over fsdp, replicated over data)."""
    match = re.search(r"devices=\[([\d,]+)\]", spec or "")
    if not match:
        return tuple(shape)
    tiles = [int(t) for t in match.group(1).split(",")]
    if "last_tile_dim_replicate" in spec or len(tiles) > len(shape):
        tiles = tiles[:len(shape)]
    return tuple(-(-dim // tile) for dim, tile in zip(shape, tiles, strict=True))


def device_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor` that one device holds (its shard; the whole tensor when replicated)."""
    spec = sharding_spec(tensor) if tensor.device.type == "xla" else ""
    return math.prod(shard_shape(tuple(tensor.shape), spec)) * tensor.element_size()


class SpmdSharding:
    """The XLA backend's side of SHARDING (`XlaBackend` inherits it): the mesh over the chips, FSDPv2, and the
    sharded checkpoints' state dicts and DCP planners. Uses the backend's `spmd` and `mesh`."""

    @property
    def device_count(self) -> int:
        """Devices this process's program spans: every chip under SPMD, else its own one."""
        return int(xr.global_runtime_device_count()) if self.spmd else 1

    def set_mesh(self, data: int, fsdp: int = 1) -> None:
        """Lay the chips out as a (data, fsdp) mesh; batches are split over all of them."""
        if not self.spmd:
            if data * fsdp != 1:
                raise ValueError(f"a {data}x{fsdp} mesh needs SPMD (spmd=True or 'auto'); this process drives one "
                                 "device")
            return
        self.mesh = make_mesh(data, fsdp)
        # Each host's loader yields only its own chips' rows (Trainer.loader_batch_size): minibatch=True tells
        # torch_xla that a batch is this host's part of the global one. Without it, on a pod every host's rows
        # would be taken as the whole global batch. On one host both mean the same, so single-host runs (and the
        # tests on simulated chips) go through the pod path.
        self._input_sharding = xs.ShardingSpec(self.mesh, (batch_axes(self.mesh), None), minibatch=True)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(data, fsdp) sizes of the current mesh; (1, 1) without SPMD."""
        if self.mesh is None:
            return 1, 1
        shape = tuple(self.mesh.mesh_shape)
        return (shape[0], 1) if len(shape) == 1 else (shape[0], shape[1])

    def prepare_model(self, model: torch.nn.Module, sharding: str = "data", *,
                      checkpoint_blocks: bool = False) -> torch.nn.Module:
        """Lay the chips out as the (data, fsdp) mesh `sharding` means, move the model there and, with an fsdp axis
        over several chips, wrap it in FSDPv2 with one unit per sharding unit (`units.block_classes`), each also
        checkpointed when `checkpoint_blocks`. Returns the module the loop calls."""
        sharding = check_sharding(sharding)
        if is_sharded(sharding) and self.device_count == 1 and self.world_size > 1:
            raise ShardingError(f"sharding={sharding!r} on XLA runs as one SPMD program per host; this run has one "
                                "process per chip (spmd=False): use spmd='auto' (or True), or sharding='data'")
        data, fsdp = mesh_shape(sharding, self.device_count)
        check_hosts(fsdp, self.device_count, self.world_size)
        self.set_mesh(data, fsdp)
        model = self.move_model(model)
        if fsdp == 1:
            return model
        return shard_model(model, self.mesh, block_classes(model), checkpoint=checkpoint_blocks)

    def checkpoints_blocks(self, sharding: str) -> bool:
        # The FSDPv2 wrapper checkpoints per block only where it wraps: an fsdp axis over more than one chip
        # ("fsdp" on a single chip runs unwrapped, and the model checkpoints by itself).
        return is_sharded(sharding) and mesh_shape(sharding, self.device_count)[1] > 1

    def shard_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            xs.mark_sharding(tensor, self.mesh, (batch_axes(self.mesh),) + (None,) * (tensor.dim() - 1))
        return tensor

    def sharding_spec(self, tensor: torch.Tensor) -> str:
        return sharding_spec(tensor) if tensor.device.type == "xla" else ""

    def device_bytes(self, tensor: torch.Tensor) -> int:
        return device_bytes(tensor)

    def after_load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.mesh is not None and self.mesh_shape[1] > 1:
            reshard_after_load(model, optimizer, self.mesh)

    def sharded_writer(self, model: torch.nn.Module) -> str | None:
        # Sharded over several chips: DCP with torch_xla's SPMD planners, each host writing the shards its chips
        # hold (on a pod the hosts agree through the gloo group that `barrier` starts, before DCP is called).
        return "xla-spmd" if self.mesh is not None and self.mesh_shape[1] > 1 else None

    def sharded_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not optimizer.state:  # a resume: DCP loads in place, so the (sharded) optimizer state must exist
            prime_optimizer(optimizer, self.mesh)
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def dcp_planner(self, *, save: bool) -> Any:
        return dcp_planner(save=save)

    def load_sharded_tensors(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict, *,
                             strict: bool = True) -> None:
        refuse_unexpected(model.load_state_dict(loaded["model"], strict=strict).unexpected_keys)
        optimizer.load_state_dict(loaded["optimizer"])
